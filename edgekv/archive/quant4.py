"""4-bit archive records (``archive.kv_dtype: int4``): a frame pair's K/V on flash in half an 8-bit record's bytes.

An archived pair never changes after it is written — no compaction moves its tokens, unlike the cache's slots
(edgekv/cache/quant.py, which for that reason scales each slot on its own) — so its keys can be quantized the way
KIVI (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", §3) finds keys need: **per
channel**, over the pair's tokens, since a few key channels carry outliers that a per-token scale would spread over
every other channel of the token; values **per token**, over its channels, as KIVI quantizes them. Both asymmetric
(KIVI §3.1), 16 levels:

    lo    = min(x) over the group, rounded down to bf16      (keys: a channel's P tokens; values: a token's D channels)
    scale = (max(x) - lo) / 15, rounded up to bf16           so that (x - lo) / scale <= 15 and nothing clips
    q     = round((x - lo) / scale) in [0, 15]               two codes a byte: even channel low nibble, odd high
    x'    = q * scale + lo                                   (fp32, then the cache's dtype)

A layer of a record: K codes [kv_heads, P, head_dim / 2] u8, V codes the same, then K scales and K minima
[kv_heads, head_dim] bf16, then V scales and V minima [kv_heads, P] bf16 — ``kv_heads * (P * head_dim + 4 * head_dim
+ 4 * P)`` bytes against ``2 * kv_heads * P * (head_dim + 2)`` for 8 bits: at the 3B shape (2 KV heads, head_dim
128, 256 tokens a pair) 0.515 of an 8-bit record's K/V, 0.262 of a bf16 one's. The keys are stored rotated at their
positions, as every archive record (the pair's tokens share one temporal angle; the spatial angles differ, so a
channel's range covers its rotation partner's too).
"""

from __future__ import annotations

import torch

LEVELS = 15  # 4 bits, asymmetric: codes 0..15
_SCALE = torch.bfloat16
_TINY = 1e-30  # a constant group (all its values equal) gets a tiny scale, never 0 / 0


def layer_bytes(kv_heads: int, tokens: int, head_dim: int) -> int:
    """Bytes of one layer of one 4-bit record: K and V codes, then their scales and minima."""
    return kv_heads * (tokens * head_dim + 4 * head_dim + 4 * tokens)


def _quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x fp32 -> (codes u8 in [0, 15] of x's shape, scale and minimum in bf16 with ``dim`` reduced away)."""
    lo = x.amin(dim=dim, keepdim=True)
    hi = x.amax(dim=dim, keepdim=True)
    lo_b = lo.to(_SCALE)
    lo_b = torch.where(lo_b.to(torch.float32) > lo, torch.nextafter(lo_b, torch.full_like(lo_b, -torch.inf)), lo_b)
    lo_f = lo_b.to(torch.float32)  # rounded down: an exact minimum (a constant group) stays exact
    scale = ((hi - lo_f) / LEVELS * (1.0 + 2.0 ** -7)).clamp_min(_TINY).to(_SCALE)  # rounded up
    codes = ((x - lo_f) / scale.to(torch.float32)).round_().clamp_(0, LEVELS).to(torch.uint8)
    return codes, scale.squeeze(dim), lo_b.squeeze(dim)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., D] codes -> [..., D / 2] bytes: channel 2i in the low nibble, 2i + 1 in the high one."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., D / 2] bytes -> [..., D] codes (``_pack`` undone)."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _bytes(t: torch.Tensor, layers: int) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(layers, -1)


def quantize_layers(kv: torch.Tensor) -> torch.Tensor:
    """A staged pair's K/V [layers, 2, kv_heads, P, head_dim] (float) -> its 4-bit records' bytes, one row a layer
    (``layer_bytes`` each)."""
    layers, _, heads, tokens, dim = kv.shape
    if dim % 2:
        raise ValueError(f"4-bit archive records need an even head_dim, got {dim}")
    x = kv.to(torch.float32)
    k_codes, k_scale, k_min = _quantize(x[:, 0], dim=-2)  # per channel, over the pair's tokens: [L, H, D]
    v_codes, v_scale, v_min = _quantize(x[:, 1], dim=-1)  # per token, over its channels: [L, H, P]
    return torch.cat([_bytes(_pack(k_codes), layers), _bytes(_pack(v_codes), layers), _bytes(k_scale, layers),
                      _bytes(k_min, layers), _bytes(v_scale, layers), _bytes(v_min, layers)], dim=1)


def dequantize_into(block: torch.Tensor, tokens: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """One layer's record bytes (``quantize_layers``'s row) dequantized into ``k``, ``v`` [kv_heads, P, head_dim]."""
    heads, _, dim = k.shape
    codes = heads * tokens * dim // 2
    k_codes, v_codes = (_unpack(block[i * codes:(i + 1) * codes].view(heads, tokens, dim // 2)).to(torch.float32)
                        for i in range(2))
    at = 2 * codes
    parts = []
    for count in (heads * dim, heads * dim, heads * tokens, heads * tokens):
        parts.append(block[at:at + 2 * count].view(_SCALE).to(torch.float32))
        at += 2 * count
    k_scale, k_min = (p.view(heads, 1, dim) for p in parts[:2])
    v_scale, v_min = (p.view(heads, tokens, 1) for p in parts[2:])
    k.copy_(k_codes * k_scale + k_min)
    v.copy_(v_codes * v_scale + v_min)
