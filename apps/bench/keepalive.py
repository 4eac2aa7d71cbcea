"""``edgekv bench keepalive``: what a kept-alive HTTP connection costs, against a fresh one per request.

A daemon runs in a child process (``edgekv bench api``'s, on the shipped toy by default, paced like a camera).
Then ``--requests`` ``GET /healthz`` and ``--chats`` chat completions go over one kept-alive connection, and
as many each on a fresh connection, alternating so both see the same load. Reported: median and p90 of each,
and the chat's kept-alive overhead (kept-alive median - fresh median). The targets of issue 25 (``/healthz``
median ≤ 2 ms on one connection, overhead ≤ 2 ms) are printed beside the figures, not asserted.

Why it matters: the server once listened on a socket made by hand with protocol 0, and asyncio sets
``TCP_NODELAY`` only on sockets whose protocol is TCP: every request after the first on a connection then
waited for the client's delayed ACK (~40 ms on Linux).

``--tls``: the same over HTTPS (``server.tls_cert_file``, a throwaway self-signed ECDSA P-256 certificate made for
the run): a fresh connection then pays a TLS handshake, what a page poller or a scraper that opens a connection per
request costs the device.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import multiprocessing
import os
import ssl
import statistics
import tempfile
import time
from pathlib import Path

from edgekv.apps.bench.common import daemon_port, provenance, serve_daemon, write_figures

HEALTHZ_TARGET_MS = 2.0
OVERHEAD_TARGET_MS = 2.0


def add_keepalive_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:toy", help="checkpoint dir or builtin:toy")
    parser.add_argument("--requests", type=int, default=200, help="/healthz requests per kind of connection")
    parser.add_argument("--chats", type=int, default=20, help="chat completions per kind of connection")
    parser.add_argument("--answer-tokens", type=int, default=2, help="max_tokens of each chat")
    parser.add_argument("--tls", action="store_true",
                        help="over HTTPS (a self-signed certificate made for the run; needs the cryptography package)")
    parser.add_argument("--json", default="bench-keepalive.json")
    parser.add_argument("--plot", default="bench-keepalive.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_keepalive)


def _timed(conn: http.client.HTTPConnection, method: str, path: str, body: dict | None = None) -> float:
    data = json.dumps(body).encode() if body is not None else None
    started = time.perf_counter()
    conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    response = conn.getresponse()
    response.read()
    if response.status != 200:
        raise SystemExit(f"edgekv bench keepalive: {method} {path} answered {response.status}")
    return (time.perf_counter() - started) * 1e3


def _connect(port: int, context: ssl.SSLContext | None) -> http.client.HTTPConnection:
    if context is not None:
        return http.client.HTTPSConnection("127.0.0.1", port, timeout=120, context=context)
    return http.client.HTTPConnection("127.0.0.1", port, timeout=120)


def _fresh(port: int, method: str, path: str, body: dict | None = None, context: ssl.SSLContext | None = None) -> float:
    """One request on a new connection, its connect (and TLS handshake) timed with it."""
    conn = _connect(port, context)
    try:
        return _timed(conn, method, path, body)
    finally:
        conn.close()


def self_signed(folder: Path) -> tuple[Path, Path]:
    """A throwaway ECDSA P-256 certificate for 127.0.0.1 / localhost, valid a day, and its key (PEM files)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "edgekv bench")])
    now = dt.datetime.now(dt.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                   .not_valid_after(now + dt.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(
                       ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "bench.pem", folder / "bench.key"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def _summary(values: list[float]) -> dict:
    ordered = sorted(values)  # p90 by nearest rank: int(0.9 * (n - 1)) was the minimum for n = 2, under the median
    return {"n": len(values), "median_ms": statistics.median(values),
            "p90_ms": ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)], "min_ms": ordered[0], "max_ms": ordered[-1]}


def measure(port: int, requests: int, chats: int, answer_tokens: int, context: ssl.SSLContext | None = None) -> dict:
    kept = _connect(port, context)
    samples: dict[str, list[float]] = {"healthz_kept": [], "healthz_fresh": [], "chat_kept": [], "chat_fresh": []}
    try:
        chat = {"messages": [{"role": "user", "content": "What color was the circle?"}], "max_tokens": answer_tokens}
        _timed(kept, "GET", "/healthz")  # the connection is open before anything is timed
        version = kept.sock.version() if context is not None else None  # the TLS version negotiated
        for _ in range(requests):
            samples["healthz_kept"].append(_timed(kept, "GET", "/healthz"))
            samples["healthz_fresh"].append(_fresh(port, "GET", "/healthz", context=context))
        for _ in range(chats):
            samples["chat_kept"].append(_timed(kept, "POST", "/v1/chat/completions", chat))
            samples["chat_fresh"].append(_fresh(port, "POST", "/v1/chat/completions", chat, context))
    finally:
        kept.close()
    result = {name: _summary(values) for name, values in samples.items()}
    result["chat_keepalive_overhead_ms"] = result["chat_kept"]["median_ms"] - result["chat_fresh"]["median_ms"]
    result["tls_version"] = version
    result["samples"] = samples
    return result


def run_keepalive(args: argparse.Namespace) -> int:
    scratch = Path(tempfile.mkdtemp(prefix="edgekv-bench-keepalive-"))
    log_path = scratch / "daemon.log"
    tls, tls_context = {}, None
    if args.tls:
        cert, key = self_signed(scratch)
        tls = {"tls_cert_file": str(cert), "tls_key_file": str(key)}
        tls_context = ssl.create_default_context(cafile=str(cert))
    sections = {
        "model": {"path": args.model, "dtype": "fp32", "device": "cpu"},
        "video": {"source": "synthetic:events?size=112x112&fps=2&frames=10000000&seed=2", "fps": 2.0,
                  "resolution": [112, 112]},
        "cache": {"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        "server": {"port": 0, "keep_alive_s": 60.0, "max_new_tokens": max(args.answer_tokens, 1), **tls},
        "generation": {"max_new_tokens": args.answer_tokens},
        "monitor": {"interval_s": 1.0, "backend": "cpu"},
    }
    context = multiprocessing.get_context("spawn")
    port_queue = context.Queue()
    child = context.Process(target=serve_daemon, args=(sections, str(log_path), port_queue))
    child.start()
    try:
        port = daemon_port(child, port_queue)
        if port is None:
            raise SystemExit(f"edgekv bench keepalive: the daemon did not start; see {log_path}")
        result = measure(port, args.requests, args.chats, args.answer_tokens, tls_context)
    finally:
        child.terminate()
        child.join(60)
        if child.is_alive():
            child.kill()
    result.update(provenance=provenance(), daemon_log=str(log_path), load_average_after=list(os.getloadavg()),
                  tls=bool(args.tls),
                  targets={"healthz_kept_median_ms": HEALTHZ_TARGET_MS, "chat_overhead_ms": OVERHEAD_TARGET_MS})
    h, c = result["healthz_kept"], result["chat_keepalive_overhead_ms"]
    over = f"over {result['tls_version']} (ECDSA P-256): " if result.get("tls_version") else ""
    print(f"{over}/healthz on one kept-alive connection: median {h['median_ms']:.2f} ms (p90 {h['p90_ms']:.2f}); "
          f"fresh connections {result['healthz_fresh']['median_ms']:.2f} ms  [target <= {HEALTHZ_TARGET_MS:g} ms]")
    print(f"chat: kept-alive median {result['chat_kept']['median_ms']:.1f} ms, fresh "
          f"{result['chat_fresh']['median_ms']:.1f} ms: overhead {c:+.1f} ms  [target <= {OVERHEAD_TARGET_MS:g} ms]")
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, kind in zip(axes, ("healthz", "chat")):
        data = [result["samples"][f"{kind}_kept"], result["samples"][f"{kind}_fresh"]]
        ax.boxplot(data, tick_labels=["kept-alive", "fresh"], showfliers=False)
        ax.set_title(f"{'GET /healthz' if kind == 'healthz' else 'chat completion'}")
        ax.set_ylabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
