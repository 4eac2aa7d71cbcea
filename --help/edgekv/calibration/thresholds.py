"""VaN coefficient-of-variation thresholds tau1 < tau2 < tau3 (InfiniPot-V Alg. 2 line 21).

The paper pre-computes model-specific thresholds but does not publish a rule; edgekv's rule
(``edgekv calibrate``) is: stream sample videos, record every layer's CV of ||V|| at each compression,
average per layer, and take the 25th, 50th and 75th percentiles of the per-layer means as
tau1..tau3 — so the layers split evenly over pool sizes 7, 5, 3 and 1, the lowest-CV (most
spatially smooth) quarter getting the widest window.

Uncalibrated models fall back to the same rule applied online: the thresholds are the quartiles of
the per-layer CVs seen at the session's first compression, then frozen (``describe()`` says so and
``stats()`` reports it).

File format (YAML): ``{model: <name>, thresholds: [t1, t2, t3], layer_cv: [...], rule: ...}``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml


def quartile_thresholds(layer_cv: torch.Tensor | list[float]) -> tuple[float, float, float]:
    # on the host: the layer CVs of a CUDA session arrive on the GPU, and quantile wants q on their device
    values = torch.as_tensor(layer_cv, dtype=torch.float64).flatten().cpu()
    if values.numel() == 0:
        raise ValueError("need at least one layer CV to choose thresholds")
    q = torch.quantile(values, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    # strictly increasing even when layers tie
    t1, t2, t3 = q
    t2 = max(t2, t1 + 1e-9)
    t3 = max(t3, t2 + 1e-9)
    return (t1, t2, t3)


@dataclass
class CVThresholds:
    path: str | None = None
    thresholds: tuple[float, float, float] | None = None
    online: bool = field(default=False)

    @classmethod
    def load(cls, path: str | Path | None) -> "CVThresholds":
        if path is None:
            return cls(online=True)
        file = Path(path).expanduser()
        if not file.is_file():
            raise ValueError(f"cache.calibration: {file} does not exist (make one with `edgekv calibrate`)")
        data = yaml.safe_load(file.read_text()) or {}
        taus = data.get("thresholds") if isinstance(data, dict) else None
        if not (isinstance(taus, list) and len(taus) == 3 and all(isinstance(t, (int, float)) for t in taus)):
            raise ValueError(f"cache.calibration: {file} needs 'thresholds: [t1, t2, t3]' (three numbers)")
        if not taus[0] < taus[1] < taus[2]:
            raise ValueError(f"cache.calibration: {file} thresholds must be increasing, got {taus}")
        return cls(path=str(file), thresholds=(float(taus[0]), float(taus[1]), float(taus[2])))

    def resolve(self, layer_cv: torch.Tensor) -> tuple[float, float, float]:
        if self.thresholds is None:
            self.thresholds = quartile_thresholds(layer_cv)
        return self.thresholds

    def describe(self) -> str:
        if not self.online:
            return f"calibrated ({self.path})"
        if self.thresholds is None:
            return "uncalibrated: quartiles of the first compression's per-layer CV (not yet chosen)"
        t = ", ".join(f"{x:.4g}" for x in self.thresholds)
        return f"uncalibrated: quartiles of the first compression's per-layer CV ({t})"


def write_thresholds(path: str | Path, model: str, layer_cv: list[float], samples: int) -> tuple[float, float, float]:
    taus = quartile_thresholds(layer_cv)
    Path(path).write_text(yaml.safe_dump({
        "model": model,
        "thresholds": [float(t) for t in taus],
        "layer_cv": [float(c) for c in layer_cv],
        "compressions_sampled": samples,
        "rule": "25th/50th/75th percentiles of the per-layer mean CV of ||V|| over sample streams",
    }, sort_keys=False))
    return taus
