"""The archive on flash under faults (DESIGN invariant 13, issue 26 items 2-4): a full disk (a real tmpfs where
the tests run as root, a write that fails by injection at the file-system boundary everywhere) costs the
pairs that could not be written and nothing after them; a flipped byte costs the record it is in, never
the records after it nor a whole segment; a torn tail is told from corruption; and recall before the
first pair answers without recalling anything."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import edgekv
from edgekv.archive import store
from edgekv.archive.store import FrameArchive, KVShape, _HEAD, SEGMENT_MAGIC

SHAPE = KVShape(layers=3, kv_heads=2, head_dim=8, dtype="float32")
TOKENS = 64  # a record of ~25 KiB: a small tmpfs fills after a few
STREAM = b"f" * 16


def _kv(pair: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(pair)
    k = torch.randn(SHAPE.layers, SHAPE.kv_heads, TOKENS, SHAPE.head_dim, generator=g)
    return k, k * 2 + 1


def _archive(folder: Path, **kw) -> FrameArchive:
    kw.setdefault("max_bytes", 64 << 20)
    kw.setdefault("segment_bytes", 16 << 20)
    kw.setdefault("when_full", "wait")
    return FrameArchive(folder, SHAPE, **kw)


def _submit(archive: FrameArchive, frames) -> None:
    """One pair at a time, each on disk (or failed) before the next: the order of writes is the test's."""
    for frame in frames:
        k, v = _kv(frame)
        assert archive.submit(k, v, frame=frame, t=frame * 0.5, tpos=frame, t_offset=0, rows=8, cols=8,
                              stream=STREAM)
        assert archive.flush()


def _check_all(archive: FrameArchive) -> list[int]:
    """The frames of every indexed pair, each layer read and compared with what was written."""
    frames = []
    for entry in archive.entries():
        k, v = _kv(entry.frame)
        for layer in range(SHAPE.layers):
            got = archive.read_layer(entry, layer)
            assert got is not None, f"pair {entry.frame} layer {layer} does not check"
            assert torch.equal(got[0], k[layer]) and torch.equal(got[1], v[layer])
        frames.append(entry.frame)
    return frames


# ---------------------------------------------------------------------------------------------- a full disk
def test_enospc_on_a_real_full_disk_costs_only_the_pairs_not_written(small_disk):
    """Fill a real 512 KiB tmpfs: the writes that hit ENOSPC lose their pair (counted as dropped), the
    state shows "disk full", and once space returns every pair written afterwards checks on reopen
    (before: the writer appended after a partial record and every later pair failed its CRC)."""
    folder = small_disk / "archive"
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (400 << 10))  # leaves room for ~4 records
    archive = _archive(folder)
    _submit(archive, range(0, 10))
    stats = archive.stats()
    assert stats["archive_write_errors"] > 0 and stats["archive_disk_full"] == 1
    lost = stats["archive_dropped"]
    assert lost > 0 and stats["archive_written"] + lost == 10
    filler.unlink()  # space returns
    _submit(archive, range(10, 16))
    stats = archive.stats()
    assert stats["archive_disk_full"] == 0 and stats["archive_written"] + stats["archive_dropped"] == 16
    written = [e.frame for e in archive.entries()]
    archive.close()
    reopened = _archive(folder)
    assert _check_all(reopened) == written and written[-6:] == list(range(10, 16))
    assert reopened.bad_records == 0 and reopened.torn_bytes == 0
    reopened.close()


def test_the_archive_leaves_the_floor_free_on_a_real_disk_another_writer_fills(small_disk):
    """archive.keep_free_gib on a real 512 KiB tmpfs: another writer (a bag recorder, say) grows a file beside the
    archive; the archive gives up its oldest segments to keep the floor free, then refuses pairs (disk full, said)
    rather than take it — the other writer never meets a full disk — and writes again once the room returns."""
    floor = 128 << 10
    folder, other = small_disk / "archive", small_disk / "bag"
    archive = _archive(folder, segment_bytes=56 << 10, max_bytes=4 << 20, keep_free_bytes=floor)  # 2 records each
    assert archive.files.free_bytes(folder) > 400 << 10
    with open(other, "wb") as bag:
        for frame in range(24):
            written = archive.written
            _submit(archive, [frame])
            if archive.written > written:  # a record went in only where it left the floor free (a page's slack)
                assert store.disk_free_bytes(small_disk) >= floor - (4 << 10), frame
            bag.write(os.urandom(16 << 10))  # the other writer: 16 KiB a pair, never refused (an error would raise)
            bag.flush()
    stats = archive.stats()
    assert stats["archive_segments_yielded"] > 0 and stats["archive_written"] > 8
    assert stats["archive_dropped"] > 0 and stats["archive_disk_full"] == 1  # at the end there was nothing to give
    kept = _check_all(archive)
    assert kept and kept == sorted(kept) and max(kept) < 24  # the newest that fit, every layer intact
    other.unlink()  # the room returns
    _submit(archive, [24, 25])
    assert archive.stats()["archive_disk_full"] == 0 and {24, 25} <= set(_check_all(archive))
    archive.close()


def test_the_floor_by_injection_gives_up_the_oldest_segments_first(tmp_path):
    """The same floor with the file system's free space told by the boundary (any machine, no root): segments go
    oldest first and only as far as needed, a pair is refused only when nothing older is left, and the
    warnings say why."""

    class SharedDisk(store.SegmentFiles):
        capacity, taken_by_others = 2 << 20, 0

        def free_bytes(self, folder):
            used = sum(p.stat().st_size for p in Path(folder).glob("seg-*.ekva"))
            return self.capacity - used - self.taken_by_others

    disk = SharedDisk()
    archive = _archive(tmp_path, files=disk, segment_bytes=128 << 10, max_bytes=64 << 20, keep_free_bytes=512 << 10)
    _submit(archive, range(0, 40))  # ~1 MiB: under the floor's reach, nothing given up
    assert archive.stats()["archive_segments_yielded"] == 0 and len(_check_all(archive)) == 40
    disk.taken_by_others = 900 << 10  # another writer takes most of the rest
    _submit(archive, range(40, 50))
    stats = archive.stats()
    assert stats["archive_segments_yielded"] > 0 and stats["archive_dropped"] == 0
    assert disk.free_bytes(tmp_path) >= 512 << 10
    frames = _check_all(archive)
    assert frames == list(range(frames[0], 50)) and frames[0] > 0  # the oldest went, the newest all kept
    disk.taken_by_others = disk.capacity  # the disk is gone: nothing older left to give, pairs refused by name
    _submit(archive, range(50, 53))
    stats = archive.stats()
    assert stats["archive_disk_full"] == 1 and stats["archive_dropped"] == 3
    assert "keep_free_gib" in stats["archive_last_error"]
    disk.taken_by_others = 0
    _submit(archive, [53])
    assert archive.stats()["archive_disk_full"] == 0 and 53 in _check_all(archive)
    archive.close()


def _full_disk():
    """A file system that fills up on demand (RocksDB's FaultInjectionFS idea): while ``full``, a write puts
    half its bytes down (a short write, as the kernel does) and the next one fails with ENOSPC."""

    class FullDisk(store.SegmentFiles):
        def __init__(self) -> None:
            self.full = False
            self.failures = 0

        def pwrite(self, fd: int, data, offset: int) -> int:
            if not self.full:
                return super().pwrite(fd, data, offset)
            view = memoryview(data).cast("B")
            if len(view) > 1 and self.failures % 2 == 0:
                self.failures += 1
                return super().pwrite(fd, view[: len(view) // 2], offset)
            self.failures += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return FullDisk()


def test_a_write_that_fails_by_injection_is_rolled_back(tmp_path):
    disk = _full_disk()
    archive = _archive(tmp_path, files=disk)
    _submit(archive, range(0, 3))
    disk.full = True
    _submit(archive, range(3, 6))
    assert archive.stats()["archive_disk_full"] == 1 and archive.stats()["archive_dropped"] == 3
    disk.full = False
    _submit(archive, range(6, 9))
    stats = archive.stats()
    assert stats["archive_disk_full"] == 0 and stats["archive_written"] == 6 and stats["archive_dropped"] == 3
    assert "No space left" in stats["archive_last_error"]
    archive.close()
    reopened = _archive(tmp_path)
    assert _check_all(reopened) == [0, 1, 2, 6, 7, 8]
    assert reopened.bad_records == 0 and reopened.torn_bytes == 0
    reopened.close()


def test_a_forget_on_a_full_disk_deletes_the_segment_whole_rather_than_keep_the_window(tmp_path):
    """A forget rewrites each segment holding a forgotten pair; on a full disk that rewrite cannot be written, and
    the segment goes whole (its other pairs counted as lost to the forget) rather than the window staying on the
    disk. Other segments are untouched, and what is left reads back whole after a reopen."""
    disk = _full_disk()
    archive = _archive(tmp_path, files=disk, segment_bytes=100 << 10)  # about four records a segment
    _submit(archive, range(12))
    by_segment = {}
    for entry in archive.entries():
        by_segment.setdefault(entry.segment, []).append(entry.frame)
    assert len(by_segment) >= 3
    first = sorted(by_segment)[0]
    doomed = by_segment[first][1]  # a pair with others beside it in its segment
    secrets = [_kv(frame)[0][0, 0, 0].numpy().tobytes() for frame in by_segment[first]]
    disk.full = True
    result = archive.forget(doomed * 0.5, doomed * 0.5, stream=STREAM)
    disk.full = False
    assert result["pairs"] == 1 and result["segments_deleted"] == 1 and result["segments_rewritten"] == 0
    assert archive.lost_to_forget == archive.stats()["archive_lost_to_forget"] == len(by_segment[first]) - 1
    assert not list(tmp_path.glob("*.tmp"))
    on_disk = b"".join(p.read_bytes() for p in sorted(tmp_path.glob("seg-*.ekva")))
    assert not [run for run in secrets if run in on_disk]
    left = sorted(frame for number, frames in by_segment.items() if number != first for frame in frames)
    assert sorted(_check_all(archive)) == left
    archive.close()
    reopened = _archive(tmp_path)
    assert sorted(_check_all(reopened)) == left and reopened.bad_records == 0
    reopened.close()


# ---------------------------------------------------------------------------------------------- byte flips
def _segments(folder: Path) -> list[Path]:
    return sorted(folder.glob("seg-*.ekva"))


def _record_offset(segment: Path, index: int) -> int:
    """Where record ``index`` of a segment written by ``_archive`` starts (records have one size)."""
    header = segment.read_bytes().index(b"EKVA")
    return header + index * SHAPE.record_bytes(TOKENS)


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _two_segments(folder: Path) -> FrameArchive:
    """20 pairs: 10 in the first segment (closed), 10 in the second (the newest)."""
    archive = _archive(folder, segment_bytes=10 * SHAPE.record_bytes(TOKENS) + 4096)
    _submit(archive, range(20))
    archive.close()
    assert [len(_records(p)) for p in _segments(folder)] == [10, 10]
    return archive


def _records(segment: Path) -> list[int]:
    data = segment.read_bytes()
    return [i for i in range(len(data)) if data.startswith(b"EKVA", i)]


@pytest.mark.parametrize("segment", [0, 1], ids=["closed-segment", "open-segment"])
@pytest.mark.parametrize("where", ["meta", "head-magic"])
def test_one_flipped_byte_costs_one_record(tmp_path, segment, where):
    """Before: one flipped byte cut the 7 records after it in its segment (a closed one too), logged as a
    torn write. Now the damaged record is skipped and counted, the scan resynchronizes on the next record
    that checks, and nothing is cut from the file."""
    _two_segments(tmp_path)
    path = _segments(tmp_path)[segment]
    size = path.stat().st_size
    at = _record_offset(path, 3) + (_HEAD.size + 5 if where == "meta" else 1)
    _flip(path, at)
    reopened = _archive(tmp_path)
    lost = 10 * segment + 3
    assert _check_all(reopened) == [f for f in range(20) if f != lost]
    assert reopened.bad_records == 1 and reopened.torn_bytes == 0
    assert reopened.stats()["archive_skipped_bytes"] == SHAPE.record_bytes(TOKENS)
    assert path.stat().st_size == size  # never delete data that still checks
    reopened.close()


def test_a_flipped_kv_byte_costs_one_layer_of_one_record(tmp_path):
    """A flipped byte in the KV of a record in the newest segment (whose KV is verified at open): the record
    stays (its other layers check), its damaged layer is never handed out; the records after it stay."""
    _two_segments(tmp_path)
    path = _segments(tmp_path)[1]
    start = _record_offset(path, 3) + _HEAD.size + SHAPE.meta_bytes()
    _flip(path, start + SHAPE.layer_bytes(TOKENS) + 7)  # layer 1 of pair 13
    reopened = _archive(tmp_path)
    assert [e.frame for e in reopened.entries()] == list(range(20))
    entry = reopened.entries()[13]
    assert reopened.read_layer(entry, 1) is None and reopened.read_layer(entry, 2) is not None
    assert reopened.stats()["archive_damaged_layers"] >= 1 and reopened.torn_bytes == 0
    reopened.close()


def test_a_flipped_header_byte_keeps_the_segment(tmp_path, caplog):
    """Before: a flipped byte in a segment's header deleted the whole segment (10 good records)."""
    _two_segments(tmp_path)
    path = _segments(tmp_path)[0]
    _flip(path, len(SEGMENT_MAGIC) + 10)  # inside the header's JSON shape key
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        reopened = _archive(tmp_path)
    assert path.exists() and _check_all(reopened) == list(range(20))
    assert any("header" in r.getMessage() for r in caplog.records)
    reopened.close()


def test_a_torn_tail_is_told_from_a_damaged_record(tmp_path, caplog):
    _two_segments(tmp_path)
    newest = _segments(tmp_path)[1]
    record = SHAPE.record_bytes(TOKENS)
    os.truncate(newest, newest.stat().st_size - record // 3)  # a write torn by a crash
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        reopened = _archive(tmp_path)
    assert [e.frame for e in reopened.entries()] == list(range(19))
    assert reopened.torn_bytes == record - record // 3 and reopened.bad_records == 0
    torn = [r.getMessage() for r in caplog.records if "a torn write" in r.getMessage()]
    assert len(torn) == 1 and not any("damaged" in r.getMessage() for r in caplog.records)
    reopened.close()
    mark = len(caplog.records)
    _flip(newest, _record_offset(newest, 8) + _HEAD.size + 5)  # the last record, complete: corruption
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        again = _archive(tmp_path)
    assert [e.frame for e in again.entries()] == list(range(18))
    assert again.bad_records == 1 and again.torn_bytes == 0
    said = [r.getMessage() for r in caplog.records[mark:]]
    assert any("damaged" in m for m in said) and not any("a torn write" in m for m in said), said
    again.close()


def test_an_old_archive_with_a_partial_record_inside_reads_every_record_after_it(tmp_path):
    """What the old writer left after ENOSPC: half a record, then complete records appended after it. The
    format is unchanged, so such archives on devices read: every record that checks is kept."""
    _two_segments(tmp_path)
    path = _segments(tmp_path)[1]
    data = path.read_bytes()
    record = SHAPE.record_bytes(TOKENS)
    cut = _record_offset(path, 4)
    path.write_bytes(data[:cut + record // 2] + data[cut + record:])  # pair 14 half written, 15.. after it
    reopened = _archive(tmp_path)
    assert _check_all(reopened) == [f for f in range(20) if f != 14]
    assert reopened.bad_records == 1
    reopened.close()


# ---------------------------------------------------------------------------------------------- recall
def test_recall_before_the_first_pair_recalls_nothing(tiny_checkpoint, tmp_path):
    """Before: KeyError('archive_stream'), a 500 for every question until the first pair."""
    runtime = edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 56], "fps": 2.0},
        cache={"max_tokens": 400, "text_reserve_tokens": 64}, generation={"max_new_tokens": 3},
        archive={"dir": str(tmp_path / "a"), "max_gib": 0.01, "segment_mib": 1.0, "top_k": 2, "when_full": "wait"})
    session = runtime.session()
    answer = session.ask("What did you see?", recall=True)
    assert answer.recalled == () and session.stats()["recalls"] == 1
    rng = np.random.default_rng(0)
    session.ingest(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), t=0.0)  # a frame waiting for its pair
    assert session.ask("What did you see?", recall=True).recalled == ()


# ---------------------------------------------------------------------------------------------- the daemon
def test_a_full_disk_shows_in_healthz_metrics_and_the_status_page(tiny_checkpoint, tmp_path):
    """Before: a full disk showed only as log lines; /healthz said ok and archive_dropped stayed 0."""
    import time

    from helpers_server import RunningDaemon, call, server_config

    config = server_config(tiny_checkpoint).with_overrides(
        archive={"dir": str(tmp_path / "archive"), "max_gib": 0.01, "segment_mib": 1.0, "top_k": 1})
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        archive = running.daemon.session.recall.archive
        disk = _full_disk()
        archive.files = disk
        disk.full = True

        def wait(predicate) -> bool:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not predicate():
                time.sleep(0.05)
            return predicate()

        assert wait(lambda: archive.disk_full and archive.dropped > 0)
        status, _, body = call(running.port, "GET", "/healthz")
        health = json.loads(body)
        assert status == 200 and health["status"] == "degraded" and "disk full" in health["problems"][0], health
        _, _, body = call(running.port, "GET", "/metrics")
        metrics = body.decode()
        assert "edgekv_archive_disk_full 1.0" in metrics and "edgekv_archive_write_errors_total" in metrics
        dropped = [line for line in metrics.splitlines() if line.startswith("edgekv_archive_dropped_total")]
        assert dropped and float(dropped[0].split()[-1]) > 0
        assert "edgekv_archive_segments_yielded_total 0.0" in metrics
        free = [line for line in metrics.splitlines() if line.startswith("edgekv_archive_disk_free_bytes ")]
        assert free and float(free[0].split()[-1]) > 0  # the real disk's free space (the injection fails writes only)
        _, _, body = call(running.port, "GET", "/v1/edgekv/status")
        assert "disk full" in json.loads(body)["daemon"]["problems"][0]
        disk.full = False  # space returns: writes go on, health is ok again
        assert wait(lambda: not archive.disk_full and not archive.failing)
        status, _, body = call(running.port, "GET", "/healthz")
        assert status == 200 and json.loads(body)["status"] == "ok", body


def test_bench_faults_writes_its_figures(tmp_path):
    from edgekv.apps.cli import main

    out = tmp_path / "faults.json"
    assert main(["bench", "faults", "--parts", "flips", "--trials", "2", "--records", "3", "--tokens", "8",
                 "--json", str(out), "--plot", ""]) == 0
    flips = json.loads(out.read_text())["flips"]
    assert len(flips["trials"]) == 2 and flips["records"] == 6
    assert flips["intact_recovered"] == flips["intact_records"]  # every record a flip did not touch survives


def test_the_daemon_says_at_start_when_its_disk_cannot_hold_the_archive_beside_the_floor(tmp_path, monkeypatch):
    """A disk with less free space than archive.max_gib (+ frames_mib) beside keep_free_gib: the daemon says so in
    one line at start (the archive will keep the floor before its budget: it reaches back less far), and stays
    quiet where the disk holds it all."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:events?size=112x112&fps=2&frames=6&seed=2", "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64}, server={"enabled": False},
        archive={"dir": str(tmp_path / "archive"), "max_gib": 16, "frames_mib": 64, "keep_free_gib": 1})
    for free, said in ((3 * 2**30, True), (40 * 2**30, False)):
        monkeypatch.setattr(store, "disk_free_bytes", lambda folder, free=free: free)
        with open(tmp_path / "out.txt", "w") as out:  # no way for a question to come: it exits at the stream's end
            Daemon(config, DaemonOptions(no_stdin=True, quiet=True), out=out).run()
        text = (tmp_path / "out.txt").read_text()
        line = [row for row in text.splitlines() if "less than archive.max_gib" in row]
        assert bool(line) == said, text
        if said:
            assert "3.00 GiB free" in line[0] and "frames_mib (64 MiB)" in line[0] and "keep_free_gib (1 GiB)" in line[0]
