"""``model.prefill_route`` (edgekv/model/prefill_fused.py): how it resolves, what it installs, where it is refused.

The fused layers' numerics run in Triton's interpreter (test_decode_attention_kernel.py) and compiled for sm_87
(test_kernels.py); here the route's plumbing on the CPU, and on a GPU a session's answers through it.
"""

from __future__ import annotations

import pytest
import torch

from edgekv.model.prefill_fused import FusedChunkLayer, prepare_prefill, resolve_prefill_route

CUDA = torch.cuda.is_available()


def test_the_route_resolves_and_is_refused_off_cuda(monkeypatch):
    import edgekv.model.prefill_fused as prefill

    assert resolve_prefill_route("fused", "cuda:0") == "fused"
    assert resolve_prefill_route("auto", "cuda") == "eager"  # until the fused route has run on a GPU
    assert resolve_prefill_route("auto", "cpu") == resolve_prefill_route("eager", "cuda") == "eager"
    monkeypatch.setattr(prefill, "AUTO_FUSED_PREFILL", True)
    assert resolve_prefill_route("auto", "cuda") == "fused" and resolve_prefill_route("auto", "cpu") == "eager"
    with pytest.raises(ValueError, match="prefill_route: fused: its Triton kernels need a CUDA device"):
        resolve_prefill_route("fused", "cpu")
    with pytest.raises(ValueError, match="unknown route 'fast'"):
        resolve_prefill_route("fast", "cpu")


def test_a_cpu_config_asking_for_it_is_refused_and_auto_is_eager(tiny_checkpoint):
    import edgekv
    from edgekv.config import ConfigError

    with pytest.raises(ConfigError, match="prefill_route: fused"):
        edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "prefill_route": "fused"})
    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu"})
    assert rt.prefill_route == "eager" and all(layer.fused is None for layer in rt.model.language.layers)
    assert rt.session().stats()["prefill_route"] == "eager"


def test_it_installs_on_torch_and_4_bit_layers_and_packs_without_new_memory():
    from test_decode_graph import language_model

    from edgekv.model.int4 import Int4Linear

    model = language_model(torch.float32, "cpu")
    layer1, layer2 = model.layers[1], model.layers[2]
    q = torch.randint(0, 16, (layer1.mlp.down_proj.in_features, layer1.mlp.down_proj.out_features), dtype=torch.uint8)
    zeros = torch.full((q.shape[0] // 16, q.shape[1]), 8, dtype=torch.uint8)
    layer1.mlp.down_proj = Int4Linear.from_integers(q, zeros, torch.full(zeros.shape, 0.01, dtype=torch.float16))
    layer2.mlp.up_proj = torch.nn.Sequential(layer2.mlp.up_proj)  # a projection of no known kind
    weights = sum(p.numel() for p in model.parameters())
    assert prepare_prefill(model, "eager") == 0 and all(layer.fused is None for layer in model.layers)
    assert prepare_prefill(model, "fused") == 2  # layer 2's unknown projection keeps its own forward
    assert isinstance(model.layers[0].fused, FusedChunkLayer) and isinstance(layer1.fused, FusedChunkLayer)
    assert layer2.fused is None
    assert sum(p.numel() for p in model.parameters()) == weights  # packing added nothing
    assert model.layers[0].self_attn.qkv_weight.data_ptr() == model.layers[0].self_attn.q_proj.weight.data_ptr()
    assert hasattr(layer1.self_attn, "qkv_weight") and hasattr(layer1.mlp, "gate_up_weight")  # its dense ones


def test_the_decode_step_still_fuses_a_model_with_fused_chunks():
    from test_decode_graph import filled_cache, language_model

    from edgekv.session.decode_graph import fusable

    model = language_model(torch.float32, "cpu")
    prepare_prefill(model, "fused")
    assert fusable(model, filled_cache(model, 32, 4, "cpu")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_a_session_answers_the_same_through_the_fused_prefill(tiny_checkpoint):
    import numpy as np

    import edgekv

    answers = {}
    for route in ("eager", "fused"):
        rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cuda", "dtype": "fp32",
                                                                    "prefill_route": route})
        assert rt.prefill_route == route
        session = rt.session()
        rng = np.random.default_rng(0)
        for i in range(8):
            session.ingest(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8), t=i * 0.5)
        answers[route] = session.ask("what is red?", max_new_tokens=6).token_ids
    assert answers["fused"] == answers["eager"] and answers["eager"]


def test_auto_on_a_model_no_layer_can_take_falls_back_and_fused_is_refused(tiny_checkpoint, monkeypatch):
    """Once "auto" means fused (a CUDA device), a model none of whose layers can take it (4-bit projections, say)
    runs eager; asking for "fused" by name is refused with the reason."""
    import edgekv
    import edgekv.model.prefill_fused as prefill
    from edgekv.config import ConfigError

    monkeypatch.setattr(prefill, "resolve_prefill_route", lambda route, device: "fused")  # as on CUDA
    monkeypatch.setattr(prefill, "prepare_prefill", lambda language, route: 0)  # no layer can take it
    assert edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu"}).prefill_route == "eager"
    with pytest.raises(ConfigError, match="prefill_route: fused: no layer of this model can take it"):
        edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "prefill_route": "fused"})
