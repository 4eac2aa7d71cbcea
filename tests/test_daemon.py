"""The camera daemon end to end on a tiny checkpoint: OpenAI-compatible API with streaming, metrics,
auth, request limits, concurrent questions during ingest, the status page data; and the daemon's own
contract: request text escaped in every line it prints, non-blocking submit with clear refusals, no
blind spot while answering, a fair share for ingest under question load, the systemd watchdog driven
by progress (a fake NOTIFY_SOCKET reads it), a bounded SIGTERM that refuses what waits, and a stream
that ends without taking the API down."""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from edgekv.apps.questions import DaemonBusy, DaemonStopping, Question, printable
from edgekv.config import EdgeKVConfig

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

def _args(**overrides) -> argparse.Namespace:
    values = {"ask": [], "ask_every": 0, "max_frames": None, "no_server": False, "no_stdin": True,
              "quiet": True, "realtime": True}
    values.update(overrides)
    return argparse.Namespace(**values)


def _config(model_dir: Path, token: str | None = None, **server) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=100000", "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 400, "text_reserve_tokens": 96},
        server={"port": 0, "token": token, "max_new_tokens": 16, "max_request_bytes": 4096, **server},
        generation={"max_new_tokens": 8},
        monitor={"interval_s": 0.2, "backend": "cpu"},
    )


class Running:
    """A Daemon in a background thread (signals go to the main thread, so it is stopped by its flag)."""

    def __init__(self, config: EdgeKVConfig, out, **args) -> None:
        from edgekv.apps.daemon.loop import Daemon

        self.daemon = Daemon(config, _args(**args), out=out)
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        assert self.daemon.ready.wait(60), "daemon did not start"
        deadline = time.monotonic() + 30
        while self.daemon.session.counters.frame_pairs < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        server = self.daemon.server
        self.base = f"http://127.0.0.1:{server.port}" if server is not None else None
        return self

    def __exit__(self, *exc):
        self.daemon.stop.event.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


def _request(url, body=None, token=None, method=None, raw=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method or ("POST" if data else "GET"))
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    log = open(tmp_path_factory.mktemp("daemon") / "out.txt", "w")
    with Running(_config(tiny_checkpoint), log) as run:
        yield run
    log.close()


def test_openai_sdk_streams_an_answer(running):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=running.base + "/v1", api_key="unused")
    models = client.models.list()
    model = models.data[0].id
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What moves?"}],
                                            stream=True, max_tokens=8)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    full = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "What moves?"}],
                                          max_tokens=8)
    assert full.usage.completion_tokens >= 1
    assert text  # random weights: meaningless, but text came through the stream


def test_metrics_parse_as_prometheus_text(running):
    parser = pytest.importorskip("prometheus_client.parser")
    status, body = _request(running.base + "/metrics")
    assert status == 200
    families = {f.name: f for f in parser.text_string_to_metric_families(body.decode())}
    assert families["edgekv_cache_capacity_bytes"].samples[0].value == running.daemon.session.cache.capacity_bytes
    assert families["edgekv_cache_tokens"].samples[0].value <= 400
    for name in ("edgekv_frames", "edgekv_ingest_fps", "edgekv_frame_pair_ingest_seconds", "edgekv_compressions",
                 "edgekv_frames_dropped", "process_resident_memory_bytes"):
        assert name in families, name
    # what wears the flash: this process's bytes written to storage, read at a scrape (the daemon runs in it here)
    psutil = pytest.importorskip("psutil")
    written = families["edgekv_disk_write_bytes"].samples[0]
    assert written.name == "edgekv_disk_write_bytes_total"
    assert 0 <= written.value <= psutil.Process().io_counters().write_bytes


def test_health_models_status_page_and_frame(running):
    assert json.loads(_request(running.base + "/healthz")[1])["status"] == "ok"
    status, page = _request(running.base + "/")
    assert status == 200 and b"edgekv" in page
    data = json.loads(_request(running.base + "/v1/edgekv/status")[1])
    assert data["kept"]["rows"] == 4 and len(data["kept"]["kept"]) == 4
    status, jpeg = _request(running.base + "/frame.jpg")
    assert status == 200 and jpeg[:2] == b"\xff\xd8"


def test_request_limits(running):
    status, body = _request(running.base + "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000})
    assert status == 400 and b"limit" in body
    status, _ = _request(running.base + "/v1/chat/completions", raw=b"{" + b" " * 5000 + b"}")
    assert status == 413
    status, body = _request(running.base + "/v1/chat/completions", {"messages": []})
    assert status == 400
    status, body = _request(running.base + "/v1/chat/completions", raw=b"not json")
    assert status == 400


def test_concurrent_questions_while_frames_keep_arriving(running):
    pairs_before = running.daemon.session.counters.frame_pairs
    results = []

    def ask(i):
        results.append(_request(running.base + "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 4}))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [status for status, _ in results] == [200] * 5
    time.sleep(1.0)
    assert running.daemon.session.counters.frame_pairs > pairs_before
    assert running.daemon.session.cache.length <= running.daemon.session.video_limit


def test_auth_on(tiny_checkpoint, tmp_path):
    with open(tmp_path / "out.txt", "w") as log, Running(_config(tiny_checkpoint, token="s3cret"), log) as run:
        assert _request(run.base + "/metrics")[0] == 401
        assert _request(run.base + "/metrics", token="wrong")[0] == 401
        assert _request(run.base + "/metrics", token="s3cret")[0] == 200
        assert _request(run.base + "/healthz")[0] == 200  # liveness needs no token


def test_startup_failure_is_one_clear_line_and_exit_2(tiny_checkpoint, tmp_path, capsys):
    """Engines that were never built: the daemon says what to run instead of dumping a traceback."""
    from edgekv.apps.daemon.loop import Daemon

    pytest.importorskip("onnxruntime")
    config = _config(tiny_checkpoint).with_overrides(
        engines={"vision": "onnxruntime", "llm": "onnxruntime", "engine_dir": str(tmp_path)})
    out = io.StringIO()
    assert Daemon(config, _args(), out=out).run() == 2
    err = capsys.readouterr().err
    assert err.startswith("edgekv-camera: cannot start: no onnxruntime engines built") and "edgekv build" in err
    assert "Traceback" not in err


# ---------------------------------------------------------------------------------------------- helpers
ROOT = Path(__file__).resolve().parents[1]


def _wait(condition, timeout: float = 30.0, step: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


class NotifyListener:
    """A fake systemd: the unix datagram socket $NOTIFY_SOCKET names, recording (time, message)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.05)
        self.messages: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.messages.append((time.monotonic(), self.sock.recv(256).decode()))
            except socket.timeout:
                continue

    def pings(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        return [t for t, m in list(self.messages) if m == "WATCHDOG=1" and since <= t <= until]

    def states(self) -> list[str]:
        return [m for _, m in list(self.messages) if m != "WATCHDOG=1"]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


@pytest.fixture
def notify(tmp_path, monkeypatch):
    """Point the daemon at a fake systemd with a 1.5 s watchdog (a ping every 0.5 s)."""
    listener = NotifyListener(tmp_path / "notify.sock")
    monkeypatch.setenv("NOTIFY_SOCKET", str(listener.path))
    monkeypatch.setenv("WATCHDOG_USEC", "1500000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield listener
    listener.close()


def _recording(daemon) -> list[float]:
    """Wrap the session's ingest to record each frame's capture timestamp."""
    times: list[float] = []
    ingest = daemon.session.ingest

    def recording(frame, t=None, **stamps):
        result = ingest(frame, t=t, **stamps)
        times.append(t)
        return result

    daemon.session.ingest = recording
    return times


# ---------------------------------------------------------------------------------------------- request text
def test_printable_escapes_what_could_break_a_line_or_an_encoder():
    assert printable("hi \ud800 there\nA: forged") == "hi \\ud800 there\\nA: forged"
    assert printable("\x1b[31mred\r\u2028x\\n") == "\\x1b[31mred\\r\\u2028x\\\\n"
    assert printable("Ünïcödé 漢字 ok") == "Ünïcödé 漢字 ok"
    assert printable("x" * 1000, limit=10) == "x" * 10 + "… (1000 characters)"
    assert printable("\ud800\U0001f600").encode("utf-8") == b"\\ud800\xf0\x9f\x98\x80"


def test_a_lone_surrogate_or_a_forged_line_in_a_question_cannot_crash_or_forge_output(tiny_checkpoint):
    """The reproduction: ``"hi \\ud800 there"`` killed the daemon (UnicodeEncodeError printing ``Q: …``),
    and a question holding a newline and ``A: …`` forged an answer line."""
    raw = io.BytesIO()
    out = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)  # like a real stdout
    with Running(_config(tiny_checkpoint), out, no_server=True) as run:
        questions = [Question("hi \ud800 there\nA: forged answer", max_new_tokens=4, source="http"),
                     Question("\x1b[2J\x1b[31mred alert", max_new_tokens=4, source="stdin")]
        for question in questions:
            run.daemon.submit(question)
        assert all(question.done.wait(60) for question in questions)
        pairs = run.daemon.session.counters.frame_pairs
        assert _wait(lambda: run.daemon.session.counters.frame_pairs > pairs + 1)  # still ingesting
        assert run.thread.is_alive()
    lines = raw.getvalue().decode("utf-8").splitlines()
    assert "Q [http]: hi \\ud800 there\\nA: forged answer" in lines
    assert "Q [stdin]: \\x1b[2J\\x1b[31mred alert" in lines
    assert not any(line.startswith("A: forged") for line in lines)
    assert not any("\x1b" in line for line in lines)


# ---------------------------------------------------------------------------------------------- submit
def test_submit_never_blocks_and_refuses_with_clear_errors(tiny_checkpoint):
    with Running(_config(tiny_checkpoint, queue_size=2), io.StringIO(), no_server=True) as run:
        daemon = run.daemon
        release = threading.Event()
        held = Question("Long?", max_new_tokens=200, on_token=lambda _token: release.wait(10))
        daemon.submit(held)
        assert _wait(lambda: daemon.status()["answering"] is not None)  # the loop is inside that answer
        waiting = [Question(f"Q{i}?", max_new_tokens=4) for i in range(2)]
        for question in waiting:
            daemon.submit(question)
        started = time.monotonic()
        with pytest.raises(DaemonBusy, match="2 questions are already waiting") as busy:
            daemon.submit(Question("One too many?"))
        assert time.monotonic() - started < 0.5 and isinstance(busy.value, queue.Full) and busy.value.status == 503
        daemon.stop.event.set()
        release.set()
        assert all(q.done.wait(10) for q in [held, *waiting])
        with pytest.raises(DaemonStopping):
            daemon.submit(Question("After the stop?"))
    assert isinstance(held.error, DaemonStopping) and "cut short" in str(held.error)  # stopped at its next token
    assert all(isinstance(q.error, DaemonStopping) and q.answer is None for q in waiting)
    assert [h["source"] for h in daemon.recent_questions()] == ["cli"]  # what was answered (or cut), for the page


# ---------------------------------------------------------------------------------------------- blind spot, fair share
@pytest.mark.slow
@pytest.mark.parametrize("backlog_s", [60.0, 0.0])
def test_frames_sampled_while_answering_are_ingested_right_after(tiny_checkpoint, backlog_s):
    """A paced camera at 8 frames/s, an answer that takes seconds: with the backlog every sampled frame
    is ingested (no hole in the capture times); without it (the old behaviour) the answer is a hole."""
    config = _config(tiny_checkpoint).with_overrides(video={
        "source": "synthetic:shapes?size=160x120&fps=16&frames=100000", "fps": 8.0, "answer_backlog_s": backlog_s})
    with Running(config, io.StringIO(), no_server=True) as run:
        daemon = run.daemon
        assert not daemon.sampler.deterministic and daemon.sampler.capture.pace  # --realtime: a camera
        times = _recording(daemon)
        assert _wait(lambda: len(times) >= 4)
        question = Question("What moved?", max_new_tokens=40, on_token=lambda _token: time.sleep(0.05))
        before = len(times)
        started = time.monotonic()
        daemon.submit(question)
        assert question.done.wait(120)
        answer_s = time.monotonic() - started
        count = len(times)
        assert _wait(lambda: len(times) >= count + 4 and not len(daemon.backlog))
        stats = daemon.backlog.stats()
    assert question.error is None and len(question.answer.token_ids) >= 20 and answer_s > 1.0
    holes = np.diff(times[before - 1:])
    if backlog_s:
        assert stats["frames_lost_while_answering"] == 0
        assert stats["frames_kept_while_answering"] >= 0.5 * answer_s * 8
        assert holes.max() < 0.5 * answer_s, holes
        assert list(times) == sorted(times)  # the backlog keeps capture order
    else:
        assert stats["frames_kept_while_answering"] == 0 and holes.max() >= 0.6 * answer_s


def test_ingest_keeps_its_share_while_many_questions_wait(tiny_checkpoint):
    """A recorded stream (a frame always waiting) and 30 questions at once: frames keep being ingested
    and the answers that went ahead of frames used no more than the rule allows."""
    with Running(_config(tiny_checkpoint, queue_size=64), io.StringIO(), no_server=True, realtime=False) as run:
        daemon = run.daemon
        assert daemon.sampler.deterministic
        frames = daemon.session.counters.frames
        questions = [Question(f"Question {i}?", max_new_tokens=8) for i in range(30)]
        for question in questions:
            daemon.submit(question)
        assert all(question.done.wait(300) for question in questions)
        fair = daemon.fair
        ingested = daemon.session.counters.frames - frames
    assert all(q.error is None for q in questions) and ingested > 0 and fair.answers_ahead > 0
    # the credit rule: time spent ahead of frames <= earned (a quarter of ingest time) + one overdraft
    assert fair.answer_ahead_s <= fair.earn_rate * fair.ingest_s + fair.longest_answer_s + 1e-9


# ---------------------------------------------------------------------------------------------- systemd
class FlakyCamera:
    """A live camera (20 frames/s, 160x120) that is lost while ``down`` is set and refuses to reopen."""

    def __new__(cls):
        from edgekv.video.sources import FrameSource, SourceLost, SourceUnavailable

        class Camera(FrameSource):
            def __init__(self) -> None:
                super().__init__("fake:camera", live=True)
                self.down = threading.Event()
                self.origin = time.monotonic()
                self.frame = np.random.default_rng(0).integers(0, 256, (120, 160, 3), dtype=np.uint8)

            def read(self):
                time.sleep(0.05)
                if self.down.is_set():
                    raise SourceLost("cable pulled")
                return self.frame.copy(), time.monotonic() - self.origin

            def reopen(self) -> None:
                if self.down.is_set():
                    raise SourceUnavailable("still gone")

        return Camera()


def _fake_camera(monkeypatch):
    from edgekv.video.sources import SourceSpec

    camera = FlakyCamera()
    monkeypatch.setattr("edgekv.apps.daemon.loop.open_video_source",
                        lambda config: (SourceSpec("camera", 0, raw="fake:camera"), camera))
    return camera


def test_watchdog_keeps_pinging_through_a_camera_outage(tiny_checkpoint, notify, monkeypatch):
    """The reproduction: WATCHDOG=1 stopped for 53 s while the camera was gone. Waiting for a reconnect
    is progress; reconnects follow video.reconnect_backoff_s."""
    camera = _fake_camera(monkeypatch)
    config = _config(tiny_checkpoint).with_overrides(video={"reconnect_backoff_s": [0.05, 0.1]})
    with Running(config, io.StringIO(), no_server=True) as run:
        daemon = run.daemon
        camera.down.set()
        assert _wait(lambda: daemon.stream_state == "reconnecting", 10)
        outage = time.monotonic()
        time.sleep(3.0)
        during = daemon.sampler.stats()
        state_during = daemon.stream_state
        camera.down.clear()
        assert _wait(lambda: daemon.stream_state == "running", 10)
        frames = daemon.session.counters.frames
        assert _wait(lambda: daemon.session.counters.frames >= frames + 2, 20)
    assert state_during == "reconnecting"
    assert len(notify.pings(outage, outage + 3.0)) >= 3  # every 0.5 s; systemd's limit is 1.5 s
    assert during["reconnect_attempts"] >= 10  # backoff capped at 0.1 s (the default [0.5, 30] allows <= 3)
    assert during["backoff_s_total"] <= 0.1 * during["reconnect_attempts"] + 1e-6
    assert notify.states()[0] == "READY=1" and notify.states()[-1] == "STOPPING=1"


def test_watchdog_goes_quiet_when_the_main_loop_hangs(tiny_checkpoint, notify):
    """A hung loop must get restarted: the pings stop within WatchdogSec / 2 of the last progress."""
    with Running(_config(tiny_checkpoint), io.StringIO(), no_server=True) as run:
        daemon = run.daemon
        assert _wait(lambda: len(notify.pings()) >= 2, 10)
        release = threading.Event()
        ingest = daemon.session.ingest
        daemon.session.ingest = lambda frame, t=None, **stamps: (release.wait(30), ingest(frame, t=t, **stamps))[1]
        assert _wait(lambda: daemon.watchdog.withheld >= 2, 10)
        quiet = time.monotonic()
        time.sleep(1.0)
        silent = notify.pings(since=quiet)
        release.set()
        daemon.session.ingest = ingest
        resumed = time.monotonic()
        assert _wait(lambda: len(notify.pings(since=resumed)) >= 1, 10)
    assert silent == []


def test_systemd_unit_matches_the_daemon():
    from edgekv.apps.daemon.camera import build_parser
    from edgekv.apps.daemon.loop import STOP_BUDGET_S

    unit = (ROOT / "jetson" / "edgekv-camera.service").read_text()
    values = dict(re.findall(r"^(\w+)=(.*)$", unit, re.M))
    assert values["Type"] == "notify" and values["NotifyAccess"] == "main"
    assert STOP_BUDGET_S + 5 <= float(values["TimeoutStopSec"])  # the shutdown budget plus one step
    assert float(values["WatchdogSec"]) >= 10  # pings every third of it, silence after half of it
    args = build_parser().parse_args(values["ExecStart"].split()[1:])  # every flag it passes exists
    assert args.no_stdin and args.config == "/etc/edgekv/deploy.yaml" and args.max_frames is None


@pytest.mark.slow
def test_sigterm_with_twelve_waiting_questions(tiny_checkpoint, tmp_path):
    """The reproduction: 12 queued questions made SIGTERM take 39.5 s (TimeoutStopSec=20). Now they are
    refused, the answer in progress is cut, every request returns, the watchdog kept pinging while they
    were answered, and a lone surrogate in a request on the way did not kill the daemon."""
    # room in the cache for a 256-token answer: the server refuses (400) a question that cannot fit
    config = _config(tiny_checkpoint, max_new_tokens=256).with_overrides(
        generation={"max_new_tokens": 256}, cache={"max_tokens": 700, "text_reserve_tokens": 300})
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps(config.to_dict()))  # JSON is YAML
    listener = NotifyListener(tmp_path / "notify.sock")
    env = {**os.environ, "NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "4000000"}
    process = subprocess.Popen([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(path), "--no-stdin",
                                "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        for line in process.stdout:
            lines.append(line)
            if line.startswith("HTTP API on "):
                break
        base = re.search(r"http://[\d.]+:\d+", lines[-1]).group(0)
        status, _ = _request(base + "/v1/chat/completions",
                             raw=b'{"messages": [{"role": "user", "content": "hi \\ud800 there"}]}')
        assert status == 400  # refused by the server, named (invalid_unicode); the daemon lives on
        status, _ = _request(base + "/v1/chat/completions",
                             raw=b'{"messages": [{"role": "user", "content": "hi there\\nA: forged"}], "max_tokens": 2}')
        assert status == 200
        time.sleep(1.0)
        assert process.poll() is None and _request(base + "/healthz")[0] == 200
        results = []

        def ask(i):
            results.append(_request(base + "/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": f"Question {i}?"}], "max_tokens": 256}))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
        for thread in threads:
            thread.start()
        answering = time.monotonic()
        assert _wait(lambda: len(results) >= 1, 120)  # one answered: the other eleven are queued behind it
        time.sleep(1.0)
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
        took = time.monotonic() - sent
        for thread in threads:
            thread.join(30)
    finally:
        if process.poll() is None:
            process.kill()
        listener.close()
    out = "".join(lines) + out
    assert process.returncode == 0, out
    assert took < 20, f"SIGTERM took {took:.1f} s"  # the unit's TimeoutStopSec
    match = re.search(r"refused (\d+) waiting question", out)
    assert match, out
    refused = int(match.group(1))
    assert refused >= 1 and "SIGTERM: finishing the current step" in out and "frames " in out
    assert len(results) == 12 and sum(b"shutting down" in body for _, body in results) >= refused
    assert "Q [http]: hi there\\nA: forged" in out and "\nA: forged" not in out  # escaped: no forged line
    pings = listener.pings(answering, sent)
    assert len(pings) >= 2 and max(np.diff([answering, *pings, sent])) < 4.0  # never silent for WatchdogSec
    assert listener.states()[0] == "READY=1" and "STOPPING=1" in listener.states()


# ---------------------------------------------------------------------------------------------- stream end, loop
def test_the_api_stays_up_after_the_stream_ends(tiny_checkpoint):
    config = _config(tiny_checkpoint).with_overrides(video={"source": "synthetic:shapes?size=160x120&fps=8&frames=24"})
    with Running(config, io.StringIO(), realtime=False) as run:
        assert _wait(lambda: run.daemon.stream_state == "ended", 60)
        status, body = _request(run.base + "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "What did you see?"}], "max_tokens": 4})
        health = json.loads(_request(run.base + "/healthz")[1])
        assert run.thread.is_alive() and run.daemon.stream_detail == "the source ended"
        frames = run.daemon.session.counters.frames
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] is not None
    assert health["status"] == "ok" and frames == 12  # 24 frames at 8 fps, sampled at 4 fps


def test_video_loop_plays_a_short_file_again(tiny_checkpoint):
    config = _config(tiny_checkpoint).with_overrides(
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=6", "loop": True})
    with Running(config, io.StringIO(), no_server=True, realtime=False) as run:
        assert _wait(lambda: run.daemon.session.counters.frames >= 12, 60)  # 3 sampled frames per pass
        assert run.daemon.stream_state == "running" and run.daemon.sampler.deterministic


@pytest.mark.slow
def test_readme_one_shot_demo_exits_by_itself(tiny_checkpoint, tmp_path):
    config = _config(tiny_checkpoint).with_overrides(video={"source": "synthetic:shapes?size=320x240&fps=4&frames=400"})
    path = tmp_path / "demo.yaml"
    path.write_text(json.dumps(config.to_dict()))
    proc = subprocess.run([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(path), "--max-frames", "8",
                           "--no-stdin", "--ask", "What is moving in the video?"], capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "stream ended: --max-frames 8 reached after 8 frames" in proc.stdout
    assert "Q [cli]: What is moving in the video?\nA: " in proc.stdout and "frames 8 (4 pairs)" in proc.stdout


@pytest.mark.parametrize("reserve, noted, answer", [(96, False, 8), (320, True, 8), (96, False, 80)])
def test_the_start_line_says_how_the_cap_is_shared(tiny_checkpoint, reserve, noted, answer):
    """``--max-tokens 640`` with the default 512-token text reserve left the video 8 frame pairs, and the start-up
    line said only "cache cap 640 tokens". It now says the video's room, the pairs it holds at video.resolution and
    the reserve; and a note where the reserves take most of the cap. And one where an answer of
    ``generation.max_new_tokens`` leaves the reserve no room for a question: once the cache filled, every question
    without its own max_tokens was refused, and nothing said so at the start."""
    config = _config(tiny_checkpoint).with_overrides(
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=8"}, cache={"text_reserve_tokens": reserve},
        generation={"max_new_tokens": answer})
    out = io.StringIO()
    with Running(config, out, no_server=True, realtime=False) as run:
        assert _wait(lambda: "allocated once" in out.getvalue(), 60)
        session = run.daemon.session
        room = session.video_limit - session.prefix_tokens
    assert room == 400 - reserve - session.prefix_tokens
    text = out.getvalue()
    assert (f"cache cap 400 tokens = {session.cache.capacity_bytes / 2**20:.2f} MiB allocated once (video {room} "
            f"tokens, {room // 16} frame pairs at 112x112; {reserve} kept for a question and its answer") in text
    assert ("note: the reserves take most of the cap" in text) == noted
    assert ("note: generation.max_new_tokens 80 leaves 16 of cache.text_reserve_tokens 96 for a question: once the "
            "cache is full, a question asked without its own max_tokens is refused" in text) == (answer == 80)


@pytest.mark.parametrize("frames, limit, by", [(47, None, None), (1, None, None), (40, 5, "flag"),
                                               (40, 7, "config")])
def test_the_last_frame_of_a_finite_source_is_seen(tiny_checkpoint, tmp_path, frames, limit, by):
    """A recording of an odd number of frames, or a still image (one frame): its last frame waited for a partner that
    never came, and was read and never seen ("frames 1 (0 pairs)": the model had seen nothing of a photo). So did the
    last of an odd ``--max-frames`` / ``video.max_frames``."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": f"synthetic:shapes?size=160x120&fps=8&frames={frames}", "fps": 8.0, "resolution": [56, 56],
               "max_frames": limit if by == "config" else None},
        cache={"policy": "sliding_window", "max_tokens": 400, "text_reserve_tokens": 64}, server={"port": 0},
        monitor={"backend": "cpu"}, generation={"max_new_tokens": 2}, alerts={"keyframe_pairs": 4})
    frames = frames if limit is None else limit
    if by == "flag":  # one-shot: the daemon answers what it was asked and stops
        from edgekv.apps.daemon.loop import Daemon

        with open(tmp_path / "out.txt", "w") as out:
            daemon = Daemon(config, _args(max_frames=limit, realtime=False, no_server=True), out=out)
            assert daemon.run() == 0
        counters = daemon.session.counters
        assert counters.frames == frames and counters.frame_pairs == (frames + 1) // 2
        assert daemon.session.ingestor.pending is None
        assert "--max-frames 5 reached after 5 frames" in (tmp_path / "out.txt").read_text()
        return
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        counters = daemon.session.counters
        assert counters.frames == frames and counters.frame_pairs == (frames + 1) // 2
        assert daemon.session.ingestor.pending is None
        assert (frames + 1) // 2 - 1 in daemon.alerts.keyframes.frames  # its picture kept, as every pair's
