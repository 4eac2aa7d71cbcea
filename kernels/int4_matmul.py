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

Both need a group size that is a multiple of 16 (``BLOCK_K`` divides it, so a block's zeros and scales are
one row); anything else runs the torch reference: dequantize (exact, fp32) and multiply.
"""

from __future__ import annotations

import torch

from edgekv.kernels._triton import cdiv, interpreting, jit, tl, use_triton

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
def _round_to_bf16(w):
    """fp32 -> the nearest bf16 (ties to even), kept in fp32: the interpreter's own conversion truncates."""
    bits = w.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@jit
def _int4_gemv_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, group, words,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(N, BLOCK_N),); x [K] contiguous, out [N] fp32
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        w = _dequantized_block(qw_ptr, qz_ptr, s_ptr, k0, offs_k, k_ok, offs_n, n_ok, words, N, group)
        acc += tl.sum(x[:, None] * w, axis=0)
    tl.store(out_ptr + offs_n, acc, mask=n_ok)


@jit
def _int4_gemm_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K, group, words, s_xm, s_om,
                      LOW_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, BF16: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)); x [M, K] rows contiguous, out [M, N] fp32
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok, n_ok = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * s_xm + offs_k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = _dequantized_block(qw_ptr, qz_ptr, s_ptr, k0, offs_k, k_ok, offs_n, n_ok, words, N, group)
        if LOW_PRECISION:  # fp16 / bf16: the weight rounded to the activations' dtype, fp32 accumulation
            if DOT_IN_FP32:  # the same rounding, multiplied in fp32 (Triton 3.9's interpreter gets bf16 tl.dot wrong)
                rounded = _round_to_bf16(w) if BF16 else w.to(x.dtype).to(tl.float32)
                acc += tl.dot(x.to(tl.float32), rounded, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
        else:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * s_om + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


# ---------------------------------------------------------------------------------------------- launcher
def _block_k(group: int) -> int:
    return 64 if group % 64 == 0 else 32 if group % 32 == 0 else 16


def int4_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                       group: int) -> torch.Tensor:
    """x [M, K] (fp32 / fp16 / bf16) -> [M, N] in x's dtype; ``group`` a multiple of 16."""
    if group % 16:
        raise ValueError(f"int4_matmul_triton: group size {group} is not a multiple of 16")
    m, k = x.shape
    n = scales.shape[1]
    x = x.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    words = qweight.shape[1]
    if m == 1:
        block_n = 64
        _int4_gemv_kernel[(cdiv(n, block_n),)](x, qweight, qzeros, scales, out, n, k, group, words,
                                               BLOCK_N=block_n, BLOCK_K=_block_k(group))
    else:
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        block_n = 64
        _int4_gemm_kernel[(cdiv(m, block_m), cdiv(n, block_n))](
            x, qweight, qzeros, scales, out, m, n, k, group, words, x.stride(0), out.stride(0),
            LOW_PRECISION=x.dtype != torch.float32, DOT_IN_FP32=interpreting(), BF16=x.dtype == torch.bfloat16,
            BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=_block_k(group))
    return out.to(x.dtype)


# ---------------------------------------------------------------------------------------------- op
def int4_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                group: int) -> torch.Tensor:
    """x [M, K] @ the 4-bit weight -> [M, N] in x's dtype: Triton on CUDA (or in the interpreter), the
    dequantize-then-matmul reference otherwise (``edgekv.kernels`` dispatch rule)."""
    if group % 16 == 0 and x.dtype in (torch.float32, torch.float16, torch.bfloat16) and use_triton(x, qweight):
        return int4_matmul_triton(x, qweight, qzeros, scales, group)
    return int4_matmul_reference(x, qweight, qzeros, scales, group)
