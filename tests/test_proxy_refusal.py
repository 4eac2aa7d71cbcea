"""A proxy that refuses, the same whichever the scheme (apps/outputs/exchange.py ``ProxyRefused``): a 407 to the
CONNECT of an ``https://`` server was an ``OSError`` — the webhooks retried it as a network fault, asking the proxy
again and again with the same wrong credentials — while the same 407 to an ``http://`` request was final, an
escalation's error then naming the server ("HTTP 407 from ...") and not the proxy. A 407 is a configuration error:
final, the proxy named without its credentials, and whether they were refused or never given said."""

from __future__ import annotations

import logging
import time

import pytest

from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.outputs.escalate import Escalator
from edgekv.apps.outputs.exchange import ProxyRefused
from edgekv.apps.outputs.webhooks import WebhookSender
from edgekv.apps.server.tls import client_context
from edgekv.config import EscalateSection
from helpers_proxy import Proxy, Remote, make_pki, no_proxy_environment, servers  # noqa: F401 (fixtures)

pytest.importorskip("cryptography.x509", reason="cryptography is not installed (pip install 'edgekv[privacy]')")

TLS_NAMES = ("alerts.webhook_ca_file", "alerts.webhook_cert_file", "alerts.webhook_key_file")
# (the proxy URL's credentials, the words that say what was wrong with them)
CREDENTIALS = [("robot:wrong@", "the credentials in HTTPS_PROXY were refused"),
               ("", "it was sent no credentials: give them in HTTPS_PROXY as http://user:password@")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("proxy-refusal-pki"))


def _url(scheme: str, remote: Remote, path: str) -> str:
    return f"{scheme}://big.example:{remote.port}{path}"


def _event() -> AlertEvent:
    return AlertEvent("e1", "alert-1", "red", "Was there a red circle?", None, 0.9, 1.0, 2, 1.0, time.time())


def _proxied(monkeypatch, proxy: Proxy, userinfo: str, scheme: str) -> str:
    """The proxy in the variable a ``scheme`` URL reads (as curl reads them); that variable's name."""
    source = "HTTPS_PROXY" if scheme == "https" else "http_proxy"
    monkeypatch.setenv(source, f"http://{userinfo}127.0.0.1:{proxy.port}")
    return source


@pytest.mark.parametrize("userinfo, said", CREDENTIALS, ids=["refused", "missing"])
@pytest.mark.parametrize("scheme", ["https", "http"])
def test_an_escalation_the_proxy_refuses_says_so_naming_the_proxy(servers, pki, monkeypatch, scheme, userinfo, said):
    remote, proxy = servers(Remote, pki if scheme == "https" else None), servers(Proxy, "robot:right")
    source = _proxied(monkeypatch, proxy, userinfo, scheme)
    escalator = Escalator(EscalateSection(url=_url(scheme, remote, "/v1"), model="big", timeout_s=60,
                                          ca_file=str(pki["ca"]) if scheme == "https" else None), done=lambda q: None)
    with pytest.raises(ProxyRefused) as caught:
        escalator.ask_remote("What is on the table?", [])
    message = str(caught.value)
    assert message.startswith(f"the proxy http://127.0.0.1:{proxy.port} ({source}) refused "), message
    assert "HTTP 407" in message and said.replace("HTTPS_PROXY", source) in message
    assert "wrong" not in message and "robot" not in message and remote.requests == []
    assert len(proxy.lines) == 1


@pytest.mark.parametrize("userinfo, said", CREDENTIALS, ids=["refused", "missing"])
@pytest.mark.parametrize("scheme", ["https", "http"])
def test_a_webhook_the_proxy_refuses_is_not_retried(servers, pki, monkeypatch, caplog, scheme, userinfo, said):
    """retries=3: the 407 to an https:// receiver's CONNECT was asked four times (0.5, 1, 2 s apart), the plain one
    once. Both once now, the warning naming the proxy and what was wrong with its credentials."""
    remote, proxy = servers(Remote, pki if scheme == "https" else None), servers(Proxy, "robot:right")
    source = _proxied(monkeypatch, proxy, userinfo, scheme)
    url = _url(scheme, remote, "/hook")
    context = client_context(url, str(pki["ca"]), None, None, names=TLS_NAMES) if scheme == "https" else None
    sender = WebhookSender(url, timeout_s=60, retries=3, context=context)
    with caplog.at_level(logging.INFO, "edgekv.webhooks"):
        assert not sender._deliver(_event())
    assert len(proxy.lines) == 1 and sender.attempts == 1 and remote.requests == []
    warning = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING][-1]
    assert f"the proxy http://127.0.0.1:{proxy.port} ({source}) refused" in warning and "HTTP 407" in warning
    assert said.replace("HTTPS_PROXY", source) in warning
    assert "wrong" not in warning and "robot" not in warning


def test_a_tunnel_the_proxy_s_policy_refuses_is_final_and_a_failing_proxy_is_retried(servers, pki, monkeypatch):
    """A 403 to a CONNECT (the proxy's policy: a host it does not let through) is what a 403 to a plain request
    already was, final; a 502 (the proxy could not reach the server) is still a fault worth another try."""
    remote = servers(Remote, pki)
    url = _url("https", remote, "/hook")
    context = client_context(url, str(pki["ca"]), None, None, names=TLS_NAMES)
    for status, tries in ((403, 1), (502, 2)):
        proxy = servers(Proxy, None, status)
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.port}")
        sender = WebhookSender(url, timeout_s=60, retries=1, context=context)
        monkeypatch.setattr("edgekv.apps.outputs.webhooks.BACKOFF_S", 0.01)
        assert not sender._deliver(_event())
        assert len(proxy.lines) == tries, status
    escalator = Escalator(EscalateSection(url=_url("https", remote, "/v1"), model="big", timeout_s=60,
                                          ca_file=str(pki["ca"]), proxy=f"http://127.0.0.1:{proxy.port}"),
                          done=lambda q: None)
    with pytest.raises(ConnectionError, match=f"through the proxy http://127.0.0.1:{proxy.port} .*502"):
        escalator.ask_remote("What is on the table?", [])


def test_a_webhook_whose_certificate_is_refused_is_not_retried(servers, pki, caplog):
    """A receiver whose certificate names another host (or comes from a CA not trusted) was asked again after 0.5,
    1, 2 s — the same certificate each time. Final now, the warning saying why."""
    remote, proxy = servers(Remote, pki), servers(Proxy)
    url = _url("https", remote, "/hook").replace("big.example", "other.example")
    context = client_context(url, str(pki["ca"]), None, None, names=TLS_NAMES)
    sender = WebhookSender(url, timeout_s=60, retries=3, context=context, proxy=f"http://127.0.0.1:{proxy.port}")
    with caplog.at_level(logging.INFO, "edgekv.webhooks"):
        assert not sender._deliver(_event())
    assert sender.attempts == 1 and remote.requests == []
    warning = [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING][-1]
    assert "certificate is refused" in warning and "other.example" in warning
