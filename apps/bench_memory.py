"""``edgekv bench memory``: more video in the same bytes (issue 14), judged by the toy model's answers.

Three parts, each printed and saved in one JSON document (+ one PNG):

* ``skip``: a mostly static ``synthetic:events`` stream (needle events, one in ``--static-every`` pairs)
  ingested with the real toy vision tower, ``video.skip_static`` off and on: vision + prefill ms summed
  over the stream, and the toy model's accuracy on the events' questions (edgekv/eval/needle.py's probes).
* ``grid``: at one ``cache.max_mib`` (equal ``cache_capacity_bytes``), accuracy (needle-event families:
  colour, shape, exists, count, order) against stream length for each ``cache.kv_dtype`` x policy x skip,
  and the mean per-pair ingest ms. The slots each kv_dtype buys at those bytes are in the JSON.
* ``logits``: at the Qwen2.5-VL-3B widths (hidden 2048, 16 heads, 2 KV heads, head_dim 128, MLP 11008)
  with only ``--logits-layers`` layers (memory; random weights), a stream of random frame-pair tokens is
  prefilled into caches of each kv_dtype and the logits of a question compared with the fp32 cache's.

Streams are few (``--streams``), so accuracies carry a binomial error of several points; the JSON keeps
every answer. J/frame needs a power sensor; on a machine without one it is not reported.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
import torch

from edgekv.eval.needle import encode_stream, needle_stream
from edgekv.toy.questions import answer_of


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="skip", help="comma-separated: skip")
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--streams", type=int, default=2, help="needle streams per setting")
    parser.add_argument("--static-length", type=int, default=200, help="pairs of the static stream (skip part)")
    parser.add_argument("--static-every", type=int, default=50, help="one event per this many pairs (skip part)")
    parser.add_argument("--lengths", default="300,600", help="stream lengths in frame pairs (grid part)")
    parser.add_argument("--max-mib", type=float, default=0.25, help="cache.max_mib of every grid run (equal bytes)")
    parser.add_argument("--kv-dtypes", default="fp16,int8,fp8")
    parser.add_argument("--policies", default="infinipot_v,adaptive_infinipot_v")
    parser.add_argument("--skip", default="off,on", help="video.skip_static settings of the grid: off, on")
    parser.add_argument("--logits-layers", type=int, default=2)
    parser.add_argument("--logits-pairs", type=int, default=16, help="frame pairs of 256 tokens (logits part)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="bench-memory.json")
    parser.add_argument("--plot", default="bench-memory.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_memory)


def _runtime(model: str, cache: dict, skip: bool, fps: float = 2.0):
    from edgekv.runtime import Runtime

    return Runtime.from_pretrained(model, model={"dtype": "fp32", "device": "cpu"},
                                   cache={"text_reserve_tokens": 64, **cache},
                                   video={"fps": fps, "resolution": [112, 112], "skip_static": {"enabled": skip}})


def run_probes(runtime, stream, replay=None) -> dict:
    """Ingest ``stream`` (its own vision tower, or ``replay``'s tokens), answering its probes at their
    checkpoints. Returns per-probe correctness, summed vision / prefill / compression ms and the stats."""
    session = runtime.session()
    if replay is not None:
        replay.index = 0
        session.vision = replay
    asks: dict[int, list] = {}
    for probe in stream.probes:
        asks.setdefault(probe.checkpoint, []).append(probe)
    ms = {"vision": 0.0, "prefill": 0.0, "compression": 0.0, "ingest": 0.0}
    answers: dict[tuple[int, str], str] = {}
    scene = stream.scene
    for pair in range(stream.pairs):
        session.ingest(scene.frame(2 * pair), t=scene.time(2 * pair))
        result = session.ingest(scene.frame(2 * pair + 1), t=scene.time(2 * pair + 1))
        ms["vision"] += result.vision_ms
        ms["prefill"] += result.prefill_ms
        ms["compression"] += result.compression_ms
        ms["ingest"] += result.ms
        for probe in asks.get(pair + 1, ()):
            key = (pair + 1, probe.qa.question)
            if key not in answers:
                answers[key] = answer_of(session.ask(probe.qa.question, max_new_tokens=2).text)
    rows = [{"family": p.qa.family, "age": p.age, "checkpoint": p.checkpoint,
             "correct": answers[(p.checkpoint, p.qa.question)] == p.qa.answer} for p in stream.probes]
    return {"rows": rows, "ms": ms, "stats": session.stats()}


def _accuracy(rows: list[dict]) -> float:
    return float(np.mean([r["correct"] for r in rows])) if rows else float("nan")


# ---------------------------------------------------------------------------------------------- skip
def skip_part(args: argparse.Namespace, log=print) -> dict:
    """Vision + prefill time and accuracy on a static stream, skip off vs on (real toy vision tower)."""
    events = max(1, args.static_length // args.static_every)
    ages = tuple(range(args.static_every // 2, args.static_length, args.static_every))
    cache = {"policy": "infinipot_v", "max_tokens": 32 + 16 * args.static_length + 64 + 16}  # nothing evicted
    out = {"length": args.static_length, "events": events, "runs": []}
    for index in range(args.streams):
        stream = needle_stream(args.static_length, ages, seed=900 + index, events=events)
        for skip in (False, True):
            result = run_probes(_runtime(args.model, cache, skip), stream)
            run = {"stream": index, "skip": skip, "accuracy": _accuracy(result["rows"]),
                   "questions": len(result["rows"]), "vision_ms": result["ms"]["vision"],
                   "prefill_ms": result["ms"]["prefill"], "ingest_ms": result["ms"]["ingest"],
                   "pairs_skipped": result["stats"]["pairs_skipped"], "rows": result["rows"]}
            out["runs"].append(run)
            log(f"skip {'on ' if skip else 'off'} stream {index}: accuracy {run['accuracy']:.3f} "
                f"({run['questions']} questions), vision {run['vision_ms']:.0f} ms + prefill {run['prefill_ms']:.0f} ms, "
                f"{run['pairs_skipped']} of {args.static_length} pairs skipped")
    for skip in (False, True):
        runs = [r for r in out["runs"] if r["skip"] == skip]
        out["off" if not skip else "on"] = {
            "accuracy": _accuracy([row for r in runs for row in r["rows"]]),
            "vision_prefill_ms": sum(r["vision_ms"] + r["prefill_ms"] for r in runs)}
    out["speedup"] = out["off"]["vision_prefill_ms"] / max(out["on"]["vision_prefill_ms"], 1e-9)
    log(f"skip: vision+prefill {out['off']['vision_prefill_ms']:.0f} -> {out['on']['vision_prefill_ms']:.0f} ms "
        f"({out['speedup']:.2f}x), accuracy {out['off']['accuracy']:.3f} -> {out['on']['accuracy']:.3f}")
    return out


# ---------------------------------------------------------------------------------------------- main
def run_memory(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - {"skip"})
    if unknown:
        raise SystemExit(f"--parts: unknown part(s) {unknown} (known: skip)")
    started = time.perf_counter()
    doc: dict = {"args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}, "load_avg": list(os.getloadavg())}
    if "skip" in parts:
        doc["skip"] = skip_part(args)
    doc["seconds"] = time.perf_counter() - started
    doc["load_avg_end"] = list(os.getloadavg())
    Path(args.json).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.json}")
    if args.plot:
        plot(doc, args.plot)
        print(f"wrote {args.plot}")
    return 0


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("skip", "grid", "logits") if name in doc]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, name in zip(axes[0], panels):
        if name == "skip":
            skip = doc["skip"]
            labels = ["skip off", "skip on"]
            times = [skip["off"]["vision_prefill_ms"] / 1e3, skip["on"]["vision_prefill_ms"] / 1e3]
            bars = ax.bar(labels, times, color=["grey", "tab:green"])
            for bar, key in zip(bars, ("off", "on")):
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"acc {skip[key]['accuracy']:.2f}",
                        ha="center", va="bottom")
            ax.set_ylabel("vision + prefill, s (whole stream)")
            ax.set_title(f"static stream: {skip['length']} pairs, {skip['events']} events per stream "
                         f"({skip['speedup']:.1f}x)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
