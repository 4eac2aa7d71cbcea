"""When each part of the stream was seen by the wall clock, so that a question or a forget can name its stretch as
people do: "what happened between 10:03 and 10:05?", "forget 14:00 to 14:10".

Stream time (``edgekv/session/clock.py``) is what the memory counts in: it only goes forward, a restart continues
it after the time the device was down, a pause after the time it was paused. The wall clock does not behave like
that: NTP steps it (a board without an RTC battery boots in 1970 or at its last shutdown and jumps when the network
comes up), an operator sets it, it slews. So the two are kept apart, and the session keeps a map between them: a
list of anchors ``(stream_t, offset)``, each meaning "from stream time ``stream_t`` on, wall time = stream time +
``offset``", until the next anchor. A frame ingested with its capture's wall time (``captured_unix``) adds an anchor
only when its offset differs from the current one by more than ``TOLERANCE_S`` — a clock step, a restart, a drift
that added up — so a day of video holds a handful of anchors, and the map is saved in every snapshot with the
memory it describes (``edgekv/state.py``).

Turning a wall-clock window back into stream time is exact up to ``TOLERANCE_S``, and can be ambiguous: after the
wall clock was set back, one wall-clock minute happened twice. A question about such a window is refused, naming the
stretches of stream time it matches (each can be asked for in stream seconds), never silently narrowed; a forget
removes every one of them (``stretches``). Frames ingested without
a wall time (a recording read as fast as it is ingested, a snapshot written before the map existed) have none, and
a window is refused where the map says nothing. Such frames after wall-timed ones (a memory kept from a live camera,
then fed a recording) add an anchor whose offset is None, "no wall time from here": without it the recording's
pairs would take the last live offset and be "seen" at wall times when the device saw nothing of them, and a
forget of that time would remove them.
"""

from __future__ import annotations

import bisect
import math
import time

from edgekv.session.clock import MAX_ABS_SECONDS, real_seconds

TOLERANCE_S = 1.0   # a frame whose wall offset differs by more than this from the current anchor starts a new one
# The oldest are dropped beyond this (their stretch of the stream loses its wall times). A clock slewed by NTP at its
# 500 ppm limit adds one a 2,000 s, so 1,024 hold weeks; they stay within the ~46 KB of a snapshot's manifest that
# edgekv/state.py allows for when it bounds a snapshot's size in advance (_MANIFEST_ALLOWANCE, 64 KiB).
MAX_ANCHORS = 1024


def _start(anchor: tuple[float, float | None]) -> float:
    return anchor[0]


class NothingSeen(ValueError):
    """A wall-clock window in which the stream saw nothing (the device was off, paused, or not yet started)."""


class NoOneStretch(ValueError):
    """A wall-clock window that names no one stretch of stream time: the stream keeps no wall time (a recording
    read as fast as it is ingested), or the clock was set back and the window matches several stretches. A
    question's ``window`` is what to change (the chat API's ``param``)."""


def checked_unix(name: str, value: object) -> float:
    """``value`` as a wall time (seconds since the epoch), or ``ValueError`` naming ``name``: a real number within
    +-``MAX_ABS_SECONDS`` (year +-141,000). A wall time of 1e300 was once kept, and every later question by the
    wall clock failed formatting a date of it (``OverflowError`` from ``time.localtime``)."""
    unix = real_seconds(value)
    if unix is None or not math.isfinite(unix):
        raise ValueError(f"{name}={value!r}: a wall time must be a finite number of seconds since the epoch")
    if abs(unix) > MAX_ABS_SECONDS:
        raise ValueError(f"{name}={value!r}: a wall time must lie within +-{MAX_ABS_SECONDS:.4g} s of the epoch")
    return unix


def describe_unix(unix: float) -> str:
    """A wall time as the device's local clock shows it, with its UTC offset: in its zone now (C keeps the zone it
    read first; ``time.tzset`` reads it again, so a daemon follows the wearer's flight)."""
    time.tzset()
    return time.strftime("%Y-%m-%d %H:%M:%S%z", time.localtime(unix))


class WallClock:
    """The stream-time <-> wall-clock map of one session (the module's docstring)."""

    def __init__(self) -> None:
        # (stream time from which it holds, wall - stream or None: no wall time), in order
        self.anchors: list[tuple[float, float | None]] = []
        self.dropped = 0  # anchors dropped beyond MAX_ANCHORS

    def observe(self, stream_t: float, unix: float) -> None:
        """A frame at stream time ``stream_t`` was captured at wall time ``unix`` (seconds since the epoch)."""
        offset = checked_unix("captured_unix", unix) - float(stream_t)
        if self.anchors and self.anchors[-1][1] is not None and abs(offset - self.anchors[-1][1]) <= TOLERANCE_S:
            return
        self._anchor(stream_t, offset)

    def observe_none(self, stream_t: float) -> None:
        """A frame at stream time ``stream_t`` came without a wall time: after wall-timed frames, the map says
        nothing from here on until a frame brings one (the module's docstring)."""
        if self.anchors and self.anchors[-1][1] is not None:
            self._anchor(stream_t, None)

    def _anchor(self, stream_t: float, offset: float | None) -> None:
        if self.anchors and stream_t < self.anchors[-1][0]:  # never: stream time only goes forward
            raise ValueError(f"stream time {stream_t!r} is before the last wall-clock anchor {self.anchors[-1][0]!r}")
        if self.anchors and stream_t == self.anchors[-1][0]:
            self.anchors[-1] = (float(stream_t), offset)
            return
        self.anchors.append((float(stream_t), offset))
        if len(self.anchors) > MAX_ANCHORS:
            del self.anchors[0]
            self.dropped += 1

    def unix_of(self, stream_t: float) -> float | None:
        """The wall time of stream time ``stream_t``, or None when it has none (before the first anchor, or in a
        stretch ingested without wall times)."""
        index = bisect.bisect_right(self.anchors, float(stream_t), key=_start) - 1
        if index < 0 or self.anchors[index][1] is None:
            return None
        return float(stream_t) + self.anchors[index][1]

    def _known(self) -> bool:
        return any(offset is not None for _, offset in self.anchors)

    def stretches(self, unix_from: float, unix_to: float, last_t: float | None) -> list[tuple[float, float]]:
        """Every separate stretch of stream time seen between wall times ``unix_from`` and ``unix_to`` (up to
        ``last_t``, the newest frame's stream time), in stream order: none when nothing was seen then, several when
        the wall clock was set back in between (it lived that time twice). ``ValueError`` for a window that is no
        window, or a stream whose frames have no wall time at all."""
        unix_from, unix_to = checked_unix("from", unix_from), checked_unix("to", unix_to)
        if unix_from > unix_to:
            raise ValueError(f"from ({describe_unix(unix_from)}) is after to ({describe_unix(unix_to)})")
        if not self._known() or last_t is None:
            raise NoOneStretch("no frame of this stream has a wall-clock time (a recording read as fast as it is "
                               "ingested, or frames ingested without captured_unix): give the window in stream seconds")
        stretches: list[list[float]] = []
        for index, (start, offset) in enumerate(self.anchors):
            if offset is None:  # a stretch seen at no known wall time
                continue
            end = self.anchors[index + 1][0] if index + 1 < len(self.anchors) else max(start, float(last_t))
            # to the microsecond: seconds since the epoch carry ~0.2 us of float64 rounding at today's dates
            low, high = round(max(start, unix_from - offset), 6), round(min(end, unix_to - offset), 6)
            if low > high:
                continue
            if stretches and low <= stretches[-1][1] + 1e-9:  # continues the stretch before (an anchor's boundary)
                stretches[-1][1] = max(stretches[-1][1], high)
            else:
                stretches.append([low, high])
        return [(low, high) for low, high in stretches]

    def window(self, unix_from: float, unix_to: float, last_t: float | None) -> tuple[float, float]:
        """The one stretch of stream time seen between wall times ``unix_from`` and ``unix_to`` (``stretches``), or
        ``ValueError`` saying why there is none: no wall times kept, none of them in the window (``NothingSeen``),
        or the window matches several separate stretches (the wall clock was set back), each named."""
        stretches = self.stretches(unix_from, unix_to, last_t)
        if not stretches:
            first, last = self.span(last_t)
            known = f"the wall times kept span {describe_unix(first)} to {describe_unix(last)}"
            raise NothingSeen(f"nothing of this stream was seen between {describe_unix(unix_from)} and "
                              f"{describe_unix(unix_to)} ({known})")
        if len(stretches) > 1:
            parts = ", ".join(f"{low:.3f}..{high:.3f}" for low, high in stretches)
            raise NoOneStretch(f"{describe_unix(unix_from)} to {describe_unix(unix_to)} matches {len(stretches)} "
                               f"separate stretches of the stream (the device's wall clock was set back in between): "
                               f"stream seconds {parts}; ask for one of them in stream seconds")
        return stretches[0]

    def span(self, last_t: float | None) -> tuple[float, float] | None:
        """The wall times of the first and the last frame that had one (the newest frame's, unless the newest
        stretch came without wall times), or None when none is known."""
        known = [index for index, (_, offset) in enumerate(self.anchors) if offset is not None]
        if not known or last_t is None:
            return None
        first_start, first_offset = self.anchors[known[0]]
        start, offset = self.anchors[known[-1]]
        end = self.anchors[known[-1] + 1][0] if known[-1] + 1 < len(self.anchors) else max(start, float(last_t))
        return first_start + first_offset, end + offset

    def state(self) -> dict:
        return {"anchors": [list(anchor) for anchor in self.anchors], "dropped": self.dropped}

    def load_state(self, state: dict | None) -> None:
        """Back from a snapshot (``state``); a snapshot written before the map existed has none (None)."""
        self.anchors, self.dropped = [], 0
        if state is None:
            return
        anchors = [(float(start), None if offset is None else float(offset)) for start, offset in state["anchors"]]
        starts = [start for start, _ in anchors]
        if any(not (math.isfinite(s) and (o is None or math.isfinite(o))) for s, o in anchors) \
                or starts != sorted(set(starts)):
            raise ValueError("wall-clock anchors must be finite (or null: no wall time) and in stream-time order")
        self.anchors, self.dropped = anchors, int(state.get("dropped", 0))
