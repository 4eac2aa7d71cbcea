"""``edgekv bench compression``: one CKV compression's scoring and selection ms per cache dtype.

Builds a ``CacheView`` at a cache shape (default Qwen2.5-VL-3B's: 36 layers, 2 KV heads, 2063 slots,
head_dim 128; a 16 x 16 merged grid per frame pair) holding a prefix, older frame pairs thinned by earlier
compactions (a different random subset per layer and head, as a compacted cache holds) and whole recent
pairs, with random K/V in the dtype under test. Times ``select`` of ``infinipot_v`` (TaR + VaN, InfiniPot-V
Alg. 1-2) and of ``tar`` and ``van`` alone, per dtype; prints and saves JSON + PNG. The kept slots do not
depend on the time, so figures only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from edgekv.cache.capped import SlotKind
from edgekv.model.rope import rotary_inv_freq
from edgekv.policies.base import CacheView, make_policy
from edgekv.threads import threads_argument

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
POLICIES = ("infinipot_v", "tar", "van")


def add_compression_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2063, help="slots held when the compression runs (n)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--grid", type=int, nargs=2, default=[16, 16], metavar=("ROWS", "COLS"),
                        help="merged grid of one frame pair")
    parser.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated: fp32, bf16, fp16")
    parser.add_argument("--policies", default=",".join(POLICIES), help=f"comma-separated, from {', '.join(POLICIES)}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=threads_argument, default="auto", help="torch CPU threads, or auto (edgekv/threads.py)")
    parser.add_argument("--json", default="bench-compression.json")
    parser.add_argument("--plot", default="bench-compression.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_compression)


def synthetic_view(layers: int, kv_heads: int, tokens: int, head_dim: int, grid: tuple[int, int],
                   dtype: torch.dtype, seed: int = 0, prefix: int = 15, recent_pairs: int = 2) -> CacheView:
    """A compacted-looking cache of ``tokens`` slots: ``prefix`` prefix slots, thinned old frame pairs
    (each (layer, head) keeps its own random half of each old pair's cells) and ``recent_pairs`` whole
    pairs at the end; K and V random normal (V scaled per slot so norms vary), rounded to ``dtype``."""
    rows, cols = grid
    cells = rows * cols
    vision = tokens - prefix
    recent = min(recent_pairs * cells, vision)
    old = vision - recent
    per_old_pair = max(cells // 2, 1)
    old_pairs = -(-old // per_old_pair)
    gen = torch.Generator().manual_seed(seed)
    shape = (layers, kv_heads, tokens)
    frame = torch.full(shape, -1, dtype=torch.int32)
    row = torch.full(shape, -1, dtype=torch.int16)
    col = torch.full(shape, -1, dtype=torch.int16)
    kind = torch.full(shape, int(SlotKind.VISION), dtype=torch.int8)
    kind[:, :, :prefix] = int(SlotKind.PREFIX)
    for layer in range(layers):
        for head in range(kv_heads):
            picks = [torch.randperm(cells, generator=gen)[:per_old_pair].sort().values for _ in range(old_pairs)]
            old_cells = torch.cat(picks)[:old] if old else torch.zeros(0, dtype=torch.long)
            old_frames = torch.arange(old_pairs).repeat_interleave(per_old_pair)[:old]
            all_cells = torch.cat([old_cells, torch.arange(cells).repeat(recent_pairs)[:recent]])
            all_frames = torch.cat([old_frames, old_pairs + torch.arange(recent) // cells])
            frame[layer, head, prefix:] = all_frames.int()
            row[layer, head, prefix:] = (all_cells // cols).short()
            col[layer, head, prefix:] = (all_cells % cols).short()
    latest = old_pairs + recent_pairs - 1
    tpos = (frame.clamp(min=0) * 2 + prefix).int()
    k = torch.empty(*shape, head_dim, dtype=dtype)
    v = torch.empty(*shape, head_dim, dtype=dtype)
    for layer in range(layers):  # one layer at a time: no full-size fp32 temporary
        k[layer] = torch.randn(kv_heads, tokens, head_dim, generator=gen)
        scale = torch.rand(kv_heads, tokens, 1, generator=gen) + 0.5
        v[layer] = torch.randn(kv_heads, tokens, head_dim, generator=gen) * scale
    return CacheView(k=k, v=v, kind=kind, sink=torch.zeros(shape, dtype=torch.bool), frame=frame, row=row, col=col,
                     tpos=tpos, grid=(rows, cols), latest_pair=latest, recent_pairs=recent_pairs,
                     tokens_per_pair=cells, inv_freq=rotary_inv_freq(head_dim, 1e6, device="cpu"),
                     temporal_section=head_dim // 8)


def time_select(policy_name: str, view: CacheView, target: int, repeats: int) -> tuple[list[float], torch.Tensor]:
    policy = make_policy(policy_name, target_tokens=target)
    keep = policy.select(view, target)  # warm-up (rotation tables, online CV thresholds)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        keep = policy.select(view, target)
        times.append((time.perf_counter() - started) * 1e3)
    return times, keep


def _check_shape(args: argparse.Namespace) -> None:
    """Positive sizes and repeats, named: 0 or less was a torch error about tensor sizes or 'no median for empty
    data' (``--repeats 0``), and ``--dtypes ''`` wrote the JSON then divided by zero in the plot."""
    for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads), ("--tokens", args.tokens),
                        ("--head-dim", args.head_dim), ("--grid", min(args.grid)), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{flag}: at least 1, got {value}")


def run_compression(args: argparse.Namespace) -> int:
    from edgekv.apps.bench.common import comma_choices, provenance, write_figures
    from edgekv.threads import apply_threads

    apply_threads(args.threads)
    dtypes = comma_choices(args.dtypes, _DTYPES, "--dtypes", "dtype")
    policies = comma_choices(args.policies, POLICIES, "--policies", "policy")
    _check_shape(args)
    target = int(0.75 * args.tokens)
    rows = []
    for dtype_name in dtypes:
        view = synthetic_view(args.layers, args.kv_heads, args.tokens, args.head_dim, tuple(args.grid),
                              _DTYPES[dtype_name])
        for policy in policies:
            times, _ = time_select(policy, view, target, args.repeats)
            row = {"dtype": dtype_name, "policy": policy, "ms_median": statistics.median(times), "ms": times}
            rows.append(row)
            print(f"{policy:12s} {dtype_name:5s} {row['ms_median']:8.1f} ms (median of {args.repeats})", flush=True)
        del view
    shape = [args.layers, args.kv_heads, args.tokens, args.head_dim]
    result = {"bench": "compression", "shape": shape, "grid": list(args.grid), "target": target,
              "threads": torch.get_num_threads(), "rows": rows, **provenance()}
    write_figures(result, args.json, args.plot, plot)
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in result["rows"]))
    dtypes = list(dict.fromkeys(r["dtype"] for r in result["rows"]))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(dtypes)
    for i, dtype in enumerate(dtypes):
        values = [next((r["ms_median"] for r in result["rows"] if r["policy"] == p and r["dtype"] == dtype), 0.0)
                  for p in policies]
        ax.bar([j + i * width for j in range(len(policies))], values, width, label=dtype)
    ax.set_xticks([j + width * (len(dtypes) - 1) / 2 for j in range(len(policies))], policies)
    ax.set_ylabel("select ms (median)")
    ax.set_title(f"compression at {result['shape']}, {result['threads']} thread(s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
