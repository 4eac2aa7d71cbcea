"""The daemon's HTTP API (FastAPI on uvicorn, in its own thread).

    POST /v1/chat/completions   OpenAI-compatible; answers about the live stream; ``stream: true`` = SSE
    GET  /v1/models             the one model this daemon serves (and GET /v1/models/{id})
    GET  /healthz               liveness and stream state (never needs the token)
    GET  /metrics               Prometheus (prometheus_client): seconds, bytes, histograms, exact counters
    GET  /                      status page (a login form first when a token is set)
    GET  /frame.jpg             the latest ingested frame
    GET  /v1/edgekv/status      figures, kept-patch map, recent questions from every channel (the page polls it)
    POST /v1/edgekv/login       {"token": ...} -> session cookie for the page (HttpOnly, SameSite=Strict)
    POST /v1/edgekv/logout

Binds 127.0.0.1 by default. Before any handler runs, ``edgekv.apps.http_guard`` checks Host (DNS
rebinding), Origin (cross-site pages), the token (``server.token`` or the env var ``server.token_env``;
a bearer header or the page's cookie) and the content type, then caps the body while it is read;
uvicorn runs with a request deadline, a keep-alive timeout and a connection limit. Every error on
every route is an OpenAI error object (``message``, ``type``, ``param``, ``code``).

The event loop never blocks: a question is handed to the daemon with a non-blocking ``submit`` (a full
queue answers 503 at once) and its tokens and completion come back through ``call_soon_threadsafe``
(``AnswerHandoff``); no thread waits per request. Handlers that need the session lock run in the
thread pool and wait for it at most a quarter second (``edgekv.apps.telemetry``).
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request  # module level: FastAPI resolves the string annotations here
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgekv.apps.camera import Question
from edgekv.apps.http_guard import (
    AccessPolicy,
    ConnectionLimits,
    GuardedH11Protocol,
    RequestGuard,
    SessionCookies,
    is_loopback,
    read_body,
)
from edgekv.apps.openai_chat import (
    CHAT_REQUEST_SCHEMA,
    ApiError,
    ChatLimits,
    ChatRequest,
    first_stop,
    held_back,
    parse_chat_request,
    parse_json_body,
    safe_text,
)
from edgekv.apps.telemetry import Telemetry, stream_detail, stream_state

log = logging.getLogger("edgekv.server")
LOGIN_FAILURE_DELAY_S = 0.5
PAGE_HEADERS = {
    "cache-control": "no-store", "x-content-type-options": "nosniff", "x-frame-options": "DENY",
    "content-security-policy": "default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
                               "'unsafe-inline'; img-src 'self' data:; frame-ancestors 'none'; form-action 'self'",
}
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def exposure_warning(host: str, token: str | None) -> str | None:
    """The warning the daemon prints at start-up when the API listens beyond this machine without a token
    (anyone who can reach the port can ask questions and see the camera); None when it is safe."""
    if token or is_loopback(host):
        return None
    shown = host or "all interfaces"
    return (
        "WARNING: the HTTP API listens on {h} WITHOUT A TOKEN: anyone who can reach this port can watch the\n"
        "         camera (/frame.jpg), read the status page and ask questions. Set server.token (or the env var\n"
        "         named by server.token_env), or bind server.host: 127.0.0.1."
    ).format(h=shown)


# ---------------------------------------------------------------------------------------------- JSON
def _finite(value: Any) -> Any:
    """NaN and infinities become null (JSON has neither); containers are walked."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


class JsonResponse(Response):
    """ASCII-escaped JSON (encodes any text, lone surrogates included) with non-finite floats as null."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), allow_nan=False, separators=(",", ":")).encode()


def error_response(error: ApiError) -> Response:
    return Response(error.body(), status_code=error.status, media_type="application/json", headers=error.headers)


# ---------------------------------------------------------------------------------------------- handoff
_DONE = object()


class _DoneSignal(threading.Event):
    """``Question.done`` for an HTTP question: setting it (from the main loop) also wakes the handler."""

    def __init__(self, handoff: "AnswerHandoff") -> None:
        super().__init__()
        self._handoff = handoff

    def set(self) -> None:
        super().set()
        self._handoff.post(_DONE)


class AnswerHandoff:
    """One question's answer tokens, then ``_DONE``, carried from the daemon's thread to the event loop
    with ``call_soon_threadsafe``: nothing waits in a thread, nothing blocks the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.done = _DoneSignal(self)

    def post(self, item: Any) -> None:  # any thread
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the server's loop is closed: nobody is waiting any more
            pass

    def on_token(self, token: int) -> None:  # the daemon's main loop
        self.post(token)

    async def next(self) -> Any:
        """The next token id, or ``_DONE``."""
        return await self.items.get()


class AnswerText:
    """Answer tokens -> text for the client: released only as whole characters, never the start of a stop
    string, and ending before the first stop string (OpenAI ``stop``; finish_reason ``stop``).

    ``StreamSession.ask`` has no stop hook, so after a stop string the daemon still decodes up to
    ``max_tokens``: a stream ends for the client at once (unless it asked for usage, which needs the
    answer's token counts), a non-streamed answer when the daemon is done."""

    def __init__(self, tokenizer: Any, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.ids: list[int] = []
        self.sent = ""
        self.stop_tokens: int | None = None  # tokens up to the one completing a stop string

    def push(self, token: int) -> str:
        if self.stop_tokens is not None:
            return ""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        return "" if text.endswith("\ufffd") else self._release(text, final=False)  # wait for whole characters

    def finish(self, final_text: str) -> str:
        return "" if self.stop_tokens is not None else self._release(final_text, final=True)

    def _release(self, text: str, final: bool) -> str:
        cut = first_stop(text, self.stops)
        if cut is not None:
            self.stop_tokens = len(self.ids)
            end = cut
        else:
            end = len(text) if final else len(text) - held_back(text, self.stops)
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        piece, self.sent = text[len(self.sent):end], text[:end]
        return piece

    def finish_reason(self, answer: Any) -> str:
        return "stop" if self.stop_tokens is not None else answer.finish_reason

    def completion_tokens(self, answer: Any) -> int:
        return self.stop_tokens if self.stop_tokens is not None else len(answer.token_ids)


def _usage(answer: Any, completion_tokens: int) -> dict:
    prompt = answer.prompt_tokens + answer.video_tokens
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens, "total_tokens": prompt + completion_tokens}


def answer_error(error: Exception) -> ApiError:
    """The daemon's refusal of a question as an HTTP error: 503 for ``QuestionRefused`` (busy, stopping),
    400 for a question the session refused (ValueError), 500 for anything else (a bug)."""
    status = getattr(error, "status", None)
    if isinstance(status, int) and status >= 500:
        return ApiError(status, safe_text(str(error), 300), kind="server_error", code="server_unavailable",
                        headers={"retry-after": "1"})
    if isinstance(error, ValueError):
        return ApiError(400, safe_text(str(error), 400))
    log.error("answering a question failed: %s", safe_text(repr(error), 300))
    return ApiError(500, f"the answer failed: {safe_text(str(error), 300)}", kind="server_error", code="answer_failed")


def check_fits(session: Any, request: ChatRequest) -> None:
    """Refuse (400 ``context_length_exceeded``) a question that cannot fit in the cache's free slots now,
    before it is queued and before any stream starts."""
    ids = session.layout.question_suffix_ids(session.tokenizer, request.question)
    recall = request.recall if request.recall is not None else getattr(session, "recall", None) is not None
    room = session.capacity - session.cache.length - (getattr(session, "recall_reserve", 0) if recall else 0)
    if len(ids) + request.max_new_tokens > room:
        raise ApiError(400, f"the question ({len(ids)} tokens) + max_tokens ({request.max_new_tokens}) exceed the "
                            f"{room} cache slots free for text (cache.text_reserve_tokens={session.text_reserve}); "
                            "shorten the question or lower max_tokens", param="messages",
                       code="context_length_exceeded")


def submit(daemon: Any, question: Question) -> None:
    """Hand the question to the daemon without blocking; a refusal (full queue, stopping) is a 503."""
    try:
        daemon.submit(question, timeout=0)
    except queue.Full as exc:
        raise ApiError(503, f"{daemon.questions.maxsize} questions are already waiting (server.queue_size); "
                            "retry shortly", kind="server_error", code="server_busy",
                       headers={"retry-after": "1"}) from exc
    except Exception as exc:
        if getattr(exc, "status", None) == 503:
            raise answer_error(exc) from exc
        raise


# ---------------------------------------------------------------------------------------------- app
COMMON_RESPONSES = {
    400: {"description": "bad request (body, Host header)"}, 401: {"description": "missing or wrong token"},
    403: {"description": "cross-origin request"}, 404: {"description": "unknown route"},
    405: {"description": "method not allowed"}, 408: {"description": "request did not arrive in time"},
    413: {"description": "body too large"}, 415: {"description": "not application/json"},
    503: {"description": "too many connections, or (chat) too many questions waiting / shutting down"},
}


def served_model_id(daemon: Any) -> str:
    path = daemon.config.model.path
    return f"edgekv/{path.rstrip('/').split('/')[-1] if path else 'model'}"


@dataclass(frozen=True)
class Api:
    """What the route handlers share."""

    daemon: Any
    telemetry: Telemetry
    policy: AccessPolicy
    limits: ChatLimits
    pages: dict[str, str]

    @property
    def cfg(self) -> Any:
        return self.daemon.config.server

    def model_card(self) -> dict:
        return {"id": self.limits.served_model, "object": "model", "created": int(self.daemon.created),
                "owned_by": "edgekv"}

    async def body(self, request: Request) -> Any:
        return parse_json_body(await read_body(request, self.cfg.max_request_bytes, self.cfg.request_timeout_s))


def build_app(daemon: Any, telemetry: Telemetry) -> RequestGuard:
    cfg = daemon.config.server
    token = cfg.token or os.environ.get(cfg.token_env) or None
    api = Api(daemon, telemetry, AccessPolicy(cfg.host, token, tuple(cfg.allowed_hosts), cfg.max_request_bytes),
              ChatLimits(served_model_id(daemon), cfg.max_new_tokens, daemon.config.generation.max_new_tokens),
              {name: resources.files("edgekv.apps").joinpath(f"static/{name}").read_text()
               for name in ("index.html", "login.html")})
    app = FastAPI(title="edgekv", version=_version(), docs_url=None, redoc_url=None, responses=COMMON_RESPONSES)
    _install_error_handlers(app)
    _info_routes(app, api)
    _page_routes(app, api)
    _chat_route(app, api)
    return RequestGuard(app, api.policy)


def _info_routes(app: FastAPI, api: Api) -> None:
    daemon, telemetry = api.daemon, api.telemetry

    @app.get("/healthz")
    async def healthz():
        alive = daemon.session is not None
        return JsonResponse({"status": "ok" if alive else "starting",
                             "frames": daemon.session.counters.frames if alive else 0,
                             "stream_state": stream_state(daemon)}, status_code=200 if alive else 503)

    @app.get("/v1/models")
    async def models():
        return JsonResponse({"object": "list", "data": [api.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        if model != api.limits.served_model:
            raise ApiError(404, f"The model `{safe_text(model)}` does not exist: this server serves "
                                f"`{api.limits.served_model}`", param="model", code="model_not_found")
        return JsonResponse(api.model_card())

    # sync handlers run in the thread pool: they may wait (briefly) for the session lock
    @app.get("/metrics", response_class=Response, responses={200: {"content": {
        "text/plain": {"schema": {"type": "string"}}, "application/openmetrics-text": {"schema": {"type": "string"}}}}})
    def metrics(request: Request):
        body, content_type = telemetry.exposition(request.headers.get("accept"))
        return Response(body, headers={"content-type": content_type})

    @app.get("/v1/edgekv/status")
    def status():
        return JsonResponse(status_payload(daemon, telemetry, auth=api.policy.token is not None),
                            headers={"cache-control": "no-store"})

    @app.get("/frame.jpg", response_class=Response,
             responses={200: {"content": {"image/jpeg": {"schema": {"type": "string", "format": "binary"}}}}})
    def frame():
        data = daemon.latest_jpeg()
        if data is None:
            raise ApiError(404, "no frame ingested yet", code="no_frame")
        return Response(data, media_type="image/jpeg", headers={"cache-control": "no-store"})


def _page_routes(app: FastAPI, api: Api) -> None:
    token, cookies = api.policy.token, api.policy.cookies

    @app.get("/", response_class=HTMLResponse)
    async def page(request: Request):
        name = "index.html" if request.state.edgekv_authenticated else "login.html"
        return HTMLResponse(api.pages[name], headers=PAGE_HEADERS)

    @app.post("/v1/edgekv/login", status_code=204, openapi_extra=_body_schema(
            {"type": "object", "properties": {"token": {"type": "string"}}, "required": ["token"]}))
    async def login(request: Request):
        if token is None:
            return Response(status_code=204)
        body = await api.body(request)
        given = body.get("token") if isinstance(body, dict) else None
        if not isinstance(given, str) or not hmac.compare_digest(given.encode(), token.encode()):
            await asyncio.sleep(LOGIN_FAILURE_DELAY_S)  # slows guessing without blocking the loop
            raise ApiError(401, "wrong token", kind="authentication_error", param="token", code="invalid_api_key")
        return Response(status_code=204, headers={"set-cookie": cookies.set_header(), "cache-control": "no-store"})

    @app.post("/v1/edgekv/logout", status_code=204, openapi_extra={"requestBody": {"required": False, "content": {
        "application/json": {"schema": {"type": "object"}}}}})
    async def logout():
        return Response(status_code=204, headers={"set-cookie": SessionCookies.clear_header()})


def _chat_route(app: FastAPI, api: Api) -> None:
    @app.post("/v1/chat/completions", openapi_extra=_body_schema(CHAT_REQUEST_SCHEMA),
              responses={200: {"description": "chat.completion, or text/event-stream chunks when stream is true"}})
    async def chat(request: Request):
        params = parse_chat_request(await api.body(request), api.limits)
        return await answer_chat(api.daemon, params, api.limits.served_model)


async def answer_chat(daemon: Any, params: ChatRequest, model_id: str) -> Response:
    """Queue the question without blocking, wait for its first token (a refusal before it is a plain HTTP
    error: no stream has started), then stream the answer or return it whole."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, check_fits, daemon.session, params)  # tokenizing a long question takes ms
    handoff = AnswerHandoff(loop)
    question = Question(params.question, max_new_tokens=params.max_new_tokens, temperature=params.temperature,
                        top_p=params.top_p, on_token=handoff.on_token, source="http", done=handoff.done)
    question.seed = params.seed
    question.recall = params.recall
    submit(daemon, question)
    first = await handoff.next()
    if first is _DONE and question.error is not None:
        raise answer_error(question.error)
    text = AnswerText(daemon.session.tokenizer, params.stop)
    completion_id, created = f"chatcmpl-{uuid.uuid4().hex[:24]}", int(time.time())
    if params.stream:
        events = _sse(first, handoff, question, text, params, completion_id, created, model_id)
        return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
    item = first
    while item is not _DONE:
        if params.stop:
            text.push(item)
        item = await handoff.next()
    if question.error is not None:
        raise answer_error(question.error)
    answer = question.answer
    content = text.sent + text.finish(answer.text) if params.stop else answer.text
    return JsonResponse({
        "id": completion_id, "object": "chat.completion", "created": created, "model": model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": text.finish_reason(answer), "logprobs": None}],
        "usage": _usage(answer, text.completion_tokens(answer)),
        "edgekv": {"ttft_s": answer.ttft_s, "decode_tok_s": answer.decode_tok_s, "video_tokens": answer.video_tokens},
    })


def _body_schema(schema: dict) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _version() -> str:
    import edgekv

    return edgekv.__version__


def _install_error_handlers(app: FastAPI) -> None:
    """OpenAI error objects on every route, for every status (404 and 405 included)."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        headers = {k.lower(): v for k, v in (exc.headers or {}).items()}
        if exc.status_code == 404:
            error = ApiError(404, f"Unknown request URL: {request.method} {safe_text(request.url.path)}",
                             code="unknown_url")
        elif exc.status_code == 405:
            error = ApiError(405, f"{request.method} is not allowed on {safe_text(request.url.path)} "
                                  f"(allowed: {headers.get('allow', '?')})", code="method_not_allowed")
        else:
            error = ApiError(exc.status_code, safe_text(str(exc.detail), 300), code="http_error")
        error.headers.update(headers)
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(ApiError(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(_request: Request, _exc: ClientDisconnect):
        return error_response(ApiError(400, "the client disconnected before the body arrived", code="disconnected"))

    @app.exception_handler(Exception)
    async def bug(_request: Request, exc: Exception):
        log.error("request failed: %s", safe_text(repr(exc), 300))
        return error_response(ApiError(500, "internal error; the daemon log has the details", kind="server_error",
                                       code="internal_error"))


async def _sse(first: Any, handoff: AnswerHandoff, question: Question, text: AnswerText, params: ChatRequest,
               completion_id: str, created: int, model_id: str):
    def event(payload: dict) -> str:
        return "data: " + json.dumps(payload) + "\n\n"

    def chunk(delta: dict, finish: str | None = None) -> str:
        return event({"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model_id,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]})

    yield chunk({"role": "assistant", "content": ""})
    item = first
    while item is not _DONE:
        piece = text.push(item)
        if piece:
            yield chunk({"content": piece})
        if text.stop_tokens is not None and not params.include_usage:
            break  # the client has all it will get; the daemon finishes the answer on its own
        item = await handoff.next()
    if item is _DONE and question.error is not None:  # failed mid-answer: the status line is long gone
        error = answer_error(question.error)
        yield event({"error": {"message": error.message, "type": error.kind, "param": None, "code": error.code}})
    else:
        answer = question.answer
        tail = text.finish(answer.text) if answer is not None else ""
        if tail:
            yield chunk({"content": tail})
        reason = "stop" if text.stop_tokens is not None else answer.finish_reason
        yield chunk({}, finish=reason)
        if params.include_usage:
            yield event({"id": completion_id, "object": "chat.completion.chunk", "created": created,
                         "model": model_id, "choices": [], "usage": _usage(answer, text.completion_tokens(answer))})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------- status page data
def status_payload(daemon: Any, telemetry: Telemetry, auth: bool) -> dict:
    snap = telemetry.snapshot()
    last = telemetry.last_answer or {}
    own = getattr(daemon, "status", None)
    info = dict(own()) if callable(own) else {"questions_waiting": daemon.questions.qsize()}
    info.update(stream_state=stream_state(daemon), stream_detail=stream_detail(daemon))
    return {
        "stats": snap["stats"], "kept": snap["kept"], "snapshot_age_s": snap["age_s"],
        "monitor": telemetry.monitor(), "capture": telemetry.capture(), "daemon": info,
        "rates": {"ingest_fps": telemetry.ingest_fps(), "ttft_s": last.get("ttft_s"),
                  "decode_tok_s": last.get("decode_tok_s")},
        "series": telemetry.series_for_page(), "questions": recent_questions(daemon, telemetry), "auth": auth,
    }


def recent_questions(daemon: Any, telemetry: Telemetry, limit: int = 20) -> list[dict]:
    """Finished questions from every channel, newest first: the daemon's own record when it keeps one
    (``recent_questions()``), else what ``Telemetry.question_answered`` saw."""
    own = getattr(daemon, "recent_questions", None)
    items = list(own()) if callable(own) else list(telemetry.answered)
    keys = ("source", "question", "answer", "error", "asked_at", "ttft_s", "decode_tok_s", "tokens", "finish_reason")
    return [{k: item.get(k) for k in keys} for item in reversed(items[-limit:])]


# ---------------------------------------------------------------------------------------------- server
class ApiServer:
    """uvicorn in a thread on a socket bound up front (so port 0 works and the port is known)."""

    def __init__(self, daemon: Any) -> None:
        import uvicorn

        cfg = daemon.config.server
        self.sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.port))
        self.host, self.port = self.sock.getsockname()[:2]
        self.telemetry = Telemetry(daemon)
        protocol = functools.partial(GuardedH11Protocol,
                                     limits=ConnectionLimits(cfg.request_timeout_s, cfg.max_connections))
        config = uvicorn.Config(build_app(daemon, self.telemetry), http=protocol, ws="none", lifespan="off",
                                log_level="warning", access_log=False, timeout_keep_alive=cfg.keep_alive_s,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="edgekv-http", daemon=True)

    # the daemon reports what happens, for the histograms and the page's question list
    def pair_ingested(self, result: Any) -> None:
        self.telemetry.pair_ingested(result)

    def question_answered(self, question: Question) -> None:
        self.telemetry.question_answered(question)

    def start(self) -> None:
        self.telemetry.start()
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)
        self.telemetry.stop()
        self.sock.close()
