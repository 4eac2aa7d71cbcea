"""``van``: Value-Norm importance with layer-adaptive pooling only (InfiniPot-V section 3.2, eq. 7,
Alg. 2 lines 14-22; alpha = 0).

||V|| is a query-agnostic proxy of a token's semantic weight; early layers show spatial locality of
it, so each layer averages it over a k x k window of the frame's grid, k in {7, 5, 3, 1} chosen from
the layer's coefficient of variation against calibrated thresholds tau1 < tau2 < tau3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from edgekv.calibration.thresholds import CVThresholds
from edgekv.policies.base import CacheView, ScoredPolicy, register
from edgekv.policies.scores import layer_cv, pool_sizes, pooled_van, value_norms


@register
@dataclass
class VaNPolicy(ScoredPolicy):
    name: ClassVar[str] = "van"
    calibration: str | None = None
    van_pooling: str = "present"  # "present": mean over the cells still held; "zeros": avg_pool2d's k^2
    thresholds: CVThresholds = field(init=False)
    last_pool_sizes: list[int] = field(init=False, default_factory=list)
    # Per-layer CV summed over every compression (and their count): what calibration averages. Running
    # sums, not a per-compression list, so a stream of weeks keeps constant memory.
    cv_sums: list[float] = field(init=False, default_factory=list)
    cv_count: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.van_pooling not in ("present", "zeros"):
            raise ValueError(f"cache.van_pooling must be 'present' or 'zeros', got {self.van_pooling!r}")
        self.thresholds = CVThresholds.load(self.calibration)

    def pooled(self, view: CacheView) -> torch.Tensor:
        norms = value_norms(view)  # once per compression: the CV and the pooling both read these
        cv = layer_cv(norms, view.vision)
        values = cv.tolist()
        self.cv_sums = [total + value for total, value in zip(self.cv_sums, values)] if self.cv_count else values
        self.cv_count += 1
        taus = self.thresholds.resolve(cv)
        self.last_pool_sizes = pool_sizes(cv, taus)
        return pooled_van(view, self.last_pool_sizes, zero_padded=self.van_pooling == "zeros", norms=norms)

    def score(self, view: CacheView) -> torch.Tensor:
        return self.pooled(view)

    def mean_cv(self) -> list[float]:
        """Per-layer CV averaged over every compression so far (empty before the first)."""
        return [total / self.cv_count for total in self.cv_sums]

    def state(self) -> dict:
        online = self.thresholds.thresholds if self.thresholds.online else None  # chosen at the first compression
        return {"last_pool_sizes": list(self.last_pool_sizes), "cv_sums": list(self.cv_sums), "cv_count": self.cv_count,
                "online_thresholds": list(online) if online is not None else None}

    def load_state(self, state: dict) -> None:
        self.last_pool_sizes = [int(size) for size in state["last_pool_sizes"]]
        self.cv_sums = [float(total) for total in state["cv_sums"]]
        self.cv_count = int(state["cv_count"])
        if self.thresholds.online and state["online_thresholds"] is not None:  # a calibration file wins
            self.thresholds.thresholds = tuple(float(tau) for tau in state["online_thresholds"])

    def stats(self, session) -> dict:
        return {"van_calibration": self.thresholds.describe(), "van_pool_sizes": list(self.last_pool_sizes)}
