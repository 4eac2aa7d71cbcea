"""The stream's clock: every frame's timestamp is checked here before anything changes, and turned into a
frame pair's temporal position.

Frame pair *k* sits at temporal position ``floor((t_k - t0) * tokens_per_second) - t_offset``: ``t_k`` the time
of the pair's first frame, ``t0`` that of the stream's first pair, ``t_offset`` what re-basing has squeezed out
(``edgekv.session.memory``). That is where transformers' ``get_rope_index`` places a uniformly sampled video
(``k * second_per_grid * tokens_per_second``), so streaming stays exact against it.
"""

from __future__ import annotations

import math

# Beyond 2**42 s (~139,000 years) float64 timestamps step by more than a millisecond.
MAX_ABS_SECONDS = 2.0 ** 42


class StreamClock:
    def __init__(self, fps: float, tokens_per_second: float) -> None:
        self.fps = float(fps)
        self.tokens_per_second = float(tokens_per_second)
        self.t0: float | None = None      # time of the first frame pair's first frame
        self.last_t: float | None = None  # time of the last frame accepted

    def check(self, t: float | None, frames: int, pending_t: float | None, t_offset: int, limit: int) -> float:
        """``t`` as a float (``None``: the frame count at ``fps``), or ``ValueError`` naming what is wrong with
        it: not finite, out of float64's millisecond range, before the last frame, or a temporal position past
        ``limit`` (the cache keeps positions as int32)."""
        if t is None:
            t = frames / self.fps
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(float(t)):
            raise ValueError(f"t must be a finite number of seconds, got {t!r}")
        if abs(float(t)) > MAX_ABS_SECONDS:
            raise ValueError(f"t={t!r}: timestamps must lie within +-{MAX_ABS_SECONDS:.4g} s (beyond, float64 "
                             f"seconds step by more than a millisecond)")
        if self.last_t is not None and float(t) < self.last_t:
            raise ValueError(f"timestamps must not go back in time: got t={t} after t={self.last_t}")
        self._check_position(float(t), pending_t, t_offset, limit)
        return float(t)

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

    def accept(self, t: float) -> None:
        """A frame stamped ``t`` went in (or was skipped as a near-duplicate)."""
        self.last_t = t

    def position(self, t_first: float, t_offset: int) -> int:
        """The temporal position of a frame pair whose first frame is stamped ``t_first``."""
        if self.t0 is None:
            self.t0 = t_first
        return int(math.floor((t_first - self.t0) * self.tokens_per_second + 1e-9)) - t_offset
