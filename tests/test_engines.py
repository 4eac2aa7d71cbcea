"""Engines: ONNX export -> onnxruntime parity with the torch backend, the bundle manifest and its checks.

One module-scoped build (through the ``edgekv build`` command line's entry point, in this process; the
second, up-to-date build runs it as a process of its own) of a random-weight checkpoint with test-sized
weights (``test-stream``: answers vary token to token) at a frame grid that is not a multiple of the ViT
window (168 px = 12 patches: edge windows are padded, so the baked gather and key mask are exercised), a
cache of 512 slots and StateKV sinks, so the mass output and per-head visibility are used on every frame
pair. Tolerances: fp32 everywhere; the graphs are exact re-expressions of the torch path (same ops,
attention in fp32 in both), so 1e-4 on logits/hidden and 1e-5 on K/V and mass.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from edgekv.engines.manifest import (
    BuildKey,
    EngineError,
    EngineMismatchError,
    Manifest,
    locate,
)

import edgekv
from edgekv.apps.cli import main
from edgekv.cache.capped import CappedKVCache
from edgekv.config import ConfigError, load_config
from helpers_checkpoints import filled_cache

RESOLUTION = [112, 168]  # grid 8 x 12 patches -> 24 tokens per frame pair
CACHE_TOKENS = 512
SOURCE = "synthetic:shapes?size=200x150&fps=4&frames=200"


def _has_tensorrt() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(config path, checkpoint dir, engine root, bundle dir, build stderr)."""
    from edgekv.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("engines")
    ckpt = make_tiny_checkpoint(root / "ckpt", preset="test-stream", seed=3)
    config = {
        "model": {"path": str(ckpt), "dtype": "fp32", "device": "cpu"},
        "video": {"source": SOURCE, "fps": 2.0, "resolution": RESOLUTION},
        "cache": {"policy": "infinipot_v", "max_tokens": CACHE_TOKENS, "text_reserve_tokens": 96, "sinks": 32},
        "engines": {"vision": "onnxruntime", "llm": "onnxruntime", "engine_dir": str(root / "cache"),
                    "onnx_providers": ["CPUExecutionProvider"]},
        "generation": {"max_new_tokens": 8},
    }
    path = root / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    # the command's own entry point, in this process (the exporter is warm after the first build of the
    # session; a second interpreter would spend seconds importing it): what it prints is captured as a pipe's
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["build", "--config", str(path)])
    assert code == 0, err.getvalue()
    bundles = [p.parent for p in (root / "cache").glob("*/manifest.json")]
    assert len(bundles) == 1
    return path, ckpt, root / "cache", bundles[0], out.getvalue() + err.getvalue()


def _runtime(config_path: Path, **overrides) -> edgekv.Runtime:
    return edgekv.Runtime.from_config(load_config(config_path).with_overrides(**overrides))


@pytest.fixture(scope="module")
def runtimes(built):
    config_path = built[0]
    torch_rt = _runtime(config_path, engines={"vision": "torch", "llm": "torch"})
    ort_rt = _runtime(config_path)
    return torch_rt, ort_rt


def test_build_writes_graphs_manifest_and_progress(built):
    _, ckpt, _, bundle, output = built
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["files"]) == {"vision", "llm"}
    for entry in manifest["files"].values():
        assert (bundle / entry["file"]).stat().st_size == entry["bytes"] > 0
    key = manifest["key"]
    assert key["backend"] == "onnxruntime" and key["grid_thw"] == [1, 8, 12]
    assert key["cache_tokens"] == CACHE_TOKENS and key["dtype"] == "fp32" and key["max_chunk_tokens"] == 256
    assert manifest["files"]["vision"]["outputs"]["tokens"][0] == 24
    assert manifest["versions"]["opset"] == 18
    for step in ("[1/4]", "[4/4]", "export vision graph", "export LLM graph", "manifest.json"):
        assert step in output
    import onnx

    graph = onnx.load(str(bundle / "llm.onnx"), load_external_data=False).graph
    assert [i.name for i in graph.input] == ["embeds", "position_ids", "k_cache", "v_cache", "visible"]
    assert [o.name for o in graph.output] == ["hidden", "new_k", "new_v", "mass"]
    dims = [d.dim_param or d.dim_value for d in graph.input[0].type.tensor_type.shape.dim]
    assert isinstance(dims[0], str) and dims[1] == 64  # P dynamic (prefill chunks and decode steps), d static
    # A second build finds the bundle up to date and does not rewrite it.
    mtime = (bundle / "llm.onnx").stat().st_mtime_ns
    proc = subprocess.run([sys.executable, "-m", "edgekv.apps.cli", "build", "--config", str(built[0]), "--quiet"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "up to date" in proc.stderr
    assert (bundle / "llm.onnx").stat().st_mtime_ns == mtime


def test_backends_are_the_engines_and_torch_copies_are_released(runtimes):
    torch_rt, ort_rt = runtimes
    assert (ort_rt.vision_backend.name, ort_rt.llm_backend.name) == ("onnxruntime", "onnxruntime")
    assert ort_rt.model.visual is None and len(ort_rt.model.language.layers) == 0
    assert torch_rt.vision_backend.name == "torch"
    stats = ort_rt.session().stats()
    assert (stats["vision_backend"], stats["llm_backend"]) == ("onnxruntime", "onnxruntime")


def test_vision_parity_on_a_padded_window_grid(runtimes):
    torch_rt, ort_rt = runtimes
    pre = torch_rt.make_preprocessor()
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 256, (150, 200, 3), dtype=np.uint8) for _ in range(2))
    pixels, grid = pre.pair(a, b)
    ref = torch_rt.vision_backend.encode(pixels, grid)
    out = ort_rt.vision_backend.encode(pixels, grid)
    assert out.shape == ref.shape == (24, torch_rt.model.config.text.hidden_size)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
    with pytest.raises(EngineError, match=r"built for grid \[1, 8, 12\].*edgekv build"):
        ort_rt.vision_backend.encode(torch.zeros(16 * 16, pixels.shape[1]), torch.tensor([[1, 16, 16]]))


def _filled_cache(runtime, length: int, seed: int) -> CappedKVCache:
    return filled_cache(runtime.model.config.text, CACHE_TOKENS, length, seed)


def _chunk_inputs(text, start: int, num: int, t: int, restricted: bool):
    """A frame pair's chunk (embeds, M-RoPE positions at temporal position ``t`` on a 4 x 6 grid) and, when
    ``restricted``, a StateKV-like per-(layer, KV head) subset of the ``start`` committed slots."""
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(num, text.hidden_size, generator=g)
    positions = torch.stack([torch.full((num,), t), torch.arange(num) // 6 + t, torch.arange(num) % 6 + t])
    visible = None
    if restricted:
        visible = torch.rand(text.num_hidden_layers, text.num_key_value_heads, start, generator=g) < 0.3
    return embeds, positions, visible


@pytest.mark.parametrize("restricted", [False, True])
def test_prefill_kv_and_mass_parity(runtimes, restricted):
    torch_rt, ort_rt = runtimes
    start, num = 100, 24
    text = torch_rt.model.config.text
    embeds, positions, visible = _chunk_inputs(text, start, num, 60, restricted)
    results = []
    for rt in (torch_rt, ort_rt):
        cache = _filled_cache(rt, start, seed=2)
        mass = torch.full((text.num_hidden_layers, text.num_key_value_heads, CACHE_TOKENS), -1.0)
        hidden = rt.llm_backend.prefill(embeds, positions, cache, visible=visible, mass_out=mass)
        results.append((hidden, cache.k[:, :, start:start + num].clone(), cache.v[:, :, start:start + num].clone(), mass))
    (h0, k0, v0, m0), (h1, k1, v1, m1) = results
    torch.testing.assert_close(h1, h0, atol=1e-4, rtol=0)
    torch.testing.assert_close(k1, k0, atol=1e-5, rtol=0)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=0)
    torch.testing.assert_close(m1[:, :, :start + num], m0[:, :, :start + num], atol=1e-5, rtol=0)
    if restricted:
        assert torch.all(m1[:, :, :start][~visible] == 0)
    assert torch.all(m1[:, :, start + num:] == -1.0)  # slots past the chunk are not touched


def test_decode_logits_parity(runtimes):
    torch_rt, ort_rt = runtimes
    text = torch_rt.model.config.text
    logits = []
    for rt in (torch_rt, ort_rt):
        cache = _filled_cache(rt, 200, seed=4)
        embeds = rt.llm_backend.embed(torch.tensor([1234]))
        hidden = rt.llm_backend.prefill(embeds, torch.full((3, 1), 300), cache)
        logits.append(rt.llm_backend.logits(hidden[-1]))
        assert cache.length == 200  # the backend writes K/V, the caller commits
    assert logits[0].shape == (text.vocab_size,)
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=0)


def test_long_chunk_is_split_at_the_engine_limit(runtimes):
    """A chunk longer than the engine's largest P runs in pieces that see each other: same result."""
    _, ort_rt = runtimes
    llm = ort_rt.llm_backend
    text = ort_rt.model.config.text
    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(13, text.hidden_size, generator=g)
    positions = (torch.arange(13) + 40).expand(3, 13).contiguous()
    whole = _filled_cache(ort_rt, 30, seed=6)
    h_whole = llm.prefill(embeds, positions, whole)
    pieces = _filled_cache(ort_rt, 30, seed=6)
    saved = llm.max_chunk
    try:
        llm.max_chunk = 5
        h_pieces = llm.prefill(embeds, positions, pieces)
    finally:
        llm.max_chunk = saved
    torch.testing.assert_close(h_pieces, h_whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(pieces.k[:, :, 30:43], whole.k[:, :, 30:43], atol=1e-5, rtol=0)


def test_full_stream_50_pairs_3_questions_same_answers(runtimes):
    """50 frame pairs through infinipot_v compression with StateKV sinks, 3 questions along the way."""
    from edgekv.video.sources import iter_frames

    sessions = [rt.session() for rt in runtimes]
    questions = {30: "What moved?", 70: "What colour is the large shape?", 99: "Describe the scene."}
    answers: list[list[list[int]]] = [[], []]
    logits_gap = 0.0
    for index, (image, t) in enumerate(iter_frames(SOURCE, max_frames=100)):
        for session in sessions:
            session.ingest(image, t=t)
        if index in questions:
            for which, session in enumerate(sessions):
                answers[which].append(session.ask(questions[index], max_new_tokens=8).token_ids)
            ref, out = (s.question_logits(questions[index]) for s in sessions)
            logits_gap = max(logits_gap, float((ref - out).abs().max()))
    stats = [s.stats() for s in sessions]
    assert stats[0]["frames"] == stats[1]["frames"] == 100
    assert stats[0]["compressions"] == stats[1]["compressions"] > 3
    assert stats[0]["cache_tokens"] == stats[1]["cache_tokens"] <= CACHE_TOKENS
    assert torch.equal(sessions[0].cache.sink, sessions[1].cache.sink)
    assert answers[1] == answers[0]
    assert len({tuple(a) for a in answers[0]}) > 1 or len(set(answers[0][0])) > 1  # answers are not one token
    assert logits_gap < 1e-3
    # a question about a stretch of time, with a conversation before it: the engine reads the same window (its
    # graph's ``visible`` input) and the same turns as the torch LLM
    held = sorted(sessions[0].pair_times.values())
    window, history = (held[len(held) // 3], held[2 * len(held) // 3]), [("user", "What moved?"), ("assistant", "x")]
    scoped = [s.ask("And then?", max_new_tokens=8, window=window, history=history) for s in sessions]
    assert scoped[0].token_ids == scoped[1].token_ids and scoped[0].window_pairs == scoped[1].window_pairs >= 1
    unscoped = sessions[1].ask("And then?", max_new_tokens=8, history=history)
    assert unscoped.token_ids != scoped[1].token_ids  # the engine did read only the window


# ---------------------------------------------------------------------------- an int8 cache


@pytest.fixture(scope="module")
def int8_runtimes(built, tmp_path_factory):
    """(torch LLM, onnxruntime LLM) over an int8 cache: the graph takes the cache's codes, scales and tpos."""
    from edgekv.engines.build import build

    config = load_config(built[0]).with_overrides(cache={"kv_dtype": "int8"}, engines={
        "vision": "torch", "engine_dir": str(tmp_path_factory.mktemp("engines8"))})
    bundle, manifest = build(config, "onnxruntime", progress=False)
    assert manifest.key["kv_dtype"] == "int8"
    assert set(manifest.files["llm"]["inputs"]) == {"embeds", "position_ids", "k_codes", "k_scale", "v_codes",
                                                     "v_scale", "tpos", "visible"}
    return (edgekv.Runtime.from_config(config.with_overrides(engines={"llm": "torch"})),
            edgekv.Runtime.from_config(config))


def _filled_int8_cache(runtime, length: int, seed: int) -> CappedKVCache:
    from edgekv.cache import ChunkMeta, SlotKind

    from edgekv.model.rope import rotary_inv_freq

    text = runtime.model.config.text
    cache = CappedKVCache(runtime.cache_spec(), CACHE_TOKENS, compute_dtype=runtime.dtype,
                          rope=(rotary_inv_freq(text.head_dim, text.rope_theta), int(text.mrope_section[0])))
    g = torch.Generator().manual_seed(seed)
    cache.write_meta(0, length, ChunkMeta(SlotKind.VISION, frame=0, tpos=torch.randint(0, 3000, (length,), generator=g)))
    for layer in range(cache.num_layers):
        cache.write_layer(layer, 0, torch.randn(cache.kv_heads, length, cache.head_dim, generator=g) * 2,
                          torch.randn(cache.kv_heads, length, cache.head_dim, generator=g))
    cache.commit(length)
    return cache


@pytest.mark.parametrize("restricted", [False, True])
def test_int8_cache_prefill_parity(int8_runtimes, restricted):
    """The same int8 cache contents read by the graph and by the torch path: same hidden states and mass, and
    the chunk's K/V written as the same codes (up to one step where a rounding tie falls differently)."""
    from edgekv.cache import ChunkMeta, SlotKind

    torch_rt, ort_rt = int8_runtimes
    start, num = 100, 24
    text = torch_rt.model.config.text
    embeds, positions, visible = _chunk_inputs(text, start, num, 3100, restricted)
    results = []
    for rt in (torch_rt, ort_rt):
        cache = _filled_int8_cache(rt, start, seed=2)
        assert cache.k.dtype == torch.int8
        cache.write_meta(start, num, ChunkMeta(SlotKind.VISION, frame=1, tpos=torch.full((num,), 3100)))
        mass = torch.full((text.num_hidden_layers, text.num_key_value_heads, CACHE_TOKENS), -1.0)
        hidden = rt.llm_backend.prefill(embeds, positions, cache, visible=visible, mass_out=mass)
        results.append((hidden, cache.keys(end=start + num)[:, :, start:], cache.values(end=start + num)[:, :, start:],
                        cache.k[:, :, start:start + num].clone(), mass))
    (h0, k0, v0, c0, m0), (h1, k1, v1, c1, m1) = results
    torch.testing.assert_close(h1, h0, atol=1e-4, rtol=0)
    torch.testing.assert_close(m1[:, :, :start + num], m0[:, :, :start + num], atol=1e-5, rtol=0)
    assert (c1.int() - c0.int()).abs().max() <= 1 and (c1 != c0).float().mean() < 0.01
    step = k0.abs().amax(-1, keepdim=True) / 127  # one int8 step of each slot
    assert ((k1 - k0).abs() <= step * 1.01 + 1e-6).all() and ((v1 - v0).abs() <= v0.abs().amax(-1, keepdim=True) / 127 * 1.01 + 1e-6).all()
    if restricted:
        assert torch.all(m1[:, :, :start][~visible] == 0)


def test_int8_cache_stream_through_the_engine_answers_as_torch(int8_runtimes):
    """40 frame pairs with compressions and StateKV sinks on an int8 cache, then a question: the onnxruntime
    LLM and the torch LLM compress alike and give the same answer tokens."""
    from edgekv.video.sources import iter_frames

    sessions = [rt.session() for rt in int8_runtimes]
    for image, t in iter_frames(SOURCE, max_frames=80):
        for session in sessions:
            session.ingest(image, t=t)
    stats = [s.stats() for s in sessions]
    assert stats[0]["compressions"] == stats[1]["compressions"] >= 2
    assert stats[0]["cache_capacity_bytes"] == stats[1]["cache_capacity_bytes"]
    ref, out = (s.question_logits("What moved?") for s in sessions)
    assert float((ref - out).abs().max()) < 0.05  # int8 rounding ties of K/V written by each path
    answers = [s.ask("What moved?", max_new_tokens=6).token_ids for s in sessions]
    assert answers[0] == answers[1]


def test_int8_engines_refuse_another_cache(int8_runtimes, built):
    """An engine built for int8 refuses a model-dtype cache and the reverse, naming cache.kv_dtype."""
    from edgekv.engines.manifest import EngineError as Error

    torch_rt, ort_rt = int8_runtimes
    fp_cache = _filled_cache(ort_rt, 10, seed=0)
    with pytest.raises(Error, match="cache.kv_dtype"):
        ort_rt.llm_backend.prefill(torch.zeros(1, ort_rt.model.config.text.hidden_size), torch.zeros(3, 1), fp_cache)
    int8_cache = _filled_int8_cache(torch_rt, 10, seed=0)
    plain = _runtime(built[0])
    with pytest.raises(Error, match="cache.kv_dtype"):
        plain.llm_backend.prefill(torch.zeros(1, plain.model.config.text.hidden_size), torch.zeros(3, 1), int8_cache)


# ---------------------------------------------------------------------------- bad input


def test_unknown_backend_name_is_refused_with_the_key():
    with pytest.raises(ConfigError, match=r"engines\.llm"):
        edgekv.config.EdgeKVConfig().with_overrides(engines={"llm": "tensorflow"})


def test_missing_engine_file_names_it_and_offers_rebuild(built, tmp_path):
    config_path, _, _, bundle, _ = built
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    (copy / "llm.onnx").unlink()
    with pytest.raises(EngineError, match=r"llm\.onnx: engine file missing.*edgekv build --model"):
        _runtime(config_path, engines={"engine_dir": str(copy)})


def test_truncated_engine_file_is_refused(built, tmp_path):
    config_path, _, _, bundle, _ = built
    copy = tmp_path / "bundle"
    shutil.copytree(bundle, copy)
    data = (copy / "vision.onnx").read_bytes()
    (copy / "vision.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(EngineError, match=r"vision\.onnx: engine file is \d+ bytes, the manifest says"):
        _runtime(config_path, engines={"engine_dir": str(copy)})


def test_engines_for_another_config_name_the_mismatch(built):
    config_path = built[0]
    with pytest.raises(EngineMismatchError, match=r"cache capacity M.*built for 512, this deployment has 640.*edgekv build"):
        _runtime(config_path, cache={"max_tokens": 640})
    with pytest.raises(EngineMismatchError, match=r"frame grid.*\[1, 8, 12\].*\[1, 8, 8\]"):
        _runtime(config_path, video={"resolution": [112, 112]})


def test_engines_for_other_weights_name_the_model_hash(built, tmp_path):
    from edgekv.model.tiny import make_tiny_checkpoint

    config_path, ckpt, _, _, _ = built
    other = make_tiny_checkpoint(tmp_path / ckpt.name, preset="test-stream", seed=4)  # same dir name and shape
    with pytest.raises(EngineMismatchError, match=r"model weights"):
        _runtime(config_path, model={"path": str(other)})


def test_engines_for_another_gpu_or_tensorrt_version_are_refused(tmp_path, built):
    _, ckpt, _, _, _ = built
    common = dict(backend="tensorrt", model_hash="ab" * 32, grid_thw=(1, 8, 12), cache_tokens=512, dtype="fp16",
                  max_chunk_tokens=256, precision="fp16")
    orin = BuildKey(**common, tensorrt_version="10.3.0", gpu="Orin (sm_87)")
    bundle = orin.bundle_dir(tmp_path, ckpt.name)
    bundle.mkdir(parents=True)
    (bundle / "llm.plan").write_bytes(b"plan")
    Manifest(key=orin.fields(), model_dir=str(ckpt), files={"llm": {"file": "llm.plan", "bytes": 4}}).write(bundle)
    found, manifest = locate(tmp_path, ckpt, orin, "rebuild")
    assert found == bundle and manifest.files["llm"]["file"] == "llm.plan"
    h100 = BuildKey(**common, tensorrt_version="10.7.0", gpu="NVIDIA H100 80GB HBM3 (sm_90)")
    with pytest.raises(EngineMismatchError) as err:
        locate(tmp_path, ckpt, h100, "rebuild with: edgekv build")
    message = str(err.value)
    assert "TensorRT version: built for '10.3.0', this deployment has '10.7.0'" in message
    assert "GPU: built for 'Orin (sm_87)'" in message and "edgekv build" in message
    with pytest.raises(EngineMismatchError, match="GPU: built for 'Orin"):
        locate(bundle, ckpt, h100, "rebuild")  # engine_dir pointing at the bundle itself


@pytest.mark.skipif(_has_tensorrt(), reason="TensorRT is installed here: the missing-TensorRT message cannot show")
def test_tensorrt_without_tensorrt_fails_fast_with_the_jetson_install(built, tmp_path):
    from edgekv.engines.build import build

    from edgekv.config import load_config

    config_path = built[0]
    with pytest.raises(EngineError, match=r"python3-libnvinfer"):
        _runtime(config_path, engines={"vision": "torch", "llm": "tensorrt"})
    with pytest.raises(EngineError, match=r"python3-libnvinfer"):
        build(load_config(config_path), "tensorrt", engine_dir=tmp_path, progress=False)
    assert not any(tmp_path.iterdir())  # nothing exported before the check
    proc = subprocess.run([sys.executable, "-m", "edgekv.apps.cli", "build", "--config", str(config_path),
                           "--backend", "tensorrt", "--engine-dir", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "python3-libnvinfer" in proc.stderr


def test_unavailable_onnxruntime_provider_is_named(built):
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    with pytest.raises(EngineError, match=r"CUDAExecutionProvider is not available.*available: .*CPUExecutionProvider"):
        _runtime(built[0], engines={"onnx_providers": ["cuda"]})
    with pytest.raises(ConfigError, match=r"engines\.onnx_providers"):
        _runtime(built[0], engines={"onnx_providers": ["gpu-please"]})


# ---------------------------------------------------------------------------- GPU paths (skipped without one)


@pytest.mark.gpu
def test_onnxruntime_cuda_provider_stream(built):
    import onnxruntime

    if not torch.cuda.is_available() or "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
        pytest.skip("needs a CUDA GPU and onnxruntime-gpu")
    config_path = built[0]
    rt = _runtime(config_path, model={"device": "cuda"},
                  engines={"onnx_providers": ["CUDAExecutionProvider", "CPUExecutionProvider"]})
    ref = _runtime(config_path, model={"device": "cuda"}, engines={"vision": "torch", "llm": "torch"})
    from edgekv.video.sources import iter_frames

    sessions = [ref.session(), rt.session()]
    for image, t in iter_frames(SOURCE, max_frames=40):
        for s in sessions:
            s.ingest(image, t=t)
    gap = float((sessions[0].question_logits("What is there?") - sessions[1].question_logits("What is there?")).abs().max())
    assert gap < 1e-3


@pytest.mark.gpu
@pytest.mark.tensorrt
def test_tensorrt_build_and_stream_parity(built, tmp_path):
    if not _has_tensorrt():
        pytest.skip("needs TensorRT 10+ and a CUDA GPU")
    from edgekv.engines.build import build

    from edgekv.video.sources import iter_frames

    config_path = built[0]
    config = load_config(config_path).with_overrides(
        model={"device": "cuda"}, engines={"vision": "tensorrt", "llm": "tensorrt", "precision": "fp32",
                                           "engine_dir": str(tmp_path)})
    bundle, manifest = build(config, "tensorrt", progress=False)
    assert all(entry["file"].endswith(".plan") for entry in manifest.files.values())
    assert list(tmp_path.glob("timing-*.cache"))
    trt_rt = edgekv.Runtime.from_config(config)
    ref_rt = edgekv.Runtime.from_config(config.with_overrides(engines={"vision": "torch", "llm": "torch"}))
    sessions = [ref_rt.session(), trt_rt.session()]
    for image, t in iter_frames(SOURCE, max_frames=40):
        for s in sessions:
            s.ingest(image, t=t)
    gap = float((sessions[0].question_logits("What is there?") - sessions[1].question_logits("What is there?")).abs().max())
    assert gap < 1e-2  # TensorRT may pick TF32 tactics for fp32 GEMMs


def test_large_weights_go_to_external_data(built, tmp_path, monkeypatch):
    """Graphs over protobuf's 2 GB limit are written with ONNX external data; the threshold is lowered
    here so a tiny graph takes the same path (one decoder layer of the module's model: the path does not
    depend on the depth, the export time does), and onnxruntime must load and run it."""
    import dataclasses

    import onnxruntime
    from edgekv.engines import export

    from edgekv.model.config import ModelConfig
    from edgekv.model.qwen25vl import Qwen25VL

    config = ModelConfig.from_dir(built[1])
    config = dataclasses.replace(config, text=dataclasses.replace(config.text, num_hidden_layers=1))
    model = Qwen25VL(config).eval()
    monkeypatch.setattr(export, "EXTERNAL_DATA_BYTES", 0)
    entry = export.export_llm(model, 64, tmp_path / "llm.onnx", max_chunk_tokens=8, example_tokens=4)
    assert entry["files"] == ["llm.onnx", "llm.onnx.data"]
    data_bytes = (tmp_path / "llm.onnx.data").stat().st_size
    assert data_bytes > (tmp_path / "llm.onnx").stat().st_size
    session = onnxruntime.InferenceSession(str(tmp_path / "llm.onnx"), providers=["CPUExecutionProvider"])
    text = model.config.text
    shape = (text.num_hidden_layers, text.num_key_value_heads, 64, text.head_dim)
    hidden = session.run(["hidden"], {"embeds": np.ones((1, text.hidden_size), np.float32),
                                      "position_ids": np.zeros((3, 1), np.int64),
                                      "k_cache": np.zeros(shape, np.float32), "v_cache": np.zeros(shape, np.float32),
                                      "visible": np.zeros(shape[:3], bool)})[0]
    assert hidden.shape == (1, text.hidden_size) and np.isfinite(hidden).all()


def test_fp16_graphs_stay_within_twice_the_torch_fp16_error(built, tmp_path):
    """fp16 engines (what CUDA / TensorRT run): the same stream's question logits, measured against the fp32
    torch reference, are at most 2x as far off as torch's own fp16 run (DESIGN: kernel tolerance rule)."""
    from edgekv.engines.build import build
    from edgekv.video.sources import iter_frames

    config = load_config(built[0]).with_overrides(model={"dtype": "fp16"}, engines={"engine_dir": str(tmp_path)},
                                                  cache={"sinks": 0})
    build(config, "onnxruntime", progress=False)
    runtimes = [edgekv.Runtime.from_config(config.with_overrides(model={"dtype": "fp32"},
                                                                 engines={"vision": "torch", "llm": "torch"})),
                edgekv.Runtime.from_config(config.with_overrides(engines={"vision": "torch", "llm": "torch"})),
                edgekv.Runtime.from_config(config)]
    sessions = [rt.session() for rt in runtimes]
    for image, t in iter_frames(SOURCE, max_frames=16):
        for s in sessions:
            s.ingest(image, t=t)
    ref, torch16, ort16 = (s.question_logits("What is there?").float() for s in sessions)
    torch_error = float((torch16 - ref).abs().max())
    ort_error = float((ort16 - ref).abs().max())
    assert 0 < torch_error < 0.05
    assert ort_error <= 2 * torch_error


def test_tensorrt_key_and_precision_rules_without_tensorrt(built):
    """The TensorRT build key is computed from the identity TensorRT reports (given here, as on a device):
    it carries version, GPU and precision; a precision other than model.dtype is refused (strong typing)."""
    from edgekv.engines.build import deployment

    config = load_config(built[0])
    orin = ("10.3.0", "Orin (nvgpu) (sm_87)")
    dep = deployment(config, "tensorrt", tensorrt_identity=orin)
    fields = dep.key.fields()
    assert (fields["tensorrt_version"], fields["gpu"], fields["precision"]) == ("10.3.0", "Orin (nvgpu) (sm_87)", "fp32")
    assert dep.key.digest() != deployment(config, "tensorrt", tensorrt_identity=("10.7.0", orin[1])).key.digest()
    assert deployment(config.with_overrides(engines={"precision": "int8"}), "tensorrt",
                      tensorrt_identity=orin).key.precision == "int8"
    with pytest.raises(EngineError, match=r"engines\.precision: fp16 differs from model\.dtype fp32"):
        deployment(config.with_overrides(engines={"precision": "fp16"}), "tensorrt", tensorrt_identity=orin)
    with pytest.raises(EngineError, match=r"bf16 graphs are not supported by onnxruntime"):
        deployment(config.with_overrides(model={"dtype": "bf16"}), "onnxruntime")
