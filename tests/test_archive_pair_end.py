"""Where an archived pair ends: a record is stamped with its first frame, and one frame prefilled as a pair of itself
(an odd last frame, ``StreamSession.finish_pair``) ends there, where a pair of two ends a frame interval on. Its record
says so (the sign of ``rows``, a field no edgekv read back: no new segment format), so a question about a window after
that frame does not recall it (the recall took every record for two frames and brought it back for a window that
begins a frame interval after it), and segments an earlier edgekv wrote still read, recall and take new records.
The restart after a ``kill -9`` at such a pair: tests/test_restart_after_kill.py."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from helpers_archive import (EARLIER_SEGMENT, SHAPE, earlier_layout, fill_at, pair_kv, read_back, records,
                             segment_names)

import edgekv
from edgekv.archive.store import _META, FrameArchive
from edgekv.cache import SlotKind

FPS = 2.0


def _archive(folder, **kw) -> FrameArchive:
    return FrameArchive(folder, SHAPE, max_bytes=1 << 20, segment_bytes=1 << 19, **kw)


def _read_back_exactly(archive: FrameArchive, pairs) -> None:
    entries = {e.frame: e for e in archive.entries()}
    for pair in pairs:
        got = archive.read_layers(entries[pair], list(range(SHAPE.layers)))
        assert torch.equal(torch.stack([got[layer] for layer in range(SHAPE.layers)]), read_back("float32", pair))


def test_a_segment_an_earlier_edgekv_wrote_reads_as_pairs_of_two_and_new_records_follow_it(tmp_path):
    shutil.copy(EARLIER_SEGMENT, tmp_path / "seg-00000001.ekva")
    archive = _archive(tmp_path)
    assert archive.bad_records == archive.torn_bytes == archive.skipped_bytes == 0
    assert [(e.pair, e.t, e.tpos, e.rows, e.cols, e.frames) for e in archive.entries()] == [
        (pair, pair / 2, 10 + pair, 2, 2, 2) for pair in range(4)]
    assert [e.t_last(0.5) for e in archive.entries()] == [0.5, 1.0, 1.5, 2.0]  # a frame interval on, as before
    _read_back_exactly(archive, range(4))
    entries, scores = archive.cosine_scores(archive.mean_keys([2])[0].float())  # recall ranks from its index rows
    assert entries[int(scores.sum(dim=1).argmax())].pair == 2
    fill_at(archive, [(4, 2.0), (5, 2.5)], one_frame=frozenset({5}))  # the stream's odd last frame
    archive.close()
    reopened = _archive(tmp_path)
    assert segment_names(tmp_path) == ["seg-00000001.ekva", "seg-00000002.ekva"]
    assert (tmp_path / "seg-00000001.ekva").read_bytes() == EARLIER_SEGMENT.read_bytes()  # left as it was
    assert [(e.pair, e.rows, e.frames, e.t_last(0.5)) for e in reopened.entries()] == [
        (0, 2, 2, 0.5), (1, 2, 2, 1.0), (2, 2, 2, 1.5), (3, 2, 2, 2.0), (4, 2, 2, 2.5), (5, 2, 1, 2.5)]
    _read_back_exactly(reopened, range(6))
    reopened.close()


def test_records_of_two_frames_are_laid_out_as_an_earlier_edgekv_wrote_them(tmp_path):
    """What changed on disk is the sign of a one-frame record's rows, nothing else: the same pairs written now are the
    earlier segment's records, field for field (the index row aside: it is computed, not copied)."""
    archive = _archive(tmp_path)
    fill_at(archive, [(pair, pair / 2) for pair in range(4)])
    archive.close()
    summary = SHAPE.summary_bytes()
    now, before = records(tmp_path / "seg-00000001.ekva"), records(EARLIER_SEGMENT)
    assert len(now) == len(before) == 4
    for (head, meta, kv), (head_before, meta_before, kv_before) in zip(now, before):
        assert head[:3] == head_before[:3] and head[4] == head_before[4]  # magic, lengths, record number
        assert meta[:-summary] == meta_before[:-summary] and kv == kv_before
    # the last pair one frame (as this edgekv writes an odd last frame): its rows' sign alone differs, and the
    # earlier layout of it (``earlier_layout``, rows positive) is the earlier segment's record
    lone = tmp_path / "lone"
    archive = _archive(lone)
    fill_at(archive, [(pair, pair / 2) for pair in range(4)], one_frame=frozenset({3}))
    archive.close()
    meta = records(lone / "seg-00000001.ekva")[3][1]
    assert _META.unpack_from(meta)[5] == -2 and _META.unpack_from(meta_before)[5] == 2
    assert meta[:_META.size] == _META.pack(*_META.unpack_from(meta_before)[:5], -2, *_META.unpack_from(meta_before)[6:])
    assert earlier_layout(lone) == 1
    assert [(r[0][:3], r[1][:-summary]) for r in records(lone / "seg-00000001.ekva")] == [
        (r[0][:3], r[1][:-summary]) for r in before]
    again = _archive(lone)
    assert [(e.frames, e.rows) for e in again.entries()] == [(2, 2)] * 4 and again.bad_records == 0
    again.close()


@pytest.mark.parametrize("sealed", [False, True])
def test_a_one_frame_record_stays_one_frame_through_a_reopen_and_a_forget(tmp_path, sealed):
    keys = None
    if sealed:
        pytest.importorskip("cryptography")
        from edgekv.privacy import Key, KeyRing

        keys = KeyRing(Key(bytes([7]) * 32, "test key 7"))
    archive = _archive(tmp_path, keys=keys)
    fill_at(archive, [(0, 0.0), (1, 0.5), (2, 1.0)], one_frame=frozenset({2}))
    assert [e.frames for e in archive.entries()] == [2, 2, 1]
    assert archive.forget(0.5, 0.5)["pairs"] == 1  # the segment is rewritten, its records copied as they are
    assert [(e.frame, e.frames) for e in archive.entries()] == [(0, 2), (2, 1)]
    archive.close()
    reopened = _archive(tmp_path, keys=keys)
    assert [(e.frame, e.rows, e.frames) for e in reopened.entries()] == [(0, 2, 2), (2, 2, 1)]
    assert reopened.bad_records == 0
    _read_back_exactly(reopened, [0, 2])
    reopened.close()


def test_a_frame_count_or_grid_that_cannot_be_stored_is_refused_by_name_and_nothing_is_queued(tmp_path):
    archive = _archive(tmp_path)
    k, v = pair_kv(0)
    for frames, rows in ((3, 2), (0, 2), (2, 0), (1, -2), (2, 1 << 15)):
        with pytest.raises(ValueError, match=f"frames must be 1 or 2 and rows 1 to 32767, got frames={frames}, "
                                             f"rows={rows}"):
            archive.submit(k, v, frame=0, t=0.0, tpos=0, t_offset=0, rows=rows, cols=2, stream=b"s" * 16,
                           frames=frames)
    assert archive.flush() and archive.pairs == 0 and archive.next_pair == 0
    archive.close()


def _session(model_dir, folder):
    archive = {"dir": str(folder), "max_gib": 0.01, "segment_mib": 1.0, "top_k": 2, "when_full": "wait"}
    rt = edgekv.Runtime.from_pretrained(model_dir, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [56, 56], "fps": FPS},
                                        cache={"policy": "sliding_window", "max_tokens": 140,
                                               "text_reserve_tokens": 64},
                                        generation={"max_new_tokens": 2}, archive=archive)
    return rt.session()


def test_window_recall_leaves_out_a_one_frame_pair_before_the_window(tiny_checkpoint, tmp_path):
    """Pair 5 is the frame at 5 s alone (a recording that ended on an odd frame, as the daemon archives it); the stream
    goes on at 5.5 s. A window of 5.25-5.5 s holds the frame at 5.5 s only: the recall brings back pair 6 (5.5 and 6 s),
    not pair 5, which has no frame in it."""
    session = _session(tiny_checkpoint, tmp_path / "archive")
    rng = np.random.default_rng(3)

    def ingest(times) -> None:
        for t in times:
            session.ingest(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), t=t)

    ingest(i / FPS for i in range(11))
    assert session.finish_pair().pair_index == 5  # archived as a pair of one frame
    ingest(5.5 + i / FPS for i in range(40))
    assert session.recall.archive.flush()
    n, cache = session.cache.length, session.cache
    held = set(cache.frame[:, :, :n][cache.kind[:, :, :n] == int(SlotKind.VISION)].tolist())
    assert held.isdisjoint({4, 5, 6, 7})  # they left the cache: only a recall brings them back
    entries = {e.frame: e for e in session.recall.archive.entries(session.recall.stream)}
    assert [(entries[p].t, entries[p].frames) for p in (4, 5, 6)] == [(4.0, 2), (5.0, 1), (5.5, 2)]
    after = session.ask("What moved?", max_new_tokens=2, recall=True, window=(5.25, 5.5))
    assert after.recalled == (6,) and after.window_pairs == 1, after.recalled
    on = session.ask("What moved?", max_new_tokens=2, recall=True, window=(5.0, 5.0))
    assert on.recalled == (5,) and on.window_pairs == 1, on.recalled  # the window holds its one frame
    before = session.ask("What moved?", max_new_tokens=2, recall=True, window=(4.5, 5.0))
    assert before.recalled == (4, 5), before.recalled  # pair 4's second frame (4.5 s) is in it, as 5 s is
    session.close()
