"""The Triton 4-bit products (kernels/int4_matmul.py, issue 29) against dequantize-then-matmul.

As in ``test_kernels.py``: on CPU the kernels run in Triton's interpreter (this module runs again in a
subprocess with ``TRITON_INTERPRET=1``, the one test_kernels.py reads too: ``helpers_interpreter.py``), on
CUDA compiled; ``gpu`` tests at the Qwen2.5-VL-3B widths.
Tolerance: max |kernel - fp64 reference| <= 2 x max |same-precision torch run - fp64 reference| + two fp32
ulps of the largest reference value; the reference multiplies the exact dequantized weight in fp64, the
same-precision run is ``int4_matmul_reference`` (the weight rounded once to the activations' dtype).
"""

from __future__ import annotations

import pytest
import torch

from edgekv.kernels import triton_available
from edgekv.kernels._triton import interpreting
from edgekv.kernels.int4_matmul import DEQUANTIZE_ROWS, int4_matmul, int4_matmul_reference, int4_matmul_triton, k_split
from edgekv.model.int4 import pack_awq
from helpers_interpreter import interpreted_run

INTERPRETED = interpreting()
CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = torch.device("cuda" if CUDA else "cpu")
RUN_HERE = triton_available() and (CUDA or INTERPRETED)
needs_triton = pytest.mark.skipif(not RUN_HERE, reason="runs in test_int4_kernels_in_triton_interpreter's subprocess")
requires_cuda = pytest.mark.skipif(not (CUDA and triton_available()), reason="needs CUDA and triton")


@pytest.mark.slow
@pytest.mark.skipif(RUN_HERE or not triton_available(), reason="the kernels run in this process")
def test_int4_kernels_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    run = interpreted_run(request.config.rootpath, request.config.getoption("markexpr"))
    outcomes = run.outcomes(__file__)
    print(run.output[-4000:])
    assert run.returncode in (0, 1) and outcomes.get("passed") and not outcomes.keys() & {"failed", "error"}, \
        f"interpreter run failed ({outcomes.get('failed', [])} {outcomes.get('error', [])}):\n{run.output[-16000:]}"


def packed(k: int, n: int, group: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=gen) * 0.02 + 0.001).half()
    return pack_awq(q).to(DEVICE), pack_awq(zeros).to(DEVICE), scales.to(DEVICE)


def check(m: int, k: int, n: int, group: int, dtype: torch.dtype, seed: int = 0, sum_order_floor: bool = False) -> None:
    """``sum_order_floor``: the floor grows with sqrt(K) fp32 roundings of the largest output, the usual size of
    the difference between two fp32 summation orders of K terms. On an H200 the compiled fp32 tiles (FMA, no TF32)
    differed from cuBLAS's fp32 product by up to ~2e-6 of the largest output at K = 2048..11008 (issue 32), 8x
    cuBLAS's own error against fp64, but well inside this floor; the interpreter adds in numpy's order."""
    qweight, qzeros, scales = packed(k, n, group, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE, dtype)
    got = int4_matmul_triton(x, qweight, qzeros, scales, group)
    assert got.dtype == dtype and got.shape == (m, n)
    reference = int4_matmul_reference(x.double(), qweight, qzeros, scales, group)
    same = int4_matmul_reference(x, qweight, qzeros, scales, group)
    err = float((got.double() - reference).abs().max())
    base = float((same.double() - reference).abs().max())
    floor = (max(2.0, k ** 0.5) if sum_order_floor else 2.0) * torch.finfo(torch.float32).eps * float(reference.abs().max())
    assert err <= 2 * base + floor, f"[{m}x{k}] @ [{k}x{n}] g{group} {dtype}: {err:.3g} > 2 x {base:.3g} + {floor:.2g}"


@needs_triton
@pytest.mark.parametrize("m", [1, 17, 70])
@pytest.mark.parametrize("k,n,group", [(64, 16, 16), (96, 40, 32), (128, 72, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_int4_matmul_small_odd_shapes(m, k, n, group, dtype):
    check(m, k, n, group, dtype, seed=m * 7 + k)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_wide_chunks_dequantize_once_to_the_references_numbers(dtype):
    """A chunk of DEQUANTIZE_ROWS rows or more takes the weight dequantized by the kernel (rounded once to the
    activations' dtype, to nearest even) and the dense product: the reference's own numbers, bit for bit."""
    qweight, qzeros, scales = packed(96, 40, 32, seed=5)
    x = torch.randn(DEQUANTIZE_ROWS, 96, generator=torch.Generator().manual_seed(6)).to(DEVICE, dtype)
    assert torch.equal(int4_matmul_triton(x, qweight, qzeros, scales, 32),
                       int4_matmul_reference(x, qweight, qzeros, scales, 32))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_split_sums_add_in_order_and_round_once(dtype):
    """The split-K partials are added in split order (deterministic) and rounded once to the activations' dtype:
    bit for bit what a fixed-order fp32 sum and torch's cast (to nearest even) give."""
    from edgekv.kernels.int4_matmul import SUM_BLOCK, _sum_splits_kernel

    partial = torch.randn(5, 3, 300, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 1e3
    want = partial[0].clone()
    for split in range(1, 5):
        want += partial[split]
    out = torch.empty(3, 300, dtype=dtype, device=DEVICE)
    _sum_splits_kernel[(-(-900 // SUM_BLOCK),)](partial, out, 5, 900, BF16=dtype == torch.bfloat16, BLOCK=SUM_BLOCK)
    assert torch.equal(out, want.to(dtype))


def test_the_k_split_covers_k_and_fills_the_programs():
    for k, tiles, block_k, programs in [(2048, 32, 64, 1056), (11008, 32, 64, 1056), (2048, 172, 64, 1056),
                                        (64, 1, 16, 16), (2048, 2000, 64, 64), (100, 3, 16, 16)]:
        chunk, splits = k_split(k, tiles, block_k, programs)
        assert chunk % block_k == 0 and chunk * (splits - 1) < k <= chunk * splits
        assert tiles * splits <= max(programs, tiles) * 2  # never far past the aim
    assert k_split(2048, 16, 128, 1056) == (128, 16)  # the 3B decode row (128 x 128 tiles): one block a program
    assert k_split(2048, 2000, 64, 64) == (2048, 1)  # enough tiles already: no split


@needs_triton
def test_dispatch_runs_triton_and_leaves_other_groups_to_the_reference(monkeypatch):
    qweight, qzeros, scales = packed(64, 16, 16, seed=3)
    x = torch.randn(2, 64).to(DEVICE)
    assert torch.equal(int4_matmul(x, qweight, qzeros, scales, 16), int4_matmul_triton(x, qweight, qzeros, scales, 16))
    q8, z8, s8 = packed(64, 16, 8, seed=3)  # group 8: not a multiple of 16, the reference serves it
    assert torch.equal(int4_matmul(x, q8, z8, s8, 8), int4_matmul_reference(x, q8, z8, s8, 8))
    with pytest.raises(ValueError, match="multiple of 16"):
        int4_matmul_triton(x, q8, z8, s8, 8)


# ---------------------------------------------------------------------------------------------- GPU, 3B widths
@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 256])
@pytest.mark.parametrize("k,n", [(2048, 2048), (2048, 256), (2048, 11008), (11008, 2048)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_int4_matmul_3b_widths(m, k, n, dtype):
    check(m, k, n, 128, dtype, seed=k + n, sum_order_floor=True)


# ---------------------------------------------------------------------------------------------- Jetson build
@pytest.mark.slow
@pytest.mark.skipif(not triton_available() or INTERPRETED, reason="needs Triton's compiler, not its interpreter")
def test_int4_kernels_compile_for_jetson_orin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a GPU, build every kernel (GEMV, GEMM, the split sum, dequantize) down to a cubin for sm_87 (Jetson
    Orin), for each activation dtype."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction, mangle_type

    launches = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: launches.append((self, args, kw)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m in (1, 17, 256):
            qweight, qzeros, scales = packed(2048, 256, 128, seed=0)
            int4_matmul_triton(torch.zeros(m, 2048, dtype=dtype), qweight.cpu(), qzeros.cpu(), scales.cpu(), 128)
    names = [fn.__name__ for fn, _, _ in launches]
    assert len(launches) == 15 and set(names) == {"_int4_gemv_kernel", "_int4_gemm_kernel", "_sum_splits_kernel",
                                                  "_int4_dequantize_kernel"}, names
    for fn, args, kwargs in launches:
        bound = {**dict(zip(fn.arg_names, args)), **{key: v for key, v in kwargs.items() if key in fn.arg_names}}
        signature, constants = {}, {}
        for param in fn.params:
            value = bound[param.name]
            if param.is_constexpr or (type(value) is int and value == 1):
                signature[param.name], constants[param.name] = "constexpr", value
            else:
                signature[param.name] = mangle_type(value)
        options = {key: v for key, v in kwargs.items() if key not in fn.arg_names}
        compiled = triton.compile(ASTSource(fn, signature, constexprs=constants), target=GPUTarget("cuda", 87, 32),
                                  options=options)
        assert compiled.asm["cubin"], fn.__name__
