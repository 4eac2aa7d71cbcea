"""The vision tower as CUDA graphs (engines/torch_backend.py VisionGraphs, ``model.vision_route``).

On the CPU the static-buffer path runs without a graph (``capture=False``): the copy into the fixed input, the
layout's ``forward_layout`` and the clone out are what the CUDA graph captures and replays. The gpu-marked tests
capture and replay it on CUDA.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from edgekv.engines.torch_backend import TorchVision, VisionGraphs, resolve_vision_route

CUDA = torch.cuda.is_available()


def pixels(tower, grid: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    patches = grid[0] * grid[1] * grid[2]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(patches, tower.config.patch_dim, generator=gen), torch.tensor([grid])


@pytest.fixture(scope="module")
def tower(tiny_checkpoint):
    import edgekv

    return edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32"}).model.visual


def test_the_static_path_is_the_eager_tower_bit_for_bit(tower):
    graphs = VisionGraphs(tower, capture=False)
    with torch.no_grad():
        for grid, seed in (((1, 4, 6), 0), ((1, 8, 8), 1), ((1, 4, 6), 2)):  # a grid seen again reuses its entry
            values, grid_thw = pixels(tower, grid, seed)
            assert torch.equal(graphs(values, grid_thw), tower(values, grid_thw))
    assert len(graphs._entries) == 2


def test_the_output_is_the_callers_and_the_grids_held_are_bounded(tower):
    graphs = VisionGraphs(tower, max_graphs=1, capture=False)
    with torch.no_grad():
        first, grid_a = pixels(tower, (1, 4, 6), 0)
        out = graphs(first, grid_a)
        kept = out.clone()
        graphs(*pixels(tower, (1, 4, 6), 3))  # the next pair of the grid: the first answer is not overwritten
        assert torch.equal(out, kept)
        graphs(*pixels(tower, (1, 8, 8), 1))
    assert len(graphs._entries) == 1 and next(iter(graphs._entries))[0] == ((1, 8, 8),)


def test_an_entry_keeps_its_layout_alive_when_the_towers_cache_drops_it(tower):
    """A captured graph reads the layout's tensors at their addresses: the entry must own them."""
    graphs = VisionGraphs(tower, capture=False)
    values, grid_thw = pixels(tower, (1, 4, 6), 0)
    with torch.no_grad():
        graphs(values, grid_thw)
        tower._layouts.clear()  # the tower's LRU of layouts holds 8 grids
        entry = next(iter(graphs._entries.values()))
        assert entry[3] is not None and entry[3].token_order.numel() == 24
        assert torch.equal(graphs(values, grid_thw), tower(values, grid_thw))


def test_built_under_inference_mode_and_replayed_outside_it(tower):
    graphs = VisionGraphs(tower, capture=False)
    values, grid_thw = pixels(tower, (1, 4, 6), 0)
    with torch.inference_mode():
        first = graphs(values, grid_thw)
    with torch.no_grad():
        again = graphs(values, grid_thw)
    assert torch.equal(first, again) and not again.requires_grad


def test_bad_input_is_the_towers_error_not_a_capture_failure(tower):
    graphs = VisionGraphs(tower, capture=False)
    values, grid_thw = pixels(tower, (1, 4, 6), 0)
    with pytest.raises(ValueError, match="pixel_values must be"):
        graphs(values[:-4], grid_thw)
    with pytest.raises(ValueError, match="grid_thw must be"):
        graphs(values, grid_thw[0])
    assert not graphs._failed and not graphs._entries


def test_a_grid_whose_capture_fails_runs_eagerly_with_one_warning(tower, monkeypatch, caplog):
    graphs = VisionGraphs(tower, capture=False)

    def fail(*args):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs, "_build", fail)
    values, grid_thw = pixels(tower, (1, 4, 6), 0)
    with caplog.at_level(logging.WARNING, logger="edgekv"), torch.no_grad():
        for _ in range(3):
            assert torch.equal(graphs(values, grid_thw), tower(values, grid_thw))
    warnings = [r for r in caplog.records if "not captured" in r.getMessage()]
    assert len(warnings) == 1 and "stream is capturing" in warnings[0].getMessage()


def test_the_route_is_a_graph_on_cuda_when_asked_and_refused_without_it(monkeypatch):
    import edgekv.engines.torch_backend as backend

    assert resolve_vision_route("graph", "cuda:0") == "graph"
    assert resolve_vision_route("auto", "cpu") == resolve_vision_route("eager", "cuda") == "eager"
    assert resolve_vision_route("auto", "cuda") == "graph" and resolve_vision_route("auto", "cpu") == "eager"
    monkeypatch.setattr(backend, "AUTO_VISION_GRAPH", False)  # the switch that kept it opt-in before a GPU ran it
    assert resolve_vision_route("auto", "cuda") == "eager"
    with pytest.raises(ValueError, match="vision_route: graph: a CUDA graph needs a CUDA device"):
        resolve_vision_route("graph", "cpu")
    with pytest.raises(ValueError, match="unknown route 'fast'"):
        resolve_vision_route("fast", "cpu")


def test_a_cpu_config_asking_for_a_vision_graph_is_refused_and_auto_is_eager(tiny_checkpoint):
    import edgekv
    from edgekv.config import ConfigError

    with pytest.raises(ConfigError, match="vision_route: graph"):
        edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "vision_route": "graph"})
    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu"})
    assert rt.vision_route == "eager" and rt.vision_backend.graphs is None
    assert rt.session().stats()["vision_route"] == "eager"


def test_a_session_ingests_the_same_through_the_static_path(tiny_checkpoint):
    """The session's ingest with the vision tower behind VisionGraphs (static path on the CPU) leaves the same
    cache and gives the same answers as the eager tower."""
    import edgekv

    results = {}
    for route in ("eager", "graph"):
        rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32"},
                                            video={"resolution": [56, 56]}, cache={"max_tokens": 1024})
        if route == "graph":  # what a CUDA runtime builds, without the capture
            rt.vision_backend = TorchVision(rt.model, "eager")
            rt.vision_backend.graphs = VisionGraphs(rt.model.visual, capture=False)
        session = rt.session()
        gen = np.random.default_rng(0)
        for index in range(6):
            session.ingest(gen.integers(0, 255, (56, 56, 3), dtype=np.uint8), t=index * 0.5)
        results[route] = (session.cache.k[:, :, : session.cache.length].clone(),
                          session.ask("what is red?", max_new_tokens=8).token_ids)
    assert torch.equal(results["graph"][0], results["eager"][0]) and results["graph"][1] == results["eager"][1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_the_replayed_tower_is_the_eager_tower(tiny_checkpoint):
    import edgekv

    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cuda", "dtype": "fp32",
                                                                "vision_route": "graph"})
    assert rt.vision_route == "graph" and rt.vision_backend.graphs is not None
    tower = rt.model.visual
    with torch.no_grad():
        for seed in range(3):  # capture, then replays with new pixels
            values, grid_thw = pixels(tower, (1, 8, 8), seed)
            got, want = rt.vision_backend.encode(values.cuda(), grid_thw), tower(values.cuda(), grid_thw)
            assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    entry = next(iter(rt.vision_backend.graphs._entries.values()))
    assert entry[2] is not None  # a real CUDA graph, not the static path


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_a_session_answers_the_same_through_the_vision_graph(tiny_checkpoint):
    import edgekv

    answers = {}
    for route in ("eager", "graph"):
        rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cuda", "dtype": "fp32",
                                                                    "vision_route": route},
                                            video={"resolution": [56, 56]}, cache={"max_tokens": 1024})
        session = rt.session()
        gen = np.random.default_rng(0)
        for index in range(6):
            session.ingest(gen.integers(0, 255, (56, 56, 3), dtype=np.uint8), t=index * 0.5)
        answers[route] = [session.ask(q, max_new_tokens=12).token_ids for q in ("what is red?", "and blue?")]
    assert answers["graph"] == answers["eager"]
