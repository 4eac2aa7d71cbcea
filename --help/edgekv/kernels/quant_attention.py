"""Chunk attention read straight from an 8-bit cache: dequantize and rotate inside the kernel.

An 8-bit capped cache (``cache.kv_dtype: int8 | fp8``, ``edgekv/cache/quant.py``) stores per slot and KV
head ``q`` (``head_dim`` 8-bit codes) and one bf16 scale; keys are stored *time-neutral* (rotated back by
their temporal position), so a reader rotates them forward again. The torch path materializes each layer's
dequantized, rotated K and V in the model's dtype (``CappedKVCache.keys(layer)``: a [Hkv, N, D] copy per
layer and step, 2x the layer's bytes at fp16); this kernel reads the 8-bit codes instead:

    k_n = rot(tpos_n) (q^K_n * s^K_n)          rot: the temporal rotary pairs (j, j + D/2), j < t,
    v_n = q^V_n * s^V_n                              by angle tpos_n * inv_freq_j (M-RoPE's time part)
    out_{h,i} = sum_n softmax_n(q_{h,i} . k_n / sqrt(D)) v_n

over the committed slots ``[0, start)`` (all visible) and the chunk's own slots, causal — the visibility of
``edgekv.attention.folded_attention`` (the decode fast path; one query needs no mask). The math is fp32:
codes widened, scaled, rotated with the same products as ``edgekv.positions.rotate_temporal``, online
softmax in exp2 (flash-attention's forward). fp8 (e4m3fn) codes are decoded from their bits in the kernel,
so the kernel needs no fp8 hardware (Jetson Orin, sm_87, has none) and runs in Triton's interpreter.

Grid: (query blocks of the folded axis, Hkv, S). As in ``folded_attention``, each KV head's ``G = Hq / Hkv``
query heads are laid one after another on the query axis, so every program reads each 8-bit key block once
for all ``G`` heads. Tiles are padded to powers of two (at least 16, ``tl.dot``'s minimum) and masked.
A key block is read as stored, and its T temporal pairs' two halves again (the same cache lines); only those
pairs are rotated (trig on T of D/2 pairs: 16 of 64 at the 3B shape), and the scores add three products —
the unrotated dims, each half of the pairs (``_key_parts``). A decode step has only ``Hkv`` programs (2 at the 3B shape), so
its keys are cut into ``S`` chunks (flash-decoding, ``key_split``) whose softmax partials
``kernels/decode_attention.combine_partials`` merges. Products: tf32 tensor cores for 16-bit queries (the
dequantized key rounds to tf32's 10-bit mantissa, finer than the bf16 copy the torch path makes), fp32
``ieee`` for fp32 ones (``decode_attention.dot_precision``). Measured on an H200 (issue 32, 2026-11-26), one
3B decode call over 6,144 slots: int8 36 us, fp8 110 us, against 75 us for SDPA over a bf16 cache and 8.4 us
for the bf16 split kernel; with ``ieee`` products and no split it had taken 29 ms.
"""

from __future__ import annotations

import math

import torch

from edgekv.kernels._triton import (cdiv, interpreting, jit, libdevice, next_power_of_2, precise_trig, round_to_bf16, tl,
                                    use_triton)
from edgekv.kernels.decode_attention import TARGET_PROGRAMS, combine_partials, dot_precision
from edgekv.kernels.sdpa import chunk_causal_mask, folded_attention

_LOG2E = 1.4426950408889634
_CODES = (torch.int8, torch.float8_e4m3fn)


# ---------------------------------------------------------------------------------------------- reference
def quantized_attention_reference(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
    tpos: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int, *, start: int,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """What the cache's torch path computes: dequantize + rotate (fp32) in ``compute_dtype`` (default q's),
    then ``folded_attention``. Shapes as ``quantized_attention``."""
    from edgekv.cache.quant import dequantize
    from edgekv.positions import rotate_temporal

    end = start + q.shape[1]
    dtype = q.dtype if compute_dtype is None else compute_dtype
    keys = rotate_temporal(dequantize(k_codes[:, :end], k_scale[:, :end], torch.float32), tpos[:, :end],
                           inv_freq, temporal_section).to(dtype)
    values = dequantize(v_codes[:, :end], v_scale[:, :end], dtype)
    if dtype == torch.float64:  # folded_attention's SDPA call in fp64 (the tests' exact reference)
        return _attention_fp64(q.to(torch.float64), keys, values, start).to(q.dtype)
    return folded_attention(q.to(dtype), keys, values, start).to(q.dtype)


def _attention_fp64(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    heads_q, num_new, dim = q.shape
    group = heads_q // keys.shape[0]
    scores = torch.einsum("hgpd,hnd->hgpn", q.view(keys.shape[0], group, num_new, dim), keys) * dim ** -0.5
    mask = chunk_causal_mask(start, num_new, q.device)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    return torch.einsum("hgpn,hnd->hgpd", probs, values).reshape(heads_q, num_new, dim)


# ---------------------------------------------------------------------------------------------- kernel
@jit
def _decode_codes(raw, FP8: tl.constexpr):
    """8-bit codes -> fp32: int8 as is; float8_e4m3fn (loaded as uint8) from its bits
    (sign, 4 exponent bits with bias 7, 3 mantissa bits; exponent 0 = subnormal; 0x7f / 0xff = NaN)."""
    value = raw.to(tl.float32)
    if FP8:
        bits = raw.to(tl.int32) & 0xFF
        exponent = (bits >> 3) & 0xF
        mantissa = (bits & 0x7).to(tl.float32)
        normal = (8.0 + mantissa) * tl.exp2((exponent - 10).to(tl.float32))  # (1 + m/8) * 2^(e-7)
        subnormal = mantissa * 0.001953125  # m/8 * 2^-6
        value = tl.where(exponent == 0, subnormal, normal)
        value = tl.where((bits & 0x7F) == 0x7F, float("nan"), value)
        value = tl.where((bits & 0x80) != 0, -value, value)
    return value


@jit
def _key_parts(k_base, ks_row, tpos_row, inv_freq_ptr, offs_n, n_ok, offs_d, d_ok, offs_t, t_ok, half,
               s_kn, s_kd, s_ksn, s_tn, FP8: tl.constexpr, PRECISE_TRIG: tl.constexpr):
    """Keys ``offs_n`` of one KV head as three fp32 tiles, zero outside them: ``x`` [BLOCK_N, BLOCK_D] the
    dequantized keys as stored (time-neutral), and the temporal pairs rotated forward to their positions —
    ``low`` = x_j cos - x_(j+half) sin and ``high`` = x_(j+half) cos + x_j sin, [BLOCK_N, BLOCK_T] for pairs
    j < T (``offs_t``, ``t_ok``) — the products of ``rotate_temporal``. Only the T temporal pairs take trig:
    computing it on every dim (cos 0 = 1 outside the section) cost 8x the libdevice calls (issue 32)."""
    tile_ok = n_ok[:, None] & d_ok[None, :]
    pair_ok = n_ok[:, None] & t_ok[None, :]
    k_scale = tl.load(ks_row + offs_n * s_ksn, mask=n_ok, other=0.0).to(tl.float32)
    rows = k_base + offs_n[:, None] * s_kn
    x = _decode_codes(tl.load(rows + offs_d[None, :] * s_kd, mask=tile_ok, other=0), FP8) * k_scale[:, None]
    lo = _decode_codes(tl.load(rows + offs_t[None, :] * s_kd, mask=pair_ok, other=0), FP8) * k_scale[:, None]
    hi = _decode_codes(tl.load(rows + (half + offs_t)[None, :] * s_kd, mask=pair_ok, other=0), FP8) * k_scale[:, None]
    t = tl.load(tpos_row + offs_n * s_tn, mask=n_ok, other=0).to(tl.float32)
    freq = tl.load(inv_freq_ptr + offs_t, mask=t_ok, other=0.0)
    angle = t[:, None] * freq[None, :]
    if PRECISE_TRIG:
        cos, sin = libdevice.cos(angle), libdevice.sin(angle)
    else:
        cos, sin = tl.cos(angle), tl.sin(angle)
    low = lo * cos + -1.0 * (hi * sin)
    high = hi * cos + lo * sin
    return tl.where(tile_ok, x, 0.0), tl.where(pair_ok, low, 0.0), tl.where(pair_ok, high, 0.0)


@jit
def _temporal(offs_d, half, temporal_section):
    """Whether key dim d is in a temporal pair (rotated at read time): d < T or half <= d < half + T."""
    return (offs_d < temporal_section) | ((offs_d >= half) & (offs_d < half + temporal_section))


@jit
def _value_block(v_base, vs_row, offs_n, n_ok, offs_d, d_ok, s_vn, s_vd, s_vsn, FP8: tl.constexpr):
    """Values ``offs_n`` of one KV head, dequantized: fp32 [BLOCK_N, BLOCK_D], zero outside the tile."""
    tile_ok = n_ok[:, None] & d_ok[None, :]
    v_scale = tl.load(vs_row + offs_n * s_vsn, mask=n_ok, other=0.0).to(tl.float32)
    value = _decode_codes(tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd, mask=tile_ok, other=0),
                          FP8) * v_scale[:, None]
    return tl.where(tile_ok, value, 0.0)


@jit
def _dequantize_kernel(
    k_ptr, ks_ptr, v_ptr, vs_ptr, tpos_ptr, inv_freq_ptr, key_out_ptr, value_out_ptr, end, dim, half, temporal_section,
    s_kh, s_kn, s_kd, s_ksh, s_ksn, s_vh, s_vn, s_vd, s_vsh, s_vsn, s_th, s_tn,
    FP8: tl.constexpr, PRECISE_TRIG: tl.constexpr, BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # grid: (cdiv(end, BLOCK_N), Hkv); key_out / value_out [Hkv, end, dim] contiguous in the queries' dtype
    block_n, head_kv = tl.program_id(0), tl.program_id(1)
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok, d_ok = offs_n < end, offs_d < dim
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < temporal_section
    x, low, high = _key_parts(k_ptr + head_kv.to(tl.int64) * s_kh, ks_ptr + head_kv.to(tl.int64) * s_ksh,
                              tpos_ptr + head_kv.to(tl.int64) * s_th, inv_freq_ptr, offs_n, n_ok, offs_d, d_ok, offs_t,
                              t_ok, half, s_kn, s_kd, s_ksn, s_tn, FP8, PRECISE_TRIG)
    value = _value_block(v_ptr + head_kv.to(tl.int64) * s_vh, vs_ptr + head_kv.to(tl.int64) * s_vsh, offs_n, n_ok,
                         offs_d, d_ok, s_vn, s_vd, s_vsn, FP8)
    if BF16:  # rounded to nearest even, as torch's cast (the interpreter's own truncates)
        x, low, high, value = round_to_bf16(x), round_to_bf16(low), round_to_bf16(high), round_to_bf16(value)
    row = (head_kv.to(tl.int64) * end + offs_n[:, None]) * dim
    tile_ok = n_ok[:, None] & d_ok[None, :]
    pair_ok = n_ok[:, None] & t_ok[None, :]
    dtype = key_out_ptr.dtype.element_ty
    # three disjoint sets of dims: the unrotated ones as stored, then the temporal pairs' two halves
    tl.store(key_out_ptr + row + offs_d[None, :], x.to(dtype),
             mask=tile_ok & ~_temporal(offs_d, half, temporal_section)[None, :])
    tl.store(key_out_ptr + row + offs_t[None, :], low.to(dtype), mask=pair_ok)
    tl.store(key_out_ptr + row + (half + offs_t)[None, :], high.to(dtype), mask=pair_ok)
    out = row + offs_d[None, :]
    tl.store(value_out_ptr + out, value.to(value_out_ptr.dtype.element_ty), mask=tile_ok)


@jit
def _quantized_attention_kernel(
    q_ptr, k_ptr, ks_ptr, v_ptr, vs_ptr, tpos_ptr, inv_freq_ptr, out_ptr,
    start, num_new, dim, half, temporal_section, group, qk_scale,
    s_qh, s_qp, s_qd, s_kh, s_kn, s_kd, s_ksh, s_ksn, s_vh, s_vn, s_vd, s_vsh, s_vsn, s_th, s_tn,
    s_oh, s_op, s_od, chunk, o_part_ptr, m_part_ptr, l_part_ptr,
    FP8: tl.constexpr, PRECISE_TRIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):
    # grid: (cdiv(G * P, BLOCK_M), Hkv, S); folded row r = member j * P + token i of query head head_kv * G + j;
    # program (., ., split) reads the keys [split * chunk, (split + 1) * chunk) of [0, start + P)
    block_m, head_kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < group * num_new
    token = offs_m % num_new
    head_q = head_kv * group + offs_m // num_new
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    q_row = q_ptr + head_q[:, None].to(tl.int64) * s_qh + token[:, None] * s_qp
    q = tl.load(q_row + offs_d[None, :] * s_qd, mask=m_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
    # q . k = q . x over the unrotated dims + the temporal pairs' two halves against the rotated keys
    q = tl.where(_temporal(offs_d, half, temporal_section)[None, :], 0.0, q)
    offs_t = tl.arange(0, BLOCK_T)
    t_ok = offs_t < temporal_section
    q_lo = tl.load(q_row + offs_t[None, :] * s_qd, mask=m_ok[:, None] & t_ok[None, :], other=0.0).to(tl.float32)
    q_hi = tl.load(q_row + (half + offs_t)[None, :] * s_qd, mask=m_ok[:, None] & t_ok[None, :], other=0.0).to(tl.float32)
    k_base = k_ptr + head_kv.to(tl.int64) * s_kh
    v_base = v_ptr + head_kv.to(tl.int64) * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = start + num_new
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        x, low, high = _key_parts(k_base, ks_ptr + head_kv.to(tl.int64) * s_ksh, tpos_ptr + head_kv.to(tl.int64) * s_th,
                                  inv_freq_ptr, offs_n, n_ok, offs_d, d_ok, offs_t, t_ok, half, s_kn, s_kd, s_ksn, s_tn,
                                  FP8, PRECISE_TRIG)
        s = tl.dot(q, tl.trans(x), input_precision=PRECISION)
        s += tl.dot(q_lo, tl.trans(low), input_precision=PRECISION)
        s += tl.dot(q_hi, tl.trans(high), input_precision=PRECISION)
        s = (s * qk_scale).to(tl.float32)  # [BLOCK_M, BLOCK_N], log2 units; fp32 whatever type compile gives the scale
        allowed = ((offs_n[None, :] < start) | ((offs_n[None, :] - start) <= token[:, None])) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        value = _value_block(v_base, vs_ptr + head_kv.to(tl.int64) * s_vsh, offs_n, n_ok, offs_d, d_ok, s_vn, s_vd,
                             s_vsn, FP8)
        acc = acc * alpha[:, None] + tl.dot(p, value, input_precision=PRECISION)
        m_i = m_new
    if SPLIT:  # the chunk's softmax partials, rows of [Hkv, S, G * P]; combined by decode_attention's kernel
        part = (head_kv * tl.num_programs(2) + split) * (group * num_new) + offs_m
        tl.store(m_part_ptr + part, m_i, mask=m_ok)
        tl.store(l_part_ptr + part, l_i, mask=m_ok)
        tl.store(o_part_ptr + part[:, None].to(tl.int64) * dim + offs_d[None, :], acc, mask=m_ok[:, None] & d_ok[None, :])
        return
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # every valid row sees at least itself
    out = acc / l_safe[:, None]
    tl.store(out_ptr + head_q[:, None].to(tl.int64) * s_oh + token[:, None] * s_op + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


# ---------------------------------------------------------------------------------------------- launcher
def _check(q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, temporal_section, start) -> None:
    heads_q, num_new, dim = q.shape
    heads_kv = k_codes.shape[0]
    if k_codes.dtype not in _CODES or v_codes.dtype != k_codes.dtype:
        raise ValueError(f"k_codes and v_codes must both be int8 or float8_e4m3fn, got {k_codes.dtype}, {v_codes.dtype}")
    if dim % 2 or heads_q % heads_kv:
        raise ValueError(f"head_dim {dim} must be even and Hq={heads_q} a multiple of Hkv={heads_kv}")
    if k_codes.shape[2] != dim or v_codes.shape != k_codes.shape:
        raise ValueError(f"k_codes {tuple(k_codes.shape)} and v_codes {tuple(v_codes.shape)} must be [Hkv, M, {dim}]")
    if not 0 <= start or start + num_new > k_codes.shape[1]:
        raise ValueError(f"keys [0, {start + num_new}) exceed the {k_codes.shape[1]} slots of the cache")
    for name, t in (("k_scale", k_scale), ("v_scale", v_scale), ("tpos", tpos)):
        if t.shape[0] != heads_kv or t.shape[1] < start + num_new:
            raise ValueError(f"{name} must be [Hkv={heads_kv}, >= {start + num_new}], got {tuple(t.shape)}")
    if not 0 <= temporal_section <= dim // 2 or inv_freq.numel() < temporal_section:
        raise ValueError(f"temporal_section {temporal_section} must be in [0, {dim // 2}] with that many inv_freq")


def quantized_attention_triton(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
    tpos: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int, *, start: int,
) -> torch.Tensor:
    _check(q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, temporal_section, start)
    heads_q, num_new, dim = q.shape
    heads_kv = k_codes.shape[0]
    group = heads_q // heads_kv
    fp8 = k_codes.dtype == torch.float8_e4m3fn
    if fp8:  # decoded from the bits in the kernel
        k_codes, v_codes = k_codes.view(torch.uint8), v_codes.view(torch.uint8)
    inv_freq = inv_freq.to(device=q.device, dtype=torch.float32).contiguous()
    interpreted = interpreting()
    rows = group * num_new
    if rows >= DEQUANTIZE_ROWS:
        keys, values = dequantized_keys_values(k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, temporal_section,
                                               start + num_new, q.dtype, fp8)
        return folded_attention(q, keys, values, start)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_m = max(16, min(16 if interpreted else 64, next_power_of_2(rows)))
    block_n = 32 if interpreted else 64
    block_d = max(16, next_power_of_2(dim))
    programs = cdiv(rows, block_m) * heads_kv
    chunk, splits = key_split(start + num_new, programs, block_n)
    if splits > 1:
        o_part = torch.empty(heads_kv, splits, rows, dim, dtype=torch.float32, device=q.device)
        m_part = torch.empty(heads_kv, splits, rows, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out  # not written
    _quantized_attention_kernel[(cdiv(rows, block_m), heads_kv, splits)](
        q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, out,
        start, num_new, dim, dim // 2, temporal_section, group, _LOG2E / math.sqrt(dim),
        *q.stride(), *k_codes.stride(), *k_scale.stride(), *v_codes.stride(), *v_scale.stride(), *tpos.stride(),
        *out.stride(), chunk, o_part, m_part, l_part,
        FP8=fp8, PRECISE_TRIG=precise_trig(), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        BLOCK_T=max(16, next_power_of_2(temporal_section)), SPLIT=splits > 1, PRECISION=dot_precision(q.dtype),
        num_warps=4,
    )
    if splits > 1:  # out [Hq, P, D] contiguous is [Hkv * G * P, D] in folded-row order
        combine_partials(o_part, m_part, l_part, out.view(heads_kv * rows, dim), splits, rows)
    return out


DEQUANTIZE_ROWS = 128  # folded query rows (G x P) from which a chunk dequantizes its keys once (a frame pair: 2,048)


def dequantized_keys_values(k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
                            tpos: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int, end: int,
                            dtype: torch.dtype, fp8: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots ``[0, end)`` dequantized (keys rotated forward) into [Hkv, end, D] in ``dtype``, one kernel: what
    the cache's torch path computes in ~10 torch ops, with the same roundings (fp32 math, one rounding to nearest).

    Why: the fused kernel re-dequantizes and re-rotates every key for every block of query rows, and precise
    trig on every dim made a frame pair's chunk (2,048 folded rows) 3.6 ms a 3B layer on an H200 (int8; fp8 7.0
    ms), against 0.84 ms for the torch path and 0.21 ms for SDPA over a bf16 cache (issue 32, 2026-11-26). The
    copy is transient — one layer's K/V in 16 bits (6 MB at the 3B shape), freed after the layer's attention."""
    heads_kv, _, dim = k_codes.shape
    keys = torch.empty(heads_kv, end, dim, dtype=dtype, device=k_codes.device)
    values = torch.empty_like(keys)
    block_n = 32 if interpreting() else 64
    _dequantize_kernel[(cdiv(end, block_n), heads_kv)](
        k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, keys, values, end, dim, dim // 2, temporal_section,
        *k_codes.stride(), *k_scale.stride(), *v_codes.stride(), *v_scale.stride(), *tpos.stride(),
        FP8=fp8, PRECISE_TRIG=precise_trig(), BF16=dtype == torch.bfloat16, BLOCK_N=block_n,
        BLOCK_D=max(16, next_power_of_2(dim)), BLOCK_T=max(16, next_power_of_2(temporal_section)), num_warps=4,
    )
    return keys, values


def key_split(keys: int, programs: int, block_n: int) -> tuple[int, int]:
    """(keys per program, splits) for ``keys`` keys when the grid has ``programs`` (query block, KV head)
    programs: a decode step at the 3B shape is 2 programs reading 6,144 keys each on a chip with 132
    multiprocessors, so the keys are cut into chunks (flash-decoding) until there are about ``TARGET_PROGRAMS``;
    a prefill chunk (a frame pair: 64 programs) stays whole."""
    if programs >= TARGET_PROGRAMS // 4:
        return max(keys, 1), 1
    chunk = max(block_n, cdiv(cdiv(keys, max(1, TARGET_PROGRAMS // programs)), block_n) * block_n)
    return chunk, cdiv(max(keys, 1), chunk)


# ---------------------------------------------------------------------------------------------- op
def quantized_attention(
    q: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor,
    tpos: torch.Tensor, inv_freq: torch.Tensor, temporal_section: int, *, start: int,
) -> torch.Tensor:
    """Chunk attention over an 8-bit cache layer's slots ``[0, start + P)``, Triton when available.

    q: [Hq, P, D] rotated queries (fp16 / bf16 / fp32); k_codes, v_codes: [Hkv, M, D] int8 or float8_e4m3fn
    (one layer of the cache's buffers, time-neutral keys); k_scale, v_scale: [Hkv, M] bf16; tpos: [Hkv, M]
    temporal positions; inv_freq: [D/2] rotary inverse frequencies, the first ``temporal_section`` of them
    temporal. Committed slots ``[0, start)`` are all visible, the chunk causal. Returns [Hq, P, D] in q's dtype.
    """
    if use_triton(q, k_codes):
        return quantized_attention_triton(q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, temporal_section,
                                          start=start)
    _check(q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, temporal_section, start)
    return quantized_attention_reference(q, k_codes, k_scale, v_codes, v_scale, tpos, inv_freq, temporal_section,
                                         start=start)
