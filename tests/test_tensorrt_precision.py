"""TensorRT precision choices per deployment dtype, through the stand-in ``helpers_tensorrt`` (TensorRT 10.3's
contract; no TensorRT or GPU here).

TF32: ``BuilderFlag.TF32`` is on in a new builder config (NvInfer.h 10.3: "Enabled by default"), and the stand-in
runs a plan built with it as TF32 tensor cores compute: every fp32 operand of an inner product rounded to 11
significant bits. fp32 deployments clear it (their parity with torch's fp32 is 1e-4: the engine-vs-torch tests of
``test_tensorrt_contract.py`` miss it by 3e-3 with TF32 left on); fp16 / bf16 ones keep it.

INT8 by calibration (``IInt8EntropyCalibrator2`` + ``BuilderFlag.INT8``) is deprecated since TensorRT 10.1:
the build says so, naming the version it ran on.
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import helpers_tensorrt as fake_trt  # noqa: E402
import test_tensorrt_contract as contract  # noqa: E402

from edgekv.engines.manifest import differences  # noqa: E402

built, jetson = contract.built, contract.jetson  # that file's fixtures: the stand-in build, the run-time stand-in
IDENTITY = contract.IDENTITY


def _matmul_graph(path, elem_type=1) -> None:
    import onnx
    from onnx import helper

    a = helper.make_tensor_value_info("a", elem_type, [4, 64])
    b = helper.make_tensor_value_info("b", elem_type, [64, 4])
    y = helper.make_tensor_value_info("y", elem_type, [4, 4])
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "g", [a, b], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), path)


def _run_plan(plan: bytes, feeds: dict[str, np.ndarray]) -> np.ndarray:
    engine = fake_trt.Runtime(fake_trt.Logger()).deserialize_cuda_engine(plan)
    return engine.session().run(["y"], feeds)[0]


def _tf32(x: np.ndarray) -> np.ndarray:
    """x rounded to TF32 (10 explicit mantissa bits), round to nearest even, by bit arithmetic."""
    bits = x.astype(np.float32).view(np.uint32)
    bits = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return bits.view(np.float32)


# ---------------------------------------------------------------------------------------------- the stand-in
def test_the_stand_in_starts_with_tf32_and_runs_it_as_tf32(tmp_path):
    """A new config has TF32 set (and only it); a plan built so rounds fp32 MatMul operands to TF32; cleared, the
    same plan computes in fp32."""
    _matmul_graph(tmp_path / "g.onnx")
    logger = fake_trt.Logger()
    builder = fake_trt.Builder(logger)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((4, 64)).astype(np.float32),
             "b": rng.standard_normal((64, 4)).astype(np.float32)}
    exact = feeds["a"].astype(np.float64) @ feeds["b"].astype(np.float64)
    results = {}
    for tf32 in (True, False):
        network = builder.create_network(1 << int(fake_trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        assert fake_trt.OnnxParser(network, logger).parse_from_file(str(tmp_path / "g.onnx"))
        config = builder.create_builder_config()
        assert config.get_flag(fake_trt.BuilderFlag.TF32) and config.flags == 1 << 6
        if not tf32:
            config.clear_flag(fake_trt.BuilderFlag.TF32)
            assert not config.get_flag(fake_trt.BuilderFlag.TF32) and config.flags == 0
        plan = builder.build_serialized_network(network, config)  # TF32 is no precision flag: strong typing keeps it
        assert plan is not None and json.loads(bytes(plan))["tf32"] is tf32
        results[tf32] = _run_plan(bytes(plan), feeds)
    rounded = _tf32(feeds["a"]).astype(np.float64) @ _tf32(feeds["b"]).astype(np.float64)
    np.testing.assert_allclose(results[True], rounded, atol=1e-5, rtol=0)
    np.testing.assert_allclose(results[False], exact, atol=1e-5, rtol=0)
    assert np.abs(results[True] - exact).max() > 1e-3  # what an fp32 engine with TF32 left on is off by


def test_the_stand_in_says_the_calibrator_is_deprecated():
    """pyCore.cpp 10.3: ``int8_calibrator`` is wrapped in ``utils::deprecateMember`` (a DeprecationWarning)."""
    config = fake_trt.Builder(fake_trt.Logger()).create_builder_config()
    with pytest.warns(DeprecationWarning, match=r"Deprecated in TensorRT 10\.1\. Superseded by explicit quant"):
        config.int8_calibrator = object()


def test_builder_flag_values_are_tensorrt_10_3s():
    """The values of NvInfer.h v10.3.0's ``enum class BuilderFlag`` (the stand-in had FP8 at 12, which is
    kREJECT_EMPTY_ALGORITHMS)."""
    flags = {flag.name: int(flag) for flag in fake_trt.BuilderFlag}
    assert {name: flags[name] for name in ("FP16", "INT8", "TF32", "FP8", "BF16", "INT4")} == {
        "FP16": 0, "INT8": 1, "TF32": 6, "FP8": 15, "BF16": 17, "INT4": 22}


# ---------------------------------------------------------------------------------------------- edgekv's builds
def test_fp32_engines_are_built_with_tf32_cleared(built):
    config, bundle, manifest, _ = built
    assert manifest.key["dtype"] == "fp32" and manifest.key["tf32"] is False
    for name, entry in manifest.files.items():
        assert entry["tf32"] is False, name
        plan = json.loads((bundle / entry["file"]).read_bytes())
        assert plan["tf32"] is False and "TF32" not in plan["flags"], name


def test_an_fp32_bundle_built_with_tf32_on_is_not_taken_for_current(built):
    """Bundles from before the flag was cleared carry no ``tf32`` in their key: they differ, and say how."""
    from edgekv.engines.build import deployment

    dep = deployment(built[0], "tensorrt", tensorrt_identity=IDENTITY)
    old = {name: value for name, value in dep.key.fields().items() if name != "tf32"}
    assert differences(old, dep.key.fields()) == [
        "TensorRT's TF32 for fp32 math (False: IEEE fp32; None: TensorRT's default, on): built for None, this "
        "deployment has False"]


def test_fp16_engines_keep_tf32_and_other_backends_have_no_tf32_field(built, jetson, tmp_path):
    """fp16: the graphs' fp32 products take fp16 operands (exact in TF32) or softmax probabilities kept fp32 for
    their range: TensorRT's default stays. onnxruntime bundles' keys are as before."""
    from edgekv.engines import tensorrt_backend
    from edgekv.engines.build import deployment

    config = built[0].with_overrides(model={"dtype": "fp16"})
    dep = deployment(config, "tensorrt", tensorrt_identity=IDENTITY, engine_dir=tmp_path / "cache")
    assert dep.key.tf32 is None and "tf32" not in dep.key.fields()
    assert "tf32" not in deployment(built[0], "onnxruntime").key.fields()
    _matmul_graph(tmp_path / "vision.onnx", elem_type=10)
    files = {"vision": {"onnx": "vision.onnx"}}
    tensorrt_backend.build_engines(tmp_path, files, dep, config)
    assert files["vision"]["tf32"] is True


# ---------------------------------------------------------------------------------------------- int8
def _int8_build(built, tmp_path, monkeypatch, version: str) -> list[warnings.WarningMessage]:
    from onnx import TensorProto

    from edgekv.engines import tensorrt_backend
    from edgekv.engines.build import deployment

    config = built[0].with_overrides(model={"dtype": "fp16"}, engines={"precision": "int8",
                                                                        "int8_calibration": built[0].video.source})
    dep = deployment(config, "tensorrt", tensorrt_identity=(version, IDENTITY[1]), engine_dir=tmp_path / "cache")
    pixels = tensorrt_backend._calibration_pixels(config, dep)[0]
    import onnx
    from onnx import helper

    x = helper.make_tensor_value_info("pixel_values", TensorProto.FLOAT16, list(pixels.shape))
    y = helper.make_tensor_value_info("tokens", TensorProto.FLOAT16, list(pixels.shape))
    graph = helper.make_graph([helper.make_node("Identity", ["pixel_values"], ["tokens"])], "v", [x], [y])
    onnx.save(helper.make_model(graph), tmp_path / "vision.onnx")
    monkeypatch.setattr(tensorrt_backend, "CALIBRATION_DEVICE", "cpu")
    monkeypatch.setattr(fake_trt, "__version__", version)
    files = {"vision": {"onnx": "vision.onnx"}}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tensorrt_backend.build_engines(tmp_path, files, dep, config)
    assert files["vision"]["file"] == "vision.plan"
    return [w for w in caught if issubclass(w.category, FutureWarning)]


def test_implicit_int8_on_tensorrt_10_0_is_not_called_deprecated(built, jetson, monkeypatch, tmp_path):
    assert _int8_build(built, tmp_path, monkeypatch, "10.0.1") == []
