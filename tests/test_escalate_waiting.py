"""A chat question waiting on the escalation server, as a client on the wire sees it (apps/server/chat.py,
apps/outputs/escalate.py ``asker_left``). A streamed escalating answer sent its status and headers only once the
remote had answered — up to ``escalate.timeout_s`` of silence, past the read timeout of many clients and proxies
(nginx's proxy_read_timeout is 60 s): now its headers go as soon as it waits on the remote, and an SSE comment line
keeps it visibly alive until the remote's chunks come, which the OpenAI SDK's SSE parser skips. A client who leaves
while it waits — streamed or whole — left the exchange with the remote running to its end, the escalation thread (and
every question behind it) held for nobody: it is cut now.

The fake remote holds its answer until the test releases it, or until the escalator hangs up; no test sleeps."""

from __future__ import annotations

import json
import re
import select
import socket
import threading

import pytest

pytest.importorskip("fastapi")

from helpers_remote import chat_body, remote_with  # noqa: E402,F401 (a fixture)
from helpers_server import RunningDaemon, call, server_config  # noqa: E402

BOUND_S = 120
CHAT = chat_body("a red cup on the table")


def _config(tiny_checkpoint, url: str):
    config = server_config(tiny_checkpoint, request_timeout_s=60.0)
    return config.with_overrides(escalate={"url": url, "model": "big", "timeout_s": 300, "keyframes": 1})


class HangUps:
    """The remote's reply: the first request held until the escalator hangs up (``abandoned`` set) or the test
    releases it; any later one answered at once."""

    def __init__(self) -> None:
        self.abandoned = threading.Event()

    def __call__(self, handler, remote) -> None:
        if len(remote.bodies) == 1:
            readable, _, _ = select.select([handler.connection, _Wake(remote.release)], [], [], 300)
            if handler.connection in readable and handler.connection.recv(1) == b"":
                self.abandoned.set()
                return
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(CHAT)))
        handler.end_headers()
        handler.wfile.write(CHAT)


class _Wake:
    """A file descriptor ``select`` can wait on that becomes readable when ``event`` is set."""

    def __init__(self, event: threading.Event) -> None:
        self.reader, self.writer = socket.socketpair()
        threading.Thread(target=lambda: event.wait(300) and self.writer.send(b"x"), daemon=True).start()

    def fileno(self) -> int:
        return self.reader.fileno()


def _send(port: int, stream: bool, question: str = "What is on the table?") -> socket.socket:
    """A chat request on a raw socket (escalating; streamed or not), the response left unread."""
    body = json.dumps({"messages": [{"role": "user", "content": question}], "max_tokens": 2,
                       "escalate": True, "stream": stream}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def _read_until(sock: socket.socket, got: bytes, done) -> bytes:
    """Bytes from ``sock`` appended to ``got`` until ``done(bytes)`` (or the server closes)."""
    while not done(got):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    return got


def _comments(got: bytes) -> list[bytes]:
    """The SSE comment lines (``: ...``) in what came so far."""
    return re.findall(rb"(?m)^:[^\r\n]*", got.partition(b"\r\n\r\n")[2])


def _dechunked(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes."""
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        length = int(size.split(b";")[0], 16)
        if length == 0:
            break
        out, body = out + rest[:length], rest[length + 2:]
    return out


def test_a_streamed_escalation_sends_its_headers_at_once_and_comments_while_the_remote_thinks(tiny_checkpoint,
                                                                                               tmp_path, remote_with,
                                                                                               monkeypatch):
    from edgekv.apps.server import chat

    monkeypatch.setattr(chat, "KEEPALIVE_S", 0.05, raising=False)  # several comment lines while the remote is held
    hold = HangUps()
    remote = remote_with(hold)
    with RunningDaemon(_config(tiny_checkpoint, remote.url), tmp_path / "out.txt") as run:
        sock = _send(run.port, stream=True)
        try:
            got = _read_until(sock, b"", lambda got: len(_comments(got)) >= 3)
            assert remote.arrived.acquire(timeout=BOUND_S)  # it is the remote that is being waited on
            assert not remote.release.is_set() and not hold.abandoned.is_set()
            head, _, body = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200"), head
            assert b"content-type: text/event-stream" in head.lower()
            assert b"data:" not in body  # no chunk before the remote's: each names its model
            remote.release.set()
            got = _read_until(sock, got, lambda got: got.endswith(b"\r\n0\r\n\r\n"))
        finally:
            sock.close()
    stream = _dechunked(got.partition(b"\r\n\r\n")[2])
    events = [line[len("data: "):] for line in stream.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert {chunk["model"] for chunk in chunks} == {"big"}
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
    assert text == "a red cup on the table" and chunks[-1]["edgekv"]["escalated"] is True
    openai_streaming = pytest.importorskip("openai._streaming")  # the OpenAI SDK's own parser: comments are no event
    decoded = list(openai_streaming.SSEDecoder().iter_bytes(iter([stream])))
    assert [sse.data for sse in decoded] == events and all(sse.event is None for sse in decoded)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_who_leaves_while_the_remote_thinks_cuts_the_escalation(tiny_checkpoint, tmp_path, remote_with,
                                                                        stream):
    """The exchange with the remote went on to its end (escalate.timeout_s), holding the escalation thread and every
    question behind it for an answer nobody would read. The escalator hangs up now, and the next question escalates
    at once."""
    hold = HangUps()
    remote = remote_with(hold)
    with RunningDaemon(_config(tiny_checkpoint, remote.url), tmp_path / "out.txt") as run:
        sock = _send(run.port, stream=stream)
        try:
            assert remote.arrived.acquire(timeout=BOUND_S)  # the escalation is on the wire
            if stream:
                assert _read_until(sock, b"", lambda got: b"\r\n\r\n" in got).startswith(b"HTTP/1.1 200")
        finally:
            sock.close()
        assert hold.abandoned.wait(BOUND_S), "the remote was left answering a client who had gone"
        status, _, raw = call(run.port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "What is on the table?"}], "max_tokens": 2,
                               "escalate": True}, timeout=BOUND_S)
        stats = run.daemon.escalator.stats()
    assert status == 200 and json.loads(raw)["edgekv"]["escalated"] is True, raw
    assert not remote.release.is_set() and len(remote.bodies) == 2
    assert stats["escalations_withdrawn"] == 1 and stats["escalations_failed"] == 0 and stats["escalations_sent"] == 1


def test_concurrent_streamed_escalations_each_wait_alive_and_get_their_own_answer(tiny_checkpoint, tmp_path,
                                                                                  remote_with):
    """Three streamed escalations at once, the remote holding its answers: each has its headers while the remote is
    held (one on the wire, two queued behind it), then each gets the answer to its own question."""
    def echo(handler, remote) -> None:
        remote.release.wait(300)
        body = chat_body("about " + remote.bodies[-1]["messages"][-1]["content"][0]["text"])  # one at a time
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    remote = remote_with(echo)
    questions = [f"What is on shelf {n}?" for n in range(3)]
    with RunningDaemon(_config(tiny_checkpoint, remote.url), tmp_path / "out.txt") as run:
        socks = []
        try:
            for question in questions:
                socks.append(_send(run.port, stream=True, question=question))
            heads = [_read_until(sock, b"", lambda got: b"\r\n\r\n" in got) for sock in socks]
            assert all(head.startswith(b"HTTP/1.1 200") for head in heads), heads
            assert not remote.release.is_set()
            remote.release.set()
            bodies = [_read_until(sock, head, lambda got: got.endswith(b"\r\n0\r\n\r\n")) for sock, head in
                      zip(socks, heads)]
        finally:
            for sock in socks:
                sock.close()
    for question, got in zip(questions, bodies):
        stream = _dechunked(got.partition(b"\r\n\r\n")[2]).decode()
        chunks = [json.loads(line[6:]) for line in stream.split("\n\n") if line.startswith("data: {")]
        text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks if chunk["choices"])
        assert text == f"about {question}", text
