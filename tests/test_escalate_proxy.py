"""Escalation through an HTTP proxy (apps/outputs/escalate.py ``escalation_proxy``): a device on a network that
reaches the outside only through a proxy. A CONNECT proxy on loopback (threads) that resolves the names it is asked
for itself, in front of an HTTPS escalation server of a private CA made here: the tunnel carries TLS checked against
the server's own name, NO_PROXY sends a host direct, credentials reach the proxy and nothing else, and a proxy URL
that cannot be used is refused naming where it was set."""

from __future__ import annotations

import logging
import socketserver
import ssl
import threading

import pytest

from edgekv.apps.outputs.escalate import Escalator, escalation_proxy
from edgekv.apps.outputs.exchange import ProxyRefused
from edgekv.config import ConfigError, EdgeKVConfig, EscalateSection
from helpers_proxy import Proxy, Remote, make_pki, no_proxy_environment, servers  # noqa: F401 (fixtures)

pytest.importorskip("cryptography.x509", reason="cryptography is not installed (pip install 'edgekv[privacy]')")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("proxy-pki"))


def _escalator(url: str, **section) -> Escalator:
    return Escalator(EscalateSection(url=url, model="big", **{"timeout_s": 60, **section}), done=lambda q: None)


def test_https_goes_through_the_environment_s_proxy_with_its_credentials(servers, pki, monkeypatch, caplog):
    """The escalation made its own connection and ignored HTTPS_PROXY: on a network that reaches the outside only
    through a proxy, every escalation failed and the local answer stood. It now goes through a CONNECT tunnel, the
    credentials of the proxy's URL (percent-decoded) in Proxy-Authorization — and in no log line."""
    remote, proxy = servers(Remote, pki), servers(Proxy, "robot:p@ss word")
    monkeypatch.setenv("HTTPS_PROXY", f"http://robot:p%40ss%20word@127.0.0.1:{proxy.port}")
    with caplog.at_level(logging.DEBUG, "edgekv.escalate"):
        escalator = _escalator(f"https://big.example:{remote.port}/v1", ca_file=str(pki["ca"]))
        assert escalator.ask_remote("What is on the table?", [b"\xff\xd8jpeg"]) == ("a red cup", "big")
    assert [line.rpartition(" ")[0] for line in proxy.lines] == [f"CONNECT big.example:{remote.port}"]
    assert proxy.authorizations == ["robot:p@ss word"]
    (path, body), = remote.requests
    assert path == "/v1/chat/completions" and body["messages"][-1]["content"][0]["text"] == "What is on the table?"
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert f"127.0.0.1:{proxy.port}" in logged and "HTTPS_PROXY" in logged
    assert "p@ss" not in logged and "p%40ss" not in logged and "robot" not in logged


def test_the_tunnel_s_certificate_is_checked_against_the_server_s_own_name(servers, pki, monkeypatch):
    """The proxy sends other.example to the same server, whose certificate does not name it: refused, as a direct
    connection would be (the certificate is checked against the name in escalate.url, never the proxy's)."""
    remote, proxy = servers(Remote, pki), servers(Proxy)
    monkeypatch.setenv("https_proxy", f"127.0.0.1:{proxy.port}")  # no scheme: http://, as curl takes it
    escalator = _escalator(f"https://other.example:{remote.port}/v1", ca_file=str(pki["ca"]))
    with pytest.raises(ssl.SSLCertVerificationError, match="other.example"):
        escalator.ask_remote("What is on the table?", [])
    assert [line.rpartition(" ")[0] for line in proxy.lines] == [f"CONNECT other.example:{remote.port}"]
    assert remote.requests == []
    untrusted = _escalator(f"https://big.example:{remote.port}/v1")  # the system's CAs: not this private one
    with pytest.raises(ssl.SSLCertVerificationError):
        untrusted.ask_remote("What is on the table?", [])
    assert remote.requests == []


def test_plain_http_goes_to_the_proxy_as_an_absolute_url(servers, monkeypatch):
    remote, proxy = servers(Remote), servers(Proxy, "robot:secret")
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # not for http:// servers
    monkeypatch.setenv("HTTP_PROXY", f"http://robot:secret@127.0.0.1:{proxy.port}")
    escalator = _escalator(f"http://big.example:{remote.port}/v1")
    assert escalator.ask_remote("What is on the table?", []) == ("a red cup", "big")
    assert proxy.lines == [f"POST http://big.example:{remote.port}/v1/chat/completions HTTP/1.1"]
    assert proxy.authorizations == ["robot:secret"] and remote.requests[0][0] == "/v1/chat/completions"


@pytest.mark.parametrize("no_proxy", ["localhost", ".localhost", "example.org, localhost:{port}", "*",
                                      "127.0.0.0/8"])
def test_no_proxy_sends_a_named_host_direct(servers, pki, monkeypatch, no_proxy):
    remote, proxy = servers(Remote, pki), servers(Proxy)
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.port}")
    monkeypatch.setenv("NO_PROXY", no_proxy.format(port=remote.port))
    host = "127.0.0.1" if "/" in no_proxy else "localhost"
    escalator = _escalator(f"https://{host}:{remote.port}/v1", ca_file=str(pki["ca"]))
    assert escalator.ask_remote("What is on the table?", []) == ("a red cup", "big")
    assert proxy.lines == [] and len(remote.requests) == 1


def test_no_proxy_matching_rules():
    env = {"HTTPS_PROXY": "http://proxy.corp:3128"}
    assert str(escalation_proxy("https://big.example/v1", None, env)) == "http://proxy.corp:3128"
    for listed, url, bypassed in (("example", "https://big.example/v1", True),
                                  ("big.example", "https://notbig.example/v1", False),
                                  ("localhost:8443", "https://localhost:9443/v1", False),
                                  ("10.0.0.0/8", "https://10.1.2.3/v1", True),
                                  ("10.0.0.0/8", "https://11.1.2.3/v1", False),
                                  ("::1", "https://[::1]:8443/v1", True)):
        found = escalation_proxy(url, None, {**env, "no_proxy": listed})
        assert (found is None) is bypassed, (listed, url)
    assert escalation_proxy("https://big.example/v1", None, {"HTTP_PROXY": "http://p:1"}) is None  # http only
    assert escalation_proxy("https://big.example/v1", None, {"ALL_PROXY": "http://p:1"}).port == 1


def test_escalate_proxy_in_the_config_wins_over_the_environment(servers, pki, monkeypatch):
    remote, proxy = servers(Remote, pki), servers(Proxy)
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")  # nothing listens there
    url = f"https://big.example:{remote.port}/v1"
    configured = _escalator(url, ca_file=str(pki["ca"]), proxy=f"http://127.0.0.1:{proxy.port}")
    assert configured.proxy.source == "escalate.proxy"
    assert configured.ask_remote("What is on the table?", []) == ("a red cup", "big")
    assert [line.rpartition(" ")[0] for line in proxy.lines] == [f"CONNECT big.example:{remote.port}"]
    direct = _escalator(f"https://localhost:{remote.port}/v1", ca_file=str(pki["ca"]), proxy="direct")
    assert direct.proxy is None and direct.ask_remote("What is on the table?", [])[1] == "big"
    assert len(proxy.lines) == 1 and len(remote.requests) == 2


def test_a_proxy_that_refuses_is_named_without_its_credentials(servers, pki, monkeypatch):
    remote, proxy = servers(Remote, pki), servers(Proxy, "robot:right")
    monkeypatch.setenv("HTTPS_PROXY", f"http://robot:wrong@127.0.0.1:{proxy.port}")
    escalator = _escalator(f"https://big.example:{remote.port}/v1", ca_file=str(pki["ca"]))
    with pytest.raises(ProxyRefused) as caught:  # final: tests/test_proxy_refusal.py
        escalator.ask_remote("What is on the table?", [])
    message = str(caught.value)
    assert f"the proxy http://127.0.0.1:{proxy.port} (HTTPS_PROXY) refused" in message and "407" in message
    assert "wrong" not in message and "robot" not in message and remote.requests == []


@pytest.mark.parametrize("value, wrong", [("socks5://robot:secret@127.0.0.1:1080", "a socks5:// proxy"),
                                          ("https://robot:secret@proxy.corp:443", "a https:// proxy"),
                                          ("http://robot:secret@proxy.corp:99999", "a port that is not a number"),
                                          ("http://", "no host")])
def test_a_proxy_that_cannot_be_used_is_refused_naming_where_it_was_set(monkeypatch, value, wrong):
    """A socks5:// ALL_PROXY was no proxy at all before (a direct connection the network drops); now the escalator
    does not start, the variable named — and not its password."""
    monkeypatch.setenv("ALL_PROXY", value)
    with pytest.raises(ValueError, match="^ALL_PROXY: expected an http://") as caught:
        _escalator("https://big.example/v1")
    assert wrong in str(caught.value) and "secret" not in str(caught.value)
    with pytest.raises(ConfigError, match="escalate.proxy"):
        EdgeKVConfig().with_overrides(escalate={"url": "https://big.example/v1", "model": "big", "proxy": value})


def test_a_daemon_whose_proxy_variable_cannot_be_used_says_so_before_the_model_loads(tiny_checkpoint, tmp_path,
                                                                                        monkeypatch, capsys):
    pytest.importorskip("fastapi")
    from helpers_server import daemon_args, server_config

    from edgekv.apps.daemon.loop import Daemon

    monkeypatch.setenv("HTTPS_PROXY", "socks5://robot:secret@127.0.0.1:1080")
    config = server_config(tiny_checkpoint).with_overrides(escalate={"url": "https://big.example/v1", "model": "big"})
    with open(tmp_path / "out.txt", "w") as out:
        assert Daemon(config, daemon_args(), out=out).run() == 2
    err = capsys.readouterr().err
    assert "HTTPS_PROXY: expected an http://" in err and "a socks5:// proxy" in err and "secret" not in err
    assert "cache cap" not in (tmp_path / "out.txt").read_text()  # the model was never loaded (it was, to fail after)


def test_a_proxy_that_trickles_its_connect_reply_is_cut_at_the_timeout(monkeypatch):
    """escalate.timeout_s is the whole exchange, the proxy's CONNECT included: a proxy sending its status line a byte
    at a time (never silent for the 1 s timeout) held the escalation thread as long as it went on."""
    stop = threading.Event()

    class Trickle(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(65536)
            try:
                self.request.sendall(b"HTTP/1.1 200 ")
                while not stop.wait(0.2):
                    self.request.sendall(b"x")
            except OSError:  # the escalator hung up: what it is for
                pass

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{server.server_address[1]}")
    outcome = []

    def ask():
        try:
            _escalator("https://big.example/v1", timeout_s=1).ask_remote("What is on the table?", [])
        except Exception as exc:  # what the test asserts on
            outcome.append(exc)

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(120)
    cut = not thread.is_alive()  # before the proxy stops: its end would end the read anyway
    stop.set()
    server.shutdown()
    server.server_close()
    assert cut and outcome, "still reading the proxy's reply"
    assert isinstance(outcome[0], TimeoutError) and "escalate.timeout_s (1 s)" in str(outcome[0]), outcome
