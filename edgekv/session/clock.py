"""The stream's clock: every frame's timestamp is checked here before anything changes, mapped onto the
stream's own time, and turned into a frame pair's temporal position.

Frame pair *k* sits at temporal position ``floor((t_k - t0) * tokens_per_second) - t_offset``: ``t_k`` the stream
time of the pair's first frame, ``t0`` that of the stream's first pair, ``t_offset`` what re-basing has squeezed
out (``edgekv.session.memory``). That is where transformers' ``get_rope_index`` places a uniformly sampled video
(``k * second_per_grid * tokens_per_second``), so streaming stays exact against it.

Time never stops the memory (DESIGN invariant 12). A caller's timestamps are the stream's own, shifted by
``shift`` (0 until a clock jumps): a step from the last accepted timestamp that goes back, or forward by more
than ``max_gap_s`` (``video.max_gap_s``), is a jump of the caller's clock — an RTC-less board that syncs NTP, a
client whose wall clock stepped, a source restarted from 0 — not time the camera saw. The frame is then placed
``max_gap_s`` after the last one (a jump forward: the gap stays bounded) or one frame interval after it (a
jump back), ``shift`` changes so the timestamps after it follow on, and the jump is logged. So a single
timestamp can never push every later frame out of range or make it "go back in time"; only a timestamp that
is no number of seconds at all (NaN, infinite, beyond float64's millisecond range) is refused, and refusing it
changes nothing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from edgekv.seconds import MAX_ABS_SECONDS, real_seconds

log = logging.getLogger("edgekv.session")

_LOGGED_JUMPS = 20  # every jump up to this many is logged; after that every 100th (a jittery clock must not flood)


@dataclass(frozen=True)
class Stamp:
    """A checked timestamp: the caller's ``source`` time and the ``stream`` time the frame gets; ``jump_s`` is
    the caller's step that was taken as a clock jump (None when there was none)."""

    source: float
    stream: float
    jump_s: float | None = None


class StreamClock:
    def __init__(self, fps: float, tokens_per_second: float, max_gap_s: float = 3600.0) -> None:
        if not (isinstance(max_gap_s, (int, float)) and math.isfinite(max_gap_s) and 0 < max_gap_s <= MAX_ABS_SECONDS):
            raise ValueError(f"max_gap_s must be a positive number of seconds up to {MAX_ABS_SECONDS:.4g}, "
                             f"got {max_gap_s!r}")
        self.fps = float(fps)
        self.tokens_per_second = float(tokens_per_second)
        self.max_gap_s = float(max_gap_s)
        self.t0: float | None = None             # stream time of the first frame pair's first frame
        self.last_t: float | None = None         # stream time of the last frame accepted
        self.last_source_t: float | None = None  # the caller's timestamp of that frame
        self.shift = 0.0                         # stream time = the caller's time + shift
        self.jumps = 0                           # clock jumps taken as bounded gaps

    def check(self, t: float | None, frames: int, pending_t: float | None, t_offset: int, limit: int) -> Stamp:
        """``t`` (``None``: the frame count at ``fps``) checked and mapped onto stream time, or ``ValueError``
        naming what is wrong with it: not a finite number, out of float64's millisecond range, or a temporal
        position past ``limit`` (the cache keeps positions as int32). Nothing changes until ``accept``."""
        if t is None:
            t = frames / self.fps
        # any real number (numpy's float32 / int64 too, as read from a timestamp array), never a bool
        source = real_seconds(t)
        if source is None or not math.isfinite(source):
            raise ValueError(f"t={t!r}: a timestamp must be a finite number of seconds")
        if abs(source) > MAX_ABS_SECONDS:
            raise ValueError(f"t={t!r}: timestamps must lie within +-{MAX_ABS_SECONDS:.4g} s (beyond, float64 "
                             f"seconds step by more than a millisecond)")
        stamp = self._map(source)
        self._check_position(stamp.stream, pending_t, t_offset, limit)
        return stamp

    def _map(self, source: float) -> Stamp:
        if self.last_source_t is None:
            return Stamp(source, source + self.shift)
        step = source - self.last_source_t
        if 0.0 <= step <= self.max_gap_s:
            return Stamp(source, source + self.shift)
        gap = self.max_gap_s if step > 0 else 1.0 / self.fps
        return Stamp(source, self.last_t + gap, step)

    def _check_position(self, t: float, pending_t: float | None, t_offset: int, limit: int) -> None:
        first = self.t0 if self.t0 is not None else (pending_t if pending_t is not None else t)
        t_pos = math.floor((t - first) * self.tokens_per_second + 1e-9) - t_offset
        if t_pos > limit:
            latest = first + (limit + t_offset) / self.tokens_per_second
            raise ValueError(
                f"t={t!r} is {t - first:.6g} s after the stream's first frame (t={first!r}): its temporal position "
                f"{t_pos} would pass the limit {limit} of the cache's int32 positions; timestamps must stay "
                f"at or below t={latest:.6g} (seconds since the first frame x {self.tokens_per_second:g} tokens "
                f"per second)"
            )

    def accept(self, stamp: Stamp) -> None:
        """A frame stamped ``stamp`` went in (or was skipped as a near-duplicate)."""
        if stamp.jump_s is not None:
            self.jumps += 1
            if self.jumps <= _LOGGED_JUMPS or self.jumps % 100 == 0:
                way = "forward" if stamp.jump_s > 0 else "back"
                log.warning("stream clock: the frame's timestamp jumped %s by %.6g s (t=%r after t=%r); taken as a "
                            "gap of %.6g s in stream time (video.max_gap_s=%g; clock jump %d)", way,
                            abs(stamp.jump_s), stamp.source, self.last_source_t, stamp.stream - self.last_t,
                            self.max_gap_s, self.jumps)
            self.shift = stamp.stream - stamp.source
        self.last_t, self.last_source_t = stamp.stream, stamp.source

    def position(self, t_first: float, t_offset: int) -> int:
        """The temporal position of a frame pair whose first frame is at stream time ``t_first``."""
        if self.t0 is None:
            self.t0 = t_first
        return int(math.floor((t_first - self.t0) * self.tokens_per_second + 1e-9)) - t_offset

    # ------------------------------------------------------------------ snapshots
    def state(self) -> dict:
        return {"last_source_t": self.last_source_t, "shift": self.shift, "jumps": self.jumps}

    def load_state(self, t0: float | None, last_t: float | None, state: dict | None) -> None:
        """Restore (``state`` None: a snapshot from before the clock kept one; its stream and source times
        were the same)."""
        state = state or {}
        self.t0, self.last_t = t0, last_t
        self.last_source_t = state.get("last_source_t", last_t)
        self.shift = float(state.get("shift", 0.0))
        self.jumps = int(state.get("jumps", 0))
