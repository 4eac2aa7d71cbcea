"""The reference backends: edgekv's own torch modules (default off-Jetson)."""

from __future__ import annotations

import torch

from edgekv.attention import CacheAttention
from edgekv.cache.capped import CappedKVCache
from edgekv.model.qwen25vl import Qwen25VL


class TorchVision:
    """The vision tower in torch; ``route`` "graph" replays a CUDA graph of the tower per frame-pair grid
    (``VisionGraphs``), "eager" runs its modules (``resolve_vision_route`` picks)."""

    name = "torch"

    def __init__(self, model: Qwen25VL, route: str = "eager") -> None:
        self.model = model
        self.graphs = VisionGraphs(model.visual) if route == "graph" else None

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None:
            return self.graphs(pixel_values, grid_thw)
        return self.model.visual(pixel_values, grid_thw)


# "auto" picks the graph on CUDA: it ran on an H200 (issue 32, 2026-11-26, third session): the replayed tower equals the
# eager one (tests/test_vision_graph.py, gpu), and the 3B pair's vision took 11.4 ms instead of 20.3 (448 x 448, bf16)
AUTO_VISION_GRAPH = True


def resolve_vision_route(route: str, device: torch.device | str) -> str:
    """``model.vision_route`` -> "graph" or "eager": "graph" asks for the CUDA graph (a ValueError with the reason
    off CUDA); "auto" is the graph on CUDA (``AUTO_VISION_GRAPH``) and eager elsewhere."""
    from edgekv.model.routes import cuda_route

    return cuda_route("vision_route", route, device, "graph", AUTO_VISION_GRAPH, "a CUDA graph needs a CUDA device")


class VisionGraphs:
    """The vision tower as CUDA graphs, one per frame-pair grid, replayed for every pair of that grid.

    Why: on an H200 the 3B tower took ~22 ms a 448x448 pair run eagerly, with the session's CPU time equal to
    its wall time — launch-bound, ~5 % of the GPU's bf16 rate (issue 32, 2026-11-26); a Jetson's CPU launches
    slower still. ``VisionTower.forward_layout`` has no shape-dependent Python and no host sync for a
    precomputed layout (the ONNX export relies on it too), so one capture per grid serves every pair: the pixels
    are copied into a static buffer, the graph replayed, the merged tokens cloned out (the next replay
    overwrites its output). A lock makes the copy-replay-clone one step for cameras sharing the tower. At most
    ``max_graphs`` grids are held (each keeps its activations' memory pool); a grid whose capture fails runs
    eagerly from then on, with one warning. ``capture=False`` runs the same static-buffer path without a graph
    (the CPU tests' twin of the CUDA path)."""

    def __init__(self, tower, max_graphs: int = 4, capture: bool = True, warmup: int = 2) -> None:
        import threading
        from collections import OrderedDict

        self.tower = tower
        self.max_graphs = max_graphs
        self.capture = capture
        self.warmup = warmup
        self._entries: OrderedDict = OrderedDict()
        self._failed: set = set()
        self._lock = threading.Lock()

    def __call__(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        self.tower.check_inputs(pixel_values, grid_thw)  # bad input is the caller's error, not a capture failure
        device = self.tower.patch_embed.proj.weight.device
        grid = tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())
        key = (grid, tuple(pixel_values.shape), pixel_values.dtype, str(device))
        if key in self._failed:
            return self.tower(pixel_values, grid_thw)
        # static buffers are plain tensors (not inference tensors) whichever mode the caller is in, so a replay
        # under torch.no_grad after a capture under torch.inference_mode may still write into them
        with self._lock, torch.inference_mode(False), torch.no_grad():
            entry = self._entries.get(key)
            if entry is None:
                try:
                    entry = self._build(pixel_values, grid_thw, device)
                except Exception as exc:  # a graph that cannot be captured: this grid runs eagerly
                    import logging

                    self._failed.add(key)
                    logging.getLogger("edgekv").warning("vision: CUDA graph of grid %s not captured (%s: %s); "
                                                        "running the tower eagerly", grid, type(exc).__name__, exc)
                    return self.tower(pixel_values, grid_thw)
                self._entries[key] = entry
                if len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            static_in, static_out, graph, layout = entry
            static_in.copy_(pixel_values)  # to the tower's device and the buffer's dtype, as the eager path
            if graph is not None:
                graph.replay()
            else:
                static_out = self.tower.forward_layout(static_in, layout)
            return static_out.clone()

    def _build(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor, device: torch.device):
        layout = self.tower.layout(grid_thw, device)
        static_in = torch.empty(pixel_values.shape, dtype=pixel_values.dtype, device=device)
        static_in.copy_(pixel_values)
        # the entry holds the layout: the graph reads its index and angle tensors at their captured addresses,
        # and the tower's own layout cache may drop them
        if not self.capture:
            return static_in, None, None, layout
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # kernels compiled and workspaces sized outside the capture
                self.tower.forward_layout(static_in, layout)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                static_out = self.tower.forward_layout(static_in, layout)
        torch.cuda.current_stream(device).wait_stream(stream)
        return static_in, static_out, graph, layout


class TorchLLM:
    name = "torch"

    def __init__(self, model: Qwen25VL) -> None:
        self.language = model.language

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.language.embed_tokens(ids)

    def prefill(self, embeds: torch.Tensor, position_ids: torch.Tensor, cache: CappedKVCache,
                visible: torch.Tensor | None = None, mass_out: torch.Tensor | None = None) -> torch.Tensor:
        attend = CacheAttention(cache, cache.length, embeds.shape[0], visible=visible, mass_out=mass_out)
        return self.language(embeds, position_ids, attend)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language.logits(hidden)
