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
