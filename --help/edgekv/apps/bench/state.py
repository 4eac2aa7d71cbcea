"""``edgekv bench state``: snapshot write / read ms and bytes at a cache shape (default: Qwen2.5-VL-3B's).

The cost of a snapshot is the cost of its cache: the model's weights are never written. So this builds
the capped cache alone — ``CappedKVCache`` at 36 layers, 2 KV heads, head_dim 128, M = 6144 by default —
fills every slot (a full cache, the largest snapshot) with random K/V, metadata and StateKV mass, and
times ``edgekv.state.write_snapshot`` (one pass: copy per layer, sha256, write, fsync, rename, fsync of
the folder) and ``read_tensors`` (read, sha256 check, copy into the cache) per dtype. Prints and saves
JSON + PNG; the figures depend on the disk and on what else the machine is doing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from edgekv.cache.capped import CappedKVCache, SlotKind
from edgekv.cache.specs import CacheSpec
from edgekv.session.results import Counters
from edgekv.state import FORMAT, cache_views, read_manifest, read_tensors, write_snapshot
from edgekv.threads import threads_argument

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def add_state_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=6144, help="cache capacity M (the cache is full)")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: fp32, fp16, bf16")
    parser.add_argument("--sinks", action="store_true", help="include StateKV's attention mass (fp32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dir", default=None, help="folder to write in (default: a temporary folder)")
    parser.add_argument("--json", default="bench-state.json")
    parser.add_argument("--plot", default="bench-state.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_state)


def full_cache(layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> CappedKVCache:
    """A CappedKVCache with every slot holding a vision token of random K/V (the largest snapshot)."""
    cache = CappedKVCache(CacheSpec.uniform(layers, kv_heads, head_dim, dtype), tokens)
    generator = torch.Generator().manual_seed(0)
    for layer in range(layers):  # one layer at a time: no full-size fp32 temporary
        shape = (kv_heads, tokens, head_dim)
        cache.k[layer].copy_(torch.randn(shape, generator=generator))
        cache.v[layer].copy_(torch.randn(shape, generator=generator))
    slots = torch.arange(tokens, dtype=torch.int32)
    cache.kind.fill_(int(SlotKind.VISION))
    cache.frame.copy_((slots // 256).expand_as(cache.frame))
    cache.row.copy_((slots % 16).to(torch.int16).expand_as(cache.row))
    cache.col.copy_((slots // 16 % 16).to(torch.int16).expand_as(cache.col))
    cache.tpos.copy_((slots // 256 * 2).expand_as(cache.tpos))
    cache.length = tokens
    return cache


def bench_session_state(cache: CappedKVCache) -> dict:
    """A session's state as ``edgekv.state`` writes it beside a full cache of this shape (every field its reader
    checks; a pair's time for each of the cache's frame pairs), so that the manifest is one a daemon would read."""
    pairs = int(cache.frame[0, : cache.length].max()) + 1 if cache.length else 0
    return {"cache_length": cache.length, "counters": dataclasses.asdict(Counters(frames=2 * pairs, frame_pairs=pairs)),
            "next_position": int(cache.tpos[0, : cache.length].max()) + 1 if cache.length else 0, "t_offset": 0,
            "rebases": 0, "video_start": 0, "prefix_tokens": 0, "grid": [16, 16], "t0": 0.0,
            "last_t": float(2 * pairs), "pending_t": None, "clock": None, "sink_updates": 0,
            "pair_times": {str(pair): float(2 * pair) for pair in range(pairs)}, "policy": None}


def measure(cache: CappedKVCache, folder: Path, repeats: int, sinks: bool) -> dict:
    mass = torch.rand(cache.num_layers, cache.kv_heads, cache.capacity) if sinks else None
    views = cache_views(cache, cache.length, mass)
    manifest = {"format": FORMAT, "key": {}, "session": bench_session_state(cache)}
    path = folder / "bench.ekv"
    write_ms, read_ms, size = [], [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        size = write_snapshot(path, manifest, views)
        write_ms.append((time.perf_counter() - started) * 1e3)
        started = time.perf_counter()
        read_tensors(path, read_manifest(path), views)
        read_ms.append((time.perf_counter() - started) * 1e3)
    path.unlink()
    return {"bytes": size, "cache_capacity_bytes": cache.capacity_bytes, "kv_bytes": cache.kv_bytes,
            "write_ms_median": statistics.median(write_ms), "write_ms": write_ms,
            "read_ms_median": statistics.median(read_ms), "read_ms": read_ms,
            "write_mib_per_s": size / 2**20 / (statistics.median(write_ms) / 1e3)}


def run_state(args: argparse.Namespace) -> int:
    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)
    folder = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="edgekv-bench-state-"))
    folder.mkdir(parents=True, exist_ok=True)
    shape = f"{args.layers} layers x {args.kv_heads} KV heads x head_dim {args.head_dim}, M={args.tokens}"
    print(f"state: snapshot of a full cache ({shape}) in {folder}, {args.repeats} repeats")
    results = {}
    for name in args.dtypes.split(","):
        if name not in _DTYPES:
            print(f"edgekv bench state: unknown dtype {name!r} (fp32, fp16, bf16)")
            return 2
        cache = full_cache(args.layers, args.kv_heads, args.head_dim, args.tokens, _DTYPES[name])
        results[name] = result = measure(cache, folder, args.repeats, args.sinks)
        del cache
        print(f"  {name}: {result['bytes'] / 2**20:.1f} MiB on disk (cache allocates "
              f"{result['cache_capacity_bytes'] / 2**20:.1f} MiB), write {result['write_ms_median']:.0f} ms "
              f"({result['write_mib_per_s']:.0f} MiB/s, fsync included), read + verify {result['read_ms_median']:.0f} ms")
    setup = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "tokens": args.tokens,
             "sinks": args.sinks, "repeats": args.repeats, "folder": str(folder), "machine": platform.machine(),
             "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "load_avg": list(os.getloadavg())}
    Path(args.json).write_text(json.dumps({"setup": setup, "results": results}, indent=1))
    if args.plot:
        _plot(results, Path(args.plot), shape)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    axes[0].bar(names, [results[n]["bytes"] / 2**20 for n in names])
    axes[0].set_ylabel("snapshot MiB")
    width = 0.38
    xs = range(len(names))
    axes[1].bar([x - width / 2 for x in xs], [results[n]["write_ms_median"] for n in names], width, label="write")
    axes[1].bar([x + width / 2 for x in xs], [results[n]["read_ms_median"] for n in names], width, label="read + verify")
    axes[1].set_xticks(list(xs), names)
    axes[1].set_ylabel("ms (median)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(f"full-cache snapshot: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
