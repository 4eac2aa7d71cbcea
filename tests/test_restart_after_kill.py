"""A daemon killed (``kill -9``, a power cut) between its last snapshot and its stop, with ``archive.dir``: the restart
goes on in the recording after the pairs the archive holds from that stretch, not from the snapshot's point.

Before, the stretch was read again from the snapshot's point and archived a second time under new pair numbers
(``StreamSession.number_pairs_after``): the archive held it twice and a recall could bring the same moment back
twice. The disk is taken "as the power goes": the state folder as the last snapshot left it, the archive as the
process that went on after it left it.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest

from edgekv.config import EdgeKVConfig

# 48 frames at 8 fps sampled at 4 fps: 24 frames in (12 pairs), 5 events
EVENTS = "synthetic:events?size=112x112&fps=8&frames=48&rate=0.3&seed=3"
STEP = 0.25  # s between the frames that go in (video.fps 4)


def _config(root: Path) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": EVENTS, "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        archive={"dir": str(root / "archive"), "when_full": "wait", "top_k": 1},
        server={"enabled": False}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2},
        state={"dir": str(root / "state"), "every_s": 3600})


def _run(config: EdgeKVConfig, at: int | None = None, then=None, **options):
    """A one-shot daemon run to its end (its snapshot written at the stop), ``then()`` called once the ``at``-th frame
    went in: (what it said, the daemon, the source times of the frames that went in)."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    out = io.StringIO()
    daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True, no_server=True, **options), out=out)
    went_in = []
    keep = daemon._went_in

    def noted(t: float, stream_t: float) -> None:  # under the daemon's lock
        went_in.append(t)
        keep(t, stream_t)
        if len(went_in) == at:
            then(daemon)

    daemon._went_in = noted
    assert daemon.run() == 0, out.getvalue()
    return out.getvalue(), daemon, went_in


def _killed_run(root: Path, crashed: Path, snapshot_at: int, frames: int) -> None:
    """A run of ``frames`` frames whose last snapshot was written after ``snapshot_at`` of them and which was then
    killed before its stop: the state folder as that snapshot left it, the archive with every pair of the run."""
    def snapshot(daemon) -> None:
        daemon.state.snapshot(daemon.session)
        shutil.copytree(root / "state", crashed / "state")

    _, daemon, _ = _run(_config(root), snapshot_at, snapshot, max_frames=frames, quiz=5)
    assert daemon.session.counters.frame_pairs == (frames + 1) // 2  # an odd last frame: a pair of itself
    shutil.copytree(root / "archive", crashed / "archive")


@pytest.mark.parametrize("first", [10, 9])  # 9: the snapshot holds a frame waiting for its partner
def test_a_restart_after_a_kill_goes_on_after_what_the_archive_saw(tmp_path, first):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    _, uninterrupted, _ = _run(_config(whole))
    archive = uninterrupted.session.recall.archive
    expected = sorted((e.t, e.tpos + e.t_offset) for e in archive.entries(uninterrupted.session.recall.stream))
    _killed_run(tmp_path / "ran", crashed, first, 16)
    said, daemon, went_in = _run(_config(crashed), quiz=5)
    assert went_in == [4.0 + STEP * k for k in range(8)]  # the recording's next frames after the archived ones
    assert daemon.session.stats()["clock_jumps"] == 0
    entries = daemon.session.recall.archive.entries(daemon.session.recall.stream)
    # each moment archived once, at the position (before re-basing) one uninterrupted run gave it
    assert sorted((e.t, e.tpos + e.t_offset) for e in entries) == expected
    assert len({e.frame for e in entries}) == len(entries)
    # the event shown only between the snapshot and the kill (t 3.25-3.75) was seen too
    assert sorted(daemon.quiz.seen) == [0, 1, 2, 3, 4]
    assert "pair(s) of this recording seen after the saved memory's snapshot" in said, said
    assert ("waiting for its partner was paired then" in said) == (first % 2 == 1), said
    assert "recording goes on after them, from 4 s" in said, said



@pytest.mark.parametrize("first, frames", [(10, 17), (9, 9)])  # (9, 9): the frame the snapshot held waiting
def test_a_kill_after_a_run_ended_on_an_odd_frame_goes_on_at_the_frame_after_it(tmp_path, first, frames):
    """The killed run's last frame (``--max-frames`` odd) was archived as a pair of itself at the stream's end, and the
    process was killed before the stop's snapshot: the archive's newest record is one frame. The restart goes on at the
    frame after it, not a frame interval later (the record was taken for two frames, and that frame skipped), and its
    archive is the one a run that stopped there, its memory saved, left with its restart (times, positions, frames)."""
    stopped, crashed = tmp_path / "stopped", tmp_path / "crashed"
    end = STEP * (frames - 1)  # the lone last frame's time
    _run(_config(stopped), max_frames=frames)
    _, restarted, went_on = _run(_config(stopped), quiz=5)
    assert went_on == [end + STEP * k for k in range(1, 24 - frames + 1)]
    archive = restarted.session.recall.archive
    expected = sorted((e.t, e.tpos + e.t_offset, e.frames) for e in archive.entries(restarted.session.recall.stream))
    assert [t for t, _, count in expected if count == 1] == [end, 5.75]  # each run's odd last frame
    _killed_run(tmp_path / "ran", crashed, first, frames)
    said, daemon, went_in = _run(_config(crashed), quiz=5)
    assert went_in == went_on
    entries = daemon.session.recall.archive.entries(daemon.session.recall.stream)
    assert sorted((e.t, e.tpos + e.t_offset, e.frames) for e in entries) == expected
    assert len({e.frame for e in entries}) == len(entries)
    assert sorted(daemon.quiz.seen) == [0, 1, 2, 3, 4]
    assert f"recording goes on after them, from {end + STEP:g} s" in said, said
    assert ("waiting for its partner was archived as a pair of itself then" in said) == (first == frames), said


def test_a_kill_at_an_odd_frame_with_an_archive_an_earlier_edgekv_wrote_goes_on_as_it_did(tmp_path):
    """The same kill, the archive as the edgekv before records said their frame count wrote it (every record taken for
    two frames): read whole, nothing taken for damage, and the restart goes on as it did then, a frame interval after
    the newest record's first frame (the frame at 4.25 s is not read: the archive cannot say it was not seen)."""
    from helpers_archive import earlier_layout

    crashed = tmp_path / "crashed"
    _killed_run(tmp_path / "ran", crashed, 10, 17)
    assert earlier_layout(crashed / "archive") == 1  # the lone last frame's record
    said, daemon, went_in = _run(_config(crashed), quiz=5)
    assert went_in == [4.5 + STEP * k for k in range(6)]
    archive = daemon.session.recall.archive
    assert archive.bad_records == archive.skipped_bytes == archive.torn_bytes == 0
    entries = archive.entries(daemon.session.recall.stream)
    assert [e.t for e in entries] == [0.5 * k for k in range(9)] + [4.5, 5.0, 5.5]
    assert [e.frames for e in entries] == [2] * 12 and len({e.frame for e in entries}) == len(entries)
    assert "recording goes on after them, from 4.5 s" in said, said
