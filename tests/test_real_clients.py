"""edgekv's HTTP API through the clients its users really run, against a real daemon on the shipped toy
(configs/cpu-demo.yaml, its recorded stream read to its end so that answers no longer change): the official
``openai`` Python SDK (models, whole and streamed answers, edgekv's own fields through ``extra_body``, the reply
continued, images as data URLs, the errors it raises and its retries on 503 / 429 with the daemon's Retry-After, the
bearer token, HTTPS with the daemon's certificate, a streamed escalation outliving the SDK's read timeout on the SSE
comment lines), ``curl`` (plain JSON, ``-N`` for SSE, ``--max-time``) and ``edgekv ask``. Each client's answer is
checked against the same request sent as plain HTTP: the daemon's cache no longer changes, so they must agree.

The fake escalation server holds its answer until the test releases it; nothing here sleeps or measures time."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai", reason="the OpenAI SDK is not installed (pip install 'edgekv[test]')")

from edgekv.config import load_config  # noqa: E402
from helpers_remote import Remote, chat_body  # noqa: E402
from helpers_server import call, ended_daemon, error_of  # noqa: E402
from helpers_wait import until  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "a-token-for-the-clients"
BOUND_S = 120
QUESTION = "Which shape was red?"
REMOTE_ANSWER = "a red cup on the table"
KEEPALIVE_S = 0.2  # the SSE comment lines' period while a streamed question waits on the escalation server
CLI = Path(sys.executable).with_name("edgekv")


def _demo(**sections):
    """configs/cpu-demo.yaml as shipped, on a free port, with ``sections`` merged over it."""
    return load_config(ROOT / "configs" / "cpu-demo.yaml").with_overrides(
        **{name: {"port": 0, **values} if name == "server" else values for name, values in sections.items()})


class _Held:
    """The escalation server's reply: held until the test releases it (or the escalator hangs up), then the
    remote's answer."""

    def __init__(self) -> None:
        self.abandoned = threading.Event()
        self.failing = False  # answer 500 at once

    def __call__(self, handler, remote) -> None:
        import select

        if self.failing:
            handler.send_response(500)
            handler.send_header("Content-Length", "0")
            handler.end_headers()
            return
        while not remote.release.is_set():
            readable, _, _ = select.select([handler.connection], [], [], 0.05)
            if readable and handler.connection.recv(1) == b"":  # the escalator hung up
                self.abandoned.set()
                return
        body = chat_body(REMOTE_ANSWER)
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)


class _Daemon:
    def __init__(self, daemon, remote: Remote | None, hold: _Held | None) -> None:
        self.daemon, self.remote, self.hold = daemon, remote, hold
        self.port = daemon.server.port
        self.base = f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The demo with a token, images in requests, and an escalation server that holds its answers."""
    hold = _Held()
    remote = Remote(hold)
    config = _demo(server={"token": TOKEN, "image_requests": True, "max_request_bytes": 4 * 2**20},
                   escalate={"url": remote.url, "model": "big", "timeout_s": 300, "keyframes": 1})
    try:
        with ended_daemon(config, tmp_path_factory.mktemp("clients") / "out.txt") as daemon:
            yield _Daemon(daemon, remote, hold)
    finally:
        remote.close()


def _client(served: _Daemon, **options) -> "openai.OpenAI":
    return openai.OpenAI(base_url=served.base, api_key=TOKEN, **options)


def _plain(served: _Daemon, body: dict) -> dict:
    """The same request as plain HTTP (the reference every client must agree with)."""
    status, _, raw = call(served.port, "POST", "/v1/chat/completions", body,
                          headers={"Authorization": f"Bearer {TOKEN}"}, timeout=BOUND_S)
    assert status == 200, raw
    return json.loads(raw)


def _user(text: str = QUESTION) -> list[dict]:
    return [{"role": "user", "content": text}]


def _streamed(chunks: list) -> str:
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)


# ------------------------------------------------------------------------------------------------ the OpenAI SDK
def test_the_sdk_lists_and_retrieves_the_served_models(served):
    client = _client(served)
    assert [model.id for model in client.models.list()] == ["edgekv/toy", "edgekv"]
    assert client.models.retrieve("edgekv").id == "edgekv"
    assert client.models.retrieve("edgekv/toy").id == "edgekv/toy"  # the SDK sends the slash as %2F
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4o", messages=_user())
    assert "gpt-4o" in refused.value.message and "edgekv/toy" in refused.value.message
    assert refused.value.code == "model_not_found"


def test_the_sdk_gets_the_same_answer_whole_and_streamed(served):
    client = _client(served)
    reference = _plain(served, {"model": "edgekv", "messages": _user(), "evidence": 2})
    whole = client.chat.completions.create(model="edgekv", messages=_user(), extra_body={"evidence": 2})
    chunks = list(client.chat.completions.create(model="edgekv", messages=_user(), stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"evidence": 2}))
    content = reference["choices"][0]["message"]["content"]
    assert content, reference  # the toy names a shape
    assert whole.choices[0].message.content == content and whole.model == "edgekv/toy"
    assert whole.choices[0].finish_reason == reference["choices"][0]["finish_reason"]
    assert whole.usage.total_tokens == reference["usage"]["total_tokens"]
    assert whole.model_extra["edgekv"]["evidence"] == reference["edgekv"]["evidence"]
    assert _streamed(chunks) == content and {chunk.model for chunk in chunks} == {"edgekv/toy"}
    last = [chunk for chunk in chunks if chunk.choices][-1]
    assert last.choices[0].finish_reason == reference["choices"][0]["finish_reason"]
    assert last.model_extra["edgekv"]["evidence"] == reference["edgekv"]["evidence"]  # on the last chunk
    assert chunks[-1].usage.total_tokens == reference["usage"]["total_tokens"] and chunks[-1].choices == []


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_sdk_continues_a_final_assistant_message(served, stream):
    """``continue_final_message`` through ``extra_body``: the content is the continuation only, as vLLM answers."""
    messages = [*_user(), {"role": "assistant", "content": "the"}]
    fields = {"continue_final_message": True, "add_generation_prompt": False}
    reference = _plain(served, {"messages": messages, **fields})["choices"][0]["message"]["content"]
    client = _client(served)
    if stream:
        content = _streamed(list(client.chat.completions.create(model="edgekv", messages=messages, stream=True,
                                                                extra_body=fields)))
    else:
        content = client.chat.completions.create(model="edgekv", messages=messages,
                                                 extra_body=fields).choices[0].message.content
    assert content == reference and content and not content.startswith("the")
    with pytest.raises(openai.BadRequestError) as refused:  # the same reply without the flag
        client.chat.completions.create(model="edgekv", messages=messages, stream=stream)
    assert refused.value.param == "messages[1].role" and "continue_final_message: true" in refused.value.message


def test_the_sdk_sends_a_window_and_recall_and_is_told_an_empty_window(served):
    client = _client(served)
    fields = {"window": {"last_s": 30}, "recall": False}
    reference = _plain(served, {"messages": _user(), **fields})
    answer = client.chat.completions.create(model="edgekv", messages=_user(), extra_body=fields)
    assert answer.choices[0].message.content == reference["choices"][0]["message"]["content"]
    assert answer.model_extra["edgekv"]["window_pairs"] == reference["edgekv"]["window_pairs"] > 0
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="edgekv", messages=_user(),
                                       extra_body={"window": {"from": 5000, "to": 6000}})
    error = refused.value
    assert error.param == "window" and error.code == "window_empty" and "5000-6000" in error.message
    assert "the cache holds stream seconds" in error.message


def test_the_sdk_is_told_which_field_cannot_be_served_here(served):
    """``recall`` on a daemon without an archive, a window by the clock on a recording read faster than real time
    (no wall times): 400s naming the field in ``param`` (what an SDK user's code can read), as every other refusal of
    a field does. Both were 400s with ``param`` null."""
    client = _client(served)
    asked = served.daemon.session.counters.questions
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="edgekv", messages=_user(), extra_body={"recall": True})
    assert refused.value.param == "recall" and "archive.dir" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="edgekv", messages=_user(),
                                       extra_body={"window": {"from": "10:03", "to": "10:05"}})
    assert refused.value.param == "window" and "stream seconds" in refused.value.message
    assert served.daemon.session.counters.questions == asked


def test_the_sdk_asks_about_its_own_image(served):
    image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    import numpy as np

    rgb = np.zeros((64, 96, 3), np.uint8)
    rgb[16:48, 24:72] = (220, 30, 30)
    buffer = io.BytesIO()
    image.fromarray(rgb, "RGB").save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "text", "text": "What did you see?"},
                                             {"type": "image_url", "image_url": {"url": url, "detail": "low"}}]}]
    reference = _plain(served, {"messages": messages})
    answer = _client(served).chat.completions.create(model="edgekv", messages=messages)
    assert answer.choices[0].message.content == reference["choices"][0]["message"]["content"]
    with pytest.raises(openai.BadRequestError) as refused:
        messages[0]["content"][1]["image_url"]["url"] = url[:-40] + "*" + url[-39:]
        _client(served).chat.completions.create(model="edgekv", messages=messages)
    assert "base64" in refused.value.message and "messages" in (refused.value.param or "")


def test_the_sdk_is_told_a_question_that_cannot_fit_by_openais_code(served):
    """A question longer than the cache keeps for text: 400 ``context_length_exceeded``, OpenAI's own code for it
    (which SDK users and frameworks match on), before anything is queued."""
    asked = served.daemon.session.counters.questions
    with pytest.raises(openai.BadRequestError) as refused:
        _client(served).chat.completions.create(model="edgekv", messages=_user("Which shape was red? " * 40))
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "messages"
    assert "cache.text_reserve_tokens" in refused.value.message
    assert served.daemon.session.counters.questions == asked


def test_the_sdk_without_the_token_is_told_so_and_does_not_retry(served):
    statuses: list[int] = []
    client = openai.OpenAI(base_url=served.base, api_key="not-the-token", http_client=_recording(statuses))
    with pytest.raises(openai.AuthenticationError) as refused:
        client.models.list()
    assert "bearer token" in refused.value.message and refused.value.code == "invalid_api_key"
    assert statuses == [401]


def _recording(statuses: list, headers: list | None = None, **options) -> "openai.DefaultHttpxClient":
    """The SDK's own HTTP client, noting each response's status (and headers): what its retries did."""
    def seen(response) -> None:
        statuses.append(response.status_code)
        if headers is not None:
            headers.append(dict(response.headers))

    return openai.DefaultHttpxClient(event_hooks={"response": [seen]}, **options)


# ------------------------------------------------------------------------ a streamed escalation: SSE comments
def _watching(comments: list) -> "openai.DefaultHttpxClient":
    """The SDK's HTTP client, counting the SSE comment lines that went by under its parser (which drops them)."""
    import httpx2

    class Counted(httpx2.SyncByteStream):
        def __init__(self, stream) -> None:
            self.stream = stream

        def __iter__(self):
            for chunk in self.stream:
                comments.append(chunk.count(b": waiting for the escalation server"))
                yield chunk

        def close(self) -> None:
            self.stream.close()

    class Watching(httpx2.HTTPTransport):
        def handle_request(self, request):
            response = super().handle_request(request)
            response.stream = Counted(response.stream)
            return response

    return openai.DefaultHttpxClient(transport=Watching())


def test_the_sdk_stream_outlives_its_read_timeout_while_the_remote_thinks(served, monkeypatch):
    """The SDK's ``timeout`` shorter than the remote's delay, longer than the comment lines' period: its stream
    iterator skips the comments, never times out, and yields the remote's answer, named by the remote's model."""
    from edgekv.apps.server import chat

    monkeypatch.setattr(chat, "KEEPALIVE_S", KEEPALIVE_S)
    timeout_s = 25 * KEEPALIVE_S  # the headers come after the local answer: ms idle, a busy CI machine takes longer
    comments: list[int] = []
    client = _client(served, timeout=timeout_s, max_retries=0, http_client=_watching(comments))
    got: dict = {}

    def ask() -> None:
        try:
            got["chunks"] = list(client.chat.completions.create(
                model="edgekv", messages=_user("What is on the table?"), stream=True,
                extra_body={"escalate": True}))
        except Exception as exc:  # noqa: BLE001 - the test asserts there was none
            got["error"] = exc

    served.remote.release.clear()
    asking = threading.Thread(target=ask)
    asking.start()
    try:
        # each comment follows the last by KEEPALIVE_S of silence: 1.5 timeouts' worth of them went by unanswered
        assert until(lambda: sum(comments) > 1.5 * timeout_s / KEEPALIVE_S or not asking.is_alive(), BOUND_S)
        assert asking.is_alive(), got
    finally:
        served.remote.release.set()
        asking.join(BOUND_S)
    assert "error" not in got, got["error"]
    chunks = got["chunks"]
    assert _streamed(chunks) == REMOTE_ANSWER and {chunk.model for chunk in chunks} == {"big"}
    assert chunks[-1].model_extra["edgekv"]["escalated"] is True


def test_the_sdk_stream_gets_the_local_answer_when_the_remote_fails(served, monkeypatch):
    """After the comment lines, a remote that fails: the stream is the local answer, named by the local model, its
    last chunk saying why it was not escalated."""
    from edgekv.apps.server import chat

    monkeypatch.setattr(chat, "KEEPALIVE_S", KEEPALIVE_S)
    monkeypatch.setattr(served.hold, "failing", True)
    local = _plain(served, {"messages": _user()})["choices"][0]["message"]["content"]
    chunks = list(_client(served).chat.completions.create(model="edgekv", messages=_user(), stream=True,
                                                          extra_body={"escalate": True}))
    assert _streamed(chunks) == local and {chunk.model for chunk in chunks} == {"edgekv/toy"}
    extension = chunks[-1].model_extra["edgekv"]
    assert extension["escalated"] is False and "HTTP 500" in extension["escalation_note"]


def test_the_sdk_raises_the_daemons_error_event_of_an_answer_failing_midway(served, monkeypatch):
    """The status line long sent, an answer that fails after its first token ends its stream with an OpenAI error
    event: the SDK's iterator raises ``APIError`` with the daemon's message, after the text that came."""
    session = served.daemon.session
    ask = session.ask

    def failing(question, on_token=None, **kwargs):
        on_token(ask(question, **kwargs).token_ids[0])
        raise RuntimeError("the accelerator fell over")

    reference = _plain(served, {"messages": _user(), "max_tokens": 1})["choices"][0]["message"]["content"]
    monkeypatch.setattr(session, "ask", failing)
    chunks = []
    with pytest.raises(openai.APIError) as failed:
        for chunk in _client(served, max_retries=0).chat.completions.create(model="edgekv", messages=_user(),
                                                                            stream=True):
            chunks.append(chunk)
    assert failed.value.message == "the answer failed: the accelerator fell over"
    assert failed.value.code == "answer_failed"
    assert _streamed(chunks) == reference


def test_the_sdk_gives_up_on_a_silent_stream_and_the_escalation_is_withdrawn(served, monkeypatch):
    """The control: comment lines further apart than the SDK's read timeout: it raises ``APITimeoutError`` (the
    same request stopped by the timeout, not by the daemon) and its hang-up cuts the exchange with the remote."""
    from edgekv.apps.server import chat

    monkeypatch.setattr(chat, "KEEPALIVE_S", 600.0)
    served.remote.release.clear()
    served.hold.abandoned.clear()
    withdrawn = served.daemon.escalator.stats()["escalations_withdrawn"]
    client = _client(served, timeout=8.0, max_retries=0)  # the local answer, before the headers, takes ms idle
    try:
        with pytest.raises(openai.APITimeoutError):
            list(client.chat.completions.create(model="edgekv", messages=_user("What is on the table?"),
                                                stream=True, extra_body={"escalate": True}))
        assert served.hold.abandoned.wait(BOUND_S), "the remote was left answering a client who had gone"
        assert until(lambda: served.daemon.escalator.stats()["escalations_withdrawn"] == withdrawn + 1, BOUND_S)
    finally:
        served.remote.release.set()


def test_each_whole_escalation_the_sdks_retries_abandon_is_withdrawn(served):
    """A whole answer carries no comment lines: an SDK ``timeout`` shorter than the remote's delay ends each try
    (``APITimeoutError`` after its retries), and each try's hang-up cuts its exchange with the remote, so none is
    left holding the escalation thread."""
    served.remote.release.clear()
    stats = served.daemon.escalator.stats
    before, asked = stats()["escalations_withdrawn"], len(served.remote.bodies)
    client = _client(served, timeout=8.0, max_retries=2)  # the local answer, before the escalation: ms idle
    try:
        with pytest.raises(openai.APITimeoutError):
            client.chat.completions.create(model="edgekv", messages=_user("What is on the table?"),
                                           extra_body={"escalate": True})
        assert until(lambda: stats()["escalations_withdrawn"] == before + 3, BOUND_S), stats()
        assert asked < len(served.remote.bodies) <= asked + 3 and stats()["escalations_waiting"] == 0
    finally:
        served.remote.release.set()


# ------------------------------------------------------------------------------------------------------- curl
def _curl(*args: str, timeout: float = BOUND_S) -> subprocess.CompletedProcess:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed")
    return subprocess.run([curl, "-sS", *args], capture_output=True, timeout=timeout)


def _curl_chat(served: _Daemon, body: dict, *args: str) -> subprocess.CompletedProcess:
    return _curl(*args, "-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json",
                 "-d", json.dumps(body), f"{served.base}/chat/completions")


def test_curl_gets_json_and_a_stream(served):
    reference = _plain(served, {"messages": _user()})["choices"][0]["message"]["content"]
    whole = _curl_chat(served, {"messages": _user()})
    assert whole.returncode == 0, whole.stderr
    assert json.loads(whole.stdout)["choices"][0]["message"]["content"] == reference
    streamed = _curl_chat(served, {"messages": _user(), "stream": True}, "-N")
    assert streamed.returncode == 0, streamed.stderr
    events = [line[len("data: "):] for line in streamed.stdout.decode().split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == reference
    (seen,) = _plain(served, {"messages": _user(), "evidence": 1})["edgekv"]["evidence"]
    frame = _curl("-H", f"Authorization: Bearer {TOKEN}", f"http://127.0.0.1:{served.port}{seen['frame']}")
    assert frame.returncode == 0 and frame.stdout[:3] == b"\xff\xd8\xff"  # the evidence frame, a JPEG
    healthz = _curl(f"http://127.0.0.1:{served.port}/healthz")
    assert json.loads(healthz.stdout)["status"] == "ok"
    refused = _curl("-H", "Authorization: Bearer wrong", f"{served.base}/models")
    assert error_of(refused.stdout)["code"] == "invalid_api_key"


def test_curl_streams_an_escalation_through_its_comment_lines(served, monkeypatch):
    from edgekv.apps.server import chat

    monkeypatch.setattr(chat, "KEEPALIVE_S", KEEPALIVE_S)
    served.remote.release.clear()
    asked = len(served.remote.bodies)
    releaser = threading.Thread(target=lambda: until(lambda: len(served.remote.bodies) > asked, BOUND_S)
                                and served.remote.release.set())
    releaser.start()
    try:
        done = _curl_chat(served, {"messages": _user("What is on the table?"), "stream": True, "escalate": True},
                          "-N")
    finally:
        served.remote.release.set()
        releaser.join(BOUND_S)
    assert done.returncode == 0, done.stderr
    text = done.stdout.decode()
    assert text.startswith(": waiting for the escalation server\n\n"), text[:200]
    chunks = [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
    assert "".join(chunk["choices"][0]["delta"].get("content") or "" for chunk in chunks) == REMOTE_ANSWER


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_curl_max_time_ends_the_wait_and_cuts_the_escalation(served, stream):
    served.remote.release.clear()
    served.hold.abandoned.clear()
    try:
        done = _curl_chat(served, {"messages": _user("What is on the table?"), "stream": stream,
                                   "escalate": True}, "-N", "--max-time", "3")
        assert done.returncode == 28, (done.returncode, done.stderr)  # curl's "operation timed out"
        assert served.hold.abandoned.wait(BOUND_S), "the remote was left answering a client who had gone"
    finally:
        served.remote.release.set()


# ------------------------------------------------------------------------------------------------ edgekv ask
def _ask(served: _Daemon, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    if not CLI.exists():
        pytest.skip(f"{CLI} is not installed (pip install -e .)")
    environ = {**os.environ, "EDGEKV_TOKEN": TOKEN, **(env or {})}
    return subprocess.run([str(CLI), "ask", "--url", f"http://127.0.0.1:{served.port}", *args],
                          capture_output=True, text=True, timeout=BOUND_S, env=environ)


def test_edgekv_ask_agrees_with_the_sdk(served):
    answer = _client(served).chat.completions.create(model="edgekv", messages=_user(), extra_body={"evidence": 1})
    content = answer.choices[0].message.content
    printed = _ask(served, QUESTION)
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == content
    streamed = _ask(served, QUESTION, "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout.strip() == content
    as_json = _ask(served, QUESTION, "--json", "--evidence")
    assert as_json.returncode == 0, as_json.stderr
    (seen,) = answer.model_extra["edgekv"]["evidence"]
    assert content in as_json.stdout and str(seen["pair"]) in as_json.stdout
    refused = _ask(served, QUESTION, env={"EDGEKV_TOKEN": "wrong"})
    assert refused.returncode != 0 and "token" in refused.stderr


# ---------------------------------------------------------------------------------------------------- limits
@pytest.fixture
def limited(tmp_path):
    """The demo with one question waiting at most and a login budget of one attempt every 5 s (five at once)."""
    config = _demo(server={"token": TOKEN, "queue_size": 1, "login_attempts_per_minute": 12})
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        yield _Daemon(daemon, None, None)


def test_the_sdk_retries_a_busy_daemon_after_its_retry_after(limited, monkeypatch):
    """A full question queue is a 503 with ``Retry-After: 1``: the SDK waits and asks again, and gets the answer
    once the daemon has room."""
    daemon = limited.daemon
    gate, entered = threading.Event(), threading.Event()
    answer = daemon._answer

    def held(question):
        entered.set()
        gate.wait(BOUND_S)
        return answer(question)

    monkeypatch.setattr(daemon, "_answer", held)
    waiting = [threading.Thread(target=_plain, args=(limited, {"messages": _user()})) for _ in range(2)]
    statuses: list[int] = []
    headers: list[dict] = []
    got: dict = {}

    def ask() -> None:
        client = _client(limited, max_retries=20, http_client=_recording(statuses, headers))
        got["answer"] = client.chat.completions.create(model="edgekv", messages=_user())

    asking = threading.Thread(target=ask, daemon=True)
    try:
        waiting[0].start()
        assert entered.wait(BOUND_S)  # the first question is being answered (held)
        waiting[1].start()
        assert until(lambda: daemon.questions.qsize() == 1, BOUND_S)  # the second waits: the queue is full
        asking.start()
        assert until(lambda: 503 in statuses, BOUND_S)
    finally:
        gate.set()
        for thread in waiting:
            thread.join(BOUND_S)
        if asking.ident is not None:
            asking.join(BOUND_S)
    refused = headers[statuses.index(503)]
    assert refused["retry-after"] == "1"
    assert statuses[-1] == 200 and got["answer"].choices[0].message.content == _plain(
        limited, {"messages": _user()})["choices"][0]["message"]["content"]


def test_the_sdk_waits_out_the_login_budget_another_client_spent(limited):
    """Wrong tokens from this address spent its login budget: the guesser's SDK ends with ``RateLimitError`` saying
    why, and a client with the right token is told 429 with ``Retry-After``: the SDK, waiting that long, gets in."""
    guesser_statuses: list[int] = []
    guesser = openai.OpenAI(base_url=limited.base, api_key="guess", max_retries=0,
                            http_client=_recording(guesser_statuses))
    refusals = []
    while not any(isinstance(error, openai.RateLimitError) for error in refusals) and len(refusals) < 20:
        with pytest.raises((openai.AuthenticationError, openai.RateLimitError)) as refused:
            guesser.models.list()
        refusals.append(refused.value)
    assert guesser_statuses[0] == 401 and guesser_statuses[-1] == 429
    assert "too many login attempts" in refusals[-1].message and refusals[-1].code == "rate_limit_exceeded"
    statuses: list[int] = []
    headers: list[dict] = []
    client = _client(limited, max_retries=5, http_client=_recording(statuses, headers))
    assert [model.id for model in client.models.list()] == ["edgekv/toy", "edgekv"]
    assert statuses[0] == 429 and statuses[-1] == 200, statuses
    assert int(headers[0]["retry-after"]) >= 1


# ------------------------------------------------------------------------------------------------------ HTTPS
@pytest.fixture(scope="module")
def https(tmp_path_factory):
    """The demo over HTTPS with a self-signed certificate for 127.0.0.1 / localhost, made as a user makes one."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("https")
    cert, key = folder / "daemon.pem", folder / "daemon.key"
    made = subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                           "-days", "30", "-subj", "/CN=localhost", "-addext",
                           "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                          capture_output=True, text=True, timeout=BOUND_S)
    assert made.returncode == 0, made.stderr
    key.chmod(0o600)
    config = _demo(server={"token": TOKEN, "tls_cert_file": str(cert), "tls_key_file": str(key)})
    with ended_daemon(config, folder / "out.txt") as daemon:
        yield daemon.server.port, cert


def test_the_sdk_and_edgekv_ask_over_https_with_the_daemons_certificate(https):
    port, cert = https
    trusted = openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=TOKEN,
                            http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=cert)))
    content = trusted.chat.completions.create(model="edgekv", messages=_user()).choices[0].message.content
    assert _streamed(list(trusted.chat.completions.create(model="edgekv", messages=_user(), stream=True))) == content
    with pytest.raises(openai.APIConnectionError):  # the system's CAs do not know the daemon's certificate
        openai.OpenAI(base_url=f"https://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0).models.list()
    if not CLI.exists():
        pytest.skip(f"{CLI} is not installed (pip install -e .)")
    printed = subprocess.run([str(CLI), "ask", "--url", f"https://127.0.0.1:{port}", "--ca-file", str(cert),
                              QUESTION], capture_output=True, text=True, timeout=BOUND_S,
                             env={**os.environ, "EDGEKV_TOKEN": TOKEN})
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.strip() == content
    curled = _curl("--cacert", str(cert), "-H", f"Authorization: Bearer {TOKEN}", f"https://127.0.0.1:{port}/v1/models")
    assert curled.returncode == 0 and json.loads(curled.stdout)["data"][0]["id"] == "edgekv/toy"


# ------------------------------------------------------------------------------------------ edgekv-camera itself
def test_the_shipped_demo_process_answers_every_client_alike_and_stops_on_sigterm(tmp_path):
    """``edgekv-camera --config cpu-demo`` as the README starts it (the token from ``EDGEKV_TOKEN``, any free port):
    the SDK, curl and ``edgekv ask`` get the same answer once its recording has ended; SIGTERM stops it cleanly."""
    import signal
    import urllib.error
    import urllib.request

    camera = Path(sys.executable).with_name("edgekv-camera")
    if not camera.exists():
        pytest.skip(f"{camera} is not installed (pip install -e .)")
    environ = {**os.environ, "EDGEKV_TOKEN": TOKEN}
    process = subprocess.Popen([str(camera), "--config", "cpu-demo", "--port", "0", "--no-stdin"], cwd=tmp_path,
                               env=environ, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        assert until(lambda: any(line.startswith("HTTP API on ") for line in lines) or process.poll() is not None,
                     BOUND_S), lines
        url = next(line for line in lines if line.startswith("HTTP API on ")).split()[3]

        def ended() -> bool:  # (without the token /healthz says only its status word)
            request = urllib.request.Request(url + "/healthz", headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(request, timeout=BOUND_S) as response:
                    return json.loads(response.read())["stream_state"] == "ended"
            except urllib.error.HTTPError:  # 503 while it starts
                return False

        assert until(ended, BOUND_S)
        client = openai.OpenAI(base_url=url + "/v1", api_key=TOKEN)
        chunks = list(client.chat.completions.create(model="edgekv", messages=_user(), stream=True))
        content = _streamed(chunks)
        assert content and chunks[0].model == "edgekv/toy"
        curled = _curl("-H", f"Authorization: Bearer {TOKEN}", "-H", "Content-Type: application/json", "-d",
                       json.dumps({"messages": _user()}), url + "/v1/chat/completions")
        assert json.loads(curled.stdout)["choices"][0]["message"]["content"] == content
        if CLI.exists():
            printed = subprocess.run([str(CLI), "ask", "--url", url, QUESTION], capture_output=True, text=True,
                                     timeout=BOUND_S, env=environ)
            assert printed.returncode == 0 and printed.stdout.strip() == content, printed.stderr
        process.send_signal(signal.SIGTERM)
        assert process.wait(BOUND_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(BOUND_S)
        reader.join(BOUND_S)
