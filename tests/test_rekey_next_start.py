"""``edgekv rekey`` says, last, when the config it was given will not resume the memory it just re-sealed: an archive
indexed with another ``archive.index_keys`` (the start refuses it) or snapshots made for another cap (the start sets
them aside), with the key to change. It re-sealed such an archive, said "done", and the next start refused it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers_archive import SHAPE, fill
from helpers_privacy import privacy_runtime, seen_session

pytest.importorskip("cryptography", reason="cryptography not installed (pip install 'edgekv[privacy]')")

from edgekv.apps.cli import main  # noqa: E402
from edgekv.apps.daemon.startup import StartupError, check_archive_shape  # noqa: E402
from edgekv.archive.store import FrameArchive  # noqa: E402
from edgekv.config import load_config  # noqa: E402


def _deployment(tmp_path: Path, **sections) -> Path:
    key = tmp_path / "new.key"
    key.write_bytes(bytes([2]) * 32)
    key.chmod(0o400)
    data = {"privacy": {"key_file": str(key)}, **sections}
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_rekey_says_the_next_start_refuses_an_archive_of_other_index_keys(tmp_path, capsys):
    folder = tmp_path / "archive"
    archive = FrameArchive(folder, SHAPE, max_bytes=1 << 20, segment_bytes=4 << 10)  # index_keys=1: the first format
    fill(archive, range(4))
    archive.close()
    section = {"dir": str(folder), "max_gib": 0.01, "segment_mib": 1}
    config = _deployment(tmp_path, archive=section)  # archive.index_keys: 2, the default now
    assert main(["rekey", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "segment(s) re-sealed" in out[1] and "privacy.previous_key_files can be emptied" in out[2]
    assert out[3] == ("the config and the memory disagree: the next start will not resume the memory as it is "
                      f"(edgekv-camera --config {config} --check says the same before a start):")
    assert out[4] == (f"  archive.dir: {folder} was indexed with archive.index_keys=1, this config has 2: the start "
                      "refuses it. Set archive.index_keys: 1 in the config to go on with this archive, or point "
                      "archive.dir at an empty folder to begin one indexed with 2 (this one is never read then: move "
                      "it aside or remove it)")
    # the start's own check says it with no model to read (rekey's configs name none): it compared nothing then
    with pytest.raises(StartupError, match="index_keys=1, this config has 2"):
        check_archive_shape(load_config(config))

    config = _deployment(tmp_path, archive={**section, "index_keys": 1})  # as the message says
    assert main(["rekey", "--config", str(config), "--dry-run"]) == 0
    assert "disagree" not in capsys.readouterr().out
    check_archive_shape(load_config(config))


def test_rekey_says_the_next_start_sets_aside_snapshots_of_another_cap(tiny_checkpoint, tmp_path, capsys):
    state = tmp_path / "state"
    state.mkdir()
    seen_session(privacy_runtime(tiny_checkpoint)).save(state / "snapshot-00000001.ekv")  # max_tokens 120
    sections = {"model": {"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
                "video": {"resolution": [56, 84], "fps": 2.0}, "state": {"dir": str(state)},
                "cache": {"policy": "infinipot_v", "max_tokens": 200, "text_reserve_tokens": 40}}
    config = _deployment(tmp_path, **sections)
    assert main(["rekey", "--config", str(config)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-2].startswith("the config and the memory disagree")
    assert out[-1].startswith(f"  state.dir {state}: the memory will be SET ASIDE and the start begins with an empty "
                              "memory: snapshot-00000001.ekv (")
    assert "snapshot has 120, this deployment 200" in out[-1]

    config = _deployment(tmp_path, **{**sections, "cache": {**sections["cache"], "max_tokens": 120}})
    assert main(["rekey", "--config", str(config)]) == 0
    assert "disagree" not in capsys.readouterr().out
