"""The ``onnxruntime`` backend: the exported graphs run by onnxruntime with CPU, CUDA or TensorRT providers.

    engines: {vision: onnxruntime, llm: onnxruntime, onnx_providers: [CUDAExecutionProvider, CPUExecutionProvider]}

Providers are tried in the order given (``cpu``/``cuda``/``tensorrt`` are accepted for the full names); one
this onnxruntime build lacks is refused at load with the list it has and what to install. Tensors are
bound by pointer with I/O binding — the session's KV cache buffers go in as they are, outputs land in torch
tensors the runner allocated — so nothing round-trips through numpy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from edgekv.engines.build import Deployment, deployment
from edgekv.engines.manifest import EngineError, Manifest, locate
from edgekv.engines.runner import make_backend

PROVIDER_ALIASES = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider",
                    "tensorrt": "TensorrtExecutionProvider"}
_NP_TYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.bool: np.bool_,
             torch.int32: np.int32, torch.int8: np.int8,
             torch.bfloat16: 16}  # onnx.TensorProto.BFLOAT16: numpy has no bf16 (an int8 cache's scales)


def _ort():
    try:
        import onnxruntime
    except ImportError:
        raise EngineError("engines: the onnxruntime backend needs the onnxruntime package: pip install "
                          "'edgekv[engines]' (desktop CPU), onnxruntime-gpu (CUDA), or NVIDIA's onnxruntime-gpu "
                          "wheel for JetPack on a Jetson") from None
    return onnxruntime


def resolve_providers(names: list[str]) -> list[str]:
    """Full provider names, every one available in this onnxruntime build, or an EngineError."""
    ort = _ort()
    available = ort.get_available_providers()
    resolved = []
    for name in names:
        full = PROVIDER_ALIASES.get(name.lower(), name)
        if full not in available:
            extra = {"CUDAExecutionProvider": " (pip install onnxruntime-gpu; on a Jetson, NVIDIA's JetPack wheel)",
                     "TensorrtExecutionProvider": " (onnxruntime-gpu built with TensorRT, and TensorRT's libraries "
                                                  "on the library path)"}.get(full, "")
            raise EngineError(f"engines.onnx_providers: {full} is not available in this onnxruntime "
                              f"{ort.__version__}{extra}; available: {', '.join(available)}")
        resolved.append(full)
    if not resolved:
        raise EngineError("engines.onnx_providers: empty; name at least CPUExecutionProvider")
    return resolved


class _Sessions:
    """onnxruntime sessions of one bundle, created on first use, shared by the vision and LLM runners."""

    def __init__(self, bundle: Path, manifest: Manifest, providers: list[str], threads: int) -> None:
        self.bundle, self.manifest, self.providers, self.threads = bundle, manifest, providers, threads
        self._sessions: dict = {}

    def get(self, graph: str):
        found = self._sessions.get(graph)
        if found is None:
            ort = _ort()
            options = ort.SessionOptions()
            options.intra_op_num_threads = self.threads
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # Idle onnxruntime threads spin-wait by default; between engine calls that steals the cores
            # the session's own torch work (preprocessing, embedding, compaction) needs on a small CPU.
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
            path = self.manifest.path_of(self.bundle, graph)
            try:
                found = ort.InferenceSession(str(path), sess_options=options, providers=self.providers)
            except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
                raise EngineError(f"{path}: onnxruntime could not load the {graph} graph ({exc})") from exc
            self._sessions[graph] = found
        return found

    def run(self, graph: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        session = self.get(graph)
        binding = session.io_binding()
        for name, tensor in inputs.items():
            _bind(binding.bind_input, name, tensor)
        for name, tensor in outputs.items():
            _bind(binding.bind_output, name, tensor)
        session.run_with_iobinding(binding)


def _bind(bind, name: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{name}: onnxruntime binding needs a contiguous tensor")
    device = tensor.device
    bind(name, device.type, device.index or 0, _NP_TYPES[tensor.dtype], tuple(tensor.shape), tensor.data_ptr())


def checked_providers(config, device: torch.device) -> list[str]:
    """``engines.onnx_providers`` as onnxruntime has them, or the EngineError the load raises (shared with
    ``edgekv.runtime.find_engines``, ``--check``'s look at the engines)."""
    providers = resolve_providers(list(config.engines.onnx_providers))
    if device.type == "cuda" and not set(providers) & {"CUDAExecutionProvider", "TensorrtExecutionProvider"}:
        raise EngineError("engines.onnx_providers: model.device is CUDA but only CPU providers are listed; add "
                          "CUDAExecutionProvider or set model.device: cpu")
    return providers


def _sessions_for(runtime) -> tuple[_Sessions, Deployment]:
    cached = getattr(runtime, "_ort_sessions", None)
    if cached is not None:
        return cached
    config = runtime.config
    providers = checked_providers(config, runtime.device)
    dep = deployment(config, "onnxruntime", model_dir=runtime.model_dir)
    bundle, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
    cached = (_Sessions(bundle, manifest, providers, torch.get_num_threads()), dep)
    runtime._ort_sessions = cached
    return cached


def load(runtime, component: str):
    sessions, dep = _sessions_for(runtime)
    return make_backend("onnxruntime", component, sessions.run, dep, runtime)
