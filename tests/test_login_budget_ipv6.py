"""Login attempts and ``server.reads_per_second`` counted per IPv6 /64, per IPv4 address (apps/server/guard.py
``budget_key``): a host holds every address of its /64 (SLAAC privacy addresses, ``ip addr add``), so a budget per
address gave a guesser 2**64 budgets."""

from __future__ import annotations

import asyncio

import pytest

from helpers_server import RunningDaemon, call, error_of, server_config

TOKEN = "s3cret-token-for-ipv6-budgets"


@pytest.mark.parametrize("client, key", [
    ("2001:db8:1:2:a:b:c:d", "2001:db8:1:2::/64"),
    ("2001:db8:1:2::1", "2001:db8:1:2::/64"),
    ("fe80::1%eth0", "fe80::/64"),
    ("::ffff:192.0.2.7", "192.0.2.7"),  # a dual-stack socket's IPv4 client: its address, as on an IPv4 socket
    ("192.0.2.7", "192.0.2.7"),
    ("testclient", "testclient"),
])
def test_an_ipv6_client_is_its_64_and_an_ipv4_one_its_address(client, key):
    from edgekv.apps.server.guard import budget_key

    assert budget_key(client) == key


def test_every_address_of_one_64_spends_one_budget():
    from edgekv.apps.server.guard import AttemptLimiter

    limiter = AttemptLimiter(per_minute=1, burst=2, clock=lambda: 0.0)
    assert limiter.allow("2001:db8:0:7::1") and limiter.allow("2001:db8:0:7::2")
    assert not any(limiter.allow(f"2001:db8:0:7:{i:x}::1") for i in range(1, 200))  # fresh addresses, same /64
    assert limiter.exhausted("2001:db8:0:7:ffff:ffff:ffff:ffff") and limiter.retry_after("2001:db8:0:7::99") > 0
    assert limiter.allow("2001:db8:0:8::1")  # the next /64: another subscriber
    assert limiter.allow("192.0.2.1") and limiter.allow("192.0.2.1") and limiter.allow("192.0.2.2")  # IPv4: each
    assert not limiter.allow("::ffff:192.0.2.1")  # the same IPv4 client, as a dual-stack socket names it
    limiter.refund("2001:db8:0:7::abcd")  # a right sign-in from another address of the /64 gives its attempt back
    assert limiter.allow("2001:db8:0:7::1")


def _bearer_status(policy, peer: str) -> tuple[int, bytes]:
    """The status RequestGuard answers a wrong bearer token from ``peer`` with (204 when it lets it through)."""
    from edgekv.apps.server.guard import RequestGuard

    sent = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "GET", "path": "/v1/models", "client": (peer, 5000), "scheme": "http",
             "headers": [(b"host", b"127.0.0.1:8080"), (b"authorization", b"Bearer wrong")]}
    asyncio.run(RequestGuard(app, policy)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], body


def test_a_guesser_rotating_through_its_64_is_refused_after_its_budget():
    from edgekv.apps.server.guard import AccessPolicy

    policy = AccessPolicy("::", TOKEN, (), 65536, login_attempts_per_minute=0.1)  # one guess in ten minutes
    assert _bearer_status(policy, "2001:db8:0:7::1")[0] == 401
    status, body = _bearer_status(policy, "2001:db8:0:7:8bad:f00d:1:2")  # a fresh address: the same network
    assert status == 429 and b"2001:db8:0:7::/64" in body and b"server.login_attempts_per_minute" in body
    assert _bearer_status(policy, "2001:db8:0:8::1")[0] == 401  # another /64 has its own budget
    assert _bearer_status(policy, "192.0.2.1")[0] == 401 and _bearer_status(policy, "192.0.2.2")[0] == 401


@pytest.fixture(scope="module")
def behind_proxy(tiny_checkpoint, tmp_path_factory):
    config = server_config(tiny_checkpoint, token=TOKEN, trusted_proxies=["127.0.0.1"],
                           login_attempts_per_minute=0.1)  # one guess, the next in ten minutes
    with RunningDaemon(config, tmp_path_factory.mktemp("ipv6-budget") / "out.txt") as run:
        yield run


def test_a_daemon_gives_one_login_budget_to_an_ipv6_64(behind_proxy):
    """Through a trusted proxy (the only way this test can have IPv6 clients of many networks): a wrong sign-in from
    one address of a /64 leaves no guess to the rest of it; the wearer on another network still signs in."""
    def login(forwarded_for: str, token: str = "wrong"):
        return call(behind_proxy.port, "POST", "/v1/edgekv/login", {"token": token},
                    headers={"X-Forwarded-For": forwarded_for})

    assert login("2001:db8:aa:1::10")[0] == 401
    status, headers, body = login("2001:db8:aa:1:dead:beef:0:1")
    assert status == 429 and "2001:db8:aa:1::/64" in error_of(body)["message"]
    assert login("[2001:db8:aa:1::77]:4711", token=TOKEN)[0] == 429  # the right token too: the network is spent
    assert login("2001:db8:aa:2::10", token=TOKEN)[0] == 204
    assert login("2001:db8:aa:2::11")[0] == 401
