"""The C 4-bit decode kernel (kernels/cpu_gemv.c, issue 29) and the ``native`` route over 4-bit models.

Tolerance (STYLE: kernel tolerance): max |kernel - fp64 reference| <= 2 x max |same-precision torch run -
fp64 reference| + two fp32 ulps of the largest reference value. The reference is the exact dequantized
weight times the activations in fp64; the same-precision run is dequantize-then-matmul in the activations'
dtype (fp32: torch's fp32 product; bf16: the weight rounded to bf16, torch's bf16 product). The portable
loop (what a CPU without AVX2 or NEON runs) must give the AVX2 kernel's outputs bit for bit, and so must the
NEON path where an aarch64 cross compiler and an emulator are installed.
"""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from edgekv.kernels import cpu_gemv
from edgekv.kernels.cpu_gemv import dequant_int4, gemv_int4, int4_tiles, int4_untile
from edgekv.model.decode_routes import ROW_KERNEL_ROWS, NativeInt4Linear, prepare_decode, resolve_route
from edgekv.model.int4 import Int4Linear, dequantize

needs_kernel = pytest.mark.skipif(cpu_gemv.load() is None,
                                  reason=f"the C kernel cannot be built here: {cpu_gemv.unavailable_reason()}")
ULPS = 2
# (K, N, group): the 3B widths (q/o 2048x2048, k/v 2048->256, gate/up 2048->11008, down 11008->2048) and small ones
SHAPES_3B = [(2048, 2048, 128), (2048, 256, 128), (2048, 11008, 128), (11008, 2048, 128)]
SHAPES_SMALL = [(16, 16, 16), (64, 32, 16), (176, 64, 16), (256, 48, 64), (128, 16, 128)]


def weights(k: int, n: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    return q, zeros, scales


def activations(k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(k, generator=gen)
    x[::97] *= 40.0  # a few outlier channels, as LLM activations have
    return x.to(dtype)


def check(got: torch.Tensor, same_precision: torch.Tensor, reference: torch.Tensor) -> None:
    ref = reference.double()
    floor = ULPS * float(torch.finfo(torch.float32).eps) * float(ref.abs().max())
    bound = 2 * float((same_precision.double() - ref).abs().max()) + floor
    error = float((got.double() - ref).abs().max())
    assert error <= bound, f"kernel error {error:.3e} > bound {bound:.3e}"


def test_tiles_round_trip_and_byte_order():
    q = torch.arange(8 * 16, dtype=torch.int64).reshape(8, 16).remainder(16).to(torch.uint8)
    q[1, 3], q[2, 3], q[3, 3] = 9, 5, 7
    tiles = int4_tiles(q)
    assert tiles.shape == (1, 2, 32)
    # byte 2c + p of the tile of rows 0..3: low nibble q[p, c], high nibble q[2 + p, c]
    assert int(tiles[0, 0, 2 * 3 + 1]) == int(q[1, 3]) | int(q[3, 3]) << 4
    assert int(tiles[0, 0, 2 * 3]) == int(q[0, 3]) | int(q[2, 3]) << 4
    big = torch.randint(0, 16, (64, 48), dtype=torch.uint8)
    assert torch.equal(int4_untile(int4_tiles(big)), big)


@needs_kernel
@pytest.mark.parametrize("k,n,group", SHAPES_SMALL + SHAPES_3B)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_kernel_within_twice_the_same_precision_error(k, n, group, dtype):
    q, zeros, scales = weights(k, n, group, seed=k + n)
    x = activations(k, seed=n, dtype=dtype)
    weight = dequantize(q, zeros, scales, group)  # [K, N], exact
    reference = x.double() @ weight.double()
    same = (x @ weight.to(dtype)).float()
    got = gemv_int4(int4_tiles(q), scales, zeros, x).to(dtype)  # the route rounds the fp32 result once
    check(got, same, reference)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_threads_bias_and_the_portable_loop_give_the_same_bits(threads, dtype):
    from edgekv.kernels.cpu_gemv import gemm_int4

    k, n, group = 256, 80, 32
    q, zeros, scales = weights(k, n, group, seed=4)
    x = activations(k, seed=5, dtype=dtype)
    bias = torch.randn(n)
    tiles = int4_tiles(q)
    one = gemv_int4(tiles, scales, zeros, x, bias)
    assert torch.equal(gemv_int4(tiles, scales, zeros, x, bias, threads=threads), one)
    many = x.repeat(640, 1)  # 13M weight-rows: work for three threads (a single row runs on the caller alone)
    assert torch.equal(gemm_int4(tiles, scales, zeros, many, bias, threads=threads), one.expand(640, n))
    assert torch.equal(gemv_int4(tiles, scales, zeros, x, bias, portable=True), one)
    assert torch.equal(gemv_int4(tiles, scales, zeros, x) + bias, one)
    assert cpu_gemv.int4_simd(portable=True) == "portable"
    # groups of tiny and subnormal values (the vector path hands a group whose fixed-point factor is no fp32
    # number to the scalar one), a zero group, and values exactly at a power of two: the same integers
    tiny = activations(k, seed=6, dtype=torch.float32)
    tiny[:group] *= 1e-38
    tiny[group:2 * group] *= 1e-44
    tiny[2 * group:3 * group] = 0.0
    tiny[3 * group:3 * group + 4] = torch.tensor([1.0, -2.0, 0.5, 4.0])
    tiny = tiny.to(dtype)
    fast = gemv_int4(tiles, scales, zeros, tiny, bias, threads=threads)
    assert torch.equal(fast, gemv_int4(tiles, scales, zeros, tiny, bias, portable=True))


@needs_kernel
@pytest.mark.parametrize("k,n,group", SHAPES_3B + [(256, 80, 32), (64, 32, 16)])
def test_the_avx512_blocks_give_the_avx2_bits(k, n, group):
    """bf16 activations on an AVX-512 BW CPU take 512-bit blocks (two tiles a load); the AVX2 blocks and the portable
    loop must give the same bits, for one row and several, alone and on the pool."""
    from edgekv.kernels.cpu_gemv import Int4Product, gemm_int4, int4_set_wide

    before = int4_set_wide(True)
    if before is None:
        pytest.skip(f"no AVX-512 BW blocks compiled on this CPU (the kernel runs {cpu_gemv.int4_simd()})")
    try:
        q, zeros, scales = weights(k, n, group, seed=31)
        tiles, bias = int4_tiles(q), torch.randn(n)
        x = torch.stack([activations(k, seed=40 + r, dtype=torch.bfloat16) for r in range(3)])
        x[1, :group] *= 1e-30  # a group of tiny values
        product = Int4Product(tiles, scales, zeros, bias)
        assert cpu_gemv.int4_simd() == "avx512"
        wide = [product(x[:1], 1), product(x, 2)]
        assert int4_set_wide(False) is True and cpu_gemv.int4_simd() == "avx2"
        narrow = [product(x[:1], 1), product(x, 2)]
        for got, want in zip(wide, narrow):
            assert torch.equal(got, want)
        portable = gemm_int4(tiles, scales, zeros, x, bias, portable=True)  # bf16 rows: two digits
        assert torch.equal(wide[1].view(3, n), portable.to(torch.bfloat16))
    finally:
        int4_set_wide(before)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k,n,group", [(256, 80, 32), (2048, 48, 128)])  # 5 and 3 blocks: a pair and one alone
def test_rows_at_once_give_each_row_the_bits_it_gets_alone(threads, dtype, k, n, group):
    from edgekv.kernels.cpu_gemv import Int4Product, gemm_int4

    q, zeros, scales = weights(k, n, group, seed=11)
    tiles, bias = int4_tiles(q), torch.randn(n)
    x = torch.stack([activations(k, seed=20 + r, dtype=dtype) for r in range(7)])
    x[3, :group] *= 1e-40  # a row with a subnormal group, taken the scalar way
    alone = torch.stack([gemv_int4(tiles, scales, zeros, row, bias) for row in x])
    assert torch.equal(gemm_int4(tiles, scales, zeros, x, bias, threads=threads), alone)
    assert torch.equal(gemm_int4(tiles, scales, zeros, x, bias, portable=True), alone)
    product = Int4Product(tiles, scales, zeros, bias)  # bf16 rows go to the bf16 entry: the same bits, rounded once
    assert torch.equal(product(x.view(7, 1, k), threads).view(7, n), alone.to(dtype))
    with pytest.raises(ValueError, match=r"activations \(7, 3\) for a weight of"):
        gemm_int4(tiles, scales, zeros, x[:, :3])
    x[6, 5] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        product(x, threads)


@needs_kernel
@pytest.mark.parametrize("k,n,group", SHAPES_SMALL + [(2048, 256, 128)])
def test_dequantizer_is_exact_and_rounds_bf16_once(k, n, group):
    q, zeros, scales = weights(k, n, group, seed=7)
    tiles = int4_tiles(q)
    exact = dequantize(q, zeros, scales, group).t()
    assert torch.equal(dequant_int4(tiles, scales, zeros), exact)
    assert torch.equal(dequant_int4(tiles, scales, zeros, portable=True), exact)
    assert torch.equal(dequant_int4(tiles, scales, zeros, torch.bfloat16), exact.bfloat16())
    assert torch.equal(dequant_int4(tiles, scales, zeros, torch.float16), exact.half())


@needs_kernel
def test_zero_and_non_finite_activations():
    q, zeros, scales = weights(64, 32, 16, seed=1)
    tiles = int4_tiles(q)
    assert torch.equal(gemv_int4(tiles, scales, zeros, torch.zeros(64)), torch.zeros(32))
    x = torch.zeros(64)
    x[:16] = 1e-30  # a group of tiny values: the group's own exponent keeps them
    weight = dequantize(q, zeros, scales, 16)
    assert torch.allclose(gemv_int4(tiles, scales, zeros, x).double(), x.double() @ weight.double(), rtol=1e-5, atol=0)
    x[5] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        gemv_int4(tiles, scales, zeros, x)


@needs_kernel
def test_refuses_what_it_cannot_read():
    q, zeros, scales = weights(64, 32, 16, seed=1)
    tiles = int4_tiles(q)
    with pytest.raises(ValueError, match="do not make one"):
        gemv_int4(tiles, scales.float(), zeros, torch.zeros(64))
    with pytest.raises(ValueError, match="do not make one"):
        gemv_int4(tiles, scales, zeros, torch.zeros(63))
    q8, zeros8, scales8 = weights(64, 32, 8, seed=1)
    with pytest.raises(ValueError, match="group size % 16"):
        gemv_int4(int4_tiles(q8), scales8, zeros8, torch.zeros(64))


# ---------------------------------------------------------------------------------------------- the route
def _int4_linear(k: int, n: int, group: int, bias: bool, seed: int) -> Int4Linear:
    q, zeros, scales = weights(k, n, group, seed)
    return Int4Linear.from_integers(q, zeros, scales, torch.randn(n) if bias else None)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_native_int4_linear_kernel_for_rows_and_long_chunks_dequantized(dtype):
    linear = _int4_linear(128, 48, 32, bias=True, seed=3)
    linear.bias.data = linear.bias.data.to(dtype)
    native = NativeInt4Linear(linear)
    assert native.bias is linear.bias and native.scales is linear.scales
    assert torch.equal(native.integers()[0], linear.integers()[0])
    assert torch.equal(native.dequantized_weight(), linear.dequantized_weight())
    with torch.inference_mode():
        row = activations(128, 1, dtype)[None]
        want = gemv_int4(native.tiles, native.scales, native.zeros, row, linear.bias).to(dtype)
        assert torch.equal(native(row)[0], want)
        short = torch.randn(2, 3, 128).to(dtype)  # a short chunk: each row what the one-row kernel gives it
        rows = torch.stack([gemv_int4(native.tiles, native.scales, native.zeros, r, linear.bias).to(dtype)
                            for r in short.reshape(6, 128)])
        assert torch.equal(native(short), rows.view(2, 3, 48))
        # a long chunk: fp32 products against the exact weight, rounded once
        chunk = torch.randn(ROW_KERNEL_ROWS[dtype] + 1, 128).to(dtype)
        want = torch.nn.functional.linear(chunk.float(), linear.dequantized_weight(), linear.bias.float()).to(dtype)
        assert torch.equal(native(chunk), want)
        wider = _int4_linear(256, 64, 32, bias=False, seed=4)  # the kept buffer grows, then serves smaller ones
        assert torch.equal(NativeInt4Linear(wider)(chunk.repeat(1, 2)),
                           (chunk.repeat(1, 2).float() @ wider.dequantized_weight().t()).to(dtype))
        assert torch.equal(native(chunk), want)
        short[0, 1, 7] = float("inf")  # a non-finite activation: torch's product, which propagates it as torch does
        want = torch.nn.functional.linear(short.float(), linear.dequantized_weight(), linear.bias.float()).to(dtype)
        torch.testing.assert_close(native(short), want, rtol=0, atol=0, equal_nan=True)


@needs_kernel
def test_route_packs_a_quantized_model_and_decodes_the_same_tokens(tmp_path):
    from edgekv.model import load_pretrained
    from edgekv.calibration.quantize import quantize_checkpoint
    from edgekv.model.tiny import make_tiny_checkpoint

    dense = make_tiny_checkpoint(tmp_path / "dense", preset="test-gqa4", seed=8)
    quantized = quantize_checkpoint(dense, tmp_path / "q4", group_size=32)
    assert resolve_route("auto", torch.float32, "cpu", quantized=True) == ("native", None)
    assert resolve_route("auto", torch.float32, "cpu")[0] == "eager"  # an fp32 dense model stays on torch
    ids = torch.randint(0, 4000, (12,), generator=torch.Generator().manual_seed(0))
    outputs = {}
    for route in ("eager", "native"):
        model = load_pretrained(quantized, dtype=torch.float32)
        info = prepare_decode(model.language, route)
        if route == "native":
            assert info["int4_linears"] == 14 and info["int4_simd"] in ("avx512", "avx2", "neon", "portable")
            assert not any(isinstance(m, Int4Linear) for m in model.modules())
        outputs[route] = model.generate(ids[None], max_new_tokens=8, stop_ids=[])
    assert outputs["native"] == outputs["eager"]


@needs_kernel
def test_route_frees_each_modules_awq_words_as_it_repacks(tmp_path, monkeypatch):
    """The repack holds one module's words and tiles at a time, never the whole model's 4-bit weights twice
    (the 3B repack peaked +1.4 GiB when every module's words lived until the last was repacked)."""
    import weakref

    from edgekv.calibration.quantize import quantize_checkpoint
    from edgekv.model import decode_routes, load_pretrained
    from edgekv.model.tiny import make_tiny_checkpoint

    dense = make_tiny_checkpoint(tmp_path / "dense", preset="test-gqa4", seed=8)
    model = load_pretrained(quantize_checkpoint(dense, tmp_path / "q4", group_size=32), dtype=torch.float32)
    words = [weakref.ref(m.qweight) for m in model.modules() if isinstance(m, Int4Linear)]
    alive_at_each_repack = []
    original = decode_routes.NativeInt4Linear.__init__

    def counting(self, linear):
        alive_at_each_repack.append(sum(ref() is not None for ref in words))
        original(self, linear)

    monkeypatch.setattr(decode_routes.NativeInt4Linear, "__init__", counting)
    prepare_decode(model.language, "native")
    assert alive_at_each_repack == list(range(len(words), 0, -1))  # the i-th repack: only i-1 freed before it
    assert all(ref() is None for ref in words)


# ---------------------------------------------------------------------------------------------- aarch64 (NEON)
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


@pytest.mark.skipif(not (CROSS and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu, qemu-user)")
@pytest.mark.parametrize("k,n,group", [(176, 64, 16), (2048, 256, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_neon_path_gives_the_host_bits_under_an_emulator(tmp_path, k, n, group, dtype):
    driver = tmp_path / "kernel_driver"
    source = Path(cpu_gemv.SOURCE)
    built = subprocess.run([CROSS, "-O3", "-march=armv8.2-a", "-std=c11", "-pthread", "-o", str(driver), str(source),
                            str(Path(__file__).parent / "native" / "kernel_driver.c"), "-lm"], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    q, zeros, scales = weights(k, n, group, seed=11)
    x = torch.stack([activations(k, seed=12 + r, dtype=dtype) for r in range(3)])  # row 0 alone, then all 3
    tiles = int4_tiles(q)
    digits = cpu_gemv.INT4_DIGITS[dtype]
    (tmp_path / "in.bin").write_bytes(struct.pack("<6q", n, k, group, 2, digits, 3) + tiles.numpy().tobytes()
                                      + scales.numpy().tobytes() + zeros.numpy().tobytes() + x.float().numpy().tobytes())
    run = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(driver), "int4", str(tmp_path / "in.bin"),
                          str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    raw = (tmp_path / "out.bin").read_bytes()
    simd = struct.unpack("<i", raw[:4])[0]
    values = torch.from_numpy(np.frombuffer(raw[4:], dtype=np.float32).copy())
    y, rows, w = values[:n], values[n:4 * n].view(3, n), values[4 * n:].view(n, k)
    assert simd == 2  # the NEON path ran
    assert torch.equal(y, gemv_int4(tiles, scales, zeros, x[0]))
    assert torch.equal(rows, cpu_gemv.gemm_int4(tiles, scales, zeros, x))
    assert torch.equal(w, dequantize(q, zeros, scales, group).t())


@needs_kernel
def test_the_bf16_entry_gives_the_generic_kernels_bits_and_checks_once():
    from edgekv.kernels.cpu_gemv import Int4Product

    k, n, group = 2048, 256, 128  # the 3B k/v projection
    q, zeros, scales = weights(k, n, group, seed=11)
    tiles = int4_tiles(q)
    bias = torch.randn(n).bfloat16()
    product = Int4Product(tiles, scales, zeros, bias)
    for seed, dtype in [(1, torch.bfloat16), (2, torch.bfloat16), (3, torch.float32), (4, torch.float16)]:
        x = activations(k, seed=seed, dtype=dtype)
        got = product(x, threads=2)
        assert got.dtype == dtype
        assert torch.equal(got, gemv_int4(tiles, scales, zeros, x, bias).to(dtype))
    bad = activations(k, seed=5, dtype=torch.bfloat16)
    bad[7] = float("nan")
    with pytest.raises(ValueError, match="inf or nan"):
        product(bad)
    with pytest.raises(ValueError, match=r"activations \(2047,\) for a weight of 2048 inputs"):
        product(torch.zeros(k - 1, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias of 3"):
        Int4Product(tiles, scales, zeros, torch.zeros(3))


@needs_kernel
def test_the_thread_pool_serves_concurrent_callers_and_a_forked_child():
    import multiprocessing
    import threading

    from edgekv.kernels.cpu_gemv import gemm_int4

    # 32 rows of a 1024 x 400 weight: 13M weight-rows, enough work for three threads (cpu_gemv.c, Q4_WORK_PER_THREAD)
    k, n, group = 1024, 400, 128
    q, zeros, scales = weights(k, n, group, seed=12)
    tiles = int4_tiles(q)
    inputs = [torch.stack([activations(k, seed=s * 100 + r, dtype=torch.bfloat16) for r in range(32)]) for s in range(4)]
    want = [gemm_int4(tiles, scales, zeros, x, threads=1) for x in inputs]
    wrong = []

    def caller(index: int) -> None:  # four threads at once: one has the pool, the others run their chunks alone
        for _ in range(10):
            if not torch.equal(gemm_int4(tiles, scales, zeros, inputs[index], threads=3), want[index]):
                wrong.append(index)

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for thread in callers:
        thread.start()
    for thread in callers:
        thread.join()
    assert wrong == []
    # a child forked from a process whose pool has workers starts its own (the parent's are not there)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_forked_product, args=(tiles, scales, zeros, inputs[0], results))
    child.start()
    got = results.get(timeout=120)  # a bound against a hang, not a figure
    child.join(timeout=120)
    assert child.exitcode == 0
    assert got == want[0].tolist()


def _forked_product(tiles, scales, zeros, x, results) -> None:
    from edgekv.kernels.cpu_gemv import gemm_int4

    results.put(gemm_int4(tiles, scales, zeros, x, threads=2).tolist())


@needs_kernel
def test_native_linear_checks_its_weight_again_after_a_move():
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (256, 64), generator=gen, dtype=torch.uint8)
    linear = Int4Linear.from_integers(q, torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8),
                                      (torch.rand(8, 64, generator=gen) * 0.02).half(),
                                      torch.randn(64, generator=gen).bfloat16())
    native = NativeInt4Linear(linear)
    x = torch.randn(1, 256, generator=gen).bfloat16()
    with torch.inference_mode():
        first = native(x)
        assert native._product is not None
        native.to("cpu")  # a move (here to where it is) may replace the buffers: the product is made again
        assert native._product is None
        assert torch.equal(native(x), first)
        exact = x.double() @ linear.dequantized_weight().double().t() + linear.bias.double()
        assert torch.allclose(first.double(), exact, rtol=2 ** -7, atol=1e-3)


def test_a_dtype_cast_of_the_model_keeps_the_4bit_scales():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (128, 32), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(4, 32, generator=gen) * 0.02 + 1e-3).half()
    linear = Int4Linear.from_integers(q, torch.randint(0, 16, (4, 32), generator=gen, dtype=torch.uint8), scales,
                                      torch.randn(32, generator=gen).bfloat16().float())  # a bias bf16 keeps
    x = torch.randn(1, 128, generator=gen)
    want = linear(x)
    linear.to(torch.bfloat16).to(torch.float32)  # a round trip through bf16 would round the fp16 scales
    assert linear.scales.dtype == torch.float16 and torch.equal(linear.scales, scales)
    assert linear.bias.dtype == torch.float32 and torch.equal(linear(x), want)
    native = NativeInt4Linear(linear)
    with torch.inference_mode():
        first = native(x.bfloat16())
        native.bfloat16()
        assert native.scales.dtype == torch.float16 and torch.equal(native.scales, scales)
        assert torch.equal(native(x.bfloat16()), first)  # the kernel still takes the weight
