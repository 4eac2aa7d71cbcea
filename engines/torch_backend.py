"""The reference backends: edgekv's own torch modules (default off-Jetson)."""

from __future__ import annotations

import torch

from edgekv.attention import CacheAttention
from edgekv.cache.capped import CappedKVCache
from edgekv.model.qwen25vl import Qwen25VL


class TorchVision:
    name = "torch"

    def __init__(self, model: Qwen25VL) -> None:
        self.model = model

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.model.visual(pixel_values, grid_thw)


class TorchLLM:
    name = "torch"

    def __init__(self, model: Qwen25VL) -> None:
        self.language = model.language

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language.embed_tokens(ids)

    def prefill(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: CappedKVCache,
                visible: torch.Tensor | None = None, mass_out: torch.Tensor | None = None) -> torch.Tensor:
        attend = CacheAttention(cache, cache.length, embeds.shape[0], visible=visible, mass_out=mass_out)
        return self.language(embeds, position_ids, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language.logits(hidden)
