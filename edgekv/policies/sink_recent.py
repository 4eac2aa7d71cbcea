"""``sink_recent``: attention sinks plus a recent window (StreamingLLM; the vLLM hybrid allocator's
sink + sliding-window eviction, seed 003). The first ``sink_pairs`` frame pairs of the stream are kept
for ever next to the prefix; the rest of the budget goes to the newest tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from edgekv.cache.capped import CapTooSmallError
from edgekv.policies.base import CacheView, ScoredPolicy, register


@register
@dataclass
class SinkRecentPolicy(ScoredPolicy):
    name: ClassVar[str] = "sink_recent"
    sink_pairs: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink_pairs < 0:
            raise ValueError(f"sink_pairs must be >= 0, got {self.sink_pairs}")

    def check(self, session) -> None:
        super().check(session)
        # the stream's first pairs are protected too: a target that cannot hold them would evict prefix slots
        per_pair, target = session.tokens_per_pair, self.target(session)
        protected = (session.prefix_tokens + (self.recent_pairs(session) + self.sink_pairs) * per_pair
                     + session.sink_budget)
        if protected >= target:
            raise CapTooSmallError(
                f"{self.target_text(session)} cannot hold the prefix ({session.prefix_tokens}), the "
                f"{self.recent_pairs(session)} recent frame pairs always kept "
                f"(cache.recent_ratio={self.recent_ratio}), "
                f"the first {self.sink_pairs} pairs of the stream (sink_recent) and {session.sink_budget} sinks: the "
                f"minimum is {protected + 1}" + self.room_hint(session, protected + 1)
            )

    def protected(self, view: CacheView) -> torch.Tensor:
        first = view.frame.masked_fill(~view.vision, 2**30).amin()
        stream_sinks = view.vision & (view.frame < first + self.sink_pairs)
        return super().protected(view) | stream_sinks

    def score(self, view: CacheView) -> torch.Tensor:
        n = view.frame.shape[-1]
        order = torch.arange(n, device=view.frame.device, dtype=torch.float32) / max(n, 1)
        return view.frame.to(torch.float32) + order
