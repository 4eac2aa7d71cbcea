"""What probing the running daemon as real clients do found (2026-12-06): ``HEAD`` on the GET routes (``curl -I``,
``wget --spider``, uptime monitors), the bearer scheme as some clients write it, and a conversation kept the way
the OpenAI SDK dumps its replies."""

from __future__ import annotations

import json

import pytest

from edgekv.apps.server.guard import AccessPolicy
from edgekv.apps.server.openai_chat import ApiError, ChatLimits, parse_chat_request
from helpers_server import RunningDaemon, call, error_of, server_config

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TOKEN = "s3cret-token"
LIMITS = ChatLimits(("edgekv",), max_new_tokens=16, default_new_tokens=4)


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    config = server_config(tiny_checkpoint, token=TOKEN)
    with RunningDaemon(config, tmp_path_factory.mktemp("probes") / "out.txt") as run:
        yield run


# ---------------------------------------------------------------------------------------------- HEAD
@pytest.mark.parametrize("path", ["/", "/v1/models", "/v1/models/edgekv", "/metrics", "/v1/edgekv/status",
                                  "/frame.jpg", "/v1/alerts", "/v1/privacy", "/version"])
def test_head_answers_wherever_get_does(running, path):
    """HEAD was 405 on every FastAPI route (HEAD /openapi.json and /healthz were 200): an uptime monitor probing the
    status page with HEAD saw the daemon as broken."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    got, got_headers, _ = call(running.port, "GET", path, headers=auth)
    status, headers, body = call(running.port, "HEAD", path, headers=auth)
    assert got == 200 and status == 200, (path, status)
    assert body == b""
    assert headers["content-type"] == got_headers["content-type"]


def test_head_needs_the_token_and_stays_off_the_event_stream_and_the_schema(running):
    status, _, _ = call(running.port, "HEAD", "/metrics")
    assert status == 401  # the guard runs first, as for GET
    status, _, _ = call(running.port, "HEAD", "/v1/alerts/stream", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=60)
    assert status == 405  # answered at once, not a stream held open
    status, _, body = call(running.port, "GET", "/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200 and not any("head" in methods for methods in json.loads(body)["paths"].values())


# ---------------------------------------------------------------------------------------------- the bearer scheme
@pytest.mark.parametrize("header", [f"Bearer {TOKEN}", f"bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer   {TOKEN}"])
def test_the_bearer_scheme_is_matched_without_regard_to_case(header):
    """RFC 9110 11.1: the scheme is case-insensitive; ``bearer <token>`` was refused with 401."""
    policy = AccessPolicy("127.0.0.1", TOKEN, (), 65536)
    assert policy.authenticated({b"authorization": header.encode()})


@pytest.mark.parametrize("header", [f"Basic {TOKEN}", f"bearer{TOKEN}", "bearer wrong", "Bearer", "", TOKEN,
                                    f"Bearer {TOKEN}x", f"Bearer {TOKEN} extra"])
def test_other_schemes_and_tokens_are_still_refused(header):
    policy = AccessPolicy("127.0.0.1", TOKEN, (), 65536)
    assert not policy.authenticated({b"authorization": header.encode()})


def test_a_lower_case_bearer_reaches_the_api(running):
    status, _, _ = call(running.port, "GET", "/v1/models", headers={"Authorization": f"bearer {TOKEN}"})
    assert status == 200


# ---------------------------------------------------------------------------------------------- conversations
def _conversation(reply: dict) -> dict:
    return {"messages": [{"role": "user", "content": "Which shape was purple?"}, reply,
                         {"role": "user", "content": "And where was it?"}]}


def test_an_assistant_turn_as_the_sdk_dumps_it_is_history():
    """``messages.append(reply.choices[0].message.model_dump())`` sends ``refusal``, ``annotations``, ``audio``,
    ``function_call`` and ``tool_calls`` as null: every follow-up question was a 400 "messages[1].refusal:
    unrecognized field"."""
    openai_types = pytest.importorskip("openai.types.chat")
    reply = openai_types.ChatCompletionMessage(role="assistant", content="triangle").model_dump()
    assert "refusal" in reply  # what the SDK really sends
    request = parse_chat_request(_conversation(reply), LIMITS)
    assert request.history == (("user", "Which shape was purple?"), ("assistant", "triangle"))
    request = parse_chat_request(_conversation({"role": "assistant", "content": "triangle", "refusal": None,
                                                "annotations": [], "tool_calls": []}), LIMITS)
    assert request.question == "And where was it?"


@pytest.mark.parametrize("field, value", [
    ("tool_calls", [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]),
    ("refusal", "I cannot say"), ("annotations", [{"type": "url_citation"}]), ("audio", {"id": "a1"}),
    ("function_call", {"name": "f", "arguments": "{}"}), ("tool_calls", {}),
])
def test_a_used_reply_field_is_refused_by_name(field, value):
    with pytest.raises(ApiError) as refused:
        parse_chat_request(_conversation({"role": "assistant", "content": "triangle", field: value}), LIMITS)
    assert refused.value.status == 400 and refused.value.param == f"messages[1].{field}"
    assert "only null" in refused.value.message


def test_a_tool_message_is_refused_for_its_role_not_its_call_id():
    with pytest.raises(ApiError) as refused:
        parse_chat_request(_conversation({"role": "tool", "tool_call_id": "c1", "content": "42"}), LIMITS)
    assert refused.value.param == "messages[1].role" and "tool" in refused.value.message


@pytest.mark.parametrize("field, value, taken", [("tools", [{"type": "function"}], "(only null)"),
                                                 ("n", 2, "(only 1 or null)")])
def test_unsupported_fields_say_what_is_taken_once(field, value, taken):
    """``tools: not supported by this server (only null or null)``."""
    with pytest.raises(ApiError) as refused:
        parse_chat_request({"messages": [{"role": "user", "content": "What moved?"}], field: value}, LIMITS)
    assert refused.value.param == field and taken in refused.value.message
    assert "null or null" not in refused.value.message
    error_of(refused.value.body())


# ---------------------------------------------------------------------------------------------- windows
@pytest.mark.parametrize("window", [{"from": 1e6, "to": 2e6}, {"from": "1999-01-01T00:00:00+00:00",
                                                              "to": "1999-01-01T00:01:00+00:00"}])
@pytest.mark.parametrize("stream", [False, True])
def test_a_window_that_holds_nothing_is_a_400_naming_the_window(running, window, stream):
    """The request is valid, but nothing of its stretch is held: the 400 said why with ``param`` null, so an SDK
    showed no field to change."""
    status, _, body = call(running.port, "POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "What moved?"}], "max_tokens": 1, "window": window,
        "stream": stream}, headers={"Authorization": f"Bearer {TOKEN}"})
    error = error_of(body)
    assert status == 400 and error["param"] == "window" and error["code"] == "window_empty", error
