"""The ``tensorrt`` backend at run time: the bundle ``edgekv build --backend tensorrt`` wrote, deserialized once
per runtime, each graph run with ``IExecutionContext.execute_async_v3`` on torch's current CUDA stream, every
I/O tensor bound by address (the session's KV cache buffers and torch-allocated outputs): nothing is copied
to or from the host. The builder is ``tensorrt_backend``; what was and was not run is said there.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edgekv.engines.build import deployment
from edgekv.engines.manifest import EngineError, Manifest, locate
from edgekv.engines.runner import make_backend
from edgekv.engines.tensorrt_backend import _logger, require


class _Engines:
    """Deserialized engines of one bundle with one execution context each."""

    def __init__(self, bundle: Path, manifest: Manifest, hint: str) -> None:
        self.trt = require()
        self.runtime = self.trt.Runtime(_logger(self.trt))
        self.bundle, self.manifest, self.hint = bundle, manifest, hint
        self._engines: dict = {}
        self._contexts: dict = {}

    def engine(self, name: str):
        found = self._engines.get(name)
        if found is None:
            path = self.manifest.path_of(self.bundle, name)
            found = self.runtime.deserialize_cuda_engine(path.read_bytes())
            if found is None:
                raise EngineError(f"{path}: TensorRT could not deserialize the {name} engine (built by another "
                                  f"TensorRT version or for another GPU?). {self.hint}")
            self._engines[name] = found
        return found

    def context(self, graph: str):
        """One execution context per graph; ``llm_decode`` is a second context of the ``llm`` engine on its
        P = 1 optimization profile, so prefill and decode share one copy of the weights."""
        found = self._contexts.get(graph)
        if found is None:
            if graph == "llm_decode":
                found = self.engine("llm").create_execution_context()
                found.set_optimization_profile_async(1, torch.cuda.current_stream().cuda_stream)
            else:
                found = self.engine(graph).create_execution_context()
            self._contexts[graph] = found
        return found

    def run(self, graph: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        context = self.context(graph)
        for name, tensor in inputs.items():
            if not tensor.is_cuda or not tensor.is_contiguous():
                raise ValueError(f"{name}: TensorRT inputs must be contiguous CUDA tensors")
            context.set_input_shape(name, tuple(tensor.shape))
            context.set_tensor_address(name, tensor.data_ptr())
        for name, tensor in outputs.items():
            context.set_tensor_address(name, tensor.data_ptr())
        if not context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError(f"TensorRT failed to run the {graph} engine")


def load(runtime, component: str):
    require()
    if runtime.device.type != "cuda":
        raise EngineError("engines: the tensorrt backend runs on a CUDA device; set model.device: cuda (or auto)")
    cached = getattr(runtime, "_trt_engines", None)
    if cached is None:
        dep = deployment(runtime.config, "tensorrt", model_dir=runtime.model_dir)
        bundle, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
        cached = (_Engines(bundle, manifest, dep.hint), dep)
        runtime._trt_engines = cached
    engines, dep = cached
    decode = "decode" in engines.manifest.files.get("llm", {}).get("profiles", {})
    return make_backend("tensorrt", component, engines.run, dep, runtime, decode_profile=decode)
