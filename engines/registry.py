"""Pick the vision and LLM backends a deployment asked for (``engines:`` in the YAML)."""

from __future__ import annotations

from edgekv.engines.base import check_backend_name


def make_backends(runtime) -> tuple:
    engines = runtime.config.engines
    check_backend_name("vision", engines.vision)
    check_backend_name("llm", engines.llm)
    from edgekv.engines.torch_backend import TorchLLM, TorchVision

    vision = TorchVision(runtime.model) if engines.vision == "torch" else _engine(runtime, "vision", engines.vision)
    llm = TorchLLM(runtime.model) if engines.llm == "torch" else _engine(runtime, "llm", engines.llm)
    return vision, llm


def _engine(runtime, component: str, backend: str):
    if backend == "onnxruntime":
        from edgekv.engines import onnx_backend

        return onnx_backend.load(runtime, component)
    from edgekv.engines import tensorrt_backend

    return tensorrt_backend.load(runtime, component)
