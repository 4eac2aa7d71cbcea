"""``edgekv bench stream``: per-frame ingest time, cache size and process memory over a long stream.

Runs edgekv's session and, side by side in the same process, transformers'
``Qwen2_5_VLForConditionalGeneration`` fed the same frame pairs one at a time with its own growing
cache (``DynamicCache``) and the same M-RoPE positions. Prints the speed ratio and saves JSON + PNG.
Figures only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import psutil
import torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    stream = sub.add_parser("stream", help="ingest a long stream; edgekv vs transformers, per frame pair")
    stream.add_argument("--model", help="checkpoint dir (default: a fresh tiny random checkpoint)")
    stream.add_argument("--frames", type=int, default=600, help="video frames to ingest (pairs = frames / 2)")
    stream.add_argument("--policy", default="full", help="comma-separated cache policies to run")
    stream.add_argument("--source", default="synthetic:shapes", help="video source (file path or synthetic:...)")
    stream.add_argument("--resolution", type=int, nargs=2, default=[224, 224], metavar=("H", "W"))
    stream.add_argument("--fps", type=float, default=2.0)
    stream.add_argument("--max-tokens", type=int, default=None, help="cache cap M (default: fits the whole stream)")
    stream.add_argument("--sinks", default="0", help="comma-separated StateKV sink budgets (statekv policy)")
    stream.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    stream.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    stream.add_argument("--json", default="bench-stream.json")
    stream.add_argument("--plot", default="bench-stream.png")
    stream.set_defaults(run=run_stream)


def main(args: argparse.Namespace) -> int:
    return args.run(args)


# ---------------------------------------------------------------------------------------------- frames
def _frames(source: str, count: int, fps: float):
    from edgekv.video.sources import iter_frames

    return iter_frames(source, max_frames=count, fps=fps)


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


# ---------------------------------------------------------------------------------------------- edgekv
def _run_edgekv(model_dir: Path, frames: list, args: argparse.Namespace, policy: str, sinks: int) -> dict:
    import edgekv

    pairs = len(frames) // 2
    rt = edgekv.Runtime.from_pretrained(
        model_dir, model={"dtype": "fp32", "device": "cpu"},
        video={"resolution": list(args.resolution), "fps": args.fps},
        cache=_cache_section(policy, args, pairs, sinks),
    )
    session = rt.session()
    rows = []
    for frame, t in frames:
        try:
            result = session.ingest(frame, t=t)
        except edgekv.session.CacheFullError as exc:
            print(f"[{policy}] stopped at frame pair {session.counters.frame_pairs}: {str(exc).split(';')[0]}")
            break
        if result.pair_index is None:
            continue
        stats = session.stats()
        rows.append({
            "pair": result.pair_index, "ingest_ms": result.ms, "vision_ms": result.vision_ms,
            "prefill_ms": result.prefill_ms, "compression_ms": result.compression_ms,
            "cache_tokens": stats["cache_tokens"], "cache_bytes": stats["cache_capacity_bytes"],
            "rss_mb": _rss_mb(),
        })
    stats = session.stats()
    return {"policy": policy, "sinks": sinks, "rows": rows, "stats": stats}


def _cache_section(policy: str, args: argparse.Namespace, pairs: int, sinks: int) -> dict:
    section = {"policy": policy, "sinks": sinks}
    if args.max_tokens:
        section["max_tokens"] = args.max_tokens
    else:
        tokens_per_pair = (args.resolution[0] // 28) * (args.resolution[1] // 28)
        section["max_tokens"] = 64 + 512 + (pairs + 1) * tokens_per_pair
    return section


# ---------------------------------------------------------------------------------------------- transformers
def _run_hf(model_dir: Path, frames: list, args: argparse.Namespace) -> dict:
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
        t0 = frames[0][1]
        for pair in range(len(frames) // 2):
            (first, t_first), (second, _) = frames[2 * pair], frames[2 * pair + 1]
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


def _plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(9, 10), sharex=True)
    for result in results:
        label = result["policy"] + (f" B={result['sinks']}" if result.get("sinks") else "")
        pairs = [r["pair"] for r in result["rows"]]
        axes[0].plot(pairs, [r["ingest_ms"] for r in result["rows"]], label=label, lw=0.8)
        axes[2].plot(pairs, [r["rss_mb"] for r in result["rows"]], label=label, lw=0.8)
        if "cache_tokens" in (result["rows"][0] if result["rows"] else {}):
            axes[1].plot(pairs, [r["cache_tokens"] for r in result["rows"]], label=label, lw=0.8)
    axes[0].set_ylabel("ingest ms / frame pair")
    axes[1].set_ylabel("cache tokens")
    axes[2].set_ylabel("process RSS (MiB)")
    axes[2].set_xlabel("frame pair")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_stream(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:
        model_dir = Path(args.model)
    else:
        from edgekv.model.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="edgekv-bench-")) / "tiny", preset="tiny")
    frames = list(_frames(args.source, args.frames, args.fps))
    print(f"stream: {len(frames)} frames ({len(frames) // 2} pairs) from {args.source} at {args.resolution}")
    results = []
    for policy in args.policy.split(","):
        for sinks in [int(s) for s in args.sinks.split(",")] if policy == "statekv" else [0]:
            result = _run_edgekv(model_dir, frames, args, policy, sinks)
            results.append(result)
            rows = result["rows"]
            print(f"[edgekv {policy}{' B=' + str(sinks) if sinks else ''}] {len(rows)} pairs, median ingest "
                  f"{statistics.median(r['ingest_ms'] for r in rows):.1f} ms, compressions {result['stats']['compressions']}, "
                  f"cache {result['stats']['cache_tokens']}/{result['stats']['cache_capacity_tokens']} tokens, "
                  f"{result['stats']['cache_capacity_bytes'] / 2**20:.1f} MiB")
    summary = {"frames": len(frames), "resolution": list(args.resolution), "source": args.source,
               "torch_threads": torch.get_num_threads()}
    if not args.no_hf:
        hf = _run_hf(model_dir, frames, args)
        results.append(hf)
        probe = min(300, len(hf["rows"]) - 1)
        ours = next(r for r in results if r["policy"] != "transformers")
        mine, theirs = _median_at(ours["rows"], probe), _median_at(hf["rows"], probe)
        if mine and theirs:
            summary.update({"probe_pair": probe, "edgekv_ms": mine, "transformers_ms": theirs, "ratio": mine / theirs})
            print(f"at frame pair {probe}: edgekv {mine:.1f} ms vs transformers {theirs:.1f} ms per pair "
                  f"-> ratio {mine / theirs:.2f} (edgekv / transformers)")
    Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    _plot(results, Path(args.plot))
    print(f"wrote {args.json} and {args.plot}")
    return 0
