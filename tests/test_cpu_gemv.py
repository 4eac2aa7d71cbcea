"""The C bf16 matrix-vector kernel for decode (kernels/cpu_gemv.c) and the ``native`` decode route.

Tolerance (STYLE: kernel tolerance): the kernel's fp32 sum differs from torch's fp32 product of the same
bf16 values only in summation order, so its bf16 output is within one bf16 unit (2^-8 relative) of the
reference's; the model's logits through the route are within a few bf16 units of torch's bf16 kernels.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgekv.config import ConfigError
from edgekv.kernels import cpu_gemv
from edgekv.model.decode_routes import NativeDecodeLinear, prepare_decode, resolve_route

needs_kernel = pytest.mark.skipif(cpu_gemv.load() is None,
                                  reason=f"the C kernel cannot be built here: {cpu_gemv.unavailable_reason()}")


def within_one_unit(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -8 + 1e-30).all())


@needs_kernel
@pytest.mark.parametrize("n,k", [(1, 1), (3, 7), (4, 16), (5, 17), (130, 33), (257, 1000), (2048, 2048)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_fp32_reference_within_one_bf16_unit(n, k, threads, with_bias):
    gen = torch.Generator().manual_seed(n * 7 + k)
    weight = torch.randn(n, k, generator=gen).bfloat16()
    x = torch.randn(k, generator=gen).bfloat16()
    bias = torch.randn(n, generator=gen).bfloat16() if with_bias else None
    got = cpu_gemv.gemv_bf16(weight, x, bias, threads=threads)
    want = cpu_gemv.gemv_bf16_reference(weight, x, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (n,)
    assert within_one_unit(got, want)


@needs_kernel
def test_kernel_rounds_to_nearest_even_and_keeps_nan_and_inf():
    # one-column products: the output is the fp32 product rounded once, exactly as torch rounds it
    weight = torch.tensor([[1.0], [3.0], [float("inf")], [float("nan")], [-2.5]]).bfloat16()
    x = torch.tensor([1.0 + 2 ** -7]).bfloat16()
    got = cpu_gemv.gemv_bf16(weight, x)
    want = (weight.float() @ x.float()).bfloat16()
    assert torch.equal(got[:3], want[:3]) and torch.equal(got[4:], want[4:])
    assert torch.isnan(got[3])


@needs_kernel
def test_kernel_refuses_what_it_cannot_read():
    weight = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 weight"):
        cpu_gemv.gemv_bf16(weight.float(), torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="vector of K"):
        cpu_gemv.gemv_bf16(weight, torch.zeros(7, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        cpu_gemv.gemv_bf16(torch.zeros(8, 4, dtype=torch.bfloat16).t(), torch.zeros(8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bias of 4"):
        cpu_gemv.gemv_bf16(weight, torch.zeros(8, dtype=torch.bfloat16), torch.zeros(3, dtype=torch.bfloat16))


@needs_kernel
def test_native_linear_takes_one_row_and_leaves_the_rest_to_torch():
    torch.manual_seed(0)
    linear = nn.Linear(48, 40).bfloat16()
    native = NativeDecodeLinear(linear)
    assert native.weight is linear.weight and native.bias is linear.bias
    with torch.inference_mode():
        one = torch.randn(1, 48).bfloat16()
        want = cpu_gemv.gemv_bf16_reference(linear.weight, one, linear.bias)
        assert within_one_unit(native(one)[0], want)
        rows = torch.randn(5, 48).bfloat16()
        assert torch.equal(native(rows), linear(rows))  # a prefill chunk: torch's kernel, bit for bit
    # with autograd the product stays on torch (the C kernel has no backward)
    out = native(torch.randn(1, 48).bfloat16())
    assert out.requires_grad


def test_resolve_route_explains_what_native_cannot_serve():
    assert resolve_route("eager", torch.bfloat16, "cpu") == ("eager", None)
    route, note = resolve_route("auto", torch.float32, "cpu")
    assert route == "eager" and "bf16 only" in note
    with pytest.raises(ValueError, match="decode_route: native: .*bf16 only"):
        resolve_route("native", torch.float16, "cpu")
    with pytest.raises(ValueError, match="unknown route 'fast'"):
        resolve_route("fast", torch.bfloat16, "cpu")


def test_auto_falls_back_to_torch_without_the_kernel(monkeypatch):
    monkeypatch.setattr(cpu_gemv, "_state", {"lib": None, "reason": "no C compiler: 'cc' is not on PATH"})
    assert resolve_route("auto", torch.bfloat16, "cpu") == ("eager", "no C compiler: 'cc' is not on PATH")
    with pytest.raises(ValueError, match="not on PATH"):
        resolve_route("native", torch.bfloat16, "cpu")


@needs_kernel
def test_runtime_decodes_through_the_native_route_with_torch_s_answers(tiny_checkpoint, monkeypatch):
    """bf16 on CPU: ``auto`` picks the native route; ingest is bit-identical to the eager route (prefill
    chunks stay on torch), a decode step's logits agree within a few bf16 units, and ``ask`` decodes
    through the kernel."""
    from edgekv.model.rope import text_position_ids
    from edgekv.runtime import Runtime
    from edgekv.video.events import Event, EventScene

    calls = []
    kernel = cpu_gemv.gemv_bf16
    monkeypatch.setattr(cpu_gemv, "gemv_bf16", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    scene = EventScene(seed=3, events=[Event("circle", "red", 1, 1, (50, 60), 14)])
    runs = {}
    for route in ("auto", "eager"):
        runtime = Runtime.from_pretrained(tiny_checkpoint, model={"dtype": "bf16", "device": "cpu", "decode_route": route},
                                          cache={"policy": "full", "max_tokens": 512, "text_reserve_tokens": 64},
                                          video={"fps": 2.0, "resolution": [112, 112]})
        session = runtime.session()
        for index in range(6):
            session.ingest(scene.frame(index), t=scene.time(index))
        assert not calls  # ingest: prefill chunks of many rows, torch's kernel
        llm, cache = runtime.llm_backend, session.cache
        with torch.inference_mode():
            steps = []
            for step, token in enumerate((5, 17, 3)):
                hidden = llm.prefill(llm.embed(torch.tensor([token])), text_position_ids(400 + step, 1), cache)
                cache.commit(1)
                steps.append(llm.logits(hidden[-1]).float())
        runs[route] = (runtime, cache.keys().clone(), torch.stack(steps), len(calls))
        if route == "auto":
            calls.clear()
            reply = session.ask("What color was the circle?", max_new_tokens=3)
            assert reply.text is not None and calls  # the answer's tokens went through the kernel
            calls.clear()
    native_rt, native_keys, native_logits, native_calls = runs["auto"]
    eager_rt, eager_keys, eager_logits, eager_calls = runs["eager"]
    assert native_rt.decode_route == "native" and eager_rt.decode_route == "eager"
    layers = native_rt.model.config.text.num_hidden_layers
    assert native_calls == 3 * (7 * layers + 1) and eager_calls == 0
    assert isinstance(native_rt.model.language.layers[0].self_attn.q_proj, NativeDecodeLinear)
    assert native_rt.model.language.lm_head.weight is native_rt.model.language.embed_tokens.weight
    cached = native_keys.shape[-2] - 3  # the video and prefix: ingested by torch in both runs
    assert torch.equal(native_keys[..., :cached, :], eager_keys[..., :cached, :])
    scale = eager_logits.abs().max()
    assert (native_logits - eager_logits).abs().max() <= 4 * 2 ** -8 * scale


def test_runtime_refuses_native_for_an_fp32_model(tiny_checkpoint):
    from edgekv.runtime import Runtime

    with pytest.raises(ConfigError, match="model.decode_route: native: .*bf16 only"):
        Runtime.from_pretrained(tiny_checkpoint, model={"dtype": "fp32", "device": "cpu", "decode_route": "native"})


@needs_kernel
def test_prepare_decode_is_idempotent_and_reports_what_it_did(tiny_checkpoint):
    from edgekv.model import load_pretrained

    model = load_pretrained(tiny_checkpoint, dtype=torch.bfloat16, skip=("visual",))
    first = prepare_decode(model.language, "native")
    second = prepare_decode(model.language, "native")
    layers = model.config.text.num_hidden_layers
    assert first["linears"] == 7 * layers + 1 and second["linears"] == 0
