"""The split decode-attention kernel (kernels/decode_attention.py) against the eager decode path.

As in ``test_kernels.py``: on CPU the kernel runs in Triton's interpreter (this module runs again in a subprocess
with ``TRITON_INTERPRET=1``: ``helpers_interpreter.py``), on CUDA compiled; ``gpu`` tests at the 3B shape.
Tolerance (flash-attention's rule, as the other kernels): max |kernel - fp64 reference| <= 2 x max |same-precision
eager run - fp64 reference| + two fp32 ulps of the largest reference value, or, where larger, one ulp of the
output dtype at the largest reference value: the kernel computes in fp32 and rounds once, which a lucky
same-precision run can undercut by half an ulp. Slots past the visible count hold NaN: a kernel that reads one
fails.
"""

from __future__ import annotations

import pytest
import torch

from edgekv.kernels import triton_available
from edgekv.kernels._triton import interpreting
from edgekv.kernels.decode_attention import decode_attention_reference, decode_attention_triton, split_size
from helpers_interpreter import interpreted_run

INTERPRETED = interpreting()
CUDA = torch.cuda.is_available() and not INTERPRETED
DEVICE = torch.device("cuda" if CUDA else "cpu")
RUN_HERE = triton_available() and (CUDA or INTERPRETED)
needs_triton = pytest.mark.skipif(not RUN_HERE, reason="runs in test_decode_attention_in_triton_interpreter's subprocess")
requires_cuda = pytest.mark.skipif(not (CUDA and triton_available()), reason="needs CUDA and triton")


@pytest.mark.slow
@pytest.mark.skipif(RUN_HERE or not triton_available(), reason="the kernel runs in this process")
def test_decode_attention_in_triton_interpreter(request: pytest.FixtureRequest) -> None:
    run = interpreted_run(request.config.rootpath, request.config.getoption("markexpr"))
    outcomes = run.outcomes(__file__)
    assert run.returncode in (0, 1) and outcomes.get("passed") and not outcomes.keys() & {"failed", "error"}, \
        f"interpreter run failed ({outcomes.get('failed', [])} {outcomes.get('error', [])}):\n{run.output[-16000:]}"


def inputs(heads_q, heads_kv, dim, slots, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(heads_q, 1, dim, generator=gen)
    k = torch.randn(heads_kv, slots, dim, generator=gen) * 2
    v = torch.randn(heads_kv, slots, dim, generator=gen)
    k[:, n:], v[:, n:] = float("nan"), float("nan")  # never visible: a read of one poisons the output
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def check(q, k, v, n):
    got = decode_attention_triton(q, k, v, torch.tensor([n], device=q.device))
    assert got.shape == q.shape and got.dtype == q.dtype and torch.isfinite(got).all()
    want = decode_attention_reference(q.double(), k.double(), v.double(), n)
    same = decode_attention_reference(q, k, v, n)
    err = float((got.double() - want).abs().max())
    base = float((same.double() - want).abs().max())
    floor = 2 * torch.finfo(torch.float32).eps * float(want.abs().max())
    rounding = torch.finfo(q.dtype).eps * float(want.abs().max())  # the one rounding of the fp32 result to q's dtype
    assert err <= max(2 * base, rounding) + floor, f"n={n} {q.dtype}: {err:.3g} > 2 x {base:.3g} + {floor:.2g}"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv,dim,slots", [(8, 2, 32, 160), (6, 1, 16, 300), (4, 4, 24, 70)])
def test_decode_attention_matches_the_eager_path(dtype, heads_q, heads_kv, dim, slots):
    for n in sorted({1, 37, slots // 2 + 1, slots}):
        check(*inputs(heads_q, heads_kv, dim, slots, n, dtype, seed=n + slots), n)


@needs_triton
def test_the_split_covers_every_slot_and_takes_strided_cache_layers():
    assert split_size(6144, 2) == 64 and split_size(100, 1) == 64 and split_size(10**6, 2) % 64 == 0
    # a layer of the [L, Hkv, M, D] cache buffer, as the decode graph passes it
    gen = torch.Generator().manual_seed(1)
    buffer = torch.randn(3, 2, 200, 32, generator=gen).to(DEVICE)
    q = torch.randn(8, 1, 32, generator=gen).to(DEVICE)
    got = decode_attention_triton(q, buffer[1], buffer[2], torch.tensor([150], device=DEVICE))
    want = decode_attention_reference(q.double(), buffer[1].double(), buffer[2].double(), 150)
    assert torch.allclose(got.double(), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one query token"):
        decode_attention_triton(torch.zeros(8, 2, 32, device=DEVICE), buffer[1], buffer[2], torch.tensor([1]))


@needs_triton
def test_the_decode_graph_step_through_the_kernel_is_the_eager_decode():
    from test_decode_graph import eager_steps, filled_cache, graph_steps, language_model

    from edgekv.session.decode_graph import DecodeGraph

    model = language_model(torch.float32, str(DEVICE))
    eager_cache, graph_cache = filled_cache(model, 96, 21, str(DEVICE)), filled_cache(model, 96, 21, str(DEVICE))
    want_tokens, want = eager_steps(model, eager_cache, 7, 30, 6)
    graph = DecodeGraph(model, graph_cache, capture=CUDA)
    assert graph.split_attention
    got_tokens, got = graph_steps(graph, 7, 30, 6)
    assert got_tokens == want_tokens
    assert (got - want).abs().max() <= 2e-5 * want.abs().max()


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("n", [1, 3001, 6144])
def test_gpu_decode_attention_3b(n):
    check(*inputs(16, 2, 128, 6144, n, torch.bfloat16, seed=n), n)


@pytest.mark.gpu
@requires_cuda
def test_gpu_decode_attention_replays_in_a_cuda_graph_at_any_length():
    q, k, v = inputs(16, 2, 128, 6144, 6144, torch.bfloat16, seed=3)
    n = torch.tensor([100], device=DEVICE)
    decode_attention_triton(q, k, v, n)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q, k, v, n)
    for length in (100, 4097, 6144):
        n.fill_(length)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.allclose(out.float(), decode_attention_reference(q, k, v, length).float(), atol=2e-2, rtol=2e-2)
