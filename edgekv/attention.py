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
from edgekv.kernels.attention_mass import attention_mass


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
        mass_out: torch.Tensor | None = None,
    ) -> None:
        if start + num_new > cache.capacity:
            raise ValueError(f"chunk [{start}, {start + num_new}) exceeds cache capacity {cache.capacity}")
        self.cache = cache
        self.start = start
        self.num_new = num_new
        self.visible = visible
        self.mass_out = mass_out  # [layers, kv_heads, M] fp32: per-key attention mass, when asked
        self.mask = chunk_causal_mask(start, num_new, cache.device)  # [P, start + P]

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [Hq, P, hd]; k, v: [Hkv, P, hd]
        cache, end = self.cache, self.start + self.num_new
        cache.write_layer(layer, self.start, k, v)
        committed = None if self.visible is None else self.visible(layer)  # [Hkv, start] bool
        if self.mass_out is not None:
            out, _ = attention_mass(q, cache.k[layer], cache.v[layer], start=self.start, visible=committed,
                                    mass_out=self.mass_out[layer])
            return out
        keys = cache.k[layer, :, :end]  # [Hkv, N, hd]
        values = cache.v[layer, :, :end]
        mask = self.mask
        if committed is not None:
            head_mask = torch.cat(
                [committed.unsqueeze(1).expand(-1, self.num_new, -1),
                 self.mask[:, self.start:].expand(committed.shape[0], -1, -1)],
                dim=2,
            )
            mask = head_mask.repeat_interleave(q.shape[0] // keys.shape[0], dim=0)  # [Hq, P, N]
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), keys.unsqueeze(0).to(q.dtype), values.unsqueeze(0).to(q.dtype),
            attn_mask=mask, enable_gqa=True,
        ).squeeze(0)


def attention_with_mass(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager GQA attention that also returns each key's attention mass (StateKV eq. 1 and 6).

    q: [Hq, P, D]; k, v: [Hkv, N, D]; mask: [P, N] or [Hq, P, N] bool (True = visible).
    Returns out [Hq, P, D] and mass [Hkv, N]: softmax probabilities summed over the chunk's queries
    and averaged over the query heads that share each KV head. Masked keys get exactly zero mass.
    Materializes [Hq, P, N] scores; ``edgekv.kernels.attention_mass`` is the fused version.
    """
    heads_q, num_q, dim = q.shape
    heads_kv = k.shape[0]
    group = heads_q // heads_kv
    qg = q.to(torch.float32).view(heads_kv, group, num_q, dim)
    scores = torch.einsum("hgpd,hnd->hgpn", qg, k.to(torch.float32)) * dim ** -0.5
    scores = scores.masked_fill(~mask.view(-1, group, num_q, mask.shape[-1]) if mask.dim() == 3 else ~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgpn,hnd->hgpd", probs, v.to(torch.float32)).reshape(heads_q, num_q, dim)
    return out.to(q.dtype), probs.sum(dim=2).mean(dim=1)
