"""The running daemon under concurrency and signals: what a fleet of users did to it while it ingested —
forgets that came in while it shut down or while an answer was on its way, lines said by two threads at once, alert
streams open at SIGTERM, a SIGTERM to several cameras. Each interleaving is forced with events and wrapped hooks,
never raced against the clock; every wait polls a condition with a generous bound."""

from __future__ import annotations

import json
import logging
import signal
import threading

import pytest

from edgekv.apps.daemon.loop import Daemon, DaemonOptions
from edgekv.apps.questions import Question
from edgekv.config import EdgeKVConfig
from helpers_cameras import running_cameras
from helpers_mqtt import until
from helpers_server import RunningDaemon, call, connect, read_until_closed, server_config

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_a_forget_that_reaches_a_stopping_daemon_is_refused_and_changes_no_file(tiny_checkpoint, tmp_path):
    """Before: a forget (HTTP) that waited for the lock while the final snapshot was written ran after it, once
    state.dir had been let go and while the archive was being closed: it wrote a snapshot past the final one (16
    of them, a forget storm under SIGTERM) and answered 200. Now it is a 503 that says nothing was forgotten, and
    the final snapshot is the newest file."""
    config = server_config(tiny_checkpoint).with_overrides(state={"dir": str(tmp_path / "state")})
    running = RunningDaemon(config, tmp_path / "out.txt")
    daemon = running.daemon
    entered, returned, answer = threading.Event(), threading.Event(), {}
    forget = daemon.forget

    def watched_forget(*args, **kwargs):
        entered.set()  # before it takes the daemon's lock
        try:
            return forget(*args, **kwargs)
        finally:
            returned.set()

    def ask_to_forget() -> None:
        answer["reply"] = call(running.port, "POST", "/v1/memory/forget", {"last_s": 1})

    on_stop, release, finals = daemon._on_stop, daemon.state.release, []
    final_snapshot = daemon.state.final_snapshot

    def stop_with_a_forget_waiting() -> None:
        with daemon.lock:  # the forget arrives while the final snapshot holds the lock
            threading.Thread(target=ask_to_forget, daemon=True).start()
            assert entered.wait(60)
            on_stop()

    def release_after_the_forget() -> None:
        assert returned.wait(60)  # the HTTP server is still up: the forget's reply goes out
        release()

    daemon._on_stop = stop_with_a_forget_waiting
    daemon.state.release = release_after_the_forget
    daemon.state.final_snapshot = (lambda session, progress=None:
                                   finals.append(final_snapshot(session, progress)) or finals[-1])
    daemon.forget = watched_forget
    with running:
        running.stop()
    assert until(lambda: "reply" in answer)
    status, _headers, body = answer["reply"]
    assert status == 503, body
    error = json.loads(body)["error"]
    assert error["code"] == "server_unavailable" and "nothing was forgotten" in error["message"]
    assert finals and finals[-1] is not None
    assert daemon.state.generations()[-1] == finals[-1].path  # no snapshot after the final one
    assert "forgot" not in (tmp_path / "out.txt").read_text()


class _HandsOverMidLine:
    """An output that, given part of a line, lets another thread say its line before taking the rest: what a
    thread switch between ``print``'s two writes did (the forget's line said from the HTTP thread while the main
    loop said SIGTERM's)."""

    def __init__(self) -> None:
        self.text, self.other = "", None

    def write(self, chunk: str) -> int:
        self.text += chunk
        if self.other is not None and not chunk.endswith("\n"):
            other, self.other = self.other, None
            other.start()
            other.join(60)
        return len(chunk)

    def flush(self) -> None:
        pass


def test_lines_said_from_two_threads_at_once_stay_whole(tiny_checkpoint):
    """Before: "forgot t=6..7 s: ... 1 older removedSIGTERM: finishing the current step and shutting down" — one
    line in the log, then an empty one."""
    out = _HandsOverMidLine()
    daemon = Daemon(server_config(tiny_checkpoint), DaemonOptions(no_stdin=True, quiet=True), out=out)
    other = threading.Thread(target=daemon.say, args=("SIGTERM: finishing the current step and shutting down",))
    out.other = other
    daemon.say("forgot t=6..7 s: 0 frame pairs")
    if out.other is not None:  # written whole: nothing was handed over mid-line; the other thread says its line now
        out.other = None
        other.start()
        other.join(60)
    assert out.text == "forgot t=6..7 s: 0 frame pairs\nSIGTERM: finishing the current step and shutting down\n"


def test_an_answer_read_before_a_forget_is_not_kept_after_it(tiny_checkpoint, tmp_path):
    """Before: an answer read from the cache before a forget and finished after it (recorded once the lock was let
    go; an escalated one seconds later) was put on the status page's recent questions after the forget had emptied
    them, telling of the forgotten window. Its asker still gets it; the page does not keep it."""
    with RunningDaemon(server_config(tiny_checkpoint), tmp_path / "out.txt") as running:
        daemon = running.daemon
        read, finish = threading.Event(), threading.Event()

        def hold_after_reading(question) -> bool:  # called once the answer is read and the lock let go
            read.set()
            assert finish.wait(60)
            return False

        daemon._escalate = hold_after_reading
        before = Question("What colour was the shape?")
        daemon.submit(before)
        assert read.wait(60)
        daemon.forget(last_s=3600.0)  # from the test's thread, as the HTTP API's executor would
        finish.set()
        assert before.done.wait(60) and before.answer is not None, before.error  # the asker got the answer
        after = Question("And now?")
        daemon.submit(after)
        assert after.done.wait(60)
        kept = [record["id"] for record in daemon.recent_questions()]
        assert before.id not in kept and after.id in kept, kept


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_alert_streams_open_at_the_stop_end_cleanly(tiny_checkpoint, tmp_path):
    """Before: a stop with /v1/alerts/stream clients open waited uvicorn's graceful timeout for streams that never
    end, then cancelled them: "Cancel 3 running task(s), timeout graceful shutdown exceeded" and a traceback per
    stream in the log, each client's stream cut without its last chunk. Now each stream ends as the server stops."""
    records = _Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        with RunningDaemon(server_config(tiny_checkpoint), tmp_path / "out.txt") as running:
            streams = []
            for _ in range(3):
                sock = connect(running.port, timeout=60)
                sock.sendall(b"GET /v1/alerts/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                received = b""
                while b": edgekv alerts" not in received:  # the stream is open and its client registered
                    chunk = sock.recv(4096)
                    assert chunk, received
                    received += chunk
                streams.append((sock, received))
            running.stop()
        for sock, received in streams:
            rest, _seconds = read_until_closed(sock, 60)
            sock.close()
            assert (received + rest).endswith(b"\r\n0\r\n\r\n"), received + rest  # the chunked body's end
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert not records.messages, records.messages


def test_each_camera_says_the_signal_that_stops_it(tmp_path):
    """Before: one camera said "SIGTERM: finishing the current step and shutting down"; several cameras said nothing
    of why they stopped (the signal's name was on the camera set's flag, not on each camera's)."""
    source = "synthetic:events?size=112x112&fps=2&frames=100000&seed={}&rate=0.08"
    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": [{"name": "front", "source": source.format(1)}, {"name": "back", "source": source.format(2)}],
               "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 1280, "text_reserve_tokens": 64},
        monitor={"backend": "cpu"}, server={"enabled": False}, generation={"max_new_tokens": 2})
    with running_cameras(config, tmp_path, no_server=True) as cameras:
        cameras.stop._handle(signal.SIGTERM, None)  # what the handler does on the main thread
    said = (tmp_path / "out.txt").read_text()
    for name in ("front", "back"):
        assert f"[{name}] SIGTERM: finishing the current step and shutting down" in said, said


def test_a_ros2_forget_reaching_a_stopping_daemon_is_answered_and_the_channel_goes_on():
    """A forget on /edgekv/input_forget while the daemon stops: ``Daemon.forget`` refuses (DaemonStopping). The
    channel caught only ValueError and OSError, so the refusal ended its thread, with no reply to the robot."""
    from edgekv.apps.outputs.ros2 import Ros2Channel
    from edgekv.apps.questions import DaemonStopping

    class Stopping:
        def forget(self, **window):
            raise DaemonStopping("the daemon is shutting down: nothing was forgotten; ask again once it is back")

    channel = object.__new__(Ros2Channel)  # the forget step alone: no DDS graph
    channel.daemon, channel.forget_out = Stopping(), "forget_result"
    channel.counts = {"forgets": 0, "forgets_refused": 0}
    sent = []
    channel._publish = lambda topic, text: sent.append((topic, text))
    channel._forget({"last_s": 5.0})
    assert channel.counts == {"forgets": 0, "forgets_refused": 1}
    ((topic, text),) = sent
    assert topic == "forget_result" and json.loads(text)["error"].startswith("the daemon is shutting down")
