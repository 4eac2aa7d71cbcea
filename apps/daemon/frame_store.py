"""Evidence frames on flash: a small JPEG of every frame pair, beside the archive, so that an answer's evidence can be
shown hours later ("Where did I leave my keys?" -> the frame it looked at, not only "at 10:03").

The keyframe ring (``alerts.keyframe_pairs``) keeps the last few frames in memory; an answer about an hour ago points
at a pair long gone from it. With ``archive.frames_mib`` > 0 (and ``archive.dir``), the daemon also writes each
ingested pair's frame, scaled to ``archive.frames_px`` on its long side, as one row of ``frames.sqlite`` in the camera's
archive folder: what the archive keeps as K/V for recall, kept here as a picture for people. ``GET
/frame.jpg?pair=N`` serves it (the ring first), and an answer's ``edgekv.evidence[].frame`` links it.

Why SQLite (the standard library's): one small blob a pair is what it does well, and it brings what the archive's
segment files had to build — a write is a transaction (a ``kill -9`` or a power cut mid-write loses that row, never an
earlier one; a full disk fails the row and rolls it back, and later rows go in once there is room), and damage is
detected (``PRAGMA quick_check`` at start: a file that fails it is set aside whole as ``frames.sqlite.bad-<time>`` and
a new one begun, said in the log; a row that fails to read later is a 404, logged).

Privacy: with a ``privacy:`` key every JPEG is sealed whole (``edgekv.privacy.seal_blob``: AES-256-GCM under a random
salt a row); ``edgekv rekey`` reseals them. A forget deletes the stretch's rows with ``secure_delete`` on (SQLite
overwrites the freed content with zeros) and then truncates the write-ahead log, so the pictures are gone from both
files, not only unlinked from an index (what the file system or the flash translation layer keeps of overwritten
blocks is beyond any file format; the archive says the same of its segments).

Ingest never waits on it (unless ``archive.when_full`` is ``wait``, as for the archive: a replay faster than real
time): ``submit`` hands the frame to a writer thread through a queue of ``QUEUE_FRAMES``; when the queue is full the
frame is dropped and counted (``dropped``). The writer scales, encodes (OpenCV releases the GIL while it does) and
writes; rows are trimmed oldest first, before a frame goes in, while the file would pass ``archive.frames_mib`` and,
with ``archive.max_age_s``, when they are older than that (as the archive's segments are: the stream being written's
behind its newest frame in stream time, an earlier stream's — a restart without the saved memory — by the wall clock
each was seen at, with guards against a clock set back or never set: ``_age``; and, with no frame coming in — a
privacy pause, a camera gone dark — when the daemon calls ``expire``), and, with ``archive.keep_free_gib``, before
the file would grow into that much of the disk's free space (other writers fill it too: the oldest frames go, their
pages reused, then frames are refused).

Below that floor the file gives the room back, as the archive deletes its oldest segments: when another writer on
the disk (a robot's bag recorder, logs) has taken the free space under ``keep_free_gib``, the next frame first
deletes the oldest rows, enough for the deficit and itself, and the file is made smaller by the deficit — its freed
pages cut off its end (``auto_vacuum = INCREMENTAL``, ``PRAGMA incremental_vacuum``) and the log truncated — so the
bytes return to the file system, not only to SQLite's list of free pages (counted in ``yielded``, said once a time
the disk goes below the floor). It does so in steps of the log's share (what it deletes and the pages the vacuum
moves pass through the log), so the log stays within ``frames_mib`` and a disk near full holds a step of it at most.
With nothing left to give, frames are refused (ENOSPC, the floor named). A file made before this (``auto_vacuum``
NONE, which cannot be cut) is rebuilt at start (``VACUUM``, once) where the disk has room for the rebuild — about
twice the file beyond the floor: SQLite's temporary copy and the log it is copied back through — else it opens as
it is, said in one line: below the floor it keeps its size, as it did, until a later start converts it.

``frames_mib`` bounds the files on the disk, not only the pictures in them: the database's pages in use (rows, their
indexes, the pages part-filled by a picture's last bytes: 10-15 % beside the JPEGs of 320 px frames, far more beside
the 2 KB of a 112 px one), its write-ahead log and that log's index (``-shm``). The log is checkpointed every
``wal_bytes // 2`` of pages and cut back to ``wal_bytes`` (``journal_size_limit``) — a sixteenth of the budget, 64
KiB to 4 MiB — and the database's pages in use are held to the rest; pages freed by the trim are reused before the
file grows, so the file never passes what was in use at its fullest. (A forget and ``edgekv rekey`` write their
whole change to the log in one transaction, then truncate it.) Measured: ``edgekv bench frames`` gives the bytes
on disk a frame.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

log = logging.getLogger("edgekv.frames")

FILE = "frames.sqlite"
QUEUE_FRAMES = 8
SHM_BYTES = 32 * 1024  # the write-ahead log's index: 32 KiB covers 4,096 logged pages, more than the log ever holds
ROW_BYTES = 128  # a row beside its picture: its header, pair, times and two index entries (plus the stream's id twice)
WARN_EVERY_S = 60.0  # a failing write is logged at most this often
AGE_EVERY_S = 60.0  # an earlier stream's frames are aged by the wall clock at most this often while writing
JPEG_QUALITY = 80
_STOP = object()
_SCHEMA = """
CREATE TABLE IF NOT EXISTS frames (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: the order frames were written in
    stream TEXT NOT NULL,                  -- the archive's id of the stream (pair numbers are a stream's own)
    pair INTEGER NOT NULL,
    t REAL NOT NULL,                       -- stream seconds
    unix REAL,                             -- the wall time it was seen at (null: a recording read as fast as it goes)
    jpeg BLOB NOT NULL                     -- the JPEG, or it sealed whole with the privacy key
);
CREATE INDEX IF NOT EXISTS frames_by_pair ON frames (stream, pair);
CREATE INDEX IF NOT EXISTS frames_by_t ON frames (stream, t);
"""


def budget_shares(max_bytes: int) -> tuple[int, int]:
    """``max_bytes`` (``archive.frames_mib``) split: the write-ahead log's share (a sixteenth, 64 KiB to 4 MiB) and
    the database's pages' (the rest, less the log's index)."""
    wal = min(4 << 20, max(64 << 10, max_bytes // 16))
    return wal, max_bytes - wal - SHM_BYTES


def _storable(pair) -> bool:
    """A pair number SQLite's INTEGER holds (one asked for outside it is simply not kept: no read error)."""
    return -(1 << 63) <= int(pair) < 1 << 63


class FrameStore:
    """``folder/frames.sqlite``: one downscaled JPEG a frame pair (the module's docstring)."""

    def __init__(self, folder: str | Path, *, max_bytes: int, px: int = 320, keys=None, max_age_s: float | None = None,
                 wait_when_full: bool = False, keep_free_bytes: int = 0) -> None:
        self.path = Path(folder) / FILE
        self.max_bytes, self.px, self.max_age_s = int(max_bytes), int(px), max_age_s
        self.wal_bytes, self.db_budget = budget_shares(self.max_bytes)
        self.keep_free_bytes = max(0, int(keep_free_bytes))  # archive.keep_free_gib: the disk's floor, as the archive's
        self.keys = keys if keys is not None and keys.enabled else None  # edgekv.privacy.KeyRing
        self.wait_when_full = wait_when_full
        self.written = self.dropped = self.write_errors = self.trimmed = self.read_errors = self.discarded = 0
        self.yielded = 0  # rows deleted only because the disk's free space fell to keep_free_bytes
        self._incremental = False  # the file's auto_vacuum is INCREMENTAL: freed pages can be given back to the disk
        self._giving = False  # below the floor and said so (the warning once a time, as the disk goes below it)
        self.set_aside: Path | None = None
        self.last_error: str | None = None
        self._warned: float | None = None  # when a failing write was last logged (None: writing fine)
        # age (``max_age_s``): the stream of the last frame this process wrote, its stream time and when (monotonic);
        # per stream the monotonic time this process last wrote one of its frames (one found at open: the open's)
        self._last: tuple[str, float, float] | None = None
        self._wrote_mono: dict[str, float] = {}
        self._opened_mono = time.monotonic()
        self._aged_mono: float | None = None  # when earlier streams were last aged by the wall clock
        self._clock_said = False  # the warning that the wall clock cannot age a frame, given once
        self._lock = threading.Lock()  # the one connection: the writer's rows, a reader's lookups, a forget
        self.closed = False  # True once ``close`` has let go of the file (a stop past its budget closes it late)
        self._db = self._open()
        self._bytes, self._rows = self._totals()
        self._fit()
        self._convert()
        self._queue: queue.Queue = queue.Queue(maxsize=QUEUE_FRAMES)
        self._thread = threading.Thread(target=self._write_loop, name="edgekv-frames", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the file
    def _open(self) -> sqlite3.Connection:
        """The file, checked; one that is not a database or fails ``quick_check`` is set aside and a new one begun.
        An I/O error (a read-only or failing disk: ``sqlite3.OperationalError``) is raised: that is no damage."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = None
        try:
            db = self._connect()
            ok = db.execute("PRAGMA quick_check").fetchone()[0]
            if ok != "ok":
                raise sqlite3.DatabaseError(ok)
            db.executescript(_SCHEMA)
            return db
        except sqlite3.OperationalError:
            if db is not None:
                db.close()
            raise
        except sqlite3.DatabaseError as exc:  # not a database, or a damaged one: set aside whole, begin anew
            if db is not None:
                db.close()
            self._remove_set_aside()  # one kept at most: it is outside frames_mib
            self.set_aside = self.path.with_name(f"{FILE}.bad-{int(time.time())}")
            for suffix in ("", "-wal", "-shm"):
                part = Path(str(self.path) + suffix)
                if part.exists():
                    part.rename(Path(str(self.set_aside) + suffix))
            log.warning("evidence frames: %s does not check (%s); set aside as %s, a new one begun", self.path,
                        str(exc)[:200], self.set_aside.name)
            db = self._connect()
            db.executescript(_SCHEMA)
            return db

    def _fit(self) -> None:
        """(Before the writer starts.) A file larger than its share of ``max_bytes`` — the budget was lowered, or the
        file was written before the budget counted its pages — is trimmed, oldest first, then rebuilt compact
        (``VACUUM``: SQLite never gives a file's free pages back by itself). A failure (no room for the rebuild)
        is said and leaves the file as it was: the writer's trim holds it from then on, at its old size."""
        if self.path.stat().st_size <= self.db_budget:
            return
        before = self.file_bytes()
        try:
            with self._transaction(recount=False):
                self._trim_to(0)
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # a file made without it is converted by the rebuild
            self._db.execute("VACUUM")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except (sqlite3.Error, ValueError) as exc:
            log.warning("evidence frames: %s is larger than archive.frames_mib (%d bytes) and could not be made "
                        "smaller (%s)", self.path.name, self.max_bytes, exc)
        else:
            log.info("evidence frames: %s made to fit archive.frames_mib: %d bytes -> %d", self.path.name, before,
                     self.file_bytes())
        finally:
            self._bytes, self._rows = self._totals()

    def _convert(self) -> None:
        """(Before the writer starts, after ``_fit``.) A file made before the store gave room back (``auto_vacuum``
        NONE: SQLite can then never cut its freed pages off) is rebuilt with ``auto_vacuum = INCREMENTAL``
        (``VACUUM``, once). The rebuild writes a copy of the pages in use to SQLite's temporary folder (often this
        disk) and copies it back through the write-ahead log, so it is done only where the disk has twice the file
        free beyond ``keep_free_bytes`` — a conversion must not take the floor it serves; else the file opens as it
        is, said in one line, keeps its size below the floor as it did, and a later start converts it. A rebuild that
        fails (a full disk) is rolled back by SQLite, said, and tried again at the next start."""
        self._incremental = self._auto_vacuum() == 2
        if self._incremental:
            return
        from edgekv.archive.store import disk_free_bytes, size_text

        need = 2 * self.path.stat().st_size
        free = disk_free_bytes(self.path.parent)
        if free is not None and free - self.keep_free_bytes < need:
            log.warning("evidence frames: %s not converted to give room back below archive.keep_free_gib (%s): "
                        "its rebuild needs about %s free beyond that, the disk has %s beyond it; it keeps its size "
                        "below the floor until a later start converts it", self.path.name,
                        size_text(self.keep_free_bytes), size_text(need),
                        size_text(max(0, free - self.keep_free_bytes)))
            return
        before = self.file_bytes()
        try:
            self._db.execute("PRAGMA auto_vacuum=INCREMENTAL")  # outside a transaction, then the rebuild takes it
            self._db.execute("VACUUM")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as exc:
            log.warning("evidence frames: %s could not be converted to give room back below "
                        "archive.keep_free_gib (%s); a later start tries again", self.path.name, exc)
        finally:
            self._incremental = self._auto_vacuum() == 2
            self._bytes, self._rows = self._totals()
        if self._incremental:
            log.info("evidence frames: %s converted to give room back below archive.keep_free_gib (auto_vacuum "
                     "incremental): %d bytes -> %d", self.path.name, before, self.file_bytes())

    def _auto_vacuum(self) -> int:
        """The file's ``auto_vacuum``: 0 NONE, 1 FULL, 2 INCREMENTAL."""
        return int(self._db.execute("PRAGMA auto_vacuum").fetchone()[0])

    def _remove_set_aside(self) -> int:
        """Unlink the files a damaged start set aside (``frames.sqlite.bad-*``); returns how many."""
        parts = list(self.path.parent.glob(f"{FILE}.bad-*"))
        for part in parts:
            part.unlink(missing_ok=True)
        return len(parts)

    def _connect(self) -> sqlite3.Connection:
        # The owner's only, as the snapshots and the archive's segments: these are pictures of what the camera saw
        # (SQLite makes its -wal and -shm files with the database's mode). One an older edgekv made under a shell's
        # umask 022 is narrowed too.
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        if os.stat(self.path).st_mode & 0o077:
            os.chmod(self.path, 0o600)
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
        # first: a new file takes it only before its first table (and before WAL writes its first page); a file made
        # without it keeps NONE until a VACUUM (_convert), for which this also asks
        db.execute("PRAGMA auto_vacuum=INCREMENTAL")
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")  # WAL: a power cut loses at most the last rows, never the file
        db.execute("PRAGMA secure_delete=ON")  # a forgotten frame's bytes are overwritten, not only unlinked
        self._page = int(db.execute("PRAGMA page_size").fetchone()[0])
        db.execute(f"PRAGMA wal_autocheckpoint={max(4, self.wal_bytes // 2 // (self._page + 24))}")
        db.execute(f"PRAGMA journal_size_limit={self.wal_bytes}")
        return db

    def _in_use(self) -> int:
        """(In a transaction, or under the lock.) The bytes of the database's pages in use (not free)."""
        pages = self._db.execute("PRAGMA page_count").fetchone()[0]
        free = self._db.execute("PRAGMA freelist_count").fetchone()[0]
        return (int(pages) - int(free)) * self._page

    # ------------------------------------------------------------------ ingest side
    def submit(self, stream: str, pair: int, t: float, unix: float | None, frame: np.ndarray) -> bool:
        """Queue frame pair ``pair``'s frame (never blocks unless ``wait_when_full``); False when it was dropped (or
        the stream has no id yet: the archive gives it with its first pair)."""
        if stream is None:
            return False
        item = (stream, int(pair), float(t), None if unix is None else float(unix), frame)
        if self.wait_when_full:
            self._queue.put(item)
            return True
        try:
            self._queue.put_nowait(item)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if isinstance(item, threading.Event):  # flush(): everything queued before it is written
                    item.set()
                    continue
                self._write(*item)
            finally:
                self._queue.task_done()

    def _write(self, stream: str, pair: int, t: float, unix: float | None, frame: np.ndarray) -> None:
        try:
            data = encode_thumbnail(frame, self.px)
            if self.keys is not None:
                from edgekv.privacy import seal_blob

                data = seal_blob(self.keys, data)
            with self._lock:
                incoming = len(data) + ROW_BYTES + 2 * len(stream) + self._page  # the row, a page part-filled by it
                if self.keep_free_bytes and self._incremental:
                    self._give_back(incoming)
                with self._transaction():
                    self._trim(stream, t, incoming)
                    self._db.execute("INSERT INTO frames (stream, pair, t, unix, jpeg) VALUES (?, ?, ?, ?, ?)",
                                     (stream, pair, t, unix, data))
                    self._bytes, self._rows = self._bytes + len(data), self._rows + 1
                now = time.monotonic()
                newest = self._last[1] if self._last is not None and self._last[0] == stream else t
                self._last, self._wrote_mono[stream] = (stream, max(newest, t), now), now
                if self._tight():  # near the floor the log is folded back each frame, not left to grow to its share
                    self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self.written += 1
            self.last_error = None
        except Exception as exc:  # a full disk, an I/O error, a frame that does not encode: this frame only, never
            # the writer thread (a dead writer would drop every later frame without a word)
            self.write_errors += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:300]
            now = time.monotonic()
            if self._warned is None or now - self._warned >= WARN_EVERY_S:  # a full disk must not fill the log too
                self._warned = now
                log.warning("evidence frames: pair %d not written (%s; %d write error(s) so far, said at most once a "
                            "minute)", pair, self.last_error, self.write_errors)
            return
        if self._warned is not None:
            self._warned = None
            log.info("evidence frames: written again (%d write error(s) before)", self.write_errors)

    def _trim(self, stream: str, newest_t: float, incoming: int) -> None:
        """(In the writer's transaction, before a row of about ``incoming`` bytes goes in.) With ``max_age_s``, the
        rows past it (``_age``: this stream's behind the new frame; an earlier stream's by the wall clock, at most
        every ``AGE_EVERY_S``); then the oldest rows while the pages in use and the new row would pass the database's
        share of ``max_bytes``. A frame that would not fit an empty file is refused (a ``ValueError`` naming both:
        that frame is not written)."""
        if self.max_age_s is not None:
            self.trimmed += self._age(stream, newest_t)
        self._trim_to(incoming)

    def expire(self) -> int:
        """``max_age_s`` applied now, with no frame being written: what a paused camera (the privacy switch, for
        hours), one gone dark or a stream that has ended kept past it goes, which the trim before each frame never
        reached. The stream last written is aged in its stream time, taken to have gone on since its last frame by
        the monotonic clock (a live stream's time after a pause is the pause's length later; a paused recording,
        which resumes on its own clock, has its pause counted too: its frames go sooner, never later); the earlier
        streams' as when writing (``_age``). For the daemon to call every minute or so; returns how many frames
        went (-1: the file could not be written, logged)."""
        if self.max_age_s is None:
            return 0
        with self._lock:
            stream, now_t = (None, 0.0) if self._last is None else (
                self._last[0], self._last[1] + time.monotonic() - self._last[2])
            try:
                with self._transaction():
                    gone = self._age(stream, now_t, every=True)
            except sqlite3.Error as exc:  # a full disk or an I/O error: the next call, or the next frame, tries again
                log.warning("evidence frames: archive.max_age_s could not be applied (%s)", exc)
                return -1
            self.trimmed += gone
        return gone

    def _age(self, stream: str | None, now_t: float, every: bool = False) -> int:
        """(In a transaction.) The rows past ``max_age_s``; returns how many went. ``stream``'s (the stream being
        written) older than that behind its time ``now_t``: stream time only goes forward and a clock jump moves it by
        ``video.max_gap_s`` at most (edgekv/session/clock.py), so a wall clock set forward deletes none of them. An
        earlier stream's (a restart without the saved memory: another stream, its time on another scale, which the
        trim by stream time never reached) by the wall clock each frame was seen at (``unix``), and at least by the
        monotonic time since this process last wrote that stream or, for one found at open, opened the file; as
        the archive's segments are (``FrameArchive._too_old``). A wall time the clock calls the future (set back
        since) or before 2025 (not set then: a board without an RTC battery) ages nothing: said once, those frames
        go at the latest ``max_age_s`` after this start. A deletion by the wall clock is logged with the times, so a
        clock stepped forward does not empty the store unsaid. Earlier streams at most every ``AGE_EVERY_S`` unless
        ``every``: their query reads every row."""
        gone = 0
        if stream is not None:
            gone += self._delete("stream = ? AND t < ?", (stream, now_t - self.max_age_s))
        mono = time.monotonic()
        if not every and self._aged_mono is not None and mono - self._aged_mono < AGE_EVERY_S:
            return gone
        self._aged_mono = mono
        others = [row[0] for row in self._db.execute("SELECT DISTINCT stream FROM frames")
                  if row[0] != stream]
        for other in others:
            gone += self._age_earlier(other, mono)
        return gone

    def _age_earlier(self, stream: str, mono: float) -> int:
        """(In a transaction.) An earlier stream's rows past ``max_age_s`` (``_age``); returns how many went."""
        from edgekv.archive.store import _WALL_FLOOR, _WALL_SLACK_S, _duration_text, _wall_text

        if mono - self._wrote_mono.get(stream, self._opened_mono) > self.max_age_s:  # every one of them, whatever
            count = self._delete("stream = ?", (stream,))                            # the wall clock says
            if count:
                log.warning("evidence frames: %d frame(s) of an earlier stream (%s), none written for %s by the "
                            "monotonic clock, past archive.max_age_s %g s: deleted", count, stream[:8],
                            _duration_text(mono - self._wrote_mono.get(stream, self._opened_mono)), self.max_age_s)
            return count
        now = time.time()
        if not self._clock_said:
            low, high = self._db.execute("SELECT MIN(unix), MAX(unix) FROM frames WHERE stream = ? AND unix IS NOT "
                                         "NULL AND (unix < ? OR unix > ?)",
                                         (stream, _WALL_FLOOR, now + _WALL_SLACK_S)).fetchone()
            if low is not None:
                self._clock_said = True
                log.warning("evidence frames: archive.max_age_s: frames of an earlier stream (%s) were seen at %s by "
                            "the wall clock, which reads %s now (%s): their age is counted from this start instead, "
                            "so they go at the latest archive.max_age_s (%g s) after it (said once)", stream[:8],
                            _wall_text(high if high > now else low), _wall_text(now),
                            "set back since" if high > now else "not set then", self.max_age_s)
        where = "stream = ? AND unix IS NOT NULL AND unix >= ? AND unix <= ? AND unix < ?"
        args = (stream, _WALL_FLOOR, now + _WALL_SLACK_S, now - self.max_age_s)
        count, low, high = self._db.execute(f"SELECT COUNT(*), MIN(unix), MAX(unix) FROM frames WHERE {where}",
                                            args).fetchone()
        if not count:
            return 0
        log.warning("evidence frames: %d frame(s) of an earlier stream (%s), seen %s to %s by the wall clock, are "
                    "past archive.max_age_s %g s (now %s, the newest of them %s old): deleted", count, stream[:8],
                    _wall_text(low), _wall_text(high), self.max_age_s, _wall_text(now), _duration_text(now - high))
        return self._delete(where, args)

    def _trim_to(self, incoming: int) -> None:
        """(In a transaction.) The oldest rows go while the pages in use and ``incoming`` pass the database's share."""
        while (excess := self._in_use() + incoming - self.db_budget) > 0:
            last = self._oldest_covering(excess)
            if last is None:
                raise ValueError(f"a frame of {incoming} bytes does not fit archive.frames_mib "
                                 f"({self.max_bytes / 2**20:g} MiB, of it {self.db_budget} bytes for the database)")
            self.trimmed += self._delete("id <= ?", (last,))
        if self.keep_free_bytes:
            self._keep_the_floor(incoming)

    def _tight(self) -> bool:
        """The disk's free space within the log's share of ``keep_free_bytes`` (never without a floor)."""
        if not self.keep_free_bytes:
            return False
        from edgekv.archive.store import disk_free_bytes

        free = disk_free_bytes(self.path.parent)
        return free is not None and free < self.keep_free_bytes + self.wal_bytes

    def _keep_the_floor(self, incoming: int) -> None:
        """(In a transaction.) The file grows only where its growth and this transaction's write-ahead log (the new
        row's pages, the freed ones zeroed, a few b-tree pages) leave ``keep_free_bytes`` of the disk free; else
        the oldest rows go, their pages reused by the new row, so that near the floor the store keeps its size
        (below it, ``_give_back`` has already made the file smaller by the deficit and left the frame's pages free;
        a file not yet converted to ``auto_vacuum`` only keeps its size). Without growing, a frame needs only room
        for its log, which is truncated after each frame while the disk is near the floor; when even that is not
        there, an ``OSError`` (ENOSPC) naming the floor: that frame is not written."""
        from edgekv.archive.store import disk_free_bytes, size_text

        free = disk_free_bytes(self.path.parent)
        if free is None:
            return
        log_bytes = 2 * incoming + 8 * self._page
        while True:
            growth = incoming - int(self._db.execute("PRAGMA freelist_count").fetchone()[0]) * self._page
            if growth <= 0 and free > log_bytes:
                return  # reuses its own pages: the disk loses nothing once the log is folded back
            if growth > 0 and free - growth - log_bytes >= self.keep_free_bytes:
                return
            last = self._oldest_covering(growth) if growth > 0 else None  # only a file that would grow is helped
            if last is None:
                raise OSError(errno.ENOSPC, f"the disk has {size_text(free)} free and archive.keep_free_gib keeps "
                                            f"{size_text(self.keep_free_bytes)} free")
            self.yielded += self._delete("id <= ?", (last,))

    def _give_back(self, incoming: int) -> None:
        """(Under the lock, outside a transaction, before a frame of about ``incoming`` bytes.) While the disk's free
        space is below ``keep_free_bytes`` (another writer took it), the oldest rows go, enough for the deficit and
        the frame, and the file is cut by the deficit (its freed pages moved to its end and cut off,
        ``incremental_vacuum``, then the log truncated): the bytes go back to the file system, as the archive's
        oldest segments do; the frame's own pages stay free for it. ``_keep_the_floor`` alone cannot: it keeps the
        file from growing, and pages a deletion frees stay in the file. In steps of half the log's share, each a
        transaction of its own and the log truncated after it (the deleted pages, zeroed by ``secure_delete``, and
        those the vacuum moves pass through the log): the log stays within ``max_bytes``, and a disk near full
        needs room for one step only. With no row left, every free page goes and the frame is then refused by
        ``_keep_the_floor`` (ENOSPC); the deletions stand, as the archive's do."""
        from edgekv.archive.store import disk_free_bytes, size_text

        free = disk_free_bytes(self.path.parent)
        if free is None or free >= self.keep_free_bytes:
            self._giving = False
            return
        want = -(-(self.keep_free_bytes - free) // self._page)  # pages to cut off the file: the deficit
        keep = -(-incoming // self._page)  # pages left free for the frame
        step = max(1, self.wal_bytes // 2 // self._page)
        size, cut, rows = self.file_bytes(), 0, 0
        while cut < want:
            pages = min(step, want - cut)
            with self._transaction():
                while (short := pages + keep - self._free_pages()) > 0:
                    last = self._oldest_covering(short * self._page)
                    if last is None:
                        break  # nothing left to give
                    rows += self._delete("id <= ?", (last,))
            free_pages, count = self._free_pages(), self._page_count()
            if short > 0:  # no row left: every free page goes, the frame's too
                pages = free_pages
            if pages <= 0 or free_pages <= 0:
                break
            # executescript steps it to its end (execute would stop after its first page: the pragma yields a row
            # a page); outside a transaction, as auto_vacuum's pragmas must be
            self._db.executescript(f"PRAGMA incremental_vacuum({min(pages, free_pages)});")
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            done = count - self._page_count()
            cut += done
            if short > 0 or done <= 0:
                break
        self.yielded += rows
        if (rows or cut) and not self._giving:
            self._giving = True
            log.warning("evidence frames: the disk has %s free, below archive.keep_free_gib (%s): the oldest %d "
                        "frame(s) deleted and %s given back to the disk (%s -> %s; said once until the disk is above "
                        "the floor again)", size_text(free), size_text(self.keep_free_bytes), rows,
                        size_text(size - self.file_bytes()), size_text(size), size_text(self.file_bytes()))

    @contextlib.contextmanager
    def _transaction(self, recount: bool = True) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``; on any failure rolled back (SQLITE_FULL and I/O errors may have rolled
        it back already) and, with ``recount``, the running totals read again from the file, then re-raised."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            if recount:
                self._bytes, self._rows = self._totals()
            raise

    def _free_pages(self) -> int:
        return int(self._db.execute("PRAGMA freelist_count").fetchone()[0])

    def _page_count(self) -> int:
        return int(self._db.execute("PRAGMA page_count").fetchone()[0])

    def _oldest_covering(self, excess: int) -> int | None:
        """(In a transaction.) The id of the last of the fewest oldest rows whose bytes cover ``excess`` (at least
        one row, at most 64: the caller asks again); None when there is no row."""
        last = None
        for row_id, size in self._db.execute("SELECT id, LENGTH(jpeg) FROM frames ORDER BY id LIMIT 64"):
            excess, last = excess - size - ROW_BYTES, row_id
            if excess <= 0:
                break
        return last

    def _delete(self, where: str, args: tuple) -> int:
        """(In a transaction.) Delete the rows ``where`` holds (no ``RETURNING``: SQLite 3.31 of JetPack 5 lacks it)
        and count their bytes out; returns how many rows went."""
        count, size = self._db.execute(f"SELECT COUNT(*), COALESCE(SUM(LENGTH(jpeg)), 0) FROM frames WHERE {where}",
                                       args).fetchone()
        if count:
            self._db.execute(f"DELETE FROM frames WHERE {where}", args)
            self._bytes, self._rows = self._bytes - int(size), self._rows - int(count)
        return int(count)

    def _totals(self) -> tuple[int, int]:
        """(Under the lock, or before the writer starts.) The blobs' bytes and the rows, as the file has them."""
        size, rows = self._db.execute("SELECT COALESCE(SUM(LENGTH(jpeg)), 0), COUNT(*) FROM frames").fetchone()
        return int(size), int(rows)

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every frame queued so far is written (or failed); False on timeout."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)
        except queue.Full:
            return False
        return done.wait(timeout)

    # ------------------------------------------------------------------ question side
    def jpeg(self, stream: str | None, pair: int) -> bytes | None:
        """Frame pair ``pair``'s JPEG of ``stream``, opened if sealed; None when it is not kept or does not read."""
        if stream is None or not _storable(pair):
            return None
        try:
            with self._lock:
                row = self._db.execute("SELECT jpeg FROM frames WHERE stream = ? AND pair = ? ORDER BY id DESC "
                                       "LIMIT 1", (stream, int(pair))).fetchone()
        except (sqlite3.Error, OverflowError) as exc:
            self.read_errors += 1
            log.warning("evidence frames: pair %s does not read (%s)", pair, exc)
            return None
        if row is None:
            return None
        return self._plain(row[0], pair)

    def last_pair(self, stream: str | None) -> int | None:
        """The highest pair number of ``stream`` kept (None: none, or it does not read)."""
        value = self._of_stream("MAX(pair)", stream)
        return None if value is None else int(value)

    def oldest_t(self, stream: str | None) -> float | None:
        """The stream time of ``stream``'s oldest frame kept (None: none, or it does not read)."""
        value = self._of_stream("MIN(t)", stream)
        return None if value is None else float(value)

    def _of_stream(self, aggregate: str, stream: str | None):
        """One of this module's aggregates (``MIN(t)``, ``MAX(pair)``) over ``stream``'s rows; None without any."""
        if stream is None:
            return None
        try:
            with self._lock:
                row = self._db.execute(f"SELECT {aggregate} FROM frames WHERE stream = ?", (stream,)).fetchone()
        except sqlite3.Error:
            return None
        return None if row is None else row[0]

    def has(self, stream: str | None, pair: int) -> bool:
        if stream is None or not _storable(pair):
            return False
        try:
            with self._lock:
                return self._db.execute("SELECT 1 FROM frames WHERE stream = ? AND pair = ? LIMIT 1",
                                        (stream, int(pair))).fetchone() is not None
        except (sqlite3.Error, OverflowError):
            return False

    def _plain(self, data: bytes, pair: int) -> bytes | None:
        from edgekv.privacy import SealError, blob_key_id, open_blob

        if blob_key_id(data) is None:
            return data if data[:2] == b"\xff\xd8" else None  # a JPEG written in the clear
        try:
            return open_blob(self.keys, data, f"{self.path.name} pair {pair}")
        except SealError as exc:
            self.read_errors += 1
            log.warning("evidence frames: %s", exc)
            return None

    # ------------------------------------------------------------------ forget, rekey
    def forget(self, t_from: float, t_to: float, stream: str | None) -> int:
        """Delete ``stream``'s frames of stream time [t_from, t_to] (those still queued are written first, then go
        too), their bytes overwritten, and truncate the write-ahead log; a file set aside as damaged is unlinked (it
        may hold the stretch and cannot be read to tell). Returns how many went."""
        if stream is None:
            return 0
        self.flush()
        where, args, gone = "stream = ? AND t BETWEEN ? AND ?", (stream, t_from, t_to), None
        if self._remove_set_aside():  # a damaged file set aside at a start may hold the stretch: it goes too
            log.info("evidence frames: the file set aside as damaged removed with the forget")
        with self._lock:
            try:
                gone = self._db.execute(f"SELECT COUNT(*) FROM frames WHERE {where}", args).fetchone()[0]
                with self._transaction():
                    self._delete(where, args)
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as exc:  # no room for the deletion's log (a full disk), an I/O error, damage
                self._discard(f"a forget could not be written ({exc})")
                return -1 if gone is None else int(gone)
        return int(gone)

    def _discard(self, why: str) -> None:
        """(Under the lock.) Every evidence frame dropped: the files unlinked and a new, empty one begun — what a
        forget does when it cannot write its deletion, so that the stretch never stays on the disk."""
        self._db.close()
        for suffix in ("", "-wal", "-shm"):
            Path(str(self.path) + suffix).unlink(missing_ok=True)
        log.warning("evidence frames: %s; every evidence frame dropped (%s unlinked), a new file begun", why,
                    self.path.name)
        self.discarded += 1
        self._db = self._connect()
        self._db.executescript(_SCHEMA)
        self._incremental = self._auto_vacuum() == 2
        self._bytes = self._rows = 0

    def reseal(self, dry_run: bool = False) -> dict:
        """Every row sealed with the current key (``edgekv rekey``): rows in the clear or under an older key of the
        ring are rewritten; a row no key opens is left and counted. One transaction, then the log truncated."""
        from edgekv.privacy import SealError, blob_key_id, open_blob, seal_blob

        current = self.keys.current.id if self.keys is not None else None
        counts = {"resealed": 0, "current": 0, "unopened": 0}
        with self._lock:
            rows = self._db.execute("SELECT id, pair, jpeg FROM frames").fetchall()
            updates = []
            for row_id, pair, data in rows:
                key_id = blob_key_id(data)
                if current is None or key_id == current:
                    counts["current"] += 1
                    continue
                try:
                    plain = data if key_id is None else open_blob(self.keys, data, f"{self.path.name} pair {pair}")
                except SealError:
                    counts["unopened"] += 1
                    continue
                updates.append((seal_blob(self.keys, plain), row_id))
            counts["resealed"] = len(updates)
            if updates and not dry_run:
                self._db.execute("BEGIN IMMEDIATE")
                self._db.executemany("UPDATE frames SET jpeg = ? WHERE id = ?", updates)
                self._db.execute("COMMIT")
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self._bytes, self._rows = self._totals()
        return counts

    # ------------------------------------------------------------------ figures, close
    def stats(self) -> dict:
        """The figures (no query: the status page asks every second)."""
        return {"frames_kept": self._rows, "frames_bytes": self._bytes, "frames_file_bytes": self.file_bytes(),
                "frames_written": self.written,
                "frames_dropped": self.dropped, "frames_write_errors": self.write_errors,
                "frames_trimmed": self.trimmed, "frames_yielded": self.yielded, "frames_discarded": self.discarded,
                "frames_last_error": self.last_error}

    def file_bytes(self) -> int:
        """The bytes of the files on the disk (database, log, its index): what ``max_bytes`` bounds."""
        total = 0
        for suffix in ("", "-wal", "-shm"):
            try:
                total += Path(str(self.path) + suffix).stat().st_size
            except OSError:
                pass
        return total

    def __enter__(self) -> "FrameStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued, then close the file."""
        if self._thread.is_alive():
            try:
                self._queue.put(_STOP, timeout=timeout)
            except queue.Full:
                pass
            self._thread.join(timeout)
        with self._lock:
            try:
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error:
                pass
            self._db.close()
            self.closed = True


def encode_thumbnail(frame: np.ndarray, px: int) -> bytes:
    """``frame`` (H x W x 3 BGR, or gray) scaled down to ``px`` on its long side (never up) as a JPEG (OpenCV's,
    or without the ``video`` extra the same from numpy and Pillow: edgekv/images.py)."""
    from edgekv.images import encode_jpeg, shrink

    height, width = frame.shape[:2]
    scale = px / max(height, width)
    if scale < 1:
        frame = shrink(frame, max(1, round(width * scale)), max(1, round(height * scale)))
    return encode_jpeg(frame, JPEG_QUALITY)
