"""Decode attention over the capped cache, split over the keys (flash-decoding), for the CUDA-graph decode step.

One query token, ``G = Hq / Hkv`` query heads per KV head, ``n`` visible slots ``[0, n)`` of a ``[Hkv, M, D]``
layer of the cache, with ``n`` read from a device tensor — so a CUDA graph captured once replays it at every
cache length (``edgekv.session.decode_graph``).

Why split: the first H200 run of the decode graph (issue 32, 2026-11-26) spent 4.27 ms of an 8.6 ms 3B token in
36 calls of SDPA's masked path (cuDNN's flash forward, 119 us a layer), which runs one program per (head, query
block): 2 KV heads x 8 folded queries at the 3B shape is ~2 programs reading 3 MB each, on a chip with 132
multiprocessors. Here the keys are cut into ``S`` chunks: the grid is ``(Hkv, S)`` programs, each computing the
softmax partials of its chunk for all ``G`` heads at once (``m`` = max score, ``l`` = sum of exp, ``o`` = the
unnormalized weighted sum, in fp32), and a second kernel combines the chunks of each (KV head, query head):

    m* = max_s m_s,   out = sum_s 2^(m_s - m*) o_s  /  sum_s 2^(m_s - m*) l_s          (scores in log2 units)

Chunks past ``n`` write ``m = -inf, l = 0`` and weigh nothing. Scores and sums are fp32 (keys and values are
widened in registers; the products take tf32 tensor cores for a 16-bit cache, fp32 ``ieee`` for an fp32 one:
``dot_precision``), the output is cast to the query's dtype —
flash-attention's forward with the split of its decoding variant.
"""

from __future__ import annotations

import math

import torch

from edgekv.kernels._triton import cdiv, interpreting, jit, next_power_of_2, tl
from edgekv.kernels.sdpa import folded_attention

_LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys a program reads per step
TARGET_PROGRAMS = 256  # the split aims at about this many programs (the H200 has 132 multiprocessors)


def decode_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """What the eager decode path computes: ``folded_attention`` over the ``n`` visible slots."""
    return folded_attention(q, keys[:, :n], values[:, :n], n - q.shape[1])


def split_size(slots: int, heads_kv: int) -> int:
    """Keys per chunk: a multiple of BLOCK_N giving about TARGET_PROGRAMS programs over all KV heads."""
    per_head = max(1, TARGET_PROGRAMS // heads_kv)
    return max(BLOCK_N, cdiv(cdiv(slots, per_head), BLOCK_N) * BLOCK_N)


@jit
def _partials_kernel(q_ptr, k_ptr, v_ptr, n_ptr, o_ptr, m_ptr, l_ptr,
                     s_qh, s_kh, s_kn, s_vh, s_vn, chunk, splits, qk_scale,
                     G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    head, split = tl.program_id(0), tl.program_id(1)
    n = tl.load(n_ptr)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < G
    d_ok = offs_d < D
    q = tl.load(q_ptr + (head * G + offs_g)[:, None] * s_qh + offs_d[None, :], mask=g_ok[:, None] & d_ok[None, :],
                other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    k_row = k_ptr + head.to(tl.int64) * s_kh
    v_row = v_ptr + head.to(tl.int64) * s_vh
    for start in range(lo, hi, BLOCK):
        offs_n = start + tl.arange(0, BLOCK)
        n_ok = offs_n < hi
        tile = n_ok[:, None] & d_ok[None, :]
        key = tl.load(k_row + offs_n[:, None].to(tl.int64) * s_kn + offs_d[None, :], mask=tile, other=0.0)
        # [BLOCK_G, BLOCK], log2 units; torch.compile passes the scale as fp64: the scores stay fp32
        s = (tl.dot(q, tl.trans(key.to(tl.float32)), input_precision=PRECISION) * qk_scale).to(tl.float32)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))  # finite: every block holds a visible key
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        value = tl.load(v_row + offs_n[:, None].to(tl.int64) * s_vn + offs_d[None, :], mask=tile, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p, value.to(tl.float32), input_precision=PRECISION)
        m_i = m_new
    part = (head * splits + split) * G + offs_g  # [BLOCK_G] rows of the [Hkv, S, G] partials
    tl.store(m_ptr + part, m_i, mask=g_ok)
    tl.store(l_ptr + part, l_i, mask=g_ok)
    tl.store(o_ptr + part[:, None].to(tl.int64) * D + offs_d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])


@jit
def _combine_kernel(o_ptr, m_ptr, l_ptr, out_ptr, s_oh, splits,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)  # a query head: KV head row // G, member row % G
    head, member = row // G, row % G
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < splits
    d_ok = offs_d < D
    part = (head * splits + offs_s) * G + member
    m = tl.load(m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(l_ptr + part, mask=s_ok, other=0.0)
    top = tl.max(m, 0)  # finite: chunk 0 holds slot 0
    w = tl.where(s_ok, tl.exp2(m - top), 0.0)
    o = tl.load(o_ptr + part[:, None].to(tl.int64) * D + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w * l, 0)
    tl.store(out_ptr + row * s_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for a cache of ``dtype``, compiled: ``tf32`` for 16-bit caches, ``ieee`` for
    fp32 (and always in the interpreter). With a bf16 / fp16 cache tf32 loses nothing on the scores — every
    16-bit query and key element is a tf32 number, the products are exact and the sums fp32 — and rounds only the
    probabilities to tf32's 10-bit mantissa (flash-attention rounds them to the 16-bit dtype's 7 or 10 bits).
    ``ieee`` fp32 runs without tensor cores: on the H200 (Triton 3.6) this kernel took 138 us a 3B layer
    with it (issue 32, 2026-11-26, second session), slower than the SDPA call it replaces."""
    return "ieee" if dtype == torch.float32 or interpreting() else "tf32"


def decode_attention_triton(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                            n: torch.Tensor, precision: str | None = None) -> torch.Tensor:
    """q [Hq, 1, D]; keys, values [Hkv, M, D] (a cache layer, any strides with unit last stride); n: a
    one-element int tensor on q's device, the visible slot count (1 <= n <= M; not checked: it stays on the
    device). Returns [Hq, 1, D] in q's dtype. No host sync, fixed launch shapes: capturable in a CUDA graph.
    ``precision``: ``tl.dot``'s input precision (default ``dot_precision(q.dtype)``; the benchmark compares)."""
    heads_q, num, dim = q.shape
    heads_kv, slots, _ = keys.shape
    if num != 1:
        raise ValueError(f"decode attention takes one query token, got {num}")
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of KV heads {heads_kv}")
    if keys.stride(-1) != 1 or values.stride(-1) != 1 or values.shape != keys.shape:
        raise ValueError("keys and values must share a [Hkv, M, D] shape with unit stride along D")
    group = heads_q // heads_kv
    chunk = split_size(slots, heads_kv)
    splits = cdiv(slots, chunk)
    q2 = q.reshape(heads_q, dim)
    if q2.stride(-1) != 1:
        q2 = q2.contiguous()
    partial_o = torch.empty(heads_kv, splits, group, dim, dtype=torch.float32, device=q.device)
    partial_m = torch.empty(heads_kv, splits, group, dtype=torch.float32, device=q.device)
    partial_l = torch.empty_like(partial_m)
    out = torch.empty(heads_q, dim, dtype=q.dtype, device=q.device)
    block_g, block_d = max(16, next_power_of_2(group)), next_power_of_2(dim)
    _partials_kernel[(heads_kv, splits)](
        q2, keys, values, n, partial_o, partial_m, partial_l,
        q2.stride(0), keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), chunk, splits,
        _LOG2E / math.sqrt(dim),
        G=group, BLOCK_G=block_g, D=dim, BLOCK_D=block_d, BLOCK=BLOCK_N,
        PRECISION=precision or dot_precision(q.dtype),
    )
    combine_partials(partial_o, partial_m, partial_l, out, splits, group)
    return out.view(heads_q, 1, dim)


def combine_partials(partial_o: torch.Tensor, partial_m: torch.Tensor, partial_l: torch.Tensor, out: torch.Tensor,
                     splits: int, group: int) -> None:
    """Softmax partials [Hkv, S, group, D] / [Hkv, S, group] (contiguous, fp32, log2 units) into ``out``
    [Hkv * group, D] (unit last stride), row ``h * group + j``; also the 8-bit attention's split decode."""
    rows, dim = out.shape
    block_d = next_power_of_2(dim)
    _combine_kernel[(rows,)](partial_o, partial_m, partial_l, out, out.stride(0), splits,
                             G=group, D=dim, BLOCK_D=block_d, BLOCK_S=next_power_of_2(splits))
