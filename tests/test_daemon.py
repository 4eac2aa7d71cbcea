"""The camera daemon end to end on a tiny checkpoint: OpenAI-compatible API with streaming, metrics,
auth, request limits, concurrent questions during ingest, the status page data, and SIGTERM."""

from __future__ import annotations

import argparse
import io
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

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

    def __init__(self, config: EdgeKVConfig, out) -> None:
        from edgekv.apps.daemon import Daemon

        self.daemon = Daemon(config, _args(), out=out)
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        assert self.daemon.ready.wait(60), "daemon did not start"
        deadline = time.monotonic() + 30
        while self.daemon.session.counters.frame_pairs < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.base = f"http://127.0.0.1:{self.daemon.server.port}"
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
                 "edgekv_frames_dropped", "edgekv_process_rss_bytes"):
        assert name in families, name


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


@pytest.mark.slow
def test_sigterm_finishes_the_step_and_exits_zero(tiny_checkpoint, tmp_path):
    config = tmp_path / "deploy.yaml"
    config.write_text(json.dumps(_config(tiny_checkpoint).to_dict()))  # JSON is YAML
    process = subprocess.Popen([sys.executable, "-m", "edgekv.apps.camera", "--config", str(config), "--no-stdin"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if line.startswith("pair ") and " 3 " in line[:12]:
            break
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, "".join(lines) + out
    assert "SIGTERM: finishing the current step" in out
    assert "frames " in out and "cache " in out


def test_startup_failure_is_one_clear_line_and_exit_2(tiny_checkpoint, tmp_path, capsys):
    """Engines that were never built: the daemon says what to run instead of dumping a traceback."""
    from edgekv.apps.daemon import Daemon

    pytest.importorskip("onnxruntime")
    config = _config(tiny_checkpoint).with_overrides(
        engines={"vision": "onnxruntime", "llm": "onnxruntime", "engine_dir": str(tmp_path)})
    out = io.StringIO()
    assert Daemon(config, _args(), out=out).run() == 2
    err = capsys.readouterr().err
    assert err.startswith("edgekv-camera: cannot start: no onnxruntime engines built") and "edgekv build" in err
    assert "Traceback" not in err
