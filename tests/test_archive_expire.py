"""``FrameArchive.expire``: archive.max_age_s with nothing being written. Retention runs before each record, so a
camera paused for hours (the privacy switch), gone dark or at the end of its stream kept every segment past
max_age_s on the disk until the next pair; the daemon calls ``expire`` every minute or so. The monotonic clock is
stepped here (never slept)."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from helpers_archive import aging_archive
from helpers_archive import MonotonicLater as _Later
from helpers_archive import fill_at as _fill
from helpers_archive import segment_names as _segments

import edgekv.archive.store as store
from edgekv.archive.store import FrameArchive

A = b"a" * 16


def _archive(folder: Path, max_age_s: float | None = 60.0) -> FrameArchive:
    return aging_archive(folder, max_age_s)


def test_a_paused_stream_ages_on_and_its_segments_go_the_open_one_too(tmp_path, monkeypatch):
    """Pairs at 0-90 s (two a segment), then a pause: 300 s of nothing leaves them all within max_age_s (600 s); at
    545 s after the last pair (stream time about 635 s) the two segments whose newest pair is before 35 s are gone,
    at 2,000 s every one, the open segment with them; the next pair begins a new segment."""
    archive = _archive(tmp_path, max_age_s=600.0)
    _fill(archive, [(pair, 10.0 * pair) for pair in range(10)])
    assert archive.expire() == 0 and len(_segments(tmp_path)) == 5
    monkeypatch.setattr(store, "time", _Later(300.0))
    assert archive.expire() == 0 and archive.pairs == 10
    monkeypatch.setattr(store, "time", _Later(545.0))
    assert archive.expire() == 2
    assert sorted(e.pair for e in archive.entries()) == [4, 5, 6, 7, 8, 9] and len(_segments(tmp_path)) == 3
    monkeypatch.setattr(store, "time", _Later(2000.0))
    assert archive._current is not None and archive.expire() == 3
    assert archive.pairs == 0 and _segments(tmp_path) == [] and archive._current is None
    assert archive.stats()["archive_segments"] == 0
    _fill(archive, [(10, 2100.0)])  # the stream goes on in a new segment
    assert [e.pair for e in archive.entries()] == [10] and len(_segments(tmp_path)) == 1
    archive.close()
    assert [e.pair for e in _archive(tmp_path).entries()] == [10]


def test_without_max_age_or_anything_past_it_expire_deletes_nothing(tmp_path, monkeypatch):
    archive = _archive(tmp_path, max_age_s=None)
    _fill(archive, [(pair, float(pair)) for pair in range(6)])
    monkeypatch.setattr(store, "time", _Later(10 * 86400.0))
    assert archive.expire() == 0 and archive.pairs == 6
    archive.close()
    assert archive.expire() == 0  # closed: nothing, no error


def test_before_anything_is_written_segments_age_as_an_earlier_streams(tmp_path, monkeypatch, caplog):
    """A restart that starts paused (the pause kept across it): nothing is written, so every segment is aged by the
    wall clock since it was written (said with the times), and at least by the time since the open."""
    archive = _archive(tmp_path)
    _fill(archive, [(pair, 5000.0 + pair) for pair in range(4)], A)
    old = _segments(tmp_path)
    _fill(archive, [(pair, 5004.0) for pair in range(4, 6)], A)
    archive.close()
    young = sorted(set(_segments(tmp_path)) - set(old))
    for path in old:
        os.utime(tmp_path / path, (time.time() - 7200.0,) * 2)  # written two hours ago
    reopened = _archive(tmp_path)
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        assert reopened.expire() == len(old)
    assert _segments(tmp_path) == young and sorted(e.pair for e in reopened.entries()) == [4, 5]
    said = [r.getMessage() for r in caplog.records if "by the wall clock" in r.getMessage()]
    assert len(said) == len(old) and "2.0 h old" in said[0], said
    monkeypatch.setattr(store, "time", _Later(61.0))  # held longer than max_age_s since the open: they go too
    assert reopened.expire() == len(young) and reopened.pairs == 0
    reopened.close()


def test_the_daemon_applies_max_age_s_to_its_files_each_minute_written_to_or_not(tiny_checkpoint, tmp_path):
    """The daemon's loop turn (paused, dark or ended included) applies ``archive.max_age_s`` to the archive and the
    evidence frames at most every ``EXPIRE_EVERY_S``, under the session's lock (a forget rewrites them under it)."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon, kept_config

    config = kept_config(tiny_checkpoint, tmp_path, archive={"max_age_s": 3600})
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        calls: list[tuple[str, bool]] = []

        def recorder(name):
            def expire():
                calls.append((name, daemon.lock._is_owned()))  # held by the thread that calls
                return 0
            return expire

        with daemon.lock:  # the loop's own turns wait here while the recorders go in
            daemon.frames.expire = recorder("frames")
            daemon.session.recall.archive.expire = recorder("archive")
            daemon._expired_at = None
        daemon._on_loop_tick()
        assert ("frames", True) in calls and ("archive", True) in calls and all(held for _, held in calls)
        done = len(calls)
        daemon._on_loop_tick()  # within the minute: not again
        assert len(calls) == done


def test_a_store_whose_expire_fails_does_not_end_the_camera_loop(tiny_checkpoint, tmp_path, monkeypatch):
    """The loop's turn runs ``_expire_kept``; an exception out of one store (a bug, a fault its own handling missed)
    ended the main loop. It is logged, the other store is still aged, and the next minute tries again."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon, kept_config

    config = kept_config(tiny_checkpoint, tmp_path, archive={"max_age_s": 3600})
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        archive_calls = []

        def broken():
            raise OSError(5, "Input/output error")

        with daemon.lock:
            daemon.frames.expire = broken
            daemon.session.recall.archive.expire = lambda: archive_calls.append(1) or 0
            daemon._expired_at = None
        import edgekv.apps.daemon.loop as loop

        logged = []
        monkeypatch.setattr(loop.log, "exception", lambda *args: logged.append(args[0] % args[1:]))
        daemon._on_loop_tick()  # raised OSError out of the loop's turn
        assert archive_calls and logged == ["archive.max_age_s: applying it to FrameStore failed"], logged
