"""The small work between a decode step's matrix products, fused: three Triton kernels for the CUDA-graph step.

On the first H200 run (issue 32) a 3B decode token launched ~1,540 kernels, ~1,250 of them elementwise ops on
vectors of 2,048 or fewer values (RMSNorm's seven, rotary's five a tensor, the residual adds, SiLU and its
product, the two ``index_copy_`` writes of K and V): 1.77 ms of a token at ~1.4 us each, a fifth of the graph's
time and more than the weights' 1.5 ms at the copy rate. Here each group is one kernel:

* ``add_rms_norm``: ``x <- x + delta`` (the residual, rounded to x's dtype as torch's add) and
  ``h = weight * (x / rms(x))`` with transformers' Qwen2 roundings — the normalisation in fp32, cast to the
  dtype, then the weight product rounded (``edgekv.model.language.RMSNorm``). Without ``delta``: the norm alone.
  The mean of squares is one fp32 tree sum: its order differs from torch's reduction, so a result can differ
  by one ulp where it lands near a rounding tie.
* ``rope_write``: q and k rotated by the step's cos/sin rows (``x * cos + rotate_half(x) * sin``, each product
  and the sum rounded to the dtype as torch's three ops are: ``edgekv.model.rope.apply_rotary``), q returned,
  the rotated key and the value written at the cache slot read from the device (what ``index_copy_`` did).
* ``silu_mul``: ``silu(gate) * up``, the SiLU rounded to the dtype before the product, as torch's two ops.

Per decoder layer the fused step (``edgekv.session.decode_graph``) launches: the q/k/v product (packed),
rope_write, the split attention (2), the o product, add_rms_norm, gate and up, silu_mul, down, add_rms_norm —
11 kernels instead of ~43.
"""

from __future__ import annotations

import torch

from edgekv.kernels._triton import jit, next_power_of_2, tl

_ROUNDING = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _rounding(dtype: torch.dtype) -> int:
    if dtype not in _ROUNDING:
        raise ValueError(f"fused decode kernels take fp32, bf16 or fp16, got {dtype}")
    return _ROUNDING[dtype]


@jit
def _rounded(x, ROUND: tl.constexpr):
    """fp32 -> the nearest value of the storage dtype (ties to even), kept in fp32: every rounding torch's eager
    ops make. bf16 by its bits (Triton's interpreter truncates in its own conversion); fp16 by conversion."""
    if ROUND == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    elif ROUND == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, x_out_ptr, h_ptr, n, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    base = row.to(tl.int64) * n
    x = tl.load(x_ptr + base + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x = _rounded(x + tl.load(delta_ptr + base + offs, mask=ok, other=0.0).to(tl.float32), ROUND)  # torch's add
        tl.store(x_out_ptr + base + offs, x.to(x_out_ptr.dtype.element_ty), mask=ok)
    mean = tl.sum(x * x, 0) / n
    normed = _rounded(x * tl.math.rsqrt(mean + eps), ROUND)
    weight = tl.load(w_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + base + offs, _rounded(weight * normed, ROUND).to(h_ptr.dtype.element_ty), mask=ok)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [P, d] (contiguous, one dtype), weight [d] -> (x + delta, RMSNorm(x + delta)), both new tensors
    (``x`` itself when ``delta`` is None)."""
    rows, n = x.shape
    if not x.is_contiguous() or (delta is not None and (not delta.is_contiguous() or delta.shape != x.shape)):
        raise ValueError("add_rms_norm takes contiguous [P, d] rows of one shape")
    h = torch.empty_like(x)
    out = torch.empty_like(x) if delta is not None else x
    _add_rms_norm_kernel[(rows,)](x, delta if delta is not None else x, weight, out, h, n, eps,
                                  HAS_DELTA=delta is not None, BLOCK=next_power_of_2(n), ROUND=_rounding(x.dtype))
    return out, h


@jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    act = _rounded(gate / (1.0 + tl.exp(-gate)), ROUND)
    tl.store(out_ptr + offs, _rounded(act * up, ROUND).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for contiguous tensors of one shape and dtype."""
    if gate.shape != up.shape or not (gate.is_contiguous() and up.is_contiguous()):
        raise ValueError("silu_mul takes contiguous tensors of one shape")
    out = torch.empty_like(gate)
    n = gate.numel()
    block = 1024
    _silu_mul_kernel[((n + block - 1) // block,)](gate, up, out, n, BLOCK=block, ROUND=_rounding(gate.dtype))
    return out


@jit
def _rope_write_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, q_out_ptr, kc_ptr, vc_ptr, slot_ptr,
                       heads_q, s_ch, s_cn, D: tl.constexpr, HALF: tl.constexpr, ROUND: tl.constexpr):
    head = tl.program_id(0)  # query heads first, then KV heads
    offs = tl.arange(0, HALF)
    cos_lo = tl.load(cos_ptr + offs).to(tl.float32)
    cos_hi = tl.load(cos_ptr + HALF + offs).to(tl.float32)
    sin_lo = tl.load(sin_ptr + offs).to(tl.float32)
    sin_hi = tl.load(sin_ptr + HALF + offs).to(tl.float32)
    is_q = head < heads_q
    kv_head = head - heads_q
    if is_q:
        lo = tl.load(q_ptr + head * D + offs).to(tl.float32)
        hi = tl.load(q_ptr + head * D + HALF + offs).to(tl.float32)
    else:
        lo = tl.load(k_ptr + kv_head * D + offs).to(tl.float32)
        hi = tl.load(k_ptr + kv_head * D + HALF + offs).to(tl.float32)
    # rotate_half(x) = [-hi, lo]; each product and the sum rounded to the dtype (torch's x*cos, rot*sin, +)
    new_lo = _rounded(_rounded(lo * cos_lo, ROUND) + _rounded(-hi * sin_lo, ROUND), ROUND)
    new_hi = _rounded(_rounded(hi * cos_hi, ROUND) + _rounded(lo * sin_hi, ROUND), ROUND)
    if is_q:
        tl.store(q_out_ptr + head * D + offs, new_lo.to(q_out_ptr.dtype.element_ty))
        tl.store(q_out_ptr + head * D + HALF + offs, new_hi.to(q_out_ptr.dtype.element_ty))
    else:
        slot = tl.load(slot_ptr)
        at = kv_head.to(tl.int64) * s_ch + slot * s_cn
        tl.store(kc_ptr + at + offs, new_lo.to(kc_ptr.dtype.element_ty))
        tl.store(kc_ptr + at + HALF + offs, new_hi.to(kc_ptr.dtype.element_ty))
        value = tl.load(v_ptr + kv_head * D + tl.arange(0, D))
        tl.store(vc_ptr + at + tl.arange(0, D), value.to(vc_ptr.dtype.element_ty))


def rope_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               cache_k: torch.Tensor, cache_v: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """q [Hq * D], k, v [Hkv * D] (one token's projections, contiguous), cos/sin [D] in q's dtype; cache_k/v one
    layer [Hkv, M, D] (unit stride along D, one layout); slot: one-element int tensor on the device. Writes the
    rotated key and the value at the slot; returns the rotated query [Hq, 1, D]."""
    dim = cos.shape[-1]
    heads_q, heads_kv = q.numel() // dim, k.numel() // dim
    if dim % 2 or dim & (dim - 1):
        raise ValueError(f"rope_write needs a power-of-two head_dim, got {dim}")
    if cache_k.stride() != cache_v.stride() or cache_k.stride(-1) != 1:
        raise ValueError("cache_k and cache_v must share one layout with unit stride along D")
    q_out = torch.empty(heads_q, 1, dim, dtype=q.dtype, device=q.device)
    _rope_write_kernel[(heads_q + heads_kv,)](
        q.contiguous(), k.contiguous(), v.contiguous(), cos.reshape(-1).contiguous(), sin.reshape(-1).contiguous(),
        q_out, cache_k, cache_v, slot, heads_q, cache_k.stride(0), cache_k.stride(1), D=dim, HALF=dim // 2,
        ROUND=_rounding(q.dtype))
    return q_out


# ---------------------------------------------------------------------------------------------- chunks (prefill)
@jit
def _silu_mul_rows_kernel(gate_ptr, up_ptr, out_ptr, n, s_gate, s_up, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    gate = tl.load(gate_ptr + row.to(tl.int64) * s_gate + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row.to(tl.int64) * s_up + offs, mask=ok, other=0.0).to(tl.float32)
    act = _rounded(gate / (1.0 + tl.exp(-gate)), ROUND)
    tl.store(out_ptr + row.to(tl.int64) * n + offs, _rounded(act * up, ROUND).to(out_ptr.dtype.element_ty), mask=ok)


def silu_mul_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for [P, n] rows with unit stride along n and any row stride (the two halves of a
    packed gate|up product's output, say) -> [P, n] contiguous; roundings as ``silu_mul``."""
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("silu_mul_rows takes [P, n] rows of one shape and dtype with unit stride along n")
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_rows_kernel[(rows, (n + block - 1) // block)](gate, up, out, n, gate.stride(0), up.stride(0),
                                                            BLOCK=block, ROUND=_rounding(gate.dtype))
    return out


@jit
def _rope_rows_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, rows, s_row, heads_q, heads_kv,
                      D: tl.constexpr, HALF: tl.constexpr, ROUND: tl.constexpr):
    # grid: (heads_q + 2 * heads_kv, rows): query heads, then key heads (rotated), then value heads (copied)
    head = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, HALF)
    src = qkv_ptr + row * s_row + head * D
    if head < heads_q + heads_kv:
        cos_lo = tl.load(cos_ptr + row * D + offs).to(tl.float32)
        cos_hi = tl.load(cos_ptr + row * D + HALF + offs).to(tl.float32)
        sin_lo = tl.load(sin_ptr + row * D + offs).to(tl.float32)
        sin_hi = tl.load(sin_ptr + row * D + HALF + offs).to(tl.float32)
        lo = tl.load(src + offs).to(tl.float32)
        hi = tl.load(src + HALF + offs).to(tl.float32)
        # rotate_half(x) = [-hi, lo]; each product and the sum rounded to the dtype (torch's x*cos, rot*sin, +)
        new_lo = _rounded(_rounded(lo * cos_lo, ROUND) + _rounded(-hi * sin_lo, ROUND), ROUND)
        new_hi = _rounded(_rounded(hi * cos_hi, ROUND) + _rounded(lo * sin_hi, ROUND), ROUND)
        if head < heads_q:
            dst = q_ptr + (head * rows + row) * D
        else:
            dst = k_ptr + ((head - heads_q) * rows + row) * D
        tl.store(dst + offs, new_lo.to(q_ptr.dtype.element_ty))
        tl.store(dst + HALF + offs, new_hi.to(q_ptr.dtype.element_ty))
    else:
        value = tl.load(src + tl.arange(0, D))
        tl.store(v_ptr + ((head - heads_q - heads_kv) * rows + row) * D + tl.arange(0, D), value)


def rope_rows(qkv: torch.Tensor, heads_q: int, heads_kv: int, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk's packed q|k|v projections [P, (Hq + 2 Hkv) D] (unit stride along the row), cos/sin [P, D] in its
    dtype -> (q [Hq, P, D], k [Hkv, P, D], v [Hkv, P, D]), contiguous: q and k rotated as
    ``edgekv.model.rope.apply_rotary`` rounds (``rope_write``'s math, a row at a time), v copied. One launch for
    what the layer's own forward does in ~12 (views, two rotations of five ops, casts)."""
    rows = qkv.shape[0]
    dim = cos.shape[-1]
    if dim % 2 or dim & (dim - 1):
        raise ValueError(f"rope_rows needs a power-of-two head_dim, got {dim}")
    if qkv.dim() != 2 or qkv.stride(1) != 1 or qkv.shape[1] != (heads_q + 2 * heads_kv) * dim:
        raise ValueError(f"rope_rows takes [P, (Hq + 2 Hkv) * D] rows with unit stride, got {tuple(qkv.shape)}")
    cos, sin = cos.to(qkv.dtype).contiguous(), sin.to(qkv.dtype).contiguous()
    if cos.shape != (rows, dim) or sin.shape != (rows, dim):
        raise ValueError(f"rope_rows: cos/sin must be [P, D] = [{rows}, {dim}], got {tuple(cos.shape)}")
    q = torch.empty(heads_q, rows, dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(heads_kv, rows, dim, dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    _rope_rows_kernel[(heads_q + 2 * heads_kv, rows)](qkv, cos, sin, q, k, v, rows, qkv.stride(0), heads_q, heads_kv,
                                                      D=dim, HALF=dim // 2, ROUND=_rounding(qkv.dtype))
    return q, k, v
