"""A full disk at the last step of an atomic write (tests/test_rekey.py, tests/test_state_faults.py): the rename of
the written copy over the file fails with ENOSPC, as a write that found no room would, and the file stays as it was."""

from __future__ import annotations

import errno
import os


def full_disk_at_rename(monkeypatch, suffix: str) -> None:
    """``os.replace`` onto a file whose name ends in ``suffix`` fails with ENOSPC until ``monkeypatch.undo()`` or the
    test's end; other renames go through."""
    replace = os.replace

    def disk_full(src, dst, *args, **kwargs):
        if str(dst).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", disk_full)
