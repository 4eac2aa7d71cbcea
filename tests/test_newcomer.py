"""What a new user hit, tried as a new user would (issue 25 §3): each test here failed before its fix.

``edgekv serve|build|plan builtin:toy``; a served model name the README's OpenAI snippet can use; ``cache:
{max_mib: X}`` alone; a broken pipe under ``| head``; ``/health``, ``/version`` and a public ``/metrics``; an
8-bit WAV; the status page's frame shown true.
"""

from __future__ import annotations

import json
import subprocess
import sys
import wave

import numpy as np
import pytest

from edgekv.config import EdgeKVConfig, config_from_dict


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgekv.apps.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


# ---------------------------------------------------------------------------------------------- builtin:toy
def test_serve_takes_builtin_toy_as_its_model_dir():
    from edgekv.apps.args import config_from_args
    from edgekv.apps.cli import build_parser

    args = build_parser(["serve", "builtin:toy"]).parse_args(["serve", "builtin:toy"])
    assert config_from_args(args).model.path == "builtin:toy"
    args = build_parser(["serve"]).parse_args(["serve", "--model", "builtin:toy"])
    assert config_from_args(args).model.path == "builtin:toy"


def test_plan_reads_builtin_toy():
    proc = _cli("plan", "--device-memory", "8", "--model", "builtin:toy", "--resolution", "112", "112")
    assert proc.returncode == 0, proc.stderr
    assert "no config.json" not in proc.stdout + proc.stderr


def test_build_resolves_builtin_toy(tmp_path):
    pytest.importorskip("onnx")
    from edgekv.engines.build import deployment

    config = EdgeKVConfig().with_overrides(model={"path": "builtin:toy", "dtype": "fp32"},
                                           video={"resolution": [112, 112]}, cache={"max_tokens": 640,
                                                                                    "text_reserve_tokens": 64})
    dep = deployment(config, "onnxruntime", engine_dir=tmp_path)
    assert (dep.model_dir / "config.json").is_file()


# ---------------------------------------------------------------------------------------------- config
def test_max_mib_alone_replaces_the_default_max_tokens():
    config = config_from_dict({"cache": {"max_mib": 64.0}})
    assert config.cache.max_mib == 64.0 and config.cache.max_tokens is None
    config = EdgeKVConfig().with_overrides(cache={"max_mib": 32.0})
    assert config.cache.max_mib == 32.0 and config.cache.max_tokens is None


def test_max_tokens_and_max_mib_both_written_are_still_refused():
    from edgekv.config import ConfigError

    with pytest.raises(ConfigError, match="set exactly one of max_tokens and max_mib"):
        config_from_dict({"cache": {"max_mib": 64.0, "max_tokens": 1024}})


# ---------------------------------------------------------------------------------------------- pipes
def test_plan_into_a_closed_pipe_is_quiet():
    """``edgekv plan ... | head``: the reader goes away; no "[Errno 32] Broken pipe", exit 0. The pipe's read
    end is closed before the command starts, so its first write meets a pipe nobody reads."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, "-m", "edgekv.apps.cli", "plan", "--device-memory", "8", "--model",
                               "builtin:toy", "--resolution", "112", "112"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert "Broken pipe" not in proc.stderr and "Errno 32" not in proc.stderr, proc.stderr
    assert proc.returncode == 0


# ---------------------------------------------------------------------------------------------- voice
def test_an_8_bit_wav_is_read(tmp_path):
    pytest.importorskip("faster_whisper", reason="reading audio takes faster-whisper (pip install 'edgekv[voice]')")
    from edgekv.apps.voice.listen import read_wav

    rate = 8000
    t = np.arange(rate // 2) / rate
    samples = (128 + 100 * np.sin(2 * np.pi * 440 * t)).astype(np.uint8)
    path = tmp_path / "u8.wav"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(1)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    audio = read_wav(path)
    assert audio.dtype == np.float32 and abs(len(audio) - 8000) <= 16  # 0.5 s at 16 kHz
    assert 0.5 < float(np.abs(audio).max()) < 1.0


def test_the_voice_example_in_the_readme_runs_past_an_event():
    """The README's ``--voice-wav`` example must ask its question after the demo stream's events were ingested,
    so the answer is grounded (it stopped at frame 40; the first event is at frame 120)."""
    import re
    from pathlib import Path

    import yaml

    from edgekv.video.sources import open_source

    root = Path(__file__).resolve().parents[1]
    example = re.search(r"edgekv-camera --config configs/cpu-demo.yaml ([^\n]*)--voice-wav", (root / "README.md").read_text())
    assert example is not None
    config = yaml.safe_load((root / "configs" / "cpu-demo.yaml").read_text())
    source = open_source(config["video"]["source"])
    try:
        last = max(2 * event.last_pair + 1 for event in source.scene.events)
    finally:
        source.close()
    frames = re.search(r"--max-frames (\d+)", example.group(1))
    assert "--ask-every" not in example.group(1)  # asked when the stream (or --max-frames) ends
    assert frames is None or int(frames.group(1)) > last


# ---------------------------------------------------------------------------------------------- HTTP
@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, server_config

    config = server_config(tiny_checkpoint, token="sesame", metrics_public=True)
    with RunningDaemon(config, tmp_path_factory.mktemp("newcomer") / "out.txt") as run:
        yield run


def test_health_and_version_routes_need_no_token(served):
    from helpers_server import call

    import edgekv

    for path in ("/health", "/healthz"):
        status, _, body = call(served.port, "GET", path)
        assert status == 200 and json.loads(body)["status"] == "ok"
    status, _, body = call(served.port, "GET", "/version")
    assert status == 200 and json.loads(body)["version"] == edgekv.__version__


def test_metrics_can_be_served_without_the_token(served):
    from helpers_server import call

    status, _, body = call(served.port, "GET", "/metrics")
    assert status == 200 and b"edgekv_frames_total" in body
    assert call(served.port, "GET", "/v1/edgekv/status")[0] == 401  # only /metrics is opened


def test_the_readme_openai_snippet_names_a_served_model(served):
    """``model="edgekv"`` (the README's snippet) is served by default, beside ``edgekv/<folder>``."""
    from helpers_server import call

    status, _, body = call(served.port, "GET", "/v1/models", headers={"Authorization": "Bearer sesame"})
    names = [card["id"] for card in json.loads(body)["data"]]
    assert "edgekv" in names
    status, _, body = call(served.port, "POST", "/v1/chat/completions",
                           {"model": "edgekv", "messages": [{"role": "user", "content": "What moved?"}],
                            "max_tokens": 2}, headers={"Authorization": "Bearer sesame"})
    assert status == 200, body
    assert json.loads(body)["model"] == names[0]


def test_served_model_name_flag_sets_the_names():
    from edgekv.apps.args import config_from_args
    from edgekv.apps.cli import build_parser

    argv = ["serve", "builtin:toy", "--served-model-name", "glasses", "qwen2.5-vl"]
    config = config_from_args(build_parser(argv).parse_args(argv))
    assert config.server.served_model_name == ["glasses", "qwen2.5-vl"]


def test_kept_alive_connections_send_without_delay(served):
    """Every accepted connection has TCP_NODELAY: with the hand-made listening socket (protocol 0) asyncio
    skipped it, and each request after the first on a kept-alive connection waited ~40 ms for a delayed ACK."""
    import http.client
    import socket

    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        for _ in range(2):
            conn.request("GET", "/healthz")
            assert conn.getresponse().read()
        server = served.daemon.server.server
        sockets = [protocol.transport.get_extra_info("socket") for protocol in server.server_state.connections]
        assert sockets
        for sock in sockets:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        conn.close()


def test_edgekv_ask_asks_the_daemon_here_over_http(served, monkeypatch, capsys):
    """`edgekv ask QUESTION` without --fleet asks the daemon on this machine (it refused: --fleet was required):
    the answer printed, whole (--json), or token by token (--stream); the token, an unreachable daemon and options
    of the fleet alone each named in one line."""
    from edgekv.apps.cli import main

    url = f"http://127.0.0.1:{served.port}"
    monkeypatch.setenv("EDGEKV_TOKEN", "sesame")
    capsys.readouterr()
    assert main(["ask", "What is in the picture?", "--url", url, "--max-new-tokens", "3", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] <= 3
    assert main(["ask", "What is in the picture?", "--url", url, "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert main(["ask", "What is in the picture?", "--url", url, "--max-new-tokens", "3", "--stream"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    monkeypatch.delenv("EDGEKV_TOKEN")
    assert main(["ask", "What is in the picture?", "--url", url]) == 2
    assert f"edgekv ask: {url}: HTTP 401" in capsys.readouterr().err
    monkeypatch.setenv("EDGEKV_TOKEN", "sesame")
    assert main(["ask", "What is in the picture?", "--url", url, "--camera", "back"]) == 2
    assert "this daemon watches one camera" in capsys.readouterr().err
    assert main(["ask", "What is in the picture?", "--url", "http://127.0.0.1:9"]) == 2
    assert "the daemon is not reachable" in capsys.readouterr().err
    assert main(["ask", "What is in the picture?", "--url", url, "--broker", "mqtt://b", "--device", "d"]) == 2
    assert "--broker, --device: only with --fleet" in capsys.readouterr().err
    assert main(["ask", "What is in the picture?", "--fleet", "--url", url, "--stream"]) == 2
    assert "--url, --stream: only without --fleet" in capsys.readouterr().err


def test_edgekv_ask_tells_a_broken_answer_from_an_answer(capsys):
    """`edgekv ask` printed a stream cut short, or one whose answer failed mid-way (the daemon's `error` event),
    as if whole, with exit 0; and a reply from something that is not a daemon as a JSON parser's message. Each is
    now one line naming the address, exit 2 (the part of an answer already printed stays on its own line)."""
    import http.server
    import socket
    import threading

    from edgekv.apps.cli import main

    replies = {
        "cut": ("text/event-stream", b'data: {"choices": [{"delta": {"content": "hel"}}]}\n\n'),
        "failed": ("text/event-stream", b'data: {"choices": [{"delta": {"content": "so"}}]}\n\n'
                   b'data: {"error": {"message": "the answer failed: out of memory"}}\n\ndata: [DONE]\n\n'),
        "garbage": ("text/event-stream", b"data: {not json\n\n"),
        "page": ("text/html", b"<html>router login</html>"),
        "whole": ("text/event-stream", b'data: {"choices": [{"delta": {"content": "two"}}]}\n\ndata: [DONE]\n\n'),
    }

    class Fake(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["content-length"]))
            kind, body = replies[self.path.split("/")[1]]
            self.send_response(200)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Fake)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        expected = {"cut": "the daemon closed the stream before the answer ended", "failed": "the answer failed on the way: "
                    "out of memory", "garbage": "a stream event that is not JSON",
                    "page": "the reply is text/html, not an answer stream"}
        for name, message in expected.items():
            assert main(["ask", "How many?", "--url", f"{base}/{name}", "--stream"]) == 2, name
            captured = capsys.readouterr()
            assert f"edgekv ask: {base}/{name}: {message}" in captured.err, (name, captured.err)
            assert captured.out in ("", "hel\n", "so\n")
        assert main(["ask", "How many?", "--url", f"{base}/whole", "--stream"]) == 0
        assert capsys.readouterr().out == "two\n"
        assert main(["ask", "How many?", "--url", f"{base}/page"]) == 2
        assert "the reply is not JSON; is this an edgekv daemon's address" in capsys.readouterr().err
        quiet = f"http://127.0.0.1:{silent.getsockname()[1]}"
        assert main(["ask", "How many?", "--url", quiet, "--timeout", "1"]) == 2
        assert f"edgekv ask: {quiet}: no reply within 1 s (--timeout)" in capsys.readouterr().err
    finally:
        server.shutdown()
        silent.close()


def test_edgekv_ask_finds_the_daemon_of_a_config(tmp_path, monkeypatch):
    """The address and token of the daemon a config deploys: its server.host (asked here when bound to every
    address) and port, its server.token or the variable server.token_env names; --token-env wins."""
    from edgekv.apps.ask import daemon_target

    monkeypatch.setenv("EDGEKV_TOKEN", "default-variable")
    monkeypatch.setenv("RIG_TOKEN", "rig")
    assert daemon_target(None) == ("http://127.0.0.1:8080", "default-variable")
    path = tmp_path / "c.yaml"
    for host, url in (("0.0.0.0", "http://127.0.0.1:9001"), ("10.0.0.7", "http://10.0.0.7:9001"),
                      ("::1", "http://[::1]:9001")):
        path.write_text(f"server:\n  host: '{host}'\n  port: 9001\n  token_env: RIG_TOKEN\n")
        assert daemon_target(str(path)) == (url, "rig")
    assert daemon_target(str(path), "EDGEKV_TOKEN")[1] == "default-variable"
    path.write_text("server:\n  token: written-in-the-config\n")
    assert daemon_target(str(path)) == ("http://127.0.0.1:8080", "written-in-the-config")
    monkeypatch.delenv("EDGEKV_TOKEN")
    assert daemon_target(None) == ("http://127.0.0.1:8080", None)
