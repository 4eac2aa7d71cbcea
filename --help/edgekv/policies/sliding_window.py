"""``sliding_window``: keep the newest frame pairs (ReKV's recency window without retrieval, seed 001).

score = frame-pair index, so a compression drops the oldest video tokens first; the system prefix is
protected by the base class. The baseline every smarter policy has to beat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.policies.base import CacheView, ScoredPolicy, register


@register
@dataclass
class SlidingWindowPolicy(ScoredPolicy):
    name: ClassVar[str] = "sliding_window"
    keeps_recent: ClassVar[bool] = False

    def score(self, view: CacheView) -> torch.Tensor:
        # frame index first; slot order breaks ties so a partly kept pair keeps its later tokens
        n = view.frame.shape[-1]
        order = torch.arange(n, device=view.frame.device, dtype=torch.float32) / max(n, 1)
        return view.frame.to(torch.float32) + order
