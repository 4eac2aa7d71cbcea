"""The daemon's HTTP API: FastAPI routers mounted on one app, served by uvicorn's own server in a thread.

    POST /v1/chat/completions   OpenAI-compatible; answers about the live stream; ``stream: true`` = SSE   (chat)
    GET  /v1/models             the model this daemon serves, under each served name (and /v1/models/{id})  (info)
    GET  /healthz, /health      liveness (never needs the token); stream state, frames, problems with it    (info)
    GET  /version               edgekv's version (never needs the token)                                   (info)
    GET  /metrics               Prometheus (prometheus_client): seconds, bytes, histograms, exact counters (info)
    GET  /v1/edgekv/status      figures, kept-patch map, recent questions (the page polls it)              (info)
    GET  /frame.jpg             the latest ingested frame (the page tints the kept patches itself); ``?pair=N``:
                                an answer's evidence frame while the keyframe ring keeps it                  (info)
    GET  /                      status page (a login form first when a token is set)                      (page)
    GET  /static/{name}         its scripts and styles (no inline script: the CSP allows 'self' only)     (page)
    POST /v1/edgekv/login       {"token": ...} -> session cookie for the page (HttpOnly, SameSite=Strict)  (page)
    POST /v1/edgekv/logout                                                                                  (page)
    POST|GET /v1/alerts, DELETE /v1/alerts/{id}, GET /v1/alerts/stream (SSE), /v1/alerts/events   (alerts)
    POST /v1/voice/talk         the push-to-talk button                                                  (voice)
    POST /v1/privacy/pause|resume, GET /v1/privacy: the privacy switch                                    (privacy)

Binds 127.0.0.1 by default. Before any handler runs, ``guard`` checks Host (DNS rebinding), Origin
(cross-site pages), the token (``server.token`` or the env var ``server.token_env``; a bearer header or the
page's cookie) and the content type, then caps the body while it is read; the connection protocol adds a
request deadline and a connection limit to uvicorn's h11 one. Every error on every route is an OpenAI error
object (``message``, ``type``, ``param``, ``code``).

uvicorn binds the listening sockets itself (through asyncio, which sets ``TCP_NODELAY`` on every accepted
TCP connection: a socket made by hand with protocol 0 does not get it, and every request after the first on
a kept-alive connection then waited ~44 ms for the peer's delayed ACK).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import sys
import threading
import time
from importlib import resources
from typing import Any

from fastapi import APIRouter, FastAPI, Request  # module level: FastAPI resolves the string annotations here
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from edgekv.apps.questions import Question
from edgekv.apps.server import alerts, chat, info, page, privacy, voice
from edgekv.apps.server.api import Api, error_response
from edgekv.apps.server.guard import (
    AccessPolicy,
    ConnectionLimits,
    GuardedH11Protocol,
    RequestGuard,
    TlsCounts,
    is_loopback,
)
from edgekv.apps.server.openai_chat import ApiError, ChatLimits, safe_text
from edgekv.apps.server.telemetry import Telemetry

log = logging.getLogger("edgekv.server")
SERVER_START_S = 10.0
SWITCH_INTERVAL_S = 0.001


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


COMMON_RESPONSES = {
    400: {"description": "bad request (body, Host header)"}, 401: {"description": "missing or wrong token"},
    403: {"description": "cross-origin request"}, 404: {"description": "unknown route"},
    429: {"description": "too many requests from this address (server.reads_per_second, the login's limit)"},
    405: {"description": "method not allowed"}, 408: {"description": "request did not arrive in time"},
    413: {"description": "body too large"}, 415: {"description": "not application/json"},
    503: {"description": "too many connections, or (chat) too many questions waiting / shutting down"},
}


def served_model_names(daemon: Any) -> tuple[str, ...]:
    """``server.served_model_name`` (vLLM's ``--served-model-name``: the first name is the one answers carry,
    every name is accepted in a request), or ``edgekv/<model folder>`` and the alias ``edgekv``."""
    names = daemon.config.server.served_model_name
    if names:
        return tuple(names)
    path = daemon.config.model.path
    folder = path.rstrip("/").split("/")[-1].removeprefix("builtin:") if path else "model"
    return (f"edgekv/{folder}", "edgekv")


def build_app(daemon: Any, telemetry: Telemetry) -> RequestGuard:
    cfg = daemon.config.server
    token = cfg.token or os.environ.get(cfg.token_env) or None
    api = Api(daemon, telemetry,
              AccessPolicy(cfg.host, token, tuple(cfg.allowed_hosts), cfg.max_request_bytes, cfg.metrics_public,
                           cfg.tls(), cfg.login_attempts_per_minute, trusted_proxies=tuple(cfg.trusted_proxies),
                           proxy_header=cfg.proxy_header),
              ChatLimits(served_model_names(daemon), cfg.max_new_tokens, daemon.config.generation.max_new_tokens,
                         images=cfg.image_requests),
              {name: resources.files("edgekv.apps.server").joinpath(f"static/{name}").read_text()
               for name in page.FILES})
    app = FastAPI(title="edgekv", version=_version(), docs_url=None, redoc_url=None, responses=COMMON_RESPONSES)
    _install_error_handlers(app)
    for routes in (info.router(api), page.router(api), chat.router(api), alerts.router(api), voice.router(api),
                   privacy.router(api)):
        _answer_head(routes)
        app.include_router(routes)
    health = functools.partial(info.health_response, daemon)  # the routes stay for /openapi.json
    return RequestGuard(app, api.policy, fast={"/healthz": health, "/health": health},
                        reads_per_second=cfg.reads_per_second)


EVENT_STREAMS = frozenset({"/v1/alerts/stream"})  # GET routes that answer with a stream that never ends


def _answer_head(routes: APIRouter) -> None:
    """HEAD wherever GET answers (RFC 9110 9.1: a general-purpose server must support both): FastAPI routes take
    only the methods they name, so ``HEAD /``, ``/metrics`` or ``/frame.jpg`` — what ``curl -I``, ``wget --spider``
    and uptime monitors send — were 405 while ``HEAD /openapi.json`` and ``/healthz`` were 200. uvicorn sends the
    GET answer's headers without its body. Kept out of the schema (the GET operation documents it), and not on an
    event stream, where a HEAD would hold a connection open feeding a stream nobody can read."""
    for route in list(routes.routes):
        if isinstance(route, APIRoute) and "GET" in route.methods and route.path not in EVENT_STREAMS:
            routes.add_api_route(route.path, route.endpoint, methods=["HEAD"], include_in_schema=False,
                                 response_class=route.response_class, name=f"{route.name}_head")


def _version() -> str:
    import edgekv

    return edgekv.__version__


# The daemon's 500s are failures that asking again meets again: an answer that raised (``answer_failed``: a bug,
# or an accelerator fault that stays), a handler's bug, a forget whose files could not all be rewritten. What passes
# (a full queue, a stopping daemon, too many connections) is a 503 with Retry-After. The OpenAI SDK retries every 5xx
# twice by default unless told not to (``x-should-retry: false``, which it and Anthropic's SDK obey): without it one
# failed answer was asked three times, each taking its turn in the question queue.
NOT_RETRIED = {"x-should-retry": "false"}


def _no_retry(error: ApiError) -> ApiError:
    if error.status == 500:
        error.headers = {**NOT_RETRIED, **error.headers}
    return error


def _install_error_handlers(app: FastAPI) -> None:
    """OpenAI error objects on every route, for every status (404 and 405 included)."""

    @app.exception_handler(ApiError)
    async def api_error(_request: Request, exc: ApiError):
        return error_response(_no_retry(exc))

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
        return error_response(_no_retry(ApiError(500, "internal error; the daemon log has the details",
                                                 kind="server_error", code="internal_error")))


# ---------------------------------------------------------------------------------------------- server
class ApiServer:
    """uvicorn's ``Server`` in a thread; it binds ``server.host:server.port`` itself (port 0: any free port,
    read back once it listens)."""

    def __init__(self, daemon: Any) -> None:
        import uvicorn

        cfg = daemon.config.server
        self.config = cfg
        self.daemon = daemon
        self.telemetry = Telemetry(daemon)
        tls = None
        if cfg.tls():  # HTTPS, its handshake done by the protocol under the connection limits (apps/server/tls.py)
            from edgekv.apps.server.tls import server_context

            tls = server_context(cfg)
        self.tls = tls
        self.tls_counts = TlsCounts() if tls is not None else None
        self.limits = ConnectionLimits(cfg.request_timeout_s, cfg.max_connections, cfg.max_connections_per_client,
                                       tls=tls, tls_counts=self.tls_counts)
        protocol = functools.partial(GuardedH11Protocol, limits=self.limits)
        config = uvicorn.Config(build_app(daemon, self.telemetry), host=cfg.host, port=cfg.port, http=protocol,
                                ws="none", lifespan="off", log_level="warning", access_log=False,
                                timeout_keep_alive=cfg.keep_alive_s, timeout_graceful_shutdown=2,
                                # the client is the socket's peer: with uvicorn's default, X-Forwarded-For from
                                # 127.0.0.1 replaced it, and any local process (or a TCP proxy passing headers on)
                                # got a fresh login_attempts_per_minute budget per forged address; behind a
                                # reverse proxy, server.trusted_proxies reads its header (guard.forwarded_client)
                                proxy_headers=False)
        self.scheme = "https" if cfg.tls() else "http"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, name="edgekv-http", daemon=True)
        self.host, self.port = cfg.host, cfg.port

    def _run(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # uvicorn exits when it cannot bind; start() reports why
            pass

    # the daemon reports what happens, for the histograms and the page's question list
    def pair_ingested(self, result: Any) -> None:
        self.telemetry.pair_ingested(result)

    def question_answered(self, question: Question) -> None:
        self.telemetry.question_answered(question)

    def start(self) -> None:
        """Start serving; ``OSError`` (naming the address) when uvicorn could not bind it."""
        # The HTTP thread waits for the GIL whenever the main loop runs Python (decode steps); CPython makes
        # the holder let go after the switch interval, 5 ms by default, and a request needs several handoffs.
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self.telemetry.start()
        self.thread.start()
        deadline = time.monotonic() + SERVER_START_S
        while not self.server.started and time.monotonic() < deadline and self.thread.is_alive():
            time.sleep(0.01)
        if not self.server.started:
            self.stop()
            with socket.create_server((self.config.host, self.config.port)):  # the bind error, when that was it
                pass
            raise OSError(f"the HTTP server did not start on {self.config.host}:{self.config.port} within "
                          f"{SERVER_START_S:g} s (the log says why)")
        self.host, self.port = self.server.servers[0].sockets[0].getsockname()[:2]

    def reload_tls(self):
        """SIGHUP: the certificate, key and client CAs read again into a new context that connections accepted from
        then on are served with (a renewed certificate without a restart; connections open keep theirs). A new
        context, not the files loaded again into the served one: OpenSSL adds trust anchors to a context and never
        drops them, so a client CA taken out of ``tls_client_ca_file`` (a lost robot's, a leaver's) would have stayed
        trusted until a restart. The files are checked whole first (``ValueError`` naming the key), so a bad renewal
        leaves the served context in place. Returns the new certificate's info."""
        from edgekv.apps.server.tls import check_server_tls, server_context

        context = server_context(self.config)
        info = check_server_tls(self.config)
        self.tls = self.limits.tls = context  # read by each connection as it is accepted (GuardedH11Protocol)
        return info

    def stop(self) -> None:
        alerts.end_streams(self.daemon)  # streams that never end would hold the graceful shutdown to its timeout
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        self.telemetry.stop()
