"""A 4-bit checkpoint through the engines (issue 29): the LLM graph with onnxruntime's ``MatMulNBits``.

One module-scoped ``edgekv build`` (the command line's entry point, in this process) of the ``test-stream`` checkpoint
quantized by ``edgekv quantize`` (group 16: its widths are 64 and 176), fp32 graphs on the CPU provider.
Parity with the torch backend on the same 4-bit weights: both multiply the exact dequantized weights in fp32
(onnxruntime's MLAS kernel and torch's product differ in summation order only), so the tolerances of
``test_engines.py`` hold: 1e-4 on hidden states and logits, 1e-5 on K/V and attention mass.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytestmark = pytest.mark.slow  # one export of the 4-bit graphs (about a minute on the 2-core machine)

import edgekv
from edgekv.apps.cli import main
from edgekv.cache.capped import CappedKVCache
from edgekv.config import load_config
from edgekv.engines.manifest import EngineError
from helpers_checkpoints import filled_cache

RESOLUTION = [112, 112]
CACHE_TOKENS = 256


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    from edgekv.calibration.quantize import quantize_checkpoint
    from edgekv.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("int4-engines")
    dense = make_tiny_checkpoint(root / "dense", preset="test-stream", seed=3)
    ckpt = quantize_checkpoint(dense, root / "q4", group_size=16)
    config = {
        "model": {"path": str(ckpt), "dtype": "fp32", "device": "cpu"},
        "video": {"source": "synthetic:shapes?size=112x112&fps=4&frames=40", "fps": 2.0, "resolution": RESOLUTION},
        "cache": {"policy": "infinipot_v", "max_tokens": CACHE_TOKENS, "text_reserve_tokens": 64, "sinks": 16},
        "engines": {"vision": "onnxruntime", "llm": "onnxruntime", "engine_dir": str(root / "cache"),
                    "onnx_providers": ["CPUExecutionProvider"]},
    }
    path = root / "deploy.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["build", "--config", str(path), "--quiet"]) == 0  # in this process: the exporter is warm
    bundle = next((root / "cache").glob("*/manifest.json")).parent
    return path, ckpt, bundle


@pytest.fixture(scope="module")
def runtimes(built):
    config = load_config(built[0])
    return (edgekv.Runtime.from_config(config.with_overrides(engines={"vision": "torch", "llm": "torch"})),
            edgekv.Runtime.from_config(config))


def test_llm_graph_holds_matmul_nbits_nodes_with_the_4bit_weights(built):
    import onnx

    _, ckpt, bundle = built
    graph = onnx.load(str(bundle / "llm.onnx")).graph
    nodes = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 3 * 7 and all(n.domain == "com.microsoft" for n in nodes)  # 3 layers x 7 linears
    attributes = {a.name: a.i for a in nodes[0].attribute}
    assert attributes["bits"] == 4 and attributes["block_size"] == 16
    initializers = {i.name: i for i in graph.initializer}
    b = initializers[nodes[0].input[1]]
    assert b.data_type == onnx.TensorProto.UINT8 and list(b.dims)[1:] == [attributes["K"] // 16, 8]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["files"]["llm"]["weights"] == "int4 (MatMulNBits)"
    # no dense copy of a decoder weight went into the graph: every float initializer is far smaller than one
    dense_weight = 64 * 176
    floats = [i for i in graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert all(int(torch.tensor(list(i.dims)).prod()) < dense_weight for i in floats if len(i.dims) == 2)


def _filled_cache(runtime, length: int, seed: int) -> CappedKVCache:
    return filled_cache(runtime.model.config.text, CACHE_TOKENS, length, seed)


def test_prefill_and_decode_parity_with_torch(runtimes):
    torch_rt, ort_rt = runtimes
    assert ort_rt.llm_backend.name == "onnxruntime" and len(ort_rt.model.language.layers) == 0
    text = torch_rt.model.config.text
    g = torch.Generator().manual_seed(1)
    embeds = torch.randn(16, text.hidden_size, generator=g)
    positions = torch.stack([torch.full((16,), 40), torch.arange(16) // 4 + 40, torch.arange(16) % 4 + 40])
    results = []
    for rt in (torch_rt, ort_rt):
        cache = _filled_cache(rt, 60, seed=2)
        mass = torch.zeros(text.num_hidden_layers, text.num_key_value_heads, CACHE_TOKENS)
        hidden = rt.llm_backend.prefill(embeds, positions, cache, mass_out=mass)
        new_k, new_v = cache.k[:, :, 60:76].clone(), cache.v[:, :, 60:76].clone()
        cache.commit(16)
        step = rt.llm_backend.prefill(rt.llm_backend.embed(torch.tensor([7])), torch.full((3, 1), 60), cache)
        results.append((hidden, new_k, new_v, mass, rt.llm_backend.logits(step[-1])))
    (h0, k0, v0, m0, l0), (h1, k1, v1, m1, l1) = results
    torch.testing.assert_close(h1, h0, atol=1e-4, rtol=0)
    torch.testing.assert_close(k1, k0, atol=1e-5, rtol=0)
    torch.testing.assert_close(v1, v0, atol=1e-5, rtol=0)
    torch.testing.assert_close(m1, m0, atol=1e-5, rtol=0)
    torch.testing.assert_close(l1, l0, atol=1e-4, rtol=0)


def test_stream_answers_the_same_through_the_engine(runtimes):
    """20 frame pairs (compressions at this cap) and a question: the same tokens through both backends."""
    from edgekv.video.sources import iter_frames

    sessions = [rt.session() for rt in runtimes]
    for image, t in iter_frames("synthetic:shapes?size=112x112&fps=4&frames=40", max_frames=40):
        for session in sessions:
            session.ingest(image, t=t)
    answers = [s.ask("What moved?", max_new_tokens=6).token_ids for s in sessions]
    assert sessions[0].stats()["compressions"] == sessions[1].stats()["compressions"] >= 1
    assert answers[0] == answers[1]


def test_tensorrt_build_of_a_4bit_checkpoint_is_refused_by_name(built):
    from edgekv.engines.build import deployment

    config = load_config(built[0])
    with pytest.raises(EngineError, match=r"4-bit weights \(quantization_config awq, group 16\).*DequantizeLinear"):
        deployment(config, "tensorrt", tensorrt_identity=("10.3.0", "Orin"))
