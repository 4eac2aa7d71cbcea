"""``model.pair_route`` (edgekv/session/pair_graph.py): a frame pair's LM prefill at static shapes, one CUDA graph
per cache length.

On the CPU the static-buffer path runs without a graph (``capture=False``, the CUDA path's twin): a stream through
it leaves the cache, the sink set and the answers bit for bit as the eager path does, through compressions, with
shapes dropped and met again, and when a capture fails. On a GPU the same with the graphs captured and replayed.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from edgekv.session.pair_graph import PairGraphs, resolve_pair_route

CUDA = torch.cuda.is_available()

# 112x112 pairs: 16 tokens each in the tiny preset; 320 slots hold the prefix and ~15 pairs, so compressions come
CACHES = {
    "statekv": {"policy": "statekv", "sinks": 32, "max_tokens": 320, "text_reserve_tokens": 64},
    "statekv-int8": {"policy": "statekv", "sinks": 32, "max_tokens": 320, "text_reserve_tokens": 64, "kv_dtype": "int8"},
    "infinipot_v": {"policy": "infinipot_v", "max_tokens": 320, "text_reserve_tokens": 64},
}


def _stream(session, pairs: int = 30, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for i in range(2 * pairs):
        session.ingest(rng.integers(0, 255, (112, 112, 3), dtype=np.uint8), t=i * 0.5)


def _state(session) -> dict:
    cache = session.cache
    state = {name: getattr(cache, name)[:, :, : cache.length].clone()
             for name in ("k", "v", "kind", "sink", "frame", "tpos")}
    if cache.quantized:
        state.update(k_scale=cache.k_scale[:, :, : cache.length].clone(),
                     v_scale=cache.v_scale[:, :, : cache.length].clone())
    if session.sinks is not None:
        state["mass"] = session.sinks.mass[:, :, : cache.length].clone()
    state["length"] = cache.length
    return state


def _assert_same(a: dict, b: dict) -> None:
    assert a["length"] == b["length"]
    for name in a:
        if name != "length":
            assert torch.equal(a[name], b[name]), name


def _runtime(checkpoint, cache: dict, device: str = "cpu", **model):
    import edgekv

    return edgekv.Runtime.from_pretrained(checkpoint, model={"device": device, "dtype": "fp32", **model},
                                          video={"resolution": [112, 112], "fps": 2}, cache=cache)


def test_the_route_resolves_and_is_refused_off_cuda(tiny_checkpoint, monkeypatch):
    import edgekv
    import edgekv.session.pair_graph as pair_graph
    from edgekv.config import ConfigError

    assert resolve_pair_route("graph", "cuda:0") == "graph"
    assert resolve_pair_route("auto", "cpu") == resolve_pair_route("eager", "cuda") == "eager"
    monkeypatch.setattr(pair_graph, "AUTO_PAIR_GRAPH", True)
    assert resolve_pair_route("auto", "cuda") == "graph" and resolve_pair_route("auto", "cpu") == "eager"
    with pytest.raises(ValueError, match="pair_route: graph: a CUDA graph needs a CUDA device"):
        resolve_pair_route("graph", "cpu")
    with pytest.raises(ConfigError, match="pair_route: graph"):
        edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "pair_route": "graph"})
    session = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu"}).session()
    assert session.stats()["pair_route"] == "eager" and session.pair_graphs() is None


def test_a_capture_off_cuda_is_refused():
    from test_decode_graph import filled_cache, language_model

    model = language_model(torch.float32, "cpu")
    cache = filled_cache(model, 64, 4, "cpu")
    with pytest.raises(ValueError, match="a CUDA graph needs a CUDA cache"):
        PairGraphs(model, cache, capture=True)
    with pytest.raises(ValueError, match="max_graphs must be at least 1"):
        PairGraphs(model, cache, capture=False, max_graphs=0)


def _graph_session(runtime, monkeypatch, **options):
    """A session whose pairs go through PairGraphs (capture=False on the CPU): the route forced to "graph"."""
    session = runtime.session()
    monkeypatch.setattr(runtime, "pair_route", "graph")
    session._pair_graphs = PairGraphs(session.model.language, session.cache, capture=False, **options)
    return session


@pytest.mark.parametrize("name", sorted(CACHES))
def test_the_static_path_streams_the_eager_bits(tiny_checkpoint, monkeypatch, name):
    eager = _runtime(tiny_checkpoint, CACHES[name]).session()
    _stream(eager)
    graphed = _graph_session(_runtime(tiny_checkpoint, CACHES[name]), monkeypatch)
    _stream(graphed)
    assert graphed.stats()["compressions"] == eager.stats()["compressions"] > 2
    _assert_same(_state(graphed), _state(eager))
    stats = graphed.pair_graphs().stats()
    # shapes recur: after the first compression the cache length cycles, so fewer shapes than pairs
    assert 0 < stats["graphs"] < 30 and stats["reuses"] > 0 and stats["failed_shapes"] == 0
    question = "what is red?"
    assert graphed.ask(question, max_new_tokens=4).token_ids == eager.ask(question, max_new_tokens=4).token_ids
    _assert_same(_state(graphed), _state(eager))  # asking left both caches as they were


def test_shapes_dropped_and_met_again_and_a_failed_capture_keep_the_bits(tiny_checkpoint, monkeypatch, caplog):
    cache = CACHES["statekv"]
    eager = _runtime(tiny_checkpoint, cache).session()
    _stream(eager)
    few = _graph_session(_runtime(tiny_checkpoint, cache), monkeypatch, max_graphs=2)
    _stream(few)
    _assert_same(_state(few), _state(eager))
    assert few.pair_graphs().stats()["graphs"] == 2

    failing = _graph_session(_runtime(tiny_checkpoint, cache), monkeypatch)
    graphs = failing.pair_graphs()

    def broken(entry):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_build", broken)
    with caplog.at_level(logging.WARNING, logger="edgekv.session"):
        _stream(failing)
    _assert_same(_state(failing), _state(eager))
    assert graphs.stats()["graphs"] == 0 and graphs.stats()["failed_shapes"] > 0
    assert "not captured (RuntimeError: operation not permitted" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", sorted(CACHES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_gpu_a_stream_through_the_graphs_is_the_eager_stream(tiny_checkpoint, name, dtype):
    states, answers, sessions = {}, {}, {}
    for route in ("eager", "graph"):
        runtime = _runtime(tiny_checkpoint, CACHES[name], device="cuda", dtype=dtype, pair_route=route)
        assert runtime.pair_route == route
        session = runtime.session()
        _stream(session)
        states[route] = _state(session)
        answers[route] = session.ask("what is red?", max_new_tokens=4).token_ids
        sessions[route] = session
    _assert_same(states["graph"], states["eager"])
    assert answers["graph"] == answers["eager"]
    stats = sessions["graph"].pair_graphs().stats()
    assert stats["captures"] > 0 and stats["replays"] >= 30 and stats["failed_shapes"] == 0
    assert sessions["graph"].stats()["pair_route"] == "graph"


def test_every_capture_of_a_device_shares_one_stream(monkeypatch):
    """torch keeps a cuBLAS workspace per (handle, stream) for the process's life (32 MiB on Hopper): the H200 run
    that made a stream per capture held 883 MiB more than the eager stream. Captures share one stream a device."""
    import edgekv.session.pair_graph as pair_graph

    made = []

    class Stream:
        def __init__(self, device):
            made.append(device)

    monkeypatch.setattr(pair_graph.torch.cuda, "Stream", Stream)
    monkeypatch.setattr(pair_graph, "_CAPTURE_STREAMS", {})
    first = pair_graph.capture_stream(torch.device("cuda", 0))
    assert pair_graph.capture_stream(torch.device("cuda", 0)) is first and len(made) == 1
    assert pair_graph.capture_stream(torch.device("cuda", 1)) is not first and len(made) == 2
