"""``edgekv bench stream``: per-frame ingest time, cache size and process memory over a long stream.

Runs edgekv's session and, side by side in the same process, transformers'
``Qwen2_5_VLForConditionalGeneration`` fed the same frame pairs one at a time with its own growing
cache (``DynamicCache``) and the same M-RoPE positions. Prints the speed ratio and saves JSON + PNG.
By default an evicting policy (``infinipot_v``) under a cap that fills after ~24 frame pairs, so the
figures show the cap at work (the plot draws it). Figures only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from edgekv.apps.bench.common import provenance
from edgekv.threads import threads_argument
from edgekv.video.sources import looped_frames

DEFAULT_PAIRS_BEFORE_CAP = 24  # the default cap holds this many frame pairs (+ prefix + question room)


def add_stream_arguments(stream: argparse.ArgumentParser) -> None:
    from edgekv.config import POLICIES

    stream.add_argument("--model", help="checkpoint dir (default: a fresh tiny random checkpoint)")
    stream.add_argument("--frames", type=int, default=600, help="video frames to ingest (pairs = frames / 2)")
    stream.add_argument("--policy", default="infinipot_v",
                        help=f"comma-separated cache policies to run, from: {', '.join(POLICIES)}")
    stream.add_argument("--source", default="synthetic:shapes", help="video source (file path or synthetic:...)")
    stream.add_argument("--resolution", type=int, nargs=2, default=[224, 224], metavar=("H", "W"),
                        help="video.resolution (multiples of 28)")
    stream.add_argument("--source-size", type=int, nargs=2, default=None, metavar=("H", "W"),
                        help="resize source frames to this size before ingest (keeps memory low for big files)")
    stream.add_argument("--fps", type=float, default=2.0, help="frames per second sampled from the source")
    stream.add_argument("--max-tokens", type=int, default=None,
                        help=f"cache cap M (default: {DEFAULT_PAIRS_BEFORE_CAP} frame pairs + prefix + question room "
                             "for evicting policies, the whole stream for full)")
    stream.add_argument("--sinks", default="0", help="comma-separated StateKV sink budgets (statekv policy)")
    stream.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    stream.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads")
    stream.add_argument("--json", default="bench-stream.json", help="figures (JSON) written here")
    stream.add_argument("--plot", default="bench-stream.png", help="plot (PNG) written here")
    stream.set_defaults(run=run_stream)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


# ---------------------------------------------------------------------------------------------- edgekv
def _run_edgekv(model_dir: Path, frames, args: argparse.Namespace, policy: str, sinks: int) -> dict:
    import edgekv
    from edgekv.cache import CacheFullError

    pairs = args.frames // 2
    rt = edgekv.Runtime.from_pretrained(
        model_dir, model={"dtype": "fp32", "device": "cpu"},
        video={"resolution": list(args.resolution), "fps": args.fps},
        cache=_cache_section(policy, args, pairs, sinks),
    )
    session = rt.session()
    text = rt.model.config.text
    rows = []
    stopped = None
    for frame, t in frames:
        try:
            cpu_started = time.process_time()
            result = session.ingest(frame, t=t)
            cpu_ms = (time.process_time() - cpu_started) * 1e3
        except CacheFullError:
            stopped = f"stopped at frame pair {session.counters.frame_pairs}: the cache is full (policy never evicts)"
            print(f"[{policy}] {stopped}")
            break
        if result.pair_index is None:
            continue
        stats = session.stats()
        visible = _visible_keys(session, sinks)
        rows.append({
            "pair": result.pair_index, "ingest_ms": result.ms, "ingest_cpu_ms": cpu_ms, "vision_ms": result.vision_ms,
            "prefill_ms": result.prefill_ms, "compression_ms": result.compression_ms,
            "cache_tokens": stats["cache_tokens"], "cache_bytes": stats["cache_capacity_bytes"],
            "rss_mb": _rss_mb(), "lm_gflops": lm_prefill_flops(text, result.tokens_added, visible) / 1e9,
        })
    stats = session.stats()
    return {"policy": policy, "sinks": sinks, "rows": rows, "stats": stats, "stopped": stopped,
            "summary": steady_state_summary(rows)}


def _visible_keys(session, sinks: int) -> int:
    """Keys a frame pair's queries saw: prefix + sinks + the pair (StateKV) or the whole cache."""
    if sinks:
        return session.prefix_tokens + min(sinks, session.cache.length) + session.tokens_per_pair
    return session.cache.length


def lm_prefill_flops(text, tokens: int, keys: int) -> float:
    """Analytic FLOPs of one chunk through the language model (2 per multiply-add): projections, MLP,
    and attention scores + weighted sum over ``keys`` visible keys. The vision tower is the same for
    every policy and is left out."""
    d, hd = text.hidden_size, text.head_dim
    q, kv = text.num_attention_heads * hd, text.num_key_value_heads * hd
    projections = 2 * tokens * d * (q + 2 * kv + q)
    mlp = 2 * tokens * 3 * d * text.intermediate_size
    attention = 2 * 2 * tokens * keys * q
    return float(text.num_hidden_layers * (projections + mlp + attention))


def steady_state_summary(rows: list[dict]) -> dict:
    """Issue targets after the first compression: RSS growth, late vs early median ingest, compression share."""
    first = next((i for i, r in enumerate(rows) if r.get("compression_ms", 0) > 0), None)
    total_ms = sum(r["ingest_ms"] for r in rows)
    summary = {"pairs": len(rows), "compressions": sum(1 for r in rows if r.get("compression_ms", 0) > 0),
               "compression_ms_total": sum(r.get("compression_ms", 0.0) for r in rows), "ingest_ms_total": total_ms}
    summary["compression_share"] = summary["compression_ms_total"] / total_ms if total_ms else None
    durations = [r["compression_ms"] for r in rows if r.get("compression_ms", 0) > 0]
    if durations:
        summary["compression_ms_median"] = statistics.median(durations)
        summary["compression_ms_max"] = max(durations)
    if first is not None:
        after = rows[first:]
        after_ms = sum(r["ingest_ms"] for r in after)
        summary["compression_share_after_first_compression"] = (
            sum(r.get("compression_ms", 0.0) for r in after) / after_ms if after_ms else None)
        summary["rss_growth_after_first_compression"] = after[-1]["rss_mb"] / after[0]["rss_mb"] - 1.0
    if first is not None and len(rows) - first >= 400:
        summary["late_over_early_median_ingest"] = (statistics.median(r["ingest_ms"] for r in after[-200:])
                                                    / statistics.median(r["ingest_ms"] for r in after[:200]))
        if all("ingest_cpu_ms" in r for r in after):
            # the same ratio on process CPU time: free of the wall-clock jitter a shared machine adds
            summary["late_over_early_median_ingest_cpu"] = (
                statistics.median(r["ingest_cpu_ms"] for r in after[-200:])
                / statistics.median(r["ingest_cpu_ms"] for r in after[:200]))
    return summary


def _cache_section(policy: str, args: argparse.Namespace, pairs: int, sinks: int) -> dict:
    section = {"policy": policy, "sinks": sinks}
    if args.max_tokens:
        section["max_tokens"] = args.max_tokens
    else:
        section["max_tokens"] = default_cap(policy, tuple(args.resolution), pairs)
    return section


def default_cap(policy: str, resolution: tuple[int, int], pairs: int) -> int:
    """The cap when none is given: ``full`` holds the whole stream (it cannot evict); every other policy
    gets room for ``DEFAULT_PAIRS_BEFORE_CAP`` pairs, so a default run compresses and shows the cap."""
    tokens_per_pair = (resolution[0] // 28) * (resolution[1] // 28)
    held = pairs + 1 if policy == "full" else min(pairs + 1, DEFAULT_PAIRS_BEFORE_CAP)
    return 64 + 512 + held * tokens_per_pair


# ---------------------------------------------------------------------------------------------- transformers
def _run_hf(model_dir: Path, frames, args: argparse.Namespace) -> dict:
    import torch
    from transformers import DynamicCache, Qwen2_5_VLForConditionalGeneration

    from edgekv.model.config import ModelConfig
    from edgekv.model.rope import text_position_ids, vision_block_position_ids
    from edgekv.preprocess import FramePreprocessor
    from edgekv.tokenizer import ChatLayout, QwenTokenizer

    config = ModelConfig.from_dir(model_dir)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = QwenTokenizer.from_dir(model_dir)
    pre = FramePreprocessor(resolution=tuple(args.resolution))
    prefix = tokenizer.encode(ChatLayout().stream_prefix())
    cache = DynamicCache(config=model.config)
    merge = config.vision.spatial_merge_size
    rows = []
    with torch.inference_mode():
        ids = torch.tensor([prefix])
        model(input_ids=ids, position_ids=text_position_ids(0, len(prefix))[:, None], past_key_values=cache,
              use_cache=True)
        t0 = None
        iterator = iter(frames)
        for pair in range(args.frames // 2):
            try:
                (first, t_first), (second, _) = next(iterator), next(iterator)
            except StopIteration:
                break
            t0 = t_first if t0 is None else t0
            started = time.perf_counter()
            pixel_values, grid = pre.pair(first, second)
            gh, gw = int(grid[0, 1]) // merge, int(grid[0, 2]) // merge
            t_pos = int((t_first - t0) * config.vision.tokens_per_second + 1e-9)
            positions = vision_block_position_ids(len(prefix), t_pos, gh, gw)[:, None]
            ids = torch.full((1, gh * gw), config.video_token_id)
            model(input_ids=ids, pixel_values_videos=pixel_values, video_grid_thw=grid, position_ids=positions,
                  past_key_values=cache, use_cache=True, mm_token_type_ids=torch.full_like(ids, 2))
            rows.append({"pair": pair, "ingest_ms": (time.perf_counter() - started) * 1e3, "rss_mb": _rss_mb()})
    return {"policy": "transformers", "rows": rows}


# ---------------------------------------------------------------------------------------------- report
def _median_at(rows: list[dict], pair: int, window: int = 10) -> float | None:
    values = [r["ingest_ms"] for r in rows if abs(r["pair"] - pair) <= window]
    return statistics.median(values) if values else None


def _plot(results: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ingest_ms", "ingest ms / frame pair"), ("cache_tokens", "cache tokens"),
              ("rss_mb", "process RSS (MiB)"), ("compression_ms", "compression ms (when one ran)"),
              ("lm_gflops", "LM GFLOPs / frame pair (analytic)")]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for result in results:
        label = result["policy"] + (f" B={result['sinks']}" if result.get("sinks") else "")
        rows = result["rows"]
        for ax, (key, _) in zip(axes, panels):
            points = [(r["pair"], r[key]) for r in rows if key in r and (key != "compression_ms" or r[key] > 0)]
            if not points:
                continue
            xs, ys = zip(*points)
            if key == "compression_ms":
                ax.scatter(xs, ys, s=6, label=label)
            else:
                ax.plot(xs, ys, label=label, lw=0.8)
    cache_axis = axes[[key for key, _ in panels].index("cache_tokens")]
    for result in results:  # the hard cap M, less the room kept for a question: where video stops
        stats = result.get("stats") or {}
        if stats.get("cache_capacity_tokens"):
            limit = stats["cache_capacity_tokens"] - stats.get("text_reserve_tokens", 0)
            cache_axis.axhline(limit, ls="--", lw=0.8, color="grey")
            cache_axis.annotate(f"{result['policy']}: cap M={stats['cache_capacity_tokens']} less question room",
                                (0.01, limit), fontsize=7, va="bottom", color="grey",
                                xycoords=("axes fraction", "data"))
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("frame pair")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _describe(summary: dict) -> str:
    parts = [f"{summary['compressions']} compressions"]
    if summary.get("compression_share") is not None:
        parts.append(f"compression {100 * summary['compression_share']:.3f} % of ingest time")
    if "compression_ms_median" in summary:
        parts.append(f"median compression {summary['compression_ms_median']:.1f} ms")
    if summary.get("compression_share_after_first_compression") is not None:
        parts.append(f"{100 * summary['compression_share_after_first_compression']:.3f} % from the first compression on")
    if "rss_growth_after_first_compression" in summary:
        parts.append(f"RSS growth after first compression {100 * summary['rss_growth_after_first_compression']:+.2f} %")
    if "late_over_early_median_ingest" in summary:
        parts.append(f"late/early median ingest {summary['late_over_early_median_ingest']:.3f}")
    if "late_over_early_median_ingest_cpu" in summary:
        parts.append(f"(CPU time {summary['late_over_early_median_ingest_cpu']:.3f})")
    return ", ".join(parts)


def run_stream(args: argparse.Namespace) -> int:
    import torch

    from edgekv.video.sources import parse_spec

    parse_spec(args.source)  # a source that cannot be is the user's mistake, not one policy's refusal

    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from edgekv.model.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="edgekv-bench-")) / "tiny", preset="tiny")
    resize = tuple(args.source_size) if args.source_size else None

    def frames():
        return looped_frames(args.source, args.frames, args.fps, resize)

    print(f"stream: {args.frames} frames ({args.frames // 2} pairs) from {args.source} at {args.resolution}")
    results = []
    for policy in args.policy.split(","):
        for sinks in [int(s) for s in args.sinks.split(",")] if policy == "statekv" else [0]:
            try:
                result = _run_edgekv(model_dir, frames(), args, policy, sinks)
            except ValueError as exc:  # a budget this configuration cannot work in: record why
                print(f"[edgekv {policy}{' B=' + str(sinks) if sinks else ''}] refused: {exc}")
                results.append({"policy": policy, "sinks": sinks, "rows": [], "refused": str(exc)})
                continue
            results.append(result)
            rows = result["rows"]
            print(f"[edgekv {policy}{' B=' + str(sinks) if sinks else ''}] {len(rows)} pairs, median ingest "
                  f"{statistics.median(r['ingest_ms'] for r in rows):.1f} ms, compressions {result['stats']['compressions']}, "
                  f"cache {result['stats']['cache_tokens']}/{result['stats']['cache_capacity_tokens']} tokens, "
                  f"{result['stats']['cache_capacity_bytes'] / 2**20:.1f} MiB")
            print(f"    {_describe(result['summary'])}")
    summary = {"frames": args.frames, "resolution": list(args.resolution), "source": args.source,
               "policies": args.policy, "max_tokens": args.max_tokens, "torch_threads": torch.get_num_threads(),
               **provenance()}
    if not args.no_hf:
        hf = _run_hf(model_dir, frames(), args)
        results.append(hf)
        probe = min(300, len(hf["rows"]) - 1)
        ours = next(r for r in results if r["policy"] != "transformers")
        mine, theirs = _median_at(ours["rows"], probe), _median_at(hf["rows"], probe)
        if mine and theirs:
            summary.update({"probe_pair": probe, "edgekv_ms": mine, "transformers_ms": theirs, "ratio": mine / theirs})
            print(f"at frame pair {probe}: edgekv {mine:.1f} ms vs transformers {theirs:.1f} ms per pair "
                  f"-> ratio {mine / theirs:.2f} (edgekv / transformers)")
    Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    _plot(results, Path(args.plot), f"{args.source} @ {args.resolution[0]}x{args.resolution[1]}, {args.frames} frames")
    print(f"wrote {args.json} and {args.plot}")
    return 0
