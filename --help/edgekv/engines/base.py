"""Backends: who runs the dense compute of a component (vision tower, language model).

The session does not know which backend runs. The cache logic (slots, metadata, policies, sinks)
stays outside every backend and is shared by all of them: an LLM backend gets the capped cache's
buffers as fixed-shape inputs, writes the chunk's new K/V at slots ``[start, start + P)`` (it does not
commit them) and, when asked, the per-key attention mass StateKV needs.
"""

from __future__ import annotations

from typing import Protocol

import torch

from edgekv.cache.capped import CappedKVCache


class VisionBackend(Protocol):
    name: str

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*2*14*14], grid_thw [1, 3] -> merged visual tokens [N/4, d]."""
        ...


class LLMBackend(Protocol):
    name: str

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [n] -> [n, d]."""
        ...

    def prefill(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: CappedKVCache,
                visible: torch.Tensor | None = None, mass_out: torch.Tensor | None = None) -> torch.Tensor:
        """Run the LM over a chunk at slots [cache.length, cache.length + P); returns final hidden [P, d].

        visible: [L, Hkv, cache.length] bool — committed slots the chunk may attend to (None: all).
        mass_out: [L, Hkv, M] fp32 — filled with each key's attention mass when given.
        """
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        ...


BACKEND_NAMES = ("torch", "onnxruntime", "tensorrt")


def check_backend_name(component: str, name: str) -> None:
    if name not in BACKEND_NAMES:
        raise ValueError(f"engines.{component}: unknown backend {name!r} (known: {', '.join(BACKEND_NAMES)})")
