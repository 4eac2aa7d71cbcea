"""The 4-bit word formats the int4 kernels read: AutoAWQ's GEMM words (eight values per int32, columns in
``AWQ_ORDER``) and GPTQ's (plain order, along rows or columns), packing, unpacking and the exact dequantization
``W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]``. ``edgekv.model.int4`` (the module that holds the weights,
the checkpoint layouts) re-exports them; the kernels' torch references use them directly.
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds column 8j + AWQ_ORDER[i]
AWQ_INVERSE = tuple(AWQ_ORDER.index(c) for c in range(PACK))  # column 8j + c sits in nibble AWQ_INVERSE[c]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the same bits as int32 (what safetensors stores)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: value i of every word (bits 4i..4i+3)."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32, device=words.device)
    return ((words.to(torch.int32).unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


def _words(values: torch.Tensor) -> torch.Tensor:
    """[..., W, 8] integers in 0..15 -> int32 [..., W] with value i in bits 4i..4i+3."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64, device=values.device)
    return _to_int32((values.to(torch.int64) << shifts).sum(-1))


def _check_range(q: torch.Tensor, what: str) -> None:
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 15):
        raise ValueError(f"{what}: 4-bit values must be in 0..15, got {int(q.min())}..{int(q.max())}")


def pack_awq(q: torch.Tensor) -> torch.Tensor:
    """[R, C] integers 0..15 -> AutoAWQ GEMM words int32 [R, C/8] (columns interleaved by ``AWQ_ORDER``)."""
    _check_range(q, "pack_awq")
    rows, cols = q.shape
    if cols % PACK:
        raise ValueError(f"pack_awq: {cols} columns is not a multiple of {PACK}")
    grouped = q.reshape(rows, cols // PACK, PACK)[..., list(AWQ_ORDER)]  # nibble i <- column AWQ_ORDER[i]
    return _words(grouped)


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM words int32 [R, C/8] -> uint8 [R, C] in column order."""
    rows, packed = words.shape
    return _nibbles(words)[..., list(AWQ_INVERSE)].reshape(rows, packed * PACK)


def pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """[K, N] -> GPTQ ``qweight`` int32 [K/8, N] (word r of a column holds rows 8r..8r+7, in order)."""
    _check_range(q, "pack_gptq_rows")
    k, n = q.shape
    if k % PACK:
        raise ValueError(f"pack_gptq_rows: {k} rows is not a multiple of {PACK}")
    return _words(q.reshape(k // PACK, PACK, n).transpose(1, 2))


def unpack_gptq_rows(words: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qweight`` int32 [K/8, N] -> uint8 [K, N]."""
    packed, n = words.shape
    return _nibbles(words).transpose(1, 2).reshape(packed * PACK, n)


def pack_gptq_cols(q: torch.Tensor) -> torch.Tensor:
    """[G, N] -> GPTQ ``qzeros`` int32 [G, N/8] (plain order along the output dimension)."""
    _check_range(q, "pack_gptq_cols")
    g, n = q.shape
    if n % PACK:
        raise ValueError(f"pack_gptq_cols: {n} columns is not a multiple of {PACK}")
    return _words(q.reshape(g, n // PACK, PACK))


def unpack_gptq_cols(words: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qzeros`` int32 [G, N/8] -> uint8 [G, N]."""
    g, packed = words.shape
    return _nibbles(words).reshape(g, packed * PACK)


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """q [K, N], zeros [K/g, N], scales [K/g, N] -> W^T [K, N] fp32, exact: (q - z) is an integer in
    -15..15 and a float16 scale times it needs at most 15 significant bits."""
    z = zeros.to(torch.float32).repeat_interleave(group, dim=0)
    s = scales.to(torch.float32).repeat_interleave(group, dim=0)
    return (q.to(torch.float32) - z) * s
