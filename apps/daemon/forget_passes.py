"""Forgets asked at the same time are done in one pass under the session's lock, each caller answered for its own
window (a database's group commit), and a pass counts as the progress of the main loops it holds up.

A forget holds the session's lock while it takes its window out of the cache, the archive, the evidence frames and
the alerts, and rewrites the snapshots. Eight clients posting forgets back to back held that lock nearly all the
time: each forget a pass of its own (a journal note, a snapshot, the lock taken again at once), and the main loop
got the lock between two of them only when it won the race — about 15 of 24 frames went in. Here a caller queues
its window (``ForgetQueue.add``) and takes the lock; the first to hold it does every window waiting then, and the
others, finding theirs done, return at once. Before a pass the main loop is let take its step (``LoopWatch``): a
storm of forgets costs the camera one pass per step at most, and never stops it.

The systemd watchdog pings only while the main loop's heartbeat is fresh (apps/daemon/systemd.py); a loop blocked
on the lock by a long forget (an archive rewritten, a snapshot written) stopped the pings, and a forget longer than
``WatchdogSec / 2`` got the daemon killed half way, to do it again at the next start. A pass beats the heartbeats
of the loops it holds up between its parts — only of a loop that beat by itself since the previous pass: a pass
that hangs beats no more, and a loop hung elsewhere is not kept looking alive by a stream of forgets. The two parts
that can each outlast ``WatchdogSec / 2`` on slow flash, the archive's rewritten segments and the snapshot, beat
within themselves too: their files reach the disk 8 MiB at a time, a beat after each step (``edgekv.state._Paced``,
``FrameArchive.forget``'s ``progress``), so a disk that stops answering still stops the beats.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from edgekv.apps.daemon.systemd import Heartbeat


@dataclass
class ForgetAsk:
    """One caller's forget: its window as asked (``Daemon.forget``'s arguments, already checked), then its answer."""

    t_from: float | None = None
    t_to: float | None = None
    last_s: float | None = None
    unix: tuple[float, float] | None = None
    result: dict | None = None
    error: BaseException | None = None
    done: bool = False

    def finish(self, result: dict) -> None:
        self.result, self.done = result, True

    def fail(self, error: BaseException) -> None:
        self.error, self.done = error, True

    def outcome(self) -> dict:
        if self.error is not None:
            raise self.error
        assert self.result is not None, "a forget's pass ended without answering it"
        return self.result


class ForgetQueue:
    """The forgets waiting for a pass. ``passes`` counts the passes run, ``asks`` the forgets they did."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiting: list[ForgetAsk] = []
        self.passes = 0
        self.asks = 0

    def add(self, ask: ForgetAsk) -> None:
        with self._mutex:
            self._waiting.append(ask)

    def waiting(self) -> int:
        with self._mutex:
            return len(self._waiting)

    def run(self, ask: ForgetAsk, lock, do_pass: Callable[[list[ForgetAsk]], None],
            before_pass: Callable[[], bool] | None = None) -> dict:
        """``ask`` done, by a pass of this thread's or of another's: under ``lock`` (the session's), every waiting
        forget taken and handed to ``do_pass``, which answers each. ``before_pass`` runs with ``lock`` let go first
        (once: the main loop's turn) and says whether it waited; the forgets that came meanwhile join the pass. A
        pass that raises answers its unanswered forgets with that error (a crash part way: each caller hears it)."""
        self.add(ask)
        waited = before_pass is None
        with lock:
            while not ask.done:
                if not waited:
                    lock.release()
                    try:
                        waited = True
                        before_pass()
                    finally:
                        lock.acquire()
                    continue
                with self._mutex:
                    batch, self._waiting = self._waiting, []
                self.passes += 1
                self.asks += len(batch)
                try:
                    do_pass(batch)
                except BaseException as exc:
                    for other in batch:
                        if not other.done:
                            other.fail(exc)
                    raise
        return ask.outcome()


@dataclass
class LoopWatch:
    """What forgets know of the main loops their lock holds up, from the loops' heartbeats (shared by the daemons
    that share one lock: several cameras). ``_after``: each heartbeat's beat count when the last pass let go."""

    wait_s: float = 1.0  # the longest a pass waits for the loop's step before going ahead (a forget is prompt)
    _after: dict[int, int] = field(default_factory=dict)

    def stepped(self, heartbeat: Heartbeat) -> bool:
        """The loop beat by itself since the last pass ended (a loop never seen by a pass has not, yet)."""
        after = self._after.setdefault(id(heartbeat), heartbeat.beats)
        return heartbeat.beats != after

    def wait_for_step(self, heartbeat: Heartbeat, stopping: threading.Event) -> bool:
        """Until the loop beating ``heartbeat`` has taken a step since the last pass (ingested a frame, turned once),
        at most ``wait_s``, or until ``stopping``; whether it did. Polled: a heartbeat is a counter, not an event."""
        deadline = time.monotonic() + self.wait_s
        while not self.stepped(heartbeat):
            left = deadline - time.monotonic()
            if left <= 0 or stopping.wait(min(left, 0.005)):
                return self.stepped(heartbeat)
        return True

    def alive(self, heartbeats: list[Heartbeat]) -> list[Heartbeat]:
        """The heartbeats a pass starting now may beat: those whose loop stepped since the last pass."""
        return [heartbeat for heartbeat in heartbeats if self.stepped(heartbeat)]

    def beat(self, heartbeats: list[Heartbeat]) -> None:
        """A part of the pass done: progress of each loop it holds up (``alive`` when it began)."""
        for heartbeat in heartbeats:
            heartbeat.beat()
            self._after[id(heartbeat)] = heartbeat.beats

    def passed(self, heartbeats: list[Heartbeat]) -> None:
        """A pass let go of the lock: from here on only the loops' own beats count as their steps."""
        for heartbeat in heartbeats:
            self._after[id(heartbeat)] = heartbeat.beats
