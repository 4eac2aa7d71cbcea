"""The INT8 vision graph by explicit quantization (``engines/int8_qdq.py``): its Q/DQ structure, its numerics under
onnxruntime against the float graph and torch on frames it was not calibrated on, and ``engines.precision: int8``
on TensorRT >= 10.1 building it strongly typed (through the stand-in ``helpers_tensorrt``; no TensorRT here).

Bounds. The Q/DQ graph computes what ``int8_qdq.fake_quantized`` computes in torch; held against the fp32 torch
tower, its per-token error is at most 2x the fake-quantized torch tower's (DESIGN: kernel tolerance rule). INT8
itself moves the tokens: measured on this random-weight checkpoint (18 held-out pairs) the smallest per-token cosine
to the fp32 tower was 0.9995 (fp32 and fp16 graphs); the test holds it to 0.99 (the trained toy: 0.993, README).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import helpers_tensorrt as fake_trt  # noqa: E402
import test_tensorrt_contract as contract  # noqa: E402

from edgekv.engines import int8_qdq  # noqa: E402
from edgekv.engines.manifest import EngineError, differences  # noqa: E402

jetson = contract.jetson  # the run-time stand-in fixture (CPU tensors for device memory, 64-byte alignment)

RESOLUTION = [112, 168]  # grid 8 x 12: edge windows padded
GRID = (1, 8, 12)
SOURCE = "synthetic:shapes?size=200x150&fps=4&frames=80"
CALIBRATION_PAIRS = 12  # the first pairs calibrate; the rest are held out
COSINE_MIN = 0.99
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


def _cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


def _relative(a: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Per-token relative error ||a - ref|| / ||ref||."""
    return (a.float() - ref.float()).norm(dim=-1) / ref.float().norm(dim=-1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from edgekv.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("qdq") / "ckpt", preset="test-stream", seed=3)


@pytest.fixture(scope="module")
def frames(checkpoint):
    from edgekv.config import EdgeKVConfig
    from edgekv.model.config import ModelConfig

    config = EdgeKVConfig().with_overrides(video={"resolution": RESOLUTION, "fps": 2.0},
                                           engines={"int8_calibration": SOURCE})
    pairs = int8_qdq.calibration_pixels(config, ModelConfig.from_dir(checkpoint).vision)
    assert len(pairs) > CALIBRATION_PAIRS + 4
    return pairs[:CALIBRATION_PAIRS], pairs[CALIBRATION_PAIRS:]


@pytest.fixture(scope="module", params=sorted(DTYPES))
def graphs(request, checkpoint, frames, tmp_path_factory):
    """(dtype, model, Q/DQ entry, Q/DQ session, float session, plan) for one graph dtype."""
    import onnxruntime as ort

    from edgekv.engines.export import export_vision
    from edgekv.engines.graphs import VisionGraph
    from edgekv.model import load_pretrained

    dtype = DTYPES[request.param]
    model = load_pretrained(checkpoint, dtype=dtype, device=torch.device("cpu")).eval()
    out = tmp_path_factory.mktemp(f"qdq-{request.param}")
    entry = int8_qdq.export_vision_qdq(model, GRID, out / "vision.onnx", frames[0])
    export_vision(model, GRID, out / "float.onnx")
    graph = VisionGraph(model.visual, GRID).eval()
    plan = int8_qdq.make_plan(model.visual, lambda p: graph(p.to(dtype)), frames[0])
    sessions = [ort.InferenceSession(str(out / name), providers=["CPUExecutionProvider"])
                for name in ("vision.onnx", "float.onnx")]
    return dtype, model, entry, out / "vision.onnx", sessions, plan


# ---------------------------------------------------------------------------------------------- weights
def test_weights_are_symmetric_int8_per_output_channel():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 40, generator=g)
    weight[2] = 0.0  # a dead channel: its scale stays positive (TensorRT's parser wants every scale > 0)
    weight[4] *= 300.0  # one loud channel does not coarsen the others
    for dtype in (torch.float32, torch.float16):
        codes, scale = int8_qdq.quantize_weight(weight.to(dtype), dtype)
        assert codes.dtype == torch.int8 and scale.dtype == dtype and scale.shape == (6,)
        assert (scale.float() > 0).all() and int(codes.abs().max()) <= 127 and not codes[2].any()
        live = [0, 1, 3, 4, 5]
        assert (codes[live].abs().amax(dim=1) >= 126).all()  # each channel spans its own range
        error = (codes.float() * scale.float()[:, None] - weight.to(dtype).float()).abs()
        assert (error <= scale.float()[:, None] * 0.5 + 1e-3 * weight.abs()).all()  # half a step (+ fp16 scale)


def test_fake_quantize_rounds_half_to_even_and_saturates():
    scale = torch.tensor(0.5)
    x = torch.tensor([0.25, 0.75, -0.25, 100.0, -100.0])  # 0.5 / 1.5 / -0.5 steps, then far outside
    assert int8_qdq.fake_quantize(x, scale).tolist() == [0.0, 1.0, -0.0, 63.5, -64.0]


# ---------------------------------------------------------------------------------------------- the graph
def test_graph_quantizes_the_block_products_and_leaves_the_rest_in_float(graphs):
    import onnx
    from onnx import numpy_helper

    dtype, model, entry, path, _, _ = graphs
    proto = onnx.load(str(path))
    assert [(o.domain, o.version) for o in proto.opset_import if o.domain in ("", "ai.onnx")] == [("", 19)]
    assert entry["opset"] == 19 and entry["files"] == ["vision.onnx"]
    assert entry["quantization"]["linears"] == sorted(int8_qdq.block_linears(model.visual))
    inits = {init.name: init for init in proto.graph.initializer}
    producers = {out: node for node in proto.graph.node for out in node.output}
    graph_type = {torch.float32: 1, torch.float16: 10}[dtype]
    blocks = len(model.visual.blocks)
    counts = {op: sum(n.op_type == op for n in proto.graph.node) for op in ("QuantizeLinear", "DequantizeLinear")}
    # four distinct inputs per block (qkv, proj, gate = up, down); a weight DQ per linear
    assert counts == {"QuantizeLinear": 4 * blocks, "DequantizeLinear": 4 * blocks + 5 * blocks}
    for node in proto.graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            scale, zero = inits[node.input[1]], inits[node.input[2]]
            assert scale.data_type == graph_type and (numpy_helper.to_array(scale).astype(np.float32) > 0).all()
            assert zero.data_type == 3 and not numpy_helper.to_array(zero).any()  # INT8 zeros: symmetric
    for node in proto.graph.node:
        if node.op_type != "Gemm":
            continue
        weight = node.input[1]
        if weight in inits:  # float products: the patch embedding and the merger, nothing else
            assert weight.startswith(("tower.patch_embed.", "tower.merger.")), weight
            continue
        dq = producers[weight]
        assert dq.op_type == "DequantizeLinear" and inits[dq.input[0]].data_type == 3  # INT8 weights
        assert {a.name: a.i for a in dq.attribute}["axis"] == 0  # per output channel of W [out, in]
        x = producers[node.input[0]]
        assert x.op_type == "DequantizeLinear" and producers[x.input[0]].op_type == "QuantizeLinear"
    assert not {f"tower.{name}.weight" for name in int8_qdq.block_linears(model.visual)} & set(inits)  # no float copy


def test_qdq_tokens_on_held_out_frames_stay_near_the_float_graph_and_torch(graphs, frames):
    """Held out: frame pairs the scales were not computed on. The Q/DQ graph under onnxruntime against the float
    graph and the fp32 torch tower: every token's cosine >= 0.99, and its error no more than 2x what torch computes
    for the same quantization (``fake_quantized``), both against fp32 torch."""
    from edgekv.engines.graphs import VisionGraph

    dtype, model, entry, _, (qdq, floats), plan = graphs
    reference = VisionGraph(model.visual, GRID).eval()
    numpy_dtype = np.float32 if dtype == torch.float32 else np.float16
    worst_cosine, ours, torch_quant = 1.0, [], []
    for pixels in frames[1]:
        x = pixels.to(dtype)
        tokens = torch.from_numpy(qdq.run(None, {"pixel_values": x.numpy().astype(numpy_dtype)})[0]).float()
        float_graph = torch.from_numpy(floats.run(None, {"pixel_values": x.numpy()})[0]).float()
        with torch.no_grad():
            model.visual.float()
            try:
                exact = reference(pixels.float()).float()
                with int8_qdq.fake_quantized(model.visual, plan):
                    fake = reference(pixels.float()).float()
            finally:
                model.visual.to(dtype)
        worst_cosine = min(worst_cosine, float(_cosine(tokens, float_graph).min()), float(_cosine(tokens, exact).min()))
        ours.append(_relative(tokens, exact))
        torch_quant.append(_relative(fake, exact))
    ours, torch_quant = torch.cat(ours), torch.cat(torch_quant)
    assert worst_cosine >= COSINE_MIN
    assert float(ours.median()) <= 2 * float(torch_quant.median())
    assert float(ours.max()) <= 2 * float(torch_quant.max())
    assert float(torch_quant.median()) > 1e-3  # INT8 did move the tokens: the graph is quantized, not float
    assert entry["quantization"]["token_cosine_min"] >= COSINE_MIN  # what the build reports in the manifest


def test_a_graph_the_rewrite_does_not_recognise_is_refused_naming_the_weight(graphs):
    import onnx

    _, _, _, path, _, plan = graphs
    proto = onnx.load(str(path))  # already rewritten: the block weights are gone
    with pytest.raises(EngineError, match=r"tower\.blocks\.0\.attn\.qkv\.weight is read by no node"):
        int8_qdq.insert_qdq(proto, plan)
    proto.opset_import[0].version = 18
    with pytest.raises(EngineError, match=r"opset 18; fp16 Q/DQ needs opset 19"):
        int8_qdq.insert_qdq(proto, plan)


# ---------------------------------------------------------------------------------------------- the stand-in
def _qdq_graph(path, zero_point: int | None = 0, zero_type: int = 3, scale: float = 0.05) -> None:
    import onnx
    from onnx import helper

    x = helper.make_tensor_value_info("x", 1, [2, 4])
    y = helper.make_tensor_value_info("y", 1, [2, 4])
    inits = [helper.make_tensor("s", 1, [], [scale])]
    names = ["x", "s"]
    if zero_point is not None:
        inits.append(helper.make_tensor("z", zero_type, [], [zero_point]))
        names.append("z")
    nodes = [helper.make_node("QuantizeLinear", names, ["q"], name="q"),
             helper.make_node("DequantizeLinear", ["q", *names[1:]], ["y"], name="dq")]
    graph = helper.make_graph(nodes, "g", [x], [y], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)]), path)


@pytest.mark.parametrize("kwargs, message", [
    ({}, None),
    ({"zero_point": 3}, "only supports symmetric quantization"),
    ({"scale": -0.05}, "Scale coefficients must all be positive"),
    ({"zero_point": None}, "no zero point: TensorRT quantizes to INT8, ONNX"),
    ({"zero_type": 2}, "TensorRT uses INT8 instead"),
])
def test_the_stand_in_parses_qdq_as_tensorrts_parser_does(tmp_path, kwargs, message):
    _qdq_graph(tmp_path / "g.onnx", **kwargs)
    logger = fake_trt.Logger()
    network = fake_trt.Builder(logger).create_network(1 << int(fake_trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = fake_trt.OnnxParser(network, logger)
    parsed = parser.parse_from_file(str(tmp_path / "g.onnx"))
    if message is None:
        assert parsed and network.qdq_nodes == 2
    else:
        assert not parsed and message in str(parser.get_error(0))


# ---------------------------------------------------------------------------------------------- the build
@pytest.fixture(scope="module")
def trt_built(checkpoint, tmp_path_factory):
    """``build(config, "tensorrt")`` of an fp16 int8 deployment with the stand-in as TensorRT 10.3.0."""
    import yaml

    from edgekv.config import load_config

    root = tmp_path_factory.mktemp("trt-int8")
    config = {
        "model": {"path": str(checkpoint), "dtype": "fp16", "device": "cpu"},
        "video": {"source": SOURCE, "fps": 2.0, "resolution": RESOLUTION},
        "cache": {"policy": "infinipot_v", "max_tokens": 512, "text_reserve_tokens": 96, "sinks": 32},
        "engines": {"vision": "tensorrt", "llm": "tensorrt", "engine_dir": str(root / "cache"), "max_chunk_tokens": 40,
                    "precision": "int8"},
    }
    (root / "deploy.yaml").write_text(yaml.safe_dump(config))
    # given after loading: a YAML file's int8_calibration is resolved as a path even when it is a synthetic: spec
    # (edgekv/config.py ``_resolve_paths``; reported, outside this area)
    config = load_config(root / "deploy.yaml").with_overrides(engines={"int8_calibration": SOURCE})
    bundle, manifest = contract.build_as_on_a_jetson(config)
    return config, bundle, manifest


def test_int8_on_tensorrt_10_3_builds_the_qdq_graph_strongly_typed_without_a_calibrator(trt_built):
    config, bundle, manifest = trt_built
    assert manifest.key["precision"] == "int8" and manifest.key["int8"] == "qdq"
    vision = json.loads((bundle / "vision.plan").read_bytes())
    assert vision["strongly_typed"] and vision["flags"] == ["TF32"]  # no INT8 / FP16 flag
    blocks = 4  # test-stream's ViT depth: down_proj in float (the default), 4 weight DQs, 3 input Q/DQ pairs a block
    quantization = manifest.files["vision"]["quantization"]
    assert vision["qdq_nodes"] == blocks * (4 + 2 * 3) == len(quantization["linears"]) + 24
    assert quantization["float_products"] == ["down_proj"] and manifest.key["int8_float_products"] == ["down_proj"]
    assert not any(name.endswith("down_proj") for name in quantization["linears"])
    assert not (bundle / "vision.int8.cache").exists()  # no calibrator ran
    llm = json.loads((bundle / "llm.plan").read_bytes())
    assert llm["strongly_typed"] and llm["qdq_nodes"] == 0  # the LLM stays in model.dtype
    assert manifest.files["vision"]["quantization"]["calibration_pairs"] > 0


def test_the_int8_vision_engine_runs_and_stays_near_torch(trt_built, jetson):
    from edgekv.engines.build import deployment
    from edgekv.engines.graphs import VisionGraph
    from edgekv.engines.manifest import locate
    from edgekv.engines.tensorrt_runtime import _Engines
    from edgekv.model import load_pretrained

    config = trt_built[0]
    dep = deployment(config, "tensorrt", tensorrt_identity=contract.IDENTITY)
    bundle, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
    engines = _Engines(bundle, manifest, dep.hint, device=torch.device("cpu"))
    model = load_pretrained(dep.model_dir, dtype=torch.float32, device=torch.device("cpu")).eval()
    reference = VisionGraph(model.visual, GRID).eval()
    pixels = int8_qdq.calibration_pixels(config, model.config.vision)[-1]  # a late pair
    tokens = torch.empty(GRID[1] * GRID[2] // 4, model.config.vision.out_hidden_size, dtype=torch.float16)
    engines.run("vision", {"pixel_values": pixels.to(torch.float16).contiguous()}, {"tokens": tokens})
    with torch.no_grad():
        exact = reference(pixels.float())
    assert float(_cosine(tokens, exact).min()) >= COSINE_MIN


def test_the_key_tells_qdq_from_calibrator_bundles_and_10_0_keeps_the_calibrator(trt_built, monkeypatch, tmp_path):
    """A bundle built by TensorRT 10.0's calibrator is not taken for a Q/DQ one (nor the reverse): the key's ``int8``
    field says which, and a 10.0 build still runs the calibrator on a weakly typed network."""
    import onnx
    from onnx import TensorProto, helper

    from edgekv.engines import tensorrt_backend
    from edgekv.engines.build import deployment

    config = trt_built[0]
    qdq = deployment(config, "tensorrt", tensorrt_identity=contract.IDENTITY)
    old = deployment(config, "tensorrt", tensorrt_identity=("10.0.1", contract.IDENTITY[1]))
    assert (qdq.key.int8, old.key.int8) == ("qdq", "calibrator")
    assert "INT8 method" in " ".join(differences(old.key.fields(), qdq.key.fields()))
    patches = GRID[1] * GRID[2]
    x = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT16, [patches, 1176])
    y = helper.make_tensor_value_info("tokens", TensorProto.FLOAT16, [patches, 1176])
    graph = helper.make_graph([helper.make_node("Identity", ["pixel_values"], ["tokens"])], "v", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "vision.onnx")
    with pytest.MonkeyPatch.context() as mp:
        contract._as_if_on_a_jetson(mp)
        mp.setattr(tensorrt_backend, "CALIBRATION_DEVICE", "cpu")
        mp.setattr(fake_trt, "ALIGNMENT", 64)  # CPU tensors stand for device buffers: torch aligns them to 64
        files = {"vision": {"onnx": "vision.onnx"}}
        tensorrt_backend.build_engines(tmp_path, files, old, config)
        plan = json.loads((tmp_path / "vision.plan").read_bytes())
        assert not plan["strongly_typed"] and {"INT8", "FP16"} <= set(plan["flags"])
        assert (tmp_path / "vision.int8.cache").read_bytes() == b"fake-calibration-table"
        with pytest.raises(EngineError, match=r"int8 on TensorRT 10\.3\.0 builds the Q/DQ vision graph"):
            tensorrt_backend.build_engines(tmp_path, {"vision": {"onnx": "vision.onnx"}}, qdq, config)


def test_int8_on_tensorrt_11_is_built_as_qdq_and_fp8_is_still_refused(trt_built):
    from edgekv.engines import tensorrt_backend
    from edgekv.engines.build import deployment

    config = trt_built[0]
    assert deployment(config, "tensorrt", tensorrt_identity=("11.0.0", "Thor (sm_110)")).key.int8 == "qdq"
    fp8 = deployment(config.with_overrides(engines={"precision": "fp8"}), "tensorrt",
                     tensorrt_identity=contract.IDENTITY)
    with pytest.MonkeyPatch.context() as mp:
        contract._as_if_on_a_jetson(mp)
        with pytest.raises(EngineError, match=r"fp8 on TensorRT 10\.3\.0 needs an FP8 Q/DQ ONNX graph"):
            tensorrt_backend.build_engines(trt_built[1], {}, fp8, config)


def test_int8_without_calibration_frames_fails_before_any_export(trt_built, tmp_path):
    import edgekv.model as model_module
    from edgekv.engines import build as build_module

    config = trt_built[0].with_overrides(engines={"int8_calibration": None, "engine_dir": str(tmp_path)})
    with pytest.MonkeyPatch.context() as mp:
        contract._as_if_on_a_jetson(mp)
        mp.setattr(model_module, "load_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
        with pytest.raises(EngineError, match=r"engines\.int8_calibration: int8 needs calibration frames"):
            build_module.build(config, "tensorrt", progress=False)


def test_the_calibration_input_and_the_float_products_are_in_the_key(trt_built, tmp_path):
    """Another calibration spec, another clip's content at the same path, another sampling rate or another
    ``int8_float_products`` is another bundle (a build does not call the old one up to date), and a load names the
    field; a copy of the same clip elsewhere, or touched, keeps the engines."""
    import os
    import shutil

    import cv2

    from edgekv.engines.build import deployment

    config = trt_built[0]

    def key(**engines):
        wanted = config.with_overrides(engines=engines) if engines else config
        return deployment(wanted, "tensorrt", tensorrt_identity=contract.IDENTITY).key

    def clip(path, shade):
        writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (64, 48))
        for index in range(8):
            writer.write(np.full((48, 64, 3), (shade + index) % 256, np.uint8))
        writer.release()
        return str(path)

    base = key()
    assert base.int8_calibration and base.int8_float_products == ("down_proj",)
    assert trt_built[2].key == base.fields()  # what the build recorded is what a load computes
    other = key(int8_calibration=SOURCE.replace("frames=80", "frames=81"))
    assert other.digest() != base.digest()
    assert "INT8 calibration frames" in " ".join(differences(base.fields(), other.fields()))
    slower = deployment(config.with_overrides(video={"fps": 1.0}), "tensorrt", tensorrt_identity=contract.IDENTITY)
    assert slower.key.int8_calibration != base.int8_calibration
    floats = key(int8_float_products=[])
    assert floats.int8_float_products == () and floats.digest() != base.digest()
    assert "left in float" in " ".join(differences(base.fields(), floats.fields()))
    assert key(int8_float_products=["down_proj", "qkv"]).digest() == \
        key(int8_float_products=["qkv", "down_proj"]).digest()

    path = clip(tmp_path / "calib.avi", 10)
    first = key(int8_calibration=path)
    copy = tmp_path / "elsewhere" / "calib.avi"
    copy.parent.mkdir()
    shutil.copy(path, copy)
    os.utime(path, (1, 1))  # touched: same frames
    assert key(int8_calibration=str(copy)).int8_calibration == first.int8_calibration
    assert key(int8_calibration=path).int8_calibration == first.int8_calibration
    clip(tmp_path / "calib.avi", 90)  # new frames at the same path
    assert key(int8_calibration=path).int8_calibration != first.int8_calibration
    missing = key(int8_calibration=str(tmp_path / "gone.avi")).int8_calibration
    assert missing.endswith("gone.avi (not found)")


def test_float_products_stay_float_in_the_graph(checkpoint, frames, tmp_path):
    import onnx

    from edgekv.model import load_pretrained

    model = load_pretrained(checkpoint, dtype=torch.float32, device=torch.device("cpu")).eval()
    entry = int8_qdq.export_vision_qdq(model, GRID, tmp_path / "vision.onnx", frames[0][:2], ["down_proj", "qkv"])
    assert entry["quantization"]["float_products"] == ["down_proj", "qkv"]
    inits = {init.name for init in onnx.load(str(tmp_path / "vision.onnx")).graph.initializer}
    blocks = len(model.visual.blocks)
    for index in range(blocks):
        assert {f"tower.blocks.{index}.mlp.down_proj.weight", f"tower.blocks.{index}.attn.qkv.weight"} <= inits
        assert f"tower.blocks.{index}.mlp.up_proj.weight_int8" in inits
    with pytest.raises(EngineError, match="'bogus'|bogus is not a ViT block product"):
        int8_qdq.block_linears(model.visual, ["bogus"])


@pytest.mark.parametrize("products, message", [
    (["down"], r"engines\.int8_float_products: 'down' is not a ViT block product"),
    (["qkv", "proj", "gate_proj", "up_proj", "down_proj"], r"every product left in float quantizes nothing"),
])
def test_bad_float_products_are_refused_naming_the_field(products, message):
    from edgekv.config import ConfigError, EdgeKVConfig

    with pytest.raises(ConfigError, match=message):
        EdgeKVConfig().with_overrides(engines={"int8_float_products": products})
