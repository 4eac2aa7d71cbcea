"""adaptive_infinipot_v: AdaReTaKe's time-adaptive budget (eq. 8-9) on top of InfiniPot-V's scores."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgekv
from edgekv.cache.capped import SlotKind
from edgekv.policies import make_policy
from edgekv.policies.adaptive_infinipot_v import pair_distance, stretch_quotas

FPS = 2.0


def test_quotas_follow_the_weights_and_never_exceed_what_a_stretch_holds():
    quota = stretch_quotas(torch.tensor([30, 10, 100]), torch.tensor([[40, 40], [5, 40], [5, 7]]),
                           torch.tensor([1.0, 2.0]))
    # eq. 9 split; a full stretch hands over what it cannot take; a budget over everything keeps all
    assert quota.flatten().tolist() == pytest.approx([10, 20, 10 / 3, 20 / 3, 5, 7])
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        held = torch.randint(0, 30, (4, 6), generator=generator)
        budget = torch.randint(0, 120, (4,), generator=generator)
        quota = stretch_quotas(budget, held, torch.rand(6, generator=generator) + 0.01)
        assert bool((quota <= held).all()) and bool((quota >= 0).all())
        assert quota.sum(-1).tolist() == pytest.approx(torch.minimum(budget, held.sum(-1)).tolist())


def test_distance_is_one_minus_the_mean_cosine_and_the_floor_holds():
    tokens = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    assert pair_distance(tokens, tokens) == pytest.approx(0.0, abs=1e-6)
    assert pair_distance(tokens, -tokens) == pytest.approx(2.0)
    policy = make_policy("adaptive_infinipot_v", chunk_pairs=4, floor=0.25)
    policy.distances = {1: 0.0, 2: 0.0, 5: 0.8, 6: 0.4}  # stretch 0 static, stretch 1 changing
    weights = policy.stretch_weights(3)
    mean = (0.0 + 0.6) / 2
    assert weights.tolist() == pytest.approx([0.25 * mean, 0.6, mean])  # floored; unmeasured = the mean
    with pytest.raises(ValueError, match="cache.adaptive_floor must be in"):
        make_policy("adaptive_infinipot_v", floor=0.0)


def _bursty_frames(pairs: int, period: int, seed: int = 0) -> list[np.ndarray]:
    """Stretches of ``period`` pairs alternate: one still frame, then a new random frame every frame."""
    rng = np.random.default_rng(seed)
    still = rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)
    frames = []
    for pair in range(pairs):
        burst = (pair // period) % 2 == 1
        frames += [rng.integers(0, 256, (56, 56, 3), dtype=np.uint8) if burst else still for _ in range(2)]
    return frames


def test_a_bursty_stream_keeps_more_of_its_bursts_and_every_stretch_survives(tiny_checkpoint):
    frames = _bursty_frames(60, period=10)
    kept = {}
    for policy in ("infinipot_v", "adaptive_infinipot_v"):
        runtime = edgekv.Runtime.from_pretrained(
            tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 56], "fps": FPS},
            cache={"policy": policy, "max_tokens": 140, "text_reserve_tokens": 32, "adaptive_chunk_pairs": 10})
        session = runtime.session()
        for index, frame in enumerate(frames):
            session.ingest(frame, t=index / FPS)
        assert session.stats()["compressions"] >= 3
        n = session.cache.length
        frame = session.cache.frame[:, :, :n].long()
        vision = session.cache.kind[:, :, :n] == 2
        old = vision & (frame < 50)  # the stretches a compression had to choose between
        kept[policy] = (int((old & ((frame // 10) % 2 == 1)).sum()), int((old & ((frame // 10) % 2 == 0)).sum()))
        if policy == "adaptive_infinipot_v":
            for stretch in range(0, 5, 2):  # static stretches: squeezed, never gone, in every (layer, head)
                assert bool(((old & (frame // 10 == stretch)).sum(-1) >= 1).all())
            restored = make_policy("adaptive_infinipot_v")
            restored.load_state(session.policy.state())
            assert restored.distances == session.policy.distances
    assert kept["adaptive_infinipot_v"][0] > kept["infinipot_v"][0]
    assert kept["adaptive_infinipot_v"][1] < kept["infinipot_v"][1]


def _scored_view(seed: int):
    """A 60-pair cache (tests/test_policies.ToySession: a real CappedKVCache, a 3-slot prefix, one recent pair)
    and random InfiniPot-V scores for it, +inf where protected: (view, scores, protected, generator)."""
    from test_policies import ToySession

    session = ToySession(capacity=400, layers=1, heads=2)
    for _ in range(60):
        session.add_pair()
    view = session.view(recent_pairs=1)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(view.kind.shape, generator=generator, dtype=torch.float64).float()
    protected = (view.kind == int(SlotKind.PREFIX)) | view.recent
    return view, scores.masked_fill(protected, float("inf")), protected, generator


def test_quotas_under_a_slot_fall_back_to_infinipot_v_and_whole_slots_follow_eq_9(monkeypatch):
    """Quotas keep their whole slots in each stretch and the fractions go by InfiniPot-V's score. Where every
    quota is under one slot that is plain InfiniPot-V's choice (rounding by largest remainders kept one slot of
    each most-changing stretch instead, whatever it scored); with many slots a stretch, eq. 9's split holds."""
    from test_policies import PER_PAIR

    view, scores, protected, generator = _scored_view(3)
    fixed = int(protected[0, 0].sum())
    assert fixed == 3 + PER_PAIR
    policy = make_policy("adaptive_infinipot_v", chunk_pairs=2, floor=0.25)
    monkeypatch.setattr(policy, "keep_scores", lambda view, target: scores)
    policy.distances = {pair: float(torch.rand(1, generator=generator)) for pair in range(1, 60)}
    plain = torch.topk(scores, fixed + 10, dim=-1).indices.sort(dim=-1).values  # 10 evictable slots, 30 stretches
    assert torch.equal(policy.select(view, fixed + 10), plain)
    target = fixed + 150  # 5 slots a stretch on average: each keeps the whole slots of its eq. 9 quota
    keep = policy.select(view, target)
    assert keep.shape == (1, 2, target) and bool(protected.gather(-1, keep).sum(-1).eq(fixed).all())
    stretch = (view.frame.clamp_min(0) // 2).long()  # the prefix (frame -1) is protected: counted nowhere
    evictable = ~protected
    weights = policy.stretch_weights(30)
    held = torch.zeros(2, 30, dtype=torch.long).scatter_add_(1, stretch[0], evictable[0].long())
    quota = stretch_quotas(torch.tensor([150, 150]), held, weights)
    kept = torch.zeros(2, 30, dtype=torch.long).scatter_add_(
        1, stretch[0].gather(1, keep[0]), evictable[0].gather(1, keep[0]).long())
    assert bool((kept >= quota.floor().long()).all()) and bool((kept <= quota.floor().long() + 2 * PER_PAIR).all())
    assert kept.sum(-1).tolist() == [150, 150]


def test_min_slots_merges_neighbouring_stretches_until_each_gets_its_share_of_the_budget(monkeypatch):
    """``min_slots``: at a tight cap the chunks of ``chunk_pairs`` outnumber the slots; neighbouring chunks
    still present merge into stretches of ``ceil(min_slots * chunks / mean budget)``, eq. 9 splits the budget
    over those by their pairs' mean distance, and each keeps its best-scored slots. Under one slot a chunk, no
    split: InfiniPot-V's order alone, merged or not."""
    view, scores, protected, generator = _scored_view(4)
    fixed = int(protected[0, 0].sum())
    # distance rising along the stream: later stretches are owed more of the budget
    distances = {pair: 0.01 + pair / 60 * float(torch.rand(1, generator=generator)) for pair in range(1, 60)}

    def policy(**kwargs):
        made = make_policy("adaptive_infinipot_v", chunk_pairs=2, floor=0.25, **kwargs)
        monkeypatch.setattr(made, "keep_scores", lambda view, target: scores)
        made.distances = dict(distances)
        return made

    budget = 40  # 30 chunks of 2 pairs: 4 chunks a stretch give each 5.3 slots on average, 8 stretches
    keep = policy(min_slots=5).select(view, fixed + budget)
    stretch = torch.where(view.frame[0] >= 0, view.frame[0].long() // 8, -1)  # [heads, n]: chunk // 4
    mean = [sum(v for p, v in distances.items() if p // 8 == k) / len([p for p in distances if p // 8 == k])
            for k in range(8)]
    weights = torch.tensor([max(m, 0.25 * sum(mean) / 8) for m in mean])
    held = torch.stack([torch.bincount(stretch[h][~protected[0, h]], minlength=8) for h in range(2)])
    quota = stretch_quotas(torch.tensor([budget, budget]), held, weights)
    assert float(quota[0, 7]) > 2 * float(quota[0, 0])
    for head in range(2):
        kept = torch.zeros(stretch.shape[-1], dtype=torch.bool).scatter_(0, keep[0, head], True) & ~protected[0, head]
        counts = torch.bincount(stretch[head][kept], minlength=8)
        assert int(counts.sum()) == budget
        whole = quota[head].floor().long()
        assert bool((counts >= whole).all()) and int((counts - whole).sum()) == budget - int(whole.sum()) > 0
        extra = []
        for k in range(8):  # each stretch keeps its best-scored slots; past its whole quota, the cache's best
            part = (stretch[head] == k) & ~protected[0, head]
            best = torch.topk(scores[0, head].masked_fill(~part, float("-inf")), int(counts[k])).indices
            assert torch.equal(best.sort().values, torch.nonzero(kept & part).flatten())
            extra += scores[0, head][best[int(whole[k]):]].tolist()
        left = scores[0, head][~kept & ~protected[0, head]]
        assert min(extra) >= float(left.max())
    assert not torch.equal(keep, policy().select(view, fixed + budget))  # the 30 stretches of 2 pairs differ
    plain = torch.topk(scores, fixed + 20, dim=-1).indices.sort(dim=-1).values
    assert torch.equal(policy(min_slots=5).select(view, fixed + 20), plain)  # 20 slots, 30 chunks
    assert torch.equal(policy().select(view, fixed + 20), plain)
    with pytest.raises(ValueError, match="cache.adaptive_min_slots must be >= 0"):
        make_policy("adaptive_infinipot_v", min_slots=-1)


def test_the_config_keys_reach_the_policy(tiny_checkpoint):
    runtime = edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [56, 56], "fps": FPS},
        cache={"policy": "adaptive_infinipot_v", "max_tokens": 140, "text_reserve_tokens": 32,
               "adaptive_chunk_pairs": 6, "adaptive_floor": 0.5, "adaptive_min_slots": 3})
    policy = runtime.session().policy
    assert (policy.chunk_pairs, policy.floor, policy.min_slots) == (6, 0.5, 3.0)
