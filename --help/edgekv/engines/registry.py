"""Pick the vision and LLM backends a deployment asked for (``engines:`` in the YAML)."""

from __future__ import annotations

import importlib

from edgekv.engines.base import check_backend_name


def make_backends(runtime) -> tuple:
    """(vision, llm) backends of ``runtime.config.engines``. The runtime did not load the torch weights an
    engine replaces (``load_pretrained(skip=...)``); the LLM keeps its embedding and (tied) lm_head, which
    every backend runs in torch."""
    engines = runtime.config.engines
    check_backend_name("vision", engines.vision)
    check_backend_name("llm", engines.llm)
    from edgekv.engines.torch_backend import TorchLLM, TorchVision

    vision = (TorchVision(runtime.model, runtime.vision_route) if engines.vision == "torch"
              else _engine(runtime, "vision", engines.vision))
    llm = TorchLLM(runtime.model) if engines.llm == "torch" else _engine(runtime, "llm", engines.llm)
    return vision, llm


def _engine(runtime, component: str, backend: str):
    module = {"onnxruntime": "onnx_backend", "tensorrt": "tensorrt_runtime"}[backend]
    loader = importlib.import_module(f"edgekv.engines.{module}")
    return loader.load(runtime, component)
