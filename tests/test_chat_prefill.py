"""The chat API's prefill (vLLM's ``continue_final_message``): a request whose last message is the start of the
assistant's reply has the model continue it, over real HTTP on the shipped toy — the ids the model saw are the
template's question ids followed by the reply's, the answer's content is the continuation only (as vLLM returns it),
whole or streamed, after a conversation, cut by ``stop``, about a request's own images, escalated with the reply's
start; contradictions are 400s naming the field, and nothing is queued for them."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest

pytest.importorskip("fastapi")

import helpers_remote  # noqa: E402
from edgekv.tokenizer import ChatLayout  # noqa: E402
from helpers_remote import answer_with, chat_body  # noqa: E402
from helpers_server import RunningDaemon, call, error_of, frozen, server_config  # noqa: E402

remote_with = helpers_remote.remote_with  # a fixture: the fake escalation server

QUESTION = "Which shape was red?"
PREFIX = "the red"  # toy words: two ids, no <unk>
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    config = server_config("builtin:toy", image_requests=True, max_request_bytes=4 * 2**20)
    with RunningDaemon(config, tmp_path_factory.mktemp("prefill") / "out.txt") as run:
        yield run


def _spy(monkeypatch, session) -> list[dict]:
    """Each ``session.ask`` from now on: its arguments, the ids embedded while it ran (the first: the question's,
    prefilled; then one per decoded token) and its answer."""
    asks: list[dict] = []
    ask, embed = session.ask, session.embed

    def recorded_embed(ids):
        if asks and "answer" not in asks[-1]:
            asks[-1]["embedded"].append(list(ids))
        return embed(ids)

    def recorded_ask(question, **kwargs):
        asks.append({"question": question, "kwargs": kwargs, "embedded": []})
        asks[-1]["answer"] = ask(question, **kwargs)
        return asks[-1]["answer"]

    monkeypatch.setattr(session, "embed", recorded_embed)
    monkeypatch.setattr(session, "ask", recorded_ask)
    return asks


def _prefilled(question=QUESTION, prefix=PREFIX, history=(), **fields) -> dict:
    turns = [{"role": role, "content": text} for role, text in history]
    return {"messages": [*turns, {"role": "user", "content": question}, {"role": "assistant", "content": prefix}],
            **CONTINUE, **fields}


def _ask(run: RunningDaemon, body: dict) -> tuple[int, bytes]:
    status, _, raw = call(run.port, "POST", CHAT, body, timeout=300)
    return status, raw


def _streamed_text(raw: bytes) -> tuple[str, list[dict]]:
    lines = [line[len("data: "):] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    events = [json.loads(line) for line in lines[:-1]]
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]), events


def _expected_ids(session, question: str, prefix: str, history=()) -> list[int]:
    tokenizer = session.tokenizer
    return session.layout.question_suffix_ids(tokenizer, question, history) + tokenizer.encode_text(prefix)


def test_the_model_continues_the_final_assistant_message_and_the_content_is_the_continuation(running, monkeypatch):
    """It was a 400 ("the last message must be the user's question"; ``continue_final_message`` an unrecognized
    argument). Now the model sees the question's ids as the template renders them, then the reply's start, and the
    content is what it generated after that — the same as ``session.ask(..., answer_prefix=...)``."""
    session = running.daemon.session
    tokenizer = session.tokenizer
    with frozen(running, monkeypatch):
        asks = _spy(monkeypatch, session)
        status, raw = _ask(running, _prefilled(max_tokens=4, temperature=0))
        assert status == 200, raw
        with running.daemon.lock:
            direct = session.ask(QUESTION, max_new_tokens=4, temperature=0.0, answer_prefix=PREFIX)
            plain = session.ask(QUESTION, max_new_tokens=4, temperature=0.0)
    body = json.loads(raw)
    served = asks[0]
    assert served["question"] == QUESTION and served["kwargs"]["answer_prefix"] == PREFIX
    assert served["kwargs"]["history"] == ()
    prefix_ids = tokenizer.encode_text(PREFIX)
    assert len(prefix_ids) == 2 and tokenizer.encode_text("<unk>")[0] not in prefix_ids
    # the template's question (rendered as text, then tokenized) followed by the reply's start
    assert session.layout.question_suffix_ids(tokenizer, QUESTION) == tokenizer.encode(
        ChatLayout.question_suffix(QUESTION))
    assert served["embedded"][0] == _expected_ids(session, QUESTION, PREFIX)
    answer = served["answer"]
    message = body["choices"][0]["message"]
    assert message == {"role": "assistant", "content": answer.text}  # the continuation, the prefix not repeated
    assert answer.token_ids == direct.token_ids and answer.text == direct.text
    assert body["usage"]["prompt_tokens"] == answer.prompt_tokens + answer.video_tokens
    assert answer.prompt_tokens == len(served["embedded"][0]) == plain.prompt_tokens + len(prefix_ids)
    assert body["usage"]["completion_tokens"] == len(answer.token_ids)


@pytest.mark.parametrize("flags", [CONTINUE, {"continue_final_message": True}], ids=["vllm", "flag-only"])
def test_a_streamed_continuation_equals_the_whole_one(running, monkeypatch, flags):
    """Streamed and whole give the same continuation (sampled with a seed: the toy's greedy reply is often empty).
    ``add_generation_prompt`` left out with the flag is no contradiction."""
    session = running.daemon.session
    with frozen(running, monkeypatch):
        asks = _spy(monkeypatch, session)
        body = {**_prefilled(max_tokens=6, temperature=2.0, seed=3), **flags}
        status, whole = _ask(running, body)
        assert status == 200, whole
        status, streamed = _ask(running, {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert status == 200, streamed
    text, events = _streamed_text(streamed)
    content = json.loads(whole)["choices"][0]["message"]["content"]
    assert text == content == asks[0]["answer"].text == asks[1]["answer"].text
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(ask["kwargs"]["answer_prefix"] == PREFIX for ask in asks)
    assert events[-1]["usage"] == json.loads(whole)["usage"]


def test_a_continued_reply_after_a_conversation(running, monkeypatch):
    """The turns before the question are its history; the reply's start follows the question's header."""
    session = running.daemon.session
    history = (("user", "What color was the circle?"), ("assistant", "blue"))
    with frozen(running, monkeypatch):
        asks = _spy(monkeypatch, session)
        status, raw = _ask(running, _prefilled(history=history, max_tokens=3, temperature=0))
    assert status == 200, raw
    (served,) = asks
    assert served["kwargs"]["history"] == history and served["kwargs"]["answer_prefix"] == PREFIX
    assert served["embedded"][0] == _expected_ids(session, QUESTION, PREFIX, history)
    assert json.loads(raw)["choices"][0]["message"]["content"] == served["answer"].text


def _a_worded_seed(run: RunningDaemon) -> tuple[int, str]:
    """A seed whose sampled continuation has at least three characters (the toy often stops at once)."""
    for seed in range(40):
        status, raw = _ask(run, _prefilled(max_tokens=6, temperature=2.0, seed=seed))
        assert status == 200, raw
        content = json.loads(raw)["choices"][0]["message"]["content"]
        if len(content) >= 3:
            return seed, content
    raise AssertionError("no seed of 40 gave a continuation of three characters")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_cut_the_continuation_not_the_prefix(running, monkeypatch, stream):
    """``stop`` is matched in what the model generated, as vLLM does: a stop string in the continuation ends the
    content before it; one found only in the reply's start (``"red"``) cuts nothing."""
    with frozen(running, monkeypatch):
        seed, content = _a_worded_seed(running)
        cut = content[1:3]
        status, raw = _ask(running, _prefilled(max_tokens=6, temperature=2.0, seed=seed, stop=[cut], stream=stream))
        assert status == 200, raw
        words = [word for word in PREFIX.split() if word not in content]
        status, kept = _ask(running, _prefilled(max_tokens=6, temperature=2.0, seed=seed, stop=words, stream=stream))
        assert status == 200, kept
    assert words, content
    if stream:
        text, events = _streamed_text(raw)
        assert text == content[:content.find(cut)] and events[-1]["choices"][0]["finish_reason"] == "stop"
        assert _streamed_text(kept)[0] == content
    else:
        choice = json.loads(raw)["choices"][0]
        assert choice["message"]["content"] == content[:content.find(cut)] and choice["finish_reason"] == "stop"
        assert json.loads(kept)["choices"][0]["message"]["content"] == content


def _png() -> dict:
    from PIL import Image

    rgb = np.zeros((64, 96, 3), np.uint8)
    rgb[16:48, 24:72] = (220, 30, 30)
    buffer = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def test_a_question_about_its_own_image_continues_the_reply(running, monkeypatch):
    """``server.image_requests``: the image's question goes through the second session, the reply's start with it;
    an image in the reply to continue is refused naming its part."""
    image_session = running.daemon.image_session
    asks = _spy(monkeypatch, image_session)
    question = [{"type": "text", "text": QUESTION}, _png()]
    body = {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": PREFIX}],
            "max_tokens": 3, "temperature": 0, **CONTINUE}
    status, raw = _ask(running, body)
    assert status == 200, raw
    (served,) = asks
    assert served["kwargs"]["answer_prefix"] == PREFIX
    assert served["embedded"][0] == _expected_ids(image_session, QUESTION, PREFIX)
    assert json.loads(raw)["choices"][0]["message"]["content"] == served["answer"].text

    reply = [{"type": "text", "text": PREFIX}, _png()]
    body["messages"][-1]["content"] = reply
    status, raw = _ask(running, body)
    assert status == 400, raw
    error = error_of(raw)
    assert error["param"] == "messages[1].content[1]" and error["code"] == "unsupported_content"
    assert "continue_final_message" in error["message"] and len(asks) == 1


U = {"role": "user", "content": QUESTION}
A = {"role": "assistant", "content": PREFIX}
REFUSED = {
    "add_generation_prompt true with the flag": ([U, A], {"continue_final_message": True,
                                                          "add_generation_prompt": True}, "add_generation_prompt",
                                                 "cannot be true with continue_final_message"),
    "a final assistant message without the flag": ([U, A], {}, "messages[1].role", "continue_final_message: true"),
    "add_generation_prompt false without the flag": ([U, A], {"add_generation_prompt": False},
                                                     "add_generation_prompt", "continue_final_message: true"),
    "the flag on a final user message": ([U], CONTINUE, "messages[0].role", "must be an assistant message"),
    "the flag on a lone assistant message": ([A], CONTINUE, "messages", "must follow the user's question"),
    "two assistant messages": ([U, A, A], CONTINUE, "messages[1].role", "must follow the user's question"),
    "a null reply": ([U, {"role": "assistant", "content": None}], CONTINUE, "messages[1].content", "null"),
    "the flag as a string": ([U, A], {"continue_final_message": "yes"}, "continue_final_message",
                             "expected a boolean"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_contradictions_are_400s_naming_the_field_and_nothing_is_queued(running, name):
    messages, fields, param, said = REFUSED[name]
    asked = running.daemon.session.counters.questions
    for stream in (False, True):
        status, raw = _ask(running, {"messages": messages, "max_tokens": 2, "stream": stream, **fields})
        assert status == 400, raw
        error = error_of(raw)
        assert error["param"] == param and said in error["message"], error
    assert running.daemon.session.counters.questions == asked
    assert _ask(running, _prefilled(max_tokens=1))[0] == 200  # the daemon goes on


def test_a_reply_that_cannot_fit_is_refused_before_any_stream(running):
    """The reply's start counts with the question against the text reserve, before the question is queued."""
    asked = running.daemon.session.counters.questions
    for stream in (False, True):
        status, raw = _ask(running, _prefilled(prefix="red " * 500, max_tokens=2, stream=stream))
        assert status == 400, raw[:300]
        error = error_of(raw)
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert "the assistant reply it continues" in error["message"]
    assert running.daemon.session.counters.questions == asked


def test_the_schema_documents_the_flags(running):
    status, _, raw = call(running.port, "GET", "/openapi.json")
    assert status == 200
    schema = json.dumps(json.loads(raw))
    assert "continue_final_message" in schema and "add_generation_prompt" in schema


def test_an_escalated_prefill_forwards_the_reply_s_start_with_the_flag(tmp_path, remote_with):
    """A question with a reply to continue that escalates sends that start to the remote as the final assistant
    message with ``continue_final_message: true, add_generation_prompt: false`` (vLLM's pair), so the remote
    continues it as the local model did and its content — the continuation — is the answer; a question without one
    sends neither flag."""
    remote = remote_with(answer_with(chat_body("triangle")))
    config = server_config("builtin:toy", request_timeout_s=60.0).with_overrides(
        escalate={"url": remote.url, "model": "big", "timeout_s": 120, "keyframes": 1})
    history = (("user", "What color was the circle?"), ("assistant", "blue"))
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        status, raw = _ask(run, _prefilled(history=history, max_tokens=2, escalate=True))
        assert status == 200, raw
        status, streamed = _ask(run, _prefilled(max_tokens=2, escalate=True, stream=True))
        assert status == 200, streamed
        status, plain = _ask(run, {"messages": [U], "max_tokens": 2, "escalate": True})
        assert status == 200, plain
    body = json.loads(raw)
    assert body["model"] == "big" and body["choices"][0]["message"]["content"] == "triangle"
    assert _streamed_text(streamed)[0] == "triangle"
    sent, sent_streamed, sent_plain = remote.bodies
    for request in (sent, sent_streamed):
        assert request["messages"][-1] == {"role": "assistant", "content": PREFIX}
        assert request["messages"][-2]["role"] == "user"
        assert request["messages"][-2]["content"][0] == {"type": "text", "text": QUESTION}
        assert request["continue_final_message"] is True and request["add_generation_prompt"] is False
    assert sent["messages"][:2] == [{"role": role, "content": text} for role, text in history]
    assert sent_plain["messages"][-1]["role"] == "user"
    assert "continue_final_message" not in sent_plain and "add_generation_prompt" not in sent_plain


def test_with_several_cameras_one_camera_continues_the_reply(tmp_path, monkeypatch):
    """``video.sources``: the camera named (``"camera"``, or the question's first word) continues the reply; a
    question of every camera is a listing ("front: ...\\nback: ..."), which continues nothing: refused naming
    ``camera``, as a streamed one is."""
    from edgekv.config import EdgeKVConfig
    from helpers_cameras import running_cameras, wait_for

    source = "synthetic:events?size=112x112&fps=2&frames=8&seed={}&rate=0.08"
    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": [{"name": "front", "source": source.format(1)}, {"name": "back", "source": source.format(7)}],
               "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64}, monitor={"backend": "cpu"},
        server={"port": 0}, generation={"max_new_tokens": 2, "temperature": 0.0})
    with running_cameras(config, tmp_path, realtime=False) as cameras:
        front, back = cameras.daemons["front"], cameras.daemons["back"]
        assert wait_for(lambda: front.stream_state == back.stream_state == "ended", 120)
        asks = _spy(monkeypatch, back.session)
        port = front.server.port
        status, _, raw = call(port, "POST", CHAT, _prefilled(max_tokens=2, camera="back"))
        assert status == 200, raw
        status, _, addressed = call(port, "POST", CHAT, _prefilled(question="back: " + QUESTION, max_tokens=2))
        assert status == 200, addressed
        asked = front.session.counters.questions, back.session.counters.questions
        status, _, refused = call(port, "POST", CHAT, _prefilled(max_tokens=2))
        assert (front.session.counters.questions, back.session.counters.questions) == asked
    assert [(ask["question"], ask["kwargs"]["answer_prefix"]) for ask in asks] == [(QUESTION, PREFIX)] * 2
    assert json.loads(raw)["choices"][0]["message"]["content"] == asks[0]["answer"].text
    assert status == 400, refused
    error = error_of(refused)
    assert error["param"] == "camera" and "continue_final_message" in error["message"]


def test_a_remote_that_refuses_the_flag_leaves_the_local_continuation(tmp_path, remote_with, monkeypatch):
    """A remote that does not take ``continue_final_message`` (OpenAI's own API: "Unrecognized request argument")
    answers 400: the local continuation stands and the note says why — never the remote's fresh answer passed off
    as a continuation."""
    said = json.dumps({"error": {"message": "Unrecognized request argument supplied: continue_final_message",
                                 "type": "invalid_request_error", "param": None, "code": None}}).encode()

    def refuse(handler, remote) -> None:
        handler.send_response(400)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(said)))
        handler.end_headers()
        handler.wfile.write(said)

    remote = remote_with(refuse)
    config = server_config("builtin:toy", request_timeout_s=60.0).with_overrides(
        escalate={"url": remote.url, "model": "big", "timeout_s": 120, "keyframes": 1})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        asks = _spy(monkeypatch, run.daemon.session)
        status, raw = _ask(run, _prefilled(max_tokens=2, escalate=True))
    assert status == 200, raw
    body = json.loads(raw)
    assert body["edgekv"]["escalated"] is False and "HTTP 400" in body["edgekv"]["escalation_note"]
    assert body["choices"][0]["message"]["content"] == asks[0]["answer"].text
    assert remote.bodies[0]["continue_final_message"] is True
