"""``adaptive_infinipot_v``: InfiniPot-V's scores under AdaReTaKe's time-adaptive budget (seed 002, §4.3,
eq. 8-9, the query-agnostic part only; the layer-adaptive part of §4.4 needs prompt attention).

Eq. 8: the distance of a frame pair to the previous one is ``d[t] = 1 - (1/N) sum_j cos(M[t, j],
M[t-1, j])`` over the N visual tokens ``M`` of the pair (the vision tower's output, token j = the same
merged-grid cell). edgekv computes it as each pair is ingested (``observe_pair``, before its prefill;
the previous pair is the last *ingested* one) and keeps it per pair while the pair has tokens in the
cache. Eq. 9 gives each chunk of ``tau`` frames a share of the budget proportional to its mean distance
``d_i``: static stretches (small ``d``) are compressed harder and leave room to stretches that change.

Streaming form. At a compression the budget of the evictable slots of each (layer, KV head) —
``C`` less the protected prefix, sinks and recent pairs — is split over the stretches of
``chunk_pairs`` pairs (``frame // chunk_pairs``) still present:

    w_i = max(d_i, floor * mean_k d_k)          (the floor keeps every stretch alive)
    quota_i = budget * w_i / sum_k w_k          (eq. 9), at most the n_i slots the stretch holds;

what a full stretch cannot use is handed to the others in proportion to their weights (water filling).
Each stretch keeps the whole slots of its quota, ranked inside it by InfiniPot-V's own order (TaR picks
first, then pooled VaN: ``keep_scores``); the fractions left over (under one slot a stretch) go to the
best-scored slots of the whole cache, as plain InfiniPot-V would choose them. Where a row's budget is under one
slot a stretch, no split means anything and the compression goes by InfiniPot-V's scores alone.
``min_slots`` > 0 merges neighbouring stretches still present until each gets that many slots on average
(a coarser ``tau`` when the cap is tight; 0, the default: AdaReTaKe's fixed stretches).

Measured (issue 27, toy X112L, 2,000-pair world needle streams, seeds 45 + 47, 403 questions a cap, caps 1/16 /
1/64 / 1/256 (the 160-slot floor), against plain ``infinipot_v`` on the same questions; docs/measurements.md, "The
needle benchmark across the cap"). Lured streams (``--busy 0.2 --lures 1``; ``infinipot_v`` 0.442 / 0.345 / 0.355):
this policy 0.474 / 0.471 / 0.360 (quotas rounded by largest remainders before: 0.454 / 0.427 / 0.303; before
the under-a-slot rule: 0.474 / 0.471 / 0.315); ``min_slots`` 2: 0.474 / 0.489 / 0.352; 4 and 8 (measured before
the rule): 0.474 / 0.449 / 0.340 and 0.476 / 0.404 / 0.362. Streams without lures (``infinipot_v`` 0.871 /
0.875 / 0.866): 0.893 / 0.868 / **0.650** (0.459 before the rule; ``min_slots`` 2: 0.660). At the floor every
row holds ~41 evictable slots over ~42 stretches (traced before the rule), so the rule falls back at some of its
compressions only. Falling back under 2.5 slots a stretch instead of 1 reads 0.712 there (1/64 0.891), but costs
the lured streams their gain at 1/64 (0.409; 1.5 slots: 0.670 / 0.471): a split by time at a 41-slot budget loses
answers even at a few slots a stretch, and the threshold stays at one slot, the point below which no split exists.

Memory outside the cap: one pair's visual tokens (the previous pair, for eq. 8) and one float per pair
that still has tokens in the cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from edgekv.policies.base import CacheView, register
from edgekv.policies.infinipot_v import InfiniPotVPolicy


def pair_distance(tokens: torch.Tensor, previous: torch.Tensor) -> float:
    """Eq. 8 for one pair: 1 - mean over tokens of the cosine with the same token of the previous pair."""
    cos = torch.nn.functional.cosine_similarity(tokens.float(), previous.float(), dim=-1)
    return float(1.0 - cos.mean())


def stretch_quotas(budget: torch.Tensor, held: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Split ``budget`` [R] slots over stretches by ``weight`` [S] (eq. 9), never above ``held`` [R, S].

    Returns float64 [R, S] quotas with ``quota <= held`` and ``quota.sum(-1) == min(budget, held.sum(-1))``
    (water filling: what a full stretch cannot take goes to the others in proportion to their weights).
    """
    held = held.to(torch.float64)
    weight = weight.to(torch.float64).expand_as(held).clone()
    weight[held == 0] = 0.0
    quota = torch.zeros_like(held)
    left = torch.minimum(budget.to(torch.float64), held.sum(-1))
    open_ = held > 0
    for _ in range(held.shape[-1] + 1):  # each round fills at least one stretch or hands out everything
        w = weight * open_
        share = left.unsqueeze(-1) * w / w.sum(-1, keepdim=True).clamp_min(1e-300)
        room = held - quota
        full = open_ & (share >= room)
        quota = torch.where(full, held, quota)
        given = torch.where(full, room, torch.zeros_like(room)).sum(-1)
        if not bool(full.any()):
            quota = quota + share
            break
        left = left - given
        open_ = open_ & ~full
    return quota


@register
@dataclass
class AdaptiveInfiniPotVPolicy(InfiniPotVPolicy):
    name: ClassVar[str] = "adaptive_infinipot_v"
    chunk_pairs: int = 8    # tau: frame pairs per stretch of time
    floor: float = 0.25     # a stretch weighs at least this share of the mean weight
    min_slots: float = 0.0  # > 0: merge neighbouring stretches until each gets this many slots on average
    distances: dict[int, float] = field(init=False, default_factory=dict)  # pair -> eq. 8 distance
    _previous: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.chunk_pairs < 1:
            raise ValueError(f"cache.adaptive_chunk_pairs must be >= 1, got {self.chunk_pairs}")
        if not 0.0 < self.floor <= 1.0:
            raise ValueError(f"cache.adaptive_floor must be in (0, 1], got {self.floor}")
        if not self.min_slots >= 0.0:
            raise ValueError(f"cache.adaptive_min_slots must be >= 0, got {self.min_slots}")

    def observe_pair(self, pair: int, tokens: torch.Tensor) -> None:
        if self._previous is not None and self._previous.shape == tokens.shape:
            self.distances[pair] = pair_distance(tokens, self._previous)
        self._previous = tokens.detach().clone()

    def stretch_weights(self, stretches: int, group: torch.Tensor | None = None) -> torch.Tensor:
        """[stretches] mean eq. 8 distance of each stretch's observed pairs (eq. 9's d_i), floored. ``group``
        [S]: the stretch (``pair // chunk_pairs``) each chunk of pairs belongs to, -1 for none (default: its own)."""
        sums = torch.zeros(stretches, dtype=torch.float64)
        counts = torch.zeros(stretches, dtype=torch.float64)
        for pair, distance in self.distances.items():
            chunk = pair // self.chunk_pairs
            index = chunk if group is None else (int(group[chunk]) if chunk < len(group) else -1)
            if 0 <= index < stretches:
                sums[index] += distance
                counts[index] += 1
        seen = counts > 0
        mean = torch.where(seen, sums / counts.clamp_min(1), torch.zeros_like(sums))
        overall = float(mean[seen].mean()) if bool(seen.any()) else 1.0
        mean[~seen] = overall  # a stretch with no measured pair (the first pair, after a restore) weighs the mean
        return mean.clamp_min(self.floor * max(overall, 1e-12))

    def stretches_of(self, chunk: torch.Tensor, evictable: torch.Tensor, budget: torch.Tensor
                     ) -> tuple[torch.Tensor, int, torch.Tensor | None]:
        """(stretch per slot, -1 where not evictable; stretch count; the group map for ``stretch_weights``).
        Stretches are chunks of ``chunk_pairs`` pairs; with ``min_slots`` > 0, ``g`` neighbouring chunks still
        present are merged into one stretch, ``g`` the least that gives a stretch ``min_slots`` of the mean
        budget of a (layer, head) row. None (count 0) where that budget is under one slot a chunk: every quota
        would be a fraction, and the compression goes by InfiniPot-V's scores alone."""
        present = torch.unique(chunk[evictable])  # sorted chunk ids with an evictable slot in some row
        mean_budget = float(budget.double().mean()) if budget.numel() else 0.0
        if not len(present) or mean_budget < len(present):  # under a slot a stretch: InfiniPot-V's order alone
            return torch.full_like(chunk, -1), 0, None
        if self.min_slots <= 0:
            stretch = torch.where(evictable, chunk, torch.full_like(chunk, -1))
            return stretch, int(stretch.max()) + 1, None
        per = max(1, math.ceil(self.min_slots * len(present) / mean_budget))
        group = torch.full((int(present.max()) + 1,), -1, dtype=torch.long)
        group[present] = torch.arange(len(present)) // per
        stretch = torch.where(evictable, group[chunk.clamp(0, len(group) - 1)], torch.full_like(chunk, -1))
        return stretch, int(group.max()) + 1, group

    def select(self, view: CacheView, target: int) -> torch.Tensor:
        scores = self.keep_scores(view, target)  # [L, H, n], protected = +inf
        protected = torch.isinf(scores) & (scores > 0)
        evictable = view.vision & ~protected
        layers, heads, n = scores.shape
        rows = layers * heads
        budget = (target - protected.view(rows, n).sum(-1)).clamp_min(0)
        stretch, stretches, group = self.stretches_of(view.frame.long() // self.chunk_pairs, evictable, budget)
        if stretches == 0:
            return self.top(scores, target)  # InfiniPot-V's choice, from the scores already computed
        held = torch.zeros(rows, stretches, dtype=torch.long)
        flat_stretch = stretch.view(rows, n)
        held.scatter_add_(1, flat_stretch.clamp_min(0), evictable.view(rows, n).long())
        # whole slots of each quota (a hair under an integer counts as it); the fractions go by score below
        quota = (stretch_quotas(budget, held, self.stretch_weights(stretches, group)) + 1e-6).floor().long()  # [rows, S]
        # rank of each evictable slot inside its stretch by InfiniPot-V's score (descending)
        flat = scores.view(rows, n).masked_fill(~evictable.view(rows, n), float("-inf"))
        by_score = flat.argsort(dim=-1, descending=True, stable=True)
        by_stretch = flat_stretch.gather(1, by_score).argsort(dim=-1, stable=True)
        order = by_score.gather(1, by_stretch)  # grouped by stretch, best first inside each
        grouped = flat_stretch.gather(1, order)
        first = torch.searchsorted(grouped, grouped, right=False)  # index where each slot's stretch starts
        rank = torch.arange(n).expand(rows, n) - first
        allowed = quota.gather(1, grouped.clamp_min(0))
        chosen_sorted = (grouped >= 0) & (rank < allowed)
        chosen = torch.zeros_like(chosen_sorted).scatter_(1, order, chosen_sorted)
        keep = chosen | protected.view(rows, n)
        # exactly ``target`` per row: kept slots first, the rest (the quotas' fractions) by InfiniPot-V's score
        final = torch.where(keep, torch.full_like(flat, float("inf")), scores.view(rows, n).clamp(max=3e38))
        return self.top(final.view(layers, heads, n), target)

    def compress(self, session, incoming: int) -> None:
        super().compress(session, incoming)
        present = set(torch.unique(session.cache.frame[:, :, : session.cache.length]).tolist())
        self.distances = {pair: d for pair, d in self.distances.items() if pair in present}

    def state(self) -> dict:
        return {**super().state(), "distances": [[pair, d] for pair, d in sorted(self.distances.items())]}

    def load_state(self, state: dict) -> None:
        state = dict(state)
        self.distances = {int(pair): float(d) for pair, d in state.pop("distances", [])}
        super().load_state(state)

    def stats(self, session) -> dict:
        return {**super().stats(session), "adaptive_pairs_measured": len(self.distances)}
