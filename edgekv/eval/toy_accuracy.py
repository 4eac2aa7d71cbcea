"""``edgekv eval toy``: the toy model's accuracy per question family on a fixed held-out set, through the
live session (``full`` cache: the no-eviction figure the model card states and a test re-checks).

The held-out streams are ordinary synthetic event streams (``edgekv.video.events``) ingested frame by
frame at 2 fps — consecutive pairs, positions from the video start, nothing evicted — of the lengths the
toy was trained on (8 to 48 frame pairs), with 1 to 5 events of one or two pairs each, random scene
styles (noise, drift, lighting, distractors), and one question of each family per stream (when that
family has a valid question). Seeded: the same set on every machine.

Generalization (issue 27), ``--families``: the same streams — the same events, the same questions — drawn
on other background families of the randomized world (``edgekv.video.world``). ``events`` is the
renderer above (``synthetic:events``, the shipped toy's training distribution); any world family name or
group draws the stream's background from that family with the stream's own noise, drift and lighting
(``--style mild``: only the background differs), or with the world's full randomization (``--style
world``: world event sizes from one grid cell to a quarter of the frame, events of 1-4 pairs, camera shake,
lighting steps, JPEG, out-of-vocabulary distractors, occlusion; a separate seeded set of schedules).
``--questions all`` adds the families ``where``, ``second`` and ``binding`` (drawn with their own seeded
generator, so the five base questions stay the card's). ``--long N`` also asks every question after the
same events spread, in their order, over an N-pair stream with nothing evicted, beside the short figure.
Every accuracy comes with its question count and a 95 % Wilson interval (``edgekv.eval.stats``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import numpy as np

from edgekv.eval.stats import proportion
from edgekv.threads import threads_argument
from edgekv.toy.questions import ALL_FAMILIES, CHANCE, EXTRA_FAMILIES, FAMILIES, QA, answer_of, sample_question
from edgekv.video.events import Event, EventPlan, EventScene, SceneStyle, random_events

HELDOUT_SEED = 20261123


@dataclass(frozen=True)
class HeldoutStream:
    scene: EventScene
    pairs: int
    questions: tuple[QA, ...]


def heldout_streams(count: int, seed: int = HELDOUT_SEED, lengths: tuple[int, int] = (8, 48),
                    size: int = 112) -> list[HeldoutStream]:
    rng = np.random.default_rng(seed)
    streams = []
    for index in range(count):
        pairs = int(rng.integers(lengths[0], lengths[1] + 1))
        wanted = int(rng.integers(1, 6))
        plan = EventPlan(rate=min(0.9, wanted / pairs * 1.6), duration=(1, 2), max_per_shape=3)
        events = random_events(rng, pairs, plan, size, size)[:wanted]
        style = SceneStyle(noise=float(rng.uniform(1, 6)), drift=float(rng.uniform(0, 0.4)) if rng.random() < 0.3 else 0.0,
                           light=float(rng.uniform(0, 0.2)) if rng.random() < 0.3 else 0.0,
                           distractors=int(rng.choice([0, 0, 0, 1, 2])))
        scene = EventScene(size, size, 2.0, seed * 7919 + index, events, style, frames=2 * pairs)
        questions = tuple(q for family in FAMILIES if (q := sample_question(events, family, rng)) is not None)
        streams.append(HeldoutStream(scene, pairs, questions))
    return streams


def evaluate(model: str, count: int = 200, seed: int = HELDOUT_SEED, log=None, part: tuple[int, int] = (0, 1),
             lm_head: str = "as_loaded") -> dict:
    """Per-family accuracy of ``model`` on the first ``count`` held-out streams (full cache, fp32, CPU;
    ``lm_head``: ``model.lm_head``, e.g. ``int8``).

    ``part=(i, n)``: only streams i, i + n, i + 2n, ... of them, with the cache the whole set needs, so that
    n processes can share the set; ``merge_parts`` gives the whole set's figures from theirs."""
    from edgekv.runtime import Runtime

    index, parts = part
    if not 0 <= index < parts:
        raise ValueError(f"part: expected (i, n) with 0 <= i < n, got {part}")
    streams = heldout_streams(count, seed)
    longest = max(s.pairs for s in streams)
    streams = streams[index::parts]
    runtime = Runtime.from_pretrained(model, model={"dtype": "fp32", "device": "cpu", "lm_head": lm_head},
                                      cache={"policy": "full", "max_tokens": 64 + 16 * longest + 64,
                                             "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [112, 112]})
    results: dict[str, list[bool]] = {family: [] for family in FAMILIES}
    started = time.perf_counter()
    done = 0
    try:
        for stream in streams:
            session = runtime.session()
            for frame in range(2 * stream.pairs):
                session.ingest(stream.scene.frame(frame), t=stream.scene.time(frame))
            answers = [(qa.family, answer_of(session.ask(qa.question, max_new_tokens=2).text) == qa.answer)
                       for qa in stream.questions]
            for family, ok in answers:  # a stream counts whole or not at all
                results[family].append(ok)
            done += 1
            if log and done % 50 == 0:
                log(f"{done}/{len(streams)} streams")
    except KeyboardInterrupt:  # Ctrl-C: the figures of the streams answered so far, marked
        if not done:  # nothing to keep: the interrupt goes on
            raise
        if log:
            log(f"interrupted after {done} of {len(streams)} streams: their figures only")
        figures = _figures(done, seed, {f: len(v) for f, v in results.items()},
                           {f: sum(v) for f, v in results.items()}, time.perf_counter() - started)
        return {**figures, "interrupted": {"streams_done": done, "streams": len(streams)}}
    questions, correct = {f: len(v) for f, v in results.items()}, {f: sum(v) for f, v in results.items()}
    return _figures(len(streams), seed, questions, correct, time.perf_counter() - started)


def merge_parts(parts: list[dict]) -> dict:
    """The figures of the whole held-out set from ``evaluate``'s on each of its parts."""
    questions = {f: sum(p["questions"][f] for p in parts) for f in FAMILIES}
    correct = {f: sum(p["correct"][f] for p in parts) for f in FAMILIES}
    return _figures(sum(p["streams"] for p in parts), parts[0]["seed"], questions, correct,
                    max(p["seconds"] for p in parts))


def _figures(streams: int, seed: int, questions: dict[str, int], correct: dict[str, int], seconds: float) -> dict:
    accuracy = {f: round(correct[f] / n, 4) for f, n in questions.items() if n}
    return {"streams": streams, "seed": seed, "questions": questions, "correct": correct,
            "accuracy": accuracy, "chance": {f: round(CHANCE[f], 4) for f in accuracy}, "seconds": round(seconds, 1)}


# ---------------------------------------------------------------------------------------------- other backgrounds
STYLES = ("mild", "world")
RENDERER = "events"  # the shipped renderer's name among --families


def extra_questions(stream: HeldoutStream, seed: int, index: int) -> tuple[QA, ...]:
    """One question of each extra family (where, second, binding) where valid, from a generator of its own."""
    rng = np.random.default_rng((seed, 7, index))
    size = (stream.scene.width, stream.scene.height)
    return tuple(q for family in EXTRA_FAMILIES
                 if (q := sample_question(stream.scene.events, family, rng, size)) is not None)


def world_heldout_streams(count: int, seed: int = HELDOUT_SEED, lengths: tuple[int, int] = (8, 48),
                          size: int = 112) -> list[tuple[HeldoutStream, object]]:
    """Held-out streams of the world's own distribution: (stream, its random ``WorldStyle``); the scene in
    the stream is only the carrier of the events (rendered per family by ``scene_for``)."""
    from edgekv.video.world import WorldPlan, random_style, world_events

    rng = np.random.default_rng((seed, 13))
    out = []
    for index in range(count):
        pairs = int(rng.integers(lengths[0], lengths[1] + 1))
        wanted = int(rng.integers(1, 6))
        plan = WorldPlan(rate=min(0.9, wanted / pairs * 1.6), duration=(1, 4))
        events = world_events(rng, pairs, plan, size, size)[:wanted]
        style = random_style(rng)
        scene = EventScene(size, size, 2.0, seed * 7919 + index, events, SceneStyle(), frames=2 * pairs)
        questions = tuple(q for family in ALL_FAMILIES
                          if (q := sample_question(events, family, rng, (size, size))) is not None)
        out.append((HeldoutStream(scene, pairs, questions), style))
    return out


def scene_for(stream: HeldoutStream, family: str, style=None, events: list[Event] | None = None,
              pairs: int | None = None):
    """``stream``'s events (or ``events``) drawn on ``family``: the stream's own scene for ``events``,
    else a world scene with ``style`` (default: the stream's noise, drift and lighting, nothing else)."""
    from edgekv.video.world import WorldScene, mild_style

    events = list(stream.scene.events) if events is None else events
    pairs = stream.pairs if pairs is None else pairs
    if family == RENDERER:
        return EventScene(stream.scene.width, stream.scene.height, stream.scene.fps, stream.scene.seed, events,
                          stream.scene.style, frames=2 * pairs)
    if style is None:
        style = mild_style(stream.scene.style)
    return WorldScene(stream.scene.width, stream.scene.height, stream.scene.fps, stream.scene.seed, events, family,
                      style, frames=2 * pairs)


def spread_events(events: list[Event], pairs: int, long: int, rng: np.random.Generator) -> list[Event]:
    """``events`` (in a ``pairs``-pair stream) moved to random pairs of a ``long``-pair stream, in the same
    order with at least the same gaps, so that every question has the same answer."""
    if long < pairs:
        raise ValueError(f"a long stream of {long} pairs cannot hold a stream of {pairs}")
    events = sorted(events, key=lambda e: e.first_pair)
    starts = [e.first_pair for e in events]
    gaps = np.diff([0] + starts)  # pairs before each event (since the previous one started)
    extra = rng.multinomial(long - pairs, np.full(len(events) + 1, 1 / (len(events) + 1))) if events else []
    out, cursor = [], 0
    for event, gap, more in zip(events, gaps, extra):
        cursor += int(gap) + int(more)
        out.append(Event(event.shape, event.color, cursor, event.pairs, event.center, event.radius))
    return out


def ask_stream(runtime, scene, pairs: int, questions: tuple[QA, ...]) -> list[str]:
    """The answer word given to each of ``questions`` after ``pairs`` frame pairs of ``scene``."""
    session = runtime.session()
    for frame in range(2 * pairs):
        session.ingest(scene.frame(frame), t=scene.time(frame))
    return [answer_of(session.ask(qa.question, max_new_tokens=2).text) for qa in questions]


def confusion(pairs: list[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """``{answer: {predicted: count}}`` over (answer, predicted) pairs: which way a question family errs."""
    table: dict[str, dict[str, int]] = {}
    for answer, predicted in pairs:
        row = table.setdefault(answer, {})
        row[predicted] = row.get(predicted, 0) + 1
    return {answer: dict(sorted(row.items())) for answer, row in sorted(table.items())}


def evaluate_families(model: str, families: tuple[str, ...], count: int = 200, seed: int = HELDOUT_SEED,
                      style: str = "mild", questions: str = "base", long: int = 0, long_streams: int | None = None,
                      log=None, size: int = 112) -> dict:
    """Per background family and question family: accuracy, question count and 95 % interval, full cache;
    with ``long``, the first ``long_streams`` streams also inside ``long``-pair streams (paired figures)."""
    from edgekv.runtime import Runtime
    from edgekv.video.world import family_problem

    if style not in STYLES:
        raise ValueError(f"style {style!r} is not one of {', '.join(STYLES)}")
    for family in families:
        for part in family.split("+"):
            if part != RENDERER and family_problem(part) is not None:
                raise ValueError(family_problem(part))
    if style == "world":
        drawn = world_heldout_streams(count, seed, size=size)
        streams = [s for s, _ in drawn]
        styles = [st for _, st in drawn]
    else:
        streams = heldout_streams(count, seed, size=size)
        styles = [None] * len(streams)
        if questions == "all":
            streams = [HeldoutStream(s.scene, s.pairs, s.questions + extra_questions(s, seed, i))
                       for i, s in enumerate(streams)]
    if questions == "base":
        streams = [HeldoutStream(s.scene, s.pairs, tuple(q for q in s.questions if q.family in FAMILIES))
                   for s in streams]
    longest = max(max(s.pairs for s in streams), long)
    per_pair = (size // 28) ** 2
    runtime = Runtime.from_pretrained(model, model={"dtype": "fp32", "device": "cpu"},
                                      cache={"policy": "full", "max_tokens": 64 + per_pair * longest + 64,
                                             "text_reserve_tokens": 64},
                                      video={"fps": 2.0, "resolution": [size, size]})
    asked = ALL_FAMILIES if questions == "all" else FAMILIES
    out: dict = {"model": model, "streams": len(streams), "seed": seed, "style": style, "questions": questions,
                 "size": size,
                 "families": {}, "chance": {f: round(CHANCE[f], 4) for f in asked}}
    long_count = len(streams) if long_streams is None else min(long_streams, len(streams))
    for family in families:
        started = time.perf_counter()
        results: dict[str, list[bool]] = {f: [] for f in asked}
        given: dict[str, list[tuple[str, str]]] = {f: [] for f in asked}
        short_paired: dict[str, list[bool]] = {f: [] for f in asked}
        long_paired: dict[str, list[bool]] = {f: [] for f in asked}
        parts = family.split("+")  # a mix: stream i on the (i mod n)-th family
        done = long_done = 0
        try:
            for index, (stream, st) in enumerate(zip(streams, styles)):
                background = parts[index % len(parts)]
                scene = scene_for(stream, background, st)
                predicted = ask_stream(runtime, scene, stream.pairs, stream.questions)
                correct = [word == qa.answer for qa, word in zip(stream.questions, predicted)]
                far = None
                if long and index < long_count:
                    rng = np.random.default_rng((seed, 17, index))
                    events = spread_events(list(stream.scene.events), stream.pairs, long, rng)
                    far = [word == qa.answer for qa, word in zip(stream.questions, ask_stream(
                        runtime, scene_for(stream, background, st, events, long), long, stream.questions))]
                # a stream counts whole (its short and long answers) or not at all
                for qa, ok, word in zip(stream.questions, correct, predicted):
                    results[qa.family].append(ok)
                    given[qa.family].append((qa.answer, word))
                if far is not None:
                    for qa, ok, ok_long in zip(stream.questions, correct, far):
                        short_paired[qa.family].append(ok)
                        long_paired[qa.family].append(ok_long)
                    long_done += 1
                done += 1
                if log and done % 50 == 0:
                    log(f"{family}: {done}/{len(streams)} streams ({time.perf_counter() - started:.0f} s)")
        except KeyboardInterrupt:  # Ctrl-C: the families done, and this one's streams so far, marked
            if not done and not out["families"]:  # nothing to keep: the interrupt goes on
                raise
            out["interrupted"] = {"family": family, "streams_done": done, "streams": len(streams),
                                  "families_left": list(families[families.index(family) + 1:])}
            if log:
                log(f"interrupted in {family} after {done} of {len(streams)} streams: the figures so far")
        entry = {"by_question": {f: proportion(int(sum(v)), len(v)) for f, v in results.items() if v},
                 "confusion": {f: confusion(v) for f, v in given.items() if v},
                 "seconds": round(time.perf_counter() - started, 1), "streams": done}
        everything = [ok for v in results.values() for ok in v]
        if everything:
            entry["all"] = proportion(int(sum(everything)), len(everything))
        if long and long_done:
            entry["long"] = {"pairs": long, "streams": long_done,
                             "short": {f: proportion(int(sum(v)), len(v)) for f, v in short_paired.items() if v},
                             "long": {f: proportion(int(sum(v)), len(v)) for f, v in long_paired.items() if v}}
            short_all = [ok for v in short_paired.values() for ok in v]
            long_all = [ok for v in long_paired.values() for ok in v]
            entry["long"]["short_all"] = proportion(int(sum(short_all)), len(short_all))
            entry["long"]["long_all"] = proportion(int(sum(long_all)), len(long_all))
        if everything:
            out["families"][family] = entry
            if log:
                log(format_family(family, entry))
        if "interrupted" in out:
            break
    return out


def format_family(family: str, entry: dict) -> str:
    parts = [f"{q} {v['accuracy']:.3f} [{v['ci95'][0]:.2f}-{v['ci95'][1]:.2f}] n={v['n']}"
             for q, v in entry["by_question"].items()]
    line = f"{family:10s} all {entry['all']['accuracy']:.3f} (n={entry['all']['n']}) | " + "; ".join(parts)
    if "long" in entry:
        lg = entry["long"]
        line += (f"\n{'':10s} {lg['streams']} streams short {lg['short_all']['accuracy']:.3f} vs inside "
                 f"{lg['pairs']} pairs {lg['long_all']['accuracy']:.3f} (n={lg['long_all']['n']}): "
                 + "; ".join(f"{q} {lg['short'][q]['accuracy']:.3f}->{lg['long'][q]['accuracy']:.3f}"
                             for q in lg["long"]))
    return line


def add_toy_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin:toy")
    parser.add_argument("--streams", type=int, default=200, help="held-out streams (one question per family each)")
    parser.add_argument("--seed", type=int, default=HELDOUT_SEED)
    parser.add_argument("--threads", type=threads_argument, default=1, help="torch CPU threads")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--families", default=None,
                        help="background families to draw the held-out streams on: 'events' (the shipped "
                             "renderer) and world families or groups (edgekv.video.world: procedural, photos, "
                             "videos, all); A+B+C is one mix (stream i on the i-th of them, in turn); per family "
                             "and question family with 95%% intervals")
    parser.add_argument("--style", choices=STYLES, default="mild",
                        help="mild: the card's streams, only the background differs; world: the world's own "
                             "event sizes and durations and full randomization")
    parser.add_argument("--questions", choices=("base", "all"), default="base",
                        help="base: the five families; all: also where, second, binding")
    parser.add_argument("--long", type=int, default=0,
                        help="also ask each question after the same events spread over a stream of this many "
                             "pairs (full cache), beside the short figure")
    parser.add_argument("--long-streams", type=int, default=None, help="how many streams get the long run")
    parser.add_argument("--size", type=int, choices=(112, 224), default=112,
                        help="frame side (the streams' events scale with it)")
    parser.add_argument("--lm-head", choices=("as_loaded", "int8"), default="as_loaded",
                        help="model.lm_head: the head's weights as loaded, or int8 (the card's streams only)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from edgekv.threads import apply_threads

    apply_threads(args.threads)
    card_set = args.families is None and args.style == "mild" and args.questions == "base" and not args.long \
        and args.size == 112
    if args.lm_head != "as_loaded" and not card_set:
        print("edgekv eval toy: --lm-head is for the card's streams (no --families, --style, --questions, --long, --size)")
        return 2
    if card_set:
        result = evaluate(args.model, args.streams, args.seed, log=print, lm_head=args.lm_head)
    else:
        from edgekv.video.world import parse_families

        names = [n.strip() for n in (args.families or RENDERER).split(",") if n.strip()]
        try:
            families = tuple(n for name in names for n in (
                (RENDERER,) if name == RENDERER else
                ("+".join(p for part in name.split("+") for p in ((RENDERER,) if part == RENDERER else
                                                                    parse_families(part))),)
                if "+" in name else parse_families(name)))
            result = evaluate_families(args.model, families, args.streams, args.seed, args.style, args.questions,
                                       args.long, args.long_streams, log=print, size=args.size)
        except ValueError as exc:
            print(f"edgekv eval toy: {exc}")
            return 2
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)
    if "interrupted" in result:  # Ctrl-C: the figures above are those of the streams answered before it
        print(f"edgekv eval toy: interrupted ({result['interrupted']['streams_done']} streams of the last set done)",
              file=sys.stderr)
        return 130
    return 0
