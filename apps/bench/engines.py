"""``edgekv bench engines``: the same stream through each backend, side by side, repeated.

Per backend (``torch``, ``onnxruntime``, ``tensorrt`` where TensorRT and a GPU exist): per frame pair the
vision-engine ms and the LLM prefill ms (after warm-up pairs), then one question's time to first token
and decode tokens/s. The whole measurement runs ``--repeats`` times on fresh sessions; each figure is
reported as the median over repeats with its min-max range (and the per-pair interquartile range), so a
reader sees the spread a shared or thermally throttled machine adds. Engines are built first
(``edgekv build``, cached in ``--engine-dir``). Figures only: JSON + PNG, nothing asserted.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

from edgekv.apps.bench.common import sync_device as _sync
from edgekv.threads import threads_argument

FIGURES = ("vision_ms", "prefill_ms", "pair_ms", "ttft_ms", "decode_tok_s")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny random checkpoint)")
    parser.add_argument("--backends", default=None,
                        help="comma-separated: torch,onnxruntime,tensorrt (default: those available here)")
    parser.add_argument("--pairs", type=int, default=20, help="timed frame pairs per repeat")
    parser.add_argument("--warmup", type=int, default=3, help="untimed frame pairs first, in every repeat")
    parser.add_argument("--repeats", type=_at_least_one, default=5, help="whole measurements per backend (for the spread)")
    parser.add_argument("--decode-tokens", type=int, default=32, help="answer tokens timed for decode tok/s")
    parser.add_argument("--resolution", type=int, nargs=2, default=[224, 224], metavar=("H", "W"),
                        help="video.resolution (multiples of 28)")
    parser.add_argument("--max-tokens", type=int, default=2048, help="cache capacity M")
    parser.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"],
                        help="default: fp32 on CPU, fp16 on CUDA")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--threads", type=threads_argument, default=None, help="torch / onnxruntime CPU threads")
    parser.add_argument("--engine-dir", default=None, help="engine cache (default: a temporary directory)")
    parser.add_argument("--json", default="bench-engines.json", help="figures (JSON) written here")
    parser.add_argument("--plot", default="bench-engines.png", help="plot (PNG) written here ('' to skip)")
    parser.set_defaults(run=run_engines)


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def spread(values: list[float]) -> dict:
    """Median, min, max and interquartile range of ``values`` (IQR 0 for fewer than two)."""
    ordered = sorted(values)
    quartiles = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else [ordered[0]] * 3
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1],
            "q1": quartiles[0], "q3": quartiles[2], "n": len(ordered)}


def available_backends() -> list[str]:
    import torch

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
    repeats = [_measure(runtime, frames, args) for _ in range(args.repeats)]
    result = {"backend": backend, "device": str(runtime.device), "build_s": build_s, "repeats": repeats,
              "pairs_timed": sum(len(r["vision_ms"]) for r in repeats)}
    for name in FIGURES:  # the spread over repeats of each repeat's figure
        per_repeat = [r[name] if not isinstance(r[name], list) else statistics.median(r[name]) for r in repeats]
        result[name] = spread(per_repeat)
    for name in ("vision_ms", "prefill_ms", "pair_ms"):  # and over every timed pair of every repeat
        result[f"{name}_per_pair"] = spread([v for r in repeats for v in r[name]])
    # the flat names earlier readers of this JSON used
    result.update({"vision_ms_median": result["vision_ms"]["median"], "prefill_ms_median": result["prefill_ms"]["median"],
                   "pair_ms_median": result["pair_ms"]["median"], "ttft_ms_median": result["ttft_ms"]["median"],
                   "decode_tok_s_median": result["decode_tok_s"]["median"]})
    return result


def _measure(runtime, frames, args: argparse.Namespace) -> dict:
    """One repeat on a fresh session: per-pair ms after warm-up, then one timed answer."""
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
    return {"vision_ms": vision_ms, "prefill_ms": prefill_ms, "pair_ms": pair_ms, "ttft_ms": answer.ttft_s * 1e3,
            "decode_tok_s": answer.decode_tok_s, "answer_tokens": len(answer.token_ids),
            "cache_tokens": session.stats()["cache_tokens"]}


def _plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["backend"] for r in results]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    panels = (("vision_ms", "vision ms / frame pair"), ("prefill_ms", "LLM prefill ms / frame pair"),
              ("ttft_ms", "time to first token, ms"), ("decode_tok_s", "decode tokens / s"))
    for ax, (key, label) in zip(axes, panels):
        medians = [r[key]["median"] for r in results]
        errors = [[r[key]["median"] - r[key]["min"] for r in results], [r[key]["max"] - r[key]["median"] for r in results]]
        bars = ax.bar(names, medians, yerr=errors, capsize=4, color=["#4c72b0", "#dd8452", "#55a868"][: len(names)])
        ax.bar_label(bars, fmt="%.1f", label_type="center", color="white")
        ax.set_title(label, fontsize=9)
    fig.suptitle(title + " — bars: median of repeats, whiskers: min-max", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_engines(args: argparse.Namespace) -> int:
    import torch

    from edgekv.config import EdgeKVConfig
    from edgekv.model.tiny import make_tiny_checkpoint
    from edgekv.runtime import resolve_device

    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)
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
    print(f"median of {args.repeats} repeats [min-max]")
    print(f"{'backend':12s} {'vision ms':>20s} {'prefill ms':>20s} {'ttft ms':>20s} {'decode tok/s':>20s}")
    for r in results:
        cells = [f"{r[k]['median']:.2f} [{r[k]['min']:.2f}-{r[k]['max']:.2f}]".rjust(20)
                 for k in ("vision_ms", "prefill_ms", "ttft_ms", "decode_tok_s")]
        print(f"{r['backend']:12s} {' '.join(cells)}")
    from edgekv.apps.bench.common import provenance

    out = {"title": title, "device": gpu or machine, "dtype": dtype, "threads": torch.get_num_threads(),
           "repeats": args.repeats, "pairs": args.pairs, "warmup": args.warmup,
           "resolution": list(args.resolution), "max_tokens": args.max_tokens,
           "model": str(model_dir), **provenance(), "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    if args.plot:
        _plot(results, Path(args.plot), title)
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    return 0
