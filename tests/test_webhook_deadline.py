"""``alerts.webhook_timeout_s`` is each delivery try's whole exchange (apps/outputs/exchange.py, escalation's): it was
urllib's timeout of each network read, so a receiver or a proxy trickling its answer a byte at a time — never silent
for the timeout — held the webhook thread, and every alert queued behind it, for as long as it went on. Here the
trickle never ends: without the deadline the try never finishes."""

from __future__ import annotations

import logging
import socketserver
import threading
import time

import pytest

from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.outputs.webhooks import WebhookSender
from helpers_mqtt import until
from helpers_proxy import PROXY_VARIABLES


@pytest.fixture(autouse=True)
def _no_proxy_of_the_machine(monkeypatch):
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _event() -> AlertEvent:
    return AlertEvent("e1", "alert-1", "red", "Was there a red circle?", None, 0.9, 1.0, 2, 1.0, time.time())


@pytest.fixture
def trickler():
    """A TCP server that reads the request, then answers ``head`` and one more byte every 0.1 s until the test ends
    (a status line or header that never completes); ``.port``, ``.requests``."""
    stop = threading.Event()
    servers = []

    def make(head: bytes):
        class Trickle(socketserver.BaseRequestHandler):
            def handle(self):
                server.requests += 1
                self.request.recv(65536)
                try:
                    self.request.sendall(head)
                    while not stop.wait(0.1):
                        self.request.sendall(b"x")
                except OSError:  # the sender hung up: what it is for
                    pass

        server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Trickle)
        server.daemon_threads, server.requests = True, 0
        server.port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield make
    stop.set()
    for server in servers:
        server.shutdown()
        server.server_close()


def _failed_at_the_deadline(sender: WebhookSender, caplog) -> str:
    """The one alert given up once every try hit the deadline (the trickle still going on): the warning said."""
    with caplog.at_level(logging.INFO, "edgekv.webhooks"):
        sender.start().offer(_event())
        try:
            assert until(lambda: sender.failed == 1, timeout=120), "still reading the trickled answer"
        finally:
            sender.stop()
    assert sender.sent == 0 and sender.attempts == sender.retries + 1
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING][-1]


def test_a_receiver_trickling_its_status_line_is_cut_at_the_timeout_on_each_try(trickler, caplog):
    receiver = trickler(b"HTTP/1.1 200 ")
    sender = WebhookSender(f"http://127.0.0.1:{receiver.port}/alerts", timeout_s=1, retries=1)
    warning = _failed_at_the_deadline(sender, caplog)
    assert "not delivered after 2 tries" in warning
    assert "no whole answer within alerts.webhook_timeout_s (1 s)" in warning
    assert receiver.requests == 2


def test_a_receiver_trickling_a_header_forever_is_cut_too(trickler, caplog):
    receiver = trickler(b"HTTP/1.1 200 OK\r\nX-Pad: ")
    sender = WebhookSender(f"http://127.0.0.1:{receiver.port}/alerts", timeout_s=1, retries=0)
    assert "alerts.webhook_timeout_s (1 s)" in _failed_at_the_deadline(sender, caplog)


def test_a_proxy_trickling_its_connect_reply_is_cut_at_the_timeout(trickler, caplog, monkeypatch):
    proxy = trickler(b"HTTP/1.1 200 ")
    monkeypatch.setenv("HTTPS_PROXY", f"http://robot:secret@127.0.0.1:{proxy.port}")
    sender = WebhookSender("https://big.example/alerts", timeout_s=1, retries=0)
    warning = _failed_at_the_deadline(sender, caplog)
    assert "alerts.webhook_timeout_s (1 s)" in warning
    assert f"through the proxy http://127.0.0.1:{proxy.port} (HTTPS_PROXY)" in warning and "secret" not in warning
