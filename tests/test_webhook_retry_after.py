"""A rate-limited alert receiver (apps/outputs/webhooks.py): a 429 or 503 naming a ``Retry-After`` is asked again
after it, not at the next step of the backoff — 0.5 s later the receiver only counted another refusal and the alert
was dropped after ``alerts.webhook_retries``. The wait is watched, not slept: the sender's stop event stands in."""

from __future__ import annotations

import threading
import time

import pytest
from helpers_remote import Remote

from edgekv.apps.outputs.alerts import AlertEvent
from edgekv.apps.outputs.webhooks import BACKOFF_S, RETRY_AFTER_MAX_S, WebhookSender


class _Waits(threading.Event):
    """The sender's stop event, noting each wait asked of it and returning at once (never set)."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.asked.append(timeout)
        return False


def _busy(status: int, retry_after: str | None):
    def answer(handler, remote) -> None:
        handler.send_response(status if len(remote.bodies) == 1 else 200)
        if retry_after is not None:
            handler.send_header("Retry-After", retry_after)
        handler.send_header("Content-Length", "0")
        handler.end_headers()
    return answer


@pytest.mark.parametrize("status, retry_after, waited", [(429, "20", 20.0), (503, "7", 7.0), (429, None, BACKOFF_S),
                                                         (429, "86400", RETRY_AFTER_MAX_S), (429, "soon", BACKOFF_S)])
def test_a_busy_receiver_is_asked_again_after_the_wait_it_named(status, retry_after, waited):
    remote = Remote(_busy(status, retry_after))
    try:
        sender = WebhookSender(remote.url, timeout_s=60, retries=2)
        sender._stop = _Waits()
        event = AlertEvent("e1", "alert-1", "red", "Was there a red circle?", None, 0.9, 1.0, 2, 1.0, time.time())
        assert sender._deliver(event)
        assert sender._stop.asked == [waited] and len(remote.bodies) == 2
    finally:
        remote.close()
