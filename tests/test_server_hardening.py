"""What the security probe of session 96 found in the HTTP server, each driven against a real daemon:

1. a few client addresses holding idle kept-alive (or never-finished) connections took every slot of
   ``server.max_connections``, and ``/healthz`` from anyone else was 503;
2. signing out left a copied session cookie working until its 12 h expiry;
3. the status page's Content-Security-Policy allowed inline scripts (``test_server_page_csp.py`` loads the page
   in Chromium);
4. no ``Strict-Transport-Security`` over HTTPS (``test_server_tls.py``);
5. the unauthenticated ``/healthz`` told anyone whether the camera was paused and how many frames it had seen.

Connections come from other loopback addresses (127.0.0.2 ...), as from other hosts."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time

import pytest

from edgekv.apps.server.guard import SessionCookies
from helpers_server import RunningDaemon, call, error_of, server_config

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TOKEN = "hardening-token"
WAIT_S = 120  # generous bounds on conditions, never a measured time


def _from(host: str, port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S, source_address=(host, 0))
    sock.settimeout(WAIT_S)
    return sock


def _response(sock: socket.socket) -> tuple[int, bytes]:
    """One whole HTTP/1.1 response read from ``sock`` (Content-Length framed), the connection left open."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response: {data[:200]!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of the body"
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def _healthz_from(host: str, port: int, headers: dict | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S, source_address=(host, 0))
    try:
        conn.request("GET", "/healthz", headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def _closed_by_server(sock: socket.socket) -> bool:
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


# ---------------------------------------------------------------------------------------------- 1: connections
HOGS = ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")


def test_idle_kept_alive_connections_of_a_few_addresses_make_room_for_a_new_client(tiny_checkpoint, tmp_path):
    """The probe: every slot held by idle kept-alive connections of four addresses (each well under
    server.max_connections_per_client), kept open far longer than the test runs. Before: /healthz from a fifth
    address was 503 until keep_alive_s closed them. Now idle ones are closed to make room (a client must expect
    an idle connection to close at any time: RFC 9112 9.3) and the fifth address is served."""
    config = server_config(tiny_checkpoint, max_connections=20, keep_alive_s=600.0, request_timeout_s=600.0)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        idle = []
        try:
            for i in range(20):
                sock = _from(HOGS[i % len(HOGS)], running.port)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                status, _ = _response(sock)  # answered: the connection is idle, kept alive for 600 s
                assert status == 200
                idle.append(sock)
            status, body = _healthz_from("127.0.0.6", running.port)
            assert status == 200, body
            deadline = time.monotonic() + WAIT_S
            while not any(_closed_by_server(sock) for sock in idle) and time.monotonic() < deadline:
                select.select(idle, [], [], 1.0)
            assert time.monotonic() < deadline, "no idle connection was closed to make room"
        finally:
            for sock in idle:
                sock.close()


def test_slow_senders_of_a_few_addresses_leave_room_for_a_new_client(tiny_checkpoint, tmp_path):
    """Connections that never finish their request (not idle: nothing can be closed for them) from four
    addresses, each under its per-client cap: they may not take the last slots, which are kept for addresses
    that hold none; /healthz from a fifth address is served, and the refused ones were told why."""
    config = server_config(tiny_checkpoint, max_connections=20, max_connections_per_client=8,
                           request_timeout_s=600.0)
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        held, refused = [], []
        try:
            for i in range(20):
                sock = _from(HOGS[i % len(HOGS)], running.port)
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the blank line never comes
                held.append(sock)
            status, body = _healthz_from("127.0.0.6", running.port)
            assert status == 200, body
            for sock in held:
                readable, _, _ = select.select([sock], [], [], 0)
                if readable:
                    answer = sock.recv(65536)
                    if answer:
                        refused.append(answer)
            assert refused, "every slot went to the four addresses"
            for answer in refused:
                assert answer.startswith(b"HTTP/1.1 503"), answer[:100]
                error = error_of(answer.split(b"\r\n\r\n", 1)[1])
                assert "server.max_connections" in error["message"] and error["code"] == "too_many_connections"
        finally:
            for sock in held:
                sock.close()


# ---------------------------------------------------------------------------------------------- a daemon with a token
@pytest.fixture(scope="module")
def secured(tiny_checkpoint, tmp_path_factory):
    config = server_config(tiny_checkpoint, token=TOKEN)
    with RunningDaemon(config, tmp_path_factory.mktemp("hardening") / "out.txt") as run:
        yield run


def _sign_in(port: int) -> dict:
    status, headers, body = call(port, "POST", "/v1/edgekv/login", {"token": TOKEN})
    assert status == 204, body
    return {"Cookie": headers["set-cookie"].split(";")[0]}


# ---------------------------------------------------------------------------------------------- 2: sign-out
def test_signing_out_revokes_the_cookie_and_every_copy_of_it(secured):
    """Before: sign-out only asked the browser to drop its cookie; a copy taken before (another browser, a stolen
    one) opened the page, the frames and the API for the rest of its 12 h."""
    port = secured.port
    copied, other = _sign_in(port), _sign_in(port)
    for path in ("/v1/edgekv/status", "/frame.jpg"):
        assert call(port, "GET", path, headers=copied)[0] == 200, path
    status, headers, _ = call(port, "POST", "/v1/edgekv/logout", {}, headers=copied)
    assert status == 204 and "Max-Age=0" in headers["set-cookie"]
    for path in ("/v1/edgekv/status", "/frame.jpg", "/static/page.js"):
        status, _, body = call(port, "GET", path, headers=copied)
        assert status == 401 and error_of(body)["code"] == "invalid_api_key", path
    status, _, page = call(port, "GET", "/", headers=copied)
    assert status == 200 and b'id="login"' in page and b'id="frame"' not in page
    assert call(port, "GET", "/v1/edgekv/status", headers=other)[0] == 200  # another sign-in is its own session
    assert call(port, "POST", "/v1/edgekv/logout", {}, headers=copied)[0] == 204  # signing out twice is harmless


def test_sessions_are_server_side_bounded_and_die_with_a_restart_or_a_new_token():
    now = [1000.0]
    cookies = SessionCookies("a", lifetime_s=60, clock=lambda: now[0], max_sessions=3)
    first, second = cookies.issue(), cookies.issue()
    assert cookies.valid(first) and cookies.valid(second) and first != second
    assert cookies.revoke(first) and not cookies.valid(first) and cookies.valid(second)
    assert not cookies.revoke(first)
    assert not SessionCookies("a", clock=lambda: now[0]).valid(second)  # a restart: same token, no session
    assert not SessionCookies("b", clock=lambda: now[0]).valid(second)
    expiry, session, mac = second.split(".")
    assert not cookies.valid(f"{expiry}.{'0' * len(session)}.{mac}")  # another id under the same MAC
    more = [cookies.issue() for _ in range(3)]
    assert not cookies.valid(second) and all(cookies.valid(value) for value in more)  # the oldest made room
    now[0] += 61
    assert not any(cookies.valid(value) for value in more)
    assert not cookies.valid("garbage") and not cookies.valid("99999999999999.x.y")


# ---------------------------------------------------------------------------------------------- 3: the page's files
def test_the_page_allows_no_inline_script_and_serves_its_own_files(secured):
    port = secured.port
    status, headers, page = call(port, "GET", "/")
    policy = dict(part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";"))
    assert "'unsafe-inline'" not in policy["script-src"] and "'unsafe-inline'" not in policy["style-src"]
    assert b"<script>" not in page and b"<style>" not in page
    for name, kind in (("login.js", "text/javascript"), ("login.css", "text/css")):  # the form's: no token
        status, headers, body = call(port, "GET", f"/static/{name}")
        assert status == 200 and headers["content-type"].startswith(kind) and body, name
    assert call(port, "GET", "/static/page.js")[0] == 401  # the page's: as the page, with the token
    session = _sign_in(port)
    status, _, page = call(port, "GET", "/", headers=session)
    assert b"<script>" not in page and b'<script src="/static/page.js">' in page
    status, headers, body = call(port, "GET", "/static/page.js", headers=session)
    assert status == 200 and headers["content-type"].startswith("text/javascript") and b"/frame.jpg" in body
    for name in ("index.html", "../guard.py", "nothing.js"):
        assert call(port, "GET", f"/static/{name}", headers=session)[0] == 404, name


# ---------------------------------------------------------------------------------------------- 5: /healthz
def test_healthz_without_the_token_says_only_the_status(secured):
    """Before: anyone who could reach the port read ``stream_state`` (``paused``: the wearer switched the camera
    off), the frame count and the problems' details. The status code and its word stay public (load balancers,
    container health checks, fleet probers act on them); the rest needs the token, as every other figure does."""
    port, bearer = secured.port, {"Authorization": f"Bearer {TOKEN}"}
    session = _sign_in(port)  # the page's cookie opens the details as the token does
    assert call(port, "POST", "/v1/privacy/pause", {}, headers=bearer)[0] == 200
    try:
        for path in ("/healthz", "/health"):
            status, _, body = call(port, "GET", path)
            assert status == 200 and json.loads(body) == {"status": "ok"}, body
            status, _, body = call(port, "GET", path, headers=bearer)
            full = json.loads(body)
            assert status == 200 and full["stream_state"] == "paused" and full["frames"] > 0, full
            assert json.loads(call(port, "GET", path, headers=session)[2])["stream_state"] == "paused"
        status, headers, body = call(port, "HEAD", "/healthz")
        assert status == 200 and body == b""
    finally:
        assert call(port, "POST", "/v1/privacy/resume", {}, headers=bearer)[0] == 200
