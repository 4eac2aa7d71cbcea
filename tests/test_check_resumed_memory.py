"""``edgekv-camera --check`` judges the memory the start really resumes, read from the snapshot's manifest (no
tensor). With ``video.resolution`` null a restored session keeps the grid of its memory, whatever size the camera's
frames are now: the check judged the budget on the grid of the frame it read, and failed a config the daemon starts
(the memory of a 160x120 camera, a 1280x720 one now) and passed one whose first pair then crashed the daemon (a text
reserve that fits the new frames' grid but not the memory's). A memory saved with a frame waiting for its partner has
that frame in every snapshot: the start sizes ``state.max_mib`` with it, the check did not. Snapshots here are made by
a short session run, as the daemon's."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from helpers_check import check_config, run_check

import edgekv
from edgekv.config import load_config

SMALL = "synthetic:shapes?size=160x120&fps=8&frames=1000"  # its grid: 112x168, 24 tokens a pair
LARGE = "synthetic:shapes?size=1280x720&fps=8&frames=1000"  # 728x1288: 1196 tokens a pair, past the 400 cap
TINY = "synthetic:shapes?size=56x56&fps=8&frames=1000"  # 56x56: 4 tokens a pair


def _config(tmp_path: Path, model: Path, source: str, **sections) -> Path:
    video = {"source": source, "resolution": None, **sections.pop("video", {})}
    state = {"dir": str(tmp_path / "state"), **sections.pop("state", {})}
    return check_config(tmp_path, model, video=video, state=state, engines={"engine_dir": str(tmp_path / "engines")},
                        **sections)


def _saved_memory(tmp_path: Path, model: Path, frames: int = 6, size: tuple[int, int] = (120, 160),
                  **sections) -> None:
    """The memory of a 160x120 camera (``size``: height, width) seen with ``video.resolution`` null (``sections``:
    over it), saved as the daemon saves it."""
    runtime = edgekv.Runtime.from_config(load_config(str(_config(tmp_path, model, SMALL, **sections))))
    session = runtime.session()
    for index in range(frames):
        session.ingest(np.random.default_rng(index).integers(0, 256, (*size, 3), dtype=np.uint8), t=index / 4)
    if frames and not sections:
        assert session.preprocessor.resolution == (112, 168)
    (tmp_path / "state").mkdir(exist_ok=True)
    session.save(tmp_path / "state" / "snapshot-00000001.ekv")


def _started_grid(path: Path) -> tuple[int, int] | None:
    """The grid of the session the daemon's start builds from ``state.dir`` (``StateKeeper.restore``)."""
    from edgekv.state import StateKeeper

    config = load_config(str(path))
    session = StateKeeper(config.state, say=lambda _: None).restore(edgekv.Runtime.from_config(config))
    try:
        return None if session.preprocessor is None else tuple(session.preprocessor.resolution)
    finally:
        session.close()


def test_the_budget_is_the_resumed_memorys_grid_not_the_new_cameras(tiny_checkpoint, tmp_path, capsys):
    _saved_memory(tmp_path, tiny_checkpoint)
    path = _config(tmp_path, tiny_checkpoint, LARGE)
    code, results = run_check(path, capsys)
    assert code == 0, results  # the 1280x720 grid would not fit: the start never uses it
    status, detail = results["cache budget"]
    assert status == "ok" and "frame pairs of 24 tokens (168x112)" in detail, detail
    assert "168x112 is the grid of the memory resumed from snapshot-00000001.ekv" in detail
    assert "the camera's 1280x720 frames are scaled to it" in detail
    assert results["state.dir memory"][0] == "ok" and "resumes snapshot-00000001.ekv" in results["state.dir memory"][1]
    assert _started_grid(path) == (112, 168)  # what the start does, as said


def test_a_budget_the_resumed_grid_does_not_fit_fails_though_the_new_frames_would(tiny_checkpoint, tmp_path,
                                                                                 capsys):
    """15 prefix + 2 x 24 + 350 > 400 at the memory's grid; at the 56x56 frames' grid (4 tokens a pair) it fits. The
    check passed it, and the restarted daemon resumed the memory and died at its first pair ("policy 'infinipot_v'
    left 37 slots; 24 do not fit")."""
    _saved_memory(tmp_path, tiny_checkpoint)
    path = _config(tmp_path, tiny_checkpoint, TINY, cache={"text_reserve_tokens": 350})
    code, results = run_check(path, capsys)
    assert code == 2, results
    status, detail = results["cache budget"]
    assert status == "FAIL" and "two frame pairs (24 tokens each at (112, 168))" in detail, detail
    assert "the minimum is 413" in detail and "resumed from snapshot-00000001.ekv" in detail
    assert "the camera's 56x56 frames are scaled to it" in detail
    from edgekv.cache import CapTooSmallError

    with pytest.raises(CapTooSmallError, match=r"snapshot-00000001.ekv: its memory was seen at \(112, 168\).*the "
                       r"minimum is 413.*move the snapshot out"):  # the start refuses, as said: it took that grid and
        _started_grid(path)  # its first pair died mid-stream ("policy 'infinipot_v' left 37 slots; 24 do not fit")


def test_memory_saved_before_its_first_frame_leaves_the_grid_to_the_first_frame(tiny_checkpoint, tmp_path, capsys):
    _saved_memory(tmp_path, tiny_checkpoint, frames=0)
    code, results = run_check(_config(tmp_path, tiny_checkpoint, LARGE), capsys)
    assert code == 2 and results["state.dir memory"][0] == "ok", results  # resumed, with no grid of its own
    status, detail = results["cache budget"]
    assert status == "FAIL" and "1196 tokens each at (728, 1288)" in detail and "resumed" not in detail, detail


@pytest.mark.parametrize("resolution", [[112, 112], [112, 168]])
def test_a_grid_the_config_sets_is_the_budgets_and_another_sets_the_memory_aside(tiny_checkpoint, tmp_path, capsys,
                                                                                 resolution):
    """``video.resolution`` set: the start's grid whatever the memory's; another than the memory's sets it aside
    (said, with both grids), the same resumes it."""
    _saved_memory(tmp_path, tiny_checkpoint)
    path = _config(tmp_path, tiny_checkpoint, LARGE, video={"resolution": resolution})
    code, results = run_check(path, capsys)
    assert code == 0, results
    height, width = resolution
    status, detail = results["cache budget"]
    assert status == "ok" and f"({width}x{height})" in detail and "resumed" not in detail, detail
    status, detail = results["state.dir memory"]
    if resolution == [112, 168]:
        assert status == "ok" and "resumes snapshot-00000001.ekv" in detail, detail
    else:
        assert status == "note" and "SET ASIDE" in detail, detail
        assert "frame grid in pixels (video.resolution): snapshot has [112, 168], this deployment [112, 112]" in detail
    assert _started_grid(path) == tuple(resolution)


def test_the_flash_figure_is_the_grids_the_start_takes(tiny_checkpoint, tmp_path, capsys):
    """``video.resolution`` null: the memory's writes a day were figured at 448x448 (256 tokens a frame pair) whatever
    the memory's grid; they are the resumed grid's (112x168: 24), or the first frame's."""
    from edgekv.calibration.plan import flash_lines

    def per_day(tokens: int) -> str:
        line = next(line for line in flash_lines(load_config(str(path)), tiny_checkpoint, tokens)
                    if line.startswith("writes to flash"))
        return f"about {line.rsplit('; ', 1)[-1].split(' GB')[0]} GB a day"

    _saved_memory(tmp_path, tiny_checkpoint)
    path = _config(tmp_path, tiny_checkpoint, LARGE)
    code, results = run_check(path, capsys)
    assert code == 0 and per_day(4 * 6) in results["flash"][1], (per_day(24), results["flash"])
    (tmp_path / "state" / "snapshot-00000001.ekv").unlink()  # no memory: the first frame's grid, 56x56
    path = _config(tmp_path, tiny_checkpoint, TINY)
    code, results = run_check(path, capsys)
    assert code == 0 and per_day(2 * 2) in results["flash"][1], (per_day(4), results["flash"])


def test_a_frame_waiting_for_its_partner_in_the_resumed_memory_counts_in_state_max_mib(tiny_checkpoint, tmp_path,
                                                                                     capsys):
    """A snapshot taken between a pair's two frames holds the first, as the camera gave it (640x480: 0.88 MiB); the
    start sizes two snapshots with it and refused ``state.max_mib: 2`` — which the check had passed for the cache
    alone (0.39 MiB a snapshot)."""
    from edgekv.state import StateKeeper

    _saved_memory(tmp_path, tiny_checkpoint, frames=5, size=(480, 640), video={"resolution": [112, 112]})
    path = _config(tmp_path, tiny_checkpoint, SMALL, video={"resolution": [112, 112]}, state={"max_mib": 2})
    config = load_config(str(path))
    with pytest.raises(ValueError) as refused:  # what the start does
        StateKeeper(config.state, say=lambda _: None).restore(edgekv.Runtime.from_config(config))
    code, results = run_check(path, capsys)
    assert code == 2, results
    status, detail = results["state.max_mib"]
    assert status == "FAIL" and detail.startswith(str(refused.value)), (detail, str(refused.value))
    assert "the frame waiting for its partner in snapshot-00000001.ekv (0.88 MiB)" in detail
    code, results = run_check(_config(tmp_path, tiny_checkpoint, SMALL, video={"resolution": [112, 112]},
                                      state={"max_mib": 3}), capsys)
    assert code == 0 and "with the frame waiting for its partner" in results["state.max_mib"][1], results
