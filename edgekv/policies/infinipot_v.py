"""``infinipot_v``: TaR and VaN together (InfiniPot-V, seed 004, Alg. 1 and Alg. 2; App. A.2 defaults
alpha = 0.5, r = 0.125 f, C = 0.75 M).

Alg. 1 step 3 gives TaR ``alpha |C| - |K_recent|`` of the slots among past tokens; Alg. 2 line 24
lifts the TaR-selected tokens to the maximum pooled VaN score, and line 25 takes the top ``|C|`` of
the pooled VaN scores — so TaR's picks are kept first and VaN fills the rest. The prefix, sinks and the
recent pairs are protected (always kept, Alg. 1 step 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.policies.base import CacheView, register
from edgekv.policies.scores import tar_scores
from edgekv.policies.van import VaNPolicy


@register
@dataclass
class InfiniPotVPolicy(VaNPolicy):
    name: ClassVar[str] = "infinipot_v"
    tar_ratio: float = 0.5
    tar_rope: str = "unrotated"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.tar_ratio <= 1.0:
            raise ValueError(f"cache.tar_ratio must be in [0, 1], got {self.tar_ratio}")
        if self.tar_rope not in ("unrotated", "raw"):
            raise ValueError(f"cache.tar_rope must be 'unrotated' or 'raw', got {self.tar_rope!r}")

    def select(self, view: CacheView, target: int) -> torch.Tensor:
        return self.top(self.keep_scores(view, target), target)

    @staticmethod
    def top(scores: torch.Tensor, target: int) -> torch.Tensor:
        """[L, H, target] the slots of the ``target`` highest scores per (layer, head), in cache order."""
        return torch.topk(scores, target, dim=-1, sorted=False).indices.sort(dim=-1).values

    def keep_scores(self, view: CacheView, target: int) -> torch.Tensor:
        """[L, H, n]: the TaR picks lifted above every VaN score, protected slots at +inf; the top ``target``
        are what Alg. 2 keeps."""
        protected = self.protected(view)
        recent = int(view.recent[0, 0].sum())
        tar_budget = max(int(self.tar_ratio * target) - recent, 0)
        tar = tar_scores(view, unrotated=self.tar_rope == "unrotated").masked_fill(protected | ~view.vision, float("-inf"))
        # never more picks than the room the protected slots leave in ``target``: TaR's picks all share one lifted
        # score, so any beyond the room would be dropped by topk's tie order instead of by their TaR rank
        room = target - int(protected.sum(-1).max())
        tar_budget = max(min(tar_budget, room, int((~protected & view.vision)[0, 0].sum())), 0)
        van = self.pooled(view)
        scores = van.clone()
        if tar_budget:
            chosen = torch.topk(tar, tar_budget, dim=-1, sorted=False).indices
            ceiling = van.amax(dim=-1, keepdim=True) + 1.0  # strictly above every VaN score (line 24)
            scores.scatter_(-1, chosen, ceiling.expand_as(chosen))
        return scores.masked_fill(protected, float("inf"))
