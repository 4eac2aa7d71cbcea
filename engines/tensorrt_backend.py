"""The ``tensorrt`` backend: TensorRT 10+ engines built from the exported ONNX graphs, run in place.

    engines: {vision: tensorrt, llm: tensorrt, precision: fp16}      # then: edgekv build --backend tensorrt

Builder (``build_engines``, called by ``edgekv build``): the ONNX parser reads each graph (external data
included) into a strongly typed network; the ``llm`` engine gets two optimization profiles — prefill chunks,
P in ``[1, max_chunk_tokens]`` with the frame pair as the optimum, and decode, P = 1 — used by two execution
contexts of the one engine (one copy of the weights); everything else is static. The
precision is the graphs' dtype (``engines.precision`` fp32 / fp16 / bf16 must equal ``model.dtype``; int8 =
the vision engine in INT8 with scales from ``engines.int8_calibration`` frames — from TensorRT 10.1 on an
explicitly quantized (Q/DQ) graph built strongly typed, on 10.0 the entropy calibrator below — and the LLM
engines in ``model.dtype``), a timing cache per
(TensorRT version, GPU) under the engine dir that every later build reuses, and one serialized plan per graph next
to its ONNX file. The plan is only valid for the TensorRT version and GPU that built it, which is why both are
part of the bundle key (``manifest.py``).

TF32, per precision: TensorRT's ``BuilderFlag.TF32`` is on by default ("Allow (but not require) computations on
tensors of type DataType::kFLOAT to use TF32 ... Enabled by default", NvInfer.h 10.3) and is no storage type, so a
strongly typed network keeps it; on Orin (Ampere) every fp32 MatMul may then round its operands to 11 significant
bits (the stand-in's emulation of that put the test model's fp32 engines 3e-3 from torch's fp32, against the 1e-4
they are held to; not measured on a device). fp32 deployments clear it
(the build key says ``tf32: false``, so fp32 plans built before with TF32 on are rebuilt); fp16 / bf16 engines keep
it: their only fp32 products are the attention islands of ``graphs.py``, whose operands are fp16 / bf16 values
(exact in TF32) and the fp32 probabilities, kept fp32 for their range, which TF32 has. INT8 by calibration is
TensorRT's implicit quantization, deprecated since 10.1 and removed in 11: edgekv uses it on 10.0 only; from 10.1
on the vision graph carries its INT8 as QuantizeLinear/DequantizeLinear pairs (``int8_qdq.py``, key ``int8: qdq``).

Runner (``tensorrt_runtime``): ``IExecutionContext.execute_async_v3`` on a CUDA stream of the engines' own
(not the default stream) with every I/O tensor bound by address (``set_tensor_address``) — the session's KV
cache buffers and torch-allocated outputs — so nothing is copied to or from the host.

What was run where: this module was written against the TensorRT 10 Python API documentation; neither a
Jetson nor TensorRT was available on the machines edgekv's CI and development used, so the tests that
build and run engines (``tests/test_engines.py``, marked ``gpu`` and ``tensorrt``) were skipped there.
The CPU-side parts — the install hint, the build key and manifest checks — are tested everywhere, and the calls
into TensorRT are driven through a stand-in module written from TensorRT 10.3's headers and bindings
(``tests/helpers_tensorrt.py``, ``tests/test_tensorrt_contract.py``): names, argument order, return values and
the documented refusals, not TensorRT's kernels.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edgekv.engines.manifest import EngineError

if TYPE_CHECKING:  # build.py calls this module; the type only names what it passes
    from edgekv.engines.build import Deployment

INSTALL_HINT = (
    "TensorRT's Python bindings are not installed. On a Jetson (JetPack 6, TensorRT 10): "
    "sudo apt install python3-libnvinfer python3-libnvinfer-dev (create the venv with --system-site-packages "
    "to see them); on an x86 machine with an NVIDIA GPU: pip install tensorrt. Or choose engines: onnxruntime"
)
WORKSPACE_BYTES = 4 * 1024 ** 3
CALIBRATION_DEVICE = "cuda"  # where get_batch puts a calibration batch (TensorRT reads device memory)


def require():
    """The ``tensorrt`` module and a CUDA device, or an EngineError that says what to install."""
    try:
        import tensorrt
    except ImportError:
        raise EngineError(f"engines: tensorrt was asked for, but {INSTALL_HINT}") from None
    if not torch.cuda.is_available():
        raise EngineError("engines: tensorrt needs a CUDA GPU and a CUDA build of torch (on a Jetson, NVIDIA's "
                          "JetPack torch wheel); none is visible here")
    major = int(tensorrt.__version__.split(".")[0])
    if major < 10:
        raise EngineError(f"engines: TensorRT {tensorrt.__version__} found; edgekv needs TensorRT 10 or newer "
                          f"(JetPack 6.x ships 10.x)")
    return tensorrt


def identity() -> tuple[str, str]:
    """(TensorRT version, "GPU name (sm_XY)") — the two things a plan file is tied to."""
    trt = require()
    major, minor = torch.cuda.get_device_capability()
    return trt.__version__, f"{torch.cuda.get_device_name()} (sm_{major}{minor})"


def _logger(trt):
    return trt.Logger(trt.Logger.WARNING)


# trt.DataType (by name: the enum's values are TensorRT's own) -> the torch dtype of a buffer bound to that tensor
TORCH_DTYPES = {"FLOAT": torch.float32, "HALF": torch.float16, "BF16": torch.bfloat16, "INT8": torch.int8,
                "UINT8": torch.uint8, "INT32": torch.int32, "INT64": torch.int64, "BOOL": torch.bool}


def torch_dtype(dtype) -> torch.dtype:
    """The torch dtype of a ``trt.DataType`` (FP8 and INT4 tensors have none: edgekv binds neither)."""
    name = getattr(dtype, "name", str(dtype)).rsplit(".", 1)[-1]
    if name not in TORCH_DTYPES:
        raise EngineError(f"a TensorRT tensor of type {name} has no torch dtype edgekv can bind")
    return TORCH_DTYPES[name]


class FrameCalibrator:
    """INT8 entropy calibration of the vision graph from real frames (TensorRT ``IInt8EntropyCalibrator2``).

    Frames come from ``engines.int8_calibration`` (a video file or any ``video.source`` spec), preprocessed
    exactly as the session does, as frame pairs; the calibration cache is kept next to the plan so a rebuild
    skips the pass. ``get_batch`` hands TensorRT the address of device memory holding the network input as the
    network declares it (``dtype``: the vision graph's input is in ``model.dtype``, fp16 on a Jetson; TensorRT
    reads the bytes as that type), one batch on the device at a time.
    """

    def __init__(self, trt, pixel_batches: list[torch.Tensor], cache_file: Path, input_name: str,
                 dtype: torch.dtype, device: torch.device | str = "cuda") -> None:
        base = trt.IInt8EntropyCalibrator2

        class _Calibrator(base):  # TensorRT calls these from C++; keep the current batch alive on self
            def __init__(inner) -> None:
                base.__init__(inner)
                inner.batches = pixel_batches
                inner.index = 0
                inner.current = None

            def get_batch_size(inner) -> int:
                return 1

            def get_batch(inner, names):  # names == [input_name]: build_engines checked the network's inputs
                if inner.index >= len(inner.batches):
                    inner.current = None
                    return None
                inner.current = inner.batches[inner.index].to(device=device, dtype=dtype).contiguous()
                inner.index += 1
                return [int(inner.current.data_ptr())]

            def read_calibration_cache(inner):
                return cache_file.read_bytes() if cache_file.is_file() else None

            def write_calibration_cache(inner, cache) -> None:
                cache_file.write_bytes(bytes(cache))

        self.calibrator = _Calibrator()


def _calibration_pixels(config, dep: Deployment, limit: int = 64) -> list[torch.Tensor]:
    """The calibrator's frame pairs: ``int8_qdq.calibration_pixels``, the same frames the Q/DQ scales come from."""
    from edgekv.engines.int8_qdq import calibration_pixels

    return calibration_pixels(config, dep.model_config.vision, limit)


def _network_flags(trt, strongly_typed: bool) -> int:
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 1 << int(flag) if strongly_typed and flag is not None else 0


def build_engines(bundle: Path, files: dict, dep: Deployment, config) -> None:
    """Compile every ONNX graph of ``files`` into ``<graph>.plan``; updates each entry's ``file``.

    Networks are strongly typed: each tensor keeps the dtype the ONNX graph gives it, so the engine runs in
    ``model.dtype`` (the dtype of the cache it binds) and the graphs' explicit fp32 attention stays fp32.
    ``int8`` from TensorRT 10.1 on (``dep.key.int8 == "qdq"``): the vision graph already holds its INT8 as
    QuantizeLinear/DequantizeLinear pairs (``int8_qdq.py``) and is built strongly typed like the rest, no
    precision flag, no calibrator. The one weakly typed build is ``int8`` on TensorRT 10.0 (``"calibrator"``):
    the vision engine with INT8 + FP16 flags and the entropy calibrator (implicit quantization, deprecated in 10.1).
    """
    trt = require()
    logger = _logger(trt)
    precision = dep.key.precision
    if precision == "fp8":
        raise EngineError(f"engines.precision: fp8 on TensorRT {dep.key.tensorrt_version} needs an FP8 Q/DQ ONNX "
                          f"graph, which `edgekv build` does not produce; use int8 (Q/DQ) or {dep.key.dtype} "
                          f"(= model.dtype)")
    if precision == "int8" and dep.key.int8 == "qdq" and "quantization" not in files.get("vision", {}):
        raise EngineError(f"{bundle / 'vision.onnx'}: int8 on TensorRT {dep.key.tensorrt_version} builds the Q/DQ "
                          f"vision graph `edgekv build` exports, and this one has no Q/DQ nodes. {dep.hint}")
    timing_file = dep.engine_dir / f"timing-trt{dep.key.tensorrt_version}-{_slug(dep.key.gpu)}.cache"
    builder = trt.Builder(logger)
    for name, entry in files.items():
        implicit_int8 = dep.key.int8 == "calibrator" and name == "vision"
        network = builder.create_network(_network_flags(trt, strongly_typed=not implicit_int8))
        parser = trt.OnnxParser(network, logger)
        onnx_path = bundle / entry["onnx"]
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise EngineError(f"{onnx_path}: TensorRT's ONNX parser failed: {errors}")
        cfg = builder.create_builder_config()
        cfg.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
        if dep.key.tf32 is False:  # fp32 engines: IEEE fp32 inner products, as torch computes them (see above)
            cfg.clear_flag(trt.BuilderFlag.TF32)
        entry["tf32"] = bool(cfg.get_flag(trt.BuilderFlag.TF32))
        if implicit_int8:  # TensorRT 10.0: post-training INT8 of the ViT by its calibrator; fp16 where INT8 cannot go
            cfg.set_flag(trt.BuilderFlag.INT8)
            cfg.set_flag(trt.BuilderFlag.FP16)
            if network.num_inputs != 1:
                raise EngineError(f"{onnx_path}: INT8 calibration feeds one input (the frame pair's pixels); this "
                                  f"vision graph has {network.num_inputs}. {dep.hint}")
            pixels = network.get_input(0)
            calibrator = FrameCalibrator(trt, _calibration_pixels(config, dep), bundle / "vision.int8.cache",
                                         pixels.name, torch_dtype(pixels.dtype), CALIBRATION_DEVICE)
            cfg.int8_calibrator = calibrator.calibrator
        # The LLM graphs stay in model.dtype under int8: activation-calibrated INT8 of a decoder loses
        # accuracy, and the weight-only INT8/INT4 that speeds up decode needs Q/DQ nodes in the graph.
        timing = cfg.create_timing_cache(timing_file.read_bytes() if timing_file.is_file() else b"")
        cfg.set_timing_cache(timing, ignore_mismatch=False)
        if name == "llm":  # profile 0: prefill chunks, P in [1, max] tuned for a frame pair; 1: decode, P = 1
            hidden = dep.model_config.text.hidden_size
            opt = min(dep.tokens_per_pair, dep.key.max_chunk_tokens)
            for low, best, top in ((1, opt, dep.key.max_chunk_tokens), (1, 1, 1)):
                profile = builder.create_optimization_profile()
                profile.set_shape("embeds", (low, hidden), (best, hidden), (top, hidden))
                profile.set_shape("position_ids", (3, low), (3, best), (3, top))
                cfg.add_optimization_profile(profile)
            entry["profiles"] = {"prefill": [1, opt, dep.key.max_chunk_tokens], "decode": [1, 1, 1]}
        plan = builder.build_serialized_network(network, cfg)
        if plan is None:
            raise EngineError(f"TensorRT could not build the {name} engine from {onnx_path} (see the log above)")
        path = bundle / f"{name}.plan"
        path.write_bytes(bytes(plan))
        entry["file"] = path.name
        timing_file.write_bytes(bytes(cfg.get_timing_cache().serialize()))


def _slug(text: str | None) -> str:
    return "".join(c if c.isalnum() else "-" for c in (text or "gpu")).strip("-").lower()
