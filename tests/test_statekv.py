"""StateKV sinks inside the capped cache: B large => capped-full attention; sinks are flags inside the
cap, never evicted by CKV; per-pair prefill sees only prefix + sinks + the pair."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import edgekv
from edgekv.cache import SlotKind

FPS = 2.0


def _session(model_dir, **cache):
    cache = {"max_tokens": 600, "text_reserve_tokens": 64, **cache}
    rt = edgekv.Runtime.from_pretrained(model_dir, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [112, 112], "fps": FPS}, cache=cache)
    return rt.session()


def _frames(count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (60, 80, 3), dtype=np.uint8) for _ in range(count)]


def test_sinks_covering_everything_equal_capped_full_attention(tiny_checkpoint):
    frames = _frames(12)
    plain = _session(tiny_checkpoint, policy="full")
    sinks = _session(tiny_checkpoint, policy="full", sinks=599)
    for i, frame in enumerate(frames):
        plain.ingest(frame, t=i / FPS)
        sinks.ingest(frame, t=i / FPS)
    n = plain.cache.length
    assert sinks.cache.length == n and int(sinks.cache.sink[0, 0, :n].sum()) == n - plain.prefix_tokens
    assert torch.allclose(plain.cache.k[:, :, :n], sinks.cache.k[:, :, :n], atol=1e-5)
    assert torch.allclose(plain.question_logits("Same?"), sinks.question_logits("Same?"), atol=1e-4)


def test_small_b_restricts_prefill_and_keeps_b_sinks_per_layer_and_head(tiny_checkpoint):
    session = _session(tiny_checkpoint, policy="statekv", sinks=8)
    for i, frame in enumerate(_frames(16, seed=1)):
        session.ingest(frame, t=i / FPS)
        n = session.cache.length
        if session.counters.frame_pairs:
            per_head = session.cache.sink[:, :, :n].sum(-1)
            assert bool((per_head == 8).all())
            kinds = session.cache.kind[:, :, :n][session.cache.sink[:, :, :n]]
            assert bool((kinds == int(SlotKind.VISION)).all())  # sinks are video tokens, flags in the cache
    assert session.stats()["sink_tokens"] == 8


def test_sinks_change_what_a_pair_sees(tiny_checkpoint):
    frames = _frames(8, seed=2)
    outputs = []
    for sinks in (0, 4):
        session = _session(tiny_checkpoint, policy="full", sinks=sinks)
        for i, frame in enumerate(frames):
            session.ingest(frame, t=i / FPS)
        outputs.append(session.cache.k[:, :, session.prefix_tokens + 16:session.cache.length].clone())
    # layer 0 keys depend only on the token itself; deeper layers see a different context with B=4
    assert torch.allclose(outputs[0][0], outputs[1][0], atol=1e-6)
    assert not torch.allclose(outputs[0][1:], outputs[1][1:], atol=1e-4)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget=st.integers(1, 60), max_tokens=st.integers(300, 500), pairs=st.integers(2, 30))
def test_property_sinks_never_leave_the_cap_and_are_never_evicted(tiny_checkpoint, budget, max_tokens, pairs):
    session = _session(tiny_checkpoint, policy="statekv", sinks=budget, max_tokens=max_tokens)
    pointers = session.cache.data_ptrs()
    for i, frame in enumerate(_frames(2 * pairs, seed=budget)):
        if i % 2 == 1:
            sinks_before = _sink_ids(session)
            compressions = session.stats()["compressions"]
        session.ingest(frame, t=i / FPS)
        assert session.cache.length <= session.video_limit <= max_tokens
        if i % 2 == 1 and session.stats()["compressions"] > compressions:
            # the compression ran before this pair's prefill: every earlier sink survived it
            survivors = _ids(session)
            assert sinks_before <= survivors
    assert session.cache.data_ptrs() == pointers


def _ids(session):
    c, n = session.cache, session.cache.length
    return {(l, h, int(f), int(r), int(col)) for l in range(c.num_layers) for h in range(c.kv_heads)
            for f, r, col in zip(c.frame[l, h, :n], c.row[l, h, :n], c.col[l, h, :n])}


def _sink_ids(session):
    c, n = session.cache, session.cache.length
    out = set()
    for l in range(c.num_layers):
        for h in range(c.kv_heads):
            mask = c.sink[l, h, :n]
            out |= {(l, h, int(f), int(r), int(col)) for f, r, col in
                    zip(c.frame[l, h, :n][mask], c.row[l, h, :n][mask], c.col[l, h, :n][mask])}
    return out


def test_statekv_needs_a_sink_budget(tiny_checkpoint):
    with pytest.raises(ValueError, match="sinks"):
        _session(tiny_checkpoint, policy="statekv", sinks=0)
