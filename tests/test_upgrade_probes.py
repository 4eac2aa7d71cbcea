"""A device upgraded in the field, or rolled back: state and archive folders written by another edgekv version,
built here byte by byte (never by the old code), read by today's."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from edgekv.archive.store import _SEGMENT_HEAD, SEGMENT_MAGIC, archived_shapes


def _segment(path: Path, fields: dict) -> None:
    """A segment file holding only its header: magic, u32 JSON bytes, u32 crc32(JSON), the JSON shape key."""
    key = json.dumps(fields, sort_keys=True).encode()
    path.write_bytes(SEGMENT_MAGIC + _SEGMENT_HEAD.pack(len(key), zlib.crc32(key)) + key)


def test_check_refuses_an_archive_a_rolled_back_edgekv_appended_first_format_segments_to(tmp_path, tiny_checkpoint):
    """Rolled back to 553e19a (the commit before 095afa9 added index_keys), an edgekv cut today's segment to its
    header (its records' meta is longer than the first format's: "a torn write") and went on in a new segment of the
    first format. Today's start then refused that segment, yet ``--check``, reading the first segment only, said the
    daemon would start. Each segment is compared now, and the mixed archive is named for what it is."""
    from edgekv.apps.daemon.startup import StartupError, check_archive_shape
    from edgekv.calibration.plan import archive_shape
    from edgekv.config import EdgeKVConfig

    folder = tmp_path / "archive"
    folder.mkdir()
    config = EdgeKVConfig().with_overrides(model={"path": str(tiny_checkpoint), "dtype": "fp32"},
                                           archive={"dir": str(folder)})
    shape, _ = archive_shape(config, tiny_checkpoint)
    assert shape.index_keys == 2  # today's default
    today = {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": shape.dtype}
    _segment(folder / "seg-00000001.ekva", {**today, "index_keys": 2})  # today's header, its records cut off
    _segment(folder / "seg-00000002.ekva", today)  # 553e19a's header: asdict(KVShape) had no index_keys
    assert [s.index_keys for s in archived_shapes(folder).values()] == [2, 1]
    with pytest.raises(StartupError) as refused:
        check_archive_shape(config)
    text = str(refused.value)
    assert "archive.index_keys=2 (from seg-00000001.ekva) and 1 (from seg-00000002.ekva)" in text, text
    assert "point archive.dir at another folder" in text
    assert sorted(p.name for p in folder.iterdir()) == ["seg-00000001.ekva", "seg-00000002.ekva"]  # left as they are


def test_check_reads_a_first_format_archive_alone_as_before(tmp_path, tiny_checkpoint):
    """An archive of 553e19a's segments only: refused with the index_keys to set, as before (one format, one fix)."""
    from edgekv.apps.daemon.startup import StartupError, check_archive_shape
    from edgekv.calibration.plan import archive_shape
    from edgekv.config import EdgeKVConfig

    folder = tmp_path / "archive"
    folder.mkdir()
    config = EdgeKVConfig().with_overrides(model={"path": str(tiny_checkpoint), "dtype": "fp32"},
                                           archive={"dir": str(folder)})
    shape, _ = archive_shape(config, tiny_checkpoint)
    first = {"layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "dtype": shape.dtype}
    _segment(folder / "seg-00000001.ekva", first)
    _segment(folder / "seg-00000002.ekva", first)
    with pytest.raises(StartupError, match="was indexed with archive.index_keys=1, this config has 2"):
        check_archive_shape(config)
    one = EdgeKVConfig().with_overrides(model={"path": str(tiny_checkpoint), "dtype": "fp32"},
                                        archive={"dir": str(folder), "index_keys": 1})
    assert check_archive_shape(one) == "records of float32, as this config writes them"


def test_a_snapshot_of_a_newer_format_says_a_newer_edgekv_wrote_it(tmp_path):
    """A rollback to an older edgekv met the newer one's snapshot as "snapshot format 2, this edgekv reads 1": the
    way out (upgrade again) was left to guess."""
    from edgekv.state import FORMAT, SnapshotError, read_manifest, write_snapshot

    path = tmp_path / "snapshot-00000001.ekv"
    write_snapshot(path, {"format": FORMAT + 1}, {})
    with pytest.raises(SnapshotError, match=rf"format {FORMAT + 1}, this edgekv reads {FORMAT} \(written by a newer "
                                            r"edgekv: upgrade this one to resume it\)"):
        read_manifest(path)
    write_snapshot(path, {"format": "x"}, {})
    with pytest.raises(SnapshotError, match=r"format 'x', this edgekv reads \d+$"):
        read_manifest(path)
