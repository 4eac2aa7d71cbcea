"""``edgekv-camera --check`` says what the start will do with the memory saved under ``state.dir``: resume it, or set
it aside because the config no longer fits it — the cap, the cameras or their weights (each camera's cap is its
share), the model, the prompt — naming the camera, the field that changed and where the memory goes. A config that
changed the cameras' weights set every camera's memory aside at the restart, and ``--check`` had passed it without a
word. What it predicts is what the start then does."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml

import edgekv
from edgekv.apps.daemon.camera import main
from edgekv.apps.daemon.cameras import camera_configs
from edgekv.config import load_config
from edgekv.state import StateKeeper, deployment_key, estimate_bytes, planned_full_bytes, planned_key


def _frame(index: int) -> np.ndarray:
    return np.random.default_rng(index).integers(0, 256, size=(120, 160, 3), dtype=np.uint8)


def _write(tmp_path: Path, name: str, checkpoint: Path, **sections) -> Path:
    data = {
        "model": {"path": str(checkpoint), "dtype": "fp32", "device": "cpu"},
        "video": {"source": "synthetic:shapes?size=160x120&fps=8&frames=1000", "fps": 4.0, "resolution": [56, 84]},
        "cache": {"policy": "infinipot_v", "max_tokens": 400, "text_reserve_tokens": 96},
        "server": {"enabled": False},
        "monitor": {"backend": "cpu"},
        "state": {"dir": str(tmp_path / "state")},
        "engines": {"engine_dir": str(tmp_path / "engines")},
    }
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return path


def _remember(config, start: int = 0, stop: int = 6) -> Path:
    """A snapshot of ``config``'s memory under its state.dir (frames ``start`` to ``stop`` added to what it resumed),
    made as the daemon makes it."""
    keeper = StateKeeper(config.state, say=lambda line: None)
    session = keeper.restore(edgekv.Runtime.from_config(config))
    for index in range(start, stop):
        session.ingest(_frame(index), t=index / 4.0)
    return keeper.snapshot(session).path


def _memory_lines(path: Path, capsys) -> list[str]:
    assert main(["--config", str(path), "--check"]) == 0
    return [line for line in capsys.readouterr().out.splitlines() if "state.dir memory:" in line]


def test_check_says_the_memory_is_resumed_or_set_aside_and_the_start_does_so(tiny_checkpoint, tmp_path, capsys):
    kept = _write(tmp_path, "deploy.yaml", tiny_checkpoint)
    older = _remember(load_config(kept), 0, 4)
    newest = _remember(load_config(kept), 4, 10)
    (line,) = _memory_lines(kept, capsys)
    assert line.startswith(f"ok    state.dir memory: resumes {newest.name} (")
    assert "10 frames" in line

    changed = _write(tmp_path, "smaller.yaml", tiny_checkpoint, cache={"max_tokens": 300})
    (line,) = _memory_lines(changed, capsys)
    assert line.startswith("note  state.dir memory: the memory will be SET ASIDE and the start begins with an empty "
                           f"memory: {newest.name} (")
    assert ("cache capacity M in tokens (cache.max_tokens / cache.max_mib): snapshot has 400, this deployment 300"
            in line)
    aside = tmp_path / "state" / "set-aside" / newest.name
    assert f"kept (not deleted) as {aside}, until new snapshots or the kept alerts need its room" in line
    assert line.endswith(f"The older generation {older.name} is deleted")
    assert newest.is_file() and older.is_file() and not aside.exists()  # the check moved nothing

    said: list[str] = []
    config = load_config(changed)
    fresh = StateKeeper(config.state, say=said.append).restore(edgekv.Runtime.from_config(config))
    assert fresh.counters.frames == 0 and said[0].startswith("starting with an empty memory")
    assert aside.is_file() and not older.exists()  # as the check said
    said.clear()  # and again, before that start wrote a snapshot: set-aside/ is no camera's folder
    StateKeeper(config.state, say=said.append).restore(edgekv.Runtime.from_config(config))
    assert said == [f"no snapshot in {tmp_path / 'state'}: starting with an empty memory"] and aside.is_file()

    # The config put back before the changed one wrote a snapshot (killed, powered off): the memory set aside is
    # resumed. That start said "no snapshot" (and named set-aside/ as a camera's folder) and began empty.
    (line,) = _memory_lines(kept, capsys)
    assert line.startswith("ok    state.dir memory: resumes the memory set aside earlier for this deployment, "
                           f"{newest.name} (")
    said.clear()
    config = load_config(kept)
    resumed = StateKeeper(config.state, say=said.append).restore(edgekv.Runtime.from_config(config))
    assert resumed.counters.frames == 10 and "from the snapshot set aside earlier" in said[0], said
    assert not list((tmp_path / "state" / "set-aside").iterdir())


def test_check_names_each_camera_whose_memory_a_changed_weight_sets_aside(tiny_checkpoint, tmp_path, capsys):
    cameras = [{"name": "front", "source": "synthetic:shapes?size=160x120&fps=8&frames=1000"},
               {"name": "back", "source": "synthetic:shapes?size=160x120&fps=8&frames=1000"}]
    two = _write(tmp_path, "two.yaml", tiny_checkpoint, video={"sources": cameras}, cache={"max_tokens": 800})
    for one in camera_configs(load_config(two)).values():
        _remember(one)
    lines = _memory_lines(two, capsys)
    assert [line.split("  ", 1)[0] for line in lines] == ["[front] ok", "[back] ok"]

    heavier = [cameras[0], {**cameras[1], "weight": 3}]
    weighted = _write(tmp_path, "weighted.yaml", tiny_checkpoint, video={"sources": heavier},
                      cache={"max_tokens": 800})
    front, back = _memory_lines(weighted, capsys)
    assert front.startswith("[front] note  state.dir memory: the memory will be SET ASIDE")
    assert "snapshot has 400, this deployment 200" in front and "snapshot has 400, this deployment 600" in back
    assert str(tmp_path / "state" / "front" / "set-aside") in front
    assert ("With video.sources each camera's cache is its weight's share of cache.max_tokens (800 tokens; weights now "
            "front 1, back 3; 'back' has weight 3 of 4: the cap above)") in back

    added = _write(tmp_path, "three.yaml", tiny_checkpoint, cache={"max_tokens": 800},
                   video={"sources": [*cameras, {**cameras[0], "name": "side"}]})
    lines = _memory_lines(added, capsys)
    assert [line.split(" state.dir memory: ")[0].split() for line in lines] == [
        ["[front]", "note"], ["[back]", "note"], ["[side]", "ok"]]
    assert "a camera added or removed" in lines[0] and "no snapshot in" in lines[2]


@pytest.mark.parametrize("overrides", [
    {},
    {"cache": {"max_mib": 0.7, "max_tokens": None, "kv_dtype": "int8"}},
    {"cache": {"policy": "statekv", "sinks": 8, "rebase_position": 40, "kv_dtype": "fp8"}},
    {"model": {"system_prompt": "Watch the door."}, "video": {"resolution": None}},
])
def test_the_key_and_size_read_without_the_weights_are_the_loaded_runtimes(tiny_checkpoint, tmp_path, overrides):
    """``planned_key`` and ``planned_full_bytes`` (the check's) agree with ``deployment_key`` and the size of a full
    cache's snapshot (the start's): a check that disagreed with the start would announce a set-aside that does not
    happen, or miss one that does, or pass a state.max_mib the start refuses."""
    config = load_config(_write(tmp_path, "deploy.yaml", tiny_checkpoint, **overrides))
    planned, full = planned_key(config), planned_full_bytes(config)
    assert not (tmp_path / "engines").exists()  # nothing written: the hashes' memo is the start's to write
    resolution = config.video.resolution
    runtime = edgekv.Runtime.from_config(config)
    assert planned == deployment_key(runtime, tuple(resolution) if resolution else None)
    assert full == estimate_bytes(runtime.session())
    assert (tmp_path / "engines" / "hashes.json").is_file() and planned_key(config) == planned  # from the memo too


def test_check_fails_a_state_max_mib_that_cannot_hold_two_snapshots(tiny_checkpoint, tmp_path, capsys):
    """The start refused it only once the model had loaded; --check said "the daemon would start"."""
    path = _write(tmp_path, "deploy.yaml", tiny_checkpoint, state={"dir": str(tmp_path / "state"), "max_mib": 0.1})
    assert main(["--config", str(path), "--check"]) == 2
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "state.max_mib:" in line]
    assert line.startswith("FAIL  state.max_mib: state.max_mib=0.1 cannot hold two snapshots of a full cache (")
    least = float(re.search(r"raise state.max_mib to at least ([\d.]+)", line).group(1))
    path = _write(tmp_path, "deploy.yaml", tiny_checkpoint, state={"dir": str(tmp_path / "state"), "max_mib": least})
    assert main(["--config", str(path), "--check"]) == 0  # the figure it names is enough, for the start too
    assert "ok    state.max_mib: two snapshots of a full cache" in capsys.readouterr().out
    config = load_config(path)
    StateKeeper(config.state, say=lambda line: None).restore(edgekv.Runtime.from_config(config))
