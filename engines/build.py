"""``edgekv build``: export a deployment's engines and write the bundle's manifest.

    edgekv build --model DIR --config deploy.yaml [--backend onnxruntime|tensorrt] [--engine-dir D]

Steps: hash the checkpoint -> export ``vision.onnx`` (the configured grid) and ``llm.onnx`` (the
configured cache capacity; prefill chunks and decode steps, see ``graphs.py``) -> for ``tensorrt`` build
one plan per graph (see ``tensorrt_backend.py``) -> ``manifest.json``. A bundle that already matches is left alone
unless ``--force``: found as a load finds it (``manifest.locate``: under another folder name too, e.g. the checkpoint's
folder renamed, or ``engine_dir`` being the bundle itself, which is then also where a rebuild goes). The same
:func:`deployment` is computed when a runtime loads the engines, so what ``build`` wrote is exactly what
``Runtime`` looks for.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv.cache.specs import CacheSpec
from edgekv.config import EdgeKVConfig
from edgekv.engines.manifest import (
    MANIFEST,
    BuildKey,
    DamagedEngineError,
    EngineError,
    EngineMismatchError,
    Manifest,
    file_digest,
    locate,
    model_hash,
    read_memo,
    rebuild_hint,
    write_memo,
)
from edgekv.model.config import ModelConfig
from edgekv.model.builtin import resolve_model_path

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
ENGINE_BACKENDS = ("onnxruntime", "tensorrt")
DEFAULT_MIN_CHUNK = 256


@dataclass(frozen=True)
class Deployment:
    """Everything the engines of one (model, config, backend) depend on, resolved."""

    model_dir: Path
    engine_dir: Path
    model_config: ModelConfig
    key: BuildKey
    hint: str

    @property
    def tokens_per_pair(self) -> int:
        _, h, w = self.key.grid_thw
        return h * w // self.model_config.vision.spatial_merge_size ** 2


def grid_for(config: EdgeKVConfig, model_config: ModelConfig) -> tuple[int, int, int]:
    resolution = config.video.resolution
    if resolution is None:
        raise EngineError("video.resolution: engines have a static frame grid; set video.resolution "
                          "(e.g. [448, 448]) in the deployment config before `edgekv build`")
    patch = model_config.vision.patch_size
    height, width = int(resolution[0]), int(resolution[1])
    return 1, height // patch, width // patch


def cache_tokens_for(config: EdgeKVConfig, model_config: ModelConfig) -> int:
    """M as the session computes it (``Runtime.cache_capacity_tokens``)."""
    from edgekv.cache.specs import KV_DTYPES

    text = model_config.text
    storage = KV_DTYPES[config.cache.kv_dtype] if config.cache.kv_dtype else DTYPES[config.model.dtype]
    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, storage)
    if config.cache.max_mib is not None:
        return spec.tokens_for_mib(config.cache.max_mib)
    return int(config.cache.max_tokens)


def deployment(config: EdgeKVConfig, backend: str, *, model_dir: str | Path | None = None,
               engine_dir: str | Path | None = None, tensorrt_identity: tuple[str, str] | None = None) -> Deployment:
    """Resolve the build key of ``backend`` for ``config`` (model and engine dir may be overridden)."""
    if backend not in ENGINE_BACKENDS:
        raise EngineError(f"--backend: {backend!r} has no engines to build (choose {' or '.join(ENGINE_BACKENDS)}; "
                          f"the torch backend runs the checkpoint directly)")
    path = model_dir if model_dir is not None else config.model.path
    if path is None:
        raise EngineError("model.path: no model directory given (--model DIR or model.path in the config)")
    model_path = Path(resolve_model_path(str(path))).expanduser()  # builtin:toy -> the shipped checkpoint
    root = Path(engine_dir if engine_dir is not None else config.engines.engine_dir).expanduser()
    model_config = ModelConfig.from_dir(model_path)
    grid = grid_for(config, model_config)
    merge = model_config.vision.spatial_merge_size ** 2
    tokens_per_pair = grid[1] * grid[2] // merge
    max_chunk = config.engines.max_chunk_tokens or max(tokens_per_pair, DEFAULT_MIN_CHUNK)
    if max_chunk < tokens_per_pair:
        raise EngineError(f"engines.max_chunk_tokens: {max_chunk} is below one frame pair ({tokens_per_pair} tokens "
                          f"at video.resolution {list(config.video.resolution)}); a frame pair is one chunk")
    dtype = config.model.dtype
    from edgekv.model.int4 import QuantConfig

    quant = QuantConfig.from_model_config(model_config.extra)
    if quant is not None and backend == "tensorrt":
        raise EngineError(f"model.path: {model_path.name} has 4-bit weights (quantization_config {quant.method}, group "
                          f"{quant.group_size}); TensorRT 10 runs those as INT4 weights behind a blocked DequantizeLinear "
                          f"(NVIDIA ModelOpt's export), a build edgekv has not made or checked: build --backend "
                          f"onnxruntime (the decoder as MatMulNBits) or run engines.llm: torch (Triton int4 kernels)")
    kv_dtype = config.cache.kv_dtype if config.cache.kv_dtype not in (None, dtype) else None
    if kv_dtype == "int8" and backend != "onnxruntime":
        raise EngineError("cache.kv_dtype: int8 — only the onnxruntime LLM graph takes an 8-bit cache (a TensorRT "
                          "build of it has not been made or run); use engines llm: onnxruntime or torch with int8")
    if kv_dtype not in (None, "int8"):
        raise EngineError(f"cache.kv_dtype: {kv_dtype} — the engines' LLM graphs bind the cache in model.dtype "
                          f"({dtype}) or as int8 codes + scales; fp8 and other float dtypes have no graph: leave "
                          f"cache.kv_dtype unset or int8 to build, or run this cache with engines.llm: torch")
    if backend == "onnxruntime" and dtype == "bf16":
        raise EngineError("model.dtype: bf16 graphs are not supported by onnxruntime's CPU/CUDA providers; use fp16 "
                          "(GPU) or fp32 (CPU) with engines onnxruntime, or the tensorrt backend for bf16")
    trt_version = gpu = precision = None
    if backend == "tensorrt":
        from edgekv.engines import tensorrt_backend

        trt_version, gpu = tensorrt_identity or tensorrt_backend.identity()
        precision = config.engines.precision or dtype
        if precision in DTYPES and precision != dtype:
            raise EngineError(f"engines.precision: {precision} differs from model.dtype {dtype}; TensorRT engines are "
                              f"strongly typed and bind the session's {dtype} cache in place, so set both to the "
                              f"same dtype (int8 keeps the LLM in model.dtype)")
    # TensorRT computes fp32 inner products in TF32 (11 significant bits) unless told not to: an fp32 deployment
    # asked for fp32 results, so its plans are built with TF32 cleared (tensorrt_backend.build_engines)
    tf32 = False if backend == "tensorrt" and dtype == "fp32" else None
    int8 = int8_method(trt_version) if precision == "int8" else None
    calibration = floats = None
    unverified: tuple[tuple[str, str, str], ...] = ()
    if int8 is not None:  # the frames the scales come from, and what Q/DQ leaves in float, make other engines
        from edgekv.engines.int8_qdq import calibration_input, calibration_record

        calibration, why = calibration_input(config, root / "hashes.json")
        if why is not None:  # the clip is gone: only a build reads it, a load takes the bundle built from it
            unverified = (("int8_calibration", calibration_record(config)["int8_calibration"], why),)
        floats = tuple(sorted(set(config.engines.int8_float_products))) if int8 == "qdq" else None
    key = BuildKey(backend=backend, model_hash=model_hash(model_path, root / "hashes.json"), grid_thw=grid,
                   cache_tokens=cache_tokens_for(config, model_config), dtype=dtype, max_chunk_tokens=max_chunk,
                   precision=precision, tensorrt_version=trt_version, gpu=gpu, kv_dtype=kv_dtype, tf32=tf32,
                   int8=int8, int8_calibration=calibration, int8_float_products=floats, unverified=unverified)
    return Deployment(model_path, root, model_config, key, rebuild_hint(model_path, config, backend))


def int8_method(tensorrt_version: str) -> str:
    """How an int8 vision engine is made on this TensorRT: "qdq" — the ONNX graph carries QuantizeLinear /
    DequantizeLinear pairs and the network is strongly typed (``int8_qdq.py``), from 10.1 on, where the calibrator
    is deprecated ("Superseded by explicit quantization") and in 11, where it is gone; "calibrator" — 10.0's
    implicit ``IInt8EntropyCalibrator2`` + ``BuilderFlag.INT8``, kept for JetPack 6.0."""
    major, minor = (int(part) for part in str(tensorrt_version).split(".")[:2])
    return "qdq" if (major, minor) >= (10, 1) else "calibrator"


class Progress:
    """Step-by-step progress on stderr: a rich spinner when rich is installed, plain lines otherwise."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._rich = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
                from rich.progress import Progress as RichProgress

                self._rich = RichProgress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                          TimeElapsedColumn(), transient=False)
                self._task = self._rich.add_task("edgekv build", total=total)
                self._rich.start()
            except ImportError:
                self._rich = None
        self._started = time.perf_counter()

    def step(self, label: str) -> _Step:
        return _Step(self, label)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()


class _Step:
    def __init__(self, progress: Progress, label: str) -> None:
        self.progress, self.label = progress, label

    def __enter__(self) -> _Step:
        self.t0 = time.perf_counter()
        p = self.progress
        if p._rich is not None:
            p._rich.update(p._task, description=f"[{p.done + 1}/{p.total}] {self.label}")
        elif p.enabled:
            print(f"[{p.done + 1}/{p.total}] {self.label} ...", file=sys.stderr, flush=True)
        return self

    def __exit__(self, kind, exc, tb) -> None:
        p = self.progress
        if exc is not None:
            return
        p.done += 1
        seconds = time.perf_counter() - self.t0
        if p._rich is not None:
            p._rich.update(p._task, advance=1)
            p._rich.console.print(f"  {self.label}: {seconds:.1f} s")
        elif p.enabled:
            print(f"[{p.done}/{p.total}] {self.label}: done in {seconds:.1f} s", file=sys.stderr, flush=True)


def require_exporter() -> None:
    """Every backend's build exports ONNX first (torch.onnx's dynamo exporter: onnx + onnxscript); without them
    say which extra to install before loading the model, not a bare ``No module named 'onnxscript'`` after loading."""
    missing = [name for name in ("onnx", "onnxscript") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"exporting the engines needs {' and '.join(missing)}: pip install 'edgekv[engines]' "
                          f"('edgekv[export]' where onnxruntime or TensorRT comes from elsewhere, e.g. a Jetson)")


def build(config: EdgeKVConfig, backend: str = "onnxruntime", *, model_dir: str | Path | None = None,
          engine_dir: str | Path | None = None, force: bool = False, progress: bool = True) -> tuple[Path, Manifest]:
    """Export (and for tensorrt, compile) the engines of ``config``; returns the bundle dir and its manifest."""
    started = time.perf_counter()
    trt = None
    if backend == "tensorrt":
        from edgekv.engines import (
            tensorrt_backend as trt,  # fails fast, before any export, without TensorRT
        )

        trt.require()
    steps = Progress(total=5 if backend == "tensorrt" else 4, enabled=progress)
    try:
        with steps.step("hash model and resolve the build key"):
            dep = deployment(config, backend, model_dir=model_dir, engine_dir=engine_dir)
        # engine_dir holding a manifest is the bundle a load reads (locate): it is rebuilt in place, not beside
        in_place = (dep.engine_dir / MANIFEST).is_file()
        bundle = dep.engine_dir if in_place else dep.key.bundle_dir(dep.engine_dir, dep.model_dir.name)
        memo_file = dep.engine_dir / "hashes.json"
        if not force:
            try:  # found and checked as a load finds and checks it: a renamed bundle is up to date, a truncated
                # file is not (the rebuild hint was a loop), a calibration clip deleted since is no reason to rebuild
                found, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
            except EngineMismatchError as exc:
                if in_place:
                    print(f"rebuilding in place (engines.engine_dir is this bundle): {exc}", file=sys.stderr)
            except DamagedEngineError as exc:
                print(f"rebuilding: {exc}", file=sys.stderr)
            except EngineError:
                pass  # none built yet (or an unreadable manifest): built below
            else:
                steps.close()
                gone = "".join(f" (engines.{name}: {why}; the engines built from it are kept, a rebuild needs it "
                               f"back)" for name, _, why in dep.key.unverified)
                print(f"up to date: {found}{gone}", file=sys.stderr)
                return found, manifest
        require_exporter()
        calibration = None
        if dep.key.int8 is not None:  # the frames first: a missing or unreadable source fails before any export
            from edgekv.engines.int8_qdq import calibration_pixels

            calibration = calibration_pixels(config, dep.model_config.vision)
            if dep.key.int8 == "calibrator":  # TensorRT 10.0's calibrator reads them itself (build_engines)
                calibration = None
        bundle.mkdir(parents=True, exist_ok=True)
        (bundle / MANIFEST).unlink(missing_ok=True)  # a rebuild cut short leaves no manifest over other files
        from edgekv.engines.export import OPSET, export_llm, export_vision

        from edgekv.model import load_pretrained

        with steps.step(f"load {dep.model_dir.name} ({config.model.dtype})"):
            device = torch.device("cpu") if config.model.device in ("auto", "cpu") and backend == "onnxruntime" \
                else torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = load_pretrained(dep.model_dir, dtype=DTYPES[config.model.dtype], device=device).eval()
        files: dict[str, dict] = {}
        key = dep.key
        if calibration is not None:
            from edgekv.engines.int8_qdq import export_vision_qdq

            with steps.step(f"export INT8 (Q/DQ) vision graph, grid {list(key.grid_thw)}, scales from "
                            f"{len(calibration)} frame pairs"):
                files["vision"] = export_vision_qdq(model, key.grid_thw, bundle / "vision.onnx", calibration,
                                                    key.int8_float_products or ())
        else:
            with steps.step(f"export vision graph, grid {list(key.grid_thw)}"):
                files["vision"] = export_vision(model, key.grid_thw, bundle / "vision.onnx")
        cache_note = f", {key.kv_dtype} cache" if key.kv_dtype else ""
        with steps.step(f"export LLM graph, M={key.cache_tokens}{cache_note}, P in [1, {key.max_chunk_tokens}]"):
            files["llm"] = export_llm(model, key.cache_tokens, bundle / "llm.onnx", max_chunk_tokens=key.max_chunk_tokens,
                                      example_tokens=dep.tokens_per_pair, kv_dtype=key.kv_dtype)
        for name, entry in files.items():
            entry["file"] = f"{name}.onnx"
            entry["onnx"] = entry["file"]
        # The exported weights are in the graphs now. TensorRT's builder reads its own copy of them and needs
        # tactic workspace beside it: on a Jetson the GPU's memory is the board's, so the torch copy goes first.
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if trt is not None:
            with steps.step(f"TensorRT {key.tensorrt_version}: build {key.precision} engines for {key.gpu}"):
                trt.build_engines(bundle, files, dep, config)
        memo = read_memo(memo_file)  # the digests remembered: the first load does not read the graphs again
        for entry in files.values():
            path = bundle / entry["file"]
            entry["bytes"] = path.stat().st_size
            entry["sha256"] = file_digest(path, memo)
        write_memo(memo_file, memo)
        import onnx
        versions = {"torch": torch.__version__, "onnx": onnx.__version__, "opset": OPSET}
        try:
            import onnxruntime
            versions["onnxruntime"] = onnxruntime.__version__
        except ImportError:
            pass
        if key.tensorrt_version:
            versions["tensorrt"] = key.tensorrt_version
        from edgekv.engines.int8_qdq import calibration_record

        manifest = Manifest(key=key.fields(), model_dir=str(dep.model_dir), files=files, versions=versions,
                            build_s=time.perf_counter() - started,
                            inputs=calibration_record(config) if key.int8_calibration is not None else {})
        manifest.write(bundle)
    finally:
        steps.close()
    return bundle, manifest
