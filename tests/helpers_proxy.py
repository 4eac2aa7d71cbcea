"""An HTTP proxy on loopback and what stands behind it, for the tests of outgoing requests through a proxy
(escalations: tests/test_escalate_proxy.py; alert webhooks: tests/test_webhook_proxy.py; the rules:
apps/outputs/proxy.py): a CONNECT and absolute-URL proxy that resolves every name itself, a private CA with a
server certificate for big.example, and a JSON server (HTTPS with that certificate) that keeps what it was sent."""

from __future__ import annotations

import pytest

import base64
import datetime as dt
import http.server
import ipaddress
import json
import select
import socket
import socketserver
import ssl
import threading
import urllib.parse
from pathlib import Path

CHAT = json.dumps({"model": "big", "choices": [{"message": {"role": "assistant", "content": "a red cup"}}]}).encode()
PROXY_VARIABLES = ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy",
                   "NO_PROXY")


def make_pki(folder: Path) -> dict[str, Path]:
    """A private CA (``ca``) and a server certificate it signed for big.example, localhost and 127.0.0.1 (``server``,
    ``server_key``), PEM files in ``folder``. Needs ``cryptography`` (the caller skips without it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())

    def certificate(subject: str, key, *, ca: bool) -> x509.Certificate:
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        issuer = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "proxy test CA")])
        builder = (x509.CertificateBuilder().subject_name(name).issuer_name(issuer).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=1))
                   .not_valid_after(now + dt.timedelta(days=30))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("big.example"), x509.DNSName("localhost"),
                 x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    paths = {"ca": folder / "ca.pem", "server": folder / "server.pem", "server_key": folder / "server.key"}
    paths["ca"].write_bytes(certificate("proxy test CA", ca_key, ca=True).public_bytes(serialization.Encoding.PEM))
    paths["server"].write_bytes(certificate("big", server_key, ca=False).public_bytes(serialization.Encoding.PEM))
    paths["server_key"].write_bytes(server_key.private_bytes(serialization.Encoding.PEM,
                                                             serialization.PrivateFormat.PKCS8,
                                                             serialization.NoEncryption()))
    return paths


class Remote:
    """A JSON server on 127.0.0.1 (HTTPS when given ``pki``) answering every POST 200 with ``reply`` (a chat
    completion unless told); keeps each request's path and JSON body in ``requests``, its headers (names in lower
    case) in ``headers``."""

    def __init__(self, pki: dict[str, Path] | None = None, reply: bytes = CHAT) -> None:
        self.requests: list[tuple[str, dict]] = []
        self.headers: list[dict[str, str]] = []
        self.arrived = threading.Semaphore(0)  # one release per request received
        remote = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                remote.requests.append((self.path, body))
                remote.headers.append({name.lower(): value for name, value in self.headers.items()})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                remote.arrived.release()

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if pki is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(pki["server"]), str(pki["server_key"]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Proxy:
    """An HTTP proxy on 127.0.0.1: CONNECT tunnels and absolute-URL requests, every name resolved to 127.0.0.1 (the
    client never resolves the server's name itself, as behind a real proxy). Keeps each request line and the
    credentials it came with; ``credentials``: what it requires (407 otherwise); ``refuse``: a status it answers
    every request with instead (a policy's 403)."""

    def __init__(self, credentials: str | None = None, refuse: int | None = None) -> None:
        self.lines: list[str] = []
        self.authorizations: list[str | None] = []
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self):
                head = b""
                while b"\r\n\r\n" not in head:
                    data = self.request.recv(65536)
                    if not data:
                        return
                    head += data
                head, _, rest = head.partition(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                headers = {k.strip().lower(): v.strip() for k, _, v in (f.partition(":") for f in fields)}
                authorization = headers.get("proxy-authorization")
                proxy.lines.append(line)
                proxy.authorizations.append(base64.b64decode(authorization.split()[1]).decode()
                                            if authorization else None)
                if credentials is not None and proxy.authorizations[-1] != credentials:
                    self.request.sendall(b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                                         b"Proxy-Authenticate: Basic realm=\"t\"\r\nContent-Length: 0\r\n\r\n")
                    return
                if refuse is not None:
                    self.request.sendall(b"HTTP/1.1 %d Refused\r\nContent-Length: 0\r\n\r\n" % refuse)
                    return
                method, target, version = line.split(" ")
                if method == "CONNECT":
                    upstream = socket.create_connection(("127.0.0.1", int(target.rpartition(":")[2])), timeout=60)
                    self.request.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                else:  # an absolute URL: forwarded in origin form, without the proxy's own header
                    url = urllib.parse.urlsplit(target)
                    upstream = socket.create_connection(("127.0.0.1", url.port or 80), timeout=60)
                    kept = [f for f in fields if not f.lower().startswith("proxy-authorization")]
                    upstream.sendall("\r\n".join([f"{method} {url.path} {version}", *kept]).encode("latin-1")
                                     + b"\r\n\r\n" + rest)
                with upstream:
                    _relay(self.request, upstream)

        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _relay(one: socket.socket, other: socket.socket) -> None:
    """Bytes both ways until either side closes (or 300 s of silence)."""
    while True:
        readable, _, _ = select.select([one, other], [], [], 300)
        if not readable:
            return
        for sock in readable:
            data = sock.recv(65536)
            if not data:
                return
            (other if sock is one else one).sendall(data)


@pytest.fixture(autouse=True)
def no_proxy_environment(monkeypatch):
    """Each test sets the proxy variables it means; none of the machine's (autouse where imported)."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def servers():
    """``servers(Remote, pki)``, ``servers(Proxy, "user:password")``: each started, all closed after the test."""
    made = []

    def make(kind, *args):
        made.append(kind(*args))
        return made[-1]

    yield make
    for server in made:
        server.close()
