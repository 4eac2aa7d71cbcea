"""Who gets the daemon's main loop next (a frame or a question), and where frames wait meanwhile.

The session has one owner, the main loop: it either ingests a frame pair or answers a question, never
both at once. Two rules keep the stream whole while people ask questions.

**No blind spot while answering (``FrameBacklog``).** A live capture keeps only its newest frame
(latest frame wins), so every frame sampled while a question is answered used to be dropped: a
64-token answer at the ~9 tok/s InfiniPot-V measured on AGX Orin is ~7 s of video never seen. During
an answer a collector thread keeps sampling the capture at the configured fps into a bounded backlog
(at most ``video.answer_backlog_s`` seconds of stream time and ``video.answer_backlog_mib`` MiB of
frames); right after the answer the loop ingests the backlog in order, each frame with its capture
timestamp, so the cache ends up exactly as if no question had been asked. The collector keeps
sampling until the backlog has drained, so catching up is no blind spot either. Frames beyond the
bounds are dropped and counted (``frames_lost_while_answering``). A recorded source read losslessly
needs no backlog: its reader simply waits. The daemon collects only while its measured ingest time
per frame x fps stays under ``video.min_ingest_share``, i.e. while ingest can catch up even when
answers take their whole share; a machine slower than that drops frames anyway (latest frame wins),
and a backlog it could never catch up would only make the stream lag the camera.

Why a queue and not ingest interleaved between decode steps: interleaving would prefill video tokens
while the question's tokens sit in the cache, which needs the session to hide the question's slots
from video prefill (or the cache stops being query-agnostic, invariant 3) and to re-base the
question's positions when a compression moves the video under it. The queue needs no session change,
keeps answers bit-identical to an answer asked between frames, and costs only memory that the two
bounds cap; the price is that the answer is computed over the cache as it was when the question
started (the frames that arrive meanwhile are ingested right after).

**Fair share under question load (``FairShare``).** Frames go first: the loop answers a question only
when no frame is waiting. When frames always wait (the machine ingests no faster than the sampled
rate, or a recorded file feeds frames as fast as they are taken) a question may still jump ahead, but
only on credit: every second spent ingesting earns ``share / (1 - share)`` seconds of answering, where
``share = 1 - video.min_ingest_share``, and an answer that jumped ahead spends its duration. Under any
number of queued questions the loop therefore spends at least ``min_ingest_share`` (default 80 %) of
its busy time ingesting, and questions still advance (no starvation). When the machine has headroom
frames wait only right after an answer (the backlog), and ingest keeps its full rate.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

Frame = tuple[np.ndarray, float]


@dataclass
class FairShare:
    """The credit rule above. ``min_ingest_share`` in (0, 1]; 1 means questions never jump ahead.

    ``max_credit_s`` caps what idle ingest can save up, so a burst of questions after a quiet hour
    cannot hold frames back for more than that long.
    """

    min_ingest_share: float = 0.8
    max_credit_s: float = 0.5
    credit_s: float = 0.0
    ingest_s: float = 0.0
    answer_s: float = 0.0
    answer_ahead_s: float = 0.0
    answers_ahead: int = 0
    longest_answer_s: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.min_ingest_share <= 1.0:
            raise ValueError(f"min_ingest_share must be in (0, 1], got {self.min_ingest_share}")
        if not self.max_credit_s > 0.0:
            raise ValueError(f"max_credit_s must be > 0 (or no question could ever go ahead), got {self.max_credit_s}")

    @property
    def earn_rate(self) -> float:
        """Seconds of answering earned per second of ingest: share / (1 - share) with share = 1 - min."""
        return (1.0 - self.min_ingest_share) / self.min_ingest_share

    def next_step(self, frame_waiting: bool, question_waiting: bool) -> str:
        """``"ingest"``, ``"answer"`` or ``"wait"`` (nothing to do)."""
        if question_waiting and (not frame_waiting or self.credit_s > 0.0):
            return "answer"
        return "ingest" if frame_waiting else "wait"

    def ingested(self, seconds: float) -> None:
        self.ingest_s += seconds
        self.credit_s = min(self.max_credit_s, self.credit_s + seconds * self.earn_rate)

    def answered(self, seconds: float, jumped_ahead: bool) -> None:
        """Record an answer; one that went ahead of waiting frames spends credit (it may go negative:
        the debt is paid by ingest before the next question may jump ahead)."""
        self.answer_s += seconds
        self.longest_answer_s = max(self.longest_answer_s, seconds)
        if jumped_ahead:
            self.answers_ahead += 1
            self.answer_ahead_s += seconds
            self.credit_s -= seconds


class FrameBacklog:
    """Frames sampled but not yet ingested, in capture order, bounded in stream seconds and bytes.

    Thread-safe: the collector appends while the main loop answers; the main loop pops afterwards.
    """

    def __init__(self, max_seconds: float, max_bytes: int) -> None:
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        self._frames: deque[tuple[np.ndarray, float, float | None]] = deque()
        self._bytes = 0
        self._lock = threading.Lock()
        self.frames_lost = 0
        self.frames_kept = 0
        self.peak_frames = 0

    def clear(self) -> None:
        """Drop every waiting frame (the privacy switch: nothing seen while paused is kept)."""
        with self._lock:
            self._frames.clear()
            self._bytes = 0

    def __len__(self) -> int:
        return len(self._frames)

    def drop(self, gone: Callable[[float, float | None], bool]) -> int:
        """Drop the waiting frames for which ``gone(t, unix)`` holds (a forgotten window's); how many went."""
        with self._lock:
            kept = deque(item for item in self._frames if not gone(item[1], item[2]))
            dropped = len(self._frames) - len(kept)
            self._frames = kept
            self._bytes = sum(item[0].nbytes for item in kept)
            return dropped

    @property
    def nbytes(self) -> int:
        return self._bytes

    def span_s(self) -> float:
        with self._lock:
            return self._frames[-1][1] - self._frames[0][1] if len(self._frames) > 1 else 0.0

    def push(self, frame: np.ndarray, t: float, unix: float | None = None, *, bounded: bool = True) -> bool:
        """Append a frame stamped ``t`` (the source's time) and ``unix`` (the wall time it was sampled, None for
        none); with ``bounded`` it is dropped (and counted) when it would take the backlog past either bound. The
        frame the loop itself pulled (``bounded=False``) always fits."""
        with self._lock:
            if bounded and self._frames and (t - self._frames[0][1] > self.max_seconds
                                             or self._bytes + frame.nbytes > self.max_bytes):
                self.frames_lost += 1
                return False
            if bounded and not self._frames and frame.nbytes > self.max_bytes:
                self.frames_lost += 1
                return False
            self._frames.append((frame, t, unix))
            self._bytes += frame.nbytes
            self.frames_kept += bounded
            self.peak_frames = max(self.peak_frames, len(self._frames))
            return True

    def pop(self) -> tuple[np.ndarray, float, float | None] | None:
        """The oldest frame as ``(frame, t, unix)``, or None."""
        with self._lock:
            if not self._frames:
                return None
            frame, t, unix = self._frames.popleft()
            self._bytes -= frame.nbytes
            return frame, t, unix

    def stats(self) -> dict:
        return {"backlog_frames": len(self._frames), "backlog_bytes": self._bytes,
                "backlog_peak_frames": self.peak_frames, "frames_kept_while_answering": self.frames_kept,
                "frames_lost_while_answering": self.frames_lost}


class Collector:
    """A thread that moves sampled frames into the backlog at the sampler's own ticks, from the start of an
    answer until the backlog has drained (``start()`` / ``stop()``, or ``with collector:``), so neither the
    answer nor a long ingest step while catching up delays a tick.

    ``take(timeout)`` returns the next sampled ``(frame, t)`` or ``(frame, t, unix)`` (the wall time it was
    sampled), or None; while the collector runs nobody
    else reads the sampler (the main loop stops pulling).
    """

    def __init__(self, backlog: FrameBacklog, take: Callable[[float], Frame | None]) -> None:
        self.backlog = backlog
        self.take = take
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "Collector":
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="edgekv-backlog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Returns once the thread is out of ``take`` (within its 50 ms timeout)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "Collector":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        while not self._stop.is_set():
            item = self.take(0.05)
            if item is not None:
                self.backlog.push(*item)
