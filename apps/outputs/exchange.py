"""One HTTP POST over a connection of its own, the whole exchange within one deadline — escalations
(apps/outputs/escalate.py, ``escalate.timeout_s``) and alert webhooks (apps/outputs/webhooks.py,
``alerts.webhook_timeout_s``) alike.

The deadline covers connecting, a proxy's CONNECT, sending, the server thinking and its reply: a timer shuts the
socket down when it passes (or ``abort`` does, at a stop), which ends a read blocked in any thread. A per-read timeout
alone (urllib's, http.client's) let a server or a proxy trickling a byte every few seconds hold the sending thread —
and every question or alert queued behind it — for as long as it went on. Through a proxy by the rules of
apps/outputs/proxy.py: an ``https://`` server through a CONNECT tunnel, its certificate checked against its own name;
``http://`` as an absolute URL to the proxy. No redirect is followed (the caller gets the 3xx and its Location).

A proxy that refuses (``ProxyRefused``) is final and said the same way whichever the scheme: a 407 to the CONNECT of an
``https://`` server was an ``OSError`` (retried by the webhooks as a network fault, the proxy asked again and again with
the same credentials), while the same 407 to an ``http://`` request was the server's status (final). A 407 is a
configuration error — the credentials in the proxy's URL are missing or wrong — and now fails as one, naming the
proxy (never its credentials) and where it was set.
"""

from __future__ import annotations

import email.utils
import http.client
import re
import time
import socket
import ssl
import threading
import urllib.parse

from edgekv.apps.outputs.proxy import Proxy, netloc


class BadReply(ValueError):
    """The server's answer was not what was asked for (not a chat completion with text; more than the bytes read);
    ``summary``: the same without the server's words (what a log may say)."""

    def __init__(self, message: str, summary: str) -> None:
        super().__init__(message)
        self.summary = summary


class ProxyRefused(RuntimeError):
    """The proxy refused the request (a 407: its credentials are missing or wrong; another 4xx of a CONNECT: its
    policy): final, nothing reached the server. The message names the proxy and where it was set, never its
    credentials; ``summary`` is the same (what a log may say)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.summary, self.status = message, status


def proxy_refusal(url: str, proxy: Proxy, status: int, reason: str = "") -> ProxyRefused:
    """What a proxy's 4xx to ``url`` means: for a 407 whether credentials were sent (``Proxy-Authorization``) at all."""
    said = f"HTTP {status}{f' {reason}' if reason else ''}"
    where = f"the proxy {proxy} ({proxy.source})"
    if status != 407:
        return ProxyRefused(f"{where} refused to reach {url}: {said}", status)
    address = netloc(proxy.host, proxy.port)
    why = (f"it was sent no credentials: give them in {proxy.source} as http://user:password@{address}"
           if proxy.user is None else f"the credentials in {proxy.source} were refused")
    return ProxyRefused(f"{where} refused {url}: {said} ({why})", status)


_TUNNEL_STATUS = re.compile(r"Tunnel connection failed: (\d{3})\s*(.*)")  # http.client's words for a CONNECT refused


def retry_after_s(value: str | None) -> float | None:
    """A ``Retry-After`` header's wait in seconds (a number of seconds, or an HTTP date), or None (absent or not
    readable)."""
    value = (value or "").strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time()) if when is not None and when.tzinfo is not None else None


class Exchange:
    """One POST, all of it within ``timeout_s`` (``timeout_key`` names the setting in the error at the deadline).
    ``max_reply_bytes``: the reply's body is read up to that many (more is a ``BadReply``); 0 reads none, the status
    being the answer (a webhook's). ``budget_s``: what is left of ``timeout_s`` (a retry's), when less."""

    def __init__(self, url: str, context: ssl.SSLContext | None, timeout_s: float, proxy: Proxy | None = None, *,
                 timeout_key: str, max_reply_bytes: int, budget_s: float | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        https = parts.scheme == "https"
        port = parts.port or (443 if https else 80)
        self.url, self.timeout_s, self.proxy = url, timeout_s, proxy
        self.timeout_key, self.max_reply_bytes = timeout_key, max_reply_bytes
        self.budget_s = timeout_s if budget_s is None else max(0.0, min(budget_s, timeout_s))
        self.retry_after: float | None = None  # the reply's Retry-After, in seconds (a 429's, a 503's)
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.proxy_headers: dict[str, str] = {}
        host, at = (parts.hostname, port) if proxy is None else (proxy.host, proxy.port)
        self.conn = (http.client.HTTPSConnection(host, at, timeout=timeout_s, context=context) if https
                     else http.client.HTTPConnection(host, at, timeout=timeout_s))
        if proxy is not None and https:  # CONNECT; the TLS inside checks the certificate against parts.hostname
            self.conn.set_tunnel(parts.hostname, port, headers=proxy.headers())
        elif proxy is not None:  # a plain request, its target named whole, to the proxy
            self.path = urllib.parse.urlunsplit(("http", netloc(parts.hostname, port), parts.path or "/",
                                                 parts.query, ""))
            self.proxy_headers = proxy.headers()
        self.why: str | None = None  # set when the exchange was cut
        self.sock: socket.socket | None = None  # kept: http.client lets go of it when the reply ends at the close

    def abort(self, why: str) -> None:  # any thread
        self.why = self.why or why
        sock = self.sock or self.conn.sock  # the latter: connected, still in the proxy's CONNECT
        if sock is not None:
            try:  # the plain socket's shutdown: an SSLSocket's own drops its state under a reading thread
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass

    def _connect(self) -> None:
        try:
            self.conn.connect()
        except OSError as exc:
            if self.proxy is None or self.why is not None or isinstance(exc, ssl.SSLError):  # TLS: the server's
                raise
            refused = _TUNNEL_STATUS.match(str(exc))
            status = int(refused.group(1)) if refused else 0
            if status == 407 or (400 <= status < 500 and status not in (408, 429)):  # the proxy's no, not a fault
                raise proxy_refusal(self.url, self.proxy, status, refused.group(2).strip()[:80]) from None
            # "Tunnel connection failed: 502 Bad Gateway" said which proxy nowhere
            raise ConnectionError(f"{self.url} through the proxy {self.proxy} ({self.proxy.source}): "
                                  f"{exc}") from None

    def post(self, body: bytes, headers: dict[str, str]) -> tuple[int, str, str | None, bytes]:
        """(status, Content-Type, Location, body read up to ``max_reply_bytes``); a ``TimeoutError`` naming
        ``timeout_key`` when the deadline cut it, or why ``abort`` did."""
        timer = threading.Timer(self.budget_s, self.abort,
                                args=(f"no whole answer within {self.timeout_key} ({self.timeout_s:g} s)",))
        timer.daemon = True
        timer.start()
        try:
            self._connect()
            self.sock = self.conn.sock
            if self.why is not None:  # cut while it connected (nothing to shut down yet)
                raise TimeoutError(self.why)
            self.conn.request("POST", self.path, body=body, headers={**headers, **self.proxy_headers})
            response = self.conn.getresponse()
            if self.why is not None:  # cut mid-status or mid-headers: a shut socket reads as their end, "200" parsed
                raise TimeoutError(self.why)
            if response.status == 407 and self.proxy is not None:  # a plain request's proxy: as its CONNECT's 407
                raise proxy_refusal(self.url, self.proxy, 407, (response.reason or "").strip()[:80])
            self.retry_after = retry_after_s(response.getheader("Retry-After"))
            answer = (response.status, response.getheader("Content-Type") or "", response.getheader("Location"))
            if not self.max_reply_bytes:
                return (*answer, b"")
            length = response.getheader("Content-Length")
            if length is not None and length.strip().isdigit() and int(length) > self.max_reply_bytes:
                raise BadReply(f"{self.url} answered with {int(length)} bytes; at most {self.max_reply_bytes} are "
                               "read", f"an oversized reply from {self.url}")
            raw = response.read(self.max_reply_bytes + 1)
            if self.why is not None:  # cut mid-reply: what came is a part (a shut socket reads as its end)
                raise TimeoutError(self.why)
            if len(raw) > self.max_reply_bytes:
                raise BadReply(f"{self.url} answered with more than {self.max_reply_bytes} bytes; not read further",
                               f"an oversized reply from {self.url}")
            return (*answer, raw)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self.why is not None and not isinstance(exc, BadReply):
                raise TimeoutError(f"{self.url}: {self.why}") from None
            raise
        finally:
            timer.cancel()
            self.conn.close()
