"""Is the memory still growing? A stream that takes frames from its source but ingests none of them (each
refused, say after a clock jump made every timestamp "too far") is not running: the daemon reports it
``stalled`` and ``/healthz`` answers 503 (issue 26: the daemon once looked healthy for hours while 100 % of its
frames were refused).

The watch only needs two moments: the last frame ingested and the end of the last answer (an answer holds
the main loop; the frames it samples meanwhile wait in the backlog, so a long answer is not a stall). Past
``video.stall_s`` (at least four frame intervals, so a 0.1 fps stream is not stalled between two frames)
without either, while the source is not being reconnected and the stream has not ended, it is stalled.
Reads are lock-free (two floats), so ``/healthz`` never waits for the session.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class StallWatch:
    def __init__(self, stall_s: float, fps: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.after_s = max(float(stall_s), 4.0 / float(fps))
        self.clock = clock
        self._since: float | None = None  # None: not started (a stream that never started is "starting")

    def start(self) -> None:
        """The loop starts: count from now."""
        self._since = self.clock()

    def progressed(self) -> None:
        """A frame went in, or an answer ended (frames sampled during it are ingested next)."""
        self._since = self.clock()

    def idle_s(self) -> float | None:
        """Seconds since the stream last moved (None before ``start``)."""
        since = self._since
        return None if since is None else self.clock() - since

    def stalled(self) -> bool:
        idle = self.idle_s()
        return idle is not None and idle > self.after_s


def problems(daemon) -> list[str]:
    """What is wrong but does not stop the memory, one line each (``/healthz`` then says ``degraded``):
    a camera being reconnected, an archive or its evidence frames that cannot write (a full disk). Lock-free
    reads only."""
    out = []
    sampler = daemon.sampler
    if sampler is not None and sampler.capture.reconnecting:
        attempts = sampler.capture.stats()["reconnect_attempts"]
        if getattr(sampler.capture.source, "connected", True):
            out.append(f"video source lost: reconnecting ({attempts} attempts so far)")
        else:  # video.wait_for_stream: not reached once since the start
            out.append(f"video source not reached yet: connecting ({attempts} attempts so far)")
    recall = getattr(daemon.session, "recall", None)
    archive = getattr(recall, "archive", None)
    if archive is not None and (archive.disk_full or archive.failing):
        why = "disk full" if archive.disk_full else "writes failing"
        out.append(f"archive: {why} ({archive.write_errors} write errors, {archive.dropped} pairs not archived; "
                   f"last: {archive.last_error})")
    frames = getattr(daemon, "frames", None)
    if frames is not None and frames.last_error is not None:  # cleared by the next frame written
        out.append(f"evidence frames: writes failing ({frames.write_errors} write errors; last: {frames.last_error})")
    return out
