"""HTTPS for the daemon's API (server.tls_cert_file / tls_key_file / tls_client_ca_file, apps/server/tls.py): a real
daemon on the tiny checkpoint serving TLS with certificates made here (a private CA, a server certificate for
localhost / 127.0.0.1, client certificates of that CA and of another), reached by the standard library's HTTPS
client and by ``edgekv ask`` / ``edgekv forget`` as their users run them; plain HTTP refused on that port; the
status page's cookie Secure; and every wrong file refused at start, named by its key."""

from __future__ import annotations

import datetime as dt
import http.client
import ipaddress
import json
import socket
import ssl
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
x509 = pytest.importorskip("cryptography.x509", reason="cryptography is not installed (pip install 'edgekv[privacy]')")

from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402
from helpers_server import RunningDaemon, server_config  # noqa: E402

NOW = dt.datetime.now(dt.timezone.utc)


def _name(text: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, text)])


def _certificate(subject: str, key, issuer_name: str, issuer_key, *, ca: bool = False, server: bool = False,
                 days: int = 30) -> x509.Certificate:
    builder = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(_name(issuer_name))
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(NOW - dt.timedelta(days=1)).not_valid_after(NOW + dt.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write(folder: Path, name: str, certificate=None, key=None, password: bytes | None = None) -> Path:
    path = folder / name
    if certificate is not None:
        path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    else:
        encryption = (serialization.BestAvailableEncryption(password) if password
                      else serialization.NoEncryption())
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption))
    return path


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Path]:
    """A CA; a server certificate it signed (localhost, 127.0.0.1); a client certificate it signed; another CA's
    client certificate; and keys that do not belong (another key, an encrypted one)."""
    folder = tmp_path_factory.mktemp("pki")
    ca_key, other_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    server_key, client_key, stranger_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = _certificate("edgekv test CA", ca_key, "edgekv test CA", ca_key, ca=True)
    paths = {
        "ca": _write(folder, "ca.pem", ca),
        "server": _write(folder, "server.pem", _certificate("robot", server_key, "edgekv test CA", ca_key,
                                                            server=True, days=90)),
        "server_key": _write(folder, "server.key", key=server_key),
        "client": _write(folder, "client.pem", _certificate("operator", client_key, "edgekv test CA", ca_key)),
        "client_key": _write(folder, "client.key", key=client_key),
        "stranger": _write(folder, "stranger.pem", _certificate("stranger", stranger_key, "other CA", other_ca_key)),
        "stranger_key": _write(folder, "stranger.key", key=stranger_key),
        "other_ca": _write(folder, "other_ca.pem", _certificate("other CA", other_ca_key, "other CA", other_ca_key,
                                                                ca=True)),
        "wrong_key": _write(folder, "wrong.key", key=ec.generate_private_key(ec.SECP256R1())),
        "locked_key": _write(folder, "locked.key", key=server_key, password=b"passphrase"),
        "ca_key": _write(folder, "ca.key", key=ca_key),
    }
    return paths


# the handshake must end within server.request_timeout_s: server_config's 2 s is tight for a busy 2-core CI machine
HANDSHAKE_S = 20.0


def _tls(pki, **more) -> dict:
    return {"tls_cert_file": str(pki["server"]), "tls_key_file": str(pki["server_key"]),
            "request_timeout_s": HANDSHAKE_S, **more}


def _https(port: int, path: str, context: ssl.SSLContext, method: str = "GET", body=None, headers=None,
           source: str | None = None):
    """``source``: the client's own address (another loopback one, 127.0.0.2 ..., for another host)."""
    conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=60, context=context,
                                       source_address=(source, 0) if source else None)
    try:
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers={"Content-Type": "application/json", **(headers or {})})
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def _connect_from(host: str, port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(host, 0))
    sock.settimeout(10)
    return sock


def _ask(argv: list[str], capsys) -> tuple[int, str, str]:
    from edgekv.apps.cli import main

    code = main(["ask", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_api_serves_https_and_the_cli_reaches_it(tiny_checkpoint, tmp_path, pki, capsys):
    config = server_config(tiny_checkpoint, **_tls(pki), token="s3cret")
    config_file = tmp_path / "deploy.yaml"
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        port = run.port
        trusted = ssl.create_default_context(cafile=str(pki["ca"]))
        assert _https(port, "/healthz", trusted)[0] == 200
        status, _, _ = _https(port, "/v1/edgekv/status", trusted, headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        status, headers, _ = _https(port, "/v1/edgekv/login", trusted, "POST", {"token": "s3cret"})
        assert status == 204 and "; Secure" in headers["set-cookie"] and "HttpOnly" in headers["set-cookie"]
        with pytest.raises(ssl.SSLCertVerificationError):  # the system's CAs do not know this one
            _https(port, "/healthz", ssl.create_default_context())
        plain = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # plain HTTP on the TLS port: nothing
        with pytest.raises((ConnectionError, http.client.HTTPException, OSError)):
            plain.request("GET", "/healthz")
            plain.getresponse().read()
        plain.close()

        config_file.write_text(f"server: {{host: 127.0.0.1, port: {port}, token: s3cret, tls_cert_file: "
                               f"{json.dumps(str(pki['server']))}, "
                               f"tls_key_file: {json.dumps(str(pki['server_key']))}}}\n")
        code, out, err = _ask(["--config", str(config_file), "--max-new-tokens", "2", "--json", "What?"], capsys)
        assert code == 0 and json.loads(out)["choices"], err  # the daemon's own certificate, pinned: no --ca-file
        url = f"https://localhost:{port}"
        code, out, err = _ask(["--url", url, "--token-env", "NOPE_UNSET", "--max-new-tokens", "2", "Q?"], capsys)
        assert code == 2 and "certificate is not trusted here" in err and "--ca-file" in err
        code, out, err = _ask(["--url", url, "--ca-file", str(pki["ca"]), "--max-new-tokens", "2", "Q?"], capsys)
        assert code == 2 and "HTTP 401" in err  # TLS fine, the token was not given
        code, out, err = _ask(["--url", f"http://127.0.0.1:{port}", "--max-new-tokens", "2", "Q?"], capsys)
        assert code == 2 and "https://" in err
        status, _, metrics = _https(port, "/metrics", trusted, headers={"Authorization": "Bearer s3cret"})
        assert status == 200
        figures = {line.split()[0]: float(line.split()[1]) for line in metrics.decode().splitlines()
                   if line.startswith("edgekv_tls")}
        assert figures["edgekv_tls_handshakes_total"] >= 3 and figures["edgekv_tls_handshakes_failed_total"] >= 2
        expiry = x509.load_pem_x509_certificate(pki["server"].read_bytes()).not_valid_after_utc.timestamp()
        assert figures["edgekv_tls_certificate_not_after_seconds"] == expiry
    out_text = (tmp_path / "out.txt").read_text()
    assert f"HTTP API on https://127.0.0.1:{port}" in out_text
    assert "TLS: certificate for localhost, 127.0.0.1" in out_text
    assert "valid until" in out_text


def test_mutual_tls_takes_only_the_clients_its_ca_signed(tiny_checkpoint, tmp_path, pki, capsys, monkeypatch):
    from edgekv.apps.cli import main

    config = server_config(tiny_checkpoint, **_tls(pki, tls_client_ca_file=str(pki["ca"])))
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        url = f"https://127.0.0.1:{run.port}"
        anonymous = ssl.create_default_context(cafile=str(pki["ca"]))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _https(run.port, "/healthz", anonymous)
        stranger = ssl.create_default_context(cafile=str(pki["ca"]))
        stranger.load_cert_chain(str(pki["stranger"]), str(pki["stranger_key"]))
        with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
            _https(run.port, "/healthz", stranger)
        member = ssl.create_default_context(cafile=str(pki["ca"]))
        member.load_cert_chain(str(pki["client"]), str(pki["client_key"]))
        assert _https(run.port, "/healthz", member)[0] == 200

        code, _, err = _ask(["--url", url, "--ca-file", str(pki["ca"]), "--max-new-tokens", "2", "Q?"], capsys)
        assert code == 2 and "client certificate" in err and "--cert-file" in err
        code, out, err = _ask(["--url", url, "--ca-file", str(pki["ca"]), "--cert-file", str(pki["client"]),
                               "--key-file", str(pki["client_key"]), "--max-new-tokens", "2", "--json", "Q?"], capsys)
        assert code == 0 and json.loads(out)["choices"], err
        code, _, err = _ask(["--url", url, "--ca-file", str(pki["ca"]), "--cert-file", str(pki["client"]), "Q?"],
                            capsys)
        assert code == 2 and "--cert-file and --key-file" in err
        monkeypatch.delenv("EDGEKV_TOKEN", raising=False)
        code = main(["forget", "--url", url, "--last", "1", "--ca-file", str(pki["ca"]), "--cert-file",
                     str(pki["client"]), "--key-file", str(pki["client_key"]), "--json"])
        assert code == 0 and "removed" in capsys.readouterr().out
    assert "TLS, client certificates required" in (tmp_path / "out.txt").read_text()


@pytest.mark.parametrize("case, message", [
    ("missing", "server.tls_key_file: {dir}/none.key: no such file"),
    ("mismatch", "server.tls_key_file: {wrong_key} is not the private key of the certificate"),
    ("encrypted", "is encrypted with a passphrase"),
    ("not pem", "server.tls_cert_file: {server_key} holds no PEM certificate"),
    ("client ca", "server.tls_client_ca_file: {server_key} holds no PEM certificate"),
])
def test_wrong_tls_files_are_refused_at_start_by_key(tiny_checkpoint, tmp_path, pki, capsys, case, message):
    from edgekv.apps.daemon.loop import Daemon
    from helpers_server import daemon_args

    server = {"missing": _tls(pki, tls_key_file=str(tmp_path / "none.key")),
              "mismatch": _tls(pki, tls_key_file=str(pki["wrong_key"])),
              "encrypted": _tls(pki, tls_key_file=str(pki["locked_key"])),
              "not pem": _tls(pki, tls_cert_file=str(pki["server_key"])),
              "client ca": _tls(pki, tls_client_ca_file=str(pki["server_key"]))}[case]
    with open(tmp_path / "out.txt", "w") as out:
        assert Daemon(server_config(tiny_checkpoint, **server), daemon_args(), out=out).run() == 2
    err = capsys.readouterr().err
    expected = message.format(dir=tmp_path, wrong_key=pki["wrong_key"], server_key=pki["server_key"])
    assert expected in err and "Traceback" not in err, err


def test_tls_settings_are_checked_with_the_config():
    from edgekv.config import ConfigError, EdgeKVConfig

    with pytest.raises(ConfigError, match="server.tls_cert_file and server.tls_key_file: HTTPS needs both"):
        EdgeKVConfig().with_overrides(server={"tls_cert_file": "/c.pem"})
    with pytest.raises(ConfigError, match="tls_client_ca_file: client certificates need HTTPS"):
        EdgeKVConfig().with_overrides(server={"tls_client_ca_file": "/ca.pem"})


def test_certificate_words_and_client_contexts(pki, tmp_path):
    from edgekv.apps.server.tls import CertificateInfo, check_server_tls, client_context
    from edgekv.config import ServerSection

    info = check_server_tls(ServerSection(tls_cert_file=str(pki["server"]), tls_key_file=str(pki["server_key"])))
    assert info.names == ("localhost", "127.0.0.1")
    assert "valid until" in info.describe() and "(88 days)" in info.describe(NOW + dt.timedelta(days=2))
    assert "expired" in info.describe(NOW + dt.timedelta(days=400))  # said, never refused: the clock may be wrong
    assert check_server_tls(ServerSection()) is None
    assert CertificateInfo(None, None).describe() == ""
    assert client_context("http://127.0.0.1:8080") is None
    assert client_context("https://h", ca_file=str(pki["ca"])).check_hostname
    pinned = client_context("https://127.0.0.1:8080", pinned=str(pki["server"]))
    assert not pinned.check_hostname and pinned.verify_flags & ssl.VERIFY_X509_PARTIAL_CHAIN
    with pytest.raises(ValueError, match="--ca-file: .*no such file"):
        client_context("https://h", ca_file=str(tmp_path / "none.pem"))


def test_connections_that_never_greet_count_against_the_limits_and_time_out(tiny_checkpoint, tmp_path, pki):
    """The TLS slowloris: TCP connections that never send a ClientHello. Counted as they are accepted, as plain
    HTTP's are (server.max_connections: those past it are closed long before any deadline), and closed when the
    handshake has not ended within server.request_timeout_s (asyncio's own handshake timeout is a minute); a
    client that greets from another address is served throughout (the last slot is kept for an address that holds
    none: guard.ConnectionLimits.reserved)."""
    from helpers_server import connect, read_until_closed

    trusted = ssl.create_default_context(cafile=str(pki["ca"]))
    limited = server_config(tiny_checkpoint, **_tls(pki, request_timeout_s=60.0), max_connections=6,
                            max_connections_per_client=100)
    with RunningDaemon(limited, tmp_path / "limited.txt") as run:
        silent = [connect(run.port) for _ in range(5)]
        assert _https(run.port, "/healthz", trusted, source="127.0.0.2")[0] == 200  # the sixth slot is left for it
        last_slot = _connect_from("127.0.0.2", run.port)
        one_more = connect(run.port)  # the seventh: past max_connections
        data, waited = read_until_closed(one_more, 40.0)
        assert data == b"" and waited < 40.0  # closed as accepted: the handshake deadline is 60 s
        for sock in [*silent, last_slot, one_more]:
            sock.close()
    deadline = server_config(tiny_checkpoint, **_tls(pki, request_timeout_s=5.0))  # a greeting client has 5 s
    with RunningDaemon(deadline, tmp_path / "deadline.txt") as run:
        silent = [connect(run.port) for _ in range(3)]
        silent[1].sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # half a ClientHello
        for sock in silent:
            data, waited = read_until_closed(sock, 45.0)
            assert waited < 45.0  # ended by the server (a minute with asyncio's own timeout)
            sock.close()
        assert _https(run.port, "/healthz", trusted)[0] == 200


# ---------------------------------------------------------------------------------------------- outgoing HTTPS
def test_escalation_reaches_an_edgekv_serving_mutual_tls(tiny_checkpoint, tmp_path, pki):
    """escalate.ca_file / cert_file / key_file: the bigger edgekv serves HTTPS with client certificates required;
    the escalation carries the device's certificate (without it, the local answer stands, the failure said)."""
    from helpers_server import call

    remote_config = server_config(tiny_checkpoint, **_tls(pki, tls_client_ca_file=str(pki["ca"])),
                                  image_requests=True, max_request_bytes=4 * 2**20, served_model_name=["big-model"])
    with RunningDaemon(remote_config, tmp_path / "remote.txt") as remote:
        url = f"https://localhost:{remote.port}/v1"
        outcomes = {}
        for name, files in (("member", {"cert_file": str(pki["client"]), "key_file": str(pki["client_key"])}),
                            ("anonymous", {})):
            local_config = server_config(tiny_checkpoint).with_overrides(escalate={
                "url": url, "model": "big-model", "keyframes": 2, "timeout_s": 60, "max_tokens": 4,
                "ca_file": str(pki["ca"]), **files})
            with RunningDaemon(local_config, tmp_path / f"local-{name}.txt") as local:
                status, _, raw = call(local.port, "POST", "/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "What is here?"}], "max_tokens": 2, "escalate": True})
                assert status == 200, raw
                outcomes[name] = json.loads(raw)
        assert outcomes["member"]["edgekv"]["escalated"] is True and outcomes["member"]["model"] == "big-model"
        assert outcomes["anonymous"]["edgekv"]["escalated"] is False
        assert "escalation failed" in outcomes["anonymous"]["edgekv"]["escalation_note"]
        assert remote.daemon.image_session.counters.frame_pairs >= 1


def test_a_webhook_of_a_private_ca_gets_its_alerts(pki):
    """alerts.webhook_ca_file: an HTTPS receiver whose certificate a private CA signed; without the CA the
    delivery fails (certificate not trusted), with it the alert arrives."""
    import http.server
    import threading
    import time

    from edgekv.apps.outputs.alerts import AlertEvent
    from edgekv.apps.outputs.webhooks import WebhookSender
    from edgekv.apps.server.tls import client_context

    bodies = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(str(pki["server"]), str(pki["server_key"]))
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"https://localhost:{server.server_address[1]}/hook"
    event = AlertEvent("e1", "alert-1", "red", "Was there a red circle?", None, 0.9, 1.0, 2, 1.0, time.time(),
                       b"\xff\xd8jpeg", "pair 2")
    try:
        untrusting = WebhookSender(url, timeout_s=60, retries=0).start()
        trusting = WebhookSender(url, timeout_s=60, retries=0, context=client_context(
            url, str(pki["ca"]), names=("alerts.webhook_ca_file", "alerts.webhook_cert_file",
                                        "alerts.webhook_key_file"))).start()
        untrusting.offer(event)
        trusting.offer(event)
        deadline = time.monotonic() + 120
        while (untrusting.failed + trusting.sent < 2) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert untrusting.failed == 1 and untrusting.sent == 0
        assert trusting.sent == 1 and bodies[0]["question"] == "Was there a red circle?"
        untrusting.stop()
        trusting.stop()
    finally:
        server.shutdown()
        server.server_close()


def test_outgoing_tls_files_are_checked_with_the_config_and_at_start(tiny_checkpoint, tmp_path, pki, capsys):
    from edgekv.apps.daemon.loop import Daemon
    from edgekv.config import ConfigError, EdgeKVConfig
    from helpers_server import daemon_args

    with pytest.raises(ConfigError, match="escalate.cert_file and escalate.key_file: a client certificate needs"):
        EdgeKVConfig().with_overrides(escalate={"url": "https://big:8000/v1", "model": "m", "cert_file": "/c"})
    with pytest.raises(ConfigError, match="alerts.webhook_ca_file: TLS files need an https:// URL"):
        EdgeKVConfig().with_overrides(alerts={"webhooks": ["http://hooks.local/x"], "webhook_ca_file": "/ca.pem"})
    config = server_config(tiny_checkpoint).with_overrides(alerts={
        "webhooks": ["https://hooks.local/x"], "webhook_ca_file": str(tmp_path / "none.pem")})
    with open(tmp_path / "out.txt", "w") as out:
        assert Daemon(config, daemon_args(), out=out).run() == 2
    err = capsys.readouterr().err
    assert f"alerts.webhook_ca_file: {tmp_path / 'none.pem'}: no such file" in err, err


def test_https_answers_say_strict_transport_security_and_plain_ones_do_not(tiny_checkpoint, tmp_path, pki):
    """Before: no HSTS, so a browser that had used the daemon over HTTPS still tried http:// for its name first
    (where anyone on the network can answer). Every HTTPS answer now carries it — the health fast path, the
    page, the guard's own refusals, the routes — and no plain-HTTP answer does (RFC 6797: meaningless there)."""
    from helpers_server import call

    trusted = ssl.create_default_context(cafile=str(pki["ca"]))
    with RunningDaemon(server_config(tiny_checkpoint, **_tls(pki), token="s3cret"), tmp_path / "tls.txt") as run:
        answers = {"healthz": _https(run.port, "/healthz", trusted), "page": _https(run.port, "/", trusted),
                   "401": _https(run.port, "/v1/edgekv/status", trusted),
                   "status": _https(run.port, "/v1/edgekv/status", trusted, headers={"Authorization": "Bearer s3cret"})}
    assert [status for status, _, _ in answers.values()] == [200, 200, 401, 200]
    for name, (_, headers, _) in answers.items():
        hsts = headers.get("strict-transport-security", "")
        assert hsts.startswith("max-age=") and int(hsts.split("=")[1].split(";")[0]) >= 86400, (name, hsts)
    with RunningDaemon(server_config(tiny_checkpoint, token="s3cret"), tmp_path / "plain.txt") as run:
        for path in ("/healthz", "/", "/v1/edgekv/status"):
            assert "strict-transport-security" not in call(run.port, "GET", path)[1], path


def test_the_status_page_over_https_in_a_real_browser(tiny_checkpoint, tmp_path, pki):
    """Chromium (Debian's, through Playwright) on https://localhost: the login sets a Secure cookie, and the page's
    figures and its <img> of the frame load over TLS with it."""
    import shutil

    from helpers_server import poll

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no chromium (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright not installed (pip install playwright)")

    config = server_config(tiny_checkpoint, **_tls(pki), token="page-token-7")
    with RunningDaemon(config, tmp_path / "out.txt") as run, sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu",
                                                                     "--no-first-run", "--disable-quic"])
        try:
            context = browser.new_context(ignore_https_errors=True)  # the test CA is not the browser's
            page = context.new_page()
            page.goto(f"https://localhost:{run.port}/")
            page.fill("#token", "page-token-7")
            with page.expect_navigation():
                page.click("#signin")
            poll(page, "document.querySelector('#figures')?.textContent.includes('cache')")
            poll(page, "document.querySelector('#frame').naturalWidth > 0")
            cookie = {c["name"]: c for c in context.cookies()}["edgekv_session"]
            assert cookie["secure"] and cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        finally:
            browser.close()


def test_sighup_serves_a_renewed_certificate_and_keeps_the_old_when_the_new_is_bad(tiny_checkpoint, tmp_path, pki):
    """A certificate renewed in place (a private CA's, Let's Encrypt's every 60-90 days): SIGHUP reads it again and
    new connections get it, no restart; a renewal that does not load (a half-written file) leaves the served one,
    said why."""
    import shutil
    import time

    ca_key = serialization.load_pem_private_key(pki["ca_key"].read_bytes(), password=None)
    cert, key = tmp_path / "robot.pem", tmp_path / "robot.key"
    shutil.copy(pki["server"], cert)
    shutil.copy(pki["server_key"], key)
    trusted = ssl.create_default_context(cafile=str(pki["ca"]))

    def served_serial(port: int) -> int:
        with socket.create_connection(("127.0.0.1", port), timeout=60) as raw, \
                trusted.wrap_socket(raw, server_hostname="localhost") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number

    old_serial = x509.load_pem_x509_certificate(cert.read_bytes()).serial_number
    new_key = ec.generate_private_key(ec.SECP256R1())
    renewed = _certificate("robot", new_key, "edgekv test CA", ca_key, server=True, days=365)
    config = server_config(tiny_checkpoint, tls_cert_file=str(cert), tls_key_file=str(key),
                           request_timeout_s=HANDSHAKE_S)
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        assert served_serial(run.port) == old_serial
        _write(tmp_path, "robot.pem", renewed)
        _write(tmp_path, "robot.key", key=new_key)
        run.daemon.stop.hangup.set()  # what the SIGHUP handler does
        deadline = time.monotonic() + 60
        while served_serial(run.port) != renewed.serial_number and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served_serial(run.port) == renewed.serial_number
        cert.write_text("-----BEGIN CERTIFICATE-----\nhalf a file")  # a renewal caught mid-write
        run.daemon.stop.hangup.set()
        out = tmp_path / "out.txt"
        while "did not load" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert served_serial(run.port) == renewed.serial_number
    text = (tmp_path / "out.txt").read_text()
    assert "SIGHUP: TLS certificate read again: for localhost, 127.0.0.1; valid until" in text
    assert "SIGHUP: the TLS files did not load" in text and "still serving the certificate loaded before" in text


def test_sighup_drops_a_client_ca_taken_out_of_the_file(tiny_checkpoint, tmp_path, pki):
    """Mutual TLS trusting two CAs; one is taken out of tls_client_ca_file (a lost robot's, a contractor's) and
    SIGHUP sent: its clients are refused from the next connection on, the other CA's still served, and a connection
    opened before the reload keeps being served. (Loading the file again into the served context would have kept the
    removed CA: OpenSSL adds trust anchors and never drops them.)"""
    import time

    bundle = tmp_path / "clients-ca.pem"
    bundle.write_bytes(pki["ca"].read_bytes() + pki["other_ca"].read_bytes())

    def client(name: str) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(pki["ca"]))
        context.load_cert_chain(str(pki[name]), str(pki[f"{name}_key"]))
        return context

    def served(name: str) -> bool:
        try:
            return _https(run.port, "/healthz", client(name))[0] == 200
        except (ssl.SSLError, ConnectionError, OSError):
            return False

    config = server_config(tiny_checkpoint, **_tls(pki, tls_client_ca_file=str(bundle)))
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        assert served("client") and served("stranger")
        kept = http.client.HTTPSConnection("127.0.0.1", run.port, timeout=60, context=client("stranger"))
        kept.request("GET", "/healthz")
        assert kept.getresponse().read() and kept.sock is not None
        bundle.write_bytes(pki["ca"].read_bytes())  # the other CA taken out
        run.daemon.stop.hangup.set()  # what the SIGHUP handler does
        out, deadline = tmp_path / "out.txt", time.monotonic() + 60
        while "TLS certificate read again" not in out.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "TLS certificate read again" in out.read_text()
        assert not served("stranger")
        assert served("client")
        kept.request("GET", "/healthz")  # the same TLS connection, opened under the old context
        response = kept.getresponse()
        assert response.status == 200 and json.loads(response.read())
        kept.close()


def test_the_key_as_a_systemd_credential(tiny_checkpoint, tmp_path, pki, monkeypatch, capsys):
    """server.tls_key_credential: the key systemd hands over under $CREDENTIALS_DIRECTORY (LoadCredentialEncrypted=
    keeps it sealed on the flash); a daemon started without it is refused, naming the key."""
    import shutil

    from edgekv.apps.daemon.loop import Daemon
    from edgekv.config import ConfigError, EdgeKVConfig
    from helpers_server import daemon_args

    credentials = tmp_path / "credentials"
    credentials.mkdir()
    shutil.copy(pki["server_key"], credentials / "edgekv-tls.key")
    config = server_config(tiny_checkpoint, tls_cert_file=str(pki["server"]), tls_key_credential="edgekv-tls.key",
                           request_timeout_s=HANDSHAKE_S)
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    with open(tmp_path / "refused.txt", "w") as out:
        assert Daemon(config, daemon_args(), out=out).run() == 2
    assert "server.tls_key_credential edgekv-tls.key: no $CREDENTIALS_DIRECTORY" in capsys.readouterr().err
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(credentials))
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        assert _https(run.port, "/healthz", ssl.create_default_context(cafile=str(pki["ca"])))[0] == 200
    with pytest.raises(ConfigError, match="give the key one way"):
        EdgeKVConfig().with_overrides(server={"tls_cert_file": "/c", "tls_key_file": "/k", "tls_key_credential": "k"})
    with pytest.raises(ConfigError, match="a credential's name"):
        EdgeKVConfig().with_overrides(server={"tls_cert_file": "/c", "tls_key_credential": "/etc/k"})
