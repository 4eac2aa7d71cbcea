"""The timing loop the device scripts share: a call made over ``copies`` different inputs (a token's worth of
layers or weights, which do not fit the L2), captured in one CUDA graph and replayed, so launch overhead is not
timed; on the CPU (the scripts' ``--small`` check) a plain loop."""

from __future__ import annotations

import time

import torch


def timed(call, copies: int, replays: int, cuda: bool) -> float:
    """Seconds a call: ``call(i)`` for i in range(copies) is one pass; after a warm-up pass, ``replays``
    passes replayed from a CUDA graph (or run plainly on the CPU)."""
    for i in range(copies):
        call(i)
    if not cuda:
        t0 = time.perf_counter()
        for i in range(copies):
            call(i)
        return (time.perf_counter() - t0) / copies
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(copies):
                call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * copies)


def row(result: dict, json_path: str, key: dict, prefix: str, measure) -> None:
    """One figure: ``measure()`` -> (figures dict, printed text); appended to ``result["rows"]`` with ``key``,
    printed after ``prefix``, and the JSON rewritten — or the error, so one failing route costs only itself."""
    import json

    try:
        figures, text = measure()
        entry = {**key, **figures}
        print(f"{prefix} {text}", flush=True)
    except Exception as exc:
        entry = {**key, "error": f"{type(exc).__name__}: {exc}"[:600]}
        print(f"{prefix} FAILED: {entry['error']}", flush=True)
    result["rows"].append(entry)
    with open(json_path, "w") as out:
        json.dump(result, out, indent=1)
