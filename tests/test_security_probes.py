"""What an attacker on the network, on the device or in the wearer's browser tried against the running daemon: each
test is one probe that got through before its fix.

* ``X-Forwarded-For`` sent from 127.0.0.1 replaced the client's address (uvicorn trusts it from there by default),
  so a process on the device — or anyone behind a TCP forwarder (socat, stunnel, an SSH tunnel) that passes the
  headers on — guessed the token without limit: a fresh ``server.login_attempts_per_minute`` budget per forged
  address, for the bearer header and the login form alike;
* a world-readable ``server.tls_key_file`` was served without a word (a world-readable ``privacy.key_file`` is
  warned of).
"""

from __future__ import annotations

import pytest

from helpers_server import RunningDaemon, call, server_config

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

TOKEN = "s3cret-token"


def test_a_forged_forwarded_for_does_not_buy_more_token_guesses(tiny_checkpoint, tmp_path):
    """Before: six wrong bearer tokens and six wrong logins, each from another forged ``X-Forwarded-For``, were
    twelve 401s. One guess a minute (a bucket of one, refilled after 60 s): every guess after the first is 429
    whatever address the header names."""
    config = server_config(tiny_checkpoint, token=TOKEN, login_attempts_per_minute=1)
    with RunningDaemon(config, tmp_path / "out.txt", pairs=0) as running:
        statuses = [call(running.port, "GET", "/v1/models", headers={
            "Authorization": f"Bearer guess-{i}", "X-Forwarded-For": f"10.0.0.{i + 1}"})[0] for i in range(6)]
        statuses += [call(running.port, "POST", "/v1/edgekv/login", {"token": f"guess-{i}"},
                          headers={"X-Forwarded-For": f"10.0.1.{i + 1}"})[0] for i in range(6)]
        assert statuses == [401] + [429] * 11, statuses


def _self_signed(folder) -> tuple[str, str]:
    import datetime as dt

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "robot")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now - dt.timedelta(days=1)).not_valid_after(now + dt.timedelta(days=30))
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "server.pem", folder / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


@pytest.mark.parametrize("mode, warned", [(0o644, True), (0o604, True), (0o640, False), (0o600, False)],
                         ids=["0644", "0604", "0640", "0600"])
def test_a_tls_key_every_account_can_read_is_warned_of(tmp_path, caplog, mode, warned):
    """Before: a world-readable ``server.tls_key_file`` (``openssl ecparam -genkey > server.key`` under umask 022 is
    0644) was served without a word, though the README asks for a key only the daemon's user reads and a world-
    readable ``privacy.key_file`` is warned of."""
    pytest.importorskip("cryptography")
    import logging
    import os

    from edgekv.apps.server.tls import check_server_tls
    from edgekv.config import EdgeKVConfig

    cert, key = _self_signed(tmp_path)
    os.chmod(key, mode)
    server = EdgeKVConfig().with_overrides(server={"tls_cert_file": cert, "tls_key_file": key}).server
    with caplog.at_level(logging.WARNING, logger="edgekv.server"):
        assert check_server_tls(server) is not None
    said = [r.getMessage() for r in caplog.records if "tls_key_file" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert key in said[0] and oct(mode)[2:] in said[0] and "chmod 600" in said[0]


def test_the_archive_and_the_jetson_service_keep_the_memory_to_the_daemons_user(tmp_path):
    """Without a privacy key the memory is in the clear: under the usual umask 022 the archive's segments came out
    0644 (created with that mode explicitly) and the state folders 0755, readable by every local account."""
    import os
    import stat
    from pathlib import Path

    from helpers_archive import SHAPE, fill

    from edgekv.archive.store import FrameArchive

    old = os.umask(0o022)
    try:
        archive = FrameArchive(tmp_path, SHAPE, max_bytes=1 << 20, segment_bytes=16 << 10)
        fill(archive, range(3))
        archive.close()
    finally:
        os.umask(old)
    segments = list(tmp_path.glob("seg-*.ekva"))
    assert segments and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in segments)
    jetson = Path(__file__).resolve().parents[1] / "jetson"
    unit = (jetson / "edgekv-camera.service").read_text()
    directives = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert directives["UMask"] == "0077" and directives["StateDirectoryMode"] == "0700"
    assert "install -d -o edgekv -g edgekv -m 0700 /var/lib/edgekv /var/lib/edgekv/archive" in (
        jetson / "install.sh").read_text()


def test_the_attempt_table_stays_within_its_bound_when_every_address_is_spending():
    """Only full buckets were dropped at ``max_clients``: a guesser rotating through networks (an IPv6 /48 holds
    2**16 /64s, each its own budget: ``budget_key``) kept every bucket spent, so the table grew past its bound, rebuilt
    whole at each new one. Now the longest idle go; the networks spending now are still limited."""
    from edgekv.apps.server.guard import AttemptLimiter

    now = [1000.0]
    limiter = AttemptLimiter(per_minute=1, burst=1, clock=lambda: now[0], max_clients=64)
    for i in range(5000):
        now[0] += 0.001
        assert limiter.allow(f"2001:db8:0:{i:x}::1")  # each /64's first guess
        assert len(limiter._buckets) <= 64
    assert not limiter.allow("2001:db8:0:1387::2")  # the last /64: its spent bucket was kept (0x1387 = 4999)
