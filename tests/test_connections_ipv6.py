"""``server.max_connections_per_client`` counts an IPv6 client by its /64, as the login budget does
(apps/server/guard.py ``budget_key``): it counted exact addresses, so one host opened the cap's connections from each
address of its network (2**64 of them, picked at will) — a slowloris the cap never saw. The reserved last tenth of
the slots and the idle connections closed to make room count the same way.

The connections are uvicorn's h11 protocol (``GuardedH11Protocol``) on transports that say which peer they come
from: this machine cannot open sockets from many addresses of a /64 (IPv4 can: all of 127/8 is loopback)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("uvicorn")

from edgekv.apps.server.guard import ConnectionLimits, GuardedH11Protocol  # noqa: E402

CAP = 2


class PeerTransport(asyncio.Transport):
    """A connection from ``peer``: what the protocol writes is kept, closing is noted."""

    def __init__(self, peer: str) -> None:
        super().__init__()
        self.peer, self.written, self.closed = (peer, 40000), bytearray(), False

    def get_extra_info(self, name, default=None):
        return {"peername": self.peer, "sockname": ("::", 8080)}.get(name, default)

    def write(self, data) -> None:
        self.written += data

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


@pytest.fixture
def opener():
    """``opener(peer)``: a connection opened from ``peer`` on one server (``max_connections`` 100 and the per-client
    cap ``CAP`` unless ``opener.limits`` is changed before the first), as its protocol sees it; its transport is
    returned."""
    from uvicorn.config import Config
    from uvicorn.server import ServerState

    async def app(scope, receive, send):  # never reached: no request is finished here
        raise AssertionError("a request was served")

    loop = asyncio.new_event_loop()
    config, state = Config(app, lifespan="off", log_level="warning"), ServerState()

    def open_from(peer: str) -> PeerTransport:
        transport = PeerTransport(peer)
        GuardedH11Protocol(config, state, {}, loop, limits=open_from.limits).connection_made(transport)
        return transport

    open_from.limits = ConnectionLimits(request_timeout_s=600.0, max_connections=100, max_per_client=CAP)

    yield open_from
    for task in asyncio.all_tasks(loop):
        task.cancel()
    loop.close()


def _refused(transport: PeerTransport) -> bool:
    return bytes(transport.written).startswith(b"HTTP/1.1 503")


def test_connections_from_the_addresses_of_one_ipv6_64_share_one_cap(opener):
    # twice the cap of fresh connections is as many as one client may open at once (a burst), whatever its addresses
    held = [opener(f"2001:db8:0:7::{i:x}") for i in range(1, 2 * CAP + 1)]
    assert not any(_refused(transport) for transport in held)
    refused = opener("2001:db8:0:7:ffff:1:2:3")  # another address of the same /64
    assert _refused(refused)
    message = bytes(refused.written).decode()
    assert "server.max_connections_per_client (2)" in message
    assert "this address's network (2001:db8:0:7::/64: connections counted per IPv6 /64)" in message
    assert not _refused(opener("2001:db8:0:8::1"))  # the next /64 is another client


def test_ipv4_clients_and_mapped_ones_are_still_counted_per_address(opener):
    held = [opener("192.0.2.10") for _ in range(2 * CAP)]
    assert not any(_refused(transport) for transport in held)
    refused = opener("::ffff:192.0.2.10")  # the same IPv4 client, as a dual-stack socket names it
    assert _refused(refused) and "connections from this address still sending" in bytes(refused.written).decode()
    assert not _refused(opener("192.0.2.11"))


def test_the_reserved_slots_count_an_ipv6_64_as_one_address(opener):
    """The last tenth of server.max_connections is kept for addresses that hold no connection still sending: another
    address of a /64 that holds one is not such an address."""
    opener.limits = ConnectionLimits(request_timeout_s=600.0, max_connections=10)  # 1 slot reserved
    held = [opener(f"192.0.2.{i}") for i in range(1, 9)] + [opener("2001:db8:0:7::1")]
    assert not any(_refused(transport) for transport in held)
    refused = opener("2001:db8:0:7::2")
    assert _refused(refused) and "are kept for addresses that hold no connection" in bytes(refused.written).decode()
    assert not _refused(opener("2001:db8:0:9::1"))  # an address of another /64 holds none: the slot is its
