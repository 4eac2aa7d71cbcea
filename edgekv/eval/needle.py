"""``edgekv eval needle``: answer accuracy of the trained toy model per cache policy, cap and event age.

This is the instrument every change to what the cache keeps is judged with (DESIGN invariant 11:
accuracy at equal bytes, not token survival).

A stream of ``L`` frame pairs (``edgekv.video.events``: a still, noisy background) holds a few
**needle events** — each a distinct shape in a distinct colour for one frame pair — placed at chosen
**ages** (pairs before the end of the stream). Questions are asked at several checkpoints along the
stream (by default after 1/4, 1/2, 3/4 and all of it), each about the events seen so far:

* per event: its shape's colour, its colour's shape, ``yes`` for its own colour + shape, its shape's
  count (``one``); the event's age at that checkpoint is the question's age;
* per checkpoint: ``no`` for an absent colour + shape (hard: a seen shape in another colour), ``zero``
  for a shape not seen, and the order of two seen events (age of the older one).

The same questions are then asked of the **ceiling**: a short stream holding exactly the events seen by
that checkpoint, in the same order, a few pairs apart, with the ``full`` policy (nothing evicted).
``ratio = accuracy / ceiling accuracy`` per age bin is the figure the issue's target reads.

The vision tower's output does not depend on the cache, so each stream's frame pairs are encoded once
and replayed to every policy run (``ReplayVision``: same tokens, checked against the pixels they came from).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from edgekv.toy.questions import (CHANCE, COLORS, FAMILIES, QA, SHAPES, answer_of, count_question,
                                  exists_question, negative_exists, order_question, questions_about)
from edgekv.video.events import Event, EventScene, SceneStyle, place_event

DEFAULT_AGES = (2, 8, 32, 128, 512, 1024, 1900)
AGE_BINS = (0, 4, 16, 64, 256, 768, 1536, 4096, 10**9)
CHECKPOINTS = (0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Probe:
    qa: QA
    checkpoint: int          # questions are asked after this many frame pairs
    age: int | None          # pairs since the event the answer depends on (the older one for order); None: none
    seen: tuple[Event, ...]  # the events shown before the checkpoint (the ceiling stream's events)


@dataclass
class NeedleStream:
    scene: EventScene
    pairs: int
    probes: list[Probe]
    seed: int


@dataclass(frozen=True)
class PolicyRun:
    """One cache configuration: a policy, its sink budget (StateKV B) and extra cache keys."""

    policy: str
    sinks: int = 0
    options: tuple[tuple[str, object], ...] = ()  # cache keys, or SECTION.KEY for another config section
    archive: bool = False  # a fresh archive on flash (edgekv/archive) for this run, recall on at every question

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.options)
        return f"{self.policy}{f' B={self.sinks}' if self.sinks else ''}{' +archive' if self.archive else ''}{extra}"


def needle_stream(length: int, ages: tuple[int, ...], seed: int, events: int = 3, fps: float = 2.0,
                  checkpoints: tuple[float, ...] = CHECKPOINTS, noise: float = 3.0) -> NeedleStream:
    """A ``length``-pair stream with ``events`` needle events at ages drawn from ``ages`` (distinct
    shapes and colours), and the probes asked at each checkpoint."""
    rng = np.random.default_rng((seed, 41))
    valid = sorted({a for a in ages if 1 <= a <= length - 1})
    if not valid:
        raise ValueError(f"no event age in {list(ages)} fits a stream of {length} frame pairs")
    chosen = sorted(rng.choice(valid, size=min(events, len(valid)), replace=False).tolist(), reverse=True)
    shapes = rng.permutation(SHAPES)[: len(chosen)]
    colors = rng.permutation(COLORS)[: len(chosen)]
    placed = [place_event(rng, str(shape), str(color), length - age, 1, 112, 112)
              for age, shape, color in zip(chosen, shapes, colors)]
    scene = EventScene(112, 112, fps, seed, placed, SceneStyle(noise=noise), frames=2 * length)
    probes: list[Probe] = []
    for fraction in checkpoints:
        at = max(1, int(round(fraction * length)))
        seen = tuple(e for e in scene.events if e.last_pair < at)
        probes.extend(_probes_at(at, seen, rng))
    return NeedleStream(scene, length, probes, seed)


def _probes_at(at: int, seen: tuple[Event, ...], rng: np.random.Generator) -> list[Probe]:
    probes = []
    for event in seen:
        for qa in questions_about(event, seen):
            probes.append(Probe(qa, at, at - event.first_pair, seen))
    if seen:
        probes.append(Probe(negative_exists(seen, rng), at, None, seen))
    absent = [s for s in SHAPES if s not in {e.shape for e in seen}]
    if absent:
        probes.append(Probe(count_question(seen, str(rng.choice(absent))), at, None, seen))
    if len(seen) >= 2:
        a, b = rng.choice(len(seen), size=2, replace=False)
        first, second = sorted((seen[a], seen[b]), key=lambda e: e.first_pair)
        names = [first.shape, second.shape] if rng.random() < 0.5 else [second.shape, first.shape]
        qa = order_question(seen, *names)
        if qa is not None:
            probes.append(Probe(qa, at, at - first.first_pair, seen))
    return probes


def ceiling_scene(seen: tuple[Event, ...], seed: int, fps: float, gap: int = 3) -> tuple[EventScene, int]:
    """The events of ``seen`` in the same order, ``gap`` background pairs apart, and the stream length."""
    events, pair = [], gap
    for event in seen:
        events.append(Event(event.shape, event.color, pair, event.pairs, event.center, event.radius))
        pair += event.pairs + gap
    length = max(pair, 2)
    return EventScene(112, 112, fps, seed, events, SceneStyle(noise=3.0), frames=2 * length), length


# ---------------------------------------------------------------------------------------------- running
class ReplayVision:
    """A vision backend that hands back precomputed tokens pair by pair (vision is policy-independent)."""

    name = "replay"

    def __init__(self, tokens: list[torch.Tensor], checks: list[float]) -> None:
        self.tokens, self.checks = tokens, checks
        self.index = 0

    def encode(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """The tokens of the next pair whose pixels match: pairs a session skipped (video.skip_static)
        are passed over, never replayed out of order."""
        check = float(pixel_values.double().sum())
        while self.index < len(self.checks) and not math.isclose(check, self.checks[self.index], rel_tol=1e-9,
                                                                  abs_tol=1e-6):
            self.index += 1
        if self.index == len(self.checks):
            raise RuntimeError("ReplayVision: a frame pair matches none of the stream's remaining pairs")
        out = self.tokens[self.index]
        self.index += 1
        return out


def encode_stream(runtime, scene: EventScene, pairs: int) -> ReplayVision:
    """Every frame pair of ``scene`` through the runtime's preprocessor and vision backend, once."""
    preprocessor = runtime.make_preprocessor(scene.frame(0))
    tokens, checks = [], []
    with torch.inference_mode():
        for pair in range(pairs):
            pixels, grid = preprocessor.pair(*scene.pair_frames(pair))
            pixels = pixels.to(runtime.device, runtime.dtype)  # what the session hands the backend
            checks.append(float(pixels.double().sum()))
            tokens.append(runtime.vision_backend.encode(pixels, grid.to(runtime.device)).clone())
    return ReplayVision(tokens, checks)


def run_stream(runtime, scene: EventScene, pairs: int, replay: ReplayVision,
               asks: dict[int, list[QA]], max_new_tokens: int = 2) -> tuple[dict[tuple[int, str], str], dict]:
    """Ingest ``pairs`` frame pairs with ``runtime``'s cache config; after ``at`` pairs ask ``asks[at]``.
    Returns {(checkpoint, question): answer word} and the session's final stats."""
    session = runtime.session()
    replay.index = 0
    session.vision = replay
    answers: dict[tuple[int, str], str] = {}
    for pair in range(pairs):
        first, second = scene.pair_frames(pair)
        session.ingest(first, t=scene.time(2 * pair))
        session.ingest(second, t=scene.time(2 * pair + 1))
        if asks.get(pair + 1) and session.recall is not None:
            session.recall.archive.flush()  # replayed faster than real time: let the writer catch up first
        for qa in asks.get(pair + 1, ()):
            key = (pair + 1, qa.question)
            if key not in answers:
                answers[key] = answer_of(session.ask(qa.question, max_new_tokens=max_new_tokens).text)
    stats = session.stats()
    if session.recall is not None:
        session.recall.close()  # the writer thread stops before its folder goes
    return answers, stats


def runtime_for(model: str, run: PolicyRun, max_tokens: int, fps: float, reserve: int, archive_dir: str | None = None):
    """The runtime of one run; ``archive_dir`` (a fresh, empty folder) when ``run.archive``."""
    from edgekv.runtime import Runtime

    cache = {"policy": run.policy, "max_tokens": max_tokens, "text_reserve_tokens": reserve, "sinks": run.sinks}
    sections: dict[str, dict] = {"cache": cache, "model": {"dtype": "fp32", "device": "cpu"},
                                 "video": {"fps": fps, "resolution": [112, 112]}}
    for key, value in run.options:
        section, dot, name = key.rpartition(".")
        sections.setdefault(section if dot else "cache", {})[name] = value
    if run.archive:
        if archive_dir is None:
            raise ValueError(f"{run.label}: an archive run needs a folder")
        # the stream is replayed far faster than real time: ingest waits for the writer rather than drop
        # pairs, so what recall can find does not depend on the machine's load
        archive = sections.setdefault("archive", {})
        archive.update(dir=archive_dir, recall=True)
        archive.setdefault("when_full", "wait")
    return Runtime.from_pretrained(model, **sections)


@dataclass
class NeedleConfig:
    model: str = "builtin:toy"
    lengths: tuple[int, ...] = (2000,)
    budgets: tuple[int, ...] = (4000,)
    runs: tuple[PolicyRun, ...] = ()
    ages: tuple[int, ...] = DEFAULT_AGES
    streams: int = 4
    events: int = 3
    fps: float = 2.0
    seed: int = 0
    reserve: int = 64
    checkpoints: tuple[float, ...] = CHECKPOINTS


def evaluate(config: NeedleConfig, log: Callable[[str], None] = print) -> dict:
    """Run every (length, stream, budget, policy) and the ceilings; returns the JSON document."""
    from edgekv.runtime import Runtime

    base = Runtime.from_pretrained(config.model, model={"dtype": "fp32", "device": "cpu"},
                                   cache={"policy": "full", "max_tokens": 64, "text_reserve_tokens": 32},
                                   video={"fps": config.fps, "resolution": [112, 112]})
    records: list[dict] = []
    for length in config.lengths:
        for index in range(config.streams):
            seed = config.seed * 1000 + index
            stream = needle_stream(length, config.ages, seed, config.events, config.fps, config.checkpoints)
            ceiling = _ceilings(config, stream)
            started = time.perf_counter()
            replay = encode_stream(base, stream.scene, stream.pairs)
            asks: dict[int, list[QA]] = {}
            for probe in stream.probes:
                asks.setdefault(probe.checkpoint, []).append(probe.qa)
            log(f"length {length} stream {index}: {len(stream.probes)} questions, events "
                f"{[e.describe() for e in stream.scene.events]} (encoded in {time.perf_counter() - started:.1f} s)")
            for budget in config.budgets:
                for run in config.runs:
                    if run.policy == "full" and budget < _tokens_needed(base, length, config.reserve):
                        continue  # full only where the stream fits
                    with tempfile.TemporaryDirectory(prefix="edgekv-needle-archive-") as folder:
                        runtime = runtime_for(config.model, run, budget, config.fps, config.reserve,
                                              folder if run.archive else None)
                        started = time.perf_counter()
                        answers, stats = run_stream(runtime, stream.scene, stream.pairs, replay, asks)
                        seconds = time.perf_counter() - started
                    correct = [answers[(p.checkpoint, p.qa.question)] == p.qa.answer for p in stream.probes]
                    log(f"  M={budget:6d} {run.label:28s} accuracy {np.mean(correct):.3f}  "
                        f"({stats['compressions']} compressions"
                        f"{', %d pairs recalled' % stats['recalled_pairs'] if run.archive else ''}"
                        f"{', %d dropped by the archive' % stats['archive_dropped'] if stats.get('archive_dropped') else ''}"
                        f", {seconds:.1f} s)")
                    for probe, ok in zip(stream.probes, correct):
                        records.append({
                            "length": length, "stream": index, "budget": budget, "bytes": stats["cache_capacity_bytes"],
                            "policy": run.label, "family": probe.qa.family, "question": probe.qa.question,
                            "answer": probe.qa.answer, "predicted": answers[(probe.checkpoint, probe.qa.question)],
                            "correct": bool(ok), "age": probe.age, "checkpoint": probe.checkpoint,
                            "ceiling_correct": ceiling[(probe.checkpoint, probe.qa.question)],
                        })
    return {"config": _config_json(config), "records": records, "summary": summarize(records)}


def _tokens_needed(runtime, pairs: int, reserve: int) -> int:
    return 32 + pairs * 16 + reserve


def _ceilings(config: NeedleConfig, stream: NeedleStream) -> dict[tuple[int, str], bool]:
    """Correctness of each probe on its no-eviction short stream (one short stream per checkpoint)."""
    out: dict[tuple[int, str], bool] = {}
    by_checkpoint: dict[int, list[Probe]] = {}
    for probe in stream.probes:
        by_checkpoint.setdefault(probe.checkpoint, []).append(probe)
    for at, probes in by_checkpoint.items():
        scene, length = ceiling_scene(probes[0].seen, stream.seed, config.fps)
        runtime = runtime_for(config.model, PolicyRun("full"), _tokens_needed(None, length, config.reserve),
                              config.fps, config.reserve)
        replay = encode_stream(runtime, scene, length)
        answers, _ = run_stream(runtime, scene, length, replay, {length: [p.qa for p in probes]})
        for probe in probes:
            out[(at, probe.qa.question)] = answers[(length, probe.qa.question)] == probe.qa.answer
    return out


def age_bin(age: int | None) -> str:
    if age is None:
        return "none"
    for low, high in zip(AGE_BINS, AGE_BINS[1:]):
        if low <= age < high:
            return f"{low}-{high - 1}" if high < 10**9 else f"{low}+"
    return "none"


def summarize(records: list[dict]) -> dict:
    """Accuracy, ceiling and their ratio per (length, budget, policy) x age bin, and per family."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["length"], r["budget"], r["policy"]), []).append(r)
    out = {}
    for (length, budget, policy), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        entry = {"length": length, "budget": budget, "bytes": rows[0]["bytes"], "policy": policy,
                 "accuracy": _mean(rows, "correct"), "ceiling": _mean(rows, "ceiling_correct"), "by_age": {},
                 "by_family": {}}
        for key, name in (("by_age", None), ("by_family", "family")):
            buckets: dict[str, list[dict]] = {}
            for r in rows:
                buckets.setdefault(age_bin(r["age"]) if name is None else r[name], []).append(r)
            for bucket, items in sorted(buckets.items(), key=lambda kv: _bin_order(kv[0])):
                accuracy, ceiling = _mean(items, "correct"), _mean(items, "ceiling_correct")
                entry[key][bucket] = {"n": len(items), "accuracy": accuracy, "ceiling": ceiling,
                                      "ratio": round(accuracy / ceiling, 4) if ceiling else None}
        out[f"L={length} M={budget} {policy}"] = entry
    return out


def _bin_order(name: str) -> float:
    head = name.split("-")[0].rstrip("+")
    return float(head) if head.isdigit() else float("inf") if name == "none" else -1.0


def _mean(rows: list[dict], key: str) -> float:
    return round(float(np.mean([r[key] for r in rows])), 4) if rows else float("nan")


def _config_json(config: NeedleConfig) -> dict:
    data = asdict(config)
    data["runs"] = [run.label for run in config.runs]
    return data


# ---------------------------------------------------------------------------------------------- figures
def plot(result: dict, path: str | Path) -> None:
    """accuracy against event age per policy (one panel per length x budget), and against the budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = result["summary"].values()
    panels = sorted({(e["length"], e["budget"]) for e in summary})
    budgets = sorted({e["budget"] for e in summary})
    fig, axes = plt.subplots(1, len(panels) + (len(budgets) > 1), figsize=(6 * (len(panels) + (len(budgets) > 1)), 4.5),
                             squeeze=False)
    chance = float(np.mean(list(CHANCE.values())))
    for ax, (length, budget) in zip(axes[0], panels):
        ceiling_drawn = False
        for entry in summary:
            if (entry["length"], entry["budget"]) != (length, budget):
                continue
            bins = [b for b in entry["by_age"] if b != "none"]
            xs = range(len(bins))
            ax.plot(xs, [entry["by_age"][b]["accuracy"] for b in bins], marker="o", label=entry["policy"])
            if not ceiling_drawn:
                ax.plot(xs, [entry["by_age"][b]["ceiling"] for b in bins], "k--", label="ceiling (no eviction)")
                ax.set_xticks(list(xs), bins, rotation=30)
                ceiling_drawn = True
        ax.axhline(chance, color="grey", lw=0.8, ls=":", label="chance (mean of families)")
        ax.set_title(f"{length} frame pairs, M = {budget} tokens")
        ax.set_xlabel("event age at the question (frame pairs)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=7)
    if len(budgets) > 1:
        ax = axes[0][-1]
        policies = sorted({e["policy"] for e in summary})
        for policy in policies:
            points = sorted((e["budget"], e["accuracy"]) for e in summary if e["policy"] == policy)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("cache cap M (tokens)")
        ax.set_ylabel("accuracy (all ages)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def save(result: dict, json_path: str | Path | None, png_path: str | Path | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    if png_path:
        Path(png_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, png_path)
