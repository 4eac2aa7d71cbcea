"""Chunk attention that also returns each key's attention mass, without materializing Q·Kᵀ.

StateKV (arXiv 2605.31598, App. 0.B.1) ranks cached keys by the attention the new frame pays them:

    out_{h,p} = sum_n softmax_n(q_{h,p} · k_{g(h),n} / sqrt(D)) v_{g(h),n}
    mass_{g,n} = (1/G) sum_{h in group g} sum_p exp(q_{h,p} · k_{g,n} / sqrt(D) - LSE_{h,p})

for a chunk of ``P`` queries against ``N = start + P`` keys: committed keys ``[0, start)`` (filtered
per KV head by ``visible``) and the chunk's own keys, causal. ``G = Hq / Hkv`` query heads share a KV
head (GQA). The eager reference builds the [Hq, P, N] probabilities; here two passes keep memory at
O(P + N) per head:

  pass 1 (grid: query blocks x Hq): a flash-attention forward with online softmax (exp2, fp32
         accumulation) writes ``out`` and the per-query log-sum-exp;
  pass 2 (grid: key blocks x Hkv): each program owns a block of keys and loops over the G query heads
         and the query blocks that can see it, recomputing q·k and summing exp(s - LSE).

Trade-off: pass 2 recomputes Q·Kᵀ (about half of pass 1's FLOPs, no P·V) instead of writing the
probabilities out — O(N) extra memory instead of O(Hq·P·N). Looping over queries per key block rather
than scattering with atomics keeps the mass deterministic and write-once; its parallelism is
N/BLOCK_N x Hkv programs (192 over a whole 6,144-slot cache), enough for a Jetson-sized GPU. D need not be a power
of two: tiles are padded to the next power of two (at least 16, tl.dot's minimum) and masked.

Occupancy on a large GPU: StateKV's prefill gathers the visible slots first (edgekv/attention.py), so at the
3B shape N is ~1,300 (1,024 sinks and a 256-token pair): pass 2 is then 21 x 2 = 42 programs and pass 1 4 x 16 = 64
on an H200's 132 multiprocessors, and the pair's profile (2026-12-04) put them first and third among its kernels:
1.26 and 0.90 ms of a 14.2 ms pair over 36 layers (35 and 25 us a call, ~5 and ~14 TFLOP/s). Two knobs, kept at
what ran there until they are timed (tools/gpu/attention_mass_3b.py): ``MASS_SPLIT`` shares a KV head's G query
heads among that many programs, each writing its part of the mass, summed after in a fixed order (deterministic);
``FORWARD_BLOCK_M`` is pass 1's query block (32 doubles its programs).
"""

from __future__ import annotations

import math

import torch

from edgekv.kernels._triton import cdiv, interpreting, jit, next_power_of_2, tl, use_triton

_LOG2E = 1.4426950408889634
MASS_SPLIT = 1        # programs sharing a KV head's query heads in pass 2 (a divisor of G; module docstring)
FORWARD_BLOCK_M = 64  # pass 1's query block on a GPU (the interpreter takes 32)


# ---------------------------------------------------------------------------------------------- reference
def chunk_mask(start: int, num_new: int, visible: torch.Tensor | None, heads_kv: int, device: torch.device) -> torch.Tensor:
    """[Hkv, P, start + P] bool: committed keys per ``visible`` (all when None), causal chunk."""
    mask = torch.ones(heads_kv, num_new, start + num_new, dtype=torch.bool, device=device)
    if visible is not None:
        mask[:, :, :start] = visible[:, :start].to(device=device, dtype=torch.bool).unsqueeze(1)
    mask[:, :, start:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril_()
    return mask


def attention_mass_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, visible: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention + mass, the semantics of ``edgekv.attention.attention_with_mass``.

    q: [Hq, P, D]; k, v: [Hkv, >= start + P, D] (only the valid prefix is read); visible: [Hkv, >= start]
    bool or None. Returns out [Hq, P, D] (q's dtype) and mass [Hkv, start + P] fp32; masked keys get 0.
    ``compute_dtype`` is fp32 for the reference; tests also run it in fp64 and in the input dtype.
    """
    heads_q, num_new, dim = q.shape
    heads_kv, end = k.shape[0], start + num_new
    group = heads_q // heads_kv
    mask = chunk_mask(start, num_new, visible, heads_kv, q.device).unsqueeze(1)  # [Hkv, 1, P, N]
    qg = q.to(compute_dtype).view(heads_kv, group, num_new, dim)
    scores = torch.einsum("hgpd,hnd->hgpn", qg, k[:, :end].to(compute_dtype)) * dim ** -0.5
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)  # [Hkv, G, P, N]
    out = torch.einsum("hgpn,hnd->hgpd", probs, v[:, :end].to(compute_dtype)).reshape(heads_q, num_new, dim)
    return out.to(q.dtype), probs.sum(dim=2).mean(dim=1).to(torch.float32)


# ---------------------------------------------------------------------------------------------- kernels
@jit
def _attention_forward_kernel(
    q_ptr, k_ptr, v_ptr, vis_ptr, out_ptr, lse_ptr,
    start, num_new, dim, group, qk_scale,
    s_qh, s_qp, s_qd, s_kh, s_kn, s_kd, s_vh, s_vn, s_vd, s_vish, s_visn, s_oh, s_op, s_od,
    HAS_VISIBLE: tl.constexpr, DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # grid: (cdiv(P, BLOCK_M), Hq). Scores are kept in log2 units (qk_scale folds in log2(e)).
    block_m, head = tl.program_id(0), tl.program_id(1)
    head_kv = head // group
    offs_m = block_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index inside the chunk
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < dim
    q = tl.load(q_ptr + head.to(tl.int64) * s_qh + offs_m[:, None] * s_qp + offs_d[None, :] * s_qd,
                mask=(offs_m < num_new)[:, None] & d_ok[None, :], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)
    k_base = k_ptr + head_kv.to(tl.int64) * s_kh
    v_base = v_ptr + head_kv.to(tl.int64) * s_vh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = start + tl.minimum((block_m + 1) * BLOCK_M, num_new)  # the last query of the block sees up to here
    for n0 in range(0, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < end
        k_t = tl.load(k_base + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd, mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        if DOT_IN_FP32:
            k_t = k_t.to(tl.float32)
        s = tl.dot(q, k_t, input_precision=INPUT_PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        committed = offs_n < start
        if HAS_VISIBLE:
            seen = tl.load(vis_ptr + head_kv.to(tl.int64) * s_vish + offs_n * s_visn, mask=committed, other=0) != 0
        else:
            seen = committed
        causal = (offs_n[None, :] - start) <= offs_m[:, None]
        allowed = tl.where(committed[None, :], seen[None, :], causal) & n_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_n[:, None] * s_vn + offs_d[None, :] * s_vd, mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_IN_FP32:
            p_v = p.to(v.dtype).to(tl.float32)  # same rounding of p as the native dot
            v = v.to(tl.float32)
        else:
            p_v = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision=INPUT_PRECISION)
        m_i = m_new
    # every query sees itself (causal diagonal), so l_i > 0 on valid rows
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    m_ok = offs_m < num_new
    tl.store(out_ptr + head.to(tl.int64) * s_oh + offs_m[:, None] * s_op + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + head.to(tl.int64) * num_new + offs_m, m_i + tl.log2(l_safe), mask=m_ok)


@jit
def _key_mass_kernel(
    q_ptr, k_ptr, vis_ptr, lse_ptr, mass_ptr,
    start, num_new, dim, group, qk_scale,
    s_qh, s_qp, s_qd, s_kh, s_kn, s_kd, s_vish, s_visn, s_ms, s_mh, s_mn,
    HAS_VISIBLE: tl.constexpr, DOT_IN_FP32: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HEADS_PER_PROGRAM: tl.constexpr,
):
    # grid: (cdiv(N, BLOCK_N), Hkv, G / HEADS_PER_PROGRAM). mass[g, n] = mean over the group's heads of
    # sum_p exp2(s - lse); program (.., .., split) sums heads [split * HEADS_PER_PROGRAM, +HEADS_PER_PROGRAM) into
    # its own row of mass (s_ms apart; 0 when there is one split).
    block_n, head_kv, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = start + num_new
    offs_n = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    n_ok = offs_n < end
    d_ok = offs_d < dim
    k_t = tl.load(k_ptr + head_kv.to(tl.int64) * s_kh + offs_n[None, :] * s_kn + offs_d[:, None] * s_kd,
                  mask=n_ok[None, :] & d_ok[:, None], other=0.0)
    if DOT_IN_FP32:
        k_t = k_t.to(tl.float32)
    committed = offs_n < start
    if HAS_VISIBLE:
        seen = tl.load(vis_ptr + head_kv.to(tl.int64) * s_vish + offs_n * s_visn, mask=committed, other=0) != 0
    else:
        seen = committed
    mass = tl.zeros([BLOCK_N], dtype=tl.float32)
    # chunk key n is seen by queries p >= n - start: skip query blocks that end before the first one
    first_query = tl.maximum(block_n * BLOCK_N - start, 0)
    m_lo = (first_query // BLOCK_M) * BLOCK_M
    for gi in range(0, HEADS_PER_PROGRAM):
        head = head_kv * group + split * HEADS_PER_PROGRAM + gi
        for m0 in range(m_lo, num_new, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < num_new
            q = tl.load(q_ptr + head.to(tl.int64) * s_qh + offs_m[:, None] * s_qp + offs_d[None, :] * s_qd,
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            if DOT_IN_FP32:
                q = q.to(tl.float32)
            lse = tl.load(lse_ptr + head.to(tl.int64) * num_new + offs_m, mask=m_ok, other=0.0)
            s = tl.dot(q, k_t, input_precision=INPUT_PRECISION) * qk_scale
            causal = (offs_n[None, :] - start) <= offs_m[:, None]
            allowed = tl.where(committed[None, :], seen[None, :], causal) & n_ok[None, :] & m_ok[:, None]
            p = tl.where(allowed, tl.exp2(s - lse[:, None]), 0.0)  # invisible keys: exactly 0
            mass += tl.sum(p, 0)
    tl.store(mass_ptr + split.to(tl.int64) * s_ms + head_kv.to(tl.int64) * s_mh + offs_n * s_mn, mass / group,
             mask=n_ok)


# ---------------------------------------------------------------------------------------------- launcher
def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, visible: torch.Tensor | None) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [Hq, P, D] and k, v [Hkv, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    heads_q, num_new, dim = q.shape
    if k.shape[2] != dim or heads_q % k.shape[0]:
        raise ValueError(f"head_dim {dim} vs {k.shape[2]}, or Hq={heads_q} not a multiple of Hkv={k.shape[0]}")
    if not 0 <= start or start + num_new > k.shape[1]:
        raise ValueError(f"keys [0, {start + num_new}) exceed the {k.shape[1]} slots of k")
    if visible is not None and (visible.shape[0] != k.shape[0] or visible.shape[1] < start):
        raise ValueError(f"visible must be [Hkv={k.shape[0]}, >= start={start}], got {tuple(visible.shape)}")


def attention_mass_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, visible: torch.Tensor | None = None,
    mass_out: torch.Tensor | None = None, mass_split: int | None = None, forward_block_m: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both passes. Same contract as ``attention_mass``; ``mass_out`` [Hkv, >= N] fp32 is written in place.
    ``mass_split`` and ``forward_block_m`` override ``MASS_SPLIT`` and ``FORWARD_BLOCK_M`` (a split that does not
    divide G falls back to 1)."""
    _check(q, k, v, start, visible)
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k, v must share a dtype for tl.dot, got {q.dtype}, {k.dtype}, {v.dtype}")
    heads_q, num_new, dim = q.shape
    heads_kv, end = k.shape[0], start + num_new
    group = heads_q // heads_kv
    out = torch.empty_like(q)
    lse = torch.empty(heads_q, num_new, dtype=torch.float32, device=q.device)  # log2 units
    if mass_out is not None and (mass_out.dtype != torch.float32 or mass_out.shape[0] != heads_kv or mass_out.shape[1] < end):
        raise ValueError(f"mass_out must be fp32 [Hkv={heads_kv}, >= {end}], got {mass_out.dtype} {tuple(mass_out.shape)}")
    mass = mass_out[:, :end] if mass_out is not None else torch.empty(heads_kv, end, dtype=torch.float32, device=q.device)
    if visible is not None:
        visible = visible.view(torch.uint8) if visible.dtype == torch.bool else visible
        vis, s_vis = visible, visible.stride()
    else:
        vis, s_vis = k, (0, 0)  # never read
    interpreted = interpreting()
    block_d = max(16, next_power_of_2(dim))
    block_m = 32 if interpreted else 64
    forward_m = forward_block_m or (32 if interpreted else FORWARD_BLOCK_M)
    if forward_m not in (16, 32, 64, 128):
        raise ValueError(f"forward_block_m must be 16, 32, 64 or 128, got {forward_m}")
    split = mass_split or MASS_SPLIT
    if split < 1 or group % split:
        split = 1
    block_n = 32 if interpreted or (q.dtype == torch.float32 and block_d > 64) else 64
    common = dict(
        HAS_VISIBLE=visible is not None, DOT_IN_FP32=interpreted,  # Triton 3.9's interpreter gets bf16 tl.dot wrong
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 or interpreted else "tf32",  # fp32 never drops to tf32
        BLOCK_N=block_n, BLOCK_D=block_d,
    )
    qk_scale = _LOG2E / math.sqrt(dim)
    _attention_forward_kernel[(cdiv(num_new, forward_m), heads_q)](
        q, k, v, vis, out, lse, start, num_new, dim, group, qk_scale,
        *q.stride(), *k.stride(), *v.stride(), *s_vis, *out.stride(), num_warps=4, BLOCK_M=forward_m, **common,
    )
    # one split writes the mass itself; several write their rows of a partial, summed in split order below
    parts = mass if split == 1 else torch.empty(split, heads_kv, end, dtype=torch.float32, device=q.device)
    s_parts = (0, *mass.stride()) if split == 1 else parts.stride()
    _key_mass_kernel[(cdiv(end, block_n), heads_kv, split)](
        q, k, vis, lse, parts, start, num_new, dim, group, qk_scale,
        *q.stride(), *k.stride(), *s_vis, *s_parts, num_warps=4, BLOCK_M=block_m,
        HEADS_PER_PROGRAM=group // split, **common,
    )
    if split > 1:
        mass.copy_(parts.sum(0))
    return out, mass


# ---------------------------------------------------------------------------------------------- op
def attention_mass(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, start: int, visible: torch.Tensor | None = None,
    mass_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a chunk plus per-key mass (StateKV eq. 6), Triton when available (see ``use_triton``).

    q: [Hq, P, D] (fp16 / bf16 / fp32); k, v: [Hkv, >= start + P, D], e.g. a layer of the capped cache
    (only ``[0, start + P)`` is read); visible: [Hkv, >= start] bool over committed slots, or None for all.
    Returns out [Hq, P, D] in q's dtype and mass [Hkv, start + P] fp32 (a view of ``mass_out`` if given).
    """
    if use_triton(q, k, v):
        return attention_mass_triton(q, k, v, start=start, visible=visible, mass_out=mass_out)
    _check(q, k, v, start, visible)
    out, mass = attention_mass_reference(q, k, v, start=start, visible=visible)
    if mass_out is not None:
        mass_out[:, : mass.shape[1]].copy_(mass)
        mass = mass_out[:, : mass.shape[1]]
    return out, mass
