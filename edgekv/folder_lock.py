"""One owner a folder: an exclusive ``flock`` on a lock file inside it, for the folders a long-running process
appends to (``archive.dir``: edgekv/archive/store.py; ``state.dir``: the daemon's persistent memory).

Two owners of one folder — two daemons given the same config, a service and a hand-started copy, two sessions of
one process — each wrote as if alone: archive records at the same segment offsets (half of them lost at the next
open, without an error), snapshots numbered past each other's and the other's generations deleted. The lock is
held by the open file, so two opens conflict within one process too, and the kernel lets go when the process
dies: a crash leaves nothing stale to clean up. The file holds the holder's pid for the refusal's message. Where
there is no ``fcntl`` (not Linux or macOS) nothing is locked.
"""

from __future__ import annotations

import os
from pathlib import Path


def lock_folder(folder: Path, name: str, key: str, owner: str, same_process_hint: str,
                error: type[Exception] = RuntimeError) -> int | None:
    """Take ``folder/name`` exclusively; the open descriptor (``unlock_folder`` lets go), or None without
    ``fcntl``. Held elsewhere: ``error`` naming ``key`` (the config key, e.g. ``archive.dir``), the holder's pid
    and, when it is this process, ``same_process_hint``."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(Path(folder) / name, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:  # a read-only mount, a full disk: said as "[Errno 30] Read-only file system: '...'" alone
        named = type(exc)(f"{key} {folder}: cannot open its lock file {name} ({exc.strerror or exc})")
        named.errno = exc.errno
        raise named from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
        os.close(fd)
        who = (f"this process: {same_process_hint}" if holder == str(os.getpid()) else
               f"process {holder}: another edgekv daemon with the same {key}?" if holder else "another process")
        raise error(f"{key} {folder} is in use by another {owner} ({who}); each needs a folder of its own") from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def unlock_folder(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the file lets go of its flock
