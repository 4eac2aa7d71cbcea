"""The tensorrt backend against TensorRT 10's documented contract, through ``helpers_tensorrt`` (a stand-in module
written from TensorRT's headers and bindings at v10.3.0; its docstring lists what it enforces and where the real
API says so). No TensorRT or GPU is needed: the stand-in "builds" a plan that runs the exported ONNX graph with
onnxruntime on the memory behind the bound addresses, and CPU tensors stand for device memory.

What this covers that nothing else here can: the build calls (network flags, profiles, calibration), binding by
name (dtype, shape against the active profile, 256-byte alignment, every I/O tensor bound) and the stream the
engines run on. What it cannot: real kernels, real device memory, TensorRT's own type inference and tactics.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import helpers_tensorrt as fake_trt  # noqa: E402

import edgekv  # noqa: E402
from edgekv.cache.capped import CappedKVCache  # noqa: E402
from edgekv.config import load_config  # noqa: E402
from helpers_checkpoints import filled_cache  # noqa: E402
from edgekv.engines.manifest import EngineError, locate  # noqa: E402

RESOLUTION = [112, 168]  # grid 8 x 12 patches -> 24 tokens per frame pair
CACHE_TOKENS = 512
MAX_CHUNK = 40
IDENTITY = ("10.3.0", "Orin (sm_87)")
CPU_ALIGNMENT = 64


class FakeStream:
    """``torch.cuda.Stream`` enough for the runtime: a handle and the waits between streams."""

    waits: list[tuple[int, int]] = []
    _next = 1

    def __init__(self, device=None, handle: int | None = None) -> None:
        if handle is None:
            handle, FakeStream._next = FakeStream._next, FakeStream._next + 1
        self.cuda_stream = handle

    def wait_stream(self, other: FakeStream) -> None:
        FakeStream.waits.append((self.cuda_stream, other.cuda_stream))


DEFAULT_STREAM = FakeStream(handle=0)


def _cuda_for_edgekv_engines_only() -> bool:
    """A CUDA device for edgekv's engine modules (their checks and device choice), none for torch's own internals
    (the ONNX exporter would otherwise move work to a device this CPU-only torch does not have)."""
    return sys._getframe(1).f_globals.get("__name__", "").startswith("edgekv.engines")


def _as_if_on_a_jetson(mp: pytest.MonkeyPatch) -> None:
    """The stand-in ``tensorrt`` module and a CUDA device that reports itself as an Orin."""
    mp.setitem(sys.modules, "tensorrt", fake_trt)
    mp.setattr(torch.cuda, "is_available", _cuda_for_edgekv_engines_only)
    mp.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 7))
    mp.setattr(torch.cuda, "get_device_name", lambda *a: "Orin")
    mp.setattr(torch.cuda, "Stream", FakeStream)
    mp.setattr(torch.cuda, "current_stream", lambda *a: DEFAULT_STREAM)


def build_as_on_a_jetson(config):
    """``edgekv build --backend tensorrt`` of ``config`` through the stand-in, as on a Jetson (``_as_if_on_a_jetson``),
    the weights loaded on the CPU: (bundle, manifest)."""
    import edgekv.model as model_module
    from edgekv.engines import build as build_module

    load_pretrained = model_module.load_pretrained
    with pytest.MonkeyPatch.context() as mp:
        _as_if_on_a_jetson(mp)
        mp.setattr(model_module, "load_pretrained",
                   lambda path, dtype, device: load_pretrained(path, dtype=dtype, device=torch.device("cpu")))
        return build_module.build(config, "tensorrt", progress=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Built once through ``build(config, "tensorrt")`` with the stand-in: (config, bundle, manifest, builds), where
    ``builds`` records for each graph the network flags, builder flags and whether the torch model was alive."""
    from edgekv.engines import build as build_module
    from edgekv.engines import tensorrt_backend
    from edgekv.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("trt")
    ckpt = make_tiny_checkpoint(root / "ckpt", preset="test-stream", seed=3)
    config = {
        "model": {"path": str(ckpt), "dtype": "fp32", "device": "cpu"},
        "video": {"source": "synthetic:shapes?size=200x150&fps=4&frames=20", "fps": 2.0, "resolution": RESOLUTION},
        "cache": {"policy": "infinipot_v", "max_tokens": CACHE_TOKENS, "text_reserve_tokens": 96, "sinks": 32},
        "engines": {"vision": "tensorrt", "llm": "tensorrt", "engine_dir": str(root / "cache"),
                    "max_chunk_tokens": MAX_CHUNK},
        "generation": {"max_new_tokens": 4},
    }
    (root / "deploy.yaml").write_text(yaml.safe_dump(config))
    config = load_config(root / "deploy.yaml")
    models: list[weakref.ref] = []
    builds: list[dict] = []
    import edgekv.model as model_module

    load_pretrained = model_module.load_pretrained
    real_build = tensorrt_backend.build_engines

    def load_on_cpu(path, dtype, device):  # the build asks for cuda (it "has" one); this machine has none
        model = load_pretrained(path, dtype=dtype, device=torch.device("cpu"))
        models.append(weakref.ref(model))
        return model

    def recording_build(bundle, files, dep, cfg):
        gc.collect()
        builds.append({"model_alive": any(ref() is not None for ref in models)})
        real_build(bundle, files, dep, cfg)

    with pytest.MonkeyPatch.context() as mp:
        _as_if_on_a_jetson(mp)
        mp.setattr(model_module, "load_pretrained", load_on_cpu)
        mp.setattr(tensorrt_backend, "build_engines", recording_build)
        bundle, manifest = build_module.build(config, "tensorrt", progress=False)
    return config, bundle, manifest, builds


@pytest.fixture
def jetson(monkeypatch):
    """Run-time stand-in. Alignment: TensorRT wants 256-byte aligned device addresses and CUDA's caching allocator
    gives 512; the CPU tensors standing for device memory here are 64-byte aligned (torch's CPU allocator), so the
    stand-in and the runtime check 64 — the same logic at the alignment these buffers have."""
    from edgekv.engines import tensorrt_runtime

    _as_if_on_a_jetson(monkeypatch)
    monkeypatch.setattr(fake_trt, "ALIGNMENT", CPU_ALIGNMENT)
    monkeypatch.setattr(tensorrt_runtime, "ALIGNMENT", CPU_ALIGNMENT)
    FakeStream.waits.clear()


@pytest.fixture(scope="module")
def torch_runtime(built):
    config = built[0]
    return edgekv.Runtime.from_config(config.with_overrides(engines={"vision": "torch", "llm": "torch"}))


def _engines(built):
    from edgekv.engines.build import deployment
    from edgekv.engines.tensorrt_runtime import _Engines

    config = built[0]
    dep = deployment(config, "tensorrt", tensorrt_identity=IDENTITY)
    bundle, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
    return _Engines(bundle, manifest, dep.hint, device=torch.device("cpu")), dep


def _backend(built, runtime, component: str):
    from edgekv.engines.runner import make_backend

    engines, dep = _engines(built)
    decode = "decode" in engines.manifest.files["llm"].get("profiles", {})
    return make_backend("tensorrt", component, engines.run, dep, runtime, decode_profile=decode), engines


def _filled_cache(text, length: int, seed: int) -> CappedKVCache:
    return filled_cache(text, CACHE_TOKENS, length, seed)


def _llm_inputs(text, num: int, start: int, seed: int = 1) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    cache = _filled_cache(text, start, seed)
    visible = torch.zeros(text.num_hidden_layers, text.num_key_value_heads, CACHE_TOKENS, dtype=torch.bool)
    visible[:, :, :start] = True
    inputs = {"embeds": torch.randn(num, text.hidden_size, generator=g),
              "position_ids": (torch.arange(num) + start).expand(3, num).contiguous(),
              "k_cache": cache.k, "v_cache": cache.v, "visible": visible}
    layers, heads, dim = text.num_hidden_layers, text.num_key_value_heads, text.head_dim
    outputs = {"hidden": torch.empty(num, text.hidden_size), "new_k": torch.empty(layers, heads, num, dim),
               "new_v": torch.empty(layers, heads, num, dim), "mass": torch.empty(layers, heads, CACHE_TOKENS + num)}
    return inputs, outputs


# ---------------------------------------------------------------------------------------------- build
def test_build_makes_strongly_typed_plans_with_prefill_and_decode_profiles(built):
    config, bundle, manifest, builds = built
    assert {name: entry["file"] for name, entry in manifest.files.items()} == {"vision": "vision.plan",
                                                                                "llm": "llm.plan"}
    assert manifest.files["llm"]["profiles"] == {"prefill": [1, 24, MAX_CHUNK], "decode": [1, 1, 1]}
    assert manifest.key["tensorrt_version"] == "10.3.0" and manifest.key["gpu"] == "Orin (sm_87)"
    timing = sorted(p.name for p in Path(config.engines.engine_dir).rglob("timing-*"))
    assert timing == ["timing-trt10.3.0-orin--sm-87.cache"]  # one per (TensorRT version, GPU), reused


def test_torch_model_is_released_before_tensorrt_builds(built):
    """On a Jetson the GPU's memory is the board's: the exported torch weights must not sit beside the builder's
    own copy of them and its tactic workspace."""
    assert built[3] == [{"model_alive": False}]


def test_profiles_are_rejected_by_the_stand_in_when_wrong(tmp_path):
    """The stand-in itself: a dynamic input without a profile, or a precision flag on a strongly typed network,
    fails the build as TensorRT does (None), so a build_engines that did either would fail here too."""
    import onnx
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["P", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["P", 4])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y]))
    onnx.save(model, tmp_path / "g.onnx")
    logger = fake_trt.Logger(fake_trt.Logger.WARNING)
    builder = fake_trt.Builder(logger)
    strongly = 1 << int(fake_trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(strongly)
    assert fake_trt.OnnxParser(network, logger).parse_from_file(str(tmp_path / "g.onnx"))
    config = builder.create_builder_config()
    assert builder.build_serialized_network(network, config) is None
    profile = builder.create_optimization_profile()
    profile.set_shape("x", (1, 4), (2, 4), (8, 4))
    config.add_optimization_profile(profile)
    assert builder.build_serialized_network(network, config) is not None
    config.set_flag(fake_trt.BuilderFlag.FP16)
    assert builder.build_serialized_network(network, config) is None


# ---------------------------------------------------------------------------------------------- run
def test_prefill_and_decode_through_the_engines_match_torch(built, torch_runtime, jetson):
    llm, engines = _backend(built, torch_runtime, "llm")
    text = torch_runtime.model.config.text
    g = torch.Generator().manual_seed(7)
    embeds = torch.randn(30, text.hidden_size, generator=g)
    positions = (torch.arange(30) + 100).expand(3, 30).contiguous()
    results = []
    for backend in (torch_runtime.llm_backend, llm):
        cache = _filled_cache(text, 100, seed=2)
        mass = torch.full((text.num_hidden_layers, text.num_key_value_heads, CACHE_TOKENS), -1.0)
        hidden = backend.prefill(embeds, positions, cache, mass_out=mass)
        cache.commit(30)
        step = backend.prefill(embeds[:1], torch.full((3, 1), 130), cache)  # a decode step, P = 1
        results.append((hidden, cache.k[:, :, 100:131].clone(), mass, step))
    for ours, ref in zip(results[1], results[0]):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert engines.context("llm").active_optimization_profile == 0
    assert engines.context("llm_decode").active_optimization_profile == 1  # the decode step ran on profile 1


def test_vision_through_the_engine_matches_torch(built, torch_runtime, jetson):
    vision, _ = _backend(built, torch_runtime, "vision")
    pre = torch_runtime.make_preprocessor()
    rng = np.random.default_rng(0)
    pixels, grid = pre.pair(*(rng.integers(0, 256, (150, 200, 3), dtype=np.uint8) for _ in range(2)))
    torch.testing.assert_close(vision.encode(pixels, grid), torch_runtime.vision_backend.encode(pixels, grid),
                               atol=1e-4, rtol=0)


def test_engines_run_on_their_own_stream_ordered_with_torchs(built, torch_runtime, jetson):
    """NvInferRuntime.h enqueueV3: the default stream costs extra cudaDeviceSynchronize calls; torch's current
    stream is the default one. The engines' stream waits for torch's, and torch's for it after each run."""
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    engines.run("llm", *_llm_inputs(text, 8, 50))
    ran_on = engines.context("llm").streams
    assert ran_on and 0 not in ran_on
    own = engines.stream().cuda_stream
    assert FakeStream.waits == [(own, 0), (0, own)]


def test_chunk_outside_the_optimization_profile_is_named(built, torch_runtime, jetson):
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    with pytest.raises(EngineError, match=rf"embeds of shape \[{MAX_CHUNK + 1}, 64\].*profile 0 \(\[1, 64\] to "
                                          rf"\[{MAX_CHUNK}, 64\]\)"):
        engines.run("llm", *_llm_inputs(text, MAX_CHUNK + 1, 50))
    with pytest.raises(EngineError, match=r"embeds of shape \[2, 64\].*profile 1 \(\[1, 64\] to \[1, 64\]\)"):
        engines.run("llm_decode", *_llm_inputs(text, 2, 50))


def test_a_buffer_of_another_dtype_is_refused_not_misread(built, torch_runtime, jetson):
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    inputs, outputs = _llm_inputs(text, 8, 50)
    inputs["position_ids"] = inputs["position_ids"].to(torch.int32)  # the graph's are int64
    with pytest.raises(EngineError, match=r"llm: position_ids is torch.int32, the engine's position_ids is "
                                          r"torch.int64"):
        engines.run("llm", inputs, outputs)


def test_an_unaligned_input_is_copied_and_gives_the_aligned_result(built, torch_runtime, jetson):
    """setTensorAddress: "The pointer must have at least 256-byte alignment" — a contiguous view 4 floats into a
    larger tensor is not (not even at the 64 bytes checked here); it is copied, with the same result."""
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    inputs, outputs = _llm_inputs(text, 8, 50)
    engines.run("llm", inputs, outputs)
    expected = outputs["hidden"].clone()
    padded = torch.cat([torch.zeros(4), inputs["embeds"].reshape(-1)])
    inputs["embeds"] = padded[4:].view(8, text.hidden_size)
    assert inputs["embeds"].data_ptr() % CPU_ALIGNMENT and inputs["embeds"].is_contiguous()
    outputs["hidden"].zero_()
    engines.run("llm", inputs, outputs)
    torch.testing.assert_close(outputs["hidden"], expected, atol=0, rtol=0)


def test_an_unaligned_output_is_refused(built, torch_runtime, jetson):
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    inputs, outputs = _llm_inputs(text, 8, 50)
    outputs["hidden"] = torch.empty(8 * text.hidden_size + 4)[4:].view(8, text.hidden_size)
    with pytest.raises(ValueError, match=f"output hidden is not {CPU_ALIGNMENT}-byte aligned"):
        engines.run("llm", inputs, outputs)


def test_an_output_of_the_wrong_shape_is_refused_before_the_engine_writes(built, torch_runtime, jetson):
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    inputs, outputs = _llm_inputs(text, 8, 50)
    outputs["mass"] = torch.empty(text.num_hidden_layers, text.num_key_value_heads, CACHE_TOKENS)
    with pytest.raises(EngineError, match=rf"output mass is \[3, 2, {CACHE_TOKENS}\], the engine writes "
                                          rf"\[3, 2, {CACHE_TOKENS + 8}\]"):
        engines.run("llm", inputs, outputs)


def test_a_missing_input_is_named(built, torch_runtime, jetson):
    text = torch_runtime.model.config.text
    engines, _ = _engines(built)
    inputs, outputs = _llm_inputs(text, 8, 50)
    del inputs["visible"]
    with pytest.raises(EngineError, match=r"engine's inputs are \[.*'visible'\].*edgekv bound inputs \[(?!.*visible)"):
        engines.run("llm", inputs, outputs)


def test_an_unreadable_plan_is_named(built, jetson, tmp_path):
    engines, _ = _engines(built)
    plan = engines.manifest.path_of(engines.bundle, "vision")
    saved = plan.read_bytes()
    try:
        plan.write_bytes(b"\x00" * len(saved))
        with pytest.raises(EngineError, match="could not deserialize the vision engine"):
            engines.engine("vision")
    finally:
        plan.write_bytes(saved)


# ---------------------------------------------------------------------------------------------- int8
def test_int8_calibration_hands_tensorrt_the_network_inputs_dtype(built, jetson, monkeypatch, tmp_path):
    """IInt8Calibrator::getBatch: device memory "containing each network input data" — for an fp16 vision graph,
    fp16 values. (fp32 values read as fp16 would calibrate the ViT on garbage.) TensorRT 10.0: from 10.1 on the int8
    graph is quantized explicitly, no calibrator (tests/test_int8_qdq.py)."""
    import onnx
    from onnx import TensorProto, helper

    from edgekv.engines import tensorrt_backend
    from edgekv.engines.build import deployment
    from edgekv.model.config import ModelConfig

    config = built[0].with_overrides(model={"dtype": "fp16"}, engines={"precision": "int8",
                                                                        "int8_calibration": built[0].video.source})
    dep = deployment(config, "tensorrt", tensorrt_identity=("10.0.1", IDENTITY[1]), engine_dir=tmp_path / "cache")
    vision = ModelConfig.from_dir(dep.model_dir).vision
    patches = (RESOLUTION[0] // vision.patch_size) * (RESOLUTION[1] // vision.patch_size)  # one frame pair
    x = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT16, [patches, vision.patch_dim])
    y = helper.make_tensor_value_info("tokens", TensorProto.FLOAT16, [patches, vision.patch_dim])
    graph = helper.make_graph([helper.make_node("Identity", ["pixel_values"], ["tokens"])], "v", [x], [y])
    onnx.save(helper.make_model(graph), tmp_path / "vision.onnx")
    builders = []

    class RecordingBuilder(fake_trt.Builder):
        def __init__(self, logger) -> None:
            super().__init__(logger)
            builders.append(self)

    monkeypatch.setattr(fake_trt, "Builder", RecordingBuilder)
    monkeypatch.setattr(tensorrt_backend, "CALIBRATION_DEVICE", "cpu")
    files = {"vision": {"onnx": "vision.onnx"}}
    tensorrt_backend.build_engines(tmp_path, files, dep, config)
    reads = builders[0].calibration_reads
    assert len(reads) >= 1 and reads[0]["pixel_values"].dtype == np.float16
    expected = tensorrt_backend._calibration_pixels(config, dep)[0].to(torch.float16).numpy()
    np.testing.assert_array_equal(reads[0]["pixel_values"], expected)
    assert (tmp_path / "vision.int8.cache").read_bytes() == b"fake-calibration-table"
    assert files["vision"]["file"] == "vision.plan"



def test_the_runtime_aligns_to_tensorrts_256_bytes():
    from edgekv.engines import tensorrt_runtime

    assert tensorrt_runtime.ALIGNMENT == 256 and fake_trt.ALIGNMENT == 256
