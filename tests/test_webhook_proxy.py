"""Alert webhooks through an HTTP proxy by the rules escalations follow (apps/outputs/proxy.py):
``alerts.webhook_proxy``, else HTTPS_PROXY / HTTP_PROXY / ALL_PROXY with NO_PROXY as curl reads them. urllib's own
reading of the variables (what apps/outputs/webhooks.py used, unasked) ignored ALL_PROXY and NO_PROXY's CIDR blocks,
took a socks5:// proxy for an HTTP one, and had no config key; the receiver behind a CONNECT tunnel must still see its
own name in Host."""

from __future__ import annotations

import logging
import time

import pytest

from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.outputs.webhooks import WebhookSender
from edgekv.apps.server.tls import client_context
from edgekv.config import ConfigError, EdgeKVConfig
from helpers_proxy import Proxy, Remote, make_pki, no_proxy_environment, servers  # noqa: F401 (fixtures)

pytest.importorskip("cryptography.x509", reason="cryptography is not installed (pip install 'edgekv[privacy]')")

TLS_NAMES = ("alerts.webhook_ca_file", "alerts.webhook_cert_file", "alerts.webhook_key_file")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("webhook-proxy-pki"))


def _event() -> AlertEvent:
    return AlertEvent("e1", "alert-1", "red", "Was there a red circle?", None, 0.9, 1.0, 2, 1.0, time.time())


def _sender(url: str, pki, **kwargs) -> WebhookSender:
    context = client_context(url, str(pki["ca"]), None, None, names=TLS_NAMES) if url.startswith("https") else None
    return WebhookSender(url, timeout_s=60, retries=0, context=context, **kwargs)


def test_an_https_receiver_is_reached_through_the_proxy_s_tunnel_under_its_own_name(servers, pki, monkeypatch,
                                                                                    caplog):
    """Through a CONNECT tunnel, the credentials (percent-decoded) at the proxy only, the certificate checked against
    big.example, and the receiver's Host its own name — not the proxy's address, as urllib writes it for a request
    it was told to tunnel."""
    remote, proxy = servers(Remote, pki), servers(Proxy, "robot:p@ss word")
    monkeypatch.setenv("HTTPS_PROXY", f"http://robot:p%40ss%20word@127.0.0.1:{proxy.port}")
    with caplog.at_level(logging.DEBUG, "edgekv.webhooks"):
        sender = _sender(f"https://big.example:{remote.port}/hook", pki).start()
        try:
            sender.offer(_event())
            assert remote.arrived.acquire(timeout=120)
        finally:
            sender.stop()
    assert [line.rpartition(" ")[0] for line in proxy.lines] == [f"CONNECT big.example:{remote.port}"]
    assert proxy.authorizations == ["robot:p@ss word"]
    (path, body), = remote.requests
    assert path == "/hook" and body["id"] == "e1" and body["type"] == "edgekv.alert"
    assert remote.headers[0]["host"] == f"big.example:{remote.port}" and "proxy-authorization" not in remote.headers[0]
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert f"http://127.0.0.1:{proxy.port} (HTTPS_PROXY)" in logged
    assert "p@ss" not in logged and "p%40ss" not in logged and "robot" not in logged


def test_all_proxy_is_followed_as_curl_follows_it(servers, pki, monkeypatch):
    """urllib never read ALL_PROXY: the webhook went direct, and on a network that resolves no outside name failed."""
    remote, proxy = servers(Remote, pki), servers(Proxy)
    monkeypatch.setenv("ALL_PROXY", f"http://127.0.0.1:{proxy.port}")
    assert _sender(f"https://big.example:{remote.port}/hook", pki)._deliver(_event())
    assert [line.rpartition(" ")[0] for line in proxy.lines] == [f"CONNECT big.example:{remote.port}"]


def test_plain_http_goes_to_the_proxy_as_an_absolute_url(servers, pki, monkeypatch):
    remote, proxy = servers(Remote), servers(Proxy, "robot:secret")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # not for http:// receivers
    monkeypatch.setenv("http_proxy", f"http://robot:secret@127.0.0.1:{proxy.port}")
    assert _sender(f"http://big.example:{remote.port}/hook?k=1", pki)._deliver(_event())
    assert proxy.lines == [f"POST http://big.example:{remote.port}/hook?k=1 HTTP/1.1"]
    assert proxy.authorizations == ["robot:secret"] and remote.headers[0]["host"] == f"big.example:{remote.port}"


@pytest.mark.parametrize("no_proxy", ["127.0.0.0/8", "localhost, 127.0.0.1", "*"])
def test_no_proxy_sends_a_listed_receiver_direct(servers, pki, monkeypatch, no_proxy):
    """A CIDR block in NO_PROXY (urllib read names only) sends the receiver direct, as it does an escalation."""
    remote, proxy = servers(Remote, pki), servers(Proxy)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("NO_PROXY", no_proxy)
    assert _sender(f"https://127.0.0.1:{remote.port}/hook", pki)._deliver(_event())
    assert proxy.lines == [] and len(remote.requests) == 1


def test_the_config_s_webhook_proxy_wins_over_the_environment_and_direct_means_none(servers, pki, monkeypatch):
    remote, proxy = servers(Remote, pki), servers(Proxy)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens there
    configured = _sender(f"https://big.example:{remote.port}/hook", pki, proxy=f"http://127.0.0.1:{proxy.port}")
    assert configured.proxy.source == "alerts.webhook_proxy" and configured._deliver(_event())
    direct = _sender(f"https://localhost:{remote.port}/hook", pki, proxy="direct")
    assert direct.proxy is None and direct._deliver(_event())
    assert [line.rpartition(" ")[0] for line in proxy.lines] == [f"CONNECT big.example:{remote.port}"]
    assert len(remote.requests) == 2
    config = EdgeKVConfig().with_overrides(alerts={"webhooks": ["https://hooks.example/a"],
                                                   "webhook_proxy": "http://proxy.corp:3128"})
    assert config.alerts.webhook_proxy == "http://proxy.corp:3128"


@pytest.mark.parametrize("https", [True, False])
def test_a_proxy_that_refuses_is_named_without_its_credentials(servers, pki, monkeypatch, caplog, https):
    remote, proxy = servers(Remote, pki if https else None), servers(Proxy, "robot:right")
    monkeypatch.setenv("ALL_PROXY", f"http://robot:n0t-1t@127.0.0.1:{proxy.port}")
    with caplog.at_level(logging.INFO, "edgekv.webhooks"):
        delivered = _sender(f"{'https' if https else 'http'}://big.example:{remote.port}/hook", pki)._deliver(_event())
    assert not delivered and remote.requests == [] and proxy.authorizations == ["robot:n0t-1t"]
    warning = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING][-1]
    assert f"the proxy http://127.0.0.1:{proxy.port} (ALL_PROXY)" in warning and "407" in warning
    assert "n0t-1t" not in warning and "robot" not in warning


@pytest.mark.parametrize("value, wrong", [("socks5://robot:secret@127.0.0.1:1080", "a socks5:// proxy"),
                                          ("https://robot:secret@proxy.corp:443", "a https:// proxy"),
                                          ("http://robot:secret@proxy.corp:99999", "a port that is not a number"),
                                          ("http://", "no host")])
def test_a_proxy_that_cannot_be_used_is_refused_naming_where_it_was_set(monkeypatch, value, wrong):
    """urllib took a socks5:// HTTPS_PROXY for an HTTP proxy and sent it a CONNECT; now the sender does not start, the
    variable (or the key) named — and not its password."""
    monkeypatch.setenv("HTTPS_PROXY", value)
    with pytest.raises(ValueError, match="^HTTPS_PROXY: expected an http://") as caught:
        WebhookSender("https://hooks.example/a")
    assert wrong in str(caught.value) and "secret" not in str(caught.value)
    with pytest.raises(ValueError, match="^alerts.webhook_proxy: expected an http://"):
        WebhookSender("http://hooks.example/a", proxy=value)
    with pytest.raises(ConfigError, match="alerts.webhook_proxy") as caught:
        EdgeKVConfig().with_overrides(alerts={"webhooks": ["https://hooks.example/a"], "webhook_proxy": value})
    assert wrong in str(caught.value) and "secret" not in str(caught.value)
