"""Seconds as callers give them: any real number (numpy's float32 / int64 too, as read from a timestamp array; a JSON
integer literal of any length), never a bool. Light: the CLI's window parsing (apps/wall_times.py) and the fleet's
messages use it without importing torch; ``edgekv.session.clock`` checks timestamps with it."""

from __future__ import annotations

import numbers
import sys

# Beyond 2**42 s (~139,000 years) float64 timestamps step by more than a millisecond.
MAX_ABS_SECONDS = 2.0 ** 42


def real_seconds(value: object) -> float | None:
    """``value`` as a float when it is a real number (numpy's float32 / int64 too, never a bool), else None. An int
    past float64's range (``10**400``, a JSON integer literal) becomes +-float64's largest value instead of
    ``float()``'s ``OverflowError``, which no caller expecting a ``ValueError`` caught: range checks name it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return sys.float_info.max if value > 0 else -sys.float_info.max
