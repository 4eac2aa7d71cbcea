"""Capture in its own thread, sample at the target fps: a slow model never stalls a camera.

``CaptureThread`` reads a source as fast as it delivers and keeps only the newest frame
(latest-frame-wins): a camera's driver buffers are drained continuously, so the frame the model
gets is current rather than seconds old, and the capture never waits for the consumer. Frames
overwritten before anyone took them are counted as dropped. Corrupt frames are skipped and counted (a
frame that fails to decode is not a lost stream: ``OpenCVSource`` reads on); a lost live source is reopened
with jittered exponential backoff; the end of a file ends the thread cleanly. Nothing raises out of the thread: failures land in ``stats()``.

A source whose ``grab`` costs less than ``read`` (``FrameSource.grab_saves_decoding``: OpenCV's cameras, streams and
files) is grabbed at every frame and its pixels retrieved only for the frames a consumer may take: those from a frame
interval or two before the sampler's next tick (``want_from``), and any while a consumer waits. A 30 fps camera
sampled at 2 fps then has about one frame in six converted to BGR (and, from a V4L2 camera sending MJPEG, decoded)
instead of every one. The frame handed out is still taken within a frame interval of its coming (``edgekv bench
capture``, H.264 1080p30 on the dev VM: a median 21.6 ms after it came, its ~10 ms of conversion included, against
8.7 ms with every frame decoded, whose conversion came before).

``Sampler`` hands the ingest loop one frame per tick of the target fps. For recorded sources a
``lossless`` capture (a bounded queue instead of the latest slot) plus timestamp-based selection
gives a reproducible frame sequence, which benchmarks and tests need; only live sources must drop.
"""

from __future__ import annotations

import logging
import math
import os
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    Frame,
    FrameSource,
    SourceLost,
    SourceUnavailable,
    TimestampSelector,
    open_source,
)

__all__ = ["Backoff", "CaptureThread", "Sampler"]

log = logging.getLogger("edgekv.video")
_END = object()  # queue sentinel: the capture thread finished


@dataclass(frozen=True)
class Backoff:
    """Reconnect delays ``min(max_s, base_s * 2**attempt)``, each shortened by a random share of up to
    ``jitter`` so that many cameras lost at once (a PoE switch reboot) do not reconnect in lockstep.
    ``max_attempts=None`` retries forever: a camera daemon should outlive a long outage."""

    base_s: float = 0.5
    max_s: float = 30.0
    jitter: float = 0.5
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.max_s >= self.base_s):
            raise ValueError(f"backoff: need 0 < base_s <= max_s, got base_s={self.base_s}, max_s={self.max_s}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff: jitter must be in [0, 1], got {self.jitter}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"backoff: max_attempts must be >= 1 or None, got {self.max_attempts}")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before reconnect try ``attempt`` (0-based)."""
        nominal = min(self.max_s, self.base_s * 2.0 ** min(attempt, 62))
        return nominal * (1.0 - self.jitter * rng.random())


class CaptureThread:
    """Reads ``source`` in a daemon thread; the consumer takes the newest frame (or, when ``lossless``,
    every frame in order from a bounded queue; only for recorded sources, which can wait).

    ``pace`` plays a recorded source back at its own clock, so that a file can stand in for a camera
    (default: on for recorded sources in latest-frame mode, off otherwise).

    ``decode_all`` retrieves every frame's pixels even where the source could skip them (the comparison
    ``edgekv bench capture`` makes); by default a latest-frame capture retrieves only what ``_wanted`` says.
    ``clock`` (monotonic seconds) times the frames for that choice; tests give a fake one.
    """

    LEAD_INTERVALS = 2.0  # frames retrieved from this many frame intervals before the consumer's next tick
    INTERVAL_SMOOTHING = 0.1  # weight of the newest frame interval in its running mean

    def __init__(self, source: FrameSource | str | int | os.PathLike, *, backoff: Backoff | None = None,
                 lossless: bool = False, queue_size: int = 8, pace: bool | None = None, seed: int | None = None,
                 name: str = "edgekv-capture", decode_all: bool = False, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.source = source if isinstance(source, FrameSource) else open_source(source)
        if lossless and self.source.live:
            raise ValueError(f"video source {self.source.spec!r} is live: it cannot be read losslessly "
                             "(the camera would have to wait); use the default latest-frame mode")
        if queue_size < 1:
            raise ValueError(f"queue_size must be >= 1, got {queue_size}")
        self.backoff = backoff or Backoff()
        self.lossless = lossless
        self.pace = (not self.source.live and not lossless) if pace is None else pace
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._cond = threading.Condition()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._latest: tuple[np.ndarray, float] | None = None
        self._seq = 0  # frames published; the latest slot holds frame number _seq
        self._taken_seq = 0  # newest frame number a consumer took
        self._finished = False
        self._end_seen = False  # lossless: the consumer reached the end marker
        self._counts = {"frames_read": 0, "frames_decoded": 0, "frames_dropped": 0, "frames_consumed": 0,
                        "frames_corrupt": 0, "reconnects": 0, "reconnect_attempts": 0, "reconnect_failures": 0}
        # grab every frame, retrieve only the wanted ones: latest-frame mode, a source where that saves work
        self.two_phase = not lossless and not decode_all and self.source.grab_saves_decoding
        self._clock = clock
        self._want_from: float | None = None  # the consumer's next tick (clock seconds); None: every frame
        self._waiting = 0  # consumers inside latest(): the next frame is retrieved whatever the time
        self._interval: float | None = None  # running mean of the seconds between frames
        self._frame_at: float | None = None  # when the previous frame came
        self._latest_came = 0.0  # when the frame in the latest slot came (before its pixels were retrieved)
        self._age_s_total = 0.0  # seconds from a frame's coming to its being taken, summed over frames taken
        self._backoff_s_total = 0.0
        self._ended: str | None = None
        self._reconnecting = False
        self._last_error: str | None = None
        self._started_at: float | None = None
        self._stopped_at: float | None = None
        self._returned_at: float | None = None  # the source's last read returned (a frame or an error)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> CaptureThread:
        self._started_at = self._returned_at = time.monotonic()
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> bool:
        """Ask the thread to finish and join it. Returns False if it is still stuck in a driver call
        after ``timeout`` (it is a daemon thread, so it cannot keep the process alive)."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        self.source.interrupt()  # a source waiting for data (a silent ROS topic) returns now
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> CaptureThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_stopped(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds, waking early (and returning True) if ``stop()`` is called."""
        return self._stop.wait(max(0.0, timeout))

    @property
    def reconnecting(self) -> bool:
        """A live source was lost and the thread is waiting to reopen it (backoff in progress)."""
        return self._reconnecting

    @property
    def finished(self) -> bool:
        """The thread is done (end of file, gave up reconnecting, stopped); no new frames will come."""
        return self._finished

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        pace_origin: tuple[float, float] | None = None  # (wall clock, stream time) of the first frame
        try:
            while not self._stop.is_set():
                frame_t = self._read_one()
                if frame_t is None:
                    continue
                if frame_t is _END:
                    break
                frame, t = frame_t
                if self.pace:
                    pace_origin = pace_origin or (time.monotonic(), t)
                    if self._stop.wait(max(0.0, pace_origin[0] + (t - pace_origin[1]) - time.monotonic())):
                        break
                came = time.monotonic()  # the frame is there (a file: at its time); its pixels may take longer
                if frame is None:  # grabbed: its pixels only if a consumer may take it
                    frame = self._retrieve_if_wanted()
                    if frame is None:
                        continue
                self._counts["frames_decoded"] += 1
                self._publish(frame, t, came)
        finally:
            self._ended = self._ended or "stopped"
            self._stopped_at = time.monotonic()
            self.source.close()
            if self.lossless:
                self._put(_END, force=True)
            with self._cond:
                self._finished = True
                self._cond.notify_all()

    def silent_s(self) -> float | None:
        """Seconds since the source's last read returned anything, a frame or an error (None before ``start`` and
        while reconnecting): how long a driver call has been stuck when nothing comes back at all."""
        if self._returned_at is None or self._reconnecting or self._finished:
            return None
        return time.monotonic() - self._returned_at

    def _read_one(self) -> tuple[np.ndarray | None, float] | object | None:
        """One read with every failure handled: a frame (its pixels None when only grabbed), None (try again) or _END
        (finish)."""
        try:
            frame_t = (None, self.source.grab()) if self.two_phase else self.source.read()
        except CorruptFrame as exc:
            self._counts["frames_corrupt"] += exc.count
            self._last_error = str(exc)
            return None
        except EndOfStream as exc:
            self._ended = exc.reason
            if exc.detail:
                self._last_error = str(exc)
            return _END
        except SourceLost as exc:
            return self._lost(exc)
        except SourceUnavailable as exc:  # a looped file gone at its reopen: it says why, a traceback would not
            log.warning("%s", exc)
            return self._lost(exc) if self.source.live else self._fail(exc)
        except Exception as exc:  # a backend raising (cv2.error, OSError): never kill the thread silently
            log.exception("video source %r raised while reading", self.source.spec)
            return self._lost(exc) if self.source.live else self._fail(exc)
        finally:
            self._returned_at = time.monotonic()  # it came back (after a reconnect, once that is over)
        self._counts["frames_read"] += 1
        return frame_t

    def _retrieve_if_wanted(self) -> np.ndarray | None:
        """The grabbed frame's pixels if ``_wanted`` says a consumer may take it, else None (counted dropped)."""
        if not self._wanted(self._clock()):
            with self._cond:
                self._counts["frames_dropped"] += 1
            return None
        try:
            return self.source.retrieve()
        except CorruptFrame as exc:
            self._counts["frames_corrupt"] += exc.count
            self._last_error = str(exc)
        except Exception as exc:  # a backend raising: as a read that raised (the next grab says if the source is lost)
            log.warning("video source %r raised while decoding a frame: %s", self.source.spec, exc)
            self._counts["frames_corrupt"] += 1
            self._last_error = f"{type(exc).__name__}: {exc}"
        return None

    def _wanted(self, now: float) -> bool:
        """Whether the frame that came at ``now`` may be taken: a consumer waits, no tick was said yet, the frame
        rate is not known yet, or the frame is within ``LEAD_INTERVALS`` frame intervals of the next tick (so the
        newest frame at the tick is one that came within a frame interval of it). Updates the running frame
        interval."""
        if self._frame_at is not None and now > self._frame_at:
            gap = now - self._frame_at
            self._interval = gap if self._interval is None else (
                self._interval + self.INTERVAL_SMOOTHING * (gap - self._interval))
        self._frame_at = now
        if self._waiting or self._want_from is None or self._interval is None:
            return True
        return now >= self._want_from - self.LEAD_INTERVALS * self._interval

    def want_from(self, tick: float | None) -> None:
        """The consumer takes its next frame at ``tick`` (``clock`` seconds); None: it may take one at any time."""
        self._want_from = tick

    def _fail(self, exc: BaseException) -> object:
        self._ended = "error"
        self._last_error = f"{type(exc).__name__}: {exc}"
        return _END

    def _lost(self, exc: BaseException) -> object | None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        if not self.source.live:
            return self._fail(exc)
        log.warning("video source %r lost (%s); reconnecting", self.source.spec, exc)
        return None if self._reconnect() else _END

    def _reconnect(self) -> bool:
        """Reopen with jittered exponential backoff until it works, ``stop()`` or ``max_attempts``."""
        self._reconnecting = True
        try:
            return self._reopen_with_backoff()
        finally:
            self._reconnecting = False

    def _reopen_with_backoff(self) -> bool:
        self.source.close()
        attempt = 0
        while not self._stop.is_set():
            if self.backoff.max_attempts is not None and attempt >= self.backoff.max_attempts:
                self._ended = "gave_up"
                return False
            delay = self.backoff.delay(attempt, self._rng)
            self._backoff_s_total += delay
            if self._stop.wait(delay):
                return False
            self._counts["reconnect_attempts"] += 1
            try:
                self.source.reopen()
            except Exception as exc:  # SourceError, cv2.error, OSError: all mean "not back yet"
                self._counts["reconnect_failures"] += 1
                self._last_error = f"reconnect {attempt + 1}: {type(exc).__name__}: {exc}"
                attempt += 1
                continue
            self._counts["reconnects"] += 1
            log.info("video source %r reconnected after %d failed attempt(s)", self.source.spec, attempt)
            return True
        return False

    def _publish(self, frame: np.ndarray, t: float, came: float) -> None:
        if self.lossless:
            self._put((frame, t))
            return
        with self._cond:
            if self._seq > self._taken_seq:
                self._counts["frames_dropped"] += 1  # overwritten before anyone took it
            self._latest = (frame, t)
            self._latest_came = came
            self._seq += 1
            self._cond.notify_all()

    def _put(self, item: object, force: bool = False) -> None:
        """Blocking put that still honours ``stop()``; ``force`` (the end marker) makes room instead."""
        while True:
            try:
                self._queue.put(item, timeout=0.05)
                return
            except queue.Full:
                if force and self._stop.is_set():
                    self._drain_one()
                elif self._stop.is_set():
                    return

    def _drain_one(self) -> None:
        try:
            self._queue.get_nowait()
        except queue.Empty:
            pass

    # ------------------------------------------------------------------ consumer side
    def latest(self, after: int = 0, timeout: float | None = None) -> tuple[np.ndarray, float, int] | None:
        """The newest frame numbered above ``after`` as ``(frame, t, number)``; waits up to ``timeout``
        for one. None on timeout or when the capture finished without a newer frame."""
        if self.lossless:
            raise RuntimeError("latest() is for latest-frame mode; a lossless capture is read with get()")
        with self._cond:
            self._waiting += 1
            try:
                ready = self._cond.wait_for(
                    lambda: self._seq > after or self._finished or self._stop.is_set(), timeout)
            finally:
                self._waiting -= 1
            if not ready or self._seq <= after or self._latest is None:
                return None
            self._counts["frames_consumed"] += 1
            self._taken_seq = self._seq
            self._age_s_total += time.monotonic() - self._latest_came
            frame, t = self._latest
            return frame, t, self._seq

    def get(self, timeout: float | None = None) -> Frame | None:
        """Lossless mode: the next frame in order, or None on timeout / at the end (see ``finished``)."""
        if not self.lossless:
            raise RuntimeError("get() is for lossless captures; use latest() in latest-frame mode")
        if self._end_seen or (self._finished and self._queue.empty()):
            return None
        try:
            item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is _END:
            self._end_seen = True
            return None
        self._counts["frames_consumed"] += 1
        return item

    @property
    def exhausted(self) -> bool:
        """Finished and every frame handed out (latest mode: the newest frame was taken)."""
        if not self._finished:
            return False
        if self.lossless:
            return self._end_seen or self._queue.empty()
        return self._taken_seq >= self._seq

    def stats(self) -> dict[str, Any]:
        """Counters for logs and /metrics (a snapshot; the thread keeps counting)."""
        end = self._stopped_at or time.monotonic()
        elapsed = end - self._started_at if self._started_at is not None else 0.0
        return {
            "source": self.source.spec,
            "live": self.source.live,
            "mode": "lossless" if self.lossless else "latest",
            "decodes": "wanted" if self.two_phase else "every",
            "running": self._thread.is_alive(),
            "reconnecting": self._reconnecting,
            **self._counts,
            "backoff_s_total": round(self._backoff_s_total, 6),
            "read_fps": self._counts["frames_read"] / elapsed if elapsed > 0 else 0.0,
            "age_ms_taken": (round(1e3 * self._age_s_total / self._counts["frames_consumed"], 3)
                             if self._counts["frames_consumed"] and not self.lossless else None),
            "ended": self._ended if self._finished else None,
            "last_error": self._last_error,
        }


class Sampler:
    """The ingest loop's view of a capture: one frame per tick of ``fps``.

    Latest-frame mode (live): waits for the next tick, then returns the newest frame not yet returned;
    a slow consumer simply gets the newest frame at each call (the ones in between were dropped by the
    capture) and the tick schedule never builds up a backlog. Lossless mode (recorded sources):
    returns the first frame at or after each tick by the source's own timestamps: reproducible.
    """

    def __init__(self, capture: CaptureThread, fps: float) -> None:
        if not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        self.capture = capture
        self.fps = float(fps)
        self.period = 1.0 / self.fps
        self._selector = TimestampSelector(fps) if capture.lossless else None
        self._next_tick: float | None = None
        self._after = 0
        self._counts = {"frames_sampled": 0, "frames_skipped_by_time": 0, "late_ticks": 0}
        self._handing = threading.Lock()  # a frame handed out and close() exclude each other
        self._closed = False
        self.handed_out_t: float | None = None  # the source's time of the last frame handed out; final once closed

    @classmethod
    def open(cls, source: FrameSource | str | int | os.PathLike, fps: float, *, deterministic: bool = False,
             **capture_kwargs: Any) -> Sampler:
        """Open ``source``, start its capture thread and wrap it. ``deterministic`` (recorded sources
        only) samples every frame by timestamp without dropping."""
        return cls(CaptureThread(source, lossless=deterministic, **capture_kwargs).start(), fps)

    @property
    def deterministic(self) -> bool:
        return self._selector is not None

    def set_fps(self, fps: float) -> None:
        """Sample at ``fps`` from now on (power-aware sampling); the ticks already handed out stay as they were."""
        if not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        self.fps, self.period = float(fps), 1.0 / float(fps)
        if self._selector is not None:
            self._selector.set_fps(self.fps)

    @property
    def exhausted(self) -> bool:
        """No frame will ever come again (the capture ended and everything was handed out)."""
        return self.capture.exhausted

    def next_frame(self, timeout: float | None = None) -> Frame | None:
        """``(frame, t)`` for the next tick, or None on timeout or at the end (check ``exhausted``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._selector is not None:
            return self._next_by_timestamp(deadline)
        return self._next_latest(deadline)

    def _remaining(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _next_latest(self, deadline: float | None) -> Frame | None:
        now = time.monotonic()
        late = False
        if self._next_tick is not None and now < self._next_tick:
            if deadline is not None and deadline < self._next_tick:
                self.capture.wait_stopped(deadline - now)
                return None
            if self.capture.wait_stopped(self._next_tick - now):
                return None
        elif self._next_tick is not None and now > self._next_tick + self.period:
            late = True
        item = self.capture.latest(self._after, self._remaining(deadline))
        if item is None:
            return None  # no frame yet (a camera reconnecting): a poll, not a tick taken late
        frame, t, after = item
        if not self._hand_out(t):
            return None
        self._after = after
        self._counts["late_ticks"] += late  # a frame taken more than a period after its tick (a slow consumer)
        tick = self._next_tick if self._next_tick is not None else time.monotonic()
        self._next_tick = max(tick + self.period, time.monotonic())  # no catch-up burst after a slow call
        self.capture.want_from(self._next_tick)  # the frames before it need not be decoded
        self._counts["frames_sampled"] += 1
        return frame, t

    def _next_by_timestamp(self, deadline: float | None) -> Frame | None:
        while True:
            item = self.capture.get(self._remaining(deadline))
            if item is None:
                return None
            frame, t = item
            if self._selector.accept(t):
                if not self._hand_out(t):
                    return None
                self._counts["frames_sampled"] += 1
                return frame, t
            self._counts["frames_skipped_by_time"] += 1

    def __iter__(self):
        """Frames until the capture is exhausted (blocks between ticks)."""
        while True:
            item = self.next_frame(timeout=0.5)
            if item is not None:
                yield item
            elif self.exhausted:
                return

    def _hand_out(self, t: float) -> bool:
        """Whether the frame stamped ``t`` may be handed out (never once ``close`` began); noted as the last if so."""
        with self._handing:
            if self._closed:
                return False
            self.handed_out_t = t
            return True

    @property
    def closed(self) -> bool:
        """``close`` was called: the capture was stopped, so ``exhausted`` says nothing of the source's end."""
        return self._closed

    def close(self) -> None:
        """Stop the capture. No frame is handed out once this returns, not even to a consumer inside ``next_frame``
        meanwhile, so ``handed_out_t`` is final: a paused recording resumes after it, every frame once."""
        with self._handing:
            self._closed = True
        self.capture.stop()

    def stats(self) -> dict[str, Any]:
        return {"fps_target": self.fps, "deterministic": self.deterministic, **self._counts, **self.capture.stats()}
