"""``edgekv-camera --check`` and ``edgekv rekey`` on the archive: the start's budget check run without the weights
(an ``archive.top_k`` too large for the cap passed ``--check``, then stopped the start; now the same message, with
the ``archive.top_k`` that fits), and segments a newer edgekv wrote named (both passed over them silently; rekey
said every segment opens with the current key while those it cannot read were left as they were)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers_archive import SHAPE, fill, newer_segment
from helpers_check import check_config, run_check

from edgekv.apps.daemon.startup import one_line
from edgekv.archive.store import ARCHIVE_FORMAT, FrameArchive


def _config(tmp_path: Path, model: Path, **sections) -> Path:
    return check_config(tmp_path, model, **{"server": {"enabled": False}, **sections})


def _check(path: Path, capsys) -> tuple[int, dict[str, tuple[str, str]]]:
    return run_check(path, capsys)


def _newer_segment(path: Path) -> bytes:
    return newer_segment(path, b"EKVA" + bytes(range(256)) * 8)  # records this edgekv cannot read


def test_a_top_k_too_large_for_the_cap_fails_the_check_as_the_start_does(tiny_checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    import edgekv

    folder = tmp_path / "archive"
    path = _config(tmp_path, tiny_checkpoint, archive={"dir": str(folder), "top_k": 40})
    load = edgekv.Runtime.from_config
    monkeypatch.setattr(edgekv.Runtime, "from_config", lambda *a, **k: pytest.fail("--check loaded the model"))
    code, results = _check(path, capsys)
    monkeypatch.setattr(edgekv.Runtime, "from_config", load)
    status, detail = results["cache budget"]
    assert code == 2 and status == "FAIL", results
    assert "retrieval reserve (archive.top_k=40 pairs" in detail and "; or set archive.top_k: " in detail, detail
    with pytest.raises(ValueError) as refused:  # the start, with the model: the same words
        edgekv.Runtime.from_config(str(path)).session()
    assert one_line(refused.value) == detail
    fits = int(detail.split("; or set archive.top_k: ")[1].split(" ")[0])
    for top_k, wanted in ((fits, 0), (fits + 1, 2)):
        path = _config(tmp_path, tiny_checkpoint, archive={"dir": str(folder), "top_k": top_k})
        code, results = _check(path, capsys)
        assert code == wanted and results["cache budget"][0] == ("ok" if wanted == 0 else "FAIL"), results
        if not wanted:
            assert f"(archive.top_k={fits})" in results["cache budget"][1], results
    code, results = _check(_config(tmp_path, tiny_checkpoint), capsys)  # no archive: no reserve
    assert code == 0 and results["cache budget"][0] == "ok" and "retrieval" not in results["cache budget"][1]
    assert not list(folder.glob("seg-*"))  # nothing written


def test_the_budget_with_the_grid_of_the_first_frame_when_the_resolution_is_not_set(tiny_checkpoint, tmp_path,
                                                                                       capsys):
    path = _config(tmp_path, tiny_checkpoint, video={"resolution": None}, cache={"max_tokens": 120})
    code, results = _check(path, capsys)
    status, detail = results["cache budget"]
    assert code == 2 and status == "FAIL" and "cache.max_tokens=120 cannot hold" in detail, results
    assert "two frame pairs" in detail


def test_segments_of_a_newer_edgekv_are_a_note_of_the_check(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "archive"
    folder.mkdir()
    _newer_segment(folder / "seg-00000007.ekva")
    code, results = _check(_config(tmp_path, tiny_checkpoint, archive={"dir": str(folder)}), capsys)
    status, detail = results["archive.dir newer segments"]
    assert code == 0 and status == "note", results
    assert detail.startswith(f"1 segment(s) of {folder} (seg-00000007.ekva; ")
    assert f"written by a newer edgekv (format {ARCHIVE_FORMAT + 1}, this one reads up to {ARCHIVE_FORMAT})" in detail
    records = [detail for name, (_, detail) in results.items() if name.startswith("archive.dir records")]
    assert records == ["no segment this edgekv reads, only 1 a newer edgekv wrote (left as they are)"], results
    (folder / "seg-00000007.ekva").unlink()
    code, results = _check(_config(tmp_path, tiny_checkpoint, archive={"dir": str(folder)}), capsys)
    assert code == 0 and "archive.dir newer segments" not in results


@pytest.mark.parametrize("own", [True, False])
def test_rekey_leaves_a_newer_edgekvs_segments_and_says_so(tmp_path, capsys, own):
    """Beside this edgekv's own segments (resealed) or alone: never touched, named, and the old keys not declared
    unneeded (exit 1), since what they hold may be under an old key or in the clear."""
    pytest.importorskip("cryptography", reason="cryptography not installed (pip install 'edgekv[privacy]')")
    from edgekv.apps.cli import main

    folder = tmp_path / "archive"
    if own:
        archive = FrameArchive(folder, SHAPE, max_bytes=1 << 20, segment_bytes=4 << 10)
        fill(archive, range(4))
        archive.close()
    folder.mkdir(exist_ok=True)
    newer = _newer_segment(folder / "seg-00000009.ekva")
    (tmp_path / "new.key").write_bytes(bytes([2]) * 32)
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"archive": {"dir": str(folder), "max_gib": 0.01, "segment_mib": 1},
                                      "privacy": {"key_file": str(tmp_path / "new.key")}}))
    for dry_run in (["--dry-run"], []):
        assert main(["rekey", "--config", str(config), *dry_run]) == 1
        out = capsys.readouterr().out
        assert (folder / "seg-00000009.ekva").read_bytes() == newer
        assert ("segment(s) would be re-sealed" if dry_run else "segment(s) re-sealed") in out or not own, out
        assert f"left as they are: 1 segment(s) of {folder} (seg-00000009.ekva; " in out, out
        assert "this edgekv cannot re-seal them" in out and "previous_key_files can be emptied" not in out, out
