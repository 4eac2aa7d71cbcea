"""Waiting on a condition in tests: a generous bound, polled; never a race against the clock."""

from __future__ import annotations

import time


def until(condition, timeout: float = 60.0) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False
