"""The opt-in int8 LM head (issue 29, ``model.lm_head: int8``): the int8 format, the C kernel against the
dequantized weight in float64, its paths (AVX2 / NEON under an emulator / portable) giving the same bits, the
head and tied embedding modules, and the runtime option."""

from __future__ import annotations

import gc
import shutil
import struct
import subprocess
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from edgekv.kernels import cpu_gemv
from edgekv.kernels.cpu_gemv import gemm_q8, q8_dequant, q8_quantize, q8_rows
from edgekv.model.decode_routes import Int8Embedding, Int8Head, quantize_lm_head

needs_kernel = pytest.mark.skipif(cpu_gemv.load() is None,
                                  reason=f"the C kernel cannot be built here: {cpu_gemv.unavailable_reason()}")


def known_weight(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 values [N, K] with every group reaching +-127, fp32 scales [K/g, N], the float weight they make)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int32)
    q.view(n, k // group, group)[..., 0] = torch.where(torch.rand(n, k // group, generator=gen) < 0.5, 127, -127)
    scales = torch.rand(k // group, n, generator=gen) * 0.01 + 1e-4
    weight = (q.float().view(n, k // group, group) * scales.T[..., None]).view(n, k)
    return q.to(torch.int8), scales, weight


def activations(p: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(p, k, generator=gen)
    x[:, ::97] *= 40.0  # outlier channels
    return x


def error_bound(weight: torch.Tensor, x: torch.Tensor, group: int) -> torch.Tensor:
    """[P, N]: each activation is read within 2^-14 of its group's largest |x| (``cpu_gemv.c``), plus fp32
    rounding of the per-group sums."""
    p, k = x.shape
    largest = x.abs().view(p, k // group, group).amax(-1).repeat_interleave(group, -1).double()  # [P, K]
    magnitude = x.abs().double() @ weight.abs().double().T
    return (largest @ weight.abs().double().T) * 2.0**-14 + magnitude * 2e-6


def test_quantize_recovers_known_integers_and_scales_and_reads_rows_back():
    n, k, group = 48, 256, 64
    q, scales, weight = known_weight(n, k, group, seed=1)
    tiles, got_scales = q8_quantize(weight, group)
    assert tiles.shape == (n // 8, k // 16, 128) and tiles.dtype == torch.int8
    index = torch.arange(n)
    assert torch.equal(q8_rows(tiles, index), q)
    torch.testing.assert_close(got_scales, scales, rtol=2e-7, atol=0)
    assert torch.equal(q8_dequant(tiles, got_scales), (q.float().view(n, k // group, group) * got_scales.T[..., None]).view(n, k))
    picked = torch.tensor([[5, 0], [47, 8]])
    assert torch.equal(q8_rows(tiles, picked), q[picked])
    # an all-zero group: scale 0, values 0 (no division by zero)
    weight[3, :group] = 0
    tiles, got_scales = q8_quantize(weight, group)
    assert float(got_scales[0, 3]) == 0.0 and not q8_rows(tiles, torch.tensor([3]))[0, :group].any()


def test_quantize_refuses_what_the_kernel_cannot_read():
    with pytest.raises(ValueError, match="out_features % 8"):
        q8_quantize(torch.randn(12, 64), 64)
    with pytest.raises(ValueError, match="group"):
        q8_quantize(torch.randn(16, 96), 64)
    bad = torch.randn(16, 64)
    bad[9, 3] = float("nan")
    with pytest.raises(ValueError, match="inf or nan values .rows 0..15"):
        q8_quantize(bad, 64)


def emulate(tiles: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The kernel's arithmetic as ``cpu_gemv.c`` states it, in numpy: activations to fixed point per group, exact
    integer sums, then per group fp32 total = fma((float)S, scale * 2^(E - 14), total) (a product of two fp32
    numbers is exact in float64, so one rounding of the float64 sum to fp32 is the fma's)."""
    n, k = tiles.shape[0] * 8, tiles.shape[1] * 16
    group = k // scales.shape[0]
    w = q8_rows(tiles, torch.arange(n)).numpy().astype(np.int64)  # [N, K]
    xs = x.numpy().astype(np.float32).reshape(x.shape[0], k // group, group)
    _, e = np.frexp(np.abs(xs).max(-1))  # largest < 2^e
    e = np.maximum(e, -100)
    X = np.rint(np.ldexp(xs, (14 - e)[..., None])).astype(np.int64)  # [P, groups, G]
    factor = np.ldexp(np.float32(1), e - 14).astype(np.float32)  # [P, groups]
    total = np.zeros((x.shape[0], n), dtype=np.float32)
    for g in range(k // group):
        sums = X[:, g] @ w[:, g * group:(g + 1) * group].T  # [P, N], exact
        scale = (scales.numpy()[g][None, :] * factor[:, g:g + 1]).astype(np.float32)
        total = (sums.astype(np.float32).astype(np.float64) * scale.astype(np.float64)
                 + total.astype(np.float64)).astype(np.float32)
    return torch.from_numpy(total)


@needs_kernel
@pytest.mark.parametrize("n,k,group", [(1184, 2048, 128), (64, 64, 64), (40, 176, 16)])
def test_kernel_is_its_stated_arithmetic_and_near_the_exact_product(n, k, group):
    q, scales, weight = known_weight(n, k, group, seed=2)
    tiles, scales = q8_quantize(weight, group)
    x = activations(3, k, seed=3)
    got = gemm_q8(tiles, scales, x)
    assert torch.equal(got, emulate(tiles, scales, x))
    exact_weight = q8_dequant(tiles, scales)
    reference = x.double() @ exact_weight.double().T
    error = (got.double() - reference).abs()
    assert bool((error <= error_bound(exact_weight, x, group)).all())
    # closer than reading the activations in bf16 (the bf16 kernel's inputs), outlier channels and all
    coarse = (x.bfloat16().double() @ exact_weight.double().T - reference).abs()
    assert float(error.max()) < float(coarse.max()) / 2


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_rows_threads_and_the_portable_loop_give_the_same_bits(threads):
    n, k, group = 4096, 2048, 128  # 3 rows: 6x the work a thread is woken for (cpu_gemv.c Q4_WORK_PER_THREAD)
    _, _, weight = known_weight(n, k, group, seed=4)
    tiles, scales = q8_quantize(weight, group)
    x = activations(3, k, seed=5)
    together = gemm_q8(tiles, scales, x, threads=threads)
    for row in range(3):
        assert torch.equal(gemm_q8(tiles, scales, x[row:row + 1]), together[row:row + 1])
    assert torch.equal(gemm_q8(tiles, scales, x, portable=True), together)
    tiny = x.clone()
    tiny[0, :group] *= 1e-35  # a group below the kernel's smallest scale (2^-100): read at that scale
    assert torch.equal(gemm_q8(tiles, scales, tiny, threads=threads), gemm_q8(tiles, scales, tiny, portable=True))


@needs_kernel
def test_kernel_refuses_non_finite_activations_and_bad_shapes():
    _, _, weight = known_weight(16, 64, 64, seed=6)
    tiles, scales = q8_quantize(weight, 64)
    x = torch.randn(1, 64)
    x[0, 10] = float("inf")
    with pytest.raises(ValueError, match="inf or nan"):
        gemm_q8(tiles, scales, x)
    with pytest.raises(ValueError, match=r"activations \(1, 32\) for a weight of 64 inputs"):
        gemm_q8(tiles, scales, torch.randn(1, 32))
    with pytest.raises(ValueError, match="not one contiguous CPU int8 weight"):
        gemm_q8(tiles, scales.half(), torch.randn(1, 64))


# ---------------------------------------------------------------------------------------------- modules
def tiny_language(tied: bool, dtype: torch.dtype = torch.float32):
    from edgekv.model.config import TextConfig
    from edgekv.model.language import Qwen2LM

    torch.manual_seed(7)
    config = TextConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, mrope_section=(4, 6, 6),
                        tie_word_embeddings=tied)
    return Qwen2LM(config).to(dtype).eval()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_tied_head_and_embedding_share_one_int8_table_and_the_float_one_is_freed(dtype):
    language = tiny_language(tied=True, dtype=dtype)
    float_table = language.embed_tokens.weight.detach().clone()
    freed = weakref.ref(language.embed_tokens.weight)
    info = quantize_lm_head(language, "int8")
    gc.collect()
    assert info == {"lm_head": "int8", "tied": True} and freed() is None
    head, embedding = language.lm_head, language.embed_tokens
    assert isinstance(head, Int8Head) and isinstance(embedding, Int8Embedding)
    assert embedding.tiles.data_ptr() == head.tiles.data_ptr() and head.group_size == 128
    ids = torch.tensor([0, 17, 255, 17])
    exact = q8_dequant(head.tiles, head.scales)
    assert embedding(ids).dtype == dtype and torch.equal(embedding(ids), exact[ids].to(dtype))
    assert float((exact - float_table.float()).abs().max()) <= float(float_table.float().abs().max()) / 254 * 1.001
    with pytest.raises(IndexError, match=r"\[0, 256\), got 0..256"):
        embedding(torch.tensor([0, 256]))
    hidden = torch.randn(3, 128).to(dtype)
    with torch.inference_mode():
        kernel = head(hidden)
    assert kernel.dtype == dtype and kernel.shape == (3, 256)
    # the fallback (autograd, or a device without the kernel) computes the same product within the kernel's bound
    fallback = head(hidden.float().requires_grad_()).detach()
    bound = error_bound(exact, hidden.float(), 128).float() + (0 if dtype is torch.float32 else kernel.float().abs() * 2**-8)
    assert bool(((kernel.float() - fallback).abs() <= bound).all())
    nan = hidden.clone()
    nan[1, 5] = float("nan")
    with torch.inference_mode():
        out = head(nan)
    assert bool(out[1].isnan().all()) and not bool(out[0].isnan().any())
    assert quantize_lm_head(language, "int8")["lm_head"] == "int8"  # twice: nothing more to do


@needs_kernel
def test_an_untied_head_is_quantized_alone_and_the_model_decodes_the_same_tokens():
    from edgekv.model.language import DenseKVCache
    from edgekv.model.rope import text_position_ids

    language = tiny_language(tied=False)
    embedding = language.embed_tokens
    ids = torch.randint(0, 256, (12,), generator=torch.Generator().manual_seed(8))

    def greedy(steps: int = 6) -> list[int]:
        cache = DenseKVCache(language.config, 32)
        with torch.inference_mode():
            hidden = language(language.embed_tokens(ids), text_position_ids(0, 12), cache)
            cache.commit()
            out = [int(language.logits(hidden[-1]).argmax())]
            for step in range(steps - 1):
                hidden = language(language.embed_tokens(torch.tensor([out[-1]])), text_position_ids(12 + step, 1), cache)
                cache.commit()
                out.append(int(language.logits(hidden[-1]).argmax()))
        return out

    before = greedy()
    assert quantize_lm_head(language, "int8") == {"lm_head": "int8", "tied": False}
    assert language.embed_tokens is embedding and isinstance(language.lm_head, Int8Head)
    assert greedy() == before  # random weights: logits far apart compared with the int8 error
    with pytest.raises(ValueError, match="unknown value 'int4'"):
        quantize_lm_head(language, "int4")


@needs_kernel
def test_runtime_option_answers_with_the_toy_and_is_refused_with_a_reason():
    from edgekv.config import ConfigError
    from edgekv.runtime import Runtime

    runtime = Runtime.from_pretrained("builtin:toy", model={"dtype": "fp32", "device": "cpu", "lm_head": "int8"},
                                      cache={"policy": "full", "max_tokens": 2048, "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [112, 112]})
    language = runtime.model.language
    assert isinstance(language.lm_head, Int8Head) and isinstance(language.embed_tokens, Int8Embedding)
    assert runtime.model.dtype == torch.float32 and language.lm_head.group_size == 64  # the toy's 64 inputs
    from edgekv.eval.toy_accuracy import answer_of, heldout_streams

    stream = heldout_streams(1)[0]  # the card's first held-out stream; the toy answers colour at 1.000 there
    session = runtime.session()
    for frame in range(2 * stream.pairs):
        session.ingest(stream.scene.frame(frame), t=stream.scene.time(frame))
    color = next(qa for qa in stream.questions if qa.family == "color")
    assert answer_of(session.ask(color.question, max_new_tokens=2).text) == color.answer
    with pytest.raises(ConfigError, match="lm_head"):
        Runtime.from_pretrained("builtin:toy", model={"device": "cpu", "lm_head": "int4"})


# ---------------------------------------------------------------------------------------------- aarch64 (NEON)
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")


@needs_kernel
@pytest.mark.skipif(not (CROSS and QEMU), reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 (apt: gcc-aarch64-linux-gnu, qemu-user)")
def test_neon_path_gives_the_host_bits_under_an_emulator(tmp_path):
    n, k, group, rows = 64, 512, 128, 2
    _, _, weight = known_weight(n, k, group, seed=9)
    tiles, scales = q8_quantize(weight, group)
    x = activations(rows, k, seed=10)
    driver = tmp_path / "kernel_driver"
    built = subprocess.run([CROSS, "-O3", "-march=armv8.2-a", "-std=c11", "-pthread", "-o", str(driver),
                            str(cpu_gemv.SOURCE), str(Path(__file__).parent / "native" / "kernel_driver.c"), "-lm"],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    (tmp_path / "in.bin").write_bytes(struct.pack("<5q", n, k, group, 2, rows) + tiles.numpy().tobytes()
                                      + scales.numpy().tobytes() + x.numpy().tobytes())
    run = subprocess.run([QEMU, "-L", "/usr/aarch64-linux-gnu", str(driver), "q8", str(tmp_path / "in.bin"),
                          str(tmp_path / "out.bin")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    raw = (tmp_path / "out.bin").read_bytes()
    assert struct.unpack("<i", raw[:4])[0] == 2  # the NEON path ran
    got = torch.from_numpy(np.frombuffer(raw[4:], dtype=np.float32).copy()).view(rows, n)
    assert torch.equal(got, gemm_q8(tiles, scales, x))
