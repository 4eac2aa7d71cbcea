"""A frame pair's prefill through the language model as a CUDA graph, replayed for every later pair at the same
cache length (``model.pair_route: graph``; issue 32).

Measured (H200, 2026-11-27, 448x448, StateKV B = 1,024, M = 6,144, 300 pairs): 27.2 ms a pair through the graphs
against 65.3 eager (the prefill 11.4 ms against 49.7), 24.4 ms with the fused layers over 1,000 pairs.

Why: on an H200 a 3B frame pair (448x448, StateKV B = 1,024, M = 6,144) was 17-20 ms of device work in 56 ms of
wall time — 3,222 kernels a pair launched one by one from Python (``tools/gpu/profile_pair.py``, 2026-11-27); the
fused layers (``model.prefill_route: fused``) cut them to 2,250 and the device time to 17.2 ms, yet the pair took
68 ms, each Triton launch costing the host more than the torch operators it replaced. A Jetson's CPU launches
slower still. A graph launches the whole pair at once.

Why it can: the capped cache is allocated once and never moves (DESIGN invariant 1), and a pair's shapes are fixed
by three numbers — the cache length ``start`` where its tokens go, its token count ``P``, and (StateKV) the count
``V`` of committed slots every (layer, KV head) sees (the prefix and its sinks: ``edgekv.attention.visible_slots``).
Under a steady stream the length cycles through a few values between compressions (the policy compacts to the
same length each time), so a handful of graphs serve every pair. What changes from pair to pair is copied into
the graph's static buffers first:

    x          [P, d]          the pair's tokens from the vision tower
    cos, sin   [P, hd]         its M-RoPE angles (computed outside: ``Qwen2LM.rotary``; cast to the model dtype)
    gather     [L, Hkv, V]     the visible committed slots (StateKV's prefix and sinks), when there are any

The graph writes the pair's keys and values at slots ``[start, start + P)`` of the cache (8-bit codes included)
and, for StateKV, each key's attention mass into the sink selector's buffer, exactly as the eager path
(``edgekv.attention.CacheAttention``) does — the same function runs either way (``Qwen2LM.run_layers`` with the
same attend object), so a replay gives the eager path's bits. Metadata stays with the caller (host-side writes).

A key is captured the first time it is met: the step runs once eagerly on a side stream (it writes what the
replay writes: idempotent), is captured, then replayed. Graphs share one memory pool (their activations are
temporaries; the output is cloned before the next replay); at most ``max_graphs`` are held, the least recently
used dropped. A key whose capture fails runs eagerly from then on, with one warning. ``capture=False`` runs the
same static-buffer path without a graph: the CPU tests' twin of the CUDA path.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from edgekv.attention import CacheAttention, visible_slots
from edgekv.cache.capped import CappedKVCache
from edgekv.model.language import Qwen2LM

log = logging.getLogger("edgekv.session")

# "auto" picks "graph" on CUDA: it ran on an H200 on 2026-11-27 (issue 32) — a 3B pair 27.2 ms against 65.3 eager,
# 24.4 with the fused layers; the whole `-m gpu` suite green with it as the default
AUTO_PAIR_GRAPH = True


def resolve_pair_route(route: str, device: torch.device | str) -> str:
    """``model.pair_route`` -> "graph" or "eager": "graph" asks for it (a ValueError with the reason off CUDA);
    "auto" is "graph" on CUDA once ``AUTO_PAIR_GRAPH`` is set, "eager" elsewhere."""
    from edgekv.model.routes import cuda_route

    return cuda_route("pair_route", route, device, "graph", AUTO_PAIR_GRAPH, "a CUDA graph needs a CUDA device")


def graph_capture(language: Qwen2LM, cache: CappedKVCache, capture: bool | None) -> bool:
    """Whether a graph over ``language`` and ``cache`` is captured (``capture``; None: on CUDA), after checking that
    the two share a device and that a capture has a CUDA one (ValueErrors naming what is wrong)."""
    parameter = next(language.parameters())
    if parameter.device.type != cache.device.type or (parameter.device.index or 0) != (cache.device.index or 0):
        raise ValueError(f"the model is on {parameter.device} and the cache on {cache.device}")
    capture = (cache.device.type == "cuda") if capture is None else capture
    if capture and cache.device.type != "cuda":
        raise ValueError("a CUDA graph needs a CUDA cache and model")
    return capture


_CAPTURE_STREAMS: dict = {}
_CAPTURE_LOCK = threading.Lock()  # one capture at a time on the shared stream (cameras' sessions in threads)


def capture_stream(device: torch.device) -> "torch.cuda.Stream":
    """The one side stream every pair graph of ``device`` is warmed up and captured on. One, not one a capture:
    torch keeps a cuBLAS workspace per (handle, stream) for the process's life — 32 MiB each on Hopper — and the
    H200 run that made a stream per capture (2026-11-27, 3B) held 883 MiB more allocated memory than the eager
    stream, flat after the shapes were met: the ~25-30 cache lengths of that stream's first fill and cycle make as
    many workspaces, 800-960 MiB (the likely cause, not counted by that run; one stream is not yet measured on a
    GPU)."""
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[key]


class _Entry:
    """One captured shape: its static inputs, its attend object (fixed start, gather buffer) and its graph."""

    __slots__ = ("x", "cos", "sin", "gather", "attend", "out", "graph")

    def __init__(self, x, cos, sin, gather, attend) -> None:
        self.x, self.cos, self.sin, self.gather, self.attend = x, cos, sin, gather, attend
        self.out: torch.Tensor | None = None
        self.graph = None


class PairGraphs:
    """Frame-pair prefills of ``language`` into ``cache`` at static shapes, one CUDA graph per shape."""

    def __init__(self, language: Qwen2LM, cache: CappedKVCache, capture: bool | None = None, max_graphs: int = 32,
                 warmup: int = 1) -> None:
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be at least 1, got {max_graphs}")
        self.language = language
        self.cache = cache
        self.device = cache.device
        self.capture = graph_capture(language, cache, capture)
        self.max_graphs = max_graphs
        self.warmup = max(1, warmup)
        self._entries: OrderedDict = OrderedDict()
        self._failed: set = set()
        self._pool = None
        self.captures = 0  # graphs captured (a new cache length met, or one dropped and met again)
        self.replays = 0
        self.reuses = 0  # pairs served by a shape already held

    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor | None = None,
                mass_out: torch.Tensor | None = None) -> torch.Tensor:
        """What ``TorchLLM.prefill(embeds, positions, cache, visible, mass_out)`` computes, through the graph of
        this shape: writes the chunk's K/V at ``cache.length`` (the caller commits) and returns the final hidden
        states [P, d]. Visibility the gathered path cannot serve (unequal counts per head, a mask without mass)
        runs eagerly."""
        cache = self.cache
        start, num = cache.length, embeds.shape[0]
        if start + num > cache.capacity:
            raise ValueError(f"chunk [{start}, {start + num}) exceeds cache capacity {cache.capacity}")
        gather = None
        if visible is not None:
            gather = visible_slots(visible[:, :, :start]) if mass_out is not None else None
            if gather is None:
                return self._eager(embeds, positions, visible, mass_out)
        key = (start, num, None if gather is None else gather.shape[2],
               None if mass_out is None else (mass_out.data_ptr(), tuple(mass_out.shape)), embeds.dtype)
        if key in self._failed:
            return self._eager(embeds, positions, visible, mass_out)
        cos, sin = self.language.rotary(positions)
        # static buffers are plain tensors whichever mode the caller is in (see engines/torch_backend.VisionGraphs)
        with torch.inference_mode(False), torch.no_grad():
            entry = self._entries.get(key)
            if entry is None:
                entry = _Entry(torch.empty(embeds.shape, dtype=embeds.dtype, device=self.device),
                               torch.empty(cos.shape, dtype=embeds.dtype, device=self.device),
                               torch.empty(sin.shape, dtype=embeds.dtype, device=self.device),
                               None if gather is None else torch.empty_like(gather),
                               CacheAttention(cache, start, num, mass_out=mass_out))
                entry.attend.gather = entry.gather  # the StateKV path reads the buffer the graph captured
                entry.attend.mask = None  # read only where a visibility mask is attended, which never comes here
            self._feed(entry, embeds, cos, sin, gather)
            if entry.graph is None and key not in self._entries:
                try:
                    self._build(entry)
                except Exception as exc:  # a shape that cannot be captured runs eagerly from now on
                    self._failed.add(key)
                    log.warning("pair prefill: CUDA graph at cache length %d not captured (%s: %s); that shape "
                                "runs eagerly", start, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
                    return self._eager(embeds, positions, visible, mass_out)
                self._entries[key] = entry
                if len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
                self.reuses += 1
            if entry.graph is not None:
                entry.graph.replay()
                self.replays += 1
                out = entry.out
            else:
                out = self._step(entry)
            return out.clone()

    # ------------------------------------------------------------------------------------------------ inside
    def _step(self, entry: _Entry) -> torch.Tensor:
        return self.language.run_layers(entry.x, entry.cos, entry.sin, entry.attend)

    @staticmethod
    def _feed(entry: _Entry, embeds, cos, sin, gather) -> None:
        entry.x.copy_(embeds)
        entry.cos.copy_(cos)  # fp32 angles -> the model dtype, as Qwen2LM.forward casts them
        entry.sin.copy_(sin)
        if gather is not None:
            entry.gather.copy_(gather)

    def _build(self, entry: _Entry) -> None:
        if not self.capture:
            return
        device = self.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with _CAPTURE_LOCK:
            self._capture(entry, capture_stream(device))

    def _capture(self, entry: _Entry, stream) -> None:
        device = self.device
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):  # kernels compiled, workspaces sized outside the capture; writes what
                self._step(entry)          # the replay writes
            graph = torch.cuda.CUDAGraph()
            # thread_local: another camera's thread launching work meanwhile neither breaks this capture nor fails
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                out = self._step(entry)
        torch.cuda.current_stream(device).wait_stream(stream)
        entry.graph, entry.out = graph, out
        self.captures += 1

    def _eager(self, embeds, positions, visible, mass_out) -> torch.Tensor:
        attend = CacheAttention(self.cache, self.cache.length, embeds.shape[0], visible=visible, mass_out=mass_out)
        return self.language(embeds, positions, attend)

    def stats(self) -> dict:
        return {"graphs": len(self._entries), "captures": self.captures, "replays": self.replays,
                "reuses": self.reuses, "failed_shapes": len(self._failed)}
