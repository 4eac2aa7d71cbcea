"""A snapshot, and an archive segment rewritten by a forget, reach the disk a step at a time, each step a sign of
life for the systemd watchdog (``edgekv.state._Paced``, ``FrameArchive.forget``'s ``progress``).

Before: a snapshot (224 MiB at the 3B shape) was written to the page cache in a moment and then synced in one
``fsync`` that lasted as long as the flash took. On slow flash (an SD card) that one call outlasted ``WatchdogSec / 2``
(15 s in jetson/edgekv-camera.service), the main loop's heartbeat went stale, and systemd killed a daemon that was only
saving its memory — at every periodic snapshot, at SIGHUP, and in the snapshot part of a forget.

Slow flash is simulated at the boundary: ``os.fsync`` / ``os.fdatasync`` of a file under ``state.dir`` advance a fake
clock by the bytes written since that file's last sync over a fixed rate, and the watchdog decides once per sync."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

import edgekv.state
from edgekv.state import write_snapshot


def _views() -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return {"k": [torch.randn(64, 1024, generator=gen) for _ in range(6)],
            "v": [torch.randn(64, 1024, generator=gen).half() for _ in range(6)]}


def _sealer(sealed: bool):
    """A sealer with a fixed salt (the same nonces: two files of the same content are the same bytes), or None."""
    if not sealed:
        return None
    pytest.importorskip("cryptography")
    from edgekv.privacy import Key, Sealer

    return Sealer(Key(bytes(range(32)), "test key"), salt=b"saltsalt")


@pytest.mark.parametrize("sealed", [False, True])
def test_a_paced_snapshot_is_the_same_file_reaching_the_disk_pace_bytes_at_a_time(tmp_path, monkeypatch, sealed):
    manifest = {"format": 1, "note": "the same manifest for both"}
    plain = write_snapshot(tmp_path / "plain.snap", manifest, _views(), _sealer(sealed))
    pace = 256 << 10
    monkeypatch.setattr(edgekv.state, "PACE_BYTES", pace)
    synced: list[int] = []
    monkeypatch.setattr(edgekv.state, "_sync_data", lambda fd: synced.append(os.lseek(fd, 0, os.SEEK_CUR)))
    steps: list[int] = []
    paced = write_snapshot(tmp_path / "paced.snap", manifest, _views(), _sealer(sealed),
                           progress=lambda: steps.append(len(synced)))
    assert paced == plain and (tmp_path / "paced.snap").read_bytes() == (tmp_path / "plain.snap").read_bytes()
    # about 2.25 MiB of tensors: a step after each sync, every PACE_BYTES (a write may carry it a little past; a
    # sealed file is written a sealed 1 MiB chunk at a time)
    from edgekv.privacy import CHUNK, TAG

    step = max(pace, CHUNK + TAG) if sealed else pace
    assert steps == list(range(1, len(synced) + 1)) and len(synced) >= plain // step - 1
    gaps = [b - a for a, b in zip([0, *synced], synced)]
    assert all(pace <= gap < 2 * step for gap in gaps), gaps


def test_a_snapshot_without_progress_is_synced_once_at_its_end(tmp_path, monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(edgekv.state, "_sync_data", lambda fd: calls.append(fd))
    write_snapshot(tmp_path / "s.snap", {"format": 1}, _views())
    assert calls == []  # the library's own snapshot (Runtime.save) writes as before: one fsync at the end


class _SlowFlash:
    """``os.fsync`` / ``os.fdatasync`` of files under ``folder``: the fake clock ``now`` moves on by the bytes written
    since that file's last sync at ``rate`` bytes a second, then the watchdog decides (``ticks``)."""

    def __init__(self, folder: Path, now: list[float], watchdog, rate: float) -> None:
        self.folder, self.now, self.watchdog, self.rate = str(folder), now, watchdog, rate
        self.synced: dict[str, int] = {}
        self.ticks: list[bool] = []
        self.real = {"fsync": os.fsync, "fdatasync": getattr(os, "fdatasync", os.fsync)}

    def install(self, monkeypatch) -> None:
        for name in ("fsync", "fdatasync"):
            if hasattr(os, name):
                monkeypatch.setattr(os, name, self._wrap(self.real[name]))

    def _wrap(self, real):
        def sync(fd: int) -> None:
            try:
                where = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                where = ""
            if where.startswith(self.folder) and os.path.isfile(where):
                position = os.lseek(fd, 0, os.SEEK_CUR)
                dirty = max(0, position - self.synced.get(where, 0))
                self.synced[where] = position
                if dirty:
                    self.now[0] += dirty / self.rate
                    self.ticks.append(self.watchdog.tick())
            real(fd)
        return sync


@pytest.fixture
def slow_daemon(tiny_checkpoint, tmp_path, monkeypatch):
    """An ended daemon that keeps what it saw, its first snapshot written, the loop's heartbeat on a fake clock (the
    loop's own beats read 1000: only the snapshot's steps can keep it fresh), a watchdog of WatchdogSec 30 on it, and
    flash that takes 40 s to take one whole snapshot."""
    pytest.importorskip("fastapi")
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("the slow flash is told from /proc/self/fd (Linux)")
    from helpers_server import ended_daemon, kept_config

    from edgekv.apps.daemon.systemd import Heartbeat, Watchdog

    with ended_daemon(kept_config(tiny_checkpoint, tmp_path, max_tokens=800), tmp_path / "out.txt") as daemon:
        with daemon.lock:
            first = daemon.state.snapshot(daemon.session)
        assert first is not None and first.bytes > 64 << 10
        monkeypatch.setattr(edgekv.state, "PACE_BYTES", first.bytes // 8)
        now = [1000.0]
        loop = daemon._loop_thread
        daemon.heartbeat = Heartbeat(clock=lambda: 1000.0 if threading.current_thread() is loop else now[0])
        sent: list[str] = []
        watchdog = Watchdog(daemon.heartbeat, 30.0, send=lambda state: sent.append(state) or True)
        flash = _SlowFlash(tmp_path / "state", now, watchdog, rate=first.bytes / 40.0)
        flash.install(monkeypatch)
        yield daemon, flash, sent


def test_a_forget_whose_snapshot_takes_40_s_to_reach_the_flash_keeps_the_watchdog_pinging(slow_daemon):
    daemon, flash, sent = slow_daemon
    times = dict(daemon.session.pair_times)
    result = daemon.forget(times[5], times[5])
    assert result["pairs"] == 1 and result["snapshots"]["snapshot"]
    assert len(flash.ticks) >= 8, flash.ticks  # the snapshot reached the disk in steps
    assert all(flash.ticks) and flash.watchdog.withheld == 0 and sent == ["WATCHDOG=1"] * len(flash.ticks)


def test_a_snapshot_at_sighup_on_slow_flash_keeps_the_watchdog_pinging(slow_daemon):
    daemon, flash, sent = slow_daemon
    daemon._save_now("SIGHUP")
    assert len(flash.ticks) >= 8 and all(flash.ticks), flash.ticks
    assert flash.watchdog.withheld == 0


def test_the_periodic_snapshot_is_written_with_the_loops_beats(slow_daemon, monkeypatch):
    """The main loop's turn hands the keeper what to beat: each step of the periodic snapshot beats the loop."""
    daemon, flash, _sent = slow_daemon
    given = []
    monkeypatch.setattr(daemon.state, "maybe_snapshot", lambda session, progress=None: given.append(progress))
    daemon._on_loop_tick()
    assert given and given[0] is not None
    beats = daemon.heartbeat.beats
    given[0]()
    assert daemon.heartbeat.beats == beats + 1


def test_a_flash_that_stops_answering_stops_the_pings(slow_daemon):
    """A step that takes as long as a hang (the whole snapshot's bytes in one step) is not vouched for: the watchdog
    withholds its ping, and systemd restarts a daemon truly stuck on its disk."""
    daemon, flash, _sent = slow_daemon
    edgekv.state.PACE_BYTES = 1 << 40  # (restored by the fixture's monkeypatch) one step: the whole file
    daemon._save_now("SIGHUP")
    assert flash.ticks and not flash.ticks[-1] and flash.watchdog.withheld >= 1


def test_an_archive_forget_reaches_the_disk_a_step_at_a_time(tmp_path, monkeypatch):
    """The archive's part of a forget copies each segment holding the window (256 MiB by default: many seconds on an
    SD card) without it: with ``progress`` the copy is synced ``_PACE_BYTES`` at a time and ``progress`` called after
    each step and each segment, and the segment is the same as one rewritten at once."""
    import edgekv.archive.store as store
    from helpers_archive import SHAPE, fill

    archives = {}
    for name in ("paced", "whole"):
        archive = store.FrameArchive(tmp_path / name, SHAPE, max_bytes=8 << 20, segment_bytes=1 << 20)
        fill(archive, range(100))
        archives[name] = archive
    segment = next((tmp_path / "paced").glob("seg-*.ekva")).stat().st_size
    monkeypatch.setattr(store, "_PACE_BYTES", segment // 10)
    synced: list[int] = []
    real = archives["paced"].files.fsync
    monkeypatch.setattr(archives["paced"].files, "fsync", lambda fd: synced.append(fd) or real(fd))
    steps: list[int] = []
    paced = archives["paced"].forget(10.0, 12.0, progress=lambda: steps.append(len(synced)))
    whole = archives["whole"].forget(10.0, 12.0)
    assert paced["pairs"] == whole["pairs"] == 3
    assert len(steps) >= 9 and steps == sorted(steps) and steps[-1] <= len(synced)  # a step only after a sync
    assert [(e.pair, e.offset) for e in archives["paced"].entries()] == [
        (e.pair, e.offset) for e in archives["whole"].entries()]
    for archive in archives.values():
        archive.close()
    reopened = store.FrameArchive(tmp_path / "paced", SHAPE, max_bytes=8 << 20, segment_bytes=1 << 20)
    assert [e.pair for e in reopened.entries()] == [p for p in range(100) if p not in (10, 11, 12)]
    reopened.close()


def test_the_final_snapshot_on_slow_flash_extends_systemds_stop_timeout_a_step_at_a_time(slow_daemon, monkeypatch):
    """At stop (SIGTERM) the snapshot was written whole and synced once: 40 s of flash here, past the unit's
    TimeoutStopSec of 20 s, so systemd killed the daemon mid-write. Each step now beats the heartbeats and sends
    ``EXTEND_TIMEOUT_USEC`` (sd_notify), so the stop goes on while the flash takes it."""
    import socket
    import tempfile

    from edgekv.apps.daemon.loop import SNAPSHOT_STEP_S

    daemon, flash, _sent = slow_daemon
    folder = tempfile.mkdtemp(prefix="ekv-notify-", dir="/tmp")  # a short path: AF_UNIX names are ~108 bytes
    path = os.path.join(folder, "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(path)
        listener.setblocking(False)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        before = daemon.state.generations()[-1]
        daemon._on_stop()
        messages = []
        while True:
            try:
                messages.append(listener.recv(256).decode())
            except BlockingIOError:
                break
    os.unlink(path)
    os.rmdir(folder)
    assert len(flash.ticks) >= 8 and all(flash.ticks), flash.ticks  # the loop's heartbeat kept fresh by each step
    extend = f"EXTEND_TIMEOUT_USEC={int(SNAPSHOT_STEP_S * 1e6)}"
    # one a step (the file's last sync, its end, is the snapshot done: nothing to extend)
    assert len(messages) >= len(flash.ticks) - 1 and set(messages) == {extend}, (messages, flash.ticks)
    assert daemon.state.generations()[-1] != before  # written: a new generation
