"""Several cameras stop within one stop budget (``CameraSet._shutdown``, apps/daemon/cameras.py).

Before: each camera's ``Daemon.shutdown`` ran after the one before it had ended, each with a ``STOP_BUDGET_S`` of its
own, so three cameras needed up to three budgets under the one ``TimeoutStopSec`` of systemd (20 s in
jetson/edgekv-camera.service): a later camera was killed before its final snapshot and lost its memory since the last
periodic one.

Simulated at the boundaries, with no sleep and no timing: the stop's clock is a fake one (``Daemon.stop_clock``); a
part that hangs (each camera's capture, one camera's archive) moves it on to the deadline it is waited for until
(``loop._bounded``'s contract: waited for until the deadline, then left behind); systemd is a fake
``notify_systemd`` that kills the process 20 s after the stop began, or later as the final snapshots extend it
(``EXTEND_TIMEOUT_USEC``)."""

from __future__ import annotations

import threading

import edgekv.apps.daemon.loop as loop
from edgekv.config import EdgeKVConfig

TIMEOUT_STOP_S = 20.0  # jetson/edgekv-camera.service
NAMES = ("front", "side", "back")


def _config(tmp_path) -> EdgeKVConfig:
    sources = [{"name": name, "source": f"synthetic:events?size=112x112&fps=2&frames=600&seed={seed}&rate=0.08"}
               for seed, name in enumerate(NAMES, 1)]
    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": sources, "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 1920, "text_reserve_tokens": 64},
        archive={"dir": str(tmp_path / "archive"), "max_gib": 0.03, "segment_mib": 0.25},
        state={"dir": str(tmp_path / "state"), "every_s": 3600}, monitor={"backend": "cpu"},
        server={"port": 0}, generation={"max_new_tokens": 2, "temperature": 0.0})


class _FakeSystemd:
    """The stop's clock and systemd's stop timeout on it: the kill comes at ``kill_at``."""

    def __init__(self) -> None:
        self.now = 0.0
        self.kill_at = TIMEOUT_STOP_S  # the SIGTERM came at 0
        self.snapshots: dict[str, tuple[float, float]] = {}  # camera: (began at, the kill then due)
        self.lock = threading.Lock()

    def notify(self, state: str) -> bool:
        if state.startswith("EXTEND_TIMEOUT_USEC="):
            with self.lock:
                self.kill_at = max(self.kill_at, self.now + int(state.split("=", 1)[1]) / 1e6)
        return True

    def hang_until(self, deadline: float) -> None:
        with self.lock:
            self.now = max(self.now, deadline)


def test_three_cameras_whose_parts_hang_stop_within_one_budget_each_snapshot_written(tmp_path, monkeypatch):
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet

    systemd = _FakeSystemd()
    monkeypatch.setattr(loop, "notify_systemd", systemd.notify)
    monkeypatch.setattr(loop.Daemon, "stop_clock", staticmethod(lambda: systemd.now))
    cameras = CameraSet(_config(tmp_path), daemon_args(), out=open(tmp_path / "out.txt", "w"))
    slow = cameras.first  # its archive cannot write its queued pairs (the camera stopped last, one after another)
    hung: list[str] = []
    real_bounded = loop._bounded

    def bounded(name, action, deadline, clock=None):
        if name == "capture" or (name == "archive" and getattr(action, "__self__", None) is slow.session):
            hung.append(name)
            systemd.hang_until(deadline)
        return real_bounded(name, action, deadline, clock)

    monkeypatch.setattr(loop, "_bounded", bounded)
    for name, daemon in cameras.daemons.items():
        def final_snapshot(session, progress, real=daemon.state.final_snapshot, name=name):
            with systemd.lock:
                systemd.snapshots[name] = (systemd.now, systemd.kill_at)
            return real(session, progress)

        daemon.state.final_snapshot = final_snapshot
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    try:
        assert cameras.ready.wait(180)
    finally:
        cameras.stop.event.set()
        thread.join(300)
    assert not thread.is_alive()
    said = (tmp_path / "out.txt").read_text()
    assert sorted(hung) == ["archive", "capture", "capture", "capture"], (hung, said)
    assert set(systemd.snapshots) == set(NAMES), said
    for name, (began, kill_at) in systemd.snapshots.items():
        assert began < kill_at, f"{name}'s final snapshot began at {began:g} s, killed at {kill_at:g} s"
        assert began <= loop.STOP_BUDGET_S, (name, began)
    assert systemd.now == loop.STOP_BUDGET_S  # the whole stop: one budget, each hung part left at its end
    for name in NAMES:
        assert f"[{name}] shutdown: past the stop's budget of {loop.STOP_BUDGET_S:g} s" in said, said
        assert said.count(f"[{name}] frames ") == 1  # each camera's summary said once
