"""The ``tensorrt`` backend at run time: the bundle ``edgekv build --backend tensorrt`` wrote, deserialized once
per runtime, each graph run with ``IExecutionContext.execute_async_v3`` on the engines' own CUDA stream (ordered
with torch's current one), every I/O tensor bound by address (the session's KV cache buffers and torch-allocated
outputs): nothing is copied to or from the host. The builder is ``tensorrt_backend``; what was and was not run is
said there.
"""

from __future__ import annotations

from pathlib import Path

import torch

from edgekv.engines.build import deployment
from edgekv.engines.manifest import EngineError, Manifest, locate
from edgekv.engines.runner import make_backend
from edgekv.engines.tensorrt_backend import _logger, require, torch_dtype


ALIGNMENT = 256  # NvInferRuntime.h, IExecutionContext::setTensorAddress: "at least 256-byte alignment"


def _aligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of ``tensor`` that starts on an ``ALIGNMENT`` boundary (whatever the allocator's own)."""
    size = tensor.element_size()
    raw = torch.empty(tensor.numel() + ALIGNMENT // size, dtype=tensor.dtype, device=tensor.device)
    start = (-raw.data_ptr() % ALIGNMENT) // size
    out = raw[start:start + tensor.numel()].view(tensor.shape)
    out.copy_(tensor)
    return out


class _Engines:
    """Deserialized engines of one bundle with one execution context each, run on a CUDA stream of their own.

    TensorRT warns that an enqueue on the default stream costs extra ``cudaDeviceSynchronize`` calls
    (NvInferRuntime.h ``enqueueV3``), and torch's current stream is the default one unless the caller chose
    another: so the engines get their own stream, ordered after torch's current stream before each run and
    before it again after (events, no host sync). The caller's tensors are allocated on torch's stream and only
    reused by work queued there after the wait, so the caching allocator needs no ``record_stream``.
    """

    def __init__(self, bundle: Path, manifest: Manifest, hint: str, device: torch.device | None = None) -> None:
        self.trt = require()
        self.runtime = self.trt.Runtime(_logger(self.trt))
        self.bundle, self.manifest, self.hint = bundle, manifest, hint
        self.device = device or torch.device("cuda")
        self._engines: dict = {}
        self._contexts: dict = {}
        self._io: dict = {}
        self._stream = None

    def stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

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
                # raises RuntimeError on an index the engine lacks; switched on the stream the runs use
                found.set_optimization_profile_async(1, self.stream().cuda_stream)
            else:
                found = self.engine(graph).create_execution_context()
            self._contexts[graph] = found
        return found

    def io(self, graph: str) -> dict[str, tuple[bool, torch.dtype]]:
        """The engine's I/O tensors: name -> (is an input, torch dtype of its buffer)."""
        found = self._io.get(graph)
        if found is None:
            engine = self.engine("llm" if graph == "llm_decode" else graph)
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            found = {name: (engine.get_tensor_mode(name) == self.trt.TensorIOMode.INPUT,
                            torch_dtype(engine.get_tensor_dtype(name))) for name in names}
            self._io[graph] = found
        return found

    def _buffer(self, graph: str, name: str, tensor: torch.Tensor, dtype: torch.dtype, is_input: bool) -> torch.Tensor:
        """``tensor`` as TensorRT can read or write it by address: on the device, contiguous, of the engine's dtype
        (a mismatch would be read as the wrong type, not converted), 256-byte aligned (an input that is not, e.g. a
        slice, is copied; an output must be, its values are read back from it)."""
        if tensor.device.type != self.device.type:
            raise ValueError(f"{graph}: {name} is on {tensor.device}; TensorRT binds {self.device.type} tensors")
        if tensor.dtype != dtype:
            raise EngineError(f"{graph}: {name} is {tensor.dtype}, the engine's {name} is {dtype}. {self.hint}")
        if not tensor.is_contiguous():
            raise ValueError(f"{graph}: {name}: TensorRT binds contiguous tensors")
        if tensor.data_ptr() % ALIGNMENT:
            if not is_input:
                raise ValueError(f"{graph}: output {name} is not {ALIGNMENT}-byte aligned (a view into a larger "
                                 f"tensor?); TensorRT writes outputs only to aligned buffers")
            tensor = _aligned_copy(tensor)
        return tensor

    def _address(self, context, graph: str, name: str, tensor: torch.Tensor) -> None:
        if not context.set_tensor_address(name, tensor.data_ptr()):
            raise EngineError(f"{graph}: TensorRT refused the address of {name} (see its log above). {self.hint}")

    def run(self, graph: str, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        context = self.context(graph)
        io = self.io(graph)
        given = {**{n: True for n in inputs}, **{n: False for n in outputs}}
        expected = {name: is_input for name, (is_input, _) in io.items()}
        if given != expected:
            raise EngineError(f"{graph}: the engine's inputs are {sorted(n for n, i in expected.items() if i)} and "
                              f"outputs {sorted(n for n, i in expected.items() if not i)}; edgekv bound inputs "
                              f"{sorted(inputs)} and outputs {sorted(outputs)}. {self.hint}")
        kept = []  # aligned copies, alive until the run is queued
        for name, tensor in inputs.items():
            tensor = self._buffer(graph, name, tensor, io[name][1], True)
            kept.append(tensor)
            if not context.set_input_shape(name, tuple(tensor.shape)):
                engine = self.engine("llm" if graph == "llm_decode" else graph)
                profile = context.active_optimization_profile
                low, _, top = (list(d) for d in engine.get_tensor_profile_shape(name, profile))
                raise EngineError(f"{graph}: input {name} of shape {list(tensor.shape)} is outside the engine's "
                                  f"optimization profile {profile} ({low} to {top}). {self.hint}")
            self._address(context, graph, name, tensor)
        unset = context.infer_shapes()
        if unset:
            raise EngineError(f"{graph}: TensorRT has no shape for {list(unset)}. {self.hint}")
        for name, tensor in outputs.items():
            shape = tuple(context.get_tensor_shape(name))
            if tuple(tensor.shape) != shape:
                raise EngineError(f"{graph}: output {name} is {list(tensor.shape)}, the engine writes {list(shape)} "
                                  f"for these inputs. {self.hint}")
            self._address(context, graph, name, self._buffer(graph, name, tensor, io[name][1], False))
        stream, current = self.stream(), torch.cuda.current_stream(self.device)
        stream.wait_stream(current)
        if not context.execute_async_v3(stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to run the {graph} engine (see its log above)")
        current.wait_stream(stream)


def check_device(device: torch.device) -> None:
    """TensorRT installed and ``device`` (the runtime's) a CUDA one, or the EngineError the load raises (shared with
    ``edgekv.runtime.find_engines``, ``--check``'s look at the engines)."""
    require()
    if device.type != "cuda":
        raise EngineError("engines: the tensorrt backend runs on a CUDA device; set model.device: cuda (or auto)")


def load(runtime, component: str):
    check_device(runtime.device)
    cached = getattr(runtime, "_trt_engines", None)
    if cached is None:
        dep = deployment(runtime.config, "tensorrt", model_dir=runtime.model_dir)
        bundle, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
        cached = (_Engines(bundle, manifest, dep.hint, runtime.device), dep)
        runtime._trt_engines = cached
    engines, dep = cached
    decode = "decode" in engines.manifest.files.get("llm", {}).get("profiles", {})
    return make_backend("tensorrt", component, engines.run, dep, runtime, decode_profile=decode)
