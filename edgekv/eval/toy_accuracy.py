"""``edgekv eval toy``: the toy model's accuracy per question family on a fixed held-out set, through the
live session (``full`` cache: the no-eviction figure the model card states and a test re-checks).

The held-out streams are ordinary synthetic event streams (``edgekv.video.events``) ingested frame by
frame at 2 fps — consecutive pairs, positions from the video start, nothing evicted — of the lengths the
toy was trained on (8 to 48 frame pairs), with 1 to 5 events of one or two pairs each, random scene
styles (noise, drift, lighting, distractors), and one question of each family per stream (when that
family has a valid question). Seeded: the same set on every machine.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import numpy as np

from edgekv.threads import threads_argument
from edgekv.toy.questions import CHANCE, FAMILIES, QA, answer_of, sample_question
from edgekv.video.events import EventPlan, EventScene, SceneStyle, random_events

HELDOUT_SEED = 20261123


@dataclass(frozen=True)
class HeldoutStream:
    scene: EventScene
    pairs: int
    questions: tuple[QA, ...]


def heldout_streams(count: int, seed: int = HELDOUT_SEED, lengths: tuple[int, int] = (8, 48)) -> list[HeldoutStream]:
    rng = np.random.default_rng(seed)
    streams = []
    for index in range(count):
        pairs = int(rng.integers(lengths[0], lengths[1] + 1))
        wanted = int(rng.integers(1, 6))
        plan = EventPlan(rate=min(0.9, wanted / pairs * 1.6), duration=(1, 2), max_per_shape=3)
        events = random_events(rng, pairs, plan)[:wanted]
        style = SceneStyle(noise=float(rng.uniform(1, 6)), drift=float(rng.uniform(0, 0.4)) if rng.random() < 0.3 else 0.0,
                           light=float(rng.uniform(0, 0.2)) if rng.random() < 0.3 else 0.0,
                           distractors=int(rng.choice([0, 0, 0, 1, 2])))
        scene = EventScene(112, 112, 2.0, seed * 7919 + index, events, style, frames=2 * pairs)
        questions = tuple(q for family in FAMILIES if (q := sample_question(events, family, rng)) is not None)
        streams.append(HeldoutStream(scene, pairs, questions))
    return streams


def evaluate(model: str, count: int = 200, seed: int = HELDOUT_SEED, log=None) -> dict:
    """Per-family accuracy of ``model`` on the first ``count`` held-out streams (full cache, fp32, CPU)."""
    from edgekv.runtime import Runtime

    streams = heldout_streams(count, seed)
    longest = max(s.pairs for s in streams)
    runtime = Runtime.from_pretrained(model, model={"dtype": "fp32", "device": "cpu"},
                                      cache={"policy": "full", "max_tokens": 64 + 16 * longest + 64,
                                             "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [112, 112]})
    results: dict[str, list[bool]] = {family: [] for family in FAMILIES}
    started = time.perf_counter()
    for index, stream in enumerate(streams):
        session = runtime.session()
        for frame in range(2 * stream.pairs):
            session.ingest(stream.scene.frame(frame), t=stream.scene.time(frame))
        for qa in stream.questions:
            reply = session.ask(qa.question, max_new_tokens=2).text
            results[qa.family].append(answer_of(reply) == qa.answer)
        if log and (index + 1) % 50 == 0:
            log(f"{index + 1}/{len(streams)} streams")
    accuracy = {f: round(float(np.mean(v)), 4) for f, v in results.items() if v}
    return {"streams": len(streams), "seed": seed, "questions": {f: len(v) for f, v in results.items()},
            "accuracy": accuracy, "chance": {f: round(CHANCE[f], 4) for f in accuracy},
            "seconds": round(time.perf_counter() - started, 1)}


def add_toy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--streams", type=int, default=200, help="held-out streams (one question per family each)")
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--threads", type=threads_argument, default=1, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from edgekv.threads import apply_threads


    apply_threads(args.threads)
    result = evaluate(args.model, args.streams, args.seed, log=print)
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0
