"""8-bit KV storage for the capped cache (``cache.kv_dtype: int8 | fp8``): quantize on write, dequantize on read.

Granularity: **one scale per (layer, KV head, slot)** for keys and for values — absmax over the slot's
``head_dim`` channels, stored beside the slot in bf16 and moved with it by every compaction.

    scale = absmax(x) / Q          (Q = 127 for int8, 448 for float8_e4m3fn's largest normal)
    q     = round(x / scale)       int8: rounded to nearest, clamped to [-127, 127]
          = fp8(x / scale)         fp8:  torch's round-to-nearest cast to float8_e4m3fn
    x'    = q * scale              (dequantized in fp32, then the model's dtype)

Why per token for keys too. KIVI (Liu et al. 2024) quantizes keys per channel over a group of tokens
because a few key channels carry outliers, and KVQuant (Hooper et al. 2024) quantizes keys per channel
(before RoPE) for the same reason. Both assume a cache whose tokens stay in arrival order: here every (layer, head)
keeps and evicts its own slots, so a scale shared by a group of tokens would have to be recomputed at
every compaction (a group loses members) — a re-quantization error each time. A per-slot scale moves
with its slot bit-exactly. Measured on the trained toy model (60 pairs of a needle stream, relative
Frobenius error of the keys): per-slot 0.44 %, per-slot after per-channel factors taken from the prefix
0.62 % (worse: the prefix does not predict the video's channel ranges), KIVI groups of 32 tokens 0.25 %
(not usable, see above). Values are per token in KIVI as here.

The scale is rounded *up* to bf16 (8 bits of mantissa, fp32's range: no underflow for tiny vectors)
before dividing, so ``|x / scale| <= Q`` and nothing clips; the bf16 rounding only coarsens the grid by
at most 2**-7. Bytes per slot and KV head: ``2 * head_dim`` (K and V) + 4 (two bf16 scales), against
``4 * head_dim`` for fp16: at head_dim 128 and edgekv's 14 metadata bytes per slot, 274 against 526 —
1.92x the slots in the same bytes (CacheSpec counts both).

Where Triton runs, an int8 cache's chunk is written by one kernel a layer (``kernels/quant_write.py``: the
rotation to time-neutral and this quantization, the same operations in the same order; a kernel the device's
Triton cannot build leaves this path for the rest of the cache's life, with one warning); fp8 stays here.
"""

from __future__ import annotations

import torch

SCALE_DTYPE = torch.bfloat16
QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)
_LEVELS = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
_TINY = 1e-30  # an all-zero slot gets a tiny scale, never 0 / 0


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [..., D] float -> (q [..., D] ``dtype``, scale [...] bf16), one scale per row of D."""
    levels = _LEVELS[dtype]
    x = x.to(torch.float32)
    amax = x.abs().amax(dim=-1).clamp_min(_TINY)
    scale = (amax / levels * (1.0 + 2.0 ** -7)).to(SCALE_DTYPE)  # rounded up: |x / scale| <= levels
    y = (x / scale.to(torch.float32).unsqueeze(-1)).clamp_(-levels, levels)
    q = y.round_().to(torch.int8) if dtype == torch.int8 else y.to(dtype)
    return q, scale


_FP8_VALUES: torch.Tensor | None = None


def _fp8_to_float32(q: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> fp32 on CPU through a table of its 256 values: exactly the cast (NaN bytes included), which
    torch runs element by element there (~40x an int8 cast; the table: ~2x faster than the cast)."""
    global _FP8_VALUES
    if _FP8_VALUES is None:
        _FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
    return torch.take(_FP8_VALUES, q.view(torch.uint8).long())


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [..., D], scale [...]) -> [..., D] in ``dtype`` (the math in fp32)."""
    values = _fp8_to_float32(q) if q.dtype == torch.float8_e4m3fn and q.device.type == "cpu" else q.to(torch.float32)
    return (values * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 buffers as uint8 (gather and the compaction kernels move bytes; fp8 gather is not on CPU)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
