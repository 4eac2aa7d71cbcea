"""The main loop's rules, with simulated clocks (deterministic, no timing): the fair share between ingest
and answers, the bounded answer backlog, and the systemd watchdog that pings only on progress."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from edgekv.apps.daemon.scheduling import Collector, FairShare, FrameBacklog
from edgekv.apps.daemon.systemd import Heartbeat, Watchdog, notify_systemd, watchdog_period_s


def simulate(fair: FairShare, questions: int, ingest_s: float, answer_s: float, frame_every_s: float | None,
             horizon_s: float) -> dict:
    """Run the loop's decisions on a simulated clock. ``frame_every_s=None``: a frame always waits (the
    machine ingests no faster than frames arrive); otherwise frames arrive on that period."""
    clock, next_frame, waiting_frames = 0.0, 0.0, 0
    log = {"ingest_s": 0.0, "answer_s": 0.0, "frames": 0, "answered": 0, "answer_times": [], "frames_at_answer": []}
    while clock < horizon_s:
        if frame_every_s is not None:
            while next_frame <= clock:
                waiting_frames += 1
                next_frame += frame_every_s
        frame_waiting = frame_every_s is None or waiting_frames > 0
        step = fair.next_step(frame_waiting, questions > 0)
        if step == "ingest":
            clock += ingest_s
            fair.ingested(ingest_s)
            log["ingest_s"] += ingest_s
            log["frames"] += 1
            waiting_frames = max(0, waiting_frames - 1)
        elif step == "answer":
            clock += answer_s
            fair.answered(answer_s, jumped_ahead=frame_waiting)
            log["answer_s"] += answer_s
            log["answered"] += 1
            log["answer_times"].append(clock)
            log["frames_at_answer"].append(log["frames"])
            questions -= 1
        else:
            clock = next_frame
    return log


def test_fifty_queued_questions_leave_ingest_its_share_and_all_get_answered():
    """Frames always waiting (the 9.7 -> 0.09 frames/s case): answers take at most 1 - 0.8 of the loop."""
    fair = FairShare(min_ingest_share=0.8)
    log = simulate(fair, questions=50, ingest_s=0.1, answer_s=1.5, frame_every_s=None, horizon_s=2000)
    until = log["answer_times"][-1]
    assert log["answered"] == 50  # nobody starves
    slack = fair.max_credit_s + 1.5  # saved-up credit and the one answer that overdraws it
    answered_share = 50 * 1.5 / until
    assert 0.2 - 0.01 <= answered_share <= 0.2 + slack / until  # answers use their share, and no more
    idle_frames = until / 0.1  # what ingest alone does in the same time
    assert log["frames_at_answer"][-1] >= 0.8 * idle_frames - slack / 0.1


def test_no_two_answers_in_a_row_while_frames_wait_once_credit_is_spent():
    fair = FairShare(min_ingest_share=0.8, max_credit_s=0.01)
    steps = []
    for _ in range(200):
        step = fair.next_step(frame_waiting=True, question_waiting=True)
        steps.append(step)
        fair.ingested(0.1) if step == "ingest" else fair.answered(0.5, jumped_ahead=True)
    assert "answer" in steps and all(not (a == b == "answer") for a, b in zip(steps, steps[1:]))
    # each 0.5 s answer is paid by 0.5 / 0.25 = 2 s = 20 ingests of 0.1 s: exactly the 80/20 split
    assert steps.count("ingest") >= 4 * 0.5 / 0.1 * (steps.count("answer") - 1)


def test_with_headroom_ingest_keeps_its_full_rate_and_answers_fill_the_rest():
    """Frames every 0.5 s, 0.05 s to ingest: an answer lets frames wait (the backlog), then they go first."""
    log = simulate(FairShare(), questions=50, ingest_s=0.05, answer_s=1.0, frame_every_s=0.5, horizon_s=100)
    arrived = 100 / 0.5
    assert log["frames"] >= arrived - 1.0 / 0.5 - 1  # at most one answer's worth still waiting at the horizon
    assert log["answered"] == 50


def test_min_ingest_share_one_means_questions_never_jump_ahead():
    fair = FairShare(min_ingest_share=1.0)
    for _ in range(100):
        assert fair.next_step(frame_waiting=True, question_waiting=True) == "ingest"
        fair.ingested(1.0)
    assert fair.next_step(frame_waiting=False, question_waiting=True) == "answer"
    with pytest.raises(ValueError, match="min_ingest_share"):
        FairShare(min_ingest_share=0.0)


def _frame(nbytes: int = 300) -> np.ndarray:
    return np.zeros((nbytes // 3, 1, 3), np.uint8)


def test_backlog_keeps_order_and_refuses_past_its_seconds_and_bytes():
    backlog = FrameBacklog(max_seconds=2.0, max_bytes=1000)
    assert backlog.push(_frame(), 0.0) and backlog.push(_frame(), 1.0) and backlog.push(_frame(), 2.0)
    assert not backlog.push(_frame(), 2.5)  # 2.5 s after the oldest frame
    assert [backlog.pop()[1] for _ in range(2)] == [0.0, 1.0]
    assert backlog.push(_frame(), 2.5)  # within 2 s of the oldest (2.0) again
    assert not backlog.push(_frame(900), 2.6)  # bytes: 600 held + 900 > 1000
    assert backlog.push(_frame(900), 2.6, bounded=False)  # the frame the loop pulled itself always fits
    stats = backlog.stats()
    assert stats["frames_lost_while_answering"] == 2 and stats["frames_kept_while_answering"] == 4
    assert stats["backlog_frames"] == 3 and stats["backlog_bytes"] == 300 + 300 + 900


def test_collector_moves_frames_only_while_it_runs():
    frames = iter([(_frame(), float(t)) for t in range(5)])
    lock = threading.Lock()

    def take(timeout: float):
        with lock:
            return next(frames, None)

    backlog = FrameBacklog(60.0, 10**6)
    with Collector(backlog, take):
        deadline = time.monotonic() + 10
        while len(backlog) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert [backlog.pop()[1] for _ in range(5)] == [0.0, 1.0, 2.0, 3.0, 4.0]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_watchdog_pings_while_the_loop_progresses_and_withholds_when_it_hangs():
    clock, sent = FakeClock(), []
    heartbeat = Heartbeat(clock)
    watchdog = Watchdog(heartbeat, period_s=30.0, send=lambda state: sent.append(state) or True)
    for second in range(0, 120, 10):  # a long answer: a token every second keeps beating
        clock.now = float(second)
        heartbeat.beat()
        assert watchdog.tick()
    clock.now += 14.0  # one slow step, under WatchdogSec / 2
    assert watchdog.tick()
    clock.now += 2.0  # 16 s without progress: stuck
    assert not watchdog.tick() and watchdog.withheld == 1
    heartbeat.beat()
    assert watchdog.tick() and sent == ["WATCHDOG=1"] * watchdog.pings


def test_watchdog_period_comes_from_systemd_for_this_process_only():
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000"}) == 30.0
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 30.0
    assert watchdog_period_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "0"}) is None and watchdog_period_s({}) is None


def test_notify_reaches_a_datagram_socket(tmp_path, monkeypatch):
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(path))
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        assert notify_systemd("READY=1")
        assert server.recv(64) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not notify_systemd("READY=1")
