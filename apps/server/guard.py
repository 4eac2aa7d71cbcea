"""What the HTTP API checks before any handler runs, and the connection limits uvicorn does not have.

``AccessPolicy`` + ``RequestGuard`` (an ASGI middleware, so it runs before a single body byte is read):

1. ``Host`` must name this server (localhost, 127.0.0.1, [::1], ``server.host``, ``server.allowed_hosts``;
   on a wildcard bind also any IP literal and this machine's names). A DNS-rebinding page reaches the
   socket under the attacker's name, so it is refused here.
2. An ``Origin`` header (browsers send it on cross-site requests and on every POST) must be this
   server's own origin: a foreign web page cannot drive the API through the user's browser.
3. The token (``Authorization: Bearer``, or the session cookie the login form sets) is checked next,
   before the body is read; ``/healthz`` (its details need it: ``info.public_health``), the page itself (which
   shows the login form), the form's script and style and the login route need none.
4. A POST must be ``Content-Type: application/json`` (a cross-site ``<form>`` or ``text/plain`` fetch
   cannot send that without a CORS preflight, which step 2 refuses).
5. A declared ``Content-Length`` over ``server.max_request_bytes`` is refused at once; a chunked body is
   counted while it is read (``read_body``) and refused as soon as it passes the limit.

Every refusal is an OpenAI error object and closes the connection (the client may still be sending).

``GuardedH11Protocol`` is uvicorn's h11 protocol with a request deadline (headers and body must arrive
within ``server.request_timeout_s`` of the request's first byte: slow-header and half-sent-body
connections are closed, with a 408 when nothing else answered) and connection limits: ``server.max_connections``
in all, and ``server.max_connections_per_client`` connections per client address (an IPv6 client's /64, as the
login budget counts it: ``GuardedH11Protocol.client_key``) that are *not waiting for an answer* (still sending
their request, or idle between requests). One more is answered 503 and closed as it opens, so a slowloris from
one host that reopens every connection it loses cannot hold every slot, while the clients of one host — or of a
reverse proxy, where every client is 127.0.0.1 — that have sent their request and wait for the answer (a queued
chat) are never counted. uvicorn's own ``timeout_keep_alive`` closes idle
keep-alive connections, and when fewer than a tenth of the slots are free (``ConnectionLimits.reserved``) idle ones
are closed at once to make room; that last tenth is kept for addresses that hold no connection still sending a
request, so a few hosts, each under its cap, cannot hold every slot between them and a health check still gets in.

``AttemptLimiter`` rate-limits the status page's login per client address (a token bucket): guesses in
parallel no longer go as fast as they come. Wrong ``Authorization: Bearer`` tokens on any route take from the
same bucket (``AccessPolicy.attempts``), so the header is not an unlimited way round the form. An IPv6 client is
counted by its /64 (``budget_key``): one host may use every address of its network, a fresh budget each otherwise.
The connection limits count the same way (a slowloris spread over a /64 is one client).

Behind a reverse proxy every request comes from the proxy's address, so every client shared one login budget
(and one ``reads_per_second``): a guesser locked the wearer out. ``server.trusted_proxies`` (opt-in) names the
proxies; a request whose socket peer is one of them counts against the client its ``server.proxy_header`` names
(``forwarded_client``: the right-most entry that is not a trusted proxy, never one the client could have written),
and ``RequestGuard`` puts that client in the request's scope for every limit and handler. From any other peer the
header is never read. The connection limits still count sockets, the proxy's (see ``GuardedH11Protocol``).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import math
import secrets
import socket
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import urlsplit

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

from edgekv.apps.server.openai_chat import ApiError, error_body

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", ""})
PUBLIC_ASSETS = ("login.js", "login.css")  # the login form's own files, under /static/ (page.py)
PUBLIC_PATHS = frozenset({"/healthz", "/health", "/version", "/", "/v1/edgekv/login", "/v1/edgekv/logout",
                          *(f"/static/{name}" for name in PUBLIC_ASSETS)})
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
COOKIE_NAME = "edgekv_session"
REFUSAL_PAUSE_S = 1.0  # a connection refused by the per-client cap is closed this long after its 503
REFUSED_RETRY_AFTER_S = 1  # the Retry-After of a connection refused by a limit (the queue's 503 says 1 too)
PENDING_GRACE_S = 1.0  # a connection counts against its address's cap once it has been receiving this long
SHAPED_PATHS = frozenset({"/metrics", "/v1/edgekv/status", "/frame.jpg"})  # server.reads_per_second
SHAPING_WAIT_S = 2.0   # a read over the rate waits at most this long for its turn, else 429
# HTTPS answers: a year (browsers ignore it for IP literals and over a certificate they did not trust, so a
# self-signed daemon reached by address is unaffected). No includeSubDomains: the daemon speaks for its own name
# only. Note that HSTS covers every port of the name: plain-HTTP services beside the daemon under the same name
# are then reached as https:// by the browsers that saw it.
HSTS_VALUE = b"max-age=31536000"


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def split_host(value: str) -> tuple[str, int | None]:
    """``Host``-header syntax -> (lower-case name without brackets or trailing dot, port or None)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    else:
        name, _, port = value.rpartition(":") if value.count(":") == 1 else (value, "", "")
    return name.rstrip("."), int(port) if port.isdigit() and len(port) <= 5 else None


# ---------------------------------------------------------------------------------------------- session cookie
class SessionCookies:
    """The status page's login: a cookie that proves the token was typed, without holding it.

    Chosen over a one-time URL token: a token in a URL lands in browser history, server logs, the
    ``Referer`` of every link and over the shoulder. The cookie is ``HttpOnly`` (page scripts, and so injected
    scripts, cannot read it), ``SameSite=Strict`` (no other site's page makes the browser send it) and ``Path=/``;
    it holds an expiry, a random session id and ``HMAC-SHA256(token, expiry, id)``. The ids of the sessions signed
    in are kept here, in memory: signing out forgets its id, so the cookie is dead server-side at once, a copy of
    it included (a stateless cookie stayed valid until its expiry, 12 h, whatever the browser did with it). A
    restart forgets every session (the page asks for the token again), and a new token fails every MAC.
    ``Secure`` (sent over HTTPS only) when the daemon serves HTTPS (``server.tls_cert_file``); over plain HTTP a
    browser would never send a Secure cookie back. At most ``max_sessions`` live at once: past it the oldest
    sign-in is forgotten (a bound on what logins, which need the token, can make the daemon hold).
    """

    def __init__(self, token: str, lifetime_s: int = 12 * 3600, clock: Callable[[], float] = time.time,
                 secure: bool = False, max_sessions: int = 1024) -> None:
        self._key, self.lifetime_s, self._clock = token.encode(), lifetime_s, clock
        self.max_sessions = max_sessions
        self.flags = "Path=/; HttpOnly; SameSite=Strict" + ("; Secure" if secure else "")
        self._live: dict[str, int] = {}  # session id -> expiry, in sign-in order (the event loop's thread only)

    def _mac(self, expiry: int, session: str) -> str:
        return hmac.new(self._key, f"edgekv-session:{expiry}:{session}".encode(), hashlib.sha256).hexdigest()

    def issue(self) -> str:
        now = int(self._clock())
        self._live = {s: e for s, e in self._live.items() if e >= now}
        while len(self._live) >= self.max_sessions:
            del self._live[next(iter(self._live))]
        expiry, session = now + self.lifetime_s, secrets.token_hex(16)
        self._live[session] = expiry
        return f"{expiry}.{session}.{self._mac(expiry, session)}"

    def _session(self, value: str) -> str | None:
        """The live session id ``value`` carries, or None (malformed, tampered, expired, signed out)."""
        expiry, _, rest = value.partition(".")
        session, _, mac = rest.partition(".")
        if not expiry.isdigit() or len(expiry) > 12 or int(expiry) < self._clock():
            return None
        if not hmac.compare_digest(mac.encode(), self._mac(int(expiry), session).encode()):
            return None
        return session if self._live.get(session) == int(expiry) else None

    def valid(self, value: str) -> bool:
        return self._session(value) is not None

    def revoke(self, value: str) -> bool:
        """Sign the session of cookie ``value`` out: it is refused from now on, wherever it was copied to."""
        session = self._session(value)
        if session is None:
            return False
        del self._live[session]
        return True

    def set_header(self) -> str:
        return f"{COOKIE_NAME}={self.issue()}; Max-Age={self.lifetime_s}; {self.flags}"

    def clear_header(self) -> str:
        return f"{COOKIE_NAME}=; Max-Age=0; {self.flags}"


def bearer_credentials(header: bytes) -> bytes:
    """The token of an ``Authorization: Bearer <token>`` header, b"" for any other scheme. The scheme is matched
    without regard to case and may be followed by several spaces (RFC 9110 11.1, 11.4): clients that write
    ``bearer`` (a Prometheus ``authorization: {type: bearer}``, hand-written scripts) were refused with 401."""
    scheme, _, credentials = header.strip().partition(b" ")
    return credentials.strip(b" ") if scheme.lower() == b"bearer" else b""


def cookie_value(header: str, name: str = COOKIE_NAME) -> str | None:
    for item in header.split(";"):
        key, _, value = item.strip().partition("=")
        if key == name:
            return value.strip()
    return None


# ---------------------------------------------------------------------------------------------- policy
@dataclass
class AccessPolicy:
    bind_host: str
    token: str | None
    allowed_hosts: tuple[str, ...]
    max_request_bytes: int
    metrics_public: bool = False  # server.metrics_public: /metrics without the token
    https: bool = False  # server.tls_cert_file: the page's cookie is Secure
    login_attempts_per_minute: float | None = None  # server.login_attempts_per_minute: the login's and the bearer's
    trusted_proxies: tuple[str, ...] = ()  # server.trusted_proxies: peers whose proxy_header names the client
    proxy_header: str = "x-forwarded-for"  # server.proxy_header: x-forwarded-for or forwarded

    def __post_init__(self) -> None:
        names = set(LOOPBACK_NAMES) | {split_host(h)[0] for h in self.allowed_hosts}
        self.wildcard = self.bind_host in WILDCARD_HOSTS
        if self.wildcard:
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        else:
            names.add(split_host(self.bind_host)[0])
        self.names = frozenset(names)
        self.cookies = SessionCookies(self.token, secure=self.https) if self.token else None
        self._token_bytes = self.token.encode() if self.token else b""  # as clients send it in the header
        self.public = PUBLIC_PATHS | ({"/metrics"} if self.metrics_public else set())
        # One bucket of token guesses per address for the login form and the bearer header of any route: with the
        # login alone limited, the same guesses went unlimited as ``Authorization: Bearer`` (a 401 or a 200, or
        # ``GET /`` answering the page instead of the login form, told which one was right).
        self.attempts = (AttemptLimiter(self.login_attempts_per_minute)
                         if self.token and self.login_attempts_per_minute else None)
        self.proxies = tuple(ipaddress.ip_network(entry.strip()) for entry in self.trusted_proxies)

    def client_of(self, scope: dict) -> tuple[str, int] | None:
        """The client a request counts against (``forwarded_client``): the socket's peer, or behind a trusted
        proxy the client that proxy names."""
        peer = scope.get("client")
        if not self.proxies or not peer:
            return peer
        client = forwarded_client(peer[0], scope["headers"], self.proxies, self.proxy_header)
        return peer if client == peer[0] else (client, 0)

    def host_allowed(self, name: str) -> bool:
        if name in self.names:
            return True
        if self.wildcard:
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    def origin_allowed(self, origin: str, host: str | None) -> bool:
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        name = parts.hostname.rstrip(".")
        if not self.host_allowed(name):
            return False
        if host is None:
            return True
        host_name, host_port = split_host(host)
        default = 443 if parts.scheme == "https" else 80
        return name == host_name and (port or default) == (host_port or default)

    def authenticated(self, headers: dict[bytes, bytes]) -> bool:
        if not self.token:
            return True
        given = headers.get(b"authorization")
        if given is not None and hmac.compare_digest(bearer_credentials(given), self._token_bytes):
            return True
        cookie = cookie_value(headers.get(b"cookie", b"").decode("latin-1"))
        return cookie is not None and self.cookies.valid(cookie)

    def check(self, scope: dict) -> ApiError | None:
        """The first reason to refuse this request before its body is read, or None."""
        headers = dict(scope["headers"])
        host = headers.get(b"host", b"").decode("latin-1") or None
        if host is not None and not self.host_allowed(split_host(host)[0]):
            return ApiError(400, f"Host {host[:80]!r} is not a name of this server (DNS rebinding guard); "
                                 "add it to server.allowed_hosts", param="Host", code="invalid_host")
        origin = headers.get(b"origin")
        if origin is not None and not self.origin_allowed(origin.decode("latin-1"), host):
            return ApiError(403, "cross-origin requests are refused: use this server's own page or a non-browser "
                                 "client", kind="permission_error", param="Origin", code="cross_origin")
        given = headers.get(b"authorization") if self.attempts is not None else None
        client = scope["client"][0] if scope.get("client") else "?"
        if given is not None and self.attempts.exhausted(client):  # before the token: a limited guesser learns nothing
            return too_many_attempts(self.attempts, client)
        authed = self.authenticated(headers)
        if given is not None and not hmac.compare_digest(bearer_credentials(given), self._token_bytes):
            self.attempts.allow(client)  # a wrong bearer token costs an attempt, as a wrong login does
        scope.setdefault("state", {})["edgekv_authenticated"] = authed
        if not authed and scope["path"] not in self.public:
            return ApiError(401, "missing or wrong bearer token (Authorization: Bearer <server.token>)",
                            kind="authentication_error", code="invalid_api_key",
                            headers={"www-authenticate": "Bearer"})
        if scope["method"] in BODY_METHODS:
            media, _, params = headers.get(b"content-type", b"").decode("latin-1").partition(";")
            charset = params.strip().lower()
            if media.strip().lower() != "application/json" or charset not in ("", "charset=utf-8"):
                return ApiError(415, "request bodies must be Content-Type: application/json (UTF-8)",
                                param="Content-Type", code="unsupported_media_type")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_request_bytes):
            return ApiError(413, f"request body over server.max_request_bytes ({self.max_request_bytes} bytes)",
                            code="request_too_large")
        return None


def too_many_attempts(attempts: "AttemptLimiter", client: str) -> ApiError:
    after = max(1, math.ceil(attempts.retry_after(client)))
    where = _from_where(budget_key(client), "one budget per IPv6 /64")
    return ApiError(429, f"too many login attempts from {where}; retry in {after} s "
                         "(server.login_attempts_per_minute)", kind="rate_limit_error", code="rate_limit_exceeded",
                    headers={"retry-after": str(after)})


def _from_where(key: str, why: str) -> str:
    """Who a per-client limit counted, for its refusal: "this address", or an IPv6 client's /64 ``key`` named."""
    return f"this address's network ({key}: {why})" if key.endswith(f"/{IPV6_CLIENT_PREFIX}") else "this address"


async def send_error(send: Callable, error: ApiError, close: bool) -> None:
    body = error.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.encode(), v.encode()) for k, v in error.headers.items()]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware applying ``AccessPolicy.check`` before the app (and before any body byte is read).

    ``fast``: GET routes answered right here, without the app's routing, validation and response classes —
    ``/healthz`` (path -> a function of whether the client is authenticated, returning status and JSON bytes):
    health must not wait behind work, and under load every bit of Python the event loop runs per request is time
    a probe waits for (issue 26)."""

    def __init__(self, app: Any, policy: AccessPolicy,
                 fast: dict[str, Callable[[bool], tuple[int, bytes]]] | None = None,
                 reads_per_second: float | None = None) -> None:
        self.app, self.policy, self.fast = app, policy, fast or {}
        self.reads = (AttemptLimiter(60.0 * reads_per_second, burst=max(1, int(2 * reads_per_second)))
                      if reads_per_second else None)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http":
            if self.policy.proxies:  # behind a trusted proxy: the client it names, for every limit and the app
                scope.setdefault("state", {})["edgekv_peer"] = scope.get("client")
                scope["client"] = self.policy.client_of(scope)
            send = _security_headers(send, scope.get("scheme") == "https")
            refusal = self.policy.check(scope)
            if refusal is None and self.reads is not None and scope["path"] in SHAPED_PATHS:
                refusal = await self._shape(scope)
            if refusal is not None:
                await send_error(send, refusal, close=True)
                return
            answer = self.fast.get(scope["path"]) if scope["method"] in ("GET", "HEAD") else None
            if answer is not None:
                status, body = answer(scope["state"]["edgekv_authenticated"])
                await send({"type": "http.response.start", "status": status, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})
                return
        await self.app(scope, receive, send)


    async def _shape(self, scope: dict) -> ApiError | None:
        """``server.reads_per_second`` per client (``budget_key``) on the routes that make figures or frames: a client
        over it waits for its turn (costing the event loop nothing), and past SHAPING_WAIT_S it is refused
        (429): twenty connections polling as fast as they can no longer keep the loop busy and /healthz
        waiting behind them."""
        client = scope["client"][0] if scope.get("client") else "?"
        wait = self.reads.reserve(client, SHAPING_WAIT_S)
        if wait is None:
            after = max(1, math.ceil(self.reads.retry_after(client)))
            return ApiError(429, f"more than server.reads_per_second ({self.reads.rate:g}) requests a second from "
                                 f"this address on figures and frames; retry in {after} s", kind="rate_limit_error",
                            code="rate_limit_exceeded", headers={"retry-after": str(after)})
        if wait > 0:
            await asyncio.sleep(wait)
        return None


def _security_headers(send: Callable, https: bool) -> Callable:
    """``X-Content-Type-Options: nosniff`` on every answer, not only the page's: the JSON routes hand back text a
    client chose (questions, alert names, a 404's path), and a browser that sniffs must not take it for HTML.
    Over HTTPS also ``Strict-Transport-Security`` (HSTS_VALUE): a browser that reached the daemon over HTTPS once
    no longer tries ``http://`` for that name, where anyone on the network could answer in its place. Never over
    plain HTTP (RFC 6797 8.1: ignored there, and it would promise HTTPS the daemon does not serve)."""
    added = [(b"x-content-type-options", b"nosniff")] + ([(b"strict-transport-security", HSTS_VALUE)] if https else [])

    async def sending(message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", ()))
            names = {name.lower() for name, _ in headers}
            missing = [(name, value) for name, value in added if name not in names]
            if missing:
                message = {**message, "headers": [*headers, *missing]}
        await send(message)

    return sending


async def read_body(request: Any, limit: int, timeout_s: float) -> bytes:
    """The request body, refused (413) as soon as it passes ``limit`` bytes and (408) when it has not all
    arrived within ``timeout_s``: a chunked body is never read whole before the check."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    chunks: list[bytes] = []
    size = 0
    stream = request.stream().__aiter__()
    while True:
        remaining = deadline - loop.time()
        try:
            if remaining <= 0:
                raise asyncio.TimeoutError
            chunk = await asyncio.wait_for(stream.__anext__(), remaining)
        except StopAsyncIteration:
            return b"".join(chunks)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within server.request_timeout_s ({timeout_s:g} s)",
                           code="request_timeout", headers={"connection": "close"}) from None
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body over server.max_request_bytes ({limit} bytes)",
                           code="request_too_large", headers={"connection": "close"})
        chunks.append(chunk)


# ---------------------------------------------------------------------------------------------- connections
@dataclass
class ConnectionLimits:
    """What each accepted connection is held to, read by ``GuardedH11Protocol`` as it accepts one. Not frozen for
    one field: SIGHUP puts a new ``tls`` context here (``ApiServer.reload_tls``), taken by connections from then on."""

    request_timeout_s: float
    max_connections: int
    max_per_client: int | None = None
    body_grace_s: float = 1.0  # the handler's own body deadline (read_body) answers 408 first
    tls: Any = None  # ssl.SSLContext: HTTPS, the handshake done here (GuardedH11Protocol; apps/server/tls.py)
    tls_counts: Any = None  # TlsCounts of those handshakes (the /metrics counters)

    @property
    def reserved(self) -> int:
        """Slots an address that already holds a connection still sending (or idle) may not take: a tenth."""
        return max(1, self.max_connections // 10)


class TlsCounts:
    """HTTPS handshakes done and failed (refused client certificates, clients that never finished, plain HTTP sent
    to the TLS port), counted on the server's event loop and read by /metrics."""

    def __init__(self) -> None:
        self.done = self.failed = 0


IPV6_CLIENT_PREFIX = 64  # the network of one IPv6 subscriber (an ISP delegates a /64 or shorter; SLAAC needs it)


def budget_key(client: str) -> str:
    """What a client's attempts count against: an IPv4 address (an IPv4-mapped IPv6 one too) itself, an IPv6
    address its /64 — a host picks any of the 2**64 addresses of its network at will (SLAAC privacy addresses,
    ``ip addr add``), so per address every guess could come with a fresh budget. The clients of one /64 share one, as
    those behind one IPv4 NAT do. Anything that is not an address (a test client's name) is its own key."""
    address = _address(client)
    if address is None:
        return client
    if address.version == 4:
        return str(address)
    shift = 128 - IPV6_CLIENT_PREFIX
    return str(ipaddress.IPv6Network((int(address) >> shift << shift, IPV6_CLIENT_PREFIX)))


class AttemptLimiter:
    """A token bucket per client (``budget_key``: an IPv4 address, an IPv6 /64): ``burst`` attempts at once, refilled
    at ``per_minute`` (so a guesser gets ``per_minute`` tries a minute, however many connections or addresses of its
    network it uses). Bounded: full buckets are forgotten when more than ``max_clients`` clients are tracked."""

    def __init__(self, per_minute: float, burst: int | None = None, clock: Callable[[], float] = time.monotonic,
                 max_clients: int = 4096) -> None:
        self.rate = float(per_minute) / 60.0
        self.burst = float(burst if burst is not None else max(1, min(5, int(per_minute))))
        self.clock, self.max_clients = clock, max_clients
        self._buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when)

    def _tokens(self, client: str, now: float) -> float:
        tokens, when = self._buckets.get(client, (self.burst, now))
        return min(self.burst, tokens + (now - when) * self.rate)

    def _prune(self, client: str, now: float) -> None:
        """At ``max_clients`` a new address makes room: full buckets go, and if every address is still spending
        (one guesser rotating through an IPv6 prefix), the longest idle, down to three quarters of the bound. Full
        buckets alone let the table grow past its bound, rebuilt whole at each new address."""
        if len(self._buckets) < self.max_clients or client in self._buckets:
            return
        kept = {c: b for c, b in self._buckets.items() if self._tokens(c, now) < self.burst}
        room = max(1, self.max_clients * 3 // 4)
        if len(kept) > room:
            kept = dict(sorted(kept.items(), key=lambda item: item[1][1])[-room:])
        self._buckets = kept

    def exhausted(self, client: str) -> bool:
        """Whether ``client`` has no attempt left now (nothing taken)."""
        return self._tokens(budget_key(client), self.clock()) < 1.0

    def allow(self, client: str) -> bool:
        """Take one attempt for ``client`` if its bucket has one."""
        client, now = budget_key(client), self.clock()
        tokens = self._tokens(client, now)
        self._prune(client, now)
        if tokens < 1.0:
            self._buckets[client] = (tokens, now)
            return False
        self._buckets[client] = (tokens - 1.0, now)
        return True

    def refund(self, client: str) -> None:
        """Give back the attempt a right token took (a sign-in that succeeded): only guesses spend the bucket. Five
        sign-ins in a minute — a page opened in several browsers, a script logging in — then left the right bearer
        token refused (429) for as long as a guesser would be."""
        client = budget_key(client)
        if client in self._buckets:
            tokens, when = self._buckets[client]
            self._buckets[client] = (min(self.burst, tokens + 1.0), when)

    def retry_after(self, client: str) -> float:
        """Seconds until ``client`` has an attempt again."""
        return max(0.0, (1.0 - self._tokens(budget_key(client), self.clock())) / self.rate)

    def reserve(self, client: str, max_wait_s: float) -> float | None:
        """Shaping instead of refusing: take the next attempt of ``client`` and return how long to wait until
        it is due (0: now), or None (nothing taken) when that would be longer than ``max_wait_s``."""
        client, now = budget_key(client), self.clock()
        tokens = self._tokens(client, now)
        wait = max(0.0, (1.0 - tokens) / self.rate)
        if wait > max_wait_s:
            return None
        self._prune(client, now)
        self._buckets[client] = (tokens - 1.0, now)
        return wait


# ---------------------------------------------------------------------------------------------- reverse proxies
def forwarded_client(peer: str, headers: list[tuple[bytes, bytes]], proxies: tuple, header: str) -> str:
    """The address a request from ``peer`` counts against (login attempts, ``reads_per_second``). ``peer`` itself
    unless it is in ``proxies`` (``server.trusted_proxies``): then the right-most address of ``header``
    (``x-forwarded-for``, or ``forwarded``'s ``for=``) that is not a trusted proxy — the client the outermost trusted
    proxy saw connect; what stands left of it was sent by that client and may say anything. Every entry trusted: the
    left-most. ``peer`` (the proxy's budget, shared) when the header is missing or that entry names no address
    (``unknown``, an obfuscated ``_name``): a client that cannot be told apart gets no budget of its own."""
    own = _address(peer)
    if own is None or not _trusted(own, proxies):
        return peer
    name = header.encode()
    values = [value.decode("latin-1") for key, value in headers if key.lower() == name]
    if header == "forwarded":
        entries = [_forwarded_for(element) for value in values for element in _split_outside_quotes(value, ",")]
    else:
        entries = [entry for value in values for entry in value.split(",") if entry.strip()]
    hop = None
    for entry in reversed(entries):
        hop = _address(entry)
        if hop is None:
            return peer
        if not _trusted(hop, proxies):
            return str(hop)
    return str(hop) if hop is not None else peer  # every entry a trusted proxy (hop: the left-most), or none


def _trusted(address: ipaddress.IPv4Address | ipaddress.IPv6Address, proxies: tuple) -> bool:
    return any(address in network for network in proxies)


def _address(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """An address as a forwarding header writes it (``203.0.113.7``, ``203.0.113.7:4711``, ``[2001:db8::1]:4711``,
    ``2001:db8::1``, quoted), an IPv4-mapped IPv6 one as its IPv4; None for anything else."""
    text = text.strip().strip('"').strip()
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _forwarded_for(element: str) -> str:
    """The ``for=`` of one ``Forwarded`` element (RFC 7239: ``for=192.0.2.60;proto=https;by=...``); "" without."""
    found = ""
    for pair in _split_outside_quotes(element, ";"):
        key, _, value = pair.partition("=")
        if key.strip().lower() == "for":
            found = value.strip()
    return found


def _split_outside_quotes(text: str, separator: str) -> list[str]:
    """``text`` split at ``separator`` where it stands outside a quoted string (RFC 9110 5.6.4)."""
    parts, current, quoted, escaped = [], [], False, False
    for char in text:
        if escaped:
            escaped = False
        elif quoted and char == "\\":
            escaped = True
        elif char == '"':
            quoted = not quoted
        elif char == separator and not quoted:
            parts.append("".join(current))
            current = []
            continue
        current.append(char)
    parts.append("".join(current))
    return parts


def raw_response(status: int, reason: str, message: str, code: str, retry_after_s: int | None = None) -> bytes:
    """A whole HTTP/1.1 error response, for answers given outside any request cycle; ``retry_after_s``: its
    ``Retry-After`` (a refusal the client should try again after, as the queue's 503 says it)."""
    body = error_body(message, "invalid_request_error" if status < 500 else "server_error", None, code)
    retry = f"retry-after: {retry_after_s}\r\n" if retry_after_s is not None else ""
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"{retry}connection: close\r\n\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a per-request arrival deadline and a connection limit (see module doc)."""

    def __init__(self, config: Any, server_state: Any, app_state: dict, _loop: Any = None, *,
                 limits: ConnectionLimits) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._body_phase = False
        self._pending_since = 0.0  # when the request being received (or the idle wait for one) began
        self._refused = False
        self._handshake: asyncio.Task | None = None  # HTTPS: the TLS handshake under way (_accept_tls)
        self._early: list[bytes] | None = None  # HTTPS: request bytes that came with the handshake's end
        self._lost = False
        self._idle_since = 0.0  # when its last answer was sent: an idle kept-alive connection (_reclaim_idle)
        self._keyed: tuple[tuple, str] | None = None  # (client, budget_key of its host): client_key's memo

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if self.limits.tls is not None and not transport.get_extra_info("sslcontext"):
            self._accept_tls(transport)
            return
        super().connection_made(transport)
        self._pending_since = self.loop.time()
        refusal = self._admission()
        if refusal is not None:
            self._refuse(*refusal)
            return
        self._arm(self.limits.request_timeout_s)
        if self.limits.max_per_client is not None:
            self.loop.call_later(PENDING_GRACE_S, self._grace_over)

    # HTTPS: the TCP connection is counted as it is accepted, against the same limits as a plain one (refused by
    # closing it: no HTTP can be said before TLS), and its handshake must end within request_timeout_s; then the
    # HTTP protocol starts on the TLS transport (connection_made again, counted once)
    def _accept_tls(self, transport: asyncio.Transport) -> None:
        self.transport, self.client = transport, get_remote_addr(transport)
        self.connections.add(self)
        self._pending_since = self.loop.time()
        if self._admission() is not None:
            self._refused = True
            self.connections.discard(self)
            transport.close()
            return
        self._early = []
        self._handshake = self.loop.create_task(self._handshake_tls(transport))

    async def _handshake_tls(self, transport: asyncio.Transport) -> None:
        try:
            secured = await self.loop.start_tls(transport, self, self.limits.tls, server_side=True,
                                                ssl_handshake_timeout=self.limits.request_timeout_s)
        except Exception:  # a failed, refused (no client certificate) or unfinished handshake: the client's loss
            self.connections.discard(self)
            transport.close()
            if self.limits.tls_counts is not None:
                self.limits.tls_counts.failed += 1
            return
        if self.limits.tls_counts is not None:
            self.limits.tls_counts.done += 1
        self.connections.discard(self)
        if secured is None or self._refused or self._lost or secured.is_closing():  # gone meanwhile
            return
        early, self._early = self._early or [], None
        self.connection_made(secured)
        if early and not self._refused:  # asyncio hands over what followed the handshake before this resumes
            self.data_received(b"".join(early))

    # Admission, as each connection opens. Idle kept-alive connections (answered, waiting for a next request that
    # may never come) are closed to make room when fewer than ``limits.reserved`` slots are free, those of the
    # address holding the most first, then the longest idle: a client must expect an idle connection to close at
    # any time (RFC 9112 9.3; nginx drains its keep-alive connections the same way), while refusing a newcomer
    # left every client out as long as keep_alive_s. What cannot be closed — connections still sending a request
    # (a slowloris) — may not take the last ``reserved`` slots from an address that already holds one: those are
    # kept for addresses that hold none (a health check, an operator), so a few hosts, each under its per-client
    # cap, can no longer hold every slot between them. Connections waiting for an answer never count (a proxy's).
    def _admission(self) -> tuple[str, bool] | None:
        """Why this new connection is refused, as ``_refuse``'s (message, pause), or None to serve it."""
        limit, reserved = self.limits.max_connections, self.limits.reserved
        short = len(self.connections) - (limit - reserved)
        if short > 0:
            self._reclaim_idle(short)
        if len(self.connections) > limit:
            return (f"more than server.max_connections ({limit}) open connections; retry shortly", False)
        if len(self.connections) > limit - reserved and self._holds_receiving():
            return (f"the last {reserved} of server.max_connections ({limit}) are kept for addresses that hold no "
                    "connection, and this address already holds one still sending a request (or idle); retry "
                    "shortly", True)
        if self._over_client_cap():
            return (self._cap_message(), True)
        return None

    @property
    def client_key(self) -> str | None:
        """What the per-client limits count this connection as (``budget_key``, as the login budget: an IPv4 address,
        an IPv6 client's /64 — per address, one host opened the cap's connections from each address of its
        network); None before its peer is known."""
        if self.client is None:
            return None
        if self._keyed is None or self._keyed[0] != self.client:
            self._keyed = (self.client, budget_key(str(self.client[0])))
        return self._keyed[1]

    def _peers(self) -> list["GuardedH11Protocol"]:
        return [other for other in self.connections if other is not self and isinstance(other, GuardedH11Protocol)
                and other.client is not None and not other._refused]

    def _holds_receiving(self) -> bool:
        if self.client is None:
            return False
        return any(other.client_key == self.client_key and other.receiving for other in self._peers())

    @property
    def idle(self) -> bool:
        """Answered and kept alive, nothing of a next request received: closing it loses no work."""
        return (self.timeout_keep_alive_task is not None and not self._refused and not self.transport.is_closing()
                and (self.cycle is None or self.cycle.response_complete) and self.conn.their_state is h11.IDLE
                and not self.conn.trailing_data[0])

    def _reclaim_idle(self, count: int) -> None:
        idle = [other for other in self._peers() if other.idle]
        if not idle:
            return
        held = Counter(other.client_key for other in self._peers())
        idle.sort(key=lambda other: (-held[other.client_key], other._idle_since))
        for other in idle[:count]:
            other._close_idle()

    def _close_idle(self) -> None:
        """As uvicorn's keep-alive timeout closes it, now; the slot is free at once."""
        self._refused = True
        self.connections.discard(self)
        self._unset_keepalive_if_required()
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # h11 already past the point of saying so: closing is what counts
            pass
        self.transport.close()

    def on_response_complete(self) -> None:
        self._idle_since = self.loop.time()
        super().on_response_complete()

    # the per-client cap counts connections from one address that have been receiving a request (or idle)
    # for PENDING_GRACE_S and more: a burst of clients that send their requests at once never counts, a
    # slowloris does within a second, and past the cap its new connections are refused as they open. Fresh
    # connections (a burst) may add as many again, no more: one address never holds more than twice the
    # cap of the slots, so others (a health check) always find one.
    def _long_pending(self, now: float) -> bool:
        return not self._refused and self.receiving and now - self._pending_since >= PENDING_GRACE_S

    def _over_client_cap(self) -> bool:
        if self.limits.max_per_client is None or self.client is None:
            return False
        key, now = self.client_key, self.loop.time()
        mine = [other for other in self.connections if other is not self and isinstance(other, GuardedH11Protocol)
                and other.client is not None and other.client_key == key and not other._refused and other.receiving]
        held = sum(1 for other in mine if other._long_pending(now))
        return held >= self.limits.max_per_client or len(mine) >= 2 * self.limits.max_per_client

    def _grace_over(self) -> None:
        if self._refused or self.transport.is_closing() or not self.receiving:
            return
        waited = self.loop.time() - self._pending_since
        if waited < PENDING_GRACE_S - 1e-3:  # a new request began meanwhile on this kept-alive connection
            self.loop.call_later(PENDING_GRACE_S - waited, self._grace_over)
        elif self._over_client_cap():
            self._refuse(self._cap_message(), pause=False)

    def _cap_message(self) -> str:
        return (f"more than server.max_connections_per_client ({self.limits.max_per_client}) connections from "
                f"{_from_where(self.client_key or '', 'connections counted per IPv6 /64')} still sending a request "
                "(or idle); retry shortly")

    def _refuse(self, message: str, pause: bool) -> None:
        """503 and close; the connection no longer holds a slot. ``pause``: close only after REFUSAL_PAUSE_S, so
        a client that reopens every connection it loses waits a moment for each refusal (it would otherwise
        keep the event loop busy accepting and refusing, and /healthz behind it)."""
        self._refused = True
        self._disarm()
        self.connections.discard(self)
        # Retry-After as every other 503 of the daemon: the OpenAI SDK, which retries a 503, waits that long instead
        # of its own backoff (from 0.5 s), and a client is told when trying again makes sense
        self.transport.write(raw_response(503, "Service Unavailable", message, "too_many_connections",
                                          retry_after_s=REFUSED_RETRY_AFTER_S))
        if pause:
            self.transport.pause_reading()
            self.loop.call_later(REFUSAL_PAUSE_S, self.transport.close)
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._early is not None:  # HTTPS: before the protocol started on the TLS transport (_handshake_tls)
            self._early.append(data)
            return
        if self._deadline is None and self.conn.their_state is h11.IDLE:  # a new request on a kept-alive connection
            self._body_phase = False
            self._pending_since = self.loop.time()
            self._arm(self.limits.request_timeout_s)
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.SEND_BODY and not self._body_phase:
            self._body_phase = True  # headers are in: the handler reads the body under its own deadline
            self._arm(self.limits.request_timeout_s + self.limits.body_grace_s)
        elif state is not h11.IDLE and state is not h11.SEND_BODY:
            self._disarm()

    @property
    def receiving(self) -> bool:
        """Still sending a request, or idle between two: not waiting for an answer (the per-client cap)."""
        return self.conn.their_state is h11.IDLE or self.conn.their_state is h11.SEND_BODY

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._disarm()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm()
        self.transport.write(raw_response(400, "Bad Request", f"invalid HTTP request: {msg}", "invalid_http"))
        self.transport.close()

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.cycle is None or self.cycle.response_complete:  # nobody else can answer this request
            self.transport.write(raw_response(408, "Request Timeout", "the request did not arrive within "
                                              f"server.request_timeout_s ({self.limits.request_timeout_s:g} s)",
                                              "request_timeout"))
        self.transport.close()
