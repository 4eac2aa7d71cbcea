"""ONNX export of the three graphs of ``graphs.py`` (``edgekv build`` calls this).

Exporter: ``torch.onnx.export(..., dynamo=True)`` (torch.export + onnxscript), ONNX opset 18 — within
what onnxruntime >= 1.16 and TensorRT 10's ONNX parser take. Dtypes: the graphs' inputs, outputs and
weights are in the deployment's ``model.dtype`` (fp32 or fp16; the KV cache is bound in place, so its dtype
is the graph's); attention scores/softmax are fp32 inside (see ``graphs.py``); ``position_ids`` are int64,
``visible`` is bool. bf16 graphs are written only for TensorRT (onnxruntime's CPU and CUDA providers lack
bf16 kernels for these ops). Weights go to ONNX external data (``<graph>.onnx.data``) when a graph's
weights exceed 2 GB, protobuf's limit for one message (the 3B LLM in fp16 is ~6 GB).

Shapes: ``vision`` static (one frame pair at the configured grid); ``llm`` with ``P`` dynamic in
``[1, max_chunk_tokens]`` (decode is P = 1 of the same graph); ``M`` (the cache capacity) is static.

A 4-bit checkpoint (issue 29) exports its decoder linears as onnxruntime's ``MatMulNBits`` nodes
(``int4_export.py``): the 4-bit weights, scales and zero points are the graph's initializers.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from pathlib import Path

import torch

from edgekv.engines.graphs import (
    LLM_INPUTS,
    LLM_INPUTS_8BIT,
    LLM_OUTPUTS,
    VISION_INPUTS,
    VISION_OUTPUTS,
    LLMChunkGraph,
    QuantizedLLMChunkGraph,
    VisionGraph,
)
from edgekv.model.qwen25vl import Qwen25VL

OPSET = 18
EXTERNAL_DATA_BYTES = 2 * 1024 ** 3


def _params_bytes(module: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in [*module.parameters(), *module.buffers()]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


@contextlib.contextmanager
def _quiet():
    """The dynamo exporter prints its stages and warns about torchvision ops; keep the build output ours."""
    loggers = [logging.getLogger(name) for name in ("torch.onnx", "torch.export", "torch._dynamo", "onnxscript")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _save(program, path: Path, weights_bytes: int) -> list[Path]:
    external = weights_bytes > EXTERNAL_DATA_BYTES
    path.parent.mkdir(parents=True, exist_ok=True)
    program.save(str(path), external_data=external)
    files = [path]
    data = path.with_name(path.name + ".data")
    if data.is_file():
        files.append(data)
    return files


def export_vision(model: Qwen25VL, grid_thw: tuple[int, int, int], path: Path) -> dict:
    """Write the vision graph for one frame pair at ``grid_thw``; returns its manifest entry."""
    graph = VisionGraph(model.visual, grid_thw).eval()
    weight = model.visual.patch_embed.proj.weight
    example = torch.randn(graph.num_patches, model.config.vision.patch_dim, dtype=weight.dtype, device=weight.device)
    with torch.no_grad(), _quiet():
        program = torch.onnx.export(graph, (example,), input_names=list(VISION_INPUTS),
                                    output_names=list(VISION_OUTPUTS), dynamo=True, opset_version=OPSET,
                                    verbose=False)
    files = _save(program, path, _params_bytes(graph))
    return {
        "inputs": {"pixel_values": [graph.num_patches, model.config.vision.patch_dim]},
        "outputs": {"tokens": [graph.num_tokens, model.config.vision.out_hidden_size]},
        "grid_thw": list(graph.grid_thw), "files": [f.name for f in files],
    }


def export_llm(model: Qwen25VL, cache_tokens: int, path: Path, *, max_chunk_tokens: int, example_tokens: int,
               kv_dtype: str | None = None) -> dict:
    """Write the ``llm`` graph (P dynamic in [1, max_chunk_tokens]); returns its manifest entry.
    ``kv_dtype="int8"``: the graph over an 8-bit cache (``LLM_INPUTS_8BIT``)."""
    text = model.config.text
    layers, heads, dim, hidden = text.num_hidden_layers, text.num_key_value_heads, text.head_dim, text.hidden_size
    weight = model.language.embed_tokens.weight
    dtype, device = weight.dtype, weight.device
    num = max(2, min(example_tokens, max_chunk_tokens))  # torch.export specializes a size-1 example
    cache_shape = (layers, heads, cache_tokens)
    if kv_dtype is None:
        graph = LLMChunkGraph(model.language).eval()
        names = LLM_INPUTS
        cache = tuple(torch.zeros(*cache_shape, dim, dtype=dtype, device=device) for _ in range(2))
        cache_io = {"k_cache": [*cache_shape, dim], "v_cache": [*cache_shape, dim]}
    elif kv_dtype == "int8":
        from edgekv.model.rope import rotary_inv_freq

        inv_freq = rotary_inv_freq(dim, text.rope_theta, device=device)
        graph = QuantizedLLMChunkGraph(model.language, inv_freq, text.mrope_section[0]).eval()
        names = LLM_INPUTS_8BIT
        codes = [torch.zeros(*cache_shape, dim, dtype=torch.int8, device=device) for _ in range(2)]
        scales = [torch.ones(*cache_shape, dtype=torch.bfloat16, device=device) for _ in range(2)]
        cache = (codes[0], scales[0], codes[1], scales[1], torch.zeros(*cache_shape, dtype=torch.int32, device=device))
        cache_io = {"k_codes": [*cache_shape, dim], "k_scale": list(cache_shape), "v_codes": [*cache_shape, dim],
                    "v_scale": list(cache_shape), "tpos": list(cache_shape)}
    else:
        raise ValueError(f"kv_dtype: {kv_dtype!r} has no LLM graph (None or 'int8')")
    example = (
        torch.randn(num, hidden, dtype=dtype, device=device),
        torch.arange(num, device=device).expand(3, num).contiguous(),
        *cache,
        torch.zeros(*cache_shape, dtype=torch.bool, device=device),
    )
    chunk = torch.export.Dim("P", min=1, max=max_chunk_tokens)
    dynamic = ({0: chunk}, {1: chunk}, *([None] * (len(names) - 2)))
    from edgekv.engines.int4_export import matmul_nbits_modules, translation_table

    with torch.no_grad(), _quiet(), matmul_nbits_modules(model.language, dtype) as int4_linears:
        program = torch.onnx.export(graph, example, input_names=list(names), output_names=list(LLM_OUTPUTS),
                                    dynamic_shapes=dynamic, dynamo=True, opset_version=OPSET, verbose=False,
                                    custom_translation_table=translation_table() if int4_linears else None)
        # The tied lm_head/embedding is not part of the graph (logits are taken outside), so count the layers.
        files = _save(program, path, _params_bytes(model.language.layers) + _params_bytes(model.language.norm))
    return {
        "weights": "int4 (MatMulNBits)" if int4_linears else str(dtype).removeprefix("torch."),
        "inputs": {"embeds": ["P", hidden], "position_ids": [3, "P"], **cache_io, "visible": list(cache_shape)},
        "outputs": {"hidden": ["P", hidden], "new_k": [layers, heads, "P", dim], "new_v": [layers, heads, "P", dim],
                    "mass": [layers, heads, f"{cache_tokens}+P"]},
        "files": [f.name for f in files], "max_chunk_tokens": max_chunk_tokens, "kv_dtype": kv_dtype,
    }
