"""Behind a reverse proxy (``server.trusted_proxies``): each client its own login budget, the header read only from
the proxies named; and ``server.metrics_public``, whose scrape without the token does not say when the camera was
paused (``/healthz`` does not either)."""

from __future__ import annotations

import asyncio
import ipaddress
import threading
import time
from types import SimpleNamespace

import pytest

from edgekv.config import ConfigError, EdgeKVConfig
from helpers_server import RunningDaemon, call, error_of, server_config

pytest.importorskip("fastapi")
parser = pytest.importorskip("prometheus_client.parser")
TOKEN = "proxy-token-3"
PROXIES = tuple(ipaddress.ip_network(n) for n in ("127.0.0.1/32", "10.0.0.0/8", "fd00::/8"))


# ---------------------------------------------------------------------------------------------- the client named
@pytest.mark.parametrize("peer, header, value, client", [
    # the proxy appends the address it saw: what the client wrote stands left of it and is never taken
    ("127.0.0.1", "x-forwarded-for", "6.6.6.6, 203.0.113.7", "203.0.113.7"),
    ("127.0.0.1", "x-forwarded-for", "203.0.113.7, 10.1.1.1", "203.0.113.7"),  # two proxies: the inner one skipped
    ("127.0.0.1", "x-forwarded-for", "203.0.113.7:4711", "203.0.113.7"),
    ("127.0.0.1", "x-forwarded-for", "[2001:db8::1]:443", "2001:db8::1"),
    ("::ffff:127.0.0.1", "x-forwarded-for", "2001:db8::1", "2001:db8::1"),  # a dual-stack socket's IPv4 peer
    ("127.0.0.1", "x-forwarded-for", "10.2.2.2, 10.1.1.1", "10.2.2.2"),  # every hop trusted: the left-most
    ("192.0.2.1", "x-forwarded-for", "203.0.113.7", "192.0.2.1"),  # not a trusted proxy: the header is not read
    ("127.0.0.1", "x-forwarded-for", "203.0.113.7, unknown", "127.0.0.1"),  # no address: the proxy's own budget
    ("127.0.0.1", "x-forwarded-for", None, "127.0.0.1"),
    ("127.0.0.1", "forwarded", 'for=6.6.6.6, for="[2001:db8:cafe::17]:4711";proto=https', "2001:db8:cafe::17"),
    ("127.0.0.1", "forwarded", "For=203.0.113.7;by=10.0.0.1, for=10.1.1.1", "203.0.113.7"),
    ("127.0.0.1", "forwarded", 'for=6.6.6.6, for="_hidden"', "127.0.0.1"),
    ("127.0.0.1", "forwarded", "for=6.6.6.6, proto=https", "127.0.0.1"),  # the last hop named nobody
])
def test_the_client_is_the_right_most_address_no_trusted_proxy_wrote(peer, header, value, client):
    from edgekv.apps.server.guard import forwarded_client

    headers = [(header.encode(), value.encode())] if value is not None else []
    headers.append((b"x-forwarded-for" if header == "forwarded" else b"forwarded", b"for=1.1.1.1"))  # the other one
    assert forwarded_client(peer, headers, PROXIES, header) == client


def test_several_header_lines_read_as_one_list():
    from edgekv.apps.server.guard import forwarded_client

    headers = [(b"x-forwarded-for", b"6.6.6.6"), (b"x-forwarded-for", b"203.0.113.7, 10.1.1.1")]
    assert forwarded_client("127.0.0.1", headers, PROXIES, "x-forwarded-for") == "203.0.113.7"


def _guarded_client(policy, peer: tuple[str, int], headers: list) -> tuple:
    """The ``client`` the app behind ``RequestGuard`` sees for one GET /v1/models from ``peer``."""
    from edgekv.apps.server.guard import RequestGuard

    seen = {}

    async def app(scope, receive, send):
        seen["client"] = scope["client"]
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        pass

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "client": peer, "scheme": "http",
             "headers": [(b"host", b"127.0.0.1:8080"), *headers]}
    asyncio.run(RequestGuard(app, policy)(scope, receive, send))
    return seen["client"]


def test_the_guard_hands_the_named_client_on_only_from_a_trusted_proxy():
    from edgekv.apps.server.guard import AccessPolicy

    forged = [(b"x-forwarded-for", b"203.0.113.7")]
    trusting = AccessPolicy("127.0.0.1", None, (), 65536, trusted_proxies=("127.0.0.1",))
    assert _guarded_client(trusting, ("127.0.0.1", 5000), forged) == ("203.0.113.7", 0)
    assert _guarded_client(trusting, ("192.0.2.1", 5000), forged) == ("192.0.2.1", 5000)
    assert _guarded_client(AccessPolicy("127.0.0.1", None, (), 65536), ("127.0.0.1", 5000), forged) == \
        ("127.0.0.1", 5000)  # the default: no proxy trusted, the header never read


@pytest.mark.parametrize("entries, says", [
    (["10.0.0.1/8"], "'10.0.0.1/8' is not an address or CIDR network (10.0.0.1/8 has host bits set)"),
    (["proxy.lan"], "'proxy.lan' is not an address or CIDR network"),
    (["::/0"], "'::/0' trusts every address"),
])
def test_a_trusted_proxy_that_is_not_one_is_refused_naming_it(entries, says):
    with pytest.raises(ConfigError, match="server.trusted_proxies: ") as caught:
        EdgeKVConfig().with_overrides(server={"trusted_proxies": entries})
    assert says in str(caught.value)


def test_a_header_no_proxy_writes_is_refused():
    with pytest.raises(ConfigError, match="server.proxy_header: expected one of x-forwarded-for, forwarded"):
        EdgeKVConfig().with_overrides(server={"proxy_header": "x-real-ip"})


# ---------------------------------------------------------------------------------------------- a daemon behind one
@pytest.fixture(scope="module")
def behind_proxy(tiny_checkpoint, tmp_path_factory):
    config = server_config(tiny_checkpoint, token=TOKEN, metrics_public=True, trusted_proxies=["127.0.0.1"],
                           login_attempts_per_minute=0.1)  # one guess, the next in ten minutes
    with RunningDaemon(config, tmp_path_factory.mktemp("proxy") / "out.txt") as run:
        yield run


def login(port: int, forwarded_for: str, token: str = "wrong") -> int:
    return call(port, "POST", "/v1/edgekv/login", {"token": token}, headers={"X-Forwarded-For": forwarded_for})[0]


def test_behind_a_trusted_proxy_each_client_has_its_own_login_budget(behind_proxy):
    """A wrong token from one client behind the proxy spends its one guess: that client is refused, another client of
    the same proxy still signs in, and a guesser writing a fresh address in front of its own is counted as itself."""
    port = behind_proxy.port
    assert login(port, "203.0.113.7") == 401
    status, headers, body = call(port, "POST", "/v1/edgekv/login", {"token": "wrong"},
                                 headers={"X-Forwarded-For": "203.0.113.7"})
    assert status == 429 and "server.login_attempts_per_minute" in error_of(body)["message"]
    assert login(port, "6.6.6.6, 203.0.113.7") == 429  # what the client wrote itself is not its address
    assert login(port, "203.0.113.8", token=TOKEN) == 204  # the wearer, through the same proxy
    assert login(port, "203.0.113.8") == 401


# ---------------------------------------------------------------------------------------------- metrics_public
def families(port: int, token: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    status, _, body = call(port, "GET", "/metrics", headers=headers)
    assert status == 200
    return {family.name: family for family in parser.text_string_to_metric_families(body.decode())}


def test_a_public_scrape_does_not_say_the_camera_was_paused(behind_proxy):
    port, auth = behind_proxy.port, {"Authorization": f"Bearer {TOKEN}"}
    assert call(port, "POST", "/v1/privacy/pause", {}, headers=auth)[0] == 200
    try:
        private = families(port, TOKEN)  # rendered first: a public scrape right after must not be served it
        public = families(port)
        state = {s.labels["state"]: s.value for s in private["edgekv_stream_state"].samples}
        assert state["paused"] == 1.0
        assert "edgekv_stream_state" not in public
        assert not [s for f in public.values() for s in f.samples if "paused" in s.labels.values()]
        assert "edgekv_frames" in public and "edgekv_cache_capacity_bytes" in public  # a monitor's figures stay
        assert call(port, "GET", "/healthz")[2] == b'{"status":"ok"}'  # as /healthz says it
    finally:
        assert call(port, "POST", "/v1/privacy/resume", {}, headers=auth)[0] == 200


class _StubSession:
    grid = None

    def __init__(self) -> None:
        self.counters = SimpleNamespace(frames=8)

    def stats(self) -> dict:
        return {"frames": 8, "frame_pairs": 4, "frames_rejected": 0, "compressions": 0, "questions": 0,
                "answer_tokens": 0, "cache_tokens": 10, "cache_capacity_tokens": 400, "cache_capacity_bytes": 4096,
                "policy": "full", "vision_backend": "torch", "llm_backend": "torch"}


def test_the_public_and_the_private_exposition_are_kept_apart():
    from edgekv.apps.server.telemetry import PRIVATE_FAMILIES, Telemetry

    ready = threading.Event()
    ready.set()
    daemon = SimpleNamespace(session=_StubSession(), lock=threading.RLock(), monitor=None, sampler=None,
                             config=EdgeKVConfig(), started=time.monotonic(), stop=False, ready=ready,
                             questions=SimpleNamespace(qsize=lambda: 0), stream_state="paused")
    telemetry = Telemetry(daemon)
    private = telemetry.exposition()[0].decode()
    public = telemetry.exposition(public=True)[0].decode()  # within FRESH_S of the private one
    assert 'edgekv_stream_state{state="paused"} 1.0' in private
    assert not [name for name in PRIVATE_FAMILIES if name in public] and "paused" not in public
    assert "edgekv_frames_total 8.0" in public
    assert telemetry.exposition_fresh(public=True) and telemetry.exposition()[0].decode() == private
