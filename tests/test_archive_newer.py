"""Segments a newer edgekv wrote (a format past ARCHIVE_FORMAT in the magic), met by this one after a downgrade: named
for what they are once, never read, and never deleted by retention, a torn-header repair, a forget or a reseal."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from helpers_archive import SHAPE, fill
from helpers_archive import newer_segment as _newer_segment

from edgekv.archive.store import (_MAGIC_NAME, ARCHIVE_FORMAT, SEGMENT_MAGIC, FrameArchive, archived_shapes,
                                  newer_segments)


def _archive(folder: Path) -> FrameArchive:
    return FrameArchive(folder, SHAPE, max_bytes=64 << 10, segment_bytes=16 << 10)


def test_a_newer_edgekvs_segments_are_named_and_never_read_or_deleted(tmp_path, caplog):
    assert SEGMENT_MAGIC == _MAGIC_NAME + ARCHIVE_FORMAT.to_bytes(2, "little")  # the files on devices today: format 1
    archive = _archive(tmp_path)
    fill(archive, range(3))
    archive.close()
    bare = _newer_segment(tmp_path / "seg-00000002.ekva")  # a header alone: was "torn" and removed
    full = _newer_segment(tmp_path / "seg-00000003.ekva", b"EKVA" + bytes(range(256)) * 20)
    assert newer_segments(tmp_path) == {tmp_path / "seg-00000002.ekva": ARCHIVE_FORMAT + 1,
                                        tmp_path / "seg-00000003.ekva": ARCHIVE_FORMAT + 1}
    assert list(archived_shapes(tmp_path)) == [tmp_path / "seg-00000001.ekva"]
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        reopened = _archive(tmp_path)
    said = [r.getMessage() for r in caplog.records]
    assert not any("damaged" in m or "skipped" in m or "torn" in m for m in said), said
    (line,) = [m for m in said if "newer edgekv" in m]
    assert (f"2 segment(s) of {tmp_path} (seg-00000002.ekva, seg-00000003.ekva; " in line
            and f"written by a newer edgekv (format {ARCHIVE_FORMAT + 1}, this one reads up to {ARCHIVE_FORMAT}): "
                "not recalled" in line and "never deleted" in line), line
    assert [e.pair for e in reopened.entries()] == [0, 1, 2] and reopened.bad_records == reopened.torn_bytes == 0
    assert sorted(reopened.newer) == [2, 3] and reopened.stats()["archive_newer_segments"] == 2
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        fill(reopened, range(3, 80))  # far past max_gib: retention deletes this edgekv's oldest segments only
    assert sum("newer edgekv" in r.getMessage() for r in caplog.records) == 0  # said once, at the open
    assert reopened.segments_deleted > 0 and 1 not in reopened._segments
    assert min(n for n in reopened._segments) > 3  # new segments numbered after the newer ones, not over them
    reopened.forget(0.0, 1e9)
    reopened.close()
    assert (tmp_path / "seg-00000002.ekva").read_bytes() == bare
    assert (tmp_path / "seg-00000003.ekva").read_bytes() == full


def test_a_daemons_forget_says_it_could_not_search_a_newer_edgekvs_segments(tiny_checkpoint, tmp_path):
    """Their records cannot be read here, so a forget neither finds nor removes what they hold: the caller hears it
    (``archive_not_searched``), not only the log."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon, kept_config

    folder = tmp_path / "archive"
    folder.mkdir()
    _newer_segment(folder / "seg-00000099.ekva")
    with ended_daemon(kept_config(tiny_checkpoint, tmp_path), tmp_path / "out.txt") as daemon:
        times = dict(daemon.session.pair_times)
        result = daemon.forget(times[3], times[3])
    assert result["pairs"] == 1 and "seg-00000099.ekva" in result["archive_not_searched"]
    assert "forget: not searched: 1 segment(s)" in (tmp_path / "out.txt").read_text()
