"""archive.max_age_s across restarts: an earlier stream's segments (a restart without the saved memory: a new stream,
its time on another scale) are aged by the wall clock since they were written, at least by the time this process has
held them; a wall clock that cannot say (set back, never set) ages nothing and says so once."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from helpers_archive import SHAPE, TOKENS, pair_kv

import edgekv.archive.store as store
from edgekv.archive.store import FrameArchive

DAY = 86400.0
A, B = b"a" * 16, b"b" * 16  # the stream before the restart, the one after it


def _archive(folder: Path, **kw) -> FrameArchive:
    record = SHAPE.record_bytes(TOKENS)
    return FrameArchive(folder, SHAPE, max_bytes=1 << 20, segment_bytes=2 * record + 200, max_age_s=3600.0, **kw)


def _fill(archive: FrameArchive, pairs: range, stream: bytes, t0: float) -> None:
    for pair in pairs:
        k, v = pair_kv(pair)
        while not archive.submit(k, v, frame=pair, t=t0 + pair, tpos=10 + pair, t_offset=0, rows=2, cols=2,
                                 stream=stream):
            archive.flush()
    assert archive.flush()


def _segments(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("seg-*.ekva"))


def _written_at(folder: Path, unix: float) -> None:
    for path in folder.glob("seg-*.ekva"):
        os.utime(path, (unix, unix))


def test_an_earlier_streams_segments_age_by_the_wall_clock_after_a_restart(tmp_path, caplog):
    """Stream A's pairs were stamped 5,000 s; the new stream B starts at 0 s. Behind B's newest pair they were 'in
    the future' and never aged; written two days ago by the wall clock, they are past max_age_s (1 h)."""
    archive = _archive(tmp_path)
    _fill(archive, range(6), A, 5000.0)
    archive.close()
    before = _segments(tmp_path)
    _written_at(tmp_path, time.time() - 2 * DAY)
    reopened = _archive(tmp_path)
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        _fill(reopened, range(6, 8), B, 0.0)
    assert {e.stream for e in reopened.entries()} == {B}
    assert not set(before) & set(_segments(tmp_path))
    said = [r.getMessage() for r in caplog.records if "by the wall clock" in r.getMessage()]
    assert len(said) == len(before) and "of an earlier stream" in said[0] and "2.0 d old" in said[0], said
    reopened.close()


def test_a_young_earlier_stream_is_kept_whatever_its_stream_times(tmp_path):
    """Stream A's pairs at 0-5 s, written just now; the new stream B's at 100,000 s (a camera that stamps with its
    uptime): behind B's newest pair A's were 28 h old and went at once."""
    archive = _archive(tmp_path)
    _fill(archive, range(6), A, 0.0)
    archive.close()
    reopened = _archive(tmp_path)
    _fill(reopened, range(6, 10), B, 100000.0)
    assert [e.pair for e in reopened.entries(A)] == list(range(6))
    _fill(reopened, range(10, 20), B, 100000.0 + 3600.0)  # B's own old pairs still go by its stream time
    assert min(e.t for e in reopened.entries(B)) > 100000.0 + 10
    assert [e.pair for e in reopened.entries(A)] == list(range(6))
    reopened.close()


@pytest.mark.parametrize("written", ["future", "unset"])
def test_a_wall_clock_that_cannot_say_ages_from_the_start_and_says_so_once(tmp_path, caplog, monkeypatch, written):
    """Written 'tomorrow' (the clock was set back since) or in 1970 (a board without an RTC battery, before NTP):
    nothing is deleted for it, one warning names both times, and the segments go max_age_s after this start (the
    monotonic clock, stepped here)."""
    archive = _archive(tmp_path)
    _fill(archive, range(6), A, 5000.0)
    archive.close()
    before = _segments(tmp_path)
    _written_at(tmp_path, time.time() + DAY if written == "future" else 3600.0)
    reopened = _archive(tmp_path)
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        _fill(reopened, range(6, 12), B, 0.0)
    assert [e.pair for e in reopened.entries(A)] == list(range(6)) and set(before) <= set(_segments(tmp_path))
    said = [r.getMessage() for r in caplog.records if "archive.max_age_s" in r.getMessage()]
    assert len(said) == 1, said
    assert ("set back since" if written == "future" else "not set then") in said[0]
    assert "counted from this start instead" in said[0]

    class Later:  # the monotonic clock an hour and a minute on; everything else the real one
        def __getattr__(self, name):
            return getattr(time, name)

        def monotonic(self) -> float:
            return time.monotonic() + 3660.0

    monkeypatch.setattr(store, "time", Later())
    _fill(reopened, range(12, 14), B, 6.0)
    assert reopened.entries(A) == [] and not set(before) & set(_segments(tmp_path))
    reopened.close()


def test_a_forget_keeps_a_segments_wall_time(tmp_path):
    """A forget rewrites a segment; it is no newer for that (max_age_s would have kept it a day longer)."""
    archive = _archive(tmp_path)
    _fill(archive, range(6), A, 5000.0)
    _written_at(tmp_path, time.time() - 600.0)
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("seg-*.ekva")}
    assert archive.forget(5000.0, 5000.0)["segments_rewritten"] == 1
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("seg-*.ekva")} == stamps
    archive.close()
