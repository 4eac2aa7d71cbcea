"""Files written whole or not at all, and kept through a power cut: the one way edgekv writes a small file it must
find again after a crash (the pause, the forget journal, the standing questions, the kept alerts).

The bytes go to ``.<name>.tmp-<pid>`` beside the file, are fsynced, and the temporary file is renamed over the old
one (``rename(2)`` is atomic within a file system), then the folder is fsynced so that the rename itself reaches
the flash (ext4's ``data=ordered`` keeps the file's blocks, not the new directory entry, without it). A crash leaves
the old file or the new one, never a torn one; a write that fails leaves the old file and no temporary one. The
temporary name is the one ``StateKeeper`` sweeps at start (``.<prefix>*.tmp-*``)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "replace_durably"]


def fsync_dir(folder: Path) -> None:
    """fsync a folder (its entries: a rename, a new or deleted file). Never raises: some file systems refuse a
    folder's fsync, and the files themselves were fsynced."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes, mode: int = 0o600) -> None:
    """``path`` holds ``data`` from now on, through a power cut (the module's docstring); created with ``mode``
    (the owner's only, by default: what edgekv keeps tells of what was seen). ``OSError`` when it could not be
    written: the old file stays."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # a read-only file system refuses even this (EROFS before ENOENT): nothing was written
            pass
        raise
    fsync_dir(path.parent)
