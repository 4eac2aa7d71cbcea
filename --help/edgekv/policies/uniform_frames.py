"""``uniform_frames``: keep whole frame pairs spread evenly over what the cache holds (InfiniPot-V's
"Uniform Select" baseline, seed 004 Tab. 4/5). The recent pairs are protected like in every CKV
policy; the rest of the budget goes to pairs picked at evenly spaced places in time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.policies.base import CacheView, ScoredPolicy, register


@register
@dataclass
class UniformFramesPolicy(ScoredPolicy):
    name: ClassVar[str] = "uniform_frames"

    def select(self, view: CacheView, target: int) -> torch.Tensor:
        protected = self.protected(view)
        spare = target - int(protected[0, 0].sum())
        past = torch.unique(view.frame[view.vision & ~view.recent])
        keep_pairs = min(max(spare // view.tokens_per_pair, 0), past.numel())
        chosen = past[torch.linspace(0, past.numel() - 1, keep_pairs).round().long()] if keep_pairs else past[:0]
        scores = torch.isin(view.frame, chosen).to(torch.float32)
        # leftover budget (less than a pair) goes to the newest remaining tokens
        n = view.frame.shape[-1]
        scores = scores * n + view.frame.to(torch.float32).clamp(min=0) / max(int(view.frame.max()) + 1, 1)
        scores = scores.masked_fill(protected, float("inf"))
        return torch.topk(scores, target, dim=-1, sorted=False).indices.sort(dim=-1).values
