"""The glue of a CPU decode step in C (kernels/cpu_gemv.c, issue 29): Qwen2's RMSNorm, the rotary of q and k,
and a whole 4-bit decoder layer with bf16 activations in two calls around its attention (``Int4Layer``, used by
the native route through ``decode_routes.FusedInt4Layer``). Each is checked against the torch code it replaces:
the rotary bit for bit; the norm (whose mean C sums in double, torch in fp32 partial sums) equal in bf16 on these
inputs and within a few ulps in fp32; the fused layer against the same layer unfused with the C norm (bit for bit)
and with torch's (within rounding ties)."""

from __future__ import annotations

import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from edgekv.kernels import cpu_gemv
from edgekv.model.decode_routes import FusedInt4Layer, prepare_decode
from edgekv.model.language import DenseKVCache, RMSNorm
from edgekv.model.rope import apply_rotary, text_position_ids

pytestmark = pytest.mark.skipif(cpu_gemv.load() is None,
                                reason=f"the C kernel cannot be built here: {cpu_gemv.unavailable_reason()}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("width", [64, 2048])
def test_rms_norm_is_transformers_norm(dtype, width):
    norm = RMSNorm(width, 1e-6).to(dtype)
    generator = torch.Generator().manual_seed(width)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(width, generator=generator) * 0.3 + 1)
    for scale in (1e-3, 1.0, 50.0):
        x = (torch.randn(5, width, generator=generator) * scale).to(dtype)
        want = norm(x).detach()
        got = cpu_gemv.rms_norm(x, norm.weight.detach(), norm.eps)
        assert got.dtype == dtype and got.shape == x.shape
        # the mean's last bit may differ (another summation order): in bf16 that moves a value only on a rounding
        # tie, by one ulp; in fp32 by a few ulps
        ulps = 2 if dtype is torch.bfloat16 else 4
        eps = torch.finfo(dtype).eps
        assert ((got.float() - want.float()).abs() <= ulps * eps * want.float().abs()).all()
        assert (got != want).float().mean() < (0.01 if dtype is torch.bfloat16 else 0.5)
    rows3 = torch.randn(2, 3, width, generator=generator).to(dtype)  # leading dims are rows
    assert torch.equal(cpu_gemv.rms_norm(rows3, norm.weight.detach(), norm.eps).view(6, width),
                       cpu_gemv.rms_norm(rows3.view(6, width), norm.weight.detach(), norm.eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,rows,hd", [(4, 1, 16), (2, 5, 128), (3, 7, 8)])
def test_rotary_is_apply_rotary_bit_for_bit(dtype, heads, rows, hd):
    generator = torch.Generator().manual_seed(heads * 100 + rows)
    x = (torch.randn(rows, heads, hd, generator=generator) * 3).to(dtype).transpose(0, 1)  # the projection's layout
    angle = torch.rand(rows, hd // 2, generator=generator) * 200
    angle = torch.cat((angle, angle), dim=-1)
    cos, sin = angle.cos().to(dtype), angle.sin().to(dtype)
    want = apply_rotary(x, cos, sin)
    got = x.clone()  # a contiguous copy: other strides than x's
    assert cpu_gemv.rotary_(got, cos, sin) is got and torch.equal(got, want)
    assert torch.equal(cpu_gemv.rotary_(x, cos, sin), want)  # in place on the transposed view


def test_glue_refuses_what_it_cannot_take():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_gemv.rms_norm(x.half(), torch.ones(8).half(), 1e-6)
    with pytest.raises(ValueError, match="rms_norm"):
        cpu_gemv.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(ValueError, match="rotary_"):
        cpu_gemv.rotary_(torch.randn(2, 3, 7), torch.randn(3, 7), torch.randn(3, 7))  # odd head_dim
    with pytest.raises(ValueError, match="rotary_"):
        cpu_gemv.rotary_(torch.randn(2, 3, 8), torch.randn(3, 8).bfloat16(), torch.randn(3, 8))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    from edgekv.calibration.quantize import quantize_checkpoint
    from edgekv.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("fused")
    dense = make_tiny_checkpoint(root / "dense", preset="test-gqa4", seed=8)
    return quantize_checkpoint(dense, root / "q4", group_size=32)


def _states(model, x, fused: bool, split: int = 12) -> torch.Tensor:
    """A chunk of ``split`` rows, then one row at a time (decode), through a dense cache: the final hidden states."""
    language = model.language
    kept = [layer.fused for layer in language.layers]
    if not fused:
        for layer in language.layers:
            layer.fused = None
    try:
        cache = DenseKVCache(model.config.text, x.shape[0], torch.bfloat16)
        outs = []
        with torch.inference_mode():
            outs.append(language(x[:split], text_position_ids(0, split), cache))
            cache.commit()
            for i in range(split, x.shape[0]):
                outs.append(language(x[i:i + 1], text_position_ids(i, 1), cache))
                cache.commit()
        return torch.cat(outs)
    finally:
        for layer, f in zip(language.layers, kept):
            layer.fused = f


def test_fused_layers_compute_what_the_unfused_native_route_does(quantized, monkeypatch):
    from edgekv.model import load_pretrained

    model = load_pretrained(quantized, dtype=torch.bfloat16)
    info = prepare_decode(model.language, "native")
    layers = model.language.layers
    assert info["fused_layers"] == len(layers) == 2 and all(isinstance(layer.fused, FusedInt4Layer) for layer in layers)
    x = torch.randn(20, model.config.text.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    fused, unfused = _states(model, x, True), _states(model, x, False)
    # The same products and roundings; the norm's mean is summed in double in C, in fp32 partial sums by torch,
    # and SiLU's exp is libm's: last-bit differences that move a bf16 value only on a rounding tie.
    assert torch.allclose(fused.float(), unfused.float(), rtol=2 ** -6, atol=2 ** -6 * unfused.float().abs().max())
    # With the C norm in the layer as written, the two are the same arithmetic: equal (SiLU ties aside, none here)
    norms = [m for layer in layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    for norm in norms:
        monkeypatch.setattr(norm, "forward", lambda v, norm=norm: cpu_gemv.rms_norm(v, norm.weight, norm.eps))
    assert torch.equal(_states(model, x, False), fused)
    ids = torch.randint(0, 4000, (10,), generator=torch.Generator().manual_seed(0))
    tokens = model.generate(ids[None], max_new_tokens=6, stop_ids=[])
    for layer in layers:
        layer.fused = None
    assert model.generate(ids[None], max_new_tokens=6, stop_ids=[]) == tokens


def test_fused_layer_steps_aside_where_it_does_not_apply(quantized):
    from edgekv.model import load_pretrained

    model = load_pretrained(quantized, dtype=torch.bfloat16)
    prepare_decode(model.language, "native")
    layer = model.language.layers[0]
    d, hd = model.config.text.hidden_size, model.config.text.head_dim
    calls = []

    def attend(index, q, k, v):
        calls.append(index)
        return torch.zeros(q.shape, dtype=q.dtype)

    cos, sin = torch.ones(1, hd).bfloat16(), torch.zeros(1, hd).bfloat16()
    with torch.inference_mode():
        long = torch.randn(129, d).bfloat16()  # longer than the row kernel takes: the layer as written
        assert layer.fused(layer, long, cos.expand(129, hd), sin.expand(129, hd), 0, attend) is None
        assert layer.fused(layer, torch.randn(1, d), cos.float(), sin.float(), 0, attend) is None  # fp32
        nan = torch.full((1, d), float("nan")).bfloat16()
        assert layer.fused(layer, nan, cos, sin, 0, attend) is None and not calls  # before the attention
        out = layer.fused(layer, torch.randn(1, d).bfloat16(), cos, sin, 0,
                          lambda i, q, k, v: torch.full(q.shape, float("nan"), dtype=q.dtype))
        assert out.shape == (1, d) and out.isnan().all()  # after it: the rest in torch, nan propagated
    x = torch.randn(1, d, requires_grad=True).bfloat16()
    assert layer.fused(layer, x, cos, sin, 0, attend) is None  # autograd on


def test_fused_layer_follows_a_move_of_the_model(quantized):
    from edgekv.model import load_pretrained

    model = load_pretrained(quantized, dtype=torch.bfloat16)
    prepare_decode(model.language, "native")
    layer = model.language.layers[0]
    x = torch.randn(14, model.config.text.hidden_size, generator=torch.Generator().manual_seed(2)).bfloat16()
    before = _states(model, x, True)
    kernel = layer.fused._kernel
    model.to("cpu")  # a move may replace the products' buffers: the fused kernels are made again over them
    assert torch.equal(_states(model, x, True), before) and layer.fused._kernel is not kernel
    norm = layer.input_layernorm.weight
    norm.data = norm.data.float()  # a norm weight no longer bf16: that layer steps aside
    hd = model.config.text.head_dim
    with torch.inference_mode():
        assert layer.fused(layer, x[:1], torch.ones(1, hd).bfloat16(), torch.zeros(1, hd).bfloat16(), 0, None) is None


def test_a_4bit_toy_session_in_bf16_answers_the_same_with_and_without_fusing(tmp_path):
    """The runtime end to end: the toy quantized to 4 bits, bf16, the native route (fused layers), a capped cache:
    frame pairs ingested in chunks and questions answered token by token — the same text as the layers unfused."""
    from edgekv.calibration.quantize import quantize_checkpoint
    from edgekv.eval.toy_accuracy import heldout_streams
    from edgekv.model.builtin import resolve_model_path
    from edgekv.runtime import Runtime

    q4 = quantize_checkpoint(resolve_model_path("builtin:toy"), tmp_path / "toy-q4", group_size=16)
    runtime = Runtime.from_pretrained(str(q4), model={"dtype": "bf16", "device": "cpu", "decode_route": "native"},
                                      cache={"policy": "infinipot_v", "max_tokens": 96, "text_reserve_tokens": 32},
                                      video={"fps": 2.0, "resolution": [112, 112]})
    layers = runtime.model.language.layers
    assert all(isinstance(layer.fused, FusedInt4Layer) for layer in layers)
    stream = heldout_streams(1)[0]

    def answers() -> list[str]:
        session = runtime.session()
        for frame in range(2 * stream.pairs):
            session.ingest(stream.scene.frame(frame), t=stream.scene.time(frame))
        return [session.ask(qa.question, max_new_tokens=3).text for qa in stream.questions]

    fused = answers()
    assert all(layer.fused._kernel is not None for layer in layers)  # the fused path did run
    kept = [layer.fused for layer in layers]
    for layer in layers:
        layer.fused = None
    try:
        assert answers() == fused
    finally:
        for layer, f in zip(layers, kept):
            layer.fused = f


CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


def _random_product(n: int, k: int, group: int, bias: bool, generator: torch.Generator):
    q = torch.randint(0, 16, (k, n), generator=generator, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(k // group, n, generator=generator) * 0.02 + 1e-3).half()
    b = torch.randn(n, generator=generator).bfloat16() if bias else None
    return cpu_gemv.Int4Product(cpu_gemv.int4_tiles(q), scales, zeros, b)


def _random_layer(d: int, hq: int, hkv: int, hd: int, inner: int, group: int, generator: torch.Generator):
    """A random 4-bit decoder layer (biased q/k/v, as Qwen2's): the kernel, its products' shapes, products, norms."""
    shapes = {"q": (hq * hd, d), "k": (hkv * hd, d), "v": (hkv * hd, d), "o": (d, hq * hd), "gate": (inner, d),
              "up": (inner, d), "down": (d, inner)}
    products = {name: _random_product(n, k, group, name in ("q", "k", "v"), generator)
                for name, (n, k) in shapes.items()}
    norms = [(torch.rand(d, generator=generator) + 0.5).bfloat16() for _ in range(2)]
    return cpu_gemv.Int4Layer(products, *norms, 1e-6, hq, hkv, hd), shapes, products, norms


@pytest.mark.skipif(not (CROSS and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu, qemu-user)")
def test_the_fused_layer_on_aarch64_gives_the_host_bits_under_an_emulator(tmp_path):
    """Jetson's CPU: the fused layer built for aarch64 (NEON products, the same C glue) and run under qemu gives the
    host's q, k, v and layer output bit for bit, for a decode row and a 3-row chunk."""
    driver = tmp_path / "kernel_driver"
    built = subprocess.run([CROSS, "-O3", "-march=armv8.2-a", "-std=c11", "-pthread", "-o", str(driver),
                            str(cpu_gemv.SOURCE), str(Path(__file__).parent / "native" / "kernel_driver.c"), "-lm"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    generator = torch.Generator().manual_seed(21)
    d, hq, hkv, hd, inner, group = 64, 4, 2, 16, 176, 16  # the toy's shapes
    layer, shapes, products, norms = _random_layer(d, hq, hkv, hd, inner, group, generator)
    for rows in (1, 3):
        x = (torch.randn(rows, d, generator=generator) * 2).bfloat16()
        angle = torch.rand(rows, hd // 2, generator=generator) * 50
        angle = torch.cat((angle, angle), dim=-1)
        cos, sin = angle.cos().bfloat16(), angle.sin().bfloat16()
        a = torch.randn(rows, hq * hd, generator=generator).bfloat16()
        blob = struct.pack("<8q", rows, d, hq, hkv, hd, inner, group, 2) + struct.pack("<f4x", 1e-6)
        for name in shapes:
            p = products[name]
            blob += p.tiles.numpy().tobytes() + p.scales.numpy().tobytes() + p.zeros.numpy().tobytes()
            blob += struct.pack("<q", p.bias32 is not None)
            blob += b"" if p.bias32 is None else p.bias32.numpy().tobytes()
        for t in (*norms, x, cos, sin, a):
            blob += t.view(torch.int16).numpy().tobytes()
        (tmp_path / "in.bin").write_bytes(blob)
        run = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(driver), "layer", str(tmp_path / "in.bin"),
                              str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        raw = (tmp_path / "out.bin").read_bytes()
        assert struct.unpack("<i", raw[:4])[0] == 2  # the NEON path ran
        values = torch.from_numpy(np.frombuffer(raw[4:], dtype=np.int16).copy()).view(torch.bfloat16)
        q, k, v = layer.pre(x, cos, sin)
        out = layer.post(x, a)
        sizes = [q.numel(), k.numel(), v.numel(), out.numel()]
        assert values.numel() == sum(sizes)
        for got, want in zip(values.split(sizes), (q, k, v, out)):
            assert torch.equal(got.view(want.shape), want)


def _big_layer(generator: torch.Generator):
    """A layer wide enough that its gate / up / down products go to the pool at two threads (cpu_gemv.c:
    Q4_WORK_PER_THREAD), with the toy's head layout."""
    d, hq, hkv, hd, inner, group = 1024, 8, 2, 128, 2048, 128
    return _random_layer(d, hq, hkv, hd, inner, group, generator)[0], (d, hq, hd)


def _layer_outputs(layer, shape, generator, rows: int, threads: int):
    d, hq, hd = shape
    x = (torch.randn(rows, d, generator=generator) * 2).bfloat16()
    angle = torch.rand(rows, hd // 2, generator=generator) * 50
    angle = torch.cat((angle, angle), dim=-1)
    a = torch.randn(rows, hq * hd, generator=generator).bfloat16()
    return (*layer.pre(x, angle.cos().bfloat16(), angle.sin().bfloat16(), threads), layer.post(x, a, threads))


def test_the_layer_on_the_pool_gives_one_threads_bits_and_lets_the_workers_sleep_after():
    """At two threads a layer call holds the pool's workers between its products (they spin instead of sleeping, so
    only its first product wakes them) and releases them when it returns: the same bits as one thread, and no hold
    left behind, for a decode row and a chunk."""
    layer, shape = _big_layer(torch.Generator().manual_seed(5))
    for rows in (1, 3):
        one = _layer_outputs(layer, shape, torch.Generator().manual_seed(rows), rows, threads=1)
        two = _layer_outputs(layer, shape, torch.Generator().manual_seed(rows), rows, threads=2)
        for got, want in zip(two, one):
            assert torch.equal(got, want)
        assert cpu_gemv.load().edgekv_pool_hold(-1) == 0


def test_a_child_forked_during_a_hold_starts_with_none():
    import multiprocessing

    layer, shape = _big_layer(torch.Generator().manual_seed(6))
    want = [t.tolist() for t in _layer_outputs(layer, shape, torch.Generator().manual_seed(9), 1, threads=1)]
    lib = cpu_gemv.load()
    assert lib.edgekv_pool_hold(1) == 1  # as if another thread were inside a layer call at the fork
    try:
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        child = context.Process(target=_forked_layer, args=(layer, shape, results))
        child.start()
        held, got = results.get(timeout=120)  # a bound against a hang, not a figure
        child.join(timeout=120)
    finally:
        assert lib.edgekv_pool_hold(0) == 0
    assert child.exitcode == 0 and held == 0 and got == want


def _forked_layer(layer, shape, results) -> None:
    held = cpu_gemv.load().edgekv_pool_hold(-1)
    outs = _layer_outputs(layer, shape, torch.Generator().manual_seed(9), 1, threads=2)
    results.put((held, [t.tolist() for t in outs]))
