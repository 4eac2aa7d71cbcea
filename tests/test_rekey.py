"""``edgekv rekey``: the memory on flash sealed with the current ``privacy:`` key at once — snapshots
(``edgekv.state.reseal_snapshot``) and archive segments (``FrameArchive.reseal``) written in the clear or under an
older key — so that the old key is not needed (nor anything left in the clear) once it has run. Bit-identical
reads after it, damaged parts left damaged or left alone, a failed rewrite leaves the file as it was, and a
running daemon's folders are refused."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from helpers_archive import SHAPE, byte_runs, fill, pair_kv
from helpers_disk import full_disk_at_rename
from helpers_privacy import privacy_runtime, seen_session

pytest.importorskip("cryptography", reason="cryptography not installed (pip install 'edgekv[privacy]')")

from edgekv.apps.cli import main  # noqa: E402
from edgekv.archive.store import ArchiveError, FrameArchive, SegmentFiles, archived_shape  # noqa: E402
from edgekv.config import StateSection  # noqa: E402
from edgekv.privacy import Key, KeyRing, SealError  # noqa: E402
from edgekv.state import SnapshotError, StateKeeper, read_manifest, reseal_snapshot  # noqa: E402



def _key(seed: int) -> Key:
    return Key(bytes([seed]) * 32, f"test key {seed}")



def _archive(folder: Path, keys=None, **kw) -> FrameArchive:
    return FrameArchive(folder, SHAPE, max_bytes=1 << 20, segment_bytes=4 << 10, keys=keys, **kw)




def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("seg-*"))}


def _readable(archive: FrameArchive, pairs, skip: tuple[int, int] | None = None) -> None:
    entries = {e.frame: e for e in archive.entries()}
    for pair in pairs:
        k, v = pair_kv(pair)
        got = archive.read_layers(entries[pair], list(range(SHAPE.layers)))
        wanted = [layer for layer in range(SHAPE.layers) if (pair, layer) != skip]
        assert sorted(got) == wanted, pair
        for layer, kv in got.items():
            assert torch.equal(kv[0], k[layer]) and torch.equal(kv[1], v[layer])


def _old_archive(folder: Path) -> None:
    """Four pairs archived in the clear (before a key was set), then eight under key 1."""
    clear = _archive(folder)
    fill(clear, range(4))
    clear.close()
    sealed = _archive(folder, keys=KeyRing(_key(1)))
    fill(sealed, range(4, 12))
    sealed.close()


def test_an_archive_in_the_clear_and_under_an_old_key_is_resealed_and_reads_bit_identically(tmp_path):
    _old_archive(tmp_path)
    assert any(run in b"".join(_files(tmp_path).values()) for run in byte_runs(1))  # the clear segment holds them
    assert archived_shape(tmp_path) == SHAPE
    rotated = _archive(tmp_path, keys=KeyRing(_key(2), [_key(1)]))
    segments = rotated.stats()["archive_segments"]
    assert rotated.reseal(dry_run=True) == {"segments_resealed": segments, "segments_current": 0, "bytes": 0}
    result = rotated.reseal()
    assert result["segments_resealed"] == segments > 2 and result["segments_current"] == 0
    _readable(rotated, range(12))  # the open archive's index follows the rewritten records
    assert rotated.reseal() == {"segments_resealed": 0, "segments_current": segments, "bytes": 0}
    rotated.close()
    data = b"".join(_files(tmp_path).values())
    assert not any(run in data for pair in range(12) for run in byte_runs(pair))
    assert not list(tmp_path.glob("*.tmp"))
    with pytest.raises(ArchiveError, match="does not have"):  # the old key no longer opens anything
        _archive(tmp_path, keys=KeyRing(_key(1)))
    alone = _archive(tmp_path, keys=KeyRing(_key(2)))  # the new key alone opens everything
    assert alone.pairs == 12 and alone.bad_records == 0 and alone.damaged_layers == 0
    _readable(alone, range(12))
    fill(alone, range(12, 15))  # and the archive goes on
    alone.close()
    again = _archive(tmp_path, keys=KeyRing(_key(2)))
    _readable(again, range(15))
    again.close()


def test_a_damaged_layer_stays_damaged_through_a_reseal(tmp_path):
    archive = _archive(tmp_path, keys=KeyRing(_key(1)))
    fill(archive, range(6))
    entry = {e.frame: e for e in archive.entries()}[2]
    archive.close()
    path = tmp_path / f"seg-{entry.segment:08d}.ekva"
    data = bytearray(path.read_bytes())
    data[entry.offset + 400] ^= 0x01  # inside one sealed layer of pair 2
    path.write_bytes(bytes(data))
    rotated = _archive(tmp_path, keys=KeyRing(_key(2), [_key(1)]))
    damaged = [layer for layer in range(SHAPE.layers)
               if layer not in rotated.read_layers({e.frame: e for e in rotated.entries()}[2], [0, 1, 2])]
    assert len(damaged) == 1
    rotated.reseal()
    rotated.close()
    alone = _archive(tmp_path, keys=KeyRing(_key(2)))
    assert alone.pairs == 6
    _readable(alone, range(6), skip=(2, damaged[0]))  # never handed out, the other layers kept
    alone.close()


class _FullDisk(SegmentFiles):
    """ENOSPC once ``room`` bytes have been written."""

    def __init__(self, room: int) -> None:
        self.room = room

    def pwrite(self, fd, data, offset):
        if self.room < len(data):
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return super().pwrite(fd, data, offset)


def test_a_reseal_cut_short_leaves_every_segment_as_it_was(tmp_path):
    _old_archive(tmp_path)
    before = _files(tmp_path)
    failing = _archive(tmp_path, keys=KeyRing(_key(2), [_key(1)]), files=_FullDisk(6000))
    with pytest.raises(OSError, match="No space"):
        failing.reseal()
    _readable(failing, range(12))  # the archive still reads, the segment that failed as it was
    failing.close()
    after = _files(tmp_path)
    assert not [name for name in after if name.endswith(".tmp")]
    changed = [name for name in before if after[name] != before[name]]
    assert len(changed) <= 1  # those rewritten before the disk filled are whole, under the new key
    reopened = _archive(tmp_path, keys=KeyRing(_key(2), [_key(1)]))
    assert reopened.pairs == 12 and reopened.bad_records == 0
    _readable(reopened, range(12))
    reopened.reseal()  # and a second run finishes the job
    reopened.close()
    alone = _archive(tmp_path, keys=KeyRing(_key(2)))
    _readable(alone, range(12))
    alone.close()






def _write_key(path: Path, seed: int) -> str:
    path.write_bytes(_key(seed).material)
    return str(path)


def test_snapshots_in_the_clear_and_under_an_old_key_are_resealed_and_restore_bit_identically(tiny_checkpoint,
                                                                                             tmp_path):
    old, new = _write_key(tmp_path / "old.key", 1), _write_key(tmp_path / "new.key", 2)
    session = seen_session(privacy_runtime(tiny_checkpoint))
    plain, sealed = tmp_path / "plain.ekv", tmp_path / "sealed.ekv"
    session.save(plain)
    privacy_runtime(tiny_checkpoint, key_file=old).restore(plain).save(sealed)
    n = session.cache.length
    k = session.cache.k[:, :, :n].contiguous().numpy().tobytes()
    runs = [k[i:i + 32] for i in range(0, len(k), len(k) // 40)]
    assert sum(run in plain.read_bytes() for run in runs) > 30
    ring = KeyRing(_key(2), [_key(1)])
    assert reseal_snapshot(plain, ring) and reseal_snapshot(sealed, ring)
    new_id = hashlib.sha256(_key(2).material).digest()[:8]
    rt = privacy_runtime(tiny_checkpoint, key_file=new)
    for path in (plain, sealed):
        data = path.read_bytes()
        assert data.startswith(b"EDGEKV-SNAPSEAL") and data[16:24] == new_id
        assert not any(run in data for run in runs)
        restored = rt.restore(path)  # the new key alone
        for name in ("k", "v", "kind", "frame", "tpos", "sink"):
            assert torch.equal(getattr(restored.cache, name)[:, :, :n], getattr(session.cache, name)[:, :, :n]), name
        assert torch.equal(restored.question_logits("What happened?"), session.question_logits("What happened?"))
        assert np.array_equal(restored.ingestor.pending[0], session.ingestor.pending[0])
    before = sealed.read_bytes()
    assert not reseal_snapshot(sealed, ring) and sealed.read_bytes() == before  # already under the key: untouched
    with pytest.raises(SealError, match="does not have"):
        privacy_runtime(tiny_checkpoint, key_file=old).restore(sealed)
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_a_damaged_snapshot_is_named_and_left_as_it_is(tiny_checkpoint, tmp_path):
    path = tmp_path / "plain.ekv"
    seen_session(privacy_runtime(tiny_checkpoint)).save(path)
    manifest = read_manifest(path)
    data = bytearray(path.read_bytes())
    data[manifest["tensors"]["k"]["offset"] + 10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotError, match=r"plain\.ekv: damaged: tensor k"):
        reseal_snapshot(path, KeyRing(_key(2)))
    assert path.read_bytes() == bytes(data) and not list(tmp_path.glob(".*.tmp-*"))


def test_rekey_command_seals_a_deployments_memory_and_refuses_a_running_daemons(tiny_checkpoint, tmp_path, capsys):
    old, new = _write_key(tmp_path / "old.key", 1), _write_key(tmp_path / "new.key", 2)
    state, archive_dir = tmp_path / "state", tmp_path / "archive"
    state.mkdir()
    seen_session(privacy_runtime(tiny_checkpoint, key_file=old)).save(state / "snapshot-00000001.ekv")
    _old_archive(archive_dir)
    from edgekv.apps.daemon.frame_store import FrameStore

    frames = FrameStore(archive_dir, max_bytes=1 << 20, px=32)  # evidence frames: one in the clear, one sealed
    frames.submit("ab" * 16, 0, 0.0, None, np.full((24, 32, 3), 7, np.uint8))
    frames.close()
    frames = FrameStore(archive_dir, max_bytes=1 << 20, px=32, keys=KeyRing(_key(1)))
    frames.submit("ab" * 16, 1, 1.0, None, np.full((24, 32, 3), 9, np.uint8))
    frames.close()
    from edgekv.apps.outputs.alerts import AlertBus, AlertEngine, KeyframeRing, RuleStore
    from edgekv.config import AlertRuleSection

    AlertEngine([], AlertBus(), KeyframeRing(0), store=RuleStore(state, KeyRing(_key(1)))).add(
        AlertRuleSection(question="Is the safe open?"))  # the API's standing questions, sealed with the old key
    from edgekv.apps.outputs.alert_log import EventLog
    from edgekv.apps.outputs.alerts import AlertEvent

    EventLog(state, KeyRing(_key(1))).save(AlertEvent("e1", "alert-1", "safe", "Is the safe open?", None, 0.9, 3.0,
                                                      1, 0.5, 1_700_000_000.0, b"\xff\xd8jpeg"))  # the last alerts
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_checkpoint)}, "state": {"dir": str(state)},
        "archive": {"dir": str(archive_dir), "max_gib": 0.01, "segment_mib": 1},
        "privacy": {"key_file": new}}))
    with_old = ["--set", f"privacy.previous_key_files=[{old}]"]

    assert main(["rekey", "--config", str(config)]) == 1  # the snapshot needs the old key: named, left alone
    out = capsys.readouterr()
    assert "snapshot-00000001.ekv: sealed with key" in out.out and "left as they were" in out.out
    assert "archive: left as it is:" in out.out.replace(str(archive_dir), "archive")

    keeper = StateKeeper(StateSection(dir=str(state)), say=lambda line: None)
    keeper.hold()  # as a running daemon holds it
    try:
        assert main(["rekey", "--config", str(config), *with_old]) == 2
        assert f"state.dir {state} is in use" in capsys.readouterr().err
    finally:
        keeper.release()

    before = {p: p.read_bytes() for p in [*state.glob("*.ekv"), *archive_dir.glob("seg-*")]}
    assert main(["rekey", "--config", str(config), *with_old, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1 snapshot(s) would be re-sealed" in out and "segment(s) would be re-sealed, 0 already" in out
    assert "frames.sqlite: 2 frame(s) would be re-sealed, 0 already" in out
    assert {p: p.read_bytes() for p in before} == before

    (state / ".snapshot-00000002.ekv.tmp-999").write_bytes(b"half a snapshot under the old key")  # a crashed write
    assert main(["rekey", "--config", str(config), *with_old]) == 0
    assert not list(state.glob(".*tmp*"))
    out = capsys.readouterr().out
    assert "1 snapshot(s) re-sealed, 0 already" in out and "previous_key_files can be emptied" in out
    assert "alerts.json (the API's standing questions): re-sealed" in out
    assert [rule.question for _, rule in RuleStore(state, KeyRing(_key(2))).load()] == ["Is the safe open?"]
    assert "alert-events (the last alerts): 1 re-sealed, 0 already under the current key" in out
    (event,) = EventLog(state, KeyRing(_key(2))).load()
    assert event.id == "e1" and event.keyframe_jpeg == b"\xff\xd8jpeg"
    assert "frames.sqlite: 2 frame(s) re-sealed, 0 already under the current key" in out
    frames = FrameStore(archive_dir, max_bytes=1 << 20, px=32, keys=KeyRing(_key(2)))  # the new key alone
    try:
        assert [frames.jpeg("ab" * 16, pair)[:2] for pair in (0, 1)] == [b"\xff\xd8"] * 2
        assert frames.reseal(dry_run=True) == {"resealed": 0, "current": 2, "unopened": 0}
    finally:
        frames.close()
    assert main(["rekey", "--config", str(config)]) == 0  # the new key alone now opens everything
    out = capsys.readouterr().out
    assert "0 snapshot(s) re-sealed, 1 already" in out and "0 segment(s) re-sealed" in out
    alone = _archive(archive_dir, keys=KeyRing(_key(2)))
    _readable(alone, range(12))
    alone.close()

    config.write_text(yaml.safe_dump({"model": {"path": str(tiny_checkpoint)}, "state": {"dir": str(state)}}))
    assert main(["rekey", "--config", str(config)]) == 2
    assert "privacy: no key is set" in capsys.readouterr().err
    assert os.listdir(state)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root: sudo edgekv rekey")
def test_rekey_run_as_root_leaves_the_files_the_service_users(tmp_path, capsys):
    """``sudo edgekv rekey``: the rewritten files were root's inside folders the daemon (User=edgekv) owns."""
    state, archive_dir = tmp_path / "state", tmp_path / "archive"
    state.mkdir()
    _old_archive(archive_dir)
    for folder in (state, archive_dir):
        for path in [folder, *folder.rglob("*")]:
            os.chown(path, 4321, 4321)  # the service user
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"state": {"dir": str(state)},
                                      "archive": {"dir": str(archive_dir), "max_gib": 0.01, "segment_mib": 1},
                                      "privacy": {"key_file": _write_key(tmp_path / "new.key", 2),
                                                  "previous_key_files": [_write_key(tmp_path / "old.key", 1)]}}))
    assert main(["rekey", "--config", str(config)]) == 0, capsys.readouterr()
    assert "segment(s) re-sealed" in capsys.readouterr().out
    owners = {(p.stat().st_uid, p.stat().st_gid) for folder in (state, archive_dir)
              for p in [folder, *folder.rglob("*")]}
    assert owners == {(4321, 4321)}


def test_a_rekey_killed_inside_the_set_aside_snapshot_is_finished_by_the_next(tiny_checkpoint, tmp_path, capsys):
    """SIGKILL while the set-aside snapshot was rewritten left ``set-aside/.snapshot-N.ekv.tmp-PID`` (probed on the
    daemon's folders): every later rekey named it "left as it is" and exited 1 (keep the old keys), for good."""
    state = tmp_path / "state"
    (state / "set-aside").mkdir(parents=True)
    session = seen_session(privacy_runtime(tiny_checkpoint))
    session.save(state / "snapshot-00000004.ekv")
    session.save(state / "set-aside" / "snapshot-00000003.ekv")
    leftover = state / "set-aside" / ".snapshot-00000003.ekv.tmp-999"
    leftover.write_bytes(b"EDGEKV-SNAPSEAL\x01" + b"\x00" * 4000)  # the new key's header, cut short
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": str(tiny_checkpoint)}, "state": {"dir": str(state)},
                                      "privacy": {"key_file": _write_key(tmp_path / "new.key", 2)}}))
    assert main(["rekey", "--config", str(config), "--dry-run"]) == 0
    assert "2 snapshot(s) would be re-sealed" in capsys.readouterr().out
    assert main(["rekey", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "2 snapshot(s) re-sealed, 0 already" in out and "left as it is" not in out
    assert not leftover.exists()
    for path in (state / "snapshot-00000004.ekv", state / "set-aside" / "snapshot-00000003.ekv"):
        assert read_manifest(path, KeyRing(_key(2)))["_sealer"].key.id == KeyRing(_key(2)).current.id


def test_an_alert_that_cannot_be_rewritten_is_not_counted_as_resealed(tmp_path, monkeypatch, capsys):
    """A full disk (probed on a 1 MiB tmpfs): the alert's rewrite failed inside ``EventLog.save``, which only logs,
    and rekey said "1 re-sealed ... previous_key_files can be emptied", exit 0, the alert still in the clear."""
    from edgekv.apps.outputs.alert_log import EventLog
    from edgekv.apps.outputs.alerts import AlertEvent

    state = tmp_path / "state"
    EventLog(state, None).save(AlertEvent("e1", "alert-1", "safe", "Is the safe open?", None, 0.9, 3.0, 1, 0.5,
                                          1_700_000_000.0, b"\xff\xd8jpeg"))  # in the clear, before the key
    (path,) = EventLog(state, None).files()
    before = path.read_bytes()
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"state": {"dir": str(state)},
                                      "privacy": {"key_file": _write_key(tmp_path / "new.key", 2)}}))
    full_disk_at_rename(monkeypatch, ".evt")
    assert main(["rekey", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "alert-events (the last alerts): could not be rewritten (No space left on device" in out
    assert "can be emptied" not in out and "left as they were" in out
    assert path.read_bytes() == before and not list(path.parent.glob(".*tmp*"))
    monkeypatch.undo()
    assert main(["rekey", "--config", str(config)]) == 0  # room again: the next run seals it
    assert "alert-events (the last alerts): 1 re-sealed" in capsys.readouterr().out
    (event,) = EventLog(state, KeyRing(_key(2))).load()
    assert event.keyframe_jpeg == b"\xff\xd8jpeg" and path.read_bytes() != before


def test_a_snapshot_that_cannot_be_rewritten_is_named_and_the_rest_still_resealed(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch, capsys):
    """A full disk under ``state.dir``: rekey stopped at the first snapshot with a bare ``edgekv rekey: [Errno 28] No
    space left on device``, naming no file, and left the archive beside it unsealed."""
    state, archive_dir = tmp_path / "state", tmp_path / "archive"
    state.mkdir()
    seen_session(privacy_runtime(tiny_checkpoint)).save(state / "snapshot-00000001.ekv")
    before = (state / "snapshot-00000001.ekv").read_bytes()
    _old_archive(archive_dir)
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_checkpoint)}, "state": {"dir": str(state)},
        "archive": {"dir": str(archive_dir), "max_gib": 0.01, "segment_mib": 1},
        "privacy": {"key_file": _write_key(tmp_path / "new.key", 2),
                    "previous_key_files": [_write_key(tmp_path / "old.key", 1)]}}))
    full_disk_at_rename(monkeypatch, ".ekv")
    assert main(["rekey", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "snapshot-00000001.ekv: could not be rewritten (No space left on device" in out
    assert "segment(s) re-sealed" in out and "0 segment(s) re-sealed" not in out
    assert (state / "snapshot-00000001.ekv").read_bytes() == before and not list(state.glob(".*tmp*"))


def test_damaged_files_set_aside_are_named_as_not_rewritten(tmp_path, capsys):
    """``alerts.json.bad``, ``alert-events/*.evt.bad`` and ``frames.sqlite.bad-<time>`` hold what they held in the
    clear (or under an old key); rekey said only that every snapshot and segment opens with the new key."""
    state, archive = tmp_path / "state", tmp_path / "archive"
    (state / "alert-events").mkdir(parents=True)
    archive.mkdir()
    bad = [state / "alerts.json.bad", state / "alert-events" / "a1.evt.bad", archive / "frames.sqlite.bad-1700000000"]
    for path in bad:
        path.write_bytes(b'{"question": "Was the safe open?"')
    (state / "alerts.json").write_text("[]")  # not damaged: not named
    config = tmp_path / "deploy.yaml"
    config.write_text(yaml.safe_dump({"model": {"path": "builtin:toy"}, "state": {"dir": str(state)},
                                      "archive": {"dir": str(archive)},
                                      "privacy": {"key_file": _write_key(tmp_path / "new.key", 2)}}))
    assert main(["rekey", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "3 damaged file(s) set aside earlier are not rewritten" in out and "remove them if it matters" in out
    assert all(str(path) in out for path in bad) and "alerts.json," not in out
