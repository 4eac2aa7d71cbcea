"""Alerts POSTed as JSON to webhook URLs (``alerts.webhooks``), from a thread of its own.

Each URL has a bounded queue (``alerts.queue``): when it is full the oldest waiting alert is dropped and
counted, so a dead receiver costs memory for ``queue`` alerts, never ingest time. A delivery is retried
``alerts.webhook_retries`` times with exponential backoff (0.5 s, 1 s, 2 s, ... at most 30 s) on a connection
error, a timeout or a 5xx / 429 answer — after the ``Retry-After`` the receiver named when it is longer (up to
``RETRY_AFTER_MAX_S``: a rate-limited receiver asked again at once only counted another refusal); a 4xx answer
is final (the receiver refused that alert). A redirect is
not followed and is final too, naming where it points (urllib turned a redirected POST into a GET without the alert).
A 2xx status is a delivery, whatever then happens to its body (sending it again would repeat the alert). The body is
``AlertEvent.to_json("base64")``: the keyframe travels inside (the receiver may not reach the API).

``alerts.webhook_timeout_s`` bounds each try whole — connecting, a proxy's CONNECT, sending, the status and headers
(apps/outputs/exchange.py, as an escalation's ``escalate.timeout_s``): it was each network read's, and a proxy or
receiver that trickled its answer a byte at a time held the webhook thread, and every alert behind it, for good.

Through a proxy as escalations go (apps/outputs/proxy.py): ``alerts.webhook_proxy``, else the environment's
``HTTPS_PROXY`` / ``HTTP_PROXY`` / ``ALL_PROXY`` with ``NO_PROXY`` honoured, as curl reads them; an ``https://``
receiver through a CONNECT tunnel, its certificate checked against its own name. Not urllib's reading of those
variables: it ignores ``ALL_PROXY`` and CIDR blocks in ``NO_PROXY``, and took a ``socks5://`` proxy for
an HTTP one. The proxy's credentials go in ``Proxy-Authorization`` only, never in a log line. A proxy that refuses —
a 407, its credentials missing or wrong, to a CONNECT or to a plain request alike; another 4xx to a CONNECT — is
final: the alert is not delivered, the proxy named (an ``https://`` receiver's 407 was retried as a network fault).
So is a certificate that is refused (another name's, or of a CA not trusted): asking again meets the same certificate.
"""

from __future__ import annotations

import http.client
import json
import logging
import ssl
import threading
from collections import deque

from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.outputs.exchange import Exchange, ProxyRefused
from edgekv.apps.outputs.proxy import proxy_for

log = logging.getLogger("edgekv.webhooks")
BACKOFF_S = 0.5
BACKOFF_MAX_S = 30.0
RETRY_AFTER_MAX_S = 300.0  # the longest Retry-After honoured (the queue behind waits meanwhile)


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
        through = f" through the proxy {self.proxy} ({self.proxy.source})" if self.proxy is not None else ""
        delay = BACKOFF_S
        for attempt in range(self.retries + 1):
            self.attempts += 1
            # alerts.webhook_timeout_s is the whole exchange, the proxy's CONNECT included: a proxy or receiver that
            # trickled its answer a byte at a time, each within the timeout, held this thread (and every alert
            # behind it) for as long as it went on. The status is the answer: its body is not read.
            exchange = Exchange(self.url, self.context, self.timeout_s, self.proxy,
                                timeout_key="alerts.webhook_timeout_s", max_reply_bytes=0)
            try:
                status, _, location, _ = exchange.post(body, headers)
            except ProxyRefused as exc:  # a configuration error: asking again gets the same answer
                log.warning("webhook %s: alert %s not delivered: %s", self.url, event.id, exc)
                return False
            except ssl.SSLCertVerificationError as exc:  # the same: not the receiver named, or not a CA trusted
                log.warning("webhook %s: alert %s not delivered: its certificate is refused (%s); see "
                            "alerts.webhook_ca_file", self.url, event.id, exc.verify_message or exc)
                return False
            except (OSError, http.client.HTTPException) as exc:  # TimeoutError at the deadline is an OSError
                reason = str(exc) or type(exc).__name__
                reason += through if through and "through the proxy" not in reason else ""
            else:
                if 200 <= status < 300:
                    return True
                if 300 <= status < 400:
                    log.warning("webhook %s redirects (HTTP %d to %s), not followed: alert %s not delivered; set "
                                "alerts.webhooks to the URL it points to", self.url, status,
                                location or "no Location", event.id)
                    return False
                if status < 500 and status != 429:
                    log.warning("webhook %s refused alert %s: HTTP %d", self.url, event.id, status)
                    return False
                reason = f"HTTP {status}"
                if exchange.retry_after is not None:
                    delay = max(delay, min(exchange.retry_after, RETRY_AFTER_MAX_S))
                    reason += f" (Retry-After {exchange.retry_after:g} s)"
            if attempt < self.retries:
                log.info("webhook %s: %s; retry %d in %.1f s", self.url, reason, attempt + 1, delay)
                if self._stop.wait(delay):
                    return False
                delay = min(delay * 2, BACKOFF_MAX_S)
        log.warning("webhook %s: alert %s not delivered after %d tries (%s)", self.url, event.id, self.retries + 1,
                    reason)
        return False
