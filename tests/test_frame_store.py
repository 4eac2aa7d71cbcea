"""Evidence frames on flash (apps/daemon/frame_store.py): a small JPEG a frame pair beside the archive, read back for an
answer's evidence after the keyframe ring let it go. Written and read back scaled; trimmed by size and by age; a
forget overwrites the stretch's pictures in the database and its log (the bytes are gone from both files, not only
unlinked); sealed with the privacy key and resealed by rekey; a full disk fails a frame and rolls it back, later ones
go in; a damaged file is set aside whole and a new one begun; a writer killed mid-row loses at most that row."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import cv2
import numpy as np
import pytest

from edgekv.apps.daemon.frame_store import FILE, FrameStore, encode_thumbnail

STREAM = "ab" * 16


def _frame(seed: int, size=(120, 160)) -> np.ndarray:
    """A frame no other seed draws: a mark of its own colour and place on noise."""
    rng = np.random.default_rng(seed)
    frame = rng.integers(0, 255, (*size, 3), dtype=np.uint8)
    cv2.circle(frame, (20 + 7 * (seed % 16), 30 + 3 * (seed % 20)), 12, (seed * 37 % 256, 200, seed * 91 % 256), -1)
    return frame


def _store(folder, **kw) -> FrameStore:
    return FrameStore(folder, **{"max_bytes": 1 << 20, "px": 64, **kw})


def _fill(store: FrameStore, pairs, stream: str = STREAM) -> None:
    for pair in pairs:
        assert store.submit(stream, pair, pair * 0.5, 1_800_000_000.0 + pair * 0.5, _frame(pair))
        store.flush()  # one at a time: the queue never fills, whatever the machine's speed
    assert store.flush()


def _file_bytes(folder) -> bytes:
    return b"".join((folder / name).read_bytes() for name in os.listdir(folder) if name.startswith(FILE))


def test_frames_are_kept_scaled_and_read_back(tmp_path):
    with _store(tmp_path) as store:
        _fill(store, range(6))
        for pair in range(6):
            jpeg = store.jpeg(STREAM, pair)
            assert jpeg == encode_thumbnail(_frame(pair), 64)  # that pair's frame, no other
            assert cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_COLOR).shape == (48, 64, 3)
            assert store.has(STREAM, pair)
        assert store.jpeg(STREAM, 6) is None and not store.has(STREAM, 6)
        assert store.jpeg("cd" * 16, 0) is None  # another stream's pair 0 is not this one's
        assert store.jpeg(None, 0) is None and not store.submit(None, 7, 3.5, None, _frame(7))
        assert store.jpeg(STREAM, 2**80) is None and store.read_errors == 0  # a number no row can have: no error
        stats = store.stats()
        assert stats["frames_kept"] == stats["frames_written"] == 6 and stats["frames_write_errors"] == 0
        assert stats["frames_bytes"] == sum(len(store.jpeg(STREAM, p)) for p in range(6))
    with _store(tmp_path) as again:  # what was written is there after a restart
        assert again.jpeg(STREAM, 3) == encode_thumbnail(_frame(3), 64) and again.stats()["frames_kept"] == 6


def test_the_oldest_go_past_the_size_and_the_age(tmp_path):
    # frames_mib bounds the files (database, log, its index), not only the pictures: 112 px frames are ~2 KB, and a
    # row's bookkeeping beside each would have taken the files 65 % past the budget (measured on a daemon: 13.8 MB
    # for frames_mib 8); the oldest go first, before a frame that would pass it goes in
    budget = 256 << 10
    with _store(tmp_path, max_bytes=budget, px=112) as store:
        sizes = []
        for pair in range(150):
            _fill(store, [pair])
            sizes.append(store.file_bytes())
            assert store.file_bytes() <= budget, (pair, sizes[-3:])  # never past it, after any frame
        kept = [pair for pair in range(150) if store.has(STREAM, pair)]
        assert kept == list(range(150 - len(kept), 150)) and 20 <= len(kept) < 150  # the newest, in order
        stats = store.stats()
        assert stats["frames_trimmed"] == 150 - len(kept) and stats["frames_write_errors"] == 0
        assert stats["frames_file_bytes"] == store.file_bytes() <= budget
        assert stats["frames_bytes"] > (budget - store.wal_bytes) // 2  # the trim keeps the budget in use
        assert max(sizes) > budget * 3 // 4  # and the files grew to it: a bound that was reached, not a loose one
    with _store(tmp_path / "aged", max_age_s=2.0) as aged:  # stream time: 0.5 s a pair
        _fill(aged, range(12))
        assert [pair for pair in range(12) if aged.has(STREAM, pair)] == [7, 8, 9, 10, 11]  # t >= 5.5 - 2.0


def test_a_file_larger_than_a_lowered_budget_is_made_to_fit_at_start(tmp_path):
    with _store(tmp_path, max_bytes=768 << 10, px=112) as store:
        _fill(store, range(120))
        assert store.file_bytes() > 512 << 10
    with _store(tmp_path, max_bytes=256 << 10, px=112) as smaller:  # the budget lowered: trimmed and rebuilt
        assert smaller.file_bytes() <= 256 << 10
        kept = [pair for pair in range(120) if smaller.has(STREAM, pair)]
        assert kept == list(range(120 - len(kept), 120)) and len(kept) >= 15  # the newest, in order
        assert smaller.jpeg(STREAM, 119) == encode_thumbnail(_frame(119), 112)
        _fill(smaller, [120])
        assert smaller.has(STREAM, 120) and smaller.file_bytes() <= 256 << 10


def test_a_frame_larger_than_the_budget_is_refused_by_name(tmp_path):
    with _store(tmp_path, max_bytes=192 << 10, px=640) as store:  # 96 KiB of it for the database's pages
        _fill(store, [0])  # a 160 px frame: ~18 KB, fits
        big = np.random.default_rng(5).integers(0, 255, (480, 640, 3), dtype=np.uint8)  # noise at 640 px: ~200 KB
        assert store.submit(STREAM, 1, 0.5, None, big) and store.flush()
        stats = store.stats()
        assert stats["frames_write_errors"] == 1 and "frames_mib" in stats["frames_last_error"]
        assert store.has(STREAM, 0) and not store.has(STREAM, 1)  # nothing kept was given up for it
        _fill(store, [2])
        assert store.has(STREAM, 2) and store.file_bytes() <= 192 << 10


def test_a_forget_overwrites_the_pictures_in_both_files(tmp_path):
    with _store(tmp_path) as store:
        _fill(store, range(8))
        gone = [store.jpeg(STREAM, pair) for pair in (3, 4)]
        kept = store.jpeg(STREAM, 6)
        assert all(jpeg[-160:-96] in _file_bytes(tmp_path) for jpeg in gone)  # there, before
        assert store.forget(1.5, 2.0, STREAM) == 2  # pairs 3 and 4 (t 1.5 and 2.0)
        assert store.forget(1.5, 2.0, "cd" * 16) == 0 and store.forget(0, 100, None) == 0
        assert not store.has(STREAM, 3) and not store.has(STREAM, 4) and store.jpeg(STREAM, 6) == kept
        on_disk = _file_bytes(tmp_path)
        assert not any(jpeg[-160:-96] in on_disk for jpeg in gone)  # overwritten, in the database and its log
        assert kept[-160:-96] in on_disk
        assert store.stats()["frames_kept"] == 6


def test_sealed_with_the_key_and_resealed_by_rekey(tmp_path):
    pytest.importorskip("cryptography", reason="cryptography not installed (pip install 'edgekv[privacy]')")
    from edgekv.privacy import BLOB_MAGIC, Key, KeyRing

    old, new = Key(b"\x01" * 32, "old"), Key(b"\x02" * 32, "new")
    with _store(tmp_path) as clear:
        _fill(clear, [0, 1])  # before a key was set: in the clear
    with _store(tmp_path, keys=KeyRing(old)) as sealed:
        _fill(sealed, [2, 3])
        assert sealed.jpeg(STREAM, 0) == encode_thumbnail(_frame(0), 64)  # the clear ones still read
        assert sealed.jpeg(STREAM, 2) == encode_thumbnail(_frame(2), 64)
        jpeg = encode_thumbnail(_frame(2), 64)
        assert jpeg[-160:-96] not in _file_bytes(tmp_path)  # sealed on disk
    rows = dict(sqlite3.connect(tmp_path / FILE).execute("SELECT pair, jpeg FROM frames").fetchall())
    assert [bytes(rows[p]).startswith(BLOB_MAGIC) for p in range(4)] == [False, False, True, True]
    with _store(tmp_path, keys=KeyRing(new, [old])) as rotated:
        assert rotated.reseal(dry_run=True) == {"resealed": 4, "current": 0, "unopened": 0}
        assert rotated.reseal() == {"resealed": 4, "current": 0, "unopened": 0}
        assert rotated.reseal() == {"resealed": 0, "current": 4, "unopened": 0}
        assert encode_thumbnail(_frame(0), 64)[-160:-96] not in _file_bytes(tmp_path)  # nothing left in the clear
    with _store(tmp_path, keys=KeyRing(new)) as alone:  # the new key alone opens every frame
        assert [alone.jpeg(STREAM, p) for p in range(4)] == [encode_thumbnail(_frame(p), 64) for p in range(4)]
    with _store(tmp_path, keys=KeyRing(Key(b"\x03" * 32, "other"))) as stranger:
        assert stranger.jpeg(STREAM, 2) is None and stranger.stats()  # no key opens it: not served, counted
        assert stranger.read_errors == 1
        assert stranger.reseal() == {"resealed": 0, "current": 0, "unopened": 4}  # left as they are


def test_a_full_disk_fails_a_frame_and_later_ones_go_in(tmp_path):
    with _store(tmp_path) as store:
        _fill(store, range(3))
        with store._lock:  # SQLite's own "database or disk is full" (SQLITE_FULL), as a full flash gives it
            pages = store._db.execute("PRAGMA page_count").fetchone()[0]
            store._db.execute(f"PRAGMA max_page_count = {pages}")
        for pair in range(3, 9):  # the file's free pages take a frame or so, then it is full
            store.submit(STREAM, pair, pair * 0.5, None, _frame(pair))
            store.flush()
        stats = store.stats()
        assert stats["frames_write_errors"] >= 4 and "full" in stats["frames_last_error"]
        kept = [pair for pair in range(9) if store.has(STREAM, pair)]
        assert kept[:3] == [0, 1, 2] and len(kept) == 9 - stats["frames_write_errors"]  # a failed one left nothing
        assert stats["frames_kept"] == len(kept)
        assert all(store.jpeg(STREAM, p) == encode_thumbnail(_frame(p), 64) for p in kept)
        assert stats["frames_bytes"] == sum(len(store.jpeg(STREAM, p)) for p in kept)  # rolled back whole
        with store._lock:  # room again
            store._db.execute("PRAGMA max_page_count = 1073741823")
        _fill(store, [9])
        assert store.jpeg(STREAM, 9) == encode_thumbnail(_frame(9), 64) and store.stats()["frames_last_error"] is None


def test_a_damaged_file_is_set_aside_and_a_new_one_begun(tmp_path):
    with _store(tmp_path) as store:
        _fill(store, range(4))
    path = tmp_path / FILE
    data = bytearray(path.read_bytes())
    data[4096:8192] = os.urandom(4096)  # a page of garbage
    path.write_bytes(bytes(data))
    with _store(tmp_path) as again:
        assert again.set_aside is not None and again.set_aside.exists()
        assert again.stats()["frames_kept"] == 0
        _fill(again, [9])
        assert again.jpeg(STREAM, 9) == encode_thumbnail(_frame(9), 64)
        assert again.forget(100.0, 101.0, STREAM) == 0 and not again.set_aside.exists()  # a forget takes it too
    (tmp_path / FILE).unlink()
    for leftover in tmp_path.glob(f"{FILE}-*"):
        leftover.unlink()
    (tmp_path / FILE).write_bytes(b"not a database at all" * 100)
    with _store(tmp_path) as third:
        assert third.set_aside is not None and third.stats()["frames_kept"] == 0


def test_a_writer_killed_mid_row_loses_at_most_that_row(tmp_path):
    """A child process writes frames as fast as it can and says each one written; it is killed with SIGKILL after
    the fifth. Every frame it said was written reads back whole (WAL: a commit is durable in the file's log)."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys
        import numpy as np
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from test_frame_store import STREAM, _frame, _store
        store = _store({str(tmp_path)!r})
        pair = 0
        while True:
            store.submit(STREAM, pair, pair * 0.5, None, _frame(pair))
            store.flush()
            print(pair, flush=True)
            pair += 1
        """)], stdout=subprocess.PIPE, text=True)
    said = []
    try:
        for line in child.stdout:
            said.append(int(line))
            if len(said) == 5:
                child.send_signal(signal.SIGKILL)
                break
    finally:
        child.kill()
        child.wait(30)
    with _store(tmp_path) as store:
        assert store.set_aside is None  # the file checks
        for pair in said:
            assert store.jpeg(STREAM, pair) == encode_thumbnail(_frame(pair), 64)


def test_an_io_error_is_no_damage(tmp_path, monkeypatch):
    """A disk that cannot be written (here: SQLite's I/O error at the first statement) is raised to the daemon, which
    goes on without pictures; the file is not set aside as damaged."""
    with _store(tmp_path) as store:
        _fill(store, [0])
    real = FrameStore._connect

    def failing(self):
        db = real(self)
        db.close()
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(FrameStore, "_connect", failing)
    with pytest.raises(sqlite3.OperationalError):
        _store(tmp_path)
    monkeypatch.setattr(FrameStore, "_connect", real)
    with _store(tmp_path) as again:
        assert again.set_aside is None and again.jpeg(STREAM, 0) == encode_thumbnail(_frame(0), 64)


def test_failing_writes_make_the_daemon_degraded_until_one_succeeds(tmp_path):
    from types import SimpleNamespace

    from edgekv.apps.daemon.health import problems

    with _store(tmp_path) as store:
        daemon = SimpleNamespace(sampler=None, session=SimpleNamespace(recall=None), frames=store)
        _fill(store, [0])
        assert problems(daemon) == []
        with store._lock:
            store._db.execute(f"PRAGMA max_page_count = {store._db.execute('PRAGMA page_count').fetchone()[0]}")
        for pair in range(1, 6):
            store.submit(STREAM, pair, pair * 0.5, None, _frame(pair))
            store.flush()
        (line,) = problems(daemon)
        assert line.startswith("evidence frames: writes failing (") and "full" in line
        with store._lock:
            store._db.execute("PRAGMA max_page_count = 1073741823")
        _fill(store, [6])
        assert problems(daemon) == []


def test_a_forget_on_a_full_disk_drops_every_frame_rather_than_keep_the_stretch(small_disk):
    """On a real full disk (a 512 KiB tmpfs) a forget cannot write its deletion's log: rather than keep the stretch's
    pictures, the store drops every evidence frame (the file unlinked), begins anew, and writes again once there is
    room. Writes that failed for lack of room were logged at most once a minute, not once a frame."""
    folder = small_disk / "archive"
    folder.mkdir()
    with _store(folder, px=160) as store:
        pair = 0
        while store.stats()["frames_write_errors"] < 3:  # until the disk is full
            store.submit(STREAM, pair, pair * 0.5, None, _frame(pair))
            store.flush()
            pair += 1
        assert pair < 400 and store.stats()["frames_kept"] > 5
        window = [p for p in range(pair) if 1.0 <= p * 0.5 <= 2.0 and store.has(STREAM, p)]
        pictures = [store.jpeg(STREAM, p)[-160:-96] for p in window]
        filler = small_disk / "filler"  # whatever room deletions left, taken too
        with open(filler, "wb", buffering=0) as sink:
            try:
                while True:
                    sink.write(b"\0" * 4096)
            except OSError:
                pass
        gone = store.forget(1.0, 2.0, STREAM)
        assert gone == len(window) > 0 and store.stats()["frames_discarded"] == 1
        assert store.stats()["frames_kept"] == 0 and not store.has(STREAM, window[0])
        assert not any(picture in _file_bytes(folder) for picture in pictures)
        filler.unlink()  # room again
        _fill(store, [1000])
        assert store.jpeg(STREAM, 1000) == encode_thumbnail(_frame(1000), 160)


def test_the_frames_leave_the_floor_free_on_a_real_disk_another_writer_fills(small_disk):
    """archive.keep_free_gib on a real 512 KiB tmpfs: another writer grows a file beside the frames into the floor;
    the store grows only where that leaves the floor, and gives back what the other writer takes of it — its oldest
    frames deleted and the file cut by as much, so the disk's free space is at the floor again after each frame (as
    the archive deletes its oldest segments) — then, with nothing left to give, refuses frames (ENOSPC, the floor
    named) rather than take the last of the disk; the other writer never meets a full disk (its write would raise);
    once the room returns, frames go in again."""
    from edgekv.archive.store import disk_free_bytes

    floor = 160 << 10
    folder, other = small_disk / "archive", small_disk / "bag"
    folder.mkdir()
    with _store(folder, px=160, max_bytes=8 << 20, keep_free_bytes=floor) as store:  # a budget past the disk
        _fill(store, range(10))
        room = disk_free_bytes(small_disk)
        assert room > floor and store.stats()["frames_yielded"] == 0
        with open(other, "wb") as bag:
            for pair in range(10, 35):  # the other writer takes 8 KiB beside each frame, into the floor
                size = store.file_bytes()
                _fill(store, [pair])
                if store.file_bytes() > size:  # the files grew only where that left the floor
                    assert disk_free_bytes(small_disk) >= floor, pair
                assert disk_free_bytes(small_disk) >= floor - (4 << 10), pair  # and gave back what was taken of it
                bag.write(os.urandom(8 << 10))
                bag.flush()
            stats = store.stats()
            assert stats["frames_yielded"] > 0 and stats["frames_trimmed"] == 0  # the disk's floor, not the budget
            assert stats["frames_write_errors"] == 0
            kept = [p for p in range(35) if store.has(STREAM, p)]
            assert kept == list(range(kept[0], 35)) and kept[0] > 0  # the oldest went first, the newest kept
            assert other.stat().st_size > room - floor  # the other writer took more than the floor left it at first
            pair = 35
            while disk_free_bytes(small_disk) >= 56 << 10:  # the other writer on, into the floor to 48 KiB of the end
                bag.write(os.urandom(8 << 10))
                bag.flush()
                _fill(store, [pair])
                pair += 1
                assert pair < 200
        stats = store.stats()
        assert stats["frames_kept"] == 0 and store.file_bytes() <= 64 << 10  # every frame given back, the file cut
        assert stats["frames_write_errors"] > 0 and "keep_free_gib" in stats["frames_last_error"]
        assert disk_free_bytes(small_disk) >= 40 << 10  # the store never took the room the other writer left
        other.unlink()
        _fill(store, [pair])
        assert store.jpeg(STREAM, pair) == encode_thumbnail(_frame(pair), 160)


def _fake_free(monkeypatch, free: list) -> None:
    """The disk's free space as the store measures it (``edgekv.archive.store.disk_free_bytes``, asked at each use)
    set by the test: ``free[0]``, the disk never filled."""
    from edgekv.archive import store as archive_store

    monkeypatch.setattr(archive_store, "disk_free_bytes", lambda folder: free[0])


def _on_disk(folder) -> int:
    """The database's and its log's bytes on the disk."""
    return sum(os.path.getsize(folder / name) for name in (FILE, f"{FILE}-wal") if (folder / name).exists())


def _auto_vacuum(folder) -> int:
    db = sqlite3.connect(folder / FILE)
    try:
        return db.execute("PRAGMA auto_vacuum").fetchone()[0]
    finally:
        db.close()


def test_below_the_floor_a_frame_gives_the_deficit_back_to_the_disk(tmp_path, monkeypatch, caplog):
    """Another writer takes the disk's free space D below archive.keep_free_gib: the next frame deletes the oldest
    frames and the files on the disk shrink by at least D (their pages cut off, not only freed inside the file), as
    the archive deletes its oldest segments; the newest are kept and read; said once while the disk stays below."""
    floor, deficit, free = 64 << 20, 200 << 10, [1 << 40]
    _fake_free(monkeypatch, free)
    with _store(tmp_path, px=160, keep_free_bytes=floor) as store:  # 1 MiB: ~50 frames of 18 KB
        _fill(store, range(70))
        assert store.stats()["frames_trimmed"] > 0 and store.stats()["frames_yielded"] == 0  # held at its budget
        with store._lock:
            store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # the log folded back: the file's own bytes compared
        before, oldest, trimmed = _on_disk(tmp_path), min(p for p in range(70) if store.has(STREAM, p)), store.trimmed
        free[0] = floor - deficit
        with caplog.at_level("INFO", logger="edgekv.frames"):
            _fill(store, [70])
            assert before - _on_disk(tmp_path) >= deficit  # given back to the disk
            kept = [p for p in range(71) if store.has(STREAM, p)]
            assert kept == list(range(kept[0], 71)) and kept[0] >= oldest + deficit // (20 << 10)  # the oldest went
            assert store.jpeg(STREAM, 70) == encode_thumbnail(_frame(70), 160)
            assert store.jpeg(STREAM, kept[0]) == encode_thumbnail(_frame(kept[0]), 160)
            stats = store.stats()
            assert stats["frames_yielded"] == kept[0] - oldest and stats["frames_trimmed"] == trimmed
            assert stats["frames_write_errors"] == 0 and stats["frames_kept"] == len(kept)
            _fill(store, [71])  # still below: more given back, not said again
            free[0] = floor + (8 << 20)  # above it again
            _fill(store, [72])
            free[0] = floor - (64 << 10)  # below it again: said again
            _fill(store, [73])
        said = [r.getMessage() for r in caplog.records if r.name == "edgekv.frames"]
        assert len(said) == 2 and all("below archive.keep_free_gib (64.0 MiB)" in line for line in said), said
        assert store.has(STREAM, 73) and store.stats()["frames_write_errors"] == 0
    assert _auto_vacuum(tmp_path) == 2  # a new file is made able to give back (INCREMENTAL)


def _old_store(folder, pairs) -> None:
    """A file as the store made every one before it gave room back: the same schema, ``auto_vacuum`` NONE."""
    from edgekv.apps.daemon.frame_store import _SCHEMA

    db = sqlite3.connect(folder / FILE, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.executescript(_SCHEMA)
    for pair in pairs:
        db.execute("INSERT INTO frames (stream, pair, t, unix, jpeg) VALUES (?, ?, ?, ?, ?)",
                   (STREAM, pair, pair * 0.5, None, encode_thumbnail(_frame(pair), 64)))
    db.close()
    assert _auto_vacuum(folder) == 0


def test_a_file_made_before_is_converted_at_start_to_give_room_back(tmp_path, monkeypatch, caplog):
    floor, free = 1 << 30, [8 << 30]
    _fake_free(monkeypatch, free)
    _old_store(tmp_path, range(40))
    with caplog.at_level("INFO", logger="edgekv.frames"), _store(tmp_path, keep_free_bytes=floor) as store:
        assert [store.jpeg(STREAM, p) for p in range(40)] == [encode_thumbnail(_frame(p), 64) for p in range(40)]
        assert store.stats()["frames_kept"] == 40
        with store._lock:
            assert store._db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
            store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        before = _on_disk(tmp_path)
        free[0] = floor - (16 << 10)  # and so it gives back below the floor
        _fill(store, [40])
        assert before - _on_disk(tmp_path) >= 16 << 10 and store.has(STREAM, 40) and not store.has(STREAM, 0)
    said = [r.getMessage() for r in caplog.records if r.name == "edgekv.frames"]
    assert "converted to give room back" in said[0], said
    assert _auto_vacuum(tmp_path) == 2


def test_a_file_made_before_stays_as_it_is_where_the_disk_has_no_room_to_convert_it(tmp_path, monkeypatch, caplog):
    """The rebuild takes about twice the file beyond the floor: without that room the store opens as it is, every
    frame there, says so in one line, and keeps its size below the floor as it did; a later start converts it."""
    floor = 1 << 30
    _old_store(tmp_path, range(40))
    free = [floor + os.path.getsize(tmp_path / FILE)]  # room for one copy beyond the floor, not two
    _fake_free(monkeypatch, free)
    with caplog.at_level("INFO", logger="edgekv.frames"), _store(tmp_path, keep_free_bytes=floor) as store:
        assert [store.jpeg(STREAM, p) for p in range(40)] == [encode_thumbnail(_frame(p), 64) for p in range(40)]
        said = [r.getMessage() for r in caplog.records if r.name == "edgekv.frames"]
        assert len(said) == 1 and "not converted" in said[0] and "a later start converts it" in said[0], said
        assert "keep_free_gib (1.00 GiB)" in said[0]
        size = os.path.getsize(tmp_path / FILE)
        free[0] = floor - (16 << 10)  # below the floor: it keeps its size, as before, and the frame goes in
        _fill(store, [40])
        assert store.has(STREAM, 40) and os.path.getsize(tmp_path / FILE) == size
        kept = [p for p in range(41) if store.has(STREAM, p)]
    assert _auto_vacuum(tmp_path) == 0
    free[0] = 8 << 30  # room at a later start
    with _store(tmp_path, keep_free_bytes=floor) as later:
        assert [p for p in range(41) if later.has(STREAM, p)] == kept
    assert _auto_vacuum(tmp_path) == 2


def test_write_failures_are_logged_once_a_minute(tmp_path, caplog):
    with _store(tmp_path) as store:
        _fill(store, [0])
        with store._lock:
            store._db.execute(f"PRAGMA max_page_count = {store._db.execute('PRAGMA page_count').fetchone()[0]}")
        with caplog.at_level("INFO", logger="edgekv.frames"):
            for pair in range(1, 30):
                store.submit(STREAM, pair, pair * 0.5, None, _frame(pair))
                store.flush()
            with store._lock:
                store._db.execute("PRAGMA max_page_count = 1073741823")
            _fill(store, [30])
        said = [r.getMessage() for r in caplog.records if r.name == "edgekv.frames"]
        assert store.write_errors > 20 and len(said) == 2, said
        assert "not written" in said[0] and said[1].startswith("evidence frames: written again")


def test_a_frame_that_does_not_encode_costs_that_frame_not_the_writer(tmp_path):
    with _store(tmp_path) as store:
        for bad in (np.zeros((0, 0, 3), np.uint8), np.zeros((4, 4, 3), object)):
            assert store.submit(STREAM, 0, 0.0, None, bad)
            assert store.flush()
        _fill(store, [1])
        assert store.stats()["frames_write_errors"] == 2 and store.jpeg(STREAM, 1) == encode_thumbnail(_frame(1), 64)
        assert store._thread.is_alive()
