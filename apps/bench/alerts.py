"""``edgekv bench alerts``: how well and at what cost standing questions raise alerts.

``--parts accuracy`` (the shipped toy, seeded ``synthetic:events`` streams): each stream gets one standing
question per (colour, shape) it shows — "Was there a {color} {shape}?", positive from the event's first pair on —
and as many about pairs it never shows (negatives), all evaluated after every frame pair with the daemon's
rule (``AlertEngine``: rising edge, hysteresis, cool-down ``--cooldown-s``). Precision = alerts raised at or after
the first appearance of what they ask about / all alerts; recall = positive questions that raised an alert by the
end of the stream / all positive questions; latency = pairs from the first appearance to the alert. Wilson 95 %
intervals beside each. Per appearance (a colour-shape can come back): an appearance is alerted when its question
raised an alert from its first pair to ``--window-s`` after its last (the pair itself without a window) — what a rule
about now (``--window-s``) is for; over the whole memory a rule stays "yes" after the first sighting.

``--parts cost``: ms of one evaluation (``StreamSession.probe``) over a full cache, against one frame pair's
ingest at the same shape (default: the real Qwen2.5-VL-3B widths from a random checkpoint, ``--model`` and
``--budget`` M tokens): the cache is filled with random vision K/V and metadata (what a probe reads costs the same
whatever the values), then the question is prefilled over it ``--repeats`` times; the share an evaluation after
every pair would take of the loop is evaluation / (evaluation + ingest). Figures only: JSON + PNG.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from edgekv.apps.bench.common import provenance, write_figures
from edgekv.threads import threads_argument


def add_alerts_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="accuracy,cost", help="comma-separated: accuracy, cost")
    parser.add_argument("--streams", type=int, default=12, help="seeded streams (accuracy)")
    parser.add_argument("--seed", type=int, default=100, help="first stream seed (accuracy)")
    parser.add_argument("--pairs", type=int, default=120, help="frame pairs per stream (accuracy)")
    parser.add_argument("--negatives", type=int, default=2, help="questions per stream about what it never shows")
    parser.add_argument("--cooldown-s", type=float, default=60.0, help="alerts.rules[].cooldown_s (stream seconds)")
    parser.add_argument("--window-s", type=float, default=None,
                        help="alerts.rules[].window_s: each question reads only the last so many seconds (accuracy)")
    parser.add_argument("--max-tokens", type=int, default=640, help="cache cap M for the toy (accuracy)")
    parser.add_argument("--model", default=None, help="checkpoint for the cost part (default: a random 3B-shape one)")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="cost part's weights")
    parser.add_argument("--budget", type=int, default=6144, help="cache cap M of the cost part")
    parser.add_argument("--resolution", type=int, default=448, help="frame side of the cost part's ingest")
    parser.add_argument("--repeats", type=int, default=3, help="timed evaluations and ingests (cost)")
    parser.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads")
    parser.add_argument("--json", default="bench-alerts.json")
    parser.add_argument("--plot", default="bench-alerts.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_alerts)


def wilson(hits: int, n: int, z: float = 1.96) -> tuple[float | None, float | None]:
    """Wilson score interval of a proportion."""
    if n == 0:
        return None, None
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


# ---------------------------------------------------------------------------------------------- accuracy
def accuracy(args: argparse.Namespace) -> dict:
    import itertools

    import numpy as np

    import edgekv
    from edgekv.apps.outputs.alerts import AlertBus, AlertEngine, KeyframeRing
    from edgekv.config import AlertRuleSection
    from edgekv.toy.questions import COLORS, SHAPES
    from edgekv.video.sources import open_source

    runtime = edgekv.Runtime.from_pretrained(
        "builtin:toy", model={"dtype": "fp32", "device": "cpu"}, video={"resolution": [112, 112], "fps": 2.0},
        cache={"policy": "infinipot_v", "max_tokens": args.max_tokens, "text_reserve_tokens": 64})
    alerts, positives, negatives_asked, started = [], {}, 0, time.perf_counter()
    appearances: list[tuple[int, str, int, int]] = []  # (seed, question, first pair, last pair an alert counts at)
    for seed in range(args.seed, args.seed + args.streams):
        source = open_source(f"synthetic:events?size=112x112&fps=2&frames={2 * args.pairs}&seed={seed}&rate=0.05&noise=3")
        first: dict[tuple[str, str], int] = {}
        for event in source.scene.events:
            first.setdefault((event.color, event.shape), event.first_pair)
            reach = event.first_pair + event.pairs - 1 + math.ceil(args.window_s or 0.0)  # a pair is 1 s at 2 fps
            appearances.append((seed, f"{event.color} {event.shape}", event.first_pair, reach))
        rng = np.random.default_rng(seed)
        absent = [pair for pair in itertools.product(COLORS, SHAPES) if pair not in first]
        negatives = [absent[i] for i in rng.choice(len(absent), size=min(args.negatives, len(absent)), replace=False)]
        negatives_asked += len(negatives)
        positives.update({(seed, f"{color} {shape}"): pair for (color, shape), pair in first.items()})
        now = [0.0]
        bus = AlertBus()
        raised: list = []
        bus.add(type("Collect", (), {"offer": lambda self, event: raised.append(event)})())
        rules = [AlertRuleSection(question=f"Was there a {color} {shape}?", name=f"{color} {shape}",
                                  cooldown_s=args.cooldown_s, window_s=args.window_s)
                 for color, shape in [*first, *negatives]]
        engine = AlertEngine(rules, bus, KeyframeRing(0), clock=lambda: now[0])
        session = runtime.session()
        for frame, t in source:
            result = session.ingest(frame, t=t)
            if result.pair_index is None:
                continue
            pair, now[0] = result.pair_index, t
            engine.keyframes.add(pair, frame, t)
            for state in engine.due(pair):
                event = engine.evaluate(state, session, pair)
                if event is not None:
                    alerts.append({"seed": seed, "question": state.rule.name, "pair": pair,
                                   "first_pair": positives.get((seed, state.rule.name)),
                                   "evidence_pair": event.evidence_pair, "p_yes": event.p_yes})
        source.close()
        print(f"stream {seed}: {len(first)} shown, {len(negatives)} never shown, "
              f"{sum(1 for a in alerts if a['seed'] == seed)} alerts")
    true = [a for a in alerts if a["first_pair"] is not None and a["pair"] >= a["first_pair"]]
    found: dict = {}
    for a in true:
        found.setdefault((a["seed"], a["question"]), a)
    latency = [a["pair"] - a["first_pair"] for a in found.values()]
    alerted = sum(1 for seed, name, start, reach in appearances
                  if any(a["seed"] == seed and a["question"] == name and start <= a["pair"] <= reach for a in alerts))
    out = {
        "window_s": args.window_s, "cooldown_s": args.cooldown_s,
        "appearances": len(appearances), "appearances_alerted": alerted,
        "appearance_recall": alerted / len(appearances) if appearances else None,
        "appearance_recall_ci95": wilson(alerted, len(appearances)),
        "streams": args.streams, "pairs": args.pairs, "positive_questions": len(positives),
        "negative_questions": negatives_asked, "alerts": len(alerts), "true_alerts": len(true),
        "precision": len(true) / len(alerts) if alerts else None, "precision_ci95": wilson(len(true), len(alerts)),
        "recall": len(found) / len(positives) if positives else None,
        "recall_ci95": wilson(len(found), len(positives)),
        "alerts_per_detected_event": len(true) / len(found) if found else None,
        "latency_pairs": {"median": statistics.median(latency) if latency else None,
                          "max": max(latency) if latency else None, "values": latency},
        "evidence_at_the_event": sum(1 for a in found.values()
                                     if a["evidence_pair"] is not None and abs(a["evidence_pair"] - a["first_pair"]) <= 1),
        "alert_rows": alerts, "wall_s": time.perf_counter() - started,
    }
    print(f"precision {out['precision']} {out['precision_ci95']}, recall {out['recall']} {out['recall_ci95']}, "
          f"median latency {out['latency_pairs']['median']} pairs, {out['alerts']} alerts; appearances alerted "
          f"{alerted} of {len(appearances)} ({out['appearance_recall_ci95']})")
    return out


# ---------------------------------------------------------------------------------------------- cost
def cost(args: argparse.Namespace, scratch: Path) -> dict:
    import numpy as np
    import torch

    import edgekv
    from edgekv.cache.capped import SlotKind

    model = args.model
    if model is None:
        from edgekv.model.tiny import make_tiny_checkpoint

        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
        print("writing a random 3B-shape checkpoint (once)...")
        model = str(make_tiny_checkpoint(scratch / "3b", preset="3b", dtype=dtype))
    side = args.resolution
    runtime = edgekv.Runtime.from_pretrained(model, model={"dtype": args.dtype, "device": "cpu"},
                                             video={"resolution": [side, side], "fps": 2.0},
                                             cache={"policy": "infinipot_v", "max_tokens": args.budget,
                                                    "text_reserve_tokens": 512})
    session = runtime.session()
    rng = np.random.default_rng(0)
    frames = [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(2 * (args.repeats + 1))]
    ingest_ms = []
    for i in range(0, len(frames), 2):
        session.ingest(frames[i], t=i / 2.0)
        result = session.ingest(frames[i + 1], t=(i + 1) / 2.0)
        if i:  # the first pair warms up
            ingest_ms.append(result.ms)
    cache = session.cache
    end = session.video_limit - session.tokens_per_pair  # full, as a steady stream keeps it
    start = cache.length
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for layer in range(cache.num_layers):
            shape = (cache.kv_heads, end - start, cache.head_dim)
            cache.k[layer, :, start:end].copy_(torch.randn(shape, generator=generator))
            cache.v[layer, :, start:end].copy_(torch.randn(shape, generator=generator))
        slots = torch.arange(end - start, dtype=torch.int32)
        per = session.tokens_per_pair
        cache.kind[:, :, start:end] = int(SlotKind.VISION)
        cache.frame[:, :, start:end] = (slots // per + session.counters.frame_pairs).expand(cache.num_layers, cache.kv_heads, -1)
        cache.tpos[:, :, start:end] = (session.next_position + slots // per).expand(cache.num_layers, cache.kv_heads, -1)
        cache.length = end
    probe_ms = []
    for _ in range(args.repeats + 1):
        probe_ms.append(session.probe("Was there a red circle?").ms)
    probe_ms = probe_ms[1:]
    evaluation, pair = statistics.median(probe_ms), statistics.median(ingest_ms)
    out = {"model": model, "dtype": args.dtype, "budget": args.budget, "cache_tokens": cache.length,
           "tokens_per_pair": session.tokens_per_pair, "resolution": side, "threads": torch.get_num_threads(),
           "probe_ms": probe_ms, "probe_ms_median": evaluation, "ingest_ms": ingest_ms, "ingest_ms_median": pair,
           "share_of_loop_every_pair": evaluation / (evaluation + pair)}
    print(f"one evaluation over {cache.length} cached tokens: {evaluation:.0f} ms; one frame pair's ingest: "
          f"{pair:.0f} ms; an evaluation after every pair would take {out['share_of_loop_every_pair']:.0%} of the loop")
    return out


def run_alerts(args: argparse.Namespace) -> int:
    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    result = {"provenance": provenance(), "args": {k: v for k, v in vars(args).items() if k not in ("run", "func")}}
    with tempfile.TemporaryDirectory(prefix="edgekv-bench-alerts-") as scratch:
        if "accuracy" in parts:
            result["accuracy"] = accuracy(args)
        if "cost" in parts:
            result["cost"] = cost(args, Path(scratch))
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    acc = result.get("accuracy")
    if acc and acc["latency_pairs"]["values"]:
        axes[0].hist(acc["latency_pairs"]["values"], bins=range(0, max(acc["latency_pairs"]["values"]) + 2))
        axes[0].set_title(f"alert latency (pairs); precision {acc['precision']:.2f}, recall {acc['recall']:.2f}")
        axes[0].set_xlabel("pairs after the first appearance")
    cost_part = result.get("cost")
    if cost_part:
        axes[1].bar(["evaluation", "pair ingest"], [cost_part["probe_ms_median"], cost_part["ingest_ms_median"]])
        axes[1].set_ylabel("ms")
        axes[1].set_title(f"{cost_part['dtype']}, M = {cost_part['budget']}, {cost_part['tokens_per_pair']} tok/pair")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
