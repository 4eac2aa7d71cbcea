"""Who may talk to the API: Host names (DNS rebinding), Origins (cross-site pages), content types (a
``text/plain`` form post), the token (checked before the body is read) and the status page's login
cookie; and the start-up warning for a non-loopback bind without a token."""

from __future__ import annotations

import pytest

from edgekv.apps.server.guard import AccessPolicy, SessionCookies, split_host
from edgekv.apps.server.app import exposure_warning
from helpers_server import RunningDaemon, call, chat, connect, error_of, read_until_closed, server_config

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def running(tiny_checkpoint, tmp_path_factory):
    config = server_config(tiny_checkpoint, token=TOKEN, allowed_hosts=["camera.local"])
    with RunningDaemon(config, tmp_path_factory.mktemp("security") / "out.txt") as run:
        yield run


def bearer(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {TOKEN}", **(extra or {})}


# ---------------------------------------------------------------------------------------------- Host and Origin
@pytest.mark.parametrize("host", ["127.0.0.1:{port}", "localhost:{port}", "LOCALHOST.", "[::1]:{port}",
                                  "camera.local:{port}"])
def test_own_host_names_are_accepted(running, host):
    status, _, _ = call(running.port, "GET", "/frame.jpg", headers=bearer({"Host": host.format(port=running.port)}))
    assert status == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:{port}", "127.0.0.1.evil.example", "10.0.0.7"])
def test_rebinding_host_names_are_refused(running, host):
    """A DNS-rebinding page reaches 127.0.0.1 under its own name: even with the token it reads nothing."""
    status, _, body = call(running.port, "GET", "/frame.jpg", headers=bearer({"Host": host.format(port=running.port)}))
    assert status == 400 and error_of(body)["code"] == "invalid_host"


def test_foreign_origins_are_refused(running):
    own = f"http://127.0.0.1:{running.port}"
    for origin in ("http://evil.example", "null", f"http://127.0.0.1:{running.port + 1}", "http://localhost"):
        status, _, body = chat(running.port, "hi", headers=bearer({"Origin": origin}), max_tokens=1)
        assert status == 403 and error_of(body)["code"] == "cross_origin", origin
    status, _, body = chat(running.port, "hi", headers=bearer({"Origin": own}), max_tokens=1)
    assert status == 200, body


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/json; charset=latin-1", None])
def test_posts_must_be_json(running, content_type):
    headers = bearer({"Content-Type": content_type} if content_type else {})
    raw = b'{"messages":[{"role":"user","content":"hi"}]}'
    conn_headers = headers if content_type else {**headers, "Content-Type": ""}
    status, _, body = call(running.port, "POST", "/v1/chat/completions", raw=raw, headers=conn_headers)
    assert status == 415 and error_of(body)["code"] == "unsupported_media_type"


# ---------------------------------------------------------------------------------------------- token
def test_every_route_but_health_and_page_needs_the_token(running):
    for path in ("/metrics", "/frame.jpg", "/v1/edgekv/status", "/v1/models", "/openapi.json"):
        status, headers, body = call(running.port, "GET", path)
        assert status == 401 and error_of(body)["type"] == "authentication_error", path
        assert headers["www-authenticate"] == "Bearer"
        assert call(running.port, "GET", path, headers=bearer())[0] == 200, path
    # once: each wrong token costs one of the login's attempts (test_page_engine_probes.py), this daemon's too
    assert call(running.port, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"})[0] == 401
    assert call(running.port, "GET", "/healthz")[0] == 200
    status, _, page = call(running.port, "GET", "/")
    assert status == 200 and b'id="login"' in page and b'id="frame"' not in page  # the login form, nothing else


def test_the_token_is_checked_before_the_body_is_read(running):
    """Headers announcing a large body and no token: 401 at once, without waiting for the body."""
    sock = connect(running.port)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 60000\r\n\r\n")
    data, took = read_until_closed(sock, limit_s=10)
    sock.close()
    assert data.startswith(b"HTTP/1.1 401 ") and took < 1.5  # the request timeout (2 s) never came into it


def test_login_sets_a_strict_http_only_cookie_that_opens_the_page(running):
    status, _, body = call(running.port, "POST", "/v1/edgekv/login", {"token": "wrong"})
    assert status == 401 and error_of(body)["param"] == "token"
    status, headers, _ = call(running.port, "POST", "/v1/edgekv/login", {"token": TOKEN})
    assert status == 204
    cookie = headers["set-cookie"]
    attributes = {part.strip().split("=")[0] for part in cookie.split(";")}
    assert {"HttpOnly", "SameSite", "Path", "Max-Age"} <= attributes and "SameSite=Strict" in cookie
    assert TOKEN not in cookie
    session = {"Cookie": cookie.split(";")[0]}
    status, _, page = call(running.port, "GET", "/", headers=session)
    assert status == 200 and b'id="frame"' in page  # the live page (its script, /static/page.js, fetches the frame)
    assert call(running.port, "GET", "/frame.jpg", headers=session)[0] == 200
    status, _, body = chat(running.port, "hi", headers=session, max_tokens=1)
    assert status == 200, body
    tampered = {"Cookie": session["Cookie"][:-1] + ("0" if session["Cookie"][-1] != "0" else "1")}
    assert call(running.port, "GET", "/frame.jpg", headers=tampered)[0] == 401


def test_session_cookies_expire_and_die_with_the_token():
    now = [1000.0]
    cookies = SessionCookies("a", lifetime_s=60, clock=lambda: now[0])
    value = cookies.issue()
    assert cookies.valid(value)
    assert not SessionCookies("b", clock=lambda: now[0]).valid(value)
    now[0] += 61
    assert not cookies.valid(value)
    assert not cookies.valid("garbage") and not cookies.valid("99999999999999.x")


# ---------------------------------------------------------------------------------------------- policy units
def test_host_parsing():
    assert split_host("[::1]:8080") == ("::1", 8080)
    assert split_host("LocalHost.:80") == ("localhost", 80)
    assert split_host("127.0.0.1") == ("127.0.0.1", None)


def test_wildcard_bind_accepts_ip_literals_and_this_machine_only():
    import socket

    policy = AccessPolicy("0.0.0.0", "t", (), 1024)
    assert policy.host_allowed("192.168.1.20") and policy.host_allowed(socket.gethostname().lower())
    assert not policy.host_allowed("evil.example")
    loopback = AccessPolicy("127.0.0.1", None, (), 1024)
    assert not loopback.host_allowed("192.168.1.20")


def test_exposure_warning():
    assert exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None
    assert exposure_warning("0.0.0.0", "token") is None
    warning = exposure_warning("0.0.0.0", None)
    assert warning.startswith("WARNING") and "WITHOUT A TOKEN" in warning and "server.token" in warning
    assert "192.168.1.20" in exposure_warning("192.168.1.20", "")

