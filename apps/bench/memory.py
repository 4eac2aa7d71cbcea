"""``edgekv bench memory``: more video in the same bytes (issue 14), judged by the toy model's answers.

Four parts, each printed and saved in one JSON document (+ one PNG):

* ``skip``: a mostly static ``synthetic:events`` stream (needle events, one in ``--static-every`` pairs)
  ingested with the real toy vision tower, ``video.skip_static`` off and on: vision + prefill ms summed
  over the stream, and the toy model's accuracy on the events' questions (edgekv/eval/needle.py's probes).
* ``grid``: at one ``cache.max_mib`` (equal ``cache_capacity_bytes``), accuracy (needle-event families:
  colour, shape, exists, count, order) against stream length for each ``cache.kv_dtype`` x policy x skip,
  and the mean per-pair ingest ms. The slots each kv_dtype buys at those bytes are in the JSON.
* ``bursty``: ``infinipot_v`` against ``adaptive_infinipot_v`` at the same bytes on needle streams whose
  events fall in two bursts of 6 pairs (the longest ``--lengths``), first ``--kv-dtypes`` entry.
* ``logits``: at the Qwen2.5-VL-3B widths (hidden 2048, 16 heads, 2 KV heads, head_dim 128, MLP 11008)
  with only ``--logits-layers`` layers (memory; random weights), a stream of random frame-pair tokens is
  prefilled into caches of each kv_dtype and the logits of a question compared with the fp32 cache's.

Streams are few (``--streams``), so accuracies carry a binomial error of several points; the JSON keeps
every answer. J/frame needs a power sensor; on a machine without one it is not reported.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from edgekv.eval.needle import encode_stream, needle_stream
from edgekv.toy.questions import answer_of


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default="skip,grid,bursty,logits", help="comma-separated: skip, grid, bursty, logits")
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


# ---------------------------------------------------------------------------------------------- grid
def grid_part(args: argparse.Namespace, log=print) -> dict:
    """Accuracy vs stream length at one max_mib for every kv_dtype x policy x skip (replayed vision)."""
    from edgekv.runtime import Runtime

    lengths = [int(x) for x in args.lengths.split(",")]
    kv_dtypes = [x.strip() for x in args.kv_dtypes.split(",")]
    policies = [x.strip() for x in args.policies.split(",")]
    skips = [{"off": False, "on": True}[x.strip()] for x in args.skip.split(",")]
    base = _runtime(args.model, {"policy": "full", "max_tokens": 64, "text_reserve_tokens": 32}, False)
    out: dict = {"max_mib": args.max_mib, "capacity": {}, "runs": []}
    for kv_dtype in kv_dtypes:
        probe = _runtime(args.model, {"policy": "infinipot_v", "max_tokens": None, "max_mib": args.max_mib,
                                      "kv_dtype": kv_dtype}, False)
        spec = probe.cache_spec()
        tokens = probe.cache_capacity_tokens(spec)
        out["capacity"][kv_dtype] = {"tokens": tokens, "bytes": spec.bytes_for(tokens),
                                     "pairs": (tokens - 64 - 32) // 16}
        log(f"{kv_dtype}: {tokens} slots in {spec.bytes_for(tokens)} bytes (max_mib {args.max_mib})")
    fp16_pairs = out["capacity"].get("fp16", next(iter(out["capacity"].values())))["pairs"]
    for length in lengths:
        for index in range(args.streams):
            stream = needle_stream(length, tuple(a for a in (2, 8, 32, 64, 128, 256, 512, 1024) if a < length),
                                   seed=700 + index, events=4)
            replay = encode_stream(base, stream.scene, stream.pairs)
            for kv_dtype in kv_dtypes:
                for policy in policies:
                    for skip in skips:
                        runtime = _runtime(args.model, {"policy": policy, "max_tokens": None, "max_mib": args.max_mib,
                                                        "kv_dtype": kv_dtype}, skip)
                        result = run_probes(runtime, stream, replay)
                        stats = result["stats"]
                        run = {"length": length, "stream": index, "kv_dtype": kv_dtype, "policy": policy, "skip": skip,
                               "accuracy": _accuracy(result["rows"]), "bytes": stats["cache_capacity_bytes"],
                               "slots": stats["cache_capacity_tokens"], "pairs_ingested": stats["frame_pairs"],
                               "ingest_ms_per_pair": result["ms"]["ingest"] / length, "rows": result["rows"]}
                        out["runs"].append(run)
                        log(f"L={length} stream {index} {kv_dtype:4s} {policy:22s} skip {'on ' if skip else 'off'}: "
                            f"accuracy {run['accuracy']:.3f}, {run['ingest_ms_per_pair']:.1f} ms/pair, "
                            f"{stats['compressions']} compressions")
    out["summary"] = _grid_summary(out["runs"], fp16_pairs)
    out["fp16_pairs_that_fit"] = fp16_pairs
    for row in out["summary"]:
        log(f"L={row['length']} {row['kv_dtype']:4s} {row['policy']:22s} skip {'on ' if row['skip'] else 'off'}: "
            f"accuracy {row['accuracy']:.3f} (events older than fp16 holds: {row['old_accuracy']:.3f}, "
            f"recent: {row['recent_accuracy']:.3f}), {row['ingest_ms_per_pair']:.1f} ms/pair")
    return out


def _grid_summary(runs: list[dict], fp16_pairs: int) -> list[dict]:
    """Per (length, kv_dtype, policy, skip): accuracy overall, on events older than the fp16 cache holds
    (age > fp16_pairs), and on the rest (recent events and the event-free questions)."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["length"], run["kv_dtype"], run["policy"], run["skip"]), []).append(run)
    summary = []
    for (length, kv_dtype, policy, skip), members in groups.items():
        rows = [row for run in members for row in run["rows"]]
        old = [r for r in rows if r["age"] is not None and r["age"] > fp16_pairs]
        recent = [r for r in rows if r not in old]
        summary.append({"length": length, "kv_dtype": kv_dtype, "policy": policy, "skip": skip,
                        "accuracy": _accuracy(rows), "questions": len(rows), "old_accuracy": _accuracy(old),
                        "old_questions": len(old), "recent_accuracy": _accuracy(recent),
                        "ingest_ms_per_pair": float(np.mean([m["ingest_ms_per_pair"] for m in members]))})
    return summary


# ---------------------------------------------------------------------------------------------- bursty
def bursty_part(args: argparse.Namespace, log=print) -> dict:
    """Fixed vs time-adaptive budget where the events come in bursts: the needle events of each stream
    fall in two windows of 6 pairs (at 1/4 and 3/4 of the stream), the rest is the still background."""
    length = int(args.lengths.split(",")[-1])
    bursts = tuple(start + offset for start in (length // 4, 3 * length // 4) for offset in range(6))
    base = _runtime(args.model, {"policy": "full", "max_tokens": 64, "text_reserve_tokens": 32}, False)
    kv_dtype = args.kv_dtypes.split(",")[0].strip()
    out: dict = {"length": length, "ages": list(bursts), "kv_dtype": kv_dtype, "max_mib": args.max_mib, "runs": []}
    for index in range(args.streams):
        stream = needle_stream(length, bursts, seed=500 + index, events=4)
        replay = encode_stream(base, stream.scene, stream.pairs)
        for policy in ("infinipot_v", "adaptive_infinipot_v"):
            runtime = _runtime(args.model, {"policy": policy, "max_tokens": None, "max_mib": args.max_mib,
                                            "kv_dtype": kv_dtype}, False)
            result = run_probes(runtime, stream, replay)
            run = {"stream": index, "policy": policy, "accuracy": _accuracy(result["rows"]), "rows": result["rows"],
                   "compressions": result["stats"]["compressions"]}
            out["runs"].append(run)
            log(f"bursty L={length} stream {index} {policy:22s}: accuracy {run['accuracy']:.3f} "
                f"({len(run['rows'])} questions, {run['compressions']} compressions)")
    for policy in ("infinipot_v", "adaptive_infinipot_v"):
        rows = [row for run in out["runs"] if run["policy"] == policy for row in run["rows"]]
        events = [r for r in rows if r["age"] is not None]
        out[policy] = {"accuracy": _accuracy(rows), "event_accuracy": _accuracy(events), "questions": len(rows)}
    out["gap"] = out["adaptive_infinipot_v"]["accuracy"] - out["infinipot_v"]["accuracy"]
    log(f"bursty: infinipot_v {out['infinipot_v']['accuracy']:.3f} vs adaptive "
        f"{out['adaptive_infinipot_v']['accuracy']:.3f} (event questions {out['infinipot_v']['event_accuracy']:.3f} vs "
        f"{out['adaptive_infinipot_v']['event_accuracy']:.3f}), gap {out['gap']:+.3f}")
    return out


# ---------------------------------------------------------------------------------------------- logits
def logits_part(args: argparse.Namespace, log=print) -> dict:
    """Logits error of each kv_dtype against an fp32 cache at the 3B widths with few layers (random weights)."""
    from edgekv.attention import CacheAttention
    from edgekv.cache import CacheSpec, CappedKVCache, ChunkMeta, SlotKind
    from edgekv.model.config import TextConfig
    from edgekv.model.language import Qwen2LM
    from edgekv.model.rope import text_position_ids, vision_block_position_ids

    config = TextConfig(vocab_size=151936, hidden_size=2048, intermediate_size=11008,
                        num_hidden_layers=args.logits_layers, num_attention_heads=16, num_key_value_heads=2,
                        head_dim=128, mrope_section=(16, 24, 24), max_position_embeddings=128000,
                        tie_word_embeddings=True, rms_norm_eps=1e-6)
    torch.manual_seed(0)
    model = Qwen2LM(config).eval()
    with torch.no_grad():
        model.embed_tokens.weight.normal_(0.0, 0.02)
    generator = torch.Generator().manual_seed(1)
    pairs = [torch.randn(256, 2048, generator=generator) for _ in range(args.logits_pairs)]
    question = torch.randn(24, 2048, generator=generator)
    capacity = 16 + 256 * args.logits_pairs + 32
    rope = (model.inv_freq, config.mrope_section[0])
    results: dict[str, dict] = {}
    reference = None
    for name in ["fp32", "fp16", "bf16", *[d for d in args.kv_dtypes.split(",") if d in ("int8", "fp8")]]:
        from edgekv.cache.specs import KV_DTYPES

        spec = CacheSpec.uniform(config.num_hidden_layers, 2, 128, KV_DTYPES[name])
        cache = CappedKVCache(spec, capacity, compute_dtype=torch.float32, rope=rope)
        prefill_ms = []
        with torch.inference_mode():
            for index, tokens in enumerate([torch.randn(16, 2048, generator=torch.Generator().manual_seed(2))] + pairs):
                if index == 0:
                    positions = text_position_ids(0, 16)
                    meta = ChunkMeta(SlotKind.PREFIX, tpos=positions[0])
                else:
                    positions = vision_block_position_ids(16, 2 * (index - 1), 16, 16)
                    rows = torch.arange(256)
                    meta = ChunkMeta(SlotKind.VISION, frame=index - 1, rows=rows // 16, cols=rows % 16,
                                     tpos=positions[0])
                started = time.perf_counter()
                cache.write_meta(cache.length, tokens.shape[0], meta)
                model(tokens, positions, CacheAttention(cache, cache.length, tokens.shape[0]))
                cache.commit(tokens.shape[0])
                if index:
                    prefill_ms.append((time.perf_counter() - started) * 1e3)
            start = int(positions.max()) + 1
            positions = text_position_ids(start, question.shape[0])
            cache.write_meta(cache.length, question.shape[0], ChunkMeta(SlotKind.TEXT, tpos=positions[0]))
            hidden = model(question, positions, CacheAttention(cache, cache.length, question.shape[0]))
            cache.commit(question.shape[0])
            logits = model.logits(hidden[-4:]).float()
            one = text_position_ids(start + question.shape[0], 1)
            cache.write_meta(cache.length, 1, ChunkMeta(SlotKind.TEXT, tpos=one[0]))
            started = time.perf_counter()
            model(question[:1], one, CacheAttention(cache, cache.length, 1))
            decode_ms = (time.perf_counter() - started) * 1e3
        if reference is None:
            reference = logits
        err = (logits - reference).abs()
        results[name] = {"bytes_per_token": spec.bytes_per_token, "slots_per_mib": spec.tokens_for_mib(1.0),
                         "logits_max_abs_err": float(err.max()),
                         "logits_rel_err": float((logits - reference).norm() / reference.norm()),
                         "top1_agree": float((logits.argmax(-1) == reference.argmax(-1)).float().mean()),
                         "logit_range": float(reference.abs().max()),
                         "prefill_ms_per_pair": float(np.median(prefill_ms)), "decode_ms_per_token": decode_ms}
        log(f"3B widths x {config.num_hidden_layers} layers, kv {name:4s}: logits max |err| "
            f"{results[name]['logits_max_abs_err']:.2e} (rel {results[name]['logits_rel_err']:.2e}, "
            f"|logit| max {results[name]['logit_range']:.2f}), top-1 agree {results[name]['top1_agree']:.2f}, "
            f"prefill {results[name]['prefill_ms_per_pair']:.0f} ms/pair, decode {decode_ms:.0f} ms/token, "
            f"{results[name]['slots_per_mib']} slots/MiB at {config.num_hidden_layers} layers, at 36 layers "
            f"{CacheSpec.uniform(36, 2, 128, KV_DTYPES[name]).tokens_for_mib(1024.0)} per GiB")
    return {"layers": config.num_hidden_layers, "pairs": args.logits_pairs, "tokens_per_pair": 256,
            "model": "random weights, Qwen2.5-VL-3B text widths, fp32 weights", "kv": results}


# ---------------------------------------------------------------------------------------------- main
def run_memory(args: argparse.Namespace) -> int:
    from edgekv.apps.bench.common import write_figures

    torch.set_num_threads(args.threads)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - {"skip", "grid", "bursty", "logits"})
    if unknown:
        raise ValueError(f"--parts: unknown part(s) {unknown} (known: skip, grid, bursty, logits)")
    started = time.perf_counter()
    doc: dict = {"args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}, "load_avg": list(os.getloadavg())}
    if "skip" in parts:
        doc["skip"] = skip_part(args)
    if "grid" in parts:
        doc["grid"] = grid_part(args)
    if "bursty" in parts:
        doc["bursty"] = bursty_part(args)
    if "logits" in parts:
        doc["logits"] = logits_part(args)
    doc["seconds"] = time.perf_counter() - started
    doc["load_avg_end"] = list(os.getloadavg())
    write_figures(doc, args.json, args.plot, plot, indent=1)
    return 0


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [name for name in ("skip", "grid", "bursty", "logits") if name in doc]
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
        elif name == "grid":
            grid = doc["grid"]
            styles = {"infinipot_v": "-", "adaptive_infinipot_v": "--"}
            colors = {"fp16": "tab:blue", "bf16": "tab:cyan", "fp32": "black", "int8": "tab:red", "fp8": "tab:orange"}
            keys = sorted({(r["kv_dtype"], r["policy"], r["skip"]) for r in grid["summary"]})
            for kv_dtype, policy, skip in keys:
                points = sorted((r["length"], r["old_accuracy"]) for r in grid["summary"]
                                if (r["kv_dtype"], r["policy"], r["skip"]) == (kv_dtype, policy, skip))
                ax.plot([p[0] for p in points], [p[1] for p in points], styles.get(policy, ":"),
                        color=colors.get(kv_dtype, "grey"), marker="o" if skip else "x",
                        label=f"{kv_dtype} {policy.replace('_infinipot_v', '')} skip {'on' if skip else 'off'}")
            ax.set_xlabel("stream length, frame pairs")
            ax.set_ylabel(f"accuracy, events older than {grid['fp16_pairs_that_fit']} pairs")
            ax.set_title(f"equal bytes: cache.max_mib = {grid['max_mib']}")
            ax.legend(fontsize=6)
        elif name == "bursty":
            bursty = doc["bursty"]
            names = ["infinipot_v", "adaptive_infinipot_v"]
            ax.bar(["fixed", "adaptive"], [bursty[n]["accuracy"] for n in names], color=["tab:blue", "tab:green"])
            ax.set_ylim(0, 1)
            ax.set_ylabel("accuracy")
            ax.set_title(f"bursty streams: {bursty['length']} pairs, {bursty['kv_dtype']}, max_mib {bursty['max_mib']}")
        elif name == "logits":
            kv = doc["logits"]["kv"]
            names = [n for n in kv if n != "fp32"]
            ax.bar(names, [max(kv[n]["logits_rel_err"], 1e-9) for n in names], color="tab:purple")
            ax.set_yscale("log")
            ax.set_ylabel("relative logits error vs fp32 cache")
            ax.set_title(f"3B widths, {doc['logits']['layers']} layers, random weights")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
