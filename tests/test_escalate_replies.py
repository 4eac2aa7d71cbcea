"""What an escalation server may send back, read as a user of an OpenAI-compatible server would expect
(apps/outputs/escalate.py ``streamed_reply``, ``ask_remote``): a fake server on loopback answering each case — a
stream cut short or failing mid-answer, a stream under another content type, a server busy (429, Retry-After)."""

from __future__ import annotations

import json
import re
import threading

import pytest
from helpers_remote import Remote

from edgekv.apps.outputs.escalate import Escalation, Escalator, RemoteRefused
from edgekv.apps.outputs.exchange import BadReply
from edgekv.apps.questions import Question
from edgekv.config import EscalateSection
from edgekv.session.results import Answer


def _reply(status: int, content_type: str, body: bytes, headers: tuple = ()):
    def answer(handler, remote) -> None:
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        for name, value in headers:
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)
    return answer


def _chunk(text: str, finish: str | None = None) -> str:
    return "data: " + json.dumps({"object": "chat.completion.chunk", "model": "big", "choices": [
        {"index": 0, "delta": {"content": text}, "finish_reason": finish}]}) + "\n\n"


def _ask(reply) -> tuple[str, str]:
    remote = Remote(reply)
    try:
        escalator = Escalator(EscalateSection(url=remote.url, model="big", timeout_s=60), done=lambda q: None)
        return escalator.ask_remote("What is on the table?", [])
    finally:
        remote.close()


@pytest.mark.parametrize("body, said", [
    (_chunk("a red ") + 'data: {"error": {"message": "model overloaded", "type": "server_error"}}\n\n',
     "streamed an error mid-answer: 'model overloaded'"),
    (_chunk("a red ") + _chunk("cu"), "ended its stream before its end (no [DONE], no finish_reason) after 8 char"),
], ids=["error-event", "cut-short"])
def test_a_stream_that_is_not_whole_is_no_escalated_answer(body, said):
    """A server that failed mid-answer (an error event, as OpenAI and vLLM send one once the status line is gone) or
    went away mid-stream: what had come ("a red ") was returned as the big model's whole answer."""
    with pytest.raises(BadReply, match=re.escape(said)) as caught:
        _ask(_reply(200, "text/event-stream", body.encode()))
    assert "model overloaded" not in caught.value.summary  # the log gets no word of the server's


@pytest.mark.parametrize("content_type, body", [
    ("text/event-stream", (": keep-alive\n\nevent: ping\ndata: {\"object\": \"chat.completion.chunk\", \"model\": "
                           "\"big\",\ndata: \"choices\": [{\"delta\": {\"content\": \"a red \"}}]}\n\n"
                           + _chunk("cup", "stop")).replace("\n", "\r\n")),
    ("application/json", _chunk("a red ") + _chunk("cup") + "data: [DONE]\n\n"),
    ("text/plain; charset=utf-8", _chunk("a red ") + _chunk("cup") + "data: [DONE]"),
], ids=["comments-multiline-crlf", "stream-called-json", "stream-called-text"])
def test_a_stream_is_read_as_sse_whatever_it_is_called(content_type, body):
    """An event's ``data`` over two lines (the SSE spec joins them) failed as "not a chat completion chunk"; a
    stream sent as application/json or text/plain (a proxy's or a small server's content type) as "did not answer
    with a chat completion", every word of the answer there."""
    assert _ask(_reply(200, content_type, body.encode())) == ("a red cup", "big")


class Busy:
    """A server that answers 429 (with ``retry_after``, when given) ``times`` times, then the answer."""

    def __init__(self, times: int, retry_after: str | None, status: int = 429) -> None:
        self.times, self.retry_after, self.status = times, retry_after, status

    def __call__(self, handler, remote) -> None:
        if len(remote.bodies) > self.times:
            return _reply(200, "application/json", CHAT)(handler, remote)
        headers = (("Retry-After", self.retry_after),) if self.retry_after is not None else ()
        _reply(self.status, "application/json", b'{"error": {"message": "rate limited"}}', headers)(handler, remote)


CHAT = json.dumps({"model": "big", "choices": [{"message": {"role": "assistant", "content": "a red cup"}}]}).encode()


@pytest.mark.parametrize("busy, asked", [(Busy(2, "0"), 3), (Busy(1, "Thu, 01 Jan 2004 00:00:00 GMT"), 2),
                                         (Busy(1, None), 2), (Busy(1, "0", status=503), 2)],
                         ids=["seconds", "http-date", "unsaid", "503-saying-when"])
def test_a_busy_server_is_asked_again_when_it_said_to(busy, asked):
    """A rate limit's 429 (Retry-After: 0) failed the escalation at once, the local answer standing, where the
    OpenAI SDK would have asked again: it is asked again after the wait it named, while escalate.timeout_s lasts."""
    remote = Remote(busy)
    try:
        escalator = Escalator(EscalateSection(url=remote.url, model="big", timeout_s=60), done=lambda q: None)
        assert escalator.ask_remote("What is on the table?", []) == ("a red cup", "big")
        assert len(remote.bodies) == asked
    finally:
        remote.close()


@pytest.mark.parametrize("busy, said, asked", [
    (Busy(1, "3600"), "HTTP 429 from {url} (it asked to be asked again in 3600 s, past escalate.timeout_s, 60 s): ", 1),
    (Busy(9, "0"), "HTTP 429 from {url} (busy at each of 3 tries): ", 3),
    (Busy(1, None, status=503), "HTTP 503 from {url}: ", 1),
], ids=["too-late", "always-busy", "503-unsaid"])
def test_a_server_that_stays_busy_fails_saying_so(busy, said, asked):
    remote = Remote(busy)
    try:
        escalator = Escalator(EscalateSection(url=remote.url, model="big", timeout_s=60), done=lambda q: None)
        with pytest.raises(RemoteRefused) as caught:
            escalator.ask_remote("What is on the table?", [])
        assert str(caught.value).startswith(said.format(url=remote.url)), str(caught.value)
        assert len(remote.bodies) == asked
    finally:
        remote.close()


@pytest.mark.parametrize("how", ["asker-left", "stop"])
def test_a_wait_for_a_busy_server_ends_when_the_asker_leaves_or_the_daemon_stops(how):
    """Waiting the Retry-After of a busy server holds the escalation thread: an asker who left or a stop ends it."""
    remote = Remote(Busy(1, "3000"))
    finished = threading.Event()
    escalator = Escalator(EscalateSection(url=remote.url, model="big", timeout_s=3600),
                          done=lambda q: finished.set()).start()
    question = Question("What is on the table?", source="http", escalate=True)
    question.answer = Answer(text="no", token_ids=[3], ttft_s=0.1, decode_tok_s=10.0, confidence=0.4)
    try:
        assert escalator.submit(Escalation(question, [], "asked"))
        assert remote.arrived.acquire(timeout=120)
        if how == "asker-left":
            question.cancelled.set()
            escalator.asker_left(question)
        else:
            escalator.stop(timeout=120)
        assert finished.wait(120), "still waiting to ask a busy server again"
    finally:
        escalator.stop()
        remote.close()
    assert question.answer.escalated is None and len(remote.bodies) == 1
    assert ("the asker left" if how == "asker-left" else "the daemon is stopping") in question.answer.escalation_note
