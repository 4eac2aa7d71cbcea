"""Issue 32 / 29, a prepared experiment for the next device call: variants of the 4-bit GEMV at the 3B widths,
timed beside the shipped kernel (kernels/int4_matmul.py) and bf16 ``F.linear``, so the next session can pick
one with figures instead of guesses.

Issue 32's lease_i (2026-11-28): the lanes-* variants 0.0133 / 0.0137 ms at 2,048 x 2,048, the shipped kernel
0.0060, bf16 0.0057. The H200 runs of 2026-11-26: the GEMV then shipped (split-K, one packed word loaded per
nibble lane) took 0.033 ms for 2,048 x 2,048 against 0.006 ms in bf16; words-128x128 0.0087 ms, words-atomic
0.0084 (third call). The shipped kernel is now words-128x128 with its splits added by a Triton kernel (in order,
cast included). Variants:

  shipped        int4_matmul_triton (split-K partials, _sum_splits_kernel)
  words-64x64    each program loads its [BLOCK_K, BLOCK_N / 8] packed words once and unpacks them with a
                 shift vector (8 nibbles a word), split-K partials as shipped
  words-128x128  the same with wider tiles (fewer programs, more bytes each)
  words-256x128  256 outputs a program; words-128x128-p4 / -p16: 4 / 16 programs a multiprocessor (8 shipped)
  lanes-*        the same words, the 8 nibble lanes as 8 accumulators (no reshape to a [K, N] tile)
  words-atomic   words-64x64 whose splits add into one fp32 row with atomics (no partials, no torch sum;
                 the sum order is not fixed, so it is a timing probe, not a candidate as it stands)
  magic-*        (2026-12-04, not yet run on a GPU) the lanes kept as a [WORDS, 8] tile (no reshape), each
                 nibble made a float without a conversion instruction (its bits or'ed into those of 2^23, then
                 2^23 subtracted: an integer and, or and a float add, all full rate, where int -> float runs at a
                 quarter rate on recent NVIDIA GPUs), and the zero point taken out of the K sum (sum x (q - z) =
                 sum x q - z sum x: one multiply-add a weight); -w8: 8 warps a program

Each timed pass runs the product over 36 different weights (a token's worth do not fit the L2), captured in
one CUDA graph and replayed. Prints ms a call and max |diff| against the fp64 reference; JSON to ``--json``.
``--small`` runs toy widths on the CPU in Triton's interpreter (a check of this script, not a figure).
"""

from __future__ import annotations

import argparse

import torch

import replay  # tools/gpu/replay.py (the scripts run as python3 tools/gpu/<name>.py)

from edgekv.kernels._triton import cdiv, jit, tl

SHIFTS = (0, 16, 4, 20, 8, 24, 12, 28)  # nibble of output n % 8 in its word (the AWQ packing order)


@jit
def _gemv_words_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, group, words, chunk,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr):
    WORDS: tl.constexpr = BLOCK_N // 8
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)  # packed word columns of this program
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    lane = tl.arange(0, 8)
    shift = ((lane // 2) + (lane % 2) * 4) * 4  # == SHIFTS
    w_ok = offs_w < words
    n_ok = offs_n < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hi
        packed = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * words + offs_w[None, :],
                         mask=k_ok[:, None] & w_ok[None, :], other=0)  # [BLOCK_K, WORDS]
        q = tl.reshape((packed[:, :, None] >> shift[None, None, :]) & 0xF, [BLOCK_K, BLOCK_N])
        row = k0 // group
        zpacked = tl.load(qz_ptr + row.to(tl.int64) * words + offs_w, mask=w_ok, other=0)  # [WORDS]
        z = tl.reshape((zpacked[:, None] >> shift[None, :]) & 0xF, [BLOCK_N])
        s = tl.load(s_ptr + row.to(tl.int64) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None] * (q - z[None, :]).to(tl.float32), axis=0) * s
    if ATOMIC:
        tl.atomic_add(out_ptr + offs_n, acc, mask=n_ok)
    else:
        tl.store(out_ptr + split.to(tl.int64) * N + offs_n, acc, mask=n_ok)


def gemv_words(x, qweight, qzeros, scales, group, block_n=64, block_k=64, atomic=False, programs=1056):
    from edgekv.kernels.int4_matmul import k_split

    k, n = x.shape[1], scales.shape[1]
    block_k = min(block_k, group)
    chunk, splits = k_split(k, cdiv(n, block_n), block_k, programs)
    if atomic:
        out = torch.zeros(1, n, dtype=torch.float32, device=x.device)
    else:
        out = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    _gemv_words_kernel[(cdiv(n, block_n), splits)](x, qweight, qzeros, scales, out, n, k, group, qweight.shape[1], chunk,
                                                   BLOCK_N=block_n, BLOCK_K=block_k, ATOMIC=atomic)
    return (out[0] if atomic else out.sum(0)).to(x.dtype)[None]


@jit
def _gemv_lanes_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, group, words, chunk,
                       WORDS: tl.constexpr, BLOCK_K: tl.constexpr):
    # as _gemv_words_kernel, without the [BLOCK_K, WORDS, 8] -> [BLOCK_K, BLOCK_N] reshape (a layout change the
    # compiler may route through shared memory): the 8 nibble lanes of each word are 8 [WORDS] accumulators,
    # output 8w + lane stored with stride 8
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)
    w_ok = offs_w < words
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    for lane in tl.static_range(8):
        shift = ((lane // 2) + (lane % 2) * 4) * 4
        offs_n = offs_w * 8 + lane
        n_ok = w_ok & (offs_n < N)
        acc = tl.zeros([WORDS], dtype=tl.float32)
        for k0 in range(lo, hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hi
            packed = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * words + offs_w[None, :],
                             mask=k_ok[:, None] & w_ok[None, :], other=0)
            q = ((packed >> shift) & 0xF).to(tl.float32)
            row = k0 // group
            z = ((tl.load(qz_ptr + row.to(tl.int64) * words + offs_w, mask=w_ok, other=0) >> shift) & 0xF).to(tl.float32)
            s = tl.load(s_ptr + row.to(tl.int64) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None] * (q - z[None, :]), axis=0) * s
        tl.store(out_ptr + split.to(tl.int64) * N + offs_n, acc, mask=n_ok)


def gemv_lanes(x, qweight, qzeros, scales, group, block_n=128, block_k=128, programs=1056):
    from edgekv.kernels.int4_matmul import k_split

    k, n = x.shape[1], scales.shape[1]
    block_k = min(block_k, group)
    chunk, splits = k_split(k, cdiv(n, block_n), block_k, programs)
    out = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    _gemv_lanes_kernel[(cdiv(n, block_n), splits)](x, qweight, qzeros, scales, out, n, k, group, qweight.shape[1], chunk,
                                                   WORDS=block_n // 8, BLOCK_K=block_k)
    return out.sum(0).to(x.dtype)[None]


@jit
def _gemv_magic_kernel(x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, group, words, chunk,
                       WORDS: tl.constexpr, BLOCK_K: tl.constexpr):
    # a [BLOCK_K, WORDS, 8] tile of nibbles summed over K into [WORDS, 8] outputs (output 8w + lane), no reshape;
    # a nibble q becomes the float 2^23 + q by or-ing its bits into 2^23's (0x4B000000), exact, then 2^23 is
    # subtracted (exact again); per block (one group row) sum_k x (q - z) s = (sum_k x q - z sum_k x) s
    pid_n, split = tl.program_id(0), tl.program_id(1)
    offs_w = pid_n * WORDS + tl.arange(0, WORDS)
    lane = tl.arange(0, 8)
    shift = ((lane // 2) + (lane % 2) * 4) * 4  # == SHIFTS
    offs_n = offs_w[:, None] * 8 + lane[None, :]  # [WORDS, 8]
    w_ok = offs_w < words
    n_ok = offs_n < N
    acc = tl.zeros([WORDS, 8], dtype=tl.float32)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, K)
    for k0 in range(lo, hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hi
        x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        packed = tl.load(qw_ptr + offs_k[:, None].to(tl.int64) * words + offs_w[None, :],
                         mask=k_ok[:, None] & w_ok[None, :], other=0)  # [BLOCK_K, WORDS]
        bits = ((packed[:, :, None] >> shift[None, None, :]) & 0xF) | 0x4B000000
        q = bits.to(tl.float32, bitcast=True) - 8388608.0  # [BLOCK_K, WORDS, 8], exactly 0..15
        dot = tl.sum(x[:, None, None] * q, axis=0)  # [WORDS, 8]
        row = k0 // group  # BLOCK_K divides the group: one row of zeros and scales for the block
        zpacked = tl.load(qz_ptr + row.to(tl.int64) * words + offs_w, mask=w_ok, other=0)
        z = ((zpacked[:, None] >> shift[None, :]) & 0xF).to(tl.float32)
        s = tl.load(s_ptr + row.to(tl.int64) * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += (dot - z * tl.sum(x, axis=0)) * s
    tl.store(out_ptr + split.to(tl.int64) * N + offs_n, acc, mask=n_ok)


def gemv_magic(x, qweight, qzeros, scales, group, block_n=128, block_k=128, programs=1056, warps=4):
    from edgekv.kernels.int4_matmul import k_split

    k, n = x.shape[1], scales.shape[1]
    block_k = min(block_k, group)
    chunk, splits = k_split(k, cdiv(n, block_n), block_k, programs)
    out = torch.empty(splits, n, dtype=torch.float32, device=x.device)
    _gemv_magic_kernel[(cdiv(n, block_n), splits)](x, qweight, qzeros, scales, out, n, k, group, qweight.shape[1],
                                                   chunk, WORDS=block_n // 8, BLOCK_K=block_k, num_warps=warps)
    return out.sum(0).to(x.dtype)[None]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--json", default="int4-variants.json")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--only", default="", help="comma-separated name prefixes to run (bf16 F.linear and "
                        "shipped always run), e.g. magic,lanes")
    args = parser.parse_args()

    import torch.nn.functional as F

    from edgekv.kernels.int4_format import pack_awq
    from edgekv.kernels.int4_matmul import int4_matmul_reference, int4_matmul_triton

    cuda = not args.small
    device = torch.device("cuda" if cuda else "cpu")
    copies = 36 if cuda else 2
    shapes = [(2048, 2048), (2048, 256), (2048, 11008), (11008, 2048)] if cuda else [(256, 64), (128, 200)]
    group = 128 if cuda else 32
    programs = 8 * torch.cuda.get_device_properties(device).multi_processor_count if cuda else 16
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "rows": []}
    gen = torch.Generator().manual_seed(0)

    def timed(call) -> float:
        return replay.timed(call, copies, args.replays, cuda) * 1e3

    for k, n in shapes:
        weights = []
        for _ in range(copies):
            q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
            zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8)
            scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
            weights.append((pack_awq(q).to(device), pack_awq(zeros).to(device), scales.to(device)))
        dense = [torch.randn(n, k, generator=gen).to(device, torch.bfloat16) * 0.02 for _ in range(copies)]
        x = torch.randn(1, k, generator=gen).to(device, torch.bfloat16)
        want = int4_matmul_reference(x.double(), *weights[0], group)
        calls = {
            "bf16 F.linear": (lambda i: F.linear(x, dense[i]), None),
            "shipped": (lambda i: int4_matmul_triton(x, *weights[i], group), True),
            "words-64x64": (lambda i: gemv_words(x, *weights[i], group, 64, 64, programs=programs), True),
            "words-128x128": (lambda i: gemv_words(x, *weights[i], group, 128, 128, programs=programs), True),
            "words-256x128": (lambda i: gemv_words(x, *weights[i], group, 256, 128, programs=programs), True),
            "words-128x128-p4": (lambda i: gemv_words(x, *weights[i], group, 128, 128, programs=programs // 2), True),
            "words-128x128-p16": (lambda i: gemv_words(x, *weights[i], group, 128, 128, programs=programs * 2), True),
            "words-atomic": (lambda i: gemv_words(x, *weights[i], group, 64, 64, atomic=True, programs=programs), True),
            "lanes-128x128": (lambda i: gemv_lanes(x, *weights[i], group, 128, 128, programs=programs), True),
            "lanes-256x128": (lambda i: gemv_lanes(x, *weights[i], group, 256, 128, programs=programs), True),
            "magic-128x128": (lambda i: gemv_magic(x, *weights[i], group, 128, 128, programs=programs), True),
            "magic-256x128": (lambda i: gemv_magic(x, *weights[i], group, 256, 128, programs=programs), True),
            "magic-128x128-w8": (lambda i: gemv_magic(x, *weights[i], group, 128, 128, programs=programs, warps=8),
                                 True),
            "magic-64x128": (lambda i: gemv_magic(x, *weights[i], group, 64, 128, programs=programs), True),
        }
        wanted = [w for w in args.only.split(",") if w]
        for name, (call, check) in calls.items():
            if wanted and name not in ("bf16 F.linear", "shipped") and not any(name.startswith(w) for w in wanted):
                continue
            def measure(call=call, check=check):
                ms = timed(call)
                diff = float((call(0).double() - want).abs().max()) if check else None
                text = f"{ms:8.4f} ms a call" + (
                    f"   max|diff| {diff:.2e} (of max {float(want.abs().max()):.2e})" if check else "")
                return {"ms": ms, "max_abs_diff": diff}, text

            replay.row(result, args.json, {"k": k, "n": n, "variant": name}, f"K {k:5d} N {n:5d}  {name:14s}", measure)

if __name__ == "__main__":
    main()
