"""Alerts POSTed as JSON to webhook URLs (``alerts.webhooks``), from a thread of its own.

Each URL has a bounded queue (``alerts.queue``): when it is full the oldest waiting alert is dropped and
counted, so a dead receiver costs memory for ``queue`` alerts, never ingest time. A delivery is retried
``alerts.webhook_retries`` times with exponential backoff (0.5 s, 1 s, 2 s, ... at most 30 s) on a connection
error, a timeout or a 5xx / 429 answer; a 4xx answer is final (the receiver refused that alert). A redirect is
not followed and is final too, naming where it points (urllib turns a redirected POST into a GET without the alert).
A 2xx status is a delivery, whatever then happens to its body (sending it again would repeat the alert). The body is
``AlertEvent.to_json("base64")``: the keyframe travels inside (the receiver may not reach the API).

Through a proxy as escalations go (apps/outputs/proxy.py): ``alerts.webhook_proxy``, else the environment's
``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``ALL_PROXY`` with ``NO_PROXY`` honoured, as curl reads them; an ``https://``
receiver through a CONNECT tunnel, its certificate checked against its own name. urllib's own reading of those
variables is not used: it ignores ``ALL_PROXY`` and CIDR blocks in ``NO_PROXY``, and took a ``socks5://`` proxy for
an HTTP one. The proxy's credentials go in ``Proxy-Authorization`` only, never in a log line.
"""

from __future__ import annotations

import json
import logging
import threading
import urllib.error
import urllib.request
from collections import deque

from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.outputs.proxy import netloc, proxy_for

log = logging.getLogger("edgekv.webhooks")
BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0


class RefuseRedirect(urllib.request.HTTPRedirectHandler):
    """No redirect is followed: urllib follows a 301/302/303 of a POST with a GET without the body, which a
    receiver answers 200, and the alert counted sent never arrived (an escalation got the 405 of that GET). The 3xx
    reaches the caller as an HTTPError."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


class WebhookSender:
    """One receiver URL: ``offer`` queues, a thread delivers in order."""

    def __init__(self, url: str, timeout_s: float = 5.0, retries: int = 4, queue: int = 64,
                 token: str | None = None, context=None, proxy: str | None = None) -> None:
        """``proxy``: ``alerts.webhook_proxy`` (a URL, ``"direct"``, or None for the environment's); one that
        cannot be used (``socks5://``) is a ``ValueError`` naming where it was set."""
        self.url, self.timeout_s, self.retries, self.token = url, timeout_s, retries, token
        self.context = context  # ssl.SSLContext of an https:// receiver (alerts.webhook_ca_file, ...), or None
        self.proxy = proxy_for(url, proxy, "alerts.webhook_proxy")
        if self.proxy is not None:
            log.info("webhook %s goes through the proxy %s (%s)", url, self.proxy, self.proxy.source)
        self.pending: deque[AlertEvent] = deque()  # waiting (the one being delivered is ``in_flight``)
        self.in_flight: AlertEvent | None = None
        self.capacity = queue
        self.sent = self.failed = self.dropped = self.attempts = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="edgekv-webhook", daemon=True)
        handlers = [urllib.request.ProxyHandler({}), RefuseRedirect()]  # {}: the proxy is self.proxy, set per request
        handlers += [urllib.request.HTTPSHandler(context=context)] if context is not None else []
        self._opener = urllib.request.build_opener(*handlers)

    def start(self) -> "WebhookSender":
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self._thread.join(timeout)

    def offer(self, event: AlertEvent) -> None:
        with self._cond:
            if len(self.pending) >= self.capacity:
                self.pending.popleft()
                self.dropped += 1
            self.pending.append(event)
            self._cond.notify()

    def stats(self) -> dict:
        return {"url": self.url, "sent": self.sent, "failed": self.failed, "dropped": self.dropped,
                "waiting": len(self.pending), "attempts": self.attempts}

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self.pending and not self._stop.is_set():
                    self._cond.wait(1.0)
                if self._stop.is_set():
                    return
                event = self.pending.popleft()
                self.in_flight = event
            delivered = self._deliver(event)
            self.in_flight = None
            if delivered:
                self.sent += 1
            else:
                self.failed += 1

    def _deliver(self, event: AlertEvent) -> bool:
        body = json.dumps(event.to_json("base64")).encode()
        headers = {"Content-Type": "application/json", "User-Agent": "edgekv-alerts"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if self.proxy is not None:  # moved to the CONNECT by urllib for an https:// receiver, never sent to it
            headers.update(self.proxy.headers())
        through = f" through the proxy {self.proxy} ({self.proxy.source})" if self.proxy is not None else ""
        delay = BACKOFF_S
        for attempt in range(self.retries + 1):
            self.attempts += 1
            try:
                request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
                if self.proxy is not None:  # https: a CONNECT tunnel to the receiver; http: the absolute URL
                    # Host first: urllib derives it after set_proxy from the proxy's address, for a tunnelled request
                    request.add_unredirected_header("Host", request.host)
                    request.set_proxy(netloc(self.proxy.host, self.proxy.port), "http")
                # the status is the answer: its body is not read (a receiver that dripped it a byte at a time, each
                # within the timeout, held this thread and every alert behind it for as long as it went on)
                with self._opener.open(request, timeout=self.timeout_s):
                    pass
                return True
            except urllib.error.HTTPError as exc:
                exc.close()
                if 300 <= exc.code < 400:
                    log.warning("webhook %s redirects (HTTP %d to %s), not followed: alert %s not delivered; set "
                                "alerts.webhooks to the URL it points to", self.url, exc.code,
                                exc.headers.get("Location", "no Location"), event.id)
                    return False
                if exc.code == 407 and self.proxy is not None:  # the proxy's answer, not the receiver's
                    log.warning("webhook %s: the proxy %s (%s) refused alert %s: HTTP 407 (its credentials are "
                                "missing or wrong)", self.url, self.proxy, self.proxy.source, event.id)
                    return False
                if exc.code < 500 and exc.code != 429:
                    log.warning("webhook %s refused alert %s: HTTP %d", self.url, event.id, exc.code)
                    return False
                reason = f"HTTP {exc.code}"
            except (urllib.error.URLError, OSError, TimeoutError) as exc:
                reason = str(getattr(exc, "reason", exc)) + through  # "Tunnel connection failed: 407 ..." said no more
            if attempt < self.retries:
                log.info("webhook %s: %s; retry %d in %.1f s", self.url, reason, attempt + 1, delay)
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, BACKOFF_MAX_S)
        log.warning("webhook %s: alert %s not delivered after %d tries (%s)", self.url, event.id, self.retries + 1,
                    reason)
        return False
