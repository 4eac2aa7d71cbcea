"""The archive's private memory (issue 31 §2): segments sealed with AES-256-GCM under the ``privacy:`` key, and
``forget`` rewriting the segments without a time window's records."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers_archive import SHAPE, STREAM, byte_runs, fill, pair_kv, read_back

pytest.importorskip("cryptography")

from edgekv.archive.store import ArchiveError, FrameArchive  # noqa: E402
from edgekv.privacy import Key, KeyRing  # noqa: E402

OTHER = b"o" * 16


def _keys(seed: int) -> KeyRing:
    return KeyRing(Key(bytes([seed]) * 32, f"test key {seed}"))



def _archive(folder: Path, **kw) -> FrameArchive:
    kw.setdefault("max_bytes", 1 << 20)
    kw.setdefault("segment_bytes", 4 << 10)  # a few records a segment: a window spans segments
    return FrameArchive(folder, SHAPE, **kw)



def _files(folder: Path) -> bytes:
    return b"".join(path.read_bytes() for path in sorted(folder.glob("seg-*.ekva")))



def _check_reads(archive: FrameArchive, pairs) -> None:
    entries = {e.frame: e for e in archive.entries()}  # frames are distinct across the tests' streams
    for pair in pairs:
        k, v = pair_kv(pair)
        got = archive.read_layers(entries[pair], list(range(SHAPE.layers)))
        assert sorted(got) == list(range(SHAPE.layers)), pair
        for layer, kv in got.items():
            assert torch.equal(kv[0], k[layer]) and torch.equal(kv[1], v[layer])


def test_sealed_segments_hold_no_plaintext_and_read_back_bit_identical(tmp_path):
    archive = _archive(tmp_path, keys=_keys(1))
    fill(archive, range(12))
    archive.close()
    data = _files(tmp_path)
    assert data and not any(run in data for pair in range(12) for run in byte_runs(pair))
    reopened = _archive(tmp_path, keys=_keys(1))
    assert reopened.pairs == 12 and reopened.bad_records == 0 and reopened.damaged_layers == 0
    assert reopened.stats()["archive_sealed_segments"] == reopened.stats()["archive_segments"] > 1
    _check_reads(reopened, range(12))
    # the index works on sealed segments: a pair's own mean key scores it first
    entries, scores = reopened.cosine_scores(reopened.mean_keys([5])[0].float())
    assert entries[int(scores.sum(dim=1).argmax())].pair == 5
    reopened.close()


def test_clear_archive_holds_the_plaintext(tmp_path):
    """The check above can fail: without a key the same bytes are in the files."""
    archive = _archive(tmp_path)
    fill(archive, range(3))
    archive.close()
    data = _files(tmp_path)
    assert all(run in data for run in byte_runs(1))


def test_wrong_or_missing_key_is_one_clear_error_and_the_files_are_untouched(tmp_path):
    archive = _archive(tmp_path, keys=_keys(1))
    fill(archive, range(6))
    archive.close()
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ArchiveError, match=r"seg-\d+\.ekva: sealed with key [0-9a-f]{16}, which this deployment"):
        _archive(tmp_path, keys=_keys(2))
    with pytest.raises(ArchiveError, match=r"seg-\d+\.ekva: sealed \(encrypted\) and this deployment has no key"):
        _archive(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    rotated = _archive(tmp_path, keys=KeyRing(_keys(2).current, [_keys(1).current]))  # key rotation
    assert rotated.pairs == 6
    fill(rotated, range(6, 9))
    _check_reads(rotated, range(9))
    rotated.close()


def test_a_flipped_byte_in_a_sealed_record_costs_that_record_only(tmp_path):
    archive = _archive(tmp_path, keys=_keys(1), segment_bytes=1 << 20, max_bytes=4 << 20)
    fill(archive, range(6))
    entry = {e.frame: e for e in archive.entries()}[2]
    archive.close()
    path = tmp_path / f"seg-{entry.segment:08d}.ekva"
    data = bytearray(path.read_bytes())
    data[entry.offset + 400] ^= 0x01  # inside pair 2's sealed K/V
    path.write_bytes(bytes(data))
    reopened = _archive(tmp_path, keys=_keys(1), segment_bytes=1 << 20, max_bytes=4 << 20)
    assert reopened.damaged_layers == 1 and reopened.pairs == 6
    _check_reads(reopened, [0, 1, 3, 4, 5])
    assert len(reopened.read_layers({e.frame: e for e in reopened.entries()}[2], [0, 1, 2])) == 2
    reopened.close()


@pytest.mark.parametrize("sealed", [False, True])
def test_forget_rewrites_the_segments_without_the_window(tmp_path, sealed):
    keys = _keys(1) if sealed else None
    archive = _archive(tmp_path, keys=keys)
    fill(archive, range(20))
    fill(archive, range(100, 104), stream=OTHER)  # another stream's pairs at t 100..103
    segments = archive.stats()["archive_segments"]
    assert segments >= 4
    plain = archive.forget(4.0, 9.0, stream=STREAM)  # pairs 4..9
    assert plain["pairs"] == 6 and plain["bytes"] > 0 and plain["segments_rewritten"] + plain["segments_deleted"] >= 2
    assert sorted(e.frame for e in archive.entries()) == [*range(4), *range(10, 20), *range(100, 104)]
    _check_reads(archive, [*range(4), *range(10, 20), *range(100, 104)])
    if not sealed:  # the window's bytes are gone from the files, the others' are there
        data = _files(tmp_path)
        assert not any(run in data for pair in range(4, 10) for run in byte_runs(pair))
        assert all(run in data for run in byte_runs(12))
    assert archive.forget(4.0, 9.0)["pairs"] == 0  # nothing left to forget
    assert archive.forget(100.0, 200.0, stream=STREAM)["pairs"] == 0  # the other stream is not this one's
    fill(archive, range(20, 24))  # the writer goes on in a new segment
    archive.close()
    assert not list(tmp_path.glob("*.tmp"))
    reopened = _archive(tmp_path, keys=keys)
    assert sorted(e.frame for e in reopened.entries()) == [*range(4), *range(10, 24), *range(100, 104)]
    assert reopened.bad_records == 0 and reopened.torn_bytes == 0 and reopened.skipped_bytes == 0
    _check_reads(reopened, [*range(4), *range(10, 24)])
    reopened.close()


def test_forget_of_a_whole_segment_deletes_it_and_a_leftover_rewrite_is_removed(tmp_path):
    archive = _archive(tmp_path)
    fill(archive, range(12))
    archive.close()
    names = sorted(p.name for p in tmp_path.glob("seg-*.ekva"))
    reopened = _archive(tmp_path)
    result = reopened.forget(-1.0, 100.0)
    assert result["pairs"] == 12 and result["segments_deleted"] == len(names) and reopened.pairs == 0
    assert not list(tmp_path.glob("seg-*.ekva"))
    reopened.close()
    (tmp_path / "seg-00000009.ekva.tmp").write_bytes(os.urandom(100))  # a rewrite cut short by a crash
    again = _archive(tmp_path)
    assert not list(tmp_path.glob("*.tmp")) and again.pairs == 0
    again.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_sealed_quantized_records_read_back_and_a_forget_removes_them(tmp_path, dtype):
    """archive.kv_dtype int8 / int4 with the privacy key: quantized records sealed like float ones (each layer's codes
    and scales one sealed chunk), read back exactly as their scheme gives them (edgekv/cache/quant.py,
    edgekv/archive/quant4.py); a forget rewrites the segments without the window's records and the rest still
    read."""
    from edgekv.archive.store import KVShape

    shape = KVShape(SHAPE.layers, SHAPE.kv_heads, SHAPE.head_dim, dtype, SHAPE.index_keys)
    archive = FrameArchive(tmp_path, shape, max_bytes=1 << 20, segment_bytes=2 << 10, keys=_keys(3),
                           stage_dtype=torch.float32)
    fill(archive, range(10))
    assert archive.stats()["archive_sealed_segments"] > 1
    assert archive.forget(3.0, 5.0)["pairs"] == 3
    archive.close()
    reopened = FrameArchive(tmp_path, shape, max_bytes=1 << 20, segment_bytes=2 << 10, keys=_keys(3),
                            stage_dtype=torch.float32)
    entries = {e.frame: e for e in reopened.entries()}
    assert sorted(entries) == [0, 1, 2, 6, 7, 8, 9] and reopened.bad_records == 0
    for pair in entries:
        got = reopened.read_layers(entries[pair], list(range(SHAPE.layers)))
        assert sorted(got) == list(range(SHAPE.layers))
        assert torch.equal(torch.stack([got[layer] for layer in range(SHAPE.layers)]), read_back(dtype, pair))
    reopened.close()
