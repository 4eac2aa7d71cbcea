"""Forget (issue 31 §2): a time window removed from the live cache and from what is saved, with the toy no
longer seeing what the window held, and none of its key/value bytes left in a snapshot file."""

from __future__ import annotations

import pytest
import torch

import edgekv
from edgekv.cache.capped import SlotKind

SOURCE = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # purple triangle: pair 60


def _session(**cache):
    rt = edgekv.Runtime.from_pretrained("builtin:toy", model={"dtype": "fp32", "device": "cpu"},
                                        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64,
                                               **cache},
                                        video={"resolution": [112, 112], "fps": 2.0})
    session = rt.session()
    from edgekv.video.sources import iter_frames

    for frame, t in iter_frames(SOURCE):
        session.ingest(frame, t=t)
    return rt, session


def _pair_bytes(session, pair: int) -> list[bytes]:
    """Runs of the cache's K bytes of ``pair`` (64 bytes of each slot's key), to look for in files."""
    cache, n = session.cache, session.cache.length
    where = torch.nonzero((cache.frame[:, :, :n] == pair) & (cache.kind[:, :, :n] == int(SlotKind.VISION)))
    return [cache.k[layer, head, slot].contiguous().numpy().tobytes()[:64] for layer, head, slot in where.tolist()[:32]]


def test_forgetting_a_window_removes_it_from_the_cache_and_the_answers(tmp_path):
    rt, session = _session()
    assert session.probe("Was there a purple triangle?").p_yes > 0.9
    assert 60 in session.pair_times and session.pair_times[60] == pytest.approx(60.0)
    secrets = _pair_bytes(session, 60)
    assert secrets
    length = session.cache.length
    result = session.forget(59.5, 60.5)  # pair 60: frames at t = 60.0 and 60.5
    assert result["pairs"] == [60] and result["slots"] > 0
    cache, n = session.cache, session.cache.length
    assert n < length and not bool((cache.frame[:, :, :n] == 60).any())
    assert float(cache.k[:, :, n:length].abs().sum()) == 0.0  # the freed slots hold no bytes
    assert 60 not in session.pair_times
    assert session.probe("Was there a purple triangle?").p_yes < 0.5  # the toy no longer saw it
    answer = session.ask("Was there a purple triangle?", max_new_tokens=2, temperature=0.0)
    assert answer.text == "no"
    snapshot = tmp_path / "after.ekv"
    session.save(snapshot)
    data = snapshot.read_bytes()
    assert not any(run in data for run in secrets)
    restored = rt.restore(snapshot)
    assert restored.ask("Was there a purple triangle?", max_new_tokens=2, temperature=0.0).text == "no"
    assert 60 not in restored.pair_times and restored.pair_times == session.pair_times


def test_forget_refuses_a_backwards_window():
    rt, session = _session()
    with pytest.raises(ValueError, match="from <= to"):
        session.forget(10.0, 5.0)
    assert session.forget(1e6, 2e6) == {"pairs": [], "slots": 0, "cache_tokens": session.cache.length}
    del rt
