"""Policies on toy caches: one registry-driven test over all of them, hand-computed TaR (eq. 4),
VaN pooling (Alg. 2 l.14-22) and the TaR-priority combine (l.24), and exact temporal re-rotation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekv.calibration.thresholds import CVThresholds
from edgekv.cache import CacheSpec, CappedKVCache, ChunkMeta, SlotKind
from edgekv.policies import CacheView, make_policy, policy_names
from edgekv.policies.scores import layer_cv, pool_sizes, pooled_van, tar_scores
from edgekv.model.rope import rotary_inv_freq
from edgekv.positions import rotate_temporal, rotate_temporal_, squeeze_gaps

GRID = (2, 3)
PER_PAIR = GRID[0] * GRID[1]
HEAD_DIM = 8
TEMPORAL = 2  # rotary frequencies carrying time (mrope_section[0])


class ToySession:
    """The parts of StreamSession a policy touches, over a real CappedKVCache with random K/V."""

    def __init__(self, capacity=64, prefix=3, reserve=8, layers=2, heads=2, seed=0, sinks=0):
        self.cache = CappedKVCache(CacheSpec.uniform(layers, heads, HEAD_DIM, torch.float32), capacity)
        self.prefix_tokens, self.text_reserve, self.sink_budget = prefix, reserve, sinks
        self.tokens_per_pair, self.grid = PER_PAIR, GRID
        self.video_limit = capacity - reserve
        self.inv_freq = rotary_inv_freq(HEAD_DIM, 10000.0)
        self.pairs = 0
        self.gen = torch.Generator().manual_seed(seed)
        self._write(prefix, ChunkMeta(SlotKind.PREFIX, tpos=torch.arange(prefix)))

    def _write(self, num, meta, k=None):
        start = self.cache.length
        for layer in range(self.cache.num_layers):
            kk = torch.randn(self.cache.kv_heads, num, HEAD_DIM, generator=self.gen) if k is None else k[layer]
            self.cache.write_layer(layer, start, kk, torch.randn(self.cache.kv_heads, num, HEAD_DIM, generator=self.gen))
        self.cache.write_meta(start, num, meta)
        self.cache.commit(num)

    def add_pair(self, k=None):
        index = torch.arange(PER_PAIR)
        meta = ChunkMeta(SlotKind.VISION, frame=self.pairs, rows=index // GRID[1], cols=index % GRID[1],
                         tpos=torch.full((PER_PAIR,), self.prefix_tokens + 2 * self.pairs))
        self._write(PER_PAIR, meta, k)
        self.pairs += 1

    def view(self, recent_pairs):
        n, c = self.cache.length, self.cache
        return CacheView(c.k[:, :, :n], c.v[:, :, :n], c.kind[:, :, :n], c.sink[:, :, :n], c.frame[:, :, :n],
                         c.row[:, :, :n], c.col[:, :, :n], c.tpos[:, :, :n], GRID, self.pairs - 1, recent_pairs,
                         PER_PAIR, self.inv_freq, TEMPORAL)

    def compact(self, keep):
        self.cache.compact(keep)


EVICTING = [name for name in policy_names() if name != "full"]


@pytest.mark.parametrize("name", EVICTING)
def test_every_policy_keeps_the_cap_the_prefix_and_the_recent_pairs(name):
    session = ToySession(capacity=64)
    policy = make_policy(name, target_tokens=30, recent_ratio=0.2)
    policy.check(session)
    pointers = session.cache.data_ptrs()
    for _ in range(40):
        if session.cache.length + PER_PAIR > session.video_limit:
            policy.compress(session, PER_PAIR)
            assert session.cache.length == 30
            kinds = session.cache.kind[:, :, :30]
            assert (kinds == int(SlotKind.PREFIX)).sum(-1).eq(3).all()  # prefix never evicted
            if policy.keeps_recent:
                recent = policy.recent_pairs(session)
                newest = session.cache.frame[:, :, :30] > session.pairs - 1 - recent
                assert newest.sum(-1).eq(recent * PER_PAIR).all()
        session.add_pair()
        assert session.cache.length <= session.video_limit
    assert session.cache.data_ptrs() == pointers


def test_full_never_evicts_and_unknown_names_are_refused():
    assert make_policy("full").evicts is False
    with pytest.raises(ValueError, match="known: "):
        make_policy("lru")


def test_policy_refuses_a_target_that_cannot_hold_the_protected_slots():
    session = ToySession(capacity=64)
    with pytest.raises(ValueError, match="minimum is"):
        make_policy("tar", target_tokens=8, recent_ratio=0.2).check(session)
    with pytest.raises(ValueError, match="maximum is"):
        make_policy("tar", target_tokens=55).check(session)


def test_tar_eq4_by_hand():
    """One layer, one head: two past pairs and two recent pairs with chosen keys."""
    session = ToySession(capacity=64, prefix=1, layers=1, heads=1)
    e = torch.eye(HEAD_DIM)
    base = e[2].repeat(PER_PAIR, 1)  # every cell's key along dim 2 (not a temporal rotary dim)
    past_same = base.clone()
    past_diff = base.clone()
    past_diff[2] = e[3]             # cell 2 differs from the recent frames in the second past pair
    recent_a = base.clone()
    recent_b = base.clone()
    recent_b[2] = (e[2] + e[3]) / math.sqrt(2)  # cell 2 in one recent frame half-way
    for keys in (past_same, past_diff, recent_a, recent_b):
        session.add_pair(keys.view(1, 1, PER_PAIR, HEAD_DIM))
    view = session.view(recent_pairs=2)
    scores = tar_scores(view, unrotated=True)[0, 0]
    past_diff_cell2 = 1 + PER_PAIR + 2
    # eq. 4: -(1/2) (cos(e3, e2) + cos(e3, (e2+e3)/sqrt2)) = -(0 + 1/sqrt2) / 2
    assert scores[past_diff_cell2].item() == pytest.approx(-(1 / math.sqrt(2)) / 2, abs=1e-6)
    # cell 2 of the identical past pair: -(1 + 1/sqrt2) / 2; other cells -1
    assert scores[1 + 2].item() == pytest.approx(-(1 + 1 / math.sqrt(2)) / 2, abs=1e-6)
    assert scores[1 + 0].item() == pytest.approx(-1.0, abs=1e-6)
    assert scores[0].item() == 0.0  # the prefix has no partner


def test_tar_undoes_time_so_a_static_patch_compares_equal():
    session = ToySession(capacity=64, prefix=1, layers=1, heads=1)
    static = torch.randn(PER_PAIR, HEAD_DIM, generator=torch.Generator().manual_seed(3))
    for pair in range(4):
        tpos = torch.full((PER_PAIR,), 1 + 2 * pair)
        rotated = rotate_temporal(static, tpos, session.inv_freq, TEMPORAL)
        session.add_pair(rotated.view(1, 1, PER_PAIR, HEAD_DIM))
    view = session.view(recent_pairs=2)
    past = slice(1, 1 + 2 * PER_PAIR)
    assert torch.allclose(tar_scores(view, unrotated=True)[0, 0, past], torch.full((2 * PER_PAIR,), -1.0), atol=1e-5)
    assert (tar_scores(view, unrotated=False)[0, 0, past] > -1.0 + 1e-4).any()


def test_van_pooling_by_hand():
    """3x3 pooling of a 2x3 grid averages the cells present around each cell."""
    session = ToySession(capacity=64, prefix=1, layers=1, heads=1)
    session.add_pair()
    norms = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    v = session.cache.v[0, 0, 1:7]
    v.zero_()
    v[:, 0] = norms
    view = session.view(recent_pairs=1)
    pooled = pooled_van(view, [3])[0, 0, 1:7]
    # cell (0,0): neighbours (0,0),(0,1),(1,0),(1,1) -> (1+2+4+5)/4
    expected = torch.tensor([(1 + 2 + 4 + 5) / 4, (1 + 2 + 3 + 4 + 5 + 6) / 6, (2 + 3 + 5 + 6) / 4,
                             (1 + 2 + 4 + 5) / 4, (1 + 2 + 3 + 4 + 5 + 6) / 6, (2 + 3 + 5 + 6) / 4])
    assert torch.allclose(pooled, expected)
    assert torch.allclose(pooled_van(view, [1])[0, 0, 1:7], norms)


def test_pool_size_from_cv_and_layer_cv():
    assert pool_sizes(torch.tensor([0.05, 0.15, 0.25, 0.35]), (0.1, 0.2, 0.3)) == [7, 5, 3, 1]
    norms = torch.tensor([[[1.0, 3.0]], [[2.0, 2.0]]])  # [L=2, H=1, n=2]
    cv = layer_cv(norms, torch.ones_like(norms, dtype=torch.bool))
    assert cv.tolist() == pytest.approx([0.5, 0.0])


def test_infinipot_v_keeps_tar_picks_first_then_van():
    """Line 24: TaR-selected past tokens outrank every VaN score; VaN fills the rest.

    C = 15 slots: prefix 1 + two recent pairs (12) + 2 more; TaR gets int(0.9 * 15) - 12 = 1 of them.
    """
    session = ToySession(capacity=64, prefix=1, layers=1, heads=1)
    e = torch.eye(HEAD_DIM)
    keys = e[2].repeat(PER_PAIR, 1)
    distinct = keys.clone()
    distinct[5] = e[3]  # one past token unlike the recent frames
    session.add_pair(distinct.view(1, 1, PER_PAIR, HEAD_DIM))
    for _ in range(3):
        session.add_pair(keys.view(1, 1, PER_PAIR, HEAD_DIM))
    v = session.cache.v[0, 0, : session.cache.length]
    v.fill_(1.0)
    v[1 + 5] = 0.01            # the distinct token has the smallest value norm ...
    v[1 + PER_PAIR + 1] = 9.0  # ... and one redundant token the largest
    policy = make_policy("infinipot_v", target_tokens=1 + 2 * PER_PAIR + 2, recent_ratio=0.25, tar_ratio=0.9)
    policy.thresholds = CVThresholds(thresholds=(-3.0, -2.0, -1.0))  # every layer: pool size 1 (raw ||V||)
    view = session.view(recent_pairs=2)
    keep = policy.select(view, 1 + 2 * PER_PAIR + 2)[0, 0].tolist()
    assert 1 + 5 in keep                 # kept by TaR despite its tiny ||V||
    assert 1 + PER_PAIR + 1 in keep      # kept by VaN


def test_rotate_temporal_composes_exactly():
    inv_freq = rotary_inv_freq(HEAD_DIM, 10000.0)
    x = torch.randn(5, HEAD_DIM, dtype=torch.float64).float()
    a, b = torch.tensor([3, 7, 11, 0, 100]), torch.tensor([-2, 5, 4, 9, -100])
    once = rotate_temporal(x, a + b, inv_freq, TEMPORAL)
    twice = rotate_temporal(rotate_temporal(x, a, inv_freq, TEMPORAL), b, inv_freq, TEMPORAL)
    assert torch.allclose(once, twice, atol=1e-5)
    assert torch.equal(rotate_temporal(x, torch.zeros(5), inv_freq, TEMPORAL), x)
    # only the temporal pairs move
    moved = rotate_temporal(x, a, inv_freq, TEMPORAL)
    untouched = [d for d in range(HEAD_DIM) if d % (HEAD_DIM // 2) >= TEMPORAL]
    assert torch.equal(moved[:, untouched], x[:, untouched])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 10_000), min_size=1, max_size=40), st.integers(1, 5))
def test_squeeze_gaps_is_order_preserving_and_bounded(values, gap):
    positions = torch.tensor([values, values[::-1]])
    valid = torch.ones_like(positions, dtype=torch.bool)
    valid[1, 0] = False
    new = squeeze_gaps(positions, valid, gap)
    assert new[1, 0] == positions[1, 0]  # invalid entries untouched
    for row in range(2):
        if not bool(valid[row].any()):
            continue
        old_row, new_row = positions[row][valid[row]], new[row][valid[row]]
        assert new_row.max() == old_row.max()  # anchored at the newest
        order = torch.argsort(old_row)
        o, m = old_row[order], new_row[order]
        assert bool(((o[1:] > o[:-1]) == (m[1:] > m[:-1])).all())  # order and ties preserved
        assert bool(((m[1:] - m[:-1]) <= torch.clamp(o[1:] - o[:-1], max=gap)).all())
        assert int(m.max() - m.min()) <= (o.unique().numel() - 1) * gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_in_place_rotation_equals_out_of_place(dtype):
    inv_freq = rotary_inv_freq(HEAD_DIM, 10000.0)
    keys = torch.randn(2, 3, 7, HEAD_DIM).to(dtype)
    delta = torch.randint(-50, 50, (2, 3, 7))
    expected = rotate_temporal(keys, delta, inv_freq, TEMPORAL)
    rotate_temporal_(keys, delta, inv_freq, TEMPORAL)
    assert torch.equal(keys, expected)
