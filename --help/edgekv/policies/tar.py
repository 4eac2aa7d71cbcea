"""``tar``: Temporal-axis Redundancy only (InfiniPot-V section 3.1, eq. 4-6; alpha = 1).

Past tokens that look like the same patch in the recent frames are redundant; the least redundant
(highest s_TaR) fill the budget left after the prefix, sinks and the recent ``r`` pairs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.policies.base import CacheView, ScoredPolicy, register
from edgekv.policies.scores import tar_scores


@register
@dataclass
class TaRPolicy(ScoredPolicy):
    name: ClassVar[str] = "tar"
    tar_rope: str = "unrotated"  # compare keys with the temporal rotation undone, or raw post-RoPE

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tar_rope not in ("unrotated", "raw"):
            raise ValueError(f"cache.tar_rope must be 'unrotated' or 'raw', got {self.tar_rope!r}")

    def score(self, view: CacheView) -> torch.Tensor:
        return tar_scores(view, unrotated=self.tar_rope == "unrotated")
