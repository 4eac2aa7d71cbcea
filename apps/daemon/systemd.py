"""systemd integration without a dependency: ``sd_notify`` datagrams and a watchdog that tells the truth.

``Type=notify`` units read ``READY=1``, ``STOPPING=1`` and ``WATCHDOG=1`` from the datagram socket named
by ``$NOTIFY_SOCKET``. With ``WatchdogSec=`` set, systemd exports ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``) and kills the service when no ``WATCHDOG=1`` arrives for that long.

Pinging after every ingested frame (the old rule) stops the pings whenever the loop does something
else for a while: answering 24 questions (45 s) or waiting for a lost camera (53 s), and systemd kills
a healthy daemon. Pinging from a timer alone would keep a hung daemon alive. So the main loop beats a
``Heartbeat`` whenever it makes progress (a frame ingested, an answer token decoded, one turn of the
loop while it waits for a frame or a reconnect) and ``Watchdog``, a thread, pings at a third of the
watchdog period only while the last beat is younger than half of it: a loop stuck in one call for
longer than that stops the pings and systemd restarts the service within one more period.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable

log = logging.getLogger("edgekv.systemd")


def notify_systemd(state: str) -> bool:
    """Send ``state`` (e.g. ``READY=1``) to ``$NOTIFY_SOCKET``; False when there is none or it failed."""
    name = os.environ.get("NOTIFY_SOCKET")
    if not name:
        return False
    address = "\0" + name[1:] if name.startswith("@") else name  # "@": the abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError as exc:  # the socket named, so a unit or an environment that points elsewhere is seen
            log.warning("sd_notify %s to $NOTIFY_SOCKET=%s failed: %s", state.split("=")[0], name, exc)
            return False
    return True


def watchdog_period_s(environ: dict[str, str] | None = None) -> float | None:
    """``WatchdogSec`` in seconds from ``$WATCHDOG_USEC``, or None when systemd set no watchdog for this
    process (unset, malformed, or ``$WATCHDOG_PID`` names another process)."""
    environ = os.environ if environ is None else environ
    usec, pid = environ.get("WATCHDOG_USEC"), environ.get("WATCHDOG_PID")
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses, and the daemon would not start
    if not usec or not (usec.isascii() and usec.isdigit()) or int(usec) == 0:
        return None
    if pid and (not (pid.isascii() and pid.isdigit()) or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6


class Heartbeat:
    """The main loop's proof of progress: ``beat()`` is cheap and may be called from any thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.last = clock()
        self.beats = 0

    def beat(self) -> None:
        self.last = self.clock()
        self.beats += 1

    def age_s(self) -> float:
        return self.clock() - self.last


class Watchdog:
    """Sends ``WATCHDOG=1`` every ``period_s / 3`` while ``heartbeat`` is younger than ``stall_s``
    (default ``period_s / 2``); counts pings sent and pings withheld for a stalled loop."""

    def __init__(self, heartbeat: Heartbeat, period_s: float, stall_s: float | None = None,
                 send: Callable[[str], bool] = notify_systemd) -> None:
        if not period_s > 0:
            raise ValueError(f"watchdog period must be > 0 s, got {period_s}")
        self.heartbeat = heartbeat
        self.period_s = period_s
        self.stall_s = period_s / 2 if stall_s is None else stall_s
        self.send = send
        self.pings = 0
        self.withheld = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgekv-watchdog", daemon=True)

    @classmethod
    def from_environment(cls, heartbeat: Heartbeat) -> "Watchdog | None":
        period = watchdog_period_s()
        return cls(heartbeat, period) if period is not None else None

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def tick(self) -> bool:
        """One decision: ping if the loop showed progress recently. Returns whether it pinged."""
        if self.heartbeat.age_s() <= self.stall_s:
            self.send("WATCHDOG=1")
            self.pings += 1
            return True
        if self.withheld == 0 or self.withheld % 10 == 0:
            log.error("main loop made no progress for %.1f s: withholding WATCHDOG=1 so systemd restarts it",
                      self.heartbeat.age_s())
        self.withheld += 1
        return False

    def _run(self) -> None:
        while not self._stop.wait(self.period_s / 3):
            self.tick()
