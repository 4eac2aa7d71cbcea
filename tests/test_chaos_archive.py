"""Faults at the file-system boundary of ``FrameArchive.expire`` and ``forget`` (the daemon calls ``expire`` every
minute from its main loop: ``Daemon._expire_kept``, with no handler around it).

A segment file that cannot be removed — a disk the kernel remounted read-only after an I/O error, EIO — made
``expire`` raise out of the daemon's loop turn, and the segment had already left the index first: its file stayed
on the disk, unknown to retention for the rest of the run."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

from helpers_archive import SHAPE, TOKENS, aging_archive
from helpers_archive import MonotonicLater as _Later
from helpers_archive import fill_at as _fill
from helpers_archive import segment_names as _segments

import edgekv.archive.store as store
from edgekv.archive.store import FrameArchive

A = b"a" * 16


def _archive(folder: Path, max_age_s: float | None = 600.0) -> FrameArchive:
    return aging_archive(folder, max_age_s)


class _ReadOnly:
    """``Path.unlink`` of the archive's segments fails with ``code`` while ``on``."""

    def __init__(self, monkeypatch, code: int = errno.EROFS) -> None:
        self.on, self.code, real = True, code, Path.unlink

        def unlink(path: Path, missing_ok: bool = False) -> None:
            if self.on and path.name.startswith("seg-") and path.name.endswith(".ekva"):
                raise OSError(self.code, os.strerror(self.code), str(path))
            real(path, missing_ok=missing_ok)
        monkeypatch.setattr(Path, "unlink", unlink)


@pytest.mark.parametrize("code", [errno.EROFS, errno.EIO])
def test_expire_on_a_disk_that_refuses_deletes_keeps_the_segments_indexed_and_says_so(tmp_path, monkeypatch,
                                                                                      caplog, code):
    archive = _archive(tmp_path)
    _fill(archive, [(pair, 10.0 * pair) for pair in range(10)])
    monkeypatch.setattr(store, "time", _Later(2000.0))
    disk = _ReadOnly(monkeypatch, code)
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        assert archive.expire() == 0  # raised before: the daemon's main loop ended on it
        assert archive.expire() == 0
    said = [r.getMessage() for r in caplog.records if "could not be deleted" in r.getMessage()]
    assert len(said) == 1 and os.strerror(code) in said[0] and "seg-00000001.ekva" in said[0], said
    assert archive.pairs == 10 and len(_segments(tmp_path)) == 5  # nothing lost from the index while kept on disk
    assert os.strerror(code) in archive.stats()["archive_last_error"]
    disk.on = False
    assert archive.expire() == 5 and _segments(tmp_path) == [] and archive.pairs == 0
    archive.close()


def test_retention_that_cannot_delete_a_segment_keeps_it_indexed(tmp_path, monkeypatch):
    """The same at write time (``_make_room``, max_gib): the pair being written fails and is counted, and the
    segment that could not go keeps its pairs, readable, until a later record's retention deletes it."""
    record = SHAPE.record_bytes(TOKENS)
    archive = FrameArchive(tmp_path, SHAPE, max_bytes=6 * record + 600, segment_bytes=2 * record + 200)
    _fill(archive, [(pair, float(pair)) for pair in range(6)])
    disk = _ReadOnly(monkeypatch)
    _fill(archive, [(6, 6.0)])
    assert archive.dropped == 1 and sorted(e.pair for e in archive.entries()) == list(range(6))
    assert len(_segments(tmp_path)) == archive.stats()["archive_segments"]  # none unknown
    disk.on = False
    _fill(archive, [(7, 7.0)])
    assert 7 in [e.pair for e in archive.entries()] and 0 not in [e.pair for e in archive.entries()]
    assert len(_segments(tmp_path)) == archive.stats()["archive_segments"]
    archive.close()
