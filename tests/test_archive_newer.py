"""Segments a newer edgekv wrote (a format past ARCHIVE_FORMAT in the magic), met by this one after a downgrade: named
for what they are once, never read, and never deleted by retention, a torn-header repair, a forget or a reseal."""

from __future__ import annotations

import json
import logging
import zlib
from dataclasses import asdict
from pathlib import Path

from helpers_archive import SHAPE, fill

from edgekv.archive.store import (_MAGIC_NAME, _SEGMENT_HEAD, ARCHIVE_FORMAT, FrameArchive, SEGMENT_MAGIC,
                                  archived_shapes, newer_segments)


def _newer_segment(path: Path, extra: bytes = b"") -> bytes:
    """A segment as a newer edgekv might write it: the magic with format ARCHIVE_FORMAT + 1, a header this one
    could parse (so only the format says it is not its own), then records of a layout it cannot know."""
    key = json.dumps({**asdict(SHAPE), "format": ARCHIVE_FORMAT + 1}, sort_keys=True).encode()
    data = (_MAGIC_NAME + (ARCHIVE_FORMAT + 1).to_bytes(2, "little") + _SEGMENT_HEAD.pack(len(key), zlib.crc32(key))
            + key + extra)
    path.write_bytes(data)
    return data


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
