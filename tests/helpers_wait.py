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


def let_go(daemon, timeout: float = 300.0) -> bool:
    """Whether ``daemon`` (an ``apps.daemon.loop.Daemon`` told to stop) let go of its evidence frames' file and its
    archive folder within ``timeout`` seconds. A shutdown past its budget (``STOP_BUDGET_S``, which the final
    snapshot's syncs spend on a loaded machine) leaves those closes running in threads of their own after ``run`` has
    returned: a restart in the same process then found the folder held ("is in use by another open archive") and
    never started."""
    from edgekv.archive.store import LOCK_NAME
    from edgekv.folder_lock import lock_folder, unlock_folder

    frames = daemon.frames
    recall = daemon.session.recall if daemon.session is not None else None
    folder = recall.archive.dir if recall is not None else None

    def free() -> bool:
        if frames is not None and not frames.closed:
            return False
        if folder is None:
            return True
        try:  # taken and let go at once: the archive's own lock, as the next opener takes it
            unlock_folder(lock_folder(folder, LOCK_NAME, "archive.dir", "open archive", "", RuntimeError))
        except (RuntimeError, OSError):
            return False
        return True

    return until(free, timeout)
