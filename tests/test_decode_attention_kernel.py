"""The decode step's Triton kernels against the eager decode path: the split attention
(kernels/decode_attention.py) and the fused small work between the products (kernels/decode_fused.py).

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
import torch.nn.functional as F

from edgekv.kernels import triton_available
from edgekv.kernels._triton import interpreting
from edgekv.kernels.decode_attention import decode_attention_reference, decode_attention_triton, dot_precision, split_size
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


def quantized_randomly(model, layers: tuple[int, ...], group: int = 16, seed: int = 3):
    """Every projection of ``layers`` as an ``Int4Linear`` of random 4-bit integers (biases kept)."""
    from edgekv.model.int4 import Int4Linear

    gen = torch.Generator().manual_seed(seed)
    for layer in (model.layers[index] for index in layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if type(child) is not torch.nn.Linear:
                    continue
                k, n = child.in_features, child.out_features
                q = torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8)
                zeros = torch.randint(6, 10, (k // group, n), generator=gen, dtype=torch.uint8)
                scales = (torch.rand(k // group, n, generator=gen) * 0.04 + 0.02).half()
                bias = None if child.bias is None else child.bias.detach()
                module = Int4Linear.from_integers(q, zeros, scales, bias=bias)
                setattr(parent, name, module.to(child.weight.device))
    return model


@needs_triton
def test_the_fused_step_takes_4_bit_projections():
    """A model with a 4-bit layer (Int4Linear projections: the Triton 4-bit GEMV) beside dense ones runs the fused
    decode step — the 4-bit layer's products are its own, the dense layers' packed — and decodes as the eager path
    does. (One 4-bit layer of three: the 4-bit products are slow in the interpreter.)"""
    from test_decode_graph import eager_steps, filled_cache, graph_steps, language_model

    from edgekv.session.decode_graph import DecodeGraph, fusable

    model, tol = quantized_randomly(language_model(torch.bfloat16, str(DEVICE)), layers=(1,)), 0.05  # bf16 as shipped
    eager_cache, graph_cache = filled_cache(model, 96, 21, str(DEVICE)), filled_cache(model, 96, 21, str(DEVICE))
    assert fusable(model, graph_cache) is None
    want_tokens, want = eager_steps(model, eager_cache, 7, 30, 3)
    graph = DecodeGraph(model, graph_cache, capture=CUDA)
    assert graph.fused and not hasattr(model.layers[1].self_attn, "qkv_weight")
    assert not hasattr(model.layers[1].mlp, "gate_up_weight") and hasattr(model.layers[0].mlp, "gate_up_weight")
    got_tokens, got = graph_steps(graph, 7, 30, 3)
    assert got_tokens == want_tokens
    assert (got - want).abs().max() <= tol * want.abs().max()


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv,dim,slots", [(8, 2, 32, 160), (6, 1, 16, 300), (4, 4, 24, 70)])
def test_decode_attention_matches_the_eager_path(dtype, heads_q, heads_kv, dim, slots):
    for n in sorted({1, 37, slots // 2 + 1, slots}):
        check(*inputs(heads_q, heads_kv, dim, slots, n, dtype, seed=n + slots), n)


def test_compiled_products_use_tensor_cores_for_16_bit_caches_only(monkeypatch):
    """fp32 ``ieee`` tl.dot ran the split kernel at 146 us a 3B layer on an H200, tf32 at 8.4 us (issue 32):
    16-bit caches take tf32 (their elements are tf32 numbers), fp32 caches keep ieee, the interpreter ieee."""
    import edgekv.kernels.decode_attention as module

    monkeypatch.setattr(module, "interpreting", lambda: False)
    assert [dot_precision(t) for t in (torch.bfloat16, torch.float16, torch.float32)] == ["tf32", "tf32", "ieee"]
    monkeypatch.setattr(module, "interpreting", lambda: True)
    assert dot_precision(torch.bfloat16) == "ieee"


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
@pytest.mark.parametrize("fused", [False, True], ids=["layers", "fused"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.05)], ids=["fp32", "bf16"])
def test_the_decode_graph_step_through_the_kernels_is_the_eager_decode(fused, dtype, tol):
    from test_decode_graph import eager_steps, filled_cache, graph_steps, language_model

    from edgekv.session.decode_graph import DecodeGraph

    model = language_model(dtype, str(DEVICE))
    eager_cache, graph_cache = filled_cache(model, 96, 21, str(DEVICE)), filled_cache(model, 96, 21, str(DEVICE))
    want_tokens, want = eager_steps(model, eager_cache, 7, 30, 6)
    graph = DecodeGraph(model, graph_cache, capture=CUDA, fused=fused)
    assert graph.split_attention and graph.fused == fused
    got_tokens, got = graph_steps(graph, 7, 30, 6)
    assert got_tokens == want_tokens
    assert (got - want).abs().max() <= tol * want.abs().max()
    end = graph_cache.length
    assert torch.allclose(graph_cache.k[:, :, :end].float(), eager_cache.k[:, :, :end].float(), atol=tol, rtol=tol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_fused_small_work_rounds_as_torch(dtype):
    """bf16 / fp16: every rounding where torch's eager ops round, so the same bits (the norm's mean may differ in
    its last fp32 bit: one ulp where that moves a tie); fp32: within a few ulps (the kernels' exp and rsqrt)."""
    import torch.nn.functional as F

    from edgekv.kernels.decode_fused import add_rms_norm, rope_write, silu_mul
    from edgekv.model.language import RMSNorm
    from edgekv.model.rope import apply_rotary

    gen = torch.Generator().manual_seed(9)
    exact = dtype != torch.float32

    def close(got, want):
        if exact:
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
            return bool(((got.float() - want.float()).abs() <= ulp).all()) and (got != want).float().mean() < 0.02
        return torch.allclose(got, want, rtol=4e-6, atol=1e-6)

    x = (torch.randn(1, 300, generator=gen) * 3).to(DEVICE, dtype)
    delta = torch.randn(1, 300, generator=gen).to(DEVICE, dtype)
    norm = RMSNorm(300, 1e-6).to(DEVICE)
    norm.weight.data = (1 + 0.1 * torch.randn(300, generator=gen)).to(DEVICE, dtype)
    summed, h = add_rms_norm(x, delta, norm.weight, 1e-6)
    assert torch.equal(summed, x + delta) and close(h, norm(x + delta))
    same, h_only = add_rms_norm(x, None, norm.weight, 1e-6)
    assert same is x and close(h_only, norm(x))
    gate, up = (torch.randn(2, 1, 700, generator=gen) * 3).to(DEVICE, dtype)
    assert close(silu_mul(gate, up), F.silu(gate) * up)
    heads_q, heads_kv, dim, slots = 8, 2, 32, 40
    q, k, v = (torch.randn(3, heads_q * dim, generator=gen)).to(DEVICE, dtype)[:, : heads_q * dim]
    k, v = k[: heads_kv * dim], v[: heads_kv * dim]
    angle = torch.arange(dim // 2, dtype=torch.float32) * 1.7
    angle = torch.cat([angle, angle])
    cos, sin = angle.cos().to(DEVICE, dtype), angle.sin().to(DEVICE, dtype)
    cache_k = torch.zeros(3, heads_kv, slots, dim, dtype=dtype, device=DEVICE)
    cache_v = torch.zeros_like(cache_k)
    rotated = rope_write(q, k, v, cos, sin, cache_k[1], cache_v[1], torch.tensor([17], device=DEVICE))
    assert torch.equal(rotated, apply_rotary(q.view(heads_q, 1, dim), cos[None], sin[None]))
    assert torch.equal(cache_k[1, :, 17], apply_rotary(k.view(heads_kv, 1, dim), cos[None], sin[None])[:, 0])
    assert torch.equal(cache_v[1, :, 17], v.view(heads_kv, dim))
    written = cache_k.abs().sum(-1) != 0
    assert int(written.sum()) == heads_kv and bool(written[1, :, 17].all())  # nothing else written


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_the_chunk_kernels_round_as_torch(dtype):
    """rope_rows (q and k rotated as apply_rotary rounds, v laid out): the eager ops' bits; silu_mul_rows (the
    halves of a packed gate|up output) as silu_mul: one ulp of the dtype where a tie moves, a few fp32 ulps."""
    from edgekv.kernels.decode_fused import rope_rows, silu_mul_rows
    from edgekv.model.rope import apply_rotary

    gen = torch.Generator().manual_seed(5)
    rows, heads_q, heads_kv, dim = 7, 4, 2, 16
    qkv = (torch.randn(rows, (heads_q + 2 * heads_kv) * dim, generator=gen) * 3).to(DEVICE, dtype)
    angle = torch.rand(rows, dim // 2, generator=gen) * 50
    cos, sin = torch.cat((angle, angle), -1).cos().to(DEVICE, dtype), torch.cat((angle, angle), -1).sin().to(DEVICE, dtype)
    q, k, v = rope_rows(qkv, heads_q, heads_kv, cos, sin)
    heads = qkv.view(rows, heads_q + 2 * heads_kv, dim).transpose(0, 1)
    assert torch.equal(q, apply_rotary(heads[:heads_q], cos, sin))
    assert torch.equal(k, apply_rotary(heads[heads_q:heads_q + heads_kv], cos, sin))
    assert torch.equal(v, heads[heads_q + heads_kv:]) and q.is_contiguous() and v.is_contiguous()
    gate_up = (torch.randn(rows, 2 * 40, generator=gen) * 4).to(DEVICE, dtype)
    got, want = silu_mul_rows(gate_up[:, :40], gate_up[:, 40:]), F.silu(gate_up[:, :40]) * gate_up[:, 40:]
    assert got.is_contiguous() and got.shape == want.shape
    if dtype == torch.float32:  # the kernel's exp against torch's
        assert torch.allclose(got, want, rtol=4e-6, atol=1e-6)
    else:
        ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
        assert bool(((got.float() - want.float()).abs() <= ulp).all()) and (got != want).float().mean() < 0.02
    with pytest.raises(ValueError, match="rope_rows takes"):
        rope_rows(qkv[:, :-dim], heads_q, heads_kv, cos, sin)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.05)], ids=["fp32", "bf16"])
def test_a_chunk_through_the_fused_layers_is_the_eager_chunk(dtype, tol, monkeypatch):
    """``model.prefill_route: fused``: a prompt's chunk through the layers' fused small work gives the eager
    layers' hidden states (within the one-ulp RMSNorm differences) and the same greedy token; a training batch
    (3-D) still runs the layers' own forward."""
    from test_decode_graph import language_model

    from edgekv.model.language import dense_causal_attend
    from edgekv.model.prefill_fused import FusedChunkLayer, prepare_prefill
    from edgekv.model.rope import text_position_ids

    model = language_model(dtype, str(DEVICE))
    ids = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6, 5], device=DEVICE)
    positions = text_position_ids(0, ids.numel()).to(DEVICE)
    with torch.inference_mode():
        want = model(model.embed_tokens(ids), positions, dense_causal_attend)
    assert prepare_prefill(model, "fused") == 3 and isinstance(model.layers[0].fused, FusedChunkLayer)
    import edgekv.model.prefill_fused as fused_kernels  # where the fused layer looks the kernel up

    calls = []
    rope_rows = fused_kernels.rope_rows
    monkeypatch.setattr(fused_kernels, "rope_rows", lambda *a: calls.append(1) or rope_rows(*a))
    with torch.inference_mode():
        got = model(model.embed_tokens(ids), positions, dense_causal_attend)
        assert torch.equal(model.logits(got[-1:]).argmax(), model.logits(want[-1:]).argmax())
    assert (got - want).abs().max() <= tol * want.abs().max() and len(calls) == 3  # every layer fused
    layer = model.layers[0]
    batch = torch.zeros(2, 3, model.config.hidden_size, dtype=dtype, device=DEVICE)
    assert layer.fused(layer, batch, None, None, 0, None) is None  # not its shape: the layer's own forward


@needs_triton
def test_a_chunk_through_a_fused_4_bit_layer_is_the_eager_chunk(monkeypatch):
    """A 4-bit layer (Int4Linear projections) takes the fused chunk route with its own products (the Triton 4-bit
    GEMM), beside dense layers with packed ones."""
    from test_decode_graph import language_model

    from edgekv.model.language import dense_causal_attend
    from edgekv.model.prefill_fused import prepare_prefill
    from edgekv.model.rope import text_position_ids

    import edgekv.model.prefill_fused as fused_kernels  # where the fused layer looks the kernel up

    calls = []
    rope_rows = fused_kernels.rope_rows
    monkeypatch.setattr(fused_kernels, "rope_rows", lambda *a: calls.append(1) or rope_rows(*a))
    model = quantized_randomly(language_model(torch.bfloat16, str(DEVICE)), layers=(2,))
    ids = torch.tensor([3, 1, 4, 1, 5, 9], device=DEVICE)
    positions = text_position_ids(0, ids.numel()).to(DEVICE)
    with torch.inference_mode():
        want = model(model.embed_tokens(ids), positions, dense_causal_attend)
        assert prepare_prefill(model, "fused") == 3 and not hasattr(model.layers[2].self_attn, "qkv_weight")
        got = model(model.embed_tokens(ids), positions, dense_causal_attend)
        assert torch.equal(model.logits(got[-1:]).argmax(), model.logits(want[-1:]).argmax())
    assert (got - want).abs().max() <= 0.05 * want.abs().max() and len(calls) == 3  # the 4-bit layer fused too


def test_fusable_names_what_it_cannot_fuse():
    from test_decode_graph import filled_cache, language_model

    from edgekv.model.decode_routes import quantize_lm_head  # noqa: F401 - the routes a layer may carry
    from edgekv.session.decode_graph import DecodeGraph, fusable

    model = language_model(torch.float32, "cpu")
    cache = filled_cache(model, 32, 4, "cpu")
    assert fusable(model, cache) is None
    model.layers[1].mlp.up_proj = torch.nn.Sequential(model.layers[1].mlp.up_proj)
    assert "layer 1" in fusable(model, cache)
    with pytest.raises(ValueError, match="fused decode step"):
        DecodeGraph(model, cache, capture=False, split_attention=True, fused=True)


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
