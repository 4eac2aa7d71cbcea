"""A real daemon on the tiny checkpoint with its HTTP API on 127.0.0.1, and small HTTP / raw-socket clients
for the server tests (kept apart from test_daemon.py so the server tests do not depend on its helpers)."""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from edgekv.config import EdgeKVConfig
from helpers_wait import let_go


def daemon_args(**overrides) -> argparse.Namespace:
    values = {"ask": [], "ask_every": 0, "max_frames": None, "no_server": False, "no_stdin": True, "quiet": True,
              "realtime": True}
    values.update(overrides)
    return argparse.Namespace(**values)


def kept_config(model_dir: Path, root: Path, frames: int = 48, max_tokens: int = 400, archive: bool = True,
                **sections) -> EdgeKVConfig:
    """A daemon that keeps what it saw: a short synthetic stream of 56 x 56 pairs under a full cache, an archive with
    evidence frames under ``root/archive`` (``archive=False``: none) and snapshots under ``root/state``. A section
    given (``state={...}``, ``alerts={...}``) is merged over these."""
    base = {
        "model": {"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        "video": {"source": f"synthetic:shapes?size=160x120&fps=8&frames={frames}", "fps": 8.0,
                  "resolution": [56, 56]},
        "cache": {"policy": "full", "max_tokens": max_tokens, "text_reserve_tokens": 64}, "server": {"port": 0},
        "archive": {"dir": str(root / "archive"), "when_full": "wait", "segment_mib": 0.25, "max_gib": 0.01,
                    "frames_mib": 1, "frames_px": 32} if archive else {},
        "state": {"dir": str(root / "state"), "every_s": 3600}, "monitor": {"backend": "cpu"}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return EdgeKVConfig().with_overrides(**{name: values for name, values in base.items() if values})


def server_config(model_dir: Path, **server) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=100000", "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 400, "text_reserve_tokens": 96},
        server={"port": 0, "max_new_tokens": 16, "request_timeout_s": 2.0, "keep_alive_s": 1.0, **server},
        generation={"max_new_tokens": 4},
        monitor={"interval_s": 0.2, "backend": "cpu"},
    )


class RunningDaemon:
    """A Daemon in a background thread, stopped through its flag (signals belong to the main thread)."""

    def __init__(self, config: EdgeKVConfig, out_path: Path, pairs: int = 2) -> None:
        """``pairs``: frame pairs to wait for after the start (0: none, e.g. a camera that is not up yet)."""
        from edgekv.apps.daemon.loop import Daemon

        self.pairs = pairs
        self.out = open(out_path, "w")
        self.daemon = Daemon(config, daemon_args(), out=self.out)
        self.thread = threading.Thread(target=self.daemon.run, daemon=True)

    def __enter__(self) -> "RunningDaemon":
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.daemon.ready.wait(0.05) and self.thread.is_alive() and time.monotonic() < deadline:
            pass
        assert self.daemon.ready.is_set(), "daemon did not start (see its stderr)"
        deadline = time.monotonic() + 30
        while self.daemon.session.counters.frame_pairs < self.pairs and time.monotonic() < deadline:
            time.sleep(0.05)
        self.port = self.daemon.server.port
        self.base = f"http://127.0.0.1:{self.port}"
        return self

    def stop(self) -> None:
        self.daemon.stop.event.set()
        self.thread.join(30)
        assert not self.thread.is_alive(), "daemon did not stop"

    def __exit__(self, *exc) -> None:
        if self.thread.is_alive():
            self.stop()
        self.out.close()


@contextmanager
def ended_daemon(config: EdgeKVConfig, out_path: Path, realtime: bool = False):
    """A Daemon (no stdin, quiet, the source read as fast as it goes — or, ``realtime``, at its own pace, each frame
    stamped with the wall time it was sampled at) whose finite stream has ended: its cache no longer changes, so
    answers do not depend on when they are asked. Stopped on exit."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    with open(out_path, "w") as out:
        daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True, realtime=realtime), out=out)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        try:
            assert daemon.ready.wait(120)
            assert daemon.stream_ended.wait(300), "the stream did not end"
            assert daemon.stream_state == "ended"
            yield daemon
        finally:
            daemon.stop.event.set()
            thread.join(60)
            # a stop past its budget (a loaded machine) closes the evidence frames and the archive after run()
            # returned: a daemon started next in this process would find the archive folder still held
            let_go(daemon)


def call(port: int, method: str, path: str, body=None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, dict, bytes]:
    """One HTTP request on a fresh connection: (status, lower-case headers, body)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    sent = {"Content-Type": "application/json"} if data is not None else {}
    sent.update(headers or {})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def chat(port: int, content, headers: dict | None = None, **fields) -> tuple[int, dict, bytes]:
    body = {"messages": [{"role": "user", "content": content}], **fields}
    return call(port, "POST", "/v1/chat/completions", body, headers=headers)


def error_of(body: bytes) -> dict:
    """The OpenAI error object of a response body (asserting its shape)."""
    payload = json.loads(body)
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def connect(port: int, timeout: float = 10) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.settimeout(timeout)
    return sock


def read_until_closed(sock: socket.socket, limit_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection; (data, seconds it took)."""
    started = time.monotonic()
    sock.settimeout(limit_s)
    chunks = []
    try:
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    except (socket.timeout, ConnectionResetError):
        pass
    return b"".join(chunks), time.monotonic() - started


@contextmanager
def frozen(run: RunningDaemon, monkeypatch):
    """No new frames while inside (the capture is not read; questions are still answered): answers and
    figures depend on the cache only, so the same request gives the same answer."""
    def no_frame(timeout: float = 0.2, *args, **kwargs):
        time.sleep(min(timeout, 0.05))
        return None

    monkeypatch.setattr(run.daemon.sampler, "next_frame", no_frame)
    with run.daemon.lock:  # wait for a step in progress to finish
        pass
    yield


def poll(page, expression: str, timeout_s: float = 20) -> None:
    """Wait until a JS expression is truthy in a Playwright page. (Playwright's wait_for_function evaluates strings,
    which the status page's Content-Security-Policy forbids; page.evaluate is not subject to it.)"""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if page.evaluate(f"() => Boolean({expression})"):
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {expression}")
