"""An 8-bit (int8) cache's write of a chunk's keys and values in one launch (issue 32).

What ``CappedKVCache.write_layer`` does for an int8 cache (``edgekv/cache/quant.py``, ``edgekv/positions.py``):

    key   <- rotate_temporal(key, -tpos)               the temporal M-RoPE pairs turned back: stored time-neutral
    scale <- bf16(absmax(x) / 127 * (1 + 2^-7))        one per (KV head, slot), rounded to nearest
    code  <- round_half_even(clamp(x / scale, +-127))  int8

In torch that is ~34 operators a layer (the rotation's five a half plus cos / sin / casts, the quantization's
nine, twice, and the copies): on an H200 an int8-cache 3B pair launched 5,458 kernels against 3,221 on a bf16
cache and took 61 ms of prefill against 31 (``tools/gpu/profile_pair.py``, 2026-11-26). Here one program
quantizes one row (a KV head's key or value at one slot): the same fp32 operations in the same order (no fused
multiply-adds, precise division and, on CUDA, libdevice sin / cos), so the codes and scales are torch's — the
interpreter's numpy trig may differ from torch's in the last bit, which moves a code only at a rounding tie.

fp8 (``float8_e4m3fn``) writes stay on torch: the kernel would need a hardware fp8 conversion Orin (sm_87) lacks.
"""

from __future__ import annotations

import torch

from edgekv.kernels._triton import jit, libdevice, next_power_of_2, precise_trig, round_to_bf16, tl

# ---------------------------------------------------------------------------------------------- reference
def quantize_write_reference(k: torch.Tensor, v: torch.Tensor, tpos: torch.Tensor, inv_freq: torch.Tensor,
                             temporal_section: int, dtype: torch.dtype = torch.int8
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """k, v [H, P, D]; tpos [H, P] -> (key codes, key scales, value codes, value scales) as an 8-bit cache of
    ``dtype`` stores them: the cache's own write where the kernel does not run (and fp8's everywhere)."""
    from edgekv.cache.quant import quantize
    from edgekv.positions import rotate_temporal

    neutral = rotate_temporal(k.to(torch.float32), -tpos, inv_freq, temporal_section)
    return (*quantize(neutral, dtype), *quantize(v, dtype))


# ---------------------------------------------------------------------------------------------- kernel
@jit
def _round_half_even(y):
    """fp32 -> the nearest integer, ties to even (torch.round), kept in fp32; exact for |y| < 2^23."""
    a = tl.abs(y)
    whole = tl.floor(a)
    frac = a - whole  # exact: a >= 0 and whole <= a < whole + 1
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) != 0.0
    up = (frac > 0.5) | ((frac == 0.5) & odd)
    rounded = tl.where(up, whole + 1.0, whole)
    return tl.where(y < 0, -rounded, rounded)


@jit
def _quantize_write_kernel(k_ptr, v_ptr, tpos_ptr, inv_freq_ptr, kq_ptr, ks_ptr, vq_ptr, vs_ptr,
                           s_kh, s_kp, s_vh, s_vp, s_th, s_tp, s_qh, s_qp, s_sh, s_sp, temporal_section,
                           D: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr, PRECISE_TRIG: tl.constexpr):
    # grid: (H, P, 2): KV head, row of the chunk, key (0) or value (1)
    head = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    ok = offs < D
    if tl.program_id(2) == 0:
        base = k_ptr + head * s_kh + row * s_kp
        x = tl.load(base + offs, mask=ok, other=0.0).to(tl.float32)
        pair = tl.where(offs < HALF, offs + HALF, offs - HALF)  # the other half of each rotary pair
        partner = tl.load(base + pair, mask=ok, other=0.0).to(tl.float32)
        j = tl.where(offs < HALF, offs, offs - HALF)
        temporal = ok & (j < temporal_section)
        t = tl.load(tpos_ptr + head * s_th + row * s_tp).to(tl.float32)
        angle = (-t) * tl.load(inv_freq_ptr + j, mask=temporal, other=0.0)  # rotate_temporal by -tpos
        if PRECISE_TRIG:
            cos, sin = libdevice.cos(angle), libdevice.sin(angle)
        else:
            cos, sin = tl.cos(angle), tl.sin(angle)
        # x1 cos - x2 sin (first half), x2 cos + x1 sin (second half): each product and the sum rounded
        rotated = tl.where(offs < HALF, x * cos - partner * sin, x * cos + partner * sin)
        x = tl.where(temporal, rotated, x)
        codes_ptr, scale_ptr = kq_ptr, ks_ptr
    else:
        x = tl.load(v_ptr + head * s_vh + row * s_vp + offs, mask=ok, other=0.0).to(tl.float32)
        codes_ptr, scale_ptr = vq_ptr, vs_ptr
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30)
    # rounded to the nearest bf16; the factor 1 + 2^-7 keeps |x / scale| <= 127
    scale = round_to_bf16(tl.math.div_rn(amax, 127.0) * 1.0078125)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -127.0), 127.0)
    tl.store(codes_ptr + head * s_qh + row * s_qp + offs, _round_half_even(y).to(tl.int8), mask=ok)
    tl.store(scale_ptr + head * s_sh + row * s_sp, scale.to(scale_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------- launcher
def quantize_write_triton(k: torch.Tensor, v: torch.Tensor, tpos: torch.Tensor, inv_freq: torch.Tensor,
                          temporal_section: int, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor,
                          v_scale: torch.Tensor) -> None:
    """Quantize k, v [H, P, D] (any float dtype, unit stride along D) into the int8 cache's slices: codes
    [H, P, D] (k_codes and v_codes one layout, unit stride along D) and bf16 scales [H, P]; tpos [H, P]."""
    heads, rows, dim = k.shape
    if dim % 2 or v.shape != k.shape or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("quantize_write: k and v must be [H, P, D] of one shape, D even, unit stride along D")
    if k_codes.dtype != torch.int8 or k_codes.stride() != v_codes.stride() or k_codes.stride(-1) != 1 \
            or k_scale.stride() != v_scale.stride():
        raise ValueError("quantize_write: int8 code slices of one layout with unit stride along D, scales alike")
    if rows == 0:
        return
    inv_freq = inv_freq.to(device=k.device, dtype=torch.float32).contiguous()
    _quantize_write_kernel[(heads, rows, 2)](
        k, v, tpos, inv_freq, k_codes, k_scale, v_codes, v_scale, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        tpos.stride(0), tpos.stride(1), k_codes.stride(0), k_codes.stride(1), k_scale.stride(0), k_scale.stride(1),
        temporal_section, D=dim, HALF=dim // 2, BLOCK_D=next_power_of_2(dim), PRECISE_TRIG=precise_trig(),
        enable_fp_fusion=False)
