"""A stop on slow flash: the archive's queued frame pairs reach the disk before the final snapshot is written
(``Daemon.shutdown``, ``Daemon._close_archive``).

Before: the final snapshot came first. On an SD card a snapshot (224 MiB at the 3B shape) spent the stop's budget
(``STOP_BUDGET_S``), the archive's close was then given no time (``_bounded`` left it behind) and the process went —
systemd kills it at ``TimeoutStopSec`` — with the queued pairs, though the snapshot held them: a hole in the archive
that no restart fills.

Simulated at the boundaries, with no sleep and no timing: the stop's clock is a fake one that an ``fsync`` of a file
under ``state.dir`` moves on by the bytes written since that file's last sync at a slow rate; the archive's records
past the first ``keep`` wait at their write until the stop asks the archive to write them (its ``flush``), and a stop
that asks for them after its budget is spent has been killed by then: they are never written."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import edgekv.apps.daemon.loop as loop
from edgekv.archive.store import RECORD_MAGIC, FrameArchive, SegmentFiles

BUDGET_S = 120.0  # the stop's budget in these tests: generous in real seconds (the archive's close is waited on)


class _SlowFlashKilledAtTheBudget:
    """The stop's fake clock ``now`` (seconds since the stop began), moved on by syncs of files under ``state``; the
    archive's record writes after the first ``keep`` held until a flush during the stop, within the budget."""

    def __init__(self, state: Path, keep: int, rate: float) -> None:
        self.state, self.keep, self.rate = str(state), keep, rate
        self.now = [0.0]
        self.stopping = threading.Event()  # the stop began: the clock counts
        self.opened = threading.Event()    # the held records may be written
        self.held = threading.Event()      # the writer waits at a held record
        self.heads = 0
        self.stuck = False                 # the disk takes no more records (never opened)
        self.synced: dict[str, int] = {}

    def install(self, monkeypatch) -> None:
        real_pwrite, real_flush = SegmentFiles.pwrite, FrameArchive.flush
        flash = self

        def pwrite(files, fd: int, data, offset: int) -> int:
            if bytes(memoryview(data)[:len(RECORD_MAGIC)]) == RECORD_MAGIC:
                flash.heads += 1
                if flash.heads > flash.keep and not flash.opened.is_set():
                    flash.held.set()
                    flash.opened.wait(300)  # the test opens it when done (a killed process writes nothing more)
            return real_pwrite(files, fd, data, offset)

        def flush(archive, timeout: float | None = 30.0) -> bool:
            if flash.stopping.is_set() and flash.now[0] < BUDGET_S and not flash.stuck:
                flash.opened.set()
            return real_flush(archive, timeout)

        monkeypatch.setattr(SegmentFiles, "pwrite", pwrite)
        monkeypatch.setattr(FrameArchive, "flush", flush)
        for name in ("fsync", "fdatasync"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, self._sync(getattr(os, name)))

    def _sync(self, real):
        def sync(fd: int) -> None:
            try:
                where = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                where = ""
            if self.stopping.is_set() and where.startswith(self.state) and os.path.isfile(where):
                position = os.fstat(fd).st_size
                self.now[0] += max(0, position - self.synced.get(where, 0)) / self.rate
                self.synced[where] = position
            real(fd)
        return sync


@pytest.fixture
def slow_stop(tiny_checkpoint, tmp_path, monkeypatch):
    """An ended daemon whose archive wrote its first 4 pairs and holds the others queued, on flash that takes far
    longer than the stop's budget to take its final snapshot."""
    pytest.importorskip("fastapi")
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("the slow flash is told from /proc/self/fd (Linux)")
    from helpers_server import ended_daemon, kept_config

    monkeypatch.setattr(loop, "STOP_BUDGET_S", BUDGET_S)
    flash = _SlowFlashKilledAtTheBudget(tmp_path / "state", keep=4, rate=256.0)  # 64 KiB: 256 s
    flash.install(monkeypatch)
    config = kept_config(tiny_checkpoint, tmp_path, archive=True).with_overrides(
        archive={"when_full": "drop", "queue_pairs": 64})  # every pair queued, none dropped
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        try:
            assert flash.held.wait(120), "the archive's writer never reached a held record"
            daemon.stop_clock = lambda: flash.now[0]
            yield daemon, flash, tmp_path
        finally:
            flash.opened.set()  # the writer let go before the daemon's end is waited for (a killed process's is gone)


def _stop(daemon, flash) -> None:
    flash.stopping.set()
    daemon.stop.event.set()
    thread = daemon._loop_thread
    assert thread is not None
    thread.join(300)
    assert not thread.is_alive()


def test_a_final_snapshot_past_the_budget_leaves_every_pair_it_holds_in_the_archive(slow_stop):
    daemon, flash, tmp_path = slow_stop
    pairs = daemon.session.counters.frame_pairs
    archive = daemon.session.recall.archive
    assert pairs == 24 and archive.stats()["archive_dropped"] == 0
    assert len(archive.entries()) <= flash.keep  # the rest queued, held at their write
    _stop(daemon, flash)
    said = (tmp_path / "out.txt").read_text()
    assert "memory saved" in said and flash.now[0] > BUDGET_S  # the snapshot was written, past the budget
    assert sorted(e.frame for e in archive.entries()) == list(range(pairs))
    assert archive.closed and daemon.frames.closed
    lines = [line for line in said.splitlines() if line.startswith("shutdown: past the stop's budget")]
    assert len(lines) == 1 and "not waited for: " in lines[0], said
    assert "archive" not in lines[0] and "evidence frames" not in lines[0]
    reopened = FrameArchive(archive.dir, archive.shape, max_bytes=archive.max_bytes,
                            segment_bytes=archive.segment_bytes)
    try:
        assert sorted(e.frame for e in reopened.entries()) == list(range(pairs))  # on the disk, not only indexed
    finally:
        reopened.close()


def test_an_archive_that_cannot_write_in_the_budget_is_said_and_the_snapshot_still_written(slow_stop, monkeypatch):
    """A disk that does not take the queued pairs within the budget (2 s here: waited for in real time): the stop says
    how many are still queued, gives the final snapshot its turn, and names the archive among what it did not wait
    for."""
    daemon, flash, tmp_path = slow_stop
    monkeypatch.setattr(loop, "STOP_BUDGET_S", 2.0)
    flash.stuck = True
    _stop(daemon, flash)
    said = (tmp_path / "out.txt").read_text()
    assert "memory saved" in said
    line = next(line for line in said.splitlines() if line.startswith("shutdown: the archive did not write"))
    assert "still queued" in line and "lost if the process is killed" in line
    past = next(line for line in said.splitlines() if line.startswith("shutdown: past the stop's"))
    assert past.endswith("archive") or "archive, " in past
    assert len(daemon.session.recall.archive.entries()) <= flash.keep
