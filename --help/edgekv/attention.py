"""Attention of a chunk of new tokens against the capped cache.

The language model hands each layer's rotated ``q, k, v`` of the new chunk to an ``AttendFn``; the
one here writes ``k, v`` into the cache at the chunk's slots and attends over the valid prefix of the
cache ``[0, start + P)``: every committed slot is visible, the chunk itself is causal. Slot order does
not matter to softmax, so a compacted (reordered) cache needs no positional bookkeeping here — the
positions are already inside the rotated keys.

``visible`` optionally restricts the committed slots per (layer, KV head) — StateKV prefill attends
only to ``[prefix ; sinks ; this frame pair]``. ``mass_out`` makes the call also write each key's
attention mass (StateKV eq. 6).

Cost: when every (layer, KV head) sees the same number ``V`` of committed slots — StateKV's case: the
prefix plus exactly ``min(B, candidates)`` sinks each — the visible keys are gathered first (StateKV
eq. 5: the pair's context is ``[prefix ; sinks]``, not the cache) and attention with mass runs over
``V + P`` keys, so per-pair cost follows ``B``, not the cache length. The mass is scattered back to
the slots it belongs to (invisible slots get exactly 0). Otherwise the whole valid prefix is attended
with a mask (same result, cost in the cache length).

Fast path (decode, and any chunk that sees every committed slot: ``visible`` and ``mass_out`` both
None): each KV head's ``G = Hq / Hkv`` query heads are folded onto the query axis, so one plain
attention call per KV head reads each key once and needs no ``enable_gqa``; a single query needs no
mask at all. On an 8-bit cache with Triton (CUDA, or the interpreter), the fast path reads the 8-bit codes
and scales in the kernel (``edgekv.kernels.quant_attention``) instead of a dequantized copy of the layer.
A ``[1, N]`` all-true mask with ``enable_gqa`` sends SDPA down its slow path on CPU
(issue 17: 1.03 ms fp32 / 7.06 ms bf16 per layer at N = 2063 against 0.30 / 0.37 ms folded).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgekv.cache.capped import CappedKVCache
from edgekv.kernels._triton import use_triton
from edgekv.kernels.attention_mass import attention_mass
from edgekv.kernels.quant_attention import quantized_attention
from edgekv.kernels.sdpa import chunk_causal_mask, folded_attention


class CacheAttention:
    """An ``AttendFn`` bound to one chunk: slots ``[start, start + P)`` of ``cache``."""

    def __init__(
        self,
        cache: CappedKVCache,
        start: int,
        num_new: int,
        visible: torch.Tensor | None = None,  # [layers, kv_heads, >= start] bool
        mass_out: torch.Tensor | None = None,
    ) -> None:
        if start + num_new > cache.capacity:
            raise ValueError(f"chunk [{start}, {start + num_new}) exceeds cache capacity {cache.capacity}")
        self.cache = cache
        self.start = start
        self.num_new = num_new
        self.visible = visible
        self.mass_out = mass_out  # [layers, kv_heads, M] fp32: per-key attention mass, when asked
        self.gather = None  # [layers, kv_heads, V] visible committed slots, when every head sees V of them
        if visible is not None and mass_out is not None:
            self.gather = visible_slots(visible[:, :, :start])
        # [P, start + P]; the gathered path never reads it
        self.mask = chunk_causal_mask(start, num_new, cache.device) if self.gather is None else None

    def _attend_visible(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention + mass over [the V visible committed slots ; the chunk] only (StateKV eq. 5)."""
        cache, start, end = self.cache, self.start, self.start + self.num_new
        index = self.gather[layer]  # [Hkv, V] ascending
        rows = index.unsqueeze(-1).expand(-1, -1, cache.head_dim)
        layer_k, layer_v = cache.keys(layer, end), cache.values(layer, end)  # dequantized if 8-bit
        keys = torch.cat([layer_k.gather(1, rows), layer_k[:, start:end]], dim=1)  # [Hkv, V + P, D]
        values = torch.cat([layer_v.gather(1, rows), layer_v[:, start:end]], dim=1)
        out, mass = attention_mass(q, keys, values, start=index.shape[1])  # mass [Hkv, V + P]
        target = self.mass_out[layer]
        target[:, :end].zero_()
        target.scatter_(1, index, mass[:, : index.shape[1]])
        target[:, start:end] = mass[:, index.shape[1]:]
        return out

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [Hq, P, hd]; k, v: [Hkv, P, hd]
        cache, end = self.cache, self.start + self.num_new
        cache.write_layer(layer, self.start, k, v)
        if self.gather is not None:
            return self._attend_visible(layer, q)
        committed = None if self.visible is None else self.visible[layer]  # [Hkv, start] bool
        if committed is None and self.mass_out is None:
            if cache.quantized and use_triton(q, cache.k):  # 8-bit codes read in the kernel, no dequantized copy
                return quantized_attention(q, cache.k[layer], cache.k_scale[layer], cache.v[layer], cache.v_scale[layer],
                                           cache.tpos[layer], *cache.rope, start=self.start)
            return folded_attention(q, cache.keys(layer, end), cache.values(layer, end), self.start)
        if self.mass_out is not None:
            out, _ = attention_mass(q, cache.keys(layer), cache.values(layer), start=self.start, visible=committed,
                                    mass_out=self.mass_out[layer])
            return out
        keys = cache.keys(layer, end)  # [Hkv, N, hd]; dequantized if the cache is 8-bit
        values = cache.values(layer, end)
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


def visible_slots(visible: torch.Tensor) -> torch.Tensor | None:
    """[L, Hkv, n] bool -> [L, Hkv, V] int64 ascending indices of the visible slots, when every (layer,
    KV head) has the same count ``V``; None otherwise (the caller then masks). One host sync."""
    layers, heads, n = visible.shape
    counts = visible.sum(-1)
    if n == 0 or not bool((counts == counts.view(-1)[0]).all()):
        return None
    count = int(counts.view(-1)[0])
    return visible.nonzero()[:, 2].view(layers, heads, count)  # nonzero is row-major: ascending per head


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
