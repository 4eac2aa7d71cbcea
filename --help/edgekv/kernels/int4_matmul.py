"""Products with 4-bit weights in the AutoAWQ GEMM layout, dequantized inside the kernel (W4A16).

    out[m, n] = sum_k x[m, k] * (q[k, n] - z[k // g, n]) * s[k // g, n]

``q`` and ``z`` are read from the packed int32 words as they are stored (``edgekv/model/int4.py``: word
``n // 8`` of row ``k``, nibble ``AWQ_INVERSE[n % 8]``), ``s`` from the float16 scales. Decode is bound by
the bytes of the weights, so reading 4 bits instead of 16 per weight is the point (AWQ, Lin et al. 2024,
section 4; TensorRT-Edge-LLM reports Qwen2.5-VL-3B decode at 71.8 tok/s in INT4 AWQ vs 27.2 in fp16 on AGX
Orin). The trade-off: each weight costs a shift, a mask, a subtraction and a multiplication before the
product — free on a GPU where decode waits on memory anyway, which is why the CPU has its own kernel
(``cpu_gemv.c``, integer products).

Two Triton kernels share the dequantization:

* ``_int4_gemv_kernel`` (one row: decode) — a program owns ``BLOCK_N`` outputs and walks K, multiplying and
  reducing in fp32 (no ``tl.dot``, whose tiles need 16 rows);
* ``_int4_gemm_kernel`` (a chunk: a question, a frame pair) — ``tl.dot`` tiles; fp32 activations are
  multiplied in fp32 (``input_precision="ieee"``: no TF32), fp16 / bf16 activations with the dequantized
  weight rounded to their dtype and fp32 accumulation — what the same-precision torch run computes.

Measured on an H200 (issue 32, 2026-11-26, `edgekv bench kernels --only int4`, bf16, graph-replayed): the GEMV
at 2,048 x 2,048 went from 0.114 ms (no split) to 0.035 ms with split-K, still 0.18x of bf16 F.linear (0.006 ms);
11,008-wide 0.15 ms (bf16 0.016-0.018); a frame pair (256 rows) 0.028-0.135 ms after dequantize-once, from
0.195-1.13 ms (bf16 0.007-0.026). Not yet the 2.5x over bf16 decode needs: the next step is loading each
packed word once per program (a [BLOCK_K, BLOCK_N / 8] tile unpacked by a shift vector) instead of once per
nibble lane, and a profile.

Both need a group size that is a multiple of 16 (``BLOCK_K`` divides it, so a block's zeros and scales are
one row); anything else runs the torch reference: dequantize (exact, fp32) and multiply.
"""

from __future__ import annotations

import functools

import torch

from edgekv.kernels._triton import cdiv, interpreting, jit, round_to_bf16, tl, use_triton

_MAX_DEQUANT_ELEMENTS = 1 << 22  # the reference dequantizes at most this many weights at a time


# ---------------------------------------------------------------------------------------------- reference
def int4_matmul_reference(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                          group: int, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dequantize-then-matmul: x [M, K] -> [M, N] in x's dtype. The weight is dequantized exactly (fp32)
    and rounded once to ``compute_dtype`` (default x's), K in group-aligned blocks so that a 3B-width
    weight never exists whole in fp32."""
    from edgekv.kernels.int4_format import dequantize, unpack_awq

    dtype = x.dtype if compute_dtype is None else compute_dtype
    k_total, n = qweight.shape[0], scales.shape[1]
    step = max(group, _MAX_DEQUANT_ELEMENTS // max(n, 1) // group * group)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    out = torch.zeros(x.shape[0], n, dtype=acc_dtype, device=x.device)
    for k0 in range(0, k_total, step):
        k1 = min(k_total, k0 + step)
        g0, g1 = k0 // group, cdiv(k1, group)
        weight = dequantize(unpack_awq(qweight[k0:k1]), unpack_awq(qzeros[g0:g1]), scales[g0:g1], group)
        out += (x[:, k0:k1].to(dtype) @ weight.to(dtype)).to(acc_dtype)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------- kernels
@jit
def _dequantized_block(qw_ptr, qz_ptr, s_ptr, k0, offs_k, k_ok, offs_n, n_ok, words, N, group):
    """W^T[offs_k, offs_n] in fp32 from the packed words (one group row of zeros and scales per block)."""
    word = offs_n // 8
    shift = ((offs_n % 8) // 2 + (offs_n % 2) * 4) * 4  # nibble AWQ_INVERSE[n % 8] of the word
    mask = k_ok[:, None] & n_ok[None, :]
    packed = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * words + word[None, :], mask=mask, other=0)
    q = (packed >> shift[None, :]) & 0xF
    row = k0 // group  # BLOCK_K divides the group: one row of zeros and scales for the block
    zpacked = tl.load(qz_ptr + row.to(tl.int64) * words + word, mask=n_ok, other=0)
    z = (zpacked >> shift) & 0xF
    s = tl.load(s_ptr + row.to(tl.int64) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    return (q - z[None, :]).to(tl.float32) * s[None, :]


@jit
def _int4_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, group, words, chunk,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(N, BLOCK_N), S); x [K] contiguous; out [S, N] fp32: split s sums K rows [s * chunk, + chunk).
    # Each packed word is loaded once (a [BLOCK_K, BLOCK_N / 8] tile) and unpacked by a vector of 8 shifts into
    # its 8 outputs — not once per output lane, as _dequantized_block does for the tl.dot tiles.
    WORDS: tl.constexpr = BLOCK_N // 8
    offs_w = tl.program_id(0) * WORDS + tl.arange(0, WORDS)  # the packed word columns of this program
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # == 8 * offs_w + lane, word-major
    split = tl.program_id(1)
    lane = tl.arange(0, 8)
    shift = ((lane // 2) + (lane % 2) * 4) * 4  # output 8w + lane is nibble AWQ_INVERSE[lane] of word w
    w_ok, n_ok = offs_w < words, offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hi
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        packed = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * words + offs_w[None, :],
                         mask=k_ok[:, None] & w_ok[None, :], other=0)
        q = tl.reshape((packed[:, :, None] >> shift[None, None, :]) & 0xF, [BLOCK_K, BLOCK_N])
        row = k0 // group  # BLOCK_K divides the group: one row of zeros and scales for the block
        zpacked = tl.load(qz_ptr + row.to(tl.int64) * words + offs_w, mask=w_ok, other=0)
        z = tl.reshape((zpacked[:, None] >> shift[None, :]) & 0xF, [BLOCK_N])
        s = tl.load(s_ptr + row.to(tl.int64) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        # the scale is shared by the block's rows: sum_k x (q - z) first, one multiplication a block
        acc += tl.sum(x[:, None] * (q - z[None, :]).to(tl.float32), axis=0) * s
    tl.store(out_ptr + split.to(tl.int64) * N + offs_n, acc, mask=n_ok)


@jit
def _int4_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K, group, words, s_xm, s_om, s_os, chunk,
                      LOW_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), S); x [M, K] rows contiguous; out [S, M, N] fp32 (as the GEMV)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hi
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _dequantized_block(qw_ptr, qz_ptr, s_ptr, k0, offs_k, k_ok, offs_n, n_ok, words, N, group)
        if LOW_PRECISION:  # fp16 / bf16: the weight rounded to the activations' dtype, fp32 accumulation
            if DOT_IN_FP32:  # the same rounding, multiplied in fp32 (Triton 3.9's interpreter gets bf16 tl.dot wrong)
                rounded = round_to_bf16(w) if BF16 else w.to(x.dtype).to(tl.float32)
                acc += tl.dot(x.to(tl.float32), rounded, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        else:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    tl.store(out_ptr + split.to(tl.int64) * s_os + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


@jit
def _int4_dequantize_kernel(qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, group, words,
                            BF16: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(K, BLOCK_K), cdiv(N, BLOCK_N)); out [K, N] in the activations' dtype, rounded once (to nearest even)
    offs_k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok, n_ok = offs_k < K, offs_n < N
    w = _dequantized_block(qw_ptr, qz_ptr, s_ptr, tl.program_id(0) * BLOCK_K, offs_k, k_ok, offs_n, n_ok, words, N,
                           group)
    if BF16:  # the interpreter's own fp32 -> bf16 conversion truncates
        w = round_to_bf16(w)
    tl.store(out_ptr + offs_k[:, None].to(tl.int64) * N + offs_n[None, :], w.to(out_ptr.dtype.element_ty),
             mask=k_ok[:, None] & n_ok[None, :])


@jit
def _sum_splits_kernel(partial_ptr, out_ptr, S, L, BF16: tl.constexpr, BLOCK: tl.constexpr):
    # grid: (cdiv(L, BLOCK),); partial [S, L] fp32 -> out [L] in the activations' dtype: the splits added in
    # order 0, 1, ..., S - 1 (deterministic) and rounded once — one launch instead of torch's sum and cast
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < L
    acc = tl.load(partial_ptr + offs, mask=ok, other=0.0)
    for split in range(1, S):
        acc += tl.load(partial_ptr + split * L + offs, mask=ok, other=0.0)
    if BF16:  # the interpreter's own fp32 -> bf16 conversion truncates
        acc = round_to_bf16(acc)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------- launcher
GEMV_BLOCK = 128  # the GEMV's tile, K rows x N outputs (tools/gpu/int4_variants.py, H200: 128 x 128 fastest)
SUM_BLOCK = 256  # outputs a program of _sum_splits_kernel adds up
DEQUANTIZE_ROWS = 64  # chunks of at least this many rows: dequantize the weight once, then the dense product
PROGRAMS_PER_SM = 8


def _block_k(group: int, widest: int = 64) -> int:
    """The widest of ``widest``, 64, 32, 16 that divides the group (a block reads one row of zeros and scales)."""
    return next(b for b in (widest, 64, 32, 16) if group % b == 0)


def _programs(device: torch.device) -> int:
    """Programs a launch aims at: 8 a multiprocessor (132 on an H200, 16 on AGX Orin, 8 on Orin Nano; 16 in
    the interpreter, where it only decides how the tests split)."""
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return PROGRAMS_PER_SM * _multiprocessors(index)
    return 16


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    """Asked once a device: an eager 4-bit decode makes ~250 products a token, each would ask again."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def k_split(k: int, tiles: int, block_k: int, programs: int) -> tuple[int, int]:
    """(rows of K per program, splits) so that ``tiles`` output tiles x splits is about ``programs``.

    Why: a program walks its K rows one block after another, and each block's loads wait on memory — the
    first H200 run (issue 32, 2026-11-26) took 0.11 ms for a 2,048 x 2,048 4-bit GEMV with 32 programs of 32
    blocks each (bf16 F.linear: 0.006 ms). Split-K (as in split-K GEMM and flash-decoding) gives each program a
    few blocks; the partial sums are added in a fixed order (deterministic)."""
    blocks = cdiv(k, block_k)
    per_program = max(1, cdiv(blocks * tiles, max(programs, 1)))
    chunk = min(blocks, per_program) * block_k
    return chunk, cdiv(k, chunk)


def int4_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group: int) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) -> [M, N] in x's dtype; ``group`` a multiple of 16.

    One row (decode) and chunks of fewer than ``DEQUANTIZE_ROWS`` rows (a question) run the fused kernels over
    the packed words, split over K; wider chunks (a frame pair's prefill) dequantize the weight once into the
    activations' dtype and take the dense product — the same numbers as the reference, whose product is also
    in that dtype — because a weight tile dequantized per program is redone for every block of rows."""
    if group % 16:
        raise ValueError(f"int4_matmul_triton: group size {group} is not a multiple of 16")
    m, k = x.shape
    n = scales.shape[1]
    x = x.contiguous()
    words = qweight.shape[1]
    block_k, block_n = _block_k(group), 64
    if m >= DEQUANTIZE_ROWS:
        weight = torch.empty(k, n, dtype=x.dtype, device=x.device)
        _int4_dequantize_kernel[(cdiv(k, block_k), cdiv(n, block_n))](
            qweight, qzeros, scales, weight, n, k, group, words, BF16=x.dtype == torch.bfloat16,
            BLOCK_N=block_n, BLOCK_K=block_k)
        return x @ weight
    if m == 1:
        block_k, block_n = _block_k(group, GEMV_BLOCK), GEMV_BLOCK
        chunk, splits = k_split(k, cdiv(n, block_n), block_k, _programs(x.device))
        partial = torch.empty(splits, 1, n, dtype=torch.float32, device=x.device)
        _int4_gemv_kernel[(cdiv(n, block_n), splits)](x, qweight, qzeros, scales, partial, n, k, group, words, chunk,
                                                      BLOCK_N=block_n, BLOCK_K=block_k)
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        chunk, splits = k_split(k, cdiv(m, block_m) * cdiv(n, block_n), block_k, _programs(x.device))
        partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        _int4_gemm_kernel[(cdiv(m, block_m), cdiv(n, block_n), splits)](
            x, qweight, qzeros, scales, partial, m, n, k, group, words, x.stride(0), partial.stride(1),
            partial.stride(0), chunk,
            LOW_PRECISION=x.dtype != torch.float32, DOT_IN_FP32=interpreting(), BF16=x.dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)
    if splits == 1 and x.dtype == torch.float32:
        return partial[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _sum_splits_kernel[(cdiv(m * n, SUM_BLOCK),)](partial, out, splits, m * n, BF16=x.dtype == torch.bfloat16,
                                                  BLOCK=SUM_BLOCK)
    return out


# ---------------------------------------------------------------------------------------------- op
def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group: int) -> torch.Tensor:
    """x [M, K] @ the 4-bit weight -> [M, N] in x's dtype: Triton on CUDA (or in the interpreter), the
    dequantize-then-matmul reference otherwise (``edgekv.kernels`` dispatch rule)."""
    if group % 16 == 0 and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and use_triton(x, qweight):
        return int4_matmul_triton(x, qweight, qzeros, scales, group)
    return int4_matmul_reference(x, qweight, qzeros, scales, group)
