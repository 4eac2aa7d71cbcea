"""The archive's index at scale, on small shapes: its RAM follows the pairs it holds (not a doubled matrix), an open
indexes a segment's records in batches and keeps every one that checks (a damaged one among them skipped), and a
``max_gib`` whose index would pass its bound in RAM keeps the newest pairs that fit, said at the first pair. The big
runs (10^4 - 10^5 pairs, open time, recall latency, the needle among real pairs) are probes:
/work/runs/s96/archive_scale.md and ``edgekv bench archive --parts scale``."""

from __future__ import annotations

import logging

import torch

from edgekv.archive import store
from edgekv.archive.store import _HEAD, FrameArchive
from helpers_archive import SHAPE, STREAM, TOKENS, fill, read_back

# one index row of SHAPE: fp16 keys [layers, kv_heads, 1, head_dim], fp16 weights [layers, kv_heads, 1], fp32 norms
ROW_BYTES = 2 * SHAPE.layers * SHAPE.kv_heads * SHAPE.head_dim + 2 * SHAPE.layers * SHAPE.kv_heads + 4 * SHAPE.layers


def _archive(folder, **kw) -> FrameArchive:
    return FrameArchive(folder, SHAPE, max_bytes=kw.pop("max_bytes", 1 << 30), segment_bytes=16 << 20,
                        queue_pairs=16, when_full="wait", **kw)


def test_index_ram_follows_the_pairs_held_not_a_doubled_matrix(tmp_path):
    archive = _archive(tmp_path)
    fill(archive, range(600))
    # grown by a quarter: at most 1.25 x the rows in use (a doubling matrix held 1,024 rows for 600 pairs, 1.7 x,
    # for as long as the archive was open)
    assert archive.index_bytes <= 1.25 * 600 * ROW_BYTES
    assert archive.stats()["archive_index_bytes"] == archive.index_bytes
    archive.close()
    reopened = _archive(tmp_path)
    assert reopened.pairs == 600
    assert reopened.index_bytes <= (600 + 600 // 16) * ROW_BYTES  # an open keeps the rows in use and a sixteenth
    # the rows read back are the pairs' own: each pair scores first against a query equal to its own mean key
    keys = reopened.mean_keys([5, 300, 599])
    _, scores = reopened.cosine_scores(keys[1])
    assert int(scores.mean(dim=1).argmax()) == 300
    reopened.close()


def test_an_open_indexes_every_record_that_checks_across_its_batches(tmp_path):
    archive = _archive(tmp_path)
    fill(archive, range(3 * store._SCAN_BATCH + 5))
    entries = archive.entries()
    archive.close()
    victim = entries[store._SCAN_BATCH]  # the first record of the second batch: its meta's CRC fails
    path = tmp_path / f"seg-{victim.segment:08d}.ekva"
    data = bytearray(path.read_bytes())
    data[victim.offset + _HEAD.size + 8] ^= 0xFF
    path.write_bytes(bytes(data))
    reopened = _archive(tmp_path)
    kept = reopened.entries()
    assert [e.pair for e in kept] == [e.pair for e in entries if e.pair != victim.pair]
    assert reopened.bad_records == 1
    for entry in (kept[store._SCAN_BATCH - 1], kept[store._SCAN_BATCH], kept[-1]):  # around the damage, the last
        got = reopened.read_layers(entry, list(range(SHAPE.layers)))
        assert sorted(got) == list(range(SHAPE.layers))
        for layer, kv in got.items():
            torch.testing.assert_close(kv, read_back("float32", entry.pair)[layer], rtol=0, atol=0)
    assert len({id(e.stream) for e in kept}) == 1 and kept[0].stream == STREAM  # one bytes object for the stream
    reopened.close()


def test_the_index_is_bounded_in_ram_and_said_at_the_first_pair_where_it_binds(tmp_path, monkeypatch, caplog):
    """An 8 GB board and 64 GiB of records of a few KiB (~40 million pairs): their index would take ~30 GiB of RAM.
    The bound (an eighth of the RAM unless archive.max_index_mib sets it) keeps the newest pairs that fit and says
    so at the first pair; before it, the index was bounded by max_gib alone, and a warning let it take the RAM."""
    ram = 8 << 30
    monkeypatch.setattr(store, "_ram_bytes", lambda: ram)
    archive = _archive(tmp_path, max_bytes=64 << 30)
    entry = ROW_BYTES + store.ENTRY_BYTES
    assert archive.index_entry_bytes == entry and archive.max_index_pairs == (ram // 8) // entry
    pairs, need = archive.index_bound(TOKENS)
    assert (pairs, need) == (archive.max_index_pairs, archive.max_index_pairs * entry) and need <= ram // 8
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        fill(archive, range(2))
    said = [r.getMessage() for r in caplog.records if "index would take" in r.getMessage()]
    disk = (64 << 30) // SHAPE.record_bytes(TOKENS)
    assert len(said) == 1 and f"archive.max_gib 64 holds {disk:,} pairs" in said[0], said
    assert f"an eighth of this machine's RAM (1.00 GiB; archive.max_index_mib sets it) keeps the newest {pairs:,}" \
        in said[0], said
    assert archive.pairs == 2
    archive.close()
    roomy = _archive(tmp_path / "roomy", max_bytes=64 << 30, max_index_bytes=disk * entry)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        fill(roomy, range(1))
    assert not [r for r in caplog.records if "index would take" in r.getMessage()]
    assert roomy.index_bound(TOKENS) == (disk, disk * entry)
    roomy.close()


def test_past_the_index_bound_the_oldest_segments_go_and_a_lowered_bound_trims_at_open(tmp_path, caplog):
    record = SHAPE.record_bytes(TOKENS)
    entry = ROW_BYTES + store.ENTRY_BYTES

    def small(bound_pairs: int) -> FrameArchive:
        return FrameArchive(tmp_path, SHAPE, max_bytes=1 << 30, segment_bytes=4 * record + 200,
                            max_index_bytes=bound_pairs * entry + entry // 2)

    archive = small(12)
    fill(archive, range(40))
    kept = [e.pair for e in archive.entries()]
    assert kept == list(range(40 - len(kept), 40)) and 12 - 4 < len(kept) <= 12  # the newest, whole segments
    assert archive.stats()["archive_segments_over_index"] == archive.segments_deleted > 0
    archive.close()
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        lowered = small(6)
    assert [e.pair for e in lowered.entries()] == kept[-len(lowered.entries()):] and len(lowered.entries()) <= 6
    said = [r.getMessage() for r in caplog.records if "deleted at open" in r.getMessage()]
    assert len(said) == 1 and "the index held more than the 6 pairs of archive.max_index_mib" in said[0], said
    lowered.close()
