"""Evidence frames' archive.max_age_s across restarts and pauses (apps/daemon/frame_store.py ``_age``, ``expire``):
an earlier stream's frames (a restart without the saved memory: a new stream, its time on another scale) were aged
only against the current stream's time, i.e. never, and a paused camera aged nothing until its next frame. Now an
earlier stream's go by the wall clock they were seen at (guarded against a clock set back or never set, and at
least by the monotonic time this process has held them), and ``expire`` ages them all with nothing being written.
The monotonic clock is stepped here (never slept)."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from helpers_archive import MonotonicLater as _Later

import edgekv.apps.daemon.frame_store as frame_store
from edgekv.apps.daemon.frame_store import FrameStore

A, B = "aa" * 16, "bb" * 16  # the stream before the restart, the one after it
DAY = 86400.0


def _store(folder, **kw) -> FrameStore:
    return FrameStore(folder, **{"max_bytes": 1 << 20, "px": 32, "max_age_s": 3600.0, **kw})


def _fill(store: FrameStore, stream: str, times, unix: float | None) -> None:
    """Frames ``times`` (pair, stream time), seen at ``unix`` + their time (None: no wall time)."""
    for pair, t in times:
        seen = None if unix is None else unix + t
        assert store.submit(stream, pair, t, seen, np.full((24, 32, 3), pair % 250, np.uint8))
        assert store.flush()


def _pairs(store: FrameStore, stream: str, pairs) -> list[int]:
    return [pair for pair in pairs if store.has(stream, pair)]


def test_an_earlier_streams_frames_age_by_the_wall_clock_after_a_restart(tmp_path, caplog):
    """Stream A's frames were stamped 5,000 s and seen two days ago; the new stream B starts at 0 s. Behind B's
    newest frame they were 'in the future' and never aged; by the wall clock they are past max_age_s (1 h)."""
    with _store(tmp_path) as store:
        _fill(store, A, [(pair, 5000.0 + pair) for pair in range(6)], time.time() - 2 * DAY - 5000.0)
    with _store(tmp_path) as store, caplog.at_level(logging.WARNING, logger="edgekv.frames"):
        _fill(store, B, [(pair, float(pair)) for pair in range(2)], time.time())
        assert _pairs(store, A, range(6)) == [] and _pairs(store, B, range(2)) == [0, 1]
        assert store.stats()["frames_kept"] == 2 and store.stats()["frames_trimmed"] == 6
    (line,) = [r.getMessage() for r in caplog.records]
    assert "6 frame(s) of an earlier stream (aaaaaaaa), seen " in line and "by the wall clock" in line, line
    assert "past archive.max_age_s 3600 s" in line and "2.0 d old): deleted" in line, line


def test_a_young_earlier_stream_is_kept_whatever_its_stream_times(tmp_path):
    """A's frames at 0-5 s, seen just now; B's at 100,000 s (a camera stamping its uptime): A's are kept, while B's
    own old frames still go by B's stream time."""
    with _store(tmp_path) as store:
        _fill(store, A, [(pair, float(pair)) for pair in range(6)], time.time())
    with _store(tmp_path) as store:
        _fill(store, B, [(pair, 100000.0 + pair) for pair in range(3)], time.time() - 100000.0)
        _fill(store, B, [(pair, 100000.0 + 3600.0 + pair) for pair in range(3, 5)], time.time() - 103600.0)
        assert _pairs(store, A, range(6)) == list(range(6))
        assert _pairs(store, B, range(5)) == [3, 4]  # 100,000-100,002 s are past 1 h behind 103,604 s
        assert store.expire() == 0 and _pairs(store, A, range(6)) == list(range(6))


@pytest.mark.parametrize("seen", ["future", "unset", "none"])
def test_a_wall_clock_that_cannot_say_ages_from_the_start_and_says_so_once(tmp_path, caplog, monkeypatch, seen):
    """Seen 'tomorrow' (the clock set back since), in 1970 (a board without an RTC battery) or at no wall time (a
    recording read as fast as it goes): nothing goes for it, the clock's case is said once, and they go max_age_s
    after this start by the monotonic clock (with the stream written now, paused as long)."""
    unix = {"future": time.time() + DAY, "unset": 3600.0, "none": None}[seen]
    with _store(tmp_path) as store:
        _fill(store, A, [(pair, float(pair)) for pair in range(4)], unix)
    with _store(tmp_path) as store, caplog.at_level(logging.WARNING, logger="edgekv.frames"):
        _fill(store, B, [(pair, float(pair)) for pair in range(3)], time.time())
        assert store.expire() == 0 and _pairs(store, A, range(4)) == list(range(4))
        said = [r.getMessage() for r in caplog.records]
        if seen == "none":
            assert said == []
        else:
            (line,) = said
            assert ("set back since" if seen == "future" else "not set then") in line
            assert "counted from this start instead" in line
        monkeypatch.setattr(frame_store, "time", _Later(3601.0))  # B's own go too: its time went on an hour
        assert store.expire() == 7 and _pairs(store, A, range(4)) == [] and _pairs(store, B, range(3)) == []
    assert any("none written for 1.0 h by the monotonic clock" in r.getMessage() for r in caplog.records)


def test_a_paused_stream_ages_on_with_nothing_written(tmp_path, monkeypatch):
    """Frames at 0-90 s, then the privacy switch: nothing is written, yet the stream's time goes on. 300 s later all
    are within max_age_s (600 s); 545 s later (stream time about 635 s) those before 35 s are gone; 2,000 s later
    every one. The next frame goes in."""
    with _store(tmp_path, max_age_s=600.0) as store:
        _fill(store, A, [(pair, 10.0 * pair) for pair in range(10)], time.time())
        assert store.expire() == 0
        monkeypatch.setattr(frame_store, "time", _Later(300.0))
        assert store.expire() == 0 and _pairs(store, A, range(10)) == list(range(10))
        monkeypatch.setattr(frame_store, "time", _Later(545.0))
        assert store.expire() == 4 and _pairs(store, A, range(10)) == [4, 5, 6, 7, 8, 9]
        monkeypatch.setattr(frame_store, "time", _Later(2000.0))
        assert store.expire() == 6 and store.stats()["frames_kept"] == 0 and store.stats()["frames_trimmed"] == 10
        _fill(store, A, [(10, 2100.0)], time.time())
        assert _pairs(store, A, range(11)) == [10]
    with _store(tmp_path, max_age_s=None) as store:  # no max_age_s: nothing, ever
        monkeypatch.setattr(frame_store, "time", _Later(10 * DAY))
        assert store.expire() == 0 and _pairs(store, A, range(11)) == [10]
