"""Attention of a chunk of new tokens against the capped cache.

The language model hands each layer's rotated ``q, k, v`` of the new chunk to an ``AttendFn``; the
one here writes ``k, v`` into the cache at the chunk's slots and attends over the valid prefix of the
cache ``[0, start + P)``: every committed slot is visible, the chunk itself is causal. Slot order does
not matter to softmax, so a compacted (reordered) cache needs no positional bookkeeping here — the
positions are already inside the rotated keys.

``visible`` optionally restricts the committed slots per (layer, KV head) — StateKV prefill attends
only to ``[prefix ; sinks ; this frame pair]``. ``want_mass`` makes the call also return each key's
attention mass (StateKV eq. 6).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from edgekv.cache.capped import CappedKVCache


def chunk_causal_mask(start: int, num_new: int, device: torch.device) -> torch.Tensor:
    """[P, start + P] bool: all committed keys visible, causal inside the chunk."""
    mask = torch.ones(num_new, start + num_new, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril_()
    return mask


class CacheAttention:
    """An ``AttendFn`` bound to one chunk: slots ``[start, start + P)`` of ``cache``."""

    def __init__(
        self,
        cache: CappedKVCache,
        start: int,
        num_new: int,
        visible: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        if start + num_new > cache.capacity:
            raise ValueError(f"chunk [{start}, {start + num_new}) exceeds cache capacity {cache.capacity}")
        self.cache = cache
        self.start = start
        self.num_new = num_new
        self.visible = visible
        self.mask = chunk_causal_mask(start, num_new, cache.device)  # [P, start + P]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [Hq, P, hd]; k, v: [Hkv, P, hd]
        cache, end = self.cache, self.start + self.num_new
        cache.write_layer(layer, self.start, k, v)
        keys = cache.k[layer, :, :end]  # [Hkv, N, hd]
        values = cache.v[layer, :, :end]
        mask = self.mask
        if self.visible is not None:
            # visible(layer): [Hkv, start] bool over committed slots -> per-KV-head mask [Hkv, 1, P, N]
            committed = self.visible(layer)
            head_mask = torch.cat(
                [committed.unsqueeze(1).expand(-1, self.num_new, -1), self.mask[:, self.start:].expand(committed.shape[0], -1, -1)],
                dim=2,
            )
            mask = head_mask.repeat_interleave(q.shape[0] // keys.shape[0], dim=0)  # [Hq, P, N]
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0).to(q.dtype), values.unsqueeze(0).to(q.dtype),
            attn_mask=mask, enable_gqa=True,
        ).squeeze(0)
