"""``edgekv bench engines``: the same stream through each backend, side by side.

Per backend (``torch``, ``onnxruntime``, ``tensorrt`` where TensorRT and a GPU exist): per frame pair the
vision-engine ms and the LLM prefill ms (median over the timed pairs, after warm-up pairs), then one
question's time to first token and decode tokens/s. Engines are built first (``edgekv build``, cached in
``--engine-dir``). Figures only: JSON + PNG, nothing asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny random checkpoint)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated: torch,onnxruntime,tensorrt (default: those available here)")
    parser.add_argument("--pairs", type=int, default=20, help="timed frame pairs per backend")
    parser.add_argument("--warmup", type=int, default=3, help="untimed frame pairs first")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--resolution", type=int, nargs=2, default=[224, 224], metavar=("H", "W"))
    parser.add_argument("--max-tokens", type=int, default=2048, help="cache capacity M")
    parser.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                        help="default: fp32 on CPU, fp16 on CUDA")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch / onnxruntime CPU threads")
    parser.add_argument("--engine-dir", default=None, help="engine cache (default: a temporary directory)")
    parser.add_argument("--json", default="bench-engines.json")
    parser.add_argument("--plot", default="bench-engines.png")
    parser.set_defaults(run=run_engines)


def available_backends() -> list[str]:
    names = ["torch"]
    try:
        import onnxruntime  # noqa: F401
        import onnxscript  # noqa: F401

        names.append("onnxruntime")
    except ImportError:
        pass
    try:
        import tensorrt  # noqa: F401

        if torch.cuda.is_available():
            names.append("tensorrt")
    except ImportError:
        pass
    return names


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _frames(count: int):
    from edgekv.video.sources import iter_frames

    return list(iter_frames("synthetic:shapes?size=320x240&fps=4", max_frames=count))


def _bench_backend(config, backend: str, frames, args: argparse.Namespace) -> dict:
    from edgekv.engines.build import build

    import edgekv

    build_s = None
    if backend != "torch":
        started = time.perf_counter()
        build(config, backend, progress=True)
        build_s = time.perf_counter() - started
    runtime = edgekv.Runtime.from_config(config)
    session = runtime.session()
    device = runtime.device
    vision_ms, prefill_ms, pair_ms = [], [], []
    pairs = 0
    for image, t in frames:
        _sync(device)
        started = time.perf_counter()
        result = session.ingest(image, t=t)
        _sync(device)
        if result.pair_index is None:
            continue
        pairs += 1
        if pairs > args.warmup:
            pair_ms.append((time.perf_counter() - started) * 1e3)
            vision_ms.append(result.vision_ms)
            prefill_ms.append(result.prefill_ms)
    session.ask("Warm up.", max_new_tokens=2)
    answer = session.ask("What happened in the video?", max_new_tokens=args.decode_tokens, temperature=0.0)
    return {
        "backend": backend, "device": str(device), "pairs_timed": len(pair_ms), "build_s": build_s,
        "vision_ms_median": statistics.median(vision_ms), "prefill_ms_median": statistics.median(prefill_ms),
        "pair_ms_median": statistics.median(pair_ms), "ttft_ms": answer.ttft_s * 1e3,
        "decode_tok_s": answer.decode_tok_s, "answer_tokens": len(answer.token_ids),
        "cache_tokens": session.stats()["cache_tokens"], "vision_ms": vision_ms, "prefill_ms": prefill_ms,
    }


def _plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["backend"] for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    for ax, key, label in ((axes[0], "vision_ms_median", "vision ms / frame pair"),
                           (axes[1], "prefill_ms_median", "LLM prefill ms / frame pair"),
                           (axes[2], "decode_tok_s", "decode tokens / s")):
        values = [r[key] for r in results]
        bars = ax.bar(names, values, color=["#4c72b0", "#dd8452", "#55a868"][: len(names)])
        ax.bar_label(bars, fmt="%.1f")
        ax.set_title(label)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_engines(args: argparse.Namespace) -> int:
    from edgekv.config import EdgeKVConfig
    from edgekv.model.tiny import make_tiny_checkpoint
    from edgekv.runtime import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    backends = args.backends.split(",") if args.backends else available_backends()
    device = resolve_device(args.device)
    dtype = args.dtype or ("fp16" if device.type == "cuda" else "fp32")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else make_tiny_checkpoint(Path(tmp) / "tiny")
        engine_dir = args.engine_dir or str(Path(tmp) / "engines")
        frames = _frames(2 * (args.pairs + args.warmup))
        base = EdgeKVConfig().with_overrides(
            model={"path": str(model_dir), "dtype": dtype, "device": str(device)},
            video={"resolution": list(args.resolution), "fps": 2.0},
            cache={"policy": "sliding_window", "max_tokens": args.max_tokens},
            engines={"engine_dir": engine_dir,
                     "onnx_providers": ["CUDAExecutionProvider"] if device.type == "cuda" else ["CPUExecutionProvider"]},
        )
        results = []
        for backend in backends:
            config = base.with_overrides(engines={"vision": backend, "llm": backend})
            results.append(_bench_backend(config, backend, frames, args))
    machine = f"{platform.machine()} {platform.processor() or ''}".strip()
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else None
    title = (f"edgekv bench engines — {model_dir.name}, {args.resolution[0]}x{args.resolution[1]}, M={args.max_tokens}, "
             f"{dtype}, {gpu or machine}, {torch.get_num_threads()} threads")
    print(title)
    print(f"{'backend':12s} {'vision ms':>10s} {'prefill ms':>11s} {'pair ms':>9s} {'ttft ms':>9s} {'decode tok/s':>13s}")
    for r in results:
        print(f"{r['backend']:12s} {r['vision_ms_median']:10.2f} {r['prefill_ms_median']:11.2f} {r['pair_ms_median']:9.2f} "
              f"{r['ttft_ms']:9.1f} {r['decode_tok_s']:13.1f}")
    out = {"title": title, "device": gpu or machine, "dtype": dtype, "threads": torch.get_num_threads(),
           "torch": torch.__version__, "resolution": list(args.resolution), "max_tokens": args.max_tokens,
           "model": str(model_dir), "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    _plot(results, Path(args.plot), title)
    print(f"wrote {args.json} and {args.plot}")
    return 0
