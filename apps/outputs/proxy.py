"""The HTTP proxy an outgoing request goes through — escalations (apps/outputs/escalate.py) and alert webhooks
(apps/outputs/webhooks.py) alike: a device on a network that reaches the outside only through one.

The config's key (``escalate.proxy``, ``alerts.webhook_proxy``) when set: a URL, or ``"direct"`` for none. Else the
environment's, read as curl reads it: ``https_proxy`` / ``HTTPS_PROXY`` for an ``https://`` URL, ``http_proxy`` /
``HTTP_PROXY`` for ``http://``, then ``all_proxy`` / ``ALL_PROXY``; ``no_proxy`` / ``NO_PROXY`` sends a host it
names direct. Only ``http://`` proxies: an ``https://`` server is reached through its CONNECT tunnel, the
certificate checked against the server's own name (the proxy sees only where the tunnel goes); an ``http://`` one
gets the absolute URL. Another scheme (``socks5://``) is a ``ValueError`` naming where it was set, never a silent
direct connection. Credentials in the proxy's URL go in ``Proxy-Authorization`` (``Proxy.headers``) and nowhere
else: ``str(Proxy)`` leaves them out, and so does every error here (the value is never quoted).
"""

from __future__ import annotations

import base64
import dataclasses
import ipaddress
import os
import urllib.parse


@dataclasses.dataclass(frozen=True)
class Proxy:
    """An HTTP proxy; ``str()`` is its address without the credentials (what a log or a note may say)."""

    host: str
    port: int
    source: str  # where it was named: "escalate.proxy", "alerts.webhook_proxy", "HTTPS_PROXY", ...
    user: str | None = dataclasses.field(default=None, repr=False)
    password: str | None = dataclasses.field(default=None, repr=False)

    def __str__(self) -> str:
        return f"http://{netloc(self.host, self.port)}"

    def headers(self) -> dict[str, str]:
        if self.user is None:
            return {}
        pair = f"{self.user}:{self.password or ''}".encode()
        return {"Proxy-Authorization": "Basic " + base64.b64encode(pair).decode()}


def proxy_for(url: str, configured: str | None, key: str, environ: dict[str, str] | None = None) -> Proxy | None:
    """The proxy ``url`` is reached through: ``configured`` (the config's ``key``: a URL, or ``"direct"`` for none);
    when null, the environment's as curl reads it — ``https_proxy`` / ``HTTPS_PROXY`` for an ``https://`` server,
    ``http_proxy`` / ``HTTP_PROXY`` for ``http://``, then ``all_proxy`` / ``ALL_PROXY``; none for a host
    ``no_proxy`` / ``NO_PROXY`` names (a name and its subdomains, ``.suffix``, an address, a CIDR block, ``*``).
    Only ``http://`` proxies (CONNECT for an ``https://`` server): another scheme is a ``ValueError`` naming
    where it was set, never a silent direct connection."""
    environ = os.environ if environ is None else environ
    parts = urllib.parse.urlsplit(url)
    if configured is not None:
        return None if configured.strip().lower() == "direct" else _proxy(configured, key)
    names = [f"{parts.scheme}_proxy", f"{parts.scheme.upper()}_PROXY", "all_proxy", "ALL_PROXY"]
    name = next((name for name in names if environ.get(name, "").strip()), None)
    if name is None:
        return None
    no_proxy = environ.get("no_proxy", "").strip() or environ.get("NO_PROXY", "").strip()
    if _bypassed(parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80), no_proxy):
        return None
    return _proxy(environ[name].strip(), name)


def _proxy(value: str, source: str) -> Proxy:
    parts = urllib.parse.urlsplit(value if "://" in value else f"http://{value}")  # "proxy:3128", as curl takes it
    try:
        port = parts.port or 80
    except ValueError:
        port = None
    wrong = (f"a {parts.scheme}:// proxy" if parts.scheme.lower() != "http" else "no host" if not parts.hostname
             else "a port that is not a number from 0 to 65535" if port is None else None)
    if wrong is not None:  # the value itself is not quoted: it may hold a password
        raise ValueError(f"{source}: expected an http://[user:password@]host[:port] proxy, got {wrong} (an https:// "
                         "server is reached through an http:// proxy's CONNECT)")
    user = urllib.parse.unquote(parts.username) if parts.username is not None else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    return Proxy(parts.hostname, port, source, user, password)


def _bypassed(host: str, port: int, no_proxy: str) -> bool:
    """Whether ``NO_PROXY``'s list names ``host`` (or ``host:port``)."""
    host = host.lower().rstrip(".")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (item.strip().lower() for item in no_proxy.split(",")):
        if not entry:
            continue
        if entry == "*":
            return True
        name, _, only_port = entry.rpartition(":") if entry.count(":") == 1 else (entry, "", "")
        if only_port and only_port != str(port):
            continue
        name = name.strip("[]").lstrip(".").lstrip("*.").rstrip(".")
        if address is not None and "/" in name:
            try:
                if address in ipaddress.ip_network(name, strict=False):
                    return True
            except ValueError:
                pass
            continue
        if host == name or host.endswith("." + name):
            return True
    return False


def netloc(host: str, port: int | None) -> str:
    """``host:port`` as a URL writes it (an IPv6 address in brackets); ``host`` alone when ``port`` is None."""
    shown = f"[{host}]" if ":" in host else host
    return shown if port is None else f"{shown}:{port}"
