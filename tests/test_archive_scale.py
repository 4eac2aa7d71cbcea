"""The archive's index at scale, on small shapes: its RAM follows the pairs it holds (not a doubled matrix), an open
indexes a segment's records in batches and keeps every one that checks (a damaged one among them skipped), and a
``max_gib`` whose index would not fit the machine's RAM is said at the first pair. The big runs (10^4 - 10^5 pairs,
open time, recall latency, the needle among real pairs) are probes: /work/runs/s96/archive_scale.md and
``edgekv bench archive --parts scale``."""

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


def test_a_max_gib_whose_index_would_not_fit_the_ram_is_said_at_the_first_pair(tmp_path, monkeypatch, caplog):
    archive = _archive(tmp_path, max_bytes=64 << 30)  # 64 GiB of records of a few KiB: ~40 million pairs
    pairs, need = archive.index_bound(TOKENS)
    assert pairs == (64 << 30) // SHAPE.record_bytes(TOKENS)
    monkeypatch.setattr(store, "_ram_bytes", lambda: 4 * need - 1)
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        fill(archive, range(2))
    said = [r.getMessage() for r in caplog.records if "index would take" in r.getMessage()]
    assert len(said) == 1 and "archive.max_gib 64 holds" in said[0] and f"{pairs:,} pairs" in said[0], said
    assert archive.pairs == 2  # said, not refused: the pairs are archived
    archive.close()
    roomy = _archive(tmp_path / "roomy", max_bytes=64 << 30)
    monkeypatch.setattr(store, "_ram_bytes", lambda: 4 * need)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="edgekv.archive"):
        fill(roomy, range(1))
    assert not [r for r in caplog.records if "index would take" in r.getMessage()]
    roomy.close()
