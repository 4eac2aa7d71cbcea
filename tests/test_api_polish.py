"""What a probe with real clients (the OpenAI SDK, curl, ``edgekv ask``) left in edgekv's HTTP API, each checked
through the client that met it, against a real daemon on the shipped toy (configs/cpu-demo.yaml, its recording read
to its end so answers no longer change):

1. every parameter of OpenAI's chat completions (the SDK's ``CompletionCreateParams``) is served, accepted and
   ignored, or refused by name as unsupported; ``verbosity`` was "Unrecognized request argument supplied";
2. the 503 of a connection over ``server.max_connections`` carries ``Retry-After`` as the other 503s do;
3. a 500 (an answer that failed) says ``x-should-retry: false``: the SDK asked it three times;
4. edgekv's own fields are ``model_extra["edgekv"]`` in the SDK, whole and on a stream's last chunk (README);
5. ``edgekv ask --stream`` said "the answer failed" twice in one line;
6. an answer given with ``continue_final_message`` is recorded, shown and spoken as the whole reply, its given start
   too (the console's ``A:`` line, the status page's history, the voice).

Nothing here sleeps or measures time; every wait is a condition with a generous bound."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")

from edgekv.apps.questions import Question  # noqa: E402
from edgekv.apps.server.openai_chat import (  # noqa: E402
    NEUTRAL,
    ApiError,
    ChatCompletionRequest,
    ChatLimits,
    parse_chat_request,
)
from edgekv.config import load_config  # noqa: E402
from helpers_server import RunningDaemon, call, ended_daemon, error_of, server_config  # noqa: E402
from helpers_wait import until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "a-token-for-the-polish"
BOUND_S = 120
QUESTION = "Which shape was red?"
LIMITS = ChatLimits(("edgekv/toy", "edgekv"), 64, 8)


def _user(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------------------- 1. OpenAI's parameters, each
def _sdk_parameters() -> set[str]:
    params = pytest.importorskip("openai.types.chat.completion_create_params")
    kinds = (params.CompletionCreateParamsNonStreaming, params.CompletionCreateParamsStreaming)
    return {name for kind in kinds for name in kind.__required_keys__ | kind.__optional_keys__}


def test_every_openai_chat_parameter_is_served_ignored_or_refused_as_unsupported():
    """No parameter OpenAI documents is "unrecognized" here: each is a field of the request (served, or accepted and
    ignored) or accepted only at its neutral value; a name OpenAI does not know is the only unrecognized one."""
    fields = {field.alias or name for name, field in ChatCompletionRequest.model_fields.items()}
    unplaced = sorted(name for name in _sdk_parameters() if name not in fields and name not in NEUTRAL)
    assert unplaced == []
    for name in sorted(_sdk_parameters() & set(NEUTRAL)):
        neutral = NEUTRAL[name]
        for value in (None, neutral):  # null and the neutral value are the default answer
            parse_chat_request({"messages": _user(), name: value}, LIMITS)
        with pytest.raises(ApiError) as refused:
            parse_chat_request({"messages": _user(), name: {"something": "else"}}, LIMITS)
        assert (refused.value.status, refused.value.param, refused.value.code) == (400, name, "unsupported_parameter")
        assert refused.value.message.startswith(f"{name}: not supported by this server")
    with pytest.raises(ApiError) as unknown:
        parse_chat_request({"messages": _user(), "verbosityy": "low"}, LIMITS)
    assert unknown.value.code == "unrecognized_argument" and unknown.value.param == "verbosityy"


def test_verbosity_is_medium_or_refused_naming_what_is_served():
    parse_chat_request({"messages": _user(), "verbosity": "medium"}, LIMITS)  # OpenAI's default
    with pytest.raises(ApiError) as refused:
        parse_chat_request({"messages": _user(), "verbosity": "low"}, LIMITS)
    assert refused.value.message == ('verbosity: not supported by this server (only "medium" or null), got the '
                                     'string "low"')
    for hint in ({"prompt_cache_retention": "24h"}, {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}}):
        parse_chat_request({"messages": _user(), **hint}, LIMITS)  # caching hints: accepted, change nothing


# ------------------------------------------------------------------------------ the daemon, through the SDK
class _Served:
    def __init__(self, daemon, out: Path) -> None:
        self.daemon, self.out = daemon, out
        self.port = daemon.server.port
        self.base = f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The shipped demo with a token; the log keeps question and answer text (privacy.log_text)."""
    config = load_config(ROOT / "configs" / "cpu-demo.yaml").with_overrides(
        server={"port": 0, "token": TOKEN}, privacy={"log_text": True})
    out = tmp_path_factory.mktemp("polish") / "out.txt"
    with ended_daemon(config, out) as daemon:
        yield _Served(daemon, out)


def _openai():
    return pytest.importorskip("openai", reason="the OpenAI SDK is not installed (pip install 'edgekv[test]')")


def _client(served: _Served, statuses: list | None = None, headers: list | None = None, **options):
    openai = _openai()

    def seen(response) -> None:
        if statuses is not None:
            statuses.append(response.status_code)
        if headers is not None:
            headers.append(dict(response.headers))

    return openai.OpenAI(base_url=served.base, api_key=TOKEN,
                         http_client=openai.DefaultHttpxClient(event_hooks={"response": [seen]}), **options)


def _plain(served: _Served, body: dict) -> dict:
    status, _, raw = call(served.port, "POST", "/v1/chat/completions", body,
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=BOUND_S)
    assert status == 200, raw
    return json.loads(raw)


def test_the_sdk_is_told_verbosity_is_not_supported_and_may_send_its_default(served):
    openai = _openai()
    client = _client(served)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="edgekv", messages=_user(), verbosity="low")
    assert refused.value.param == "verbosity" and refused.value.code == "unsupported_parameter"
    assert "not supported by this server" in refused.value.message
    answer = client.chat.completions.create(model="edgekv", messages=_user(), verbosity="medium",
                                            prompt_cache_retention="24h")
    assert answer.choices[0].message.content == _plain(served, {"messages": _user()})["choices"][0]["message"][
        "content"]


def test_an_answer_that_fails_is_asked_once_not_three_times(served, monkeypatch):
    """A 500 says ``x-should-retry: false``: the SDK (two retries by default) raises at once, and the daemon
    answered the question once."""
    openai = _openai()
    asked = []

    def failing(question, **kwargs):
        asked.append(question)
        raise RuntimeError("the accelerator fell over")

    monkeypatch.setattr(served.daemon.session, "ask", failing)
    statuses, headers = [], []
    with pytest.raises(openai.InternalServerError) as failed:
        _client(served, statuses, headers).chat.completions.create(model="edgekv", messages=_user())
    assert failed.value.code == "answer_failed" and "the accelerator fell over" in failed.value.message
    assert statuses == [500] and headers[0]["x-should-retry"] == "false"
    assert len(asked) == 1


def test_the_sdk_reads_edgekvs_own_fields_as_the_readme_says(served):
    """README: ``completion.model_extra["edgekv"]`` on a whole answer; on a stream, the last chunk's (the one with
    the finish_reason), where the request asked for something that rides there (``evidence``)."""
    client = _client(served)
    whole = client.chat.completions.create(model="edgekv", messages=_user(), extra_body={"evidence": 1})
    assert "evidence" in whole.model_extra["edgekv"]
    chunks = list(client.chat.completions.create(model="edgekv", messages=_user(), stream=True,
                                                 extra_body={"evidence": 1}))
    carrying = [chunk for chunk in chunks if (chunk.model_extra or {}).get("edgekv")]
    assert len(carrying) == 1 and carrying[0] is chunks[-1] and chunks[-1].choices[0].finish_reason
    assert carrying[0].model_extra["edgekv"]["evidence"] == whole.model_extra["edgekv"]["evidence"]


# -------------------------------------------------------------------- 5. edgekv ask --stream, a failed answer
def test_edgekv_ask_stream_says_once_that_the_answer_failed(served, monkeypatch, capsys):
    from edgekv.apps.cli import main

    session = served.daemon.session
    ask = session.ask

    def failing(question, on_token=None, **kwargs):
        on_token(ask(question, **kwargs).token_ids[0])
        raise RuntimeError("out of memory")

    monkeypatch.setattr(session, "ask", failing)
    monkeypatch.setenv("EDGEKV_TOKEN", TOKEN)
    assert main(["ask", QUESTION, "--url", f"http://127.0.0.1:{served.port}", "--stream"]) == 2
    err = capsys.readouterr().err
    assert "the answer failed on the way: out of memory" in err
    assert err.count("the answer failed") == 1, err


# ------------------------------------------------------------- 6. continue_final_message: the whole reply
FIELDS = {"continue_final_message": True, "add_generation_prompt": False}
START = "the"


def _continued(served: _Served) -> str:
    messages = _user() + [{"role": "assistant", "content": START}]
    body = _plain(served, {"messages": messages, **FIELDS})
    return body["choices"][0]["message"]["content"]


def test_the_console_shows_the_whole_continued_reply(served):
    continuation = _continued(served)
    assert continuation  # the toy names a shape
    assert until(lambda: f"A: {START}{continuation}\n" in served.out.read_text(), BOUND_S), \
        served.out.read_text()[-2000:]
    line = next(line for line in served.out.read_text().splitlines()[::-1] if "continuing the" in line)
    assert f"continuing the {len(START)} characters the asker gave" in line


def test_format_answer_keeps_the_start_out_of_a_private_log_but_counts_it():
    from edgekv.apps.daemon.console import format_answer

    question = Question("Which shape?", source="http", answer_prefix="It was")
    question.answer = SimpleNamespace(text=" red", token_ids=[1], ttft_s=0.01, decode_tok_s=0.0, video_tokens=10)
    assert "A: It was red\n" in format_answer(question)
    assert "A: (10 characters; privacy.log_text)" in format_answer(question, log_text=False)
    plain = Question("Which shape?", source="http")
    plain.answer = question.answer
    assert "A:  red\n" in format_answer(plain) and "continuing" not in format_answer(plain)


def test_telemetry_keeps_the_whole_continued_reply(served):
    continuation = _continued(served)
    telemetry = served.daemon.server.telemetry
    assert until(lambda: telemetry.answered and telemetry.answered[-1]["answer"] == START + continuation, BOUND_S)


def test_the_status_pages_history_shows_the_whole_continued_reply(served):
    continuation = _continued(served)
    status, _, raw = call(served.port, "GET", "/v1/edgekv/status", headers={"Authorization": f"Bearer {TOKEN}"})
    assert status == 200, raw
    newest = json.loads(raw)["questions"][0]
    assert newest["answer"] == START + continuation


def test_the_voice_speaks_the_whole_continued_reply(served, monkeypatch):
    said: list[str] = []
    speaker = SimpleNamespace(say=lambda text, *_: said.append(text))
    monkeypatch.setattr(served.daemon, "speaker", speaker)
    monkeypatch.setattr(served.daemon, "_speaks", lambda question: True)
    continuation = _continued(served)
    assert "".join(said) == START + continuation


# ----------------------------------------------------------------------- 2. too many connections: Retry-After
def test_a_connection_over_the_limit_is_told_when_to_retry_and_the_sdk_gets_in(tiny_checkpoint, tmp_path):
    """Slots held by half-sent requests: a newcomer's 503 ``too_many_connections`` carries ``Retry-After: 1``; the
    SDK, refused once, asks again after it and, a slot freed meanwhile, gets its answer."""
    openai = _openai()
    config = server_config(tiny_checkpoint, max_connections=10, request_timeout_s=600.0)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        held = []
        try:
            while len(held) < 10:  # every slot (the last one kept for a new address: taken from another)
                source = "127.0.0.2" if len(held) < 9 else "127.0.0.3"
                sock = socket.create_connection(("127.0.0.1", running.port), timeout=BOUND_S,
                                                source_address=(source, 0))
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the blank line never comes
                held.append(sock)
            status, headers, body = call(running.port, "GET", "/healthz")
            assert status == 503, body
            assert headers.get("retry-after") == "1" and error_of(body)["code"] == "too_many_connections"
            statuses, seen_headers = [], []

            def freed_on_refusal(response) -> None:
                statuses.append(response.status_code)
                seen_headers.append(dict(response.headers))
                if response.status_code == 503:
                    held.pop().close()

            client = openai.OpenAI(base_url=f"http://127.0.0.1:{running.port}/v1", api_key="none", max_retries=5,
                                   http_client=openai.DefaultHttpxClient(event_hooks={"response": [freed_on_refusal]}))
            assert client.models.list().data
            assert statuses[0] == 503 and seen_headers[0]["retry-after"] == "1" and statuses[-1] == 200
        finally:
            for sock in held:
                sock.close()


# --------------------------------------------------------------------------------- ask's message, no daemon
def test_a_streamed_error_event_is_said_once():
    from edgekv.apps.ask import _stream_answer

    events = [b'data: {"choices": [{"delta": {"content": "so"}}]}\n',
              b'data: {"error": {"message": "the answer failed: out of memory", "code": "answer_failed"}}\n']
    with pytest.raises(ValueError) as failed:
        _stream_answer("http://daemon", _Events(events), 10.0)
    assert str(failed.value) == "http://daemon: the answer failed on the way: out of memory"
    other = _Events([b'data: {"error": {"message": "the daemon is shutting down"}}\n'])
    with pytest.raises(ValueError) as stopped:
        _stream_answer("http://daemon", other, 10.0)
    assert str(stopped.value) == "http://daemon: the answer failed on the way: the daemon is shutting down"


class _Events:
    headers = {"content-type": "text/event-stream"}

    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def __iter__(self):
        return iter(self.lines)

