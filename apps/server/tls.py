"""HTTPS for the daemon's API, and the TLS of what talks to it and of what it talks to.

``server.tls_cert_file`` + ``server.tls_key_file`` (or ``tls_key_credential``, a systemd credential) serve the API,
the status page and ``/metrics`` over TLS 1.2 or later (Python's ``ssl``, OpenSSL underneath);
``server.tls_client_ca_file`` adds mutual TLS, a client certificate signed by that CA required in the handshake,
before a byte of a request is read. Without them the token, every question and every answer cross the network in
the clear: fine on 127.0.0.1, not on the shared Wi-Fi of a robot fleet or of a pair of glasses talking to a phone.

The handshake is the connection protocol's (``apps/server/guard.py``'s ``GuardedH11Protocol``, through asyncio's
``start_tls``), not uvicorn's: a connection is counted against ``server.max_connections`` and the per-client cap
as it is accepted, before its handshake, and the handshake has ``server.request_timeout_s`` to finish (asyncio's own
default is 60 s), so sockets opened and never greeted cannot pile up past the limits plain HTTP has. SIGHUP reads
the files again into the served context (``ApiServer.reload_tls``): a renewed certificate without a restart.

``check_server_tls`` is the start-up check (the daemon's preflight, before the model loads): each file read as the
server will read it, a problem named by its key (a missing file, a key that is not the certificate's, a key
encrypted with a passphrase the unattended daemon cannot type), and what the certificate says (its names and
expiry) for the start-up line and ``/metrics``. The device's clock is not the certificate's judge: a Jetson without
an RTC battery boots in the past, so an expiry is reported, never refused.

``client_context`` is the other side: ``edgekv ask`` / ``edgekv forget`` (``--ca-file`` trusts a private CA or a
self-signed certificate, ``--cert-file`` / ``--key-file`` present a client certificate; asked through the daemon's
own ``--config`` on the same machine, the daemon's certificate itself is the one trusted, pinned, so a certificate
made for the robot's network name still serves ``127.0.0.1``), and what the daemon reaches over HTTPS of a private
CA: the escalation server (``escalate.ca_file`` ...) and the alert webhooks (``alerts.webhook_ca_file`` ...).
"""

from __future__ import annotations

import datetime as dt
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CertificateInfo", "check_server_tls", "client_context", "server_context", "tls_failure"]

PEM_CERTIFICATE = "-----BEGIN CERTIFICATE-----"
log = logging.getLogger("edgekv.server")


@dataclass(frozen=True)
class CertificateInfo:
    """What the served certificate says, for the start-up line (``None`` where ``cryptography`` is not installed)."""

    names: tuple[str, ...] | None
    not_after: dt.datetime | None

    def describe(self, now: dt.datetime | None = None) -> str:
        parts = []
        if self.names:
            parts.append("for " + ", ".join(self.names[:4]) + (" ..." if len(self.names) > 4 else ""))
        if self.not_after is not None:
            now = now or dt.datetime.now(dt.timezone.utc)
            days = (self.not_after - now).total_seconds() / 86400
            when = self.not_after.strftime("%Y-%m-%d")
            parts.append(f"expired {when} by this device's clock" if days < 0 else f"valid until {when} "
                         f"({days:.0f} days)")
        return "; ".join(parts)


def _read(key: str, path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except FileNotFoundError:
        raise ValueError(f"server.{key}: {path}: no such file") from None
    except PermissionError:
        raise ValueError(f"server.{key}: {path}: not readable by this user") from None
    except IsADirectoryError:
        raise ValueError(f"server.{key}: {path} is a folder, not a PEM file") from None


def check_server_tls(server: Any) -> CertificateInfo | None:
    """None without HTTPS; else the served certificate's names and expiry, after loading the files exactly as the
    server will (``server_context``). ``ValueError`` naming the key of the file that is wrong, and how."""
    if server.tls_cert_file is None:
        return None
    server_context(server)
    if server.tls_key_credential is None:
        _warn_if_others_read(server.tls_key_file)
    return _certificate_info(_read("tls_cert_file", server.tls_cert_file))


def _warn_if_others_read(path: str) -> None:
    """Said, not refused (as ``privacy.key_file``'s): a key written with ``openssl ecparam -genkey > FILE`` or
    copied under the usual umask 022 is world-readable, and any local account could then impersonate the daemon
    to its clients and read their tokens and answers. A group's bits are left alone: Debian's ``ssl-cert`` group
    (keys 0640) is how a service user is given a key on purpose."""
    try:
        mode = Path(path).stat().st_mode & 0o777
    except OSError:
        return
    if mode & 0o007:
        log.warning("server.tls_key_file %s: the key is readable by every local account (mode %o): any of them can "
                    "impersonate this daemon over HTTPS; chmod 600 it (owned by the service's user)", path, mode)


def server_context(server: Any) -> ssl.SSLContext:
    """The TLS context the API serves with (TLS 1.2 or later; a client certificate required with
    ``tls_client_ca_file``). ``ValueError`` naming the key of the file that is wrong, and how."""
    cert, key = server.tls_cert_file, server.tls_key_path()
    key_name = "tls_key_credential" if server.tls_key_credential is not None else "tls_key_file"
    cert_text, key_text = _read("tls_cert_file", cert), _read(key_name, key)
    if PEM_CERTIFICATE not in cert_text:
        raise ValueError(f"server.tls_cert_file: {cert} holds no PEM certificate ({PEM_CERTIFICATE} ...)")
    if "PRIVATE KEY-----" not in key_text:
        raise ValueError(f"server.{key_name}: {key} holds no PEM private key")
    if "ENCRYPTED" in key_text:
        raise ValueError(f"server.{key_name}: {key} is encrypted with a passphrase, which a daemon started by "
                         f"systemd cannot type: give it the key unencrypted, readable by the daemon's user only")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if "KEY_VALUES_MISMATCH" in str(exc) or "key values mismatch" in str(exc):
            raise ValueError(f"server.{key_name}: {key} is not the private key of the certificate in "
                             f"server.tls_cert_file ({cert})") from None
        raise ValueError(f"server.tls_cert_file / tls_key_file: OpenSSL cannot use {cert} with {key} "
                         f"({exc.reason or exc})") from None
    if server.tls_client_ca_file is not None:
        ca = server.tls_client_ca_file
        if PEM_CERTIFICATE not in _read("tls_client_ca_file", ca):
            raise ValueError(f"server.tls_client_ca_file: {ca} holds no PEM certificate")
        try:
            context.load_verify_locations(cafile=ca)
        except ssl.SSLError as exc:
            raise ValueError(f"server.tls_client_ca_file: OpenSSL cannot read {ca} ({exc.reason or exc})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def _certificate_info(cert_text: str) -> CertificateInfo:
    try:
        from cryptography import x509
    except ImportError:
        return CertificateInfo(None, None)
    try:
        certificate = x509.load_pem_x509_certificate(cert_text.encode())
    except ValueError:
        return CertificateInfo(None, None)
    names: list[str] = []
    try:
        alternative = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [str(name.value) for name in alternative]
    except x509.ExtensionNotFound:
        names = [attribute.value for attribute in certificate.subject.get_attributes_for_oid(
            x509.oid.NameOID.COMMON_NAME)]
    return CertificateInfo(tuple(names) or None, certificate.not_valid_after_utc)


CLI_NAMES = ("--ca-file", "--cert-file", "--key-file")


def client_context(url: str, ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None,
                   pinned: str | None = None, names: tuple[str, str, str] = CLI_NAMES) -> ssl.SSLContext | None:
    """The TLS context to reach the server at ``url`` (None for ``http://``): the system's CAs, or ``ca_file``'s;
    ``pinned`` (the daemon's own certificate, read from its config on the same machine) trusted alone, its names
    not checked against the address; ``cert_file`` / ``key_file`` the client certificate of mutual TLS. Errors name
    the files by ``names`` (the CLI's options, or config keys: ``escalate.ca_file``, ...)."""
    if not url.lower().startswith("https://"):
        return None
    ca_name, cert_name, key_name = names
    for name, path in ((ca_name, ca_file), (cert_name, cert_file), (key_name, key_file)):
        if path is not None and not Path(path).is_file():
            raise ValueError(f"{name}: {path}: no such file")
    if (cert_file is None) != (key_file is None):
        raise ValueError(f"{cert_name} and {key_name}: a client certificate needs both")
    if pinned is not None and ca_file is None:
        context = ssl.create_default_context(cafile=pinned)
        context.check_hostname = False  # the one certificate trusted is the identity checked
        context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a leaf a CA signed, trusted by itself
    else:
        try:
            context = ssl.create_default_context(cafile=ca_file)
        except ssl.SSLError as exc:
            raise ValueError(f"{ca_name}: {ca_file} is not a PEM certificate OpenSSL can read ({exc.reason})") from None
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except ssl.SSLError as exc:
            raise ValueError(f"{cert_name} / {key_name}: OpenSSL cannot use {cert_file} with {key_file} "
                             f"({exc.reason or exc})") from None
    return context


def tls_failure(reason: object) -> str | None:
    """What a TLS failure reaching the daemon means, said with the option that fixes it; None for other failures."""
    if isinstance(reason, ssl.SSLCertVerificationError):
        return (f"its certificate is not trusted here ({reason.verify_message or reason}): give --ca-file with the "
                f"CA that signed it (or the certificate itself, when it signed itself)")
    text = str(reason)
    if isinstance(reason, ssl.SSLError) and "CERTIFICATE_REQUIRED" in text.upper().replace(" ", "_"):
        return "it asks for a client certificate (server.tls_client_ca_file): give --cert-file and --key-file"
    if isinstance(reason, ssl.SSLEOFError) or "EOF occurred in violation of protocol" in text:
        # TLS 1.3: a server that wants a client certificate finds none after the client's handshake is done, and
        # closes; the client reads the close as an EOF
        return ("it closed the TLS connection: does it require a client certificate (server.tls_client_ca_file)? "
                "give --cert-file and --key-file")
    if isinstance(reason, ssl.SSLError) and ("WRONG_VERSION_NUMBER" in text.upper() or "record layer" in text):
        return "it does not speak TLS here: is its address http:// (server.tls_cert_file not set)?"
    if isinstance(reason, ssl.SSLError):
        return f"the TLS handshake failed ({reason.reason or reason})"
    return None
