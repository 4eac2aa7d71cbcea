"""DecodeGraph: the static-shape decode step over the capped cache equals the eager decode path.

On the CPU the step runs eagerly (``capture=False``): the fixed-shape mask, the slot writes, the rotary
angles from a position buffer and the in-graph advance are the code the CUDA graph captures. The gpu-marked
tests capture and replay it on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from edgekv.attention import CacheAttention
from edgekv.cache import CacheSpec, CappedKVCache
from edgekv.model.config import TextConfig
from edgekv.model.language import Qwen2LM
from edgekv.model.rope import text_position_ids
from edgekv.session.decode_graph import DecodeGraph

CUDA = torch.cuda.is_available()


def language_model(dtype: torch.dtype, device: str, seed: int = 0) -> Qwen2LM:
    torch.manual_seed(seed)
    config = TextConfig(vocab_size=512, hidden_size=128, intermediate_size=192, num_hidden_layers=3,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, mrope_section=(2, 3, 3),
                        max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6)
    model = Qwen2LM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():  # larger than nn.Linear's init, so greedy tokens vary
            parameter.normal_(0.0, 0.15)
    return model.to(device=device, dtype=dtype)


def filled_cache(model: Qwen2LM, capacity: int, prompt: int, device: str) -> CappedKVCache:
    """A cache whose slots past ``prompt`` hold large garbage (what a compaction or an earlier answer leaves)."""
    text = model.config
    dtype = next(model.parameters()).dtype
    cache = CappedKVCache(CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, dtype),
                          capacity, device=device)
    gen = torch.Generator().manual_seed(3)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen) * 50)
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen) * 50)
    ids = torch.randint(0, text.vocab_size, (prompt,), generator=gen).to(device)
    with torch.inference_mode():
        model(model.embed_tokens(ids), text_position_ids(0, prompt, device), CacheAttention(cache, 0, prompt))
    cache.commit(prompt)
    return cache


def eager_steps(model: Qwen2LM, cache: CappedKVCache, token: int, position: int, steps: int):
    """The eager decode path (TorchLLM.prefill of one token), greedy."""
    tokens, logits = [], []
    with torch.inference_mode():
        for step in range(steps):
            embeds = model.embed_tokens(torch.tensor([token], device=cache.device))
            hidden = model(embeds, text_position_ids(position + step, 1, cache.device),
                           CacheAttention(cache, cache.length, 1))
            cache.commit(1)
            logits.append(model.logits(hidden[-1]).float().cpu())
            token = int(logits[-1].argmax())
            tokens.append(token)
    return tokens, torch.stack(logits)


def graph_steps(graph: DecodeGraph, token: int, position: int, steps: int):
    tokens, logits = [], []
    graph.feed(token, position)
    for _ in range(steps):
        logits.append(graph.step().float().cpu())
        tokens.append(int(graph.next_token))
    return tokens, torch.stack(logits)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 0.1)], ids=["fp32", "bf16"])
def test_the_static_step_is_the_eager_decode(dtype, tol):
    model = language_model(dtype, "cpu")
    prompt, capacity, position = 21, 64, 40  # the position is not the slot (a re-based stream)
    eager_cache, graph_cache = filled_cache(model, capacity, prompt, "cpu"), filled_cache(model, capacity, prompt, "cpu")
    want_tokens, want = eager_steps(model, eager_cache, 7, position, 12)
    graph = DecodeGraph(model, graph_cache, capture=False)
    got_tokens, got = graph_steps(graph, 7, position, 12)
    assert got_tokens == want_tokens and len(set(want_tokens)) >= 2
    assert (got - want).abs().max() <= tol * want.abs().max()
    assert graph_cache.length == eager_cache.length == prompt + 12
    # the K/V written at the decoded slots are the eager path's
    end = prompt + 12
    assert torch.allclose(graph_cache.k[:, :, :end].float(), eager_cache.k[:, :, :end].float(), atol=tol, rtol=tol)


def test_feeding_a_sampled_token_replaces_the_greedy_one():
    model = language_model(torch.float32, "cpu", seed=1)
    eager_cache, graph_cache = filled_cache(model, 48, 9, "cpu"), filled_cache(model, 48, 9, "cpu")
    graph = DecodeGraph(model, graph_cache, capture=False)
    chosen = [5, 300, 17]
    with torch.inference_mode():
        for step, token in enumerate(chosen):
            graph.feed(token, 9 + step)
            got = graph.step().clone()
            embeds = model.embed_tokens(torch.tensor([token]))
            hidden = model(embeds, text_position_ids(9 + step, 1), CacheAttention(eager_cache, eager_cache.length, 1))
            eager_cache.commit(1)
            assert torch.allclose(got, model.logits(hidden[-1]), atol=2e-5, rtol=2e-5)


def test_a_full_or_8_bit_cache_is_refused():
    model = language_model(torch.float32, "cpu")
    full = filled_cache(model, 16, 16, "cpu")
    with pytest.raises(ValueError, match="full"):
        DecodeGraph(model, full, capture=False)
    text = model.config
    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, torch.int8)
    quantized = CappedKVCache(spec, 16, rope=(model.inv_freq, 2))
    with pytest.raises(ValueError, match="16/32-bit"):
        DecodeGraph(model, quantized, capture=False)
    with pytest.raises(ValueError, match="CUDA"):
        DecodeGraph(model, filled_cache(model, 32, 4, "cpu"), capture=True)
    graph = DecodeGraph(model, filled_cache(model, 6, 4, "cpu"), capture=False)
    graph.feed(1, 4)
    graph.step()
    graph.step()
    with pytest.raises(ValueError, match="full"):
        graph.step()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile", [False, True], ids=["graph", "compiled-graph"])
def test_gpu_the_replayed_graph_is_the_eager_decode(compile):
    model = language_model(torch.bfloat16, "cuda")
    prompt, capacity, position = 37, 256, 37
    eager_cache, graph_cache = filled_cache(model, capacity, prompt, "cuda"), filled_cache(model, capacity, prompt, "cuda")
    want_tokens, want = eager_steps(model, eager_cache, 11, position, 16)
    graph = DecodeGraph(model, graph_cache, compile=compile)
    assert graph.graph is not None
    got_tokens, got = graph_steps(graph, 11, position, 16)
    assert got_tokens == want_tokens
    assert (got - want).abs().max() <= 0.1 * want.abs().max()
    # a second chain from a fed token: the graph reads the new inputs
    graph_cache.truncate(prompt)
    again_tokens, _ = graph_steps(graph, 11, position, 16)
    assert again_tokens == got_tokens


def test_the_graph_route_is_chosen_on_cuda_and_refused_without_it():
    from edgekv.model.decode_routes import resolve_route

    assert resolve_route("auto", torch.bfloat16, "cuda") == ("graph", None)
    assert resolve_route("graph", torch.float32, "cuda:0") == ("graph", None)
    assert resolve_route("auto", torch.bfloat16, "cuda", quantized=True)[0] != "graph"
    assert resolve_route("auto", torch.float32, "cpu")[0] == "eager"
    with pytest.raises(ValueError, match="graph: a CUDA graph needs a CUDA device"):
        resolve_route("graph", torch.bfloat16, "cpu")


def test_a_cpu_config_asking_for_graphs_is_refused_with_the_reason(tiny_checkpoint):
    import edgekv
    from edgekv.config import ConfigError

    with pytest.raises(ConfigError, match="decode_route: graph"):
        edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32", "decode_route": "graph"})


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_a_session_answers_the_same_through_its_decode_graph(tiny_checkpoint):
    """A CUDA session (decode_route auto = graph) and an eager one give the same answers to the same stream."""
    import numpy as np

    import edgekv

    answers = {}
    for route in ("eager", "auto"):
        rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cuda", "dtype": "fp32", "decode_route": route},
                                            video={"resolution": [56, 56]}, cache={"max_tokens": 1024})
        assert rt.decode_route == ("graph" if route == "auto" else "eager")
        session = rt.session()
        gen = np.random.default_rng(0)
        for index in range(6):
            session.ingest(gen.integers(0, 255, (56, 56, 3), dtype=np.uint8), t=index * 0.5)
        length = session.cache.length
        answers[route] = [session.ask(q, max_new_tokens=12).token_ids for q in ("what is red?", "and blue?")]
        assert session.cache.length == length
        assert (session.decode_graph() is not None) == (route == "auto")
    assert answers["auto"] == answers["eager"]


def test_a_session_answers_the_same_through_the_static_step(tiny_checkpoint):
    """The answer loop's graph branch, on the CPU (the static step runs eagerly there): the same answers and
    confidences as the eager loop, the cache left as it was, a recall-free question only."""
    import numpy as np

    import edgekv

    results = {}
    for route in ("eager", "graph"):
        rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32"},
                                            video={"resolution": [56, 56]}, cache={"max_tokens": 1024})
        rt.decode_route = route  # what a CUDA runtime resolves "auto" to
        session = rt.session()
        gen = np.random.default_rng(0)
        for index in range(6):
            session.ingest(gen.integers(0, 255, (56, 56, 3), dtype=np.uint8), t=index * 0.5)
        length = session.cache.length
        answers = [session.ask(q, max_new_tokens=10) for q in ("what is red?", "and blue?")]
        results[route] = [(a.token_ids, round(a.confidence, 4)) for a in answers]
        assert session.cache.length == length
        assert (session.decode_graph() is not None) == (route == "graph")
    assert results["graph"] == results["eager"]
    assert any(len(ids) > 3 for ids, _ in results["eager"])


def test_a_graph_that_does_not_build_falls_back_and_says_why(tiny_checkpoint, monkeypatch, caplog):
    """A kernel that fails to build on a GPU (none of the Triton kernels had run on one when this was written) must
    not cost the answer: the session tries the graph without the Triton kernels, then decodes eagerly, once."""
    import numpy as np

    import edgekv
    from edgekv.session import decode_graph as module

    built = []

    class Failing(module.DecodeGraph):
        def __init__(self, *args, **options):
            built.append(options)
            raise RuntimeError("triton: no kernel image for this device")

    monkeypatch.setattr(module, "DecodeGraph", Failing)
    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32"},
                                        video={"resolution": [56, 56]}, cache={"max_tokens": 1024})
    rt.decode_route = "graph"
    session = rt.session()
    session.ingest(np.zeros((56, 56, 3), dtype=np.uint8), t=0.0)
    session.ingest(np.zeros((56, 56, 3), dtype=np.uint8), t=0.5)
    with caplog.at_level("WARNING", logger="edgekv.session"):
        first = session.ask("what is red?", max_new_tokens=6)
        second = session.ask("what is red?", max_new_tokens=6)
    assert first.token_ids == second.token_ids and first.token_ids
    assert built == [{}, {"split_attention": False, "fused": False}]  # tried once each, not again per answer
    assert session.decode_graph() is None
    assert "no kernel image" in caplog.text and caplog.text.count("decode graph unavailable") == 1


def test_packing_the_projections_changes_no_value_and_no_memory():
    from edgekv.model.packing import pack_projections, packed_attention as _packed, packed_mlp as _packed_mlp

    model = language_model(torch.float32, "cpu")
    ids = torch.tensor([3, 1, 4, 1, 5])
    positions = text_position_ids(0, 5)
    from edgekv.model.language import dense_causal_attend

    with torch.inference_mode():
        before = model(model.embed_tokens(ids), positions, dense_causal_attend)
    weights = sum(p.numel() for p in model.parameters())
    assert pack_projections(model) == 3 and pack_projections(model) == 0  # once
    attn = model.layers[0].self_attn
    assert _packed(attn) and attn.qkv_weight.shape[0] == attn.q_proj.weight.shape[0] + 2 * attn.k_proj.weight.shape[0]
    assert attn.k_proj.weight.is_contiguous() and attn.k_proj.weight.data_ptr() > attn.qkv_weight.data_ptr()
    mlp = model.layers[0].mlp
    assert _packed_mlp(mlp) and mlp.gate_up_weight.shape[0] == 2 * mlp.gate_proj.weight.shape[0]
    assert mlp.up_proj.weight.is_contiguous() and mlp.up_proj.weight.data_ptr() > mlp.gate_up_weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == weights
    with torch.inference_mode():
        assert torch.equal(model(model.embed_tokens(ids), positions, dense_causal_attend), before)
    model.to(torch.float64)  # new tensors: the packed one no longer backs the projections
    assert not _packed(model.layers[0].self_attn) and not _packed_mlp(model.layers[0].mlp)
