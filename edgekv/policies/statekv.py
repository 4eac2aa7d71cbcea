"""``statekv``: StateKV's temporal sinks inside the capped cache (seed 000, section 3.1-3.3, eq. 1-6),
with InfiniPot-V compression of everything that is not a sink.

While a frame pair is prefilled its queries attend only to [system prefix ; sink set ; the pair itself
(causal)] instead of the whole cache, so per-pair cost is constant in the stream length (eq. 5). With
the torch backend those keys are gathered before attention (``edgekv.attention.CacheAttention``:
every (layer, KV head) holds the same number of sinks), so the work follows B, not the cache; the
exported engine graphs have static shapes and mask the whole cache instead (same result).
Each key's attention mass — softmax probabilities summed over the pair's queries and averaged over
heads (eq. 1, 6) — scores the candidates ``sinks ∪ this pair``; the top ``B`` become the next sink set
(eq. 3, 6). Sinks are slots of the capped cache marked by a flag (DESIGN invariant 6: no second
copy); CKV never evicts a sink, and the TaR/VaN budget is what the sinks leave. Questions still attend
to the whole capped cache.

edgekv keeps one sink set per (layer, KV head): after compactions a slot holds different tokens in
different KV heads, so the mass is averaged over the query heads of each KV-head group (GQA) and the
top ``B`` are taken per group. While the cache holds at most ``B`` video tokens (the stream's start), every past
token is a sink and prefill equals attention over the whole cache; ``check()`` refuses a ``B`` that leaves TaR/VaN
no room under ``C`` (the sinks are protected), so "B covers the whole video" is ``policy: full`` with ``cache.sinks``
(tests/test_statekv.py checks that equivalence).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.cache.capped import CappedKVCache, SlotKind
from edgekv.policies.base import register
from edgekv.policies.infinipot_v import InfiniPotVPolicy


class SinkSelector:
    """Keeps the sink flags of a CappedKVCache: visibility for a pair's prefill, then the top-B update."""

    def __init__(self, cache: CappedKVCache, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"cache.sinks must be positive for StateKV, got {budget}")
        self.cache = cache
        self.budget = budget
        # [layers, kv_heads, M] fp32 per-key attention mass of the last prefilled pair (one allocation)
        self.mass = torch.zeros(cache.num_layers, cache.kv_heads, cache.capacity, dtype=torch.float32,
                                device=cache.device)
        self.updates = 0

    def visibility(self) -> torch.Tensor:
        """[layers, kv_heads, length] bool: the prefix and the sinks."""
        n = self.cache.length
        return (self.cache.kind[:, :, :n] == int(SlotKind.PREFIX)) | self.cache.sink[:, :, :n]

    def update(self, start: int, num_new: int) -> None:
        """After a pair at slots [start, start + num_new) was prefilled: top-B of sinks ∪ pair (eq. 6)."""
        end = start + num_new
        cache = self.cache
        candidates = cache.sink[:, :, :end].clone()
        candidates[:, :, start:end] = True
        scores = self.mass[:, :, :end].masked_fill(~candidates, float("-inf"))
        count = min(self.budget, int(candidates[0, 0].sum()))
        chosen = torch.topk(scores, count, dim=-1, sorted=False).indices
        cache.sink[:, :, :end] = False
        cache.sink[:, :, :end].scatter_(-1, chosen, True)
        self.updates += 1


@register
@dataclass
class StateKVPolicy(InfiniPotVPolicy):
    name: ClassVar[str] = "statekv"
    uses_sinks: ClassVar[bool] = True
