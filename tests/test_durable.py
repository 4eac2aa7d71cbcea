"""edgekv/durable.py: the small files edgekv must find again after a crash are written whole or not at all."""

from __future__ import annotations

import errno
import os
import stat

import pytest

from edgekv.durable import replace_durably


def test_a_file_is_replaced_whole_owner_only_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "paused.json"
    replace_durably(path, b'{"reason": "a"}')
    replace_durably(path, b'{"reason": "b"}')
    assert path.read_bytes() == b'{"reason": "b"}'
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["paused.json"]


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "alerts.json"
    replace_durably(path, b"old")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        replace_durably(path, b"new")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["alerts.json"]
