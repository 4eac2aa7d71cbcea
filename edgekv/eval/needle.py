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

Harder settings (issue 27), all off by default so that earlier figures keep their meaning:

* ``families``: the stream's background from the randomized world (``edgekv.video.world``), one family per
  stream in turn; ``style="world"`` also draws the world's camera, light, JPEG, distractors, occlusion and
  event sizes (one merged-grid cell to a quarter of the frame);
* ``size`` 224: 64 tokens per frame pair, so what a cache keeps within a frame matters;
* ``kinds``: the extra question families (``where``, ``second``, ``binding``), and ``repeats``: events that
  bring a needle's shape back in another colour at another age (counts across long gaps: the ``count``
  questions about them are reported apart as ``count_gap``; the second colour; binding);
* ``caps``: caps given as shares of the stream's video tokens (1/4 .. 1/256) instead of, or beside, tokens;
* the **full-cache ceiling**: the same long stream with nothing evicted, where its tokens fit
  ``full_max_tokens`` (``ceiling_full`` per record; the short-stream ceiling stays beside it);
* ``oracle``: the full cache also answers cut down to the needle pairs seen so far and the ``CEILING_GAP`` pairs
  before each, as in the short streams (``oracle_cut``: every token of those pairs, nothing else of the video;
  ``ceiling_oracle`` per record) — a cache that knew the questions. Where
  the full cache falls short of the short streams and the oracle does not, the events were remembered and the
  background misled the question (a look-alike; measured on the 224 x 224 toy: docs/measurements.md, "Where the full
  cache loses");
* ``busy`` and ``lures`` (world families): out-of-vocabulary objects passing through the frame at ``busy`` per pair,
  a ``lures`` share of them in the vocabulary's colours (a red star, a blue ring). A trained toy's value norms mark
  its needles (``tools/toy_value_norms.py``), so a cache that ranks by them keeps every needle of a quiet stream
  in a few tokens; lures are what a cache that cannot know the question must keep as well — the real condition;
  ``lure_colors`` "free" draws them only in colours no event of the stream wears (and ``lure_shapes`` in chosen
  look-alikes): then no lure matches a question's colour, and a full cache that cannot read past them is not
  misled by a look-alike but by how many salient objects it holds;
* ``kv_dtypes``: every run once per K/V storage dtype **at equal bytes** (DESIGN invariant 11): the first
  dtype's cache of ``M`` tokens sets the bytes, and each other dtype gets the slots those bytes buy it
  (``CacheSpec.tokens_for_bytes``, scales and metadata counted); records keep ``M`` as their budget (so the
  dtypes line up in the summary) and the slots each one had.

Every accuracy in the summary carries its question count and a 95 % Wilson interval (``edgekv.eval.stats``).
``frontier`` names, per policy, the largest cap at which it answers under 90 % of the ceiling (all questions, and
those about events at least 256 pairs old): where the issue asks the benchmark to show each policy break. Where
the full cache ran on the long stream, each cap is also paired with it question by question (``vs_full``: the
questions right only with the cap, only with the full cache, and McNemar's exact p, as ``eval compare`` does): a
ratio under 0.9 on 60 questions can be noise, and the verdict prints its p.

The vision tower's output does not depend on the cache, so each stream's frame pairs are encoded once
and replayed to every policy run (``ReplayVision``: same tokens, checked against the pixels they came from).
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from edgekv.cache.capped import METADATA_FIELDS, CapTooSmallError, SlotKind
from edgekv.cache.specs import KV_DTYPES, CacheSpec
from edgekv.config import ArchiveSection
from edgekv.eval.stats import mcnemar_exact, proportion
from edgekv.toy.questions import (CHANCE, COLORS, FAMILIES, QA, SHAPES, answer_of, binding_options,
                                  binding_question, count_question, negative_exists,
                                  order_question, questions_about)
from edgekv.video.events import Event, EventScene, SceneStyle, place_event

DEFAULT_AGES = (2, 8, 32, 128, 512, 1024, 1900)
AGE_BINS = (0, 4, 16, 64, 256, 768, 1536, 4096, 10**9)
CHECKPOINTS = (0.25, 0.5, 0.75, 1.0)
CLASSIC = "events"  # the family name of the classic renderer (edgekv.video.events)
GAP_SPAN = 256  # count questions about appearances at least this many pairs apart are reported as count_gap
BREAK_RATIO = 0.9  # a policy "breaks" at a cap where it answers under 90 % of the ceiling (issue 27)
OLD_AGE = 256      # events at least this many pairs old: beyond a short window's reach


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
    family: str = CLASSIC
    style: object = None  # the WorldStyle of a world stream (its ceiling streams share it)


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
                  checkpoints: tuple[float, ...] = CHECKPOINTS, noise: float = 3.0, family: str = CLASSIC,
                  size: int = 112, kinds: tuple[str, ...] = FAMILIES, repeats: int = 0,
                  style: str = "mild", busy: float = 0.0, lures: float = 0.0, lure_colors: str | tuple[str, ...] = (),
                  lure_shapes: tuple[str, ...] = ()) -> NeedleStream:
    """A ``length``-pair stream with ``events`` needle events at ages drawn from ``ages`` (distinct
    shapes and colours), ``repeats`` more that bring a needle's shape back in an unused colour at another
    age, and the probes (of the question families in ``kinds``) asked at each checkpoint. ``family`` other
    than ``events`` draws the background from the randomized world (``style`` "world": its random camera,
    light, JPEG, clutter, occlusion and event sizes too). ``busy`` > 0 (world families only): out-of-vocabulary
    objects pass through the frame at that many per pair (each for 1-6 pairs), whatever the style; ``lures``
    of them (a share) in the vocabulary's colours: out-of-vocabulary shapes as salient as the needles;
    ``lure_colors`` the colours they take (default any; ``"free"``: those no event of the stream wears, so that a
    question's colour picks out its needle) and ``lure_shapes`` their shapes (default any look-alike)."""
    if (busy or lures) and family == CLASSIC:
        raise ValueError(f"busy {busy}, lures {lures}: passing objects are drawn by the world renderer; the "
                         f"classic family {CLASSIC!r} has none (choose a world family)")
    rng = np.random.default_rng((seed, 41))
    valid = sorted({a for a in ages if 1 <= a <= length - 1})
    if not valid:
        raise ValueError(f"no event age in {list(ages)} fits a stream of {length} frame pairs")
    chosen = sorted(rng.choice(valid, size=min(events, len(valid)), replace=False).tolist(), reverse=True)
    shapes = rng.permutation(SHAPES)[: len(chosen)]
    colors = rng.permutation(COLORS)[: len(chosen)]
    world = family != CLASSIC and style == "world"
    if world:
        from edgekv.video.world import world_event

        placed = [world_event(rng, str(shape), str(color), length - age, 1, size, size)
                  for age, shape, color in zip(chosen, shapes, colors)]
    else:
        placed = [place_event(rng, str(shape), str(color), length - age, 1, size, size)
                  for age, shape, color in zip(chosen, shapes, colors)]
    if repeats:
        rest = [a for a in valid if a not in chosen]
        again = rng.choice(rest, size=min(repeats, len(rest)), replace=False).tolist() if rest else []
        for age in again:
            original = placed[int(rng.integers(len(placed)))]
            used = {e.color for e in placed}
            color = str(rng.choice([c for c in COLORS if c not in used] or [c for c in COLORS if c != original.color]))
            avoid = [e for e in placed if e.shape == original.shape]
            if world:
                placed.append(world_event(rng, original.shape, color, length - age, 1, size, size, avoid=avoid))
            else:
                placed.append(place_event(rng, original.shape, color, length - age, 1, size, size, avoid=avoid))
    if lure_colors == "free":
        lure_colors = tuple(c for c in COLORS if c not in {e.color for e in placed})
        if not lure_colors:
            raise ValueError(f"lure colours 'free': the stream's {len(placed)} events wear every vocabulary colour "
                             f"({', '.join(COLORS)}), none is left for the lures (fewer events or repeats)")
    scene, world_style = make_scene(family, style, size, fps, seed, placed, 2 * length, noise, busy, lures,
                                    tuple(lure_colors), tuple(lure_shapes))
    probes: list[Probe] = []
    for fraction in checkpoints:
        at = max(1, int(round(fraction * length)))
        seen = tuple(e for e in scene.events if e.last_pair < at)
        probes.extend(_probes_at(at, seen, rng, kinds, (size, size)))
    return NeedleStream(scene, length, probes, seed, family, world_style)


def make_scene(family: str, style: str | object, size: int, fps: float, seed: int, events: list[Event],
               frames: int, noise: float = 3.0, busy: float = 0.0, lures: float = 0.0,
               lure_colors: tuple[str, ...] = (), lure_shapes: tuple[str, ...] = ()):
    """(scene, world style): the classic renderer for ``events``; else a world scene of ``family`` whose
    style is the given ``WorldStyle``, or drawn from the seed ("world"), or noise only ("mild"); ``busy``
    sets its transient objects per pair, ``lures`` the share of them in vocabulary colours, ``lure_colors`` /
    ``lure_shapes`` the colours / shapes those take."""
    if family == CLASSIC:
        return EventScene(size, size, 2.0 if fps is None else fps, seed, events, SceneStyle(noise=noise),
                          frames=frames), None
    from edgekv.video.world import WorldScene, WorldStyle, random_style

    if style == "world":
        style = random_style(np.random.default_rng((seed, 43)))
    elif style == "mild":
        style = WorldStyle(noise=noise)
    if busy or lures:
        style = replace(style, transients=busy or style.transients, lures=lures or style.lures)
    if lure_colors or lure_shapes:
        style = replace(style, lure_colors=lure_colors, lure_shapes=lure_shapes)
    return WorldScene(size, size, fps, seed, events, family, style, frames=frames), style


def _probes_at(at: int, seen: tuple[Event, ...], rng: np.random.Generator, kinds: tuple[str, ...] = FAMILIES,
               size: tuple[int, int] = (112, 112)) -> list[Probe]:
    """The probes at checkpoint ``at`` (each question once; its age is that of the oldest event it is about)."""
    probes: dict[str, Probe] = {}
    for event in seen:
        for qa in questions_about(event, seen, kinds, size):
            # a binding question is an exists question that needs binding: reported as binding
            if qa.question not in probes or qa.family == "binding":
                probes[qa.question] = Probe(qa, at, at - min(e.first_pair for e in qa.about), seen)
    out = list(probes.values())
    if seen and "exists" in kinds:
        out.append(Probe(negative_exists(seen, rng), at, None, seen))
    absent = [s for s in SHAPES if s not in {e.shape for e in seen}]
    if absent and "count" in kinds:
        out.append(Probe(count_question(seen, str(rng.choice(absent))), at, None, seen))
    if len(seen) >= 2 and "order" in kinds:
        a, b = rng.choice(len(seen), size=2, replace=False)
        first, second = sorted((seen[a], seen[b]), key=lambda e: e.first_pair)
        names = [first.shape, second.shape] if rng.random() < 0.5 else [second.shape, first.shape]
        qa = order_question(seen, *names)
        if qa is not None:
            out.append(Probe(qa, at, at - first.first_pair, seen))
    if "binding" in kinds:
        negatives = binding_options(seen)[1]
        if negatives:
            color, shape = negatives[int(rng.integers(len(negatives)))]
            # a colour and a shape both seen, never together: the age of the older of the two appearances
            about = [e for e in seen if e.color == color or e.shape == shape]
            qa = binding_question(seen, color, shape)
            out = [p for p in out if p.qa.question != qa.question]  # the same words asked as exists: once
            out.append(Probe(qa, at, at - min(e.first_pair for e in about), seen))
    return out


def probe_family(probe: Probe) -> str:
    """The family a probe is reported under: ``count_gap`` for a count over appearances ``GAP_SPAN`` apart."""
    about = probe.qa.about
    if probe.qa.family == "count" and len(about) >= 2 and \
            max(e.first_pair for e in about) - min(e.first_pair for e in about) >= GAP_SPAN:
        return "count_gap"
    return probe.qa.family


# Background frame pairs before each event in the short ceiling streams, and before each needle pair in the oracle's
# cut (``oracle_cut``): the needles shown as the short streams show them.
CEILING_GAP = 3


def ceiling_scene(seen: tuple[Event, ...], seed: int, fps: float, gap: int = CEILING_GAP, family: str = CLASSIC,
                  style: object = None, size: int = 112) -> tuple[EventScene, int]:
    """The events of ``seen`` in the same order, ``gap`` background pairs apart, and the stream length
    (the same background family and world style as the long stream)."""
    events, pair = [], gap
    for event in seen:
        events.append(Event(event.shape, event.color, pair, event.pairs, event.center, event.radius))
        pair += event.pairs + gap
    length = max(pair, 2)
    scene, _ = make_scene(family, style if style is not None else "mild", size, fps, seed, events, 2 * length)
    return scene, length


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
               asks: dict[int, list[QA]], max_new_tokens: int = 2,
               oracle: dict[tuple[int, str], str] | None = None) -> tuple[dict[tuple[int, str], str], dict]:
    """Ingest ``pairs`` frame pairs with ``runtime``'s cache config; after ``at`` pairs ask ``asks[at]``.
    Returns {(checkpoint, question): answer word} and the session's final stats. With ``oracle`` (a dict to
    fill), each checkpoint's questions are asked a second time of the cache cut down to the needle pairs seen
    so far and the ``CEILING_GAP`` pairs before each (``oracle_cut``), and those answers go there."""
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
        if oracle is not None and asks.get(pair + 1):
            with oracle_cut(session, oracle_pairs(scene.events, pair + 1)):
                for qa in asks[pair + 1]:
                    oracle.setdefault((pair + 1, qa.question),
                                      answer_of(session.ask(qa.question, max_new_tokens=max_new_tokens).text))
    stats = session.stats()
    if session.recall is not None:
        session.recall.close()  # the writer thread stops before its folder goes
    return answers, stats


def oracle_pairs(events, at: int | None = None) -> set[int]:
    """The frame pairs the oracle keeps at checkpoint ``at`` (default: the stream's end): every pair of each event
    seen by then and the ``CEILING_GAP`` pairs before it."""
    return {p for e in events if at is None or e.last_pair < at
            for p in range(max(0, e.first_pair - CEILING_GAP), e.last_pair + 1)}


@contextmanager
def oracle_cut(session, pairs: set[int]):
    """The session's cache holding nothing of the video but the frame pairs ``pairs`` (every token of each; the
    prefix stays), for the ``with`` block, and exactly as before after it — an eviction no policy can make: it
    knows where the needles are. What the full cache answers then is what a perfect cache keeps; what it answers
    with everything is that and the background's distraction (issue 27: on the 224 x 224 toy, the gap between
    the full cache on long streams and the short ones is the background's, not lost memory)."""
    cache = session.cache
    n = cache.length
    names = ["k", "v", *METADATA_FIELDS] + (["k_scale", "v_scale"] if cache.quantized else [])
    saved = {name: getattr(cache, name)[:, :, :n].clone() for name in names}
    kind, frame = cache.kind[:, :, :n], cache.frame[:, :, :n]
    wanted = torch.tensor(sorted(pairs), dtype=frame.dtype, device=frame.device)
    keep = (kind != int(SlotKind.VISION)) | torch.isin(frame, wanted)
    if not bool((keep == keep[:1, :1]).all()):
        raise RuntimeError("oracle_cut: layers or heads disagree on which slots hold a pair (a policy compacted "
                           "them apart); the oracle is for a full cache")
    index = torch.nonzero(keep[0, 0]).flatten()
    try:
        cache.compact(index.expand(cache.num_layers, cache.kv_heads, -1).contiguous())
        yield
    finally:
        for name, value in saved.items():
            getattr(cache, name)[:, :, :n].copy_(value)
        cache.length = n


def runtime_for(model: str, run: PolicyRun, max_tokens: int, fps: float, reserve: int, archive_dir: str | None = None,
                size: int = 112):
    """The runtime of one run; ``archive_dir`` (a fresh, empty folder) when ``run.archive``."""
    from edgekv.runtime import Runtime

    cache = {"policy": run.policy, "max_tokens": max_tokens, "text_reserve_tokens": reserve, "sinks": run.sinks}
    sections: dict[str, dict] = {"cache": cache, "model": {"dtype": "fp32", "device": "cpu"},
                                 "video": {"fps": fps, "resolution": [size, size]}}
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
    families: tuple[str, ...] = (CLASSIC,)   # background family per stream, in turn
    style: str = "mild"                      # world streams: "mild" (background only) or "world" (everything)
    sizes: tuple[int, ...] = (112,)          # frame sides (112: 16 tokens per pair, 224: 64)
    kinds: tuple[str, ...] = FAMILIES        # question families asked
    repeats: int = 0                         # events bringing a needle's shape back in another colour
    caps: tuple[float, ...] = ()             # caps as shares of the stream's video tokens (beside budgets)
    full_max_tokens: int = 40000             # the full-cache ceiling on the long stream where it fits this
    kv_dtypes: tuple[str, ...] = ()          # K/V dtypes compared at equal bytes (the first one's M tokens)
    busy: float = 0.0                        # world streams: passing out-of-vocabulary objects per frame pair
    lures: float = 0.0                       # ... the share of them in the vocabulary's colours
    lure_colors: str | tuple[str, ...] = ()  # ... their colours: () any, "free" those no event wears, or a list
    lure_shapes: tuple[str, ...] = ()        # ... their shapes: () any look-alike, or a list of them
    oracle: bool = False                     # the full cache also answers cut to the needle pairs (``oracle_cut``)


def tokens_per_pair(size: int) -> int:
    return (size // 28) ** 2


def cap_budget(cap: float, length: int, size: int, reserve: int) -> int:
    """M for a cap given as a share of the stream's video tokens, at least what a session needs (the prefix,
    four frame pairs and the text reserve)."""
    per_pair = tokens_per_pair(size)
    return max(int(round(cap * length * per_pair)), 32 + 4 * per_pair + reserve)


def equal_bytes_slots(spec_of: Callable[[str], CacheSpec], budget: int, reference: str, kv_dtype: str) -> int:
    """The slots a ``kv_dtype`` cache gets in the bytes ``budget`` tokens of ``reference`` take."""
    return spec_of(kv_dtype).tokens_for_bytes(spec_of(reference).bytes_for(budget))


def dtype_runs(runs: tuple[PolicyRun, ...], kv_dtypes: tuple[str, ...]) -> list[tuple[PolicyRun, str | None]]:
    """Each run once per K/V dtype (its ``kv_dtype`` cache key set), or as given without ``kv_dtypes``."""
    if not kv_dtypes:
        return [(run, None) for run in runs]
    return [(replace(run, options=run.options + (("kv_dtype", d),)), d) for run in runs for d in kv_dtypes]


def evaluate(config: NeedleConfig, log: Callable[[str], None] = print) -> dict:
    """Run every (size, length, stream, cap, policy), the ceilings and the full-cache runs; returns the
    JSON document. Ctrl-C keeps the streams every run finished on (each policy and cap then answered the same
    questions), marks the result ``interrupted`` and drops the stream under way; before the first: the interrupt."""
    records: list[dict] = []
    streams_done, interrupted = 0, False
    try:
        for done in _stream_records(config, log):
            records.extend(done)
            streams_done += 1
    except KeyboardInterrupt:
        if not records:
            raise
        interrupted = True
        log(f"interrupted: keeping the {streams_done} stream(s) every run finished on; the one under way is dropped")
    summary = summarize(records)
    result = {"config": _config_json(config), "records": records, "summary": summary, "frontier": frontier(summary)}
    if interrupted:
        result["interrupted"] = {"streams_done": streams_done}
    return result


def _stream_records(config: NeedleConfig, log: Callable[[str], None]) -> Iterator[list[dict]]:
    """Each stream's records once every run on it (ceilings, full cache, each cap x policy) has finished."""
    from edgekv.runtime import Runtime

    for size in config.sizes:
        per_pair = tokens_per_pair(size)
        base = Runtime.from_pretrained(config.model, model={"dtype": "fp32", "device": "cpu"},
                                       cache={"policy": "full", "max_tokens": 64 + 2 * per_pair,
                                              "text_reserve_tokens": 32},
                                       video={"fps": config.fps, "resolution": [size, size]})
        text = base.model.config.text
        # The full cache keeps every pair at its own temporal position (nothing to squeeze: DESIGN invariant 5), so
        # its video spans length x G positions; past the model's max_position_embeddings its attention reaches
        # distances the model never saw (the toy: 8,192; a 10,000-pair stream at 2 fps spans 20,000).
        spacing = base.session(archive=False).pair_spacing

        def spec_of(name: str) -> CacheSpec:
            return CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim,
                                     KV_DTYPES[name])

        for length in config.lengths:
            budgets: list[tuple[int, float | None]] = [(b, None) for b in config.budgets]
            budgets += [(cap_budget(c, length, size, config.reserve), c) for c in config.caps]
            needed = _tokens_needed(None, length, config.reserve, per_pair)
            for index in range(config.streams):
                seed = config.seed * 1000 + index
                family = config.families[index % len(config.families)]
                stream = needle_stream(length, config.ages, seed, config.events, config.fps, config.checkpoints,
                                       family=family, size=size, kinds=config.kinds, repeats=config.repeats,
                                       style=config.style, busy=config.busy, lures=config.lures,
                                       lure_colors=config.lure_colors, lure_shapes=config.lure_shapes)
                ceiling = _ceilings(config, stream, size)
                started = time.perf_counter()
                replay = encode_stream(base, stream.scene, stream.pairs)
                asks: dict[int, list[QA]] = {}
                for probe in stream.probes:
                    asks.setdefault(probe.checkpoint, []).append(probe.qa)
                log(f"{size}px length {length} stream {index} ({family}): {len(stream.probes)} questions, events "
                    f"{[e.describe() for e in stream.scene.events]} (encoded in {time.perf_counter() - started:.1f} s)")
                full = oracle = None
                done: list[dict] = []
                if config.full_max_tokens and needed <= config.full_max_tokens:
                    started = time.perf_counter()
                    runtime = runtime_for(config.model, PolicyRun("full"), needed, config.fps, config.reserve,
                                          size=size)
                    oracle = {} if config.oracle else None
                    full, _ = run_stream(runtime, stream.scene, stream.pairs, replay, asks, oracle=oracle)
                    correct = [full[(p.checkpoint, p.qa.question)] == p.qa.answer for p in stream.probes]
                    cut = "" if oracle is None else (
                        f"; cut to the needle pairs (oracle) "
                        f"{np.mean([oracle[(p.checkpoint, p.qa.question)] == p.qa.answer for p in stream.probes]):.3f}")
                    log(f"  full cache on the long stream (M={needed}): accuracy {np.mean(correct):.3f}{cut} "
                        f"({time.perf_counter() - started:.1f} s)")
                for budget, cap in budgets:
                    for run, kv_dtype in dtype_runs(config.runs, config.kv_dtypes):
                        if run.policy == "full" and budget < needed:
                            continue  # full only where the stream fits
                        slots = budget if kv_dtype is None else equal_bytes_slots(
                            spec_of, budget, config.kv_dtypes[0], kv_dtype)
                        if slots < cap_budget(0.0, length, size, config.reserve):
                            log(f"  M={budget:6d} {run.label:28s} skipped: {slots} slots at equal bytes are "
                                f"fewer than a session needs")
                            continue
                        recalled = int(dict(run.options).get("archive.top_k", ArchiveSection.top_k)) \
                            if run.archive else 0
                        if run.archive and slots < 32 + (2 + recalled) * per_pair + config.reserve:
                            log(f"  M={budget:6d} {run.label:28s} skipped: {slots} slots cannot hold the prefix, two "
                                f"pairs, the text reserve and the {recalled} recalled pairs of archive.top_k")
                            continue
                        if run.sinks and run.sinks >= slots:  # StateKV's B sinks live inside the cap
                            log(f"  M={budget:6d} {run.label:28s} skipped: B={run.sinks} sinks do not fit a cap "
                                f"of {slots} slots")
                            continue
                        with tempfile.TemporaryDirectory(prefix="edgekv-needle-archive-") as folder:
                            runtime = runtime_for(config.model, run, slots, config.fps, config.reserve,
                                                  folder if run.archive else None, size=size)
                            started = time.perf_counter()
                            try:
                                answers, stats = run_stream(runtime, stream.scene, stream.pairs, replay, asks)
                            except CapTooSmallError as error:  # raised at the first frame, before any answer
                                log(f"  M={budget:6d} {run.label:28s} skipped: {error}")
                                continue
                            seconds = time.perf_counter() - started
                        correct = [answers[(p.checkpoint, p.qa.question)] == p.qa.answer for p in stream.probes]
                        log(f"  M={budget:6d} {run.label:28s} accuracy {np.mean(correct):.3f}  "
                            f"({f'{slots} slots, ' if slots != budget else ''}{stats['compressions']} compressions"
                            f"{', %d pairs recalled' % stats['recalled_pairs'] if run.archive else ''}"
                            f"{', %d dropped by the archive' % stats['archive_dropped'] if stats.get('archive_dropped') else ''}"
                            f", {seconds:.1f} s)")
                        for probe, ok in zip(stream.probes, correct):
                            key = (probe.checkpoint, probe.qa.question)
                            done.append({
                                "length": length, "stream": index, "budget": budget, "slots": slots,
                                "bytes": stats["cache_capacity_bytes"], "policy": run.label,
                                "family": probe.qa.family, "kind": probe_family(probe),
                                "question": probe.qa.question, "answer": probe.qa.answer,
                                "predicted": answers[key], "correct": bool(ok), "age": probe.age,
                                "checkpoint": probe.checkpoint, "ceiling_correct": ceiling[key],
                                "ceiling_full": None if full is None else full[key] == probe.qa.answer,
                                "ceiling_oracle": None if not oracle else oracle[key] == probe.qa.answer,
                                "size": size, "background": family, "cap": cap,
                                "cap_actual": round(budget / (length * per_pair), 6),
                                "span_positions": length * spacing,
                                "trained_positions": int(text.max_position_embeddings),
                            })
                yield done


def _tokens_needed(runtime, pairs: int, reserve: int, per_pair: int = 16) -> int:
    return 32 + pairs * per_pair + reserve


def _ceilings(config: NeedleConfig, stream: NeedleStream, size: int = 112) -> dict[tuple[int, str], bool]:
    """Correctness of each probe on its no-eviction short stream (one short stream per checkpoint)."""
    out: dict[tuple[int, str], bool] = {}
    by_checkpoint: dict[int, list[Probe]] = {}
    for probe in stream.probes:
        by_checkpoint.setdefault(probe.checkpoint, []).append(probe)
    for at, probes in by_checkpoint.items():
        scene, length = ceiling_scene(probes[0].seen, stream.seed, config.fps, family=stream.family,
                                      style=stream.style, size=size)
        runtime = runtime_for(config.model, PolicyRun("full"),
                              _tokens_needed(None, length, config.reserve, tokens_per_pair(size)),
                              config.fps, config.reserve, size=size)
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
    """Accuracy, ceiling and their ratio per (size, length, budget, policy) x age bin, and per question
    family (``kind``: ``count_gap`` apart); question counts and 95 % Wilson intervals beside each figure,
    and the full-cache ceiling on the long stream where it was run."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r.get("size", 112), r["length"], r["budget"], r["policy"]), []).append(r)
    out = {}
    for (size, length, budget, policy), rows in sorted(groups.items(), key=lambda kv: kv[0]):
        entry = {"length": length, "budget": budget, "bytes": rows[0]["bytes"], "policy": policy,
                 "slots": rows[0].get("slots", budget),
                 "accuracy": _mean(rows, "correct"), "ceiling": _mean(rows, "ceiling_correct"), "by_age": {},
                 "by_family": {}, "size": size, "cap": rows[0].get("cap"), "cap_actual": rows[0].get("cap_actual"),
                 "span_positions": rows[0].get("span_positions"), "trained_positions": rows[0].get("trained_positions"),
                 **_intervals(rows)}
        for key, name in (("by_age", None), ("by_family", "family")):
            buckets: dict[str, list[dict]] = {}
            for r in rows:
                bucket = age_bin(r["age"]) if name is None else r.get("kind", r["family"])
                buckets.setdefault(bucket, []).append(r)
            for bucket, items in sorted(buckets.items(), key=lambda kv: _bin_order(kv[0])):
                accuracy, ceiling = _mean(items, "correct"), _mean(items, "ceiling_correct")
                entry[key][bucket] = {"n": len(items), "accuracy": accuracy, "ceiling": ceiling,
                                      "ratio": round(accuracy / ceiling, 4) if ceiling else None, **_intervals(items)}
        label = f"L={length} M={budget} {policy}" + (f" {size}px" if size != 112 else "")
        out[label] = entry
    return out


# A question family's cell breaks only on at least this many questions (a family asked 4 times, e.g. count_gap on a
# few streams, is within its noise of any ratio).
FAMILY_MIN_N = 20


def frontier(summary: dict, threshold: float = BREAK_RATIO) -> dict:
    """Where each policy breaks: per (size, length, policy), its accuracy over the ceiling at every cap run,
    largest cap first, for all questions and for those about events at least ``OLD_AGE`` pairs old, and the
    largest cap at which that ratio falls under ``threshold`` (``breaks_at`` / ``old_breaks_at``; None: it holds
    at every cap run), and the same per question family on cells of at least ``FAMILY_MIN_N`` questions
    (``family_breaks_at``: a policy may keep what colour and shape need and lose what ``where`` or ``count``
    need). The ceiling is the full cache on the long stream where it was run, else the short streams'. Where the
    full cache was run, ``full_vs_short`` is its accuracy over the short streams' on the same questions, and
    ``short_breaks_at`` the verdict against the short streams: a toy whose long memory fails at a length (the
    shipped one's full cache reads 10,000-pair world streams at 59 % of short) makes a low ceiling, against
    which every policy "holds"; ``full_past_trained`` says whether the full cache's video spans more temporal
    positions (``full_span_positions``: the stream's pairs times their spacing) than the model's
    ``max_position_embeddings`` (``trained_positions``); a capped cache is re-based to span at most its slots
    times that spacing."""
    groups: dict[tuple, list[dict]] = {}
    for entry in summary.values():
        groups.setdefault((entry.get("size", 112), entry["length"], entry["policy"]), []).append(entry)
    out = {}
    for (size, length, policy), entries in sorted(groups.items(), key=lambda kv: kv[0]):
        caps = []
        for entry in sorted(entries, key=lambda e: -e["budget"]):
            old = [v for k, v in entry["by_age"].items() if k != "none" and int(k.split("-")[0].rstrip("+")) >= OLD_AGE]
            caps.append({"budget": entry["budget"], "cap": entry.get("cap_actual"),
                         "ratio": _ratio(entry["accuracy"], entry.get("ceiling_full"), entry["ceiling"]),
                         "short_ratio": _ratio(entry["accuracy"], None, entry["ceiling"]),
                         "vs_full": entry.get("vs_full"),
                         "old_n": sum(v["n"] for v in old), "old_ratio": _old_ratio(old),
                         "by_family": {f: {"n": v["n"], "ratio": _ratio(v["accuracy"], v.get("ceiling_full"),
                                                                        v["ceiling"])}
                                       for f, v in entry.get("by_family", {}).items()}})
        label = f"L={length} {policy}" + (f" {size}px" if size != 112 else "")
        full, short = entries[0].get("ceiling_full"), entries[0].get("ceiling_where_full")
        full_vs_short = round(full / short, 4) if full is not None and short else None
        span, trained = entries[0].get("span_positions"), entries[0].get("trained_positions")
        out[label] = {"size": size, "length": length, "policy": policy, "threshold": threshold, "caps": caps,
                      "full_vs_short": full_vs_short,
                      "full_span_positions": span if full is not None else None,
                      "full_past_trained": (span > trained) if full is not None and span and trained else None,
                      "trained_positions": trained,
                      "short_breaks_at": next((c["cap"] for c in caps
                                               if c["short_ratio"] is not None and c["short_ratio"] < threshold),
                                              None),
                      "breaks_at": next((c["cap"] for c in caps if c["ratio"] is not None and c["ratio"] < threshold),
                                        None),
                      "old_breaks_at": next((c["cap"] for c in caps
                                             if c["old_ratio"] is not None and c["old_ratio"] < threshold), None),
                      "family_breaks_at": {f: next((c["cap"] for c in caps
                                                    if c["by_family"].get(f, {}).get("n", 0) >= FAMILY_MIN_N
                                                    and (r := c["by_family"][f]["ratio"]) is not None
                                                    and r < threshold), None)
                                           for f in sorted({f for c in caps for f in c["by_family"]})}}
    return out


def _ratio(accuracy: float, full: float | None, short: float) -> float | None:
    ceiling = full if full is not None else short
    return round(accuracy / ceiling, 4) if ceiling else None


def _old_ratio(bins: list[dict]) -> float | None:
    n = sum(v["n"] for v in bins)
    if not n:
        return None
    accuracy = sum(v["accuracy"] * v["n"] for v in bins) / n
    if all(v.get("ceiling_full") is not None for v in bins):
        full_n = sum(v["ceiling_full_n"] for v in bins)
        return _ratio(accuracy, sum(v["ceiling_full"] * v["ceiling_full_n"] for v in bins) / full_n, 0.0)
    return _ratio(accuracy, None, sum(v["ceiling"] * v["n"] for v in bins) / n)


def _intervals(rows: list[dict]) -> dict:
    """95 % Wilson intervals of the accuracy and of both ceilings (the full cache on the long stream only
    over the questions it was run for)."""
    correct = sum(bool(r["correct"]) for r in rows)
    ceiling = sum(bool(r["ceiling_correct"]) for r in rows)
    full = [r["ceiling_full"] for r in rows if r.get("ceiling_full") is not None]
    out = {"ci95": proportion(correct, len(rows))["ci95"], "ceiling_ci95": proportion(ceiling, len(rows))["ci95"]}
    if full:
        stats = proportion(sum(full), len(full))
        out.update(ceiling_full=stats["accuracy"], ceiling_full_n=len(full), ceiling_full_ci95=stats["ci95"])
        accuracy = sum(bool(r["correct"]) for r in rows if r.get("ceiling_full") is not None) / len(full)
        out["ratio_full"] = round(accuracy / stats["accuracy"], 4) if stats["accuracy"] else None
        # paired on the same questions: right only with this cache / only with the full one, and McNemar's exact p
        only_cap = sum(1 for r in rows if r.get("ceiling_full") is not None and r["correct"] and not r["ceiling_full"])
        only_full = sum(1 for r in rows if r.get("ceiling_full") is not None and r["ceiling_full"] and not r["correct"])
        out["vs_full"] = {"only_cap": only_cap, "only_full": only_full,
                          "p_mcnemar": round(mcnemar_exact(only_cap, only_full), 4)}
        out["ceiling_where_full"] = round(sum(bool(r["ceiling_correct"]) for r in rows
                                              if r.get("ceiling_full") is not None) / len(full), 4)
    oracle = [r["ceiling_oracle"] for r in rows if r.get("ceiling_oracle") is not None]
    if oracle:
        stats = proportion(sum(oracle), len(oracle))
        out.update(ceiling_oracle=stats["accuracy"], ceiling_oracle_n=len(oracle), ceiling_oracle_ci95=stats["ci95"])
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
    """One row per (frame size, stream length): accuracy against the cap per policy (all questions, with
    95 % intervals; the full cache on the long stream and the short-stream ceiling as lines), the same for
    the questions about events older than a quarter of the stream, and accuracy by event age at the
    smallest cap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = result["records"]
    rows = sorted({(r.get("size", 112), r["length"]) for r in records})
    if not rows:  # every run skipped (the log says why for each): a figure that says so, not a crash after the run
        fig, ax = plt.subplots(figsize=(6, 1.5))
        ax.axis("off")
        ax.text(0.5, 0.5, "no cap ran: every policy run was skipped (the log says why)", ha="center", va="center")
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    fig, axes = plt.subplots(len(rows), 3, figsize=(18, 4.6 * len(rows)), squeeze=False)
    kinds = sorted({r["family"] for r in records}) or list(FAMILIES)
    chance = float(np.mean([CHANCE[k] for k in kinds if k in CHANCE]))
    for row, (size, length) in zip(axes, rows):
        mine = [r for r in records if r.get("size", 112) == size and r["length"] == length]
        per_pair = tokens_per_pair(size)
        policies = sorted({r["policy"] for r in mine})
        for ax, title, keep in ((row[0], "all questions", lambda r: True),
                                (row[1], f"events older than {length // 4} pairs",
                                 lambda r, length=length: r["age"] is not None and r["age"] >= length // 4)):
            chosen = [r for r in mine if keep(r)]
            for policy in policies:
                points = []
                for budget in sorted({r["budget"] for r in chosen if r["policy"] == policy}):
                    cell = [r for r in chosen if r["policy"] == policy and r["budget"] == budget]
                    stats = proportion(sum(r["correct"] for r in cell), len(cell))
                    points.append((budget / (length * per_pair), stats["accuracy"], *stats["ci95"]))
                if points:
                    xs, ys, lows, highs = (np.array(v) for v in zip(*points))
                    ax.errorbar(xs, ys, yerr=[ys - lows, highs - ys], marker="o", capsize=3, label=policy)
            _ceiling_lines(ax, chosen)
            ax.axhline(chance, color="grey", lw=0.8, ls=":", label="chance (mean of families)")
            ax.set_xscale("log", base=2)
            ticks = sorted({r["budget"] / (length * per_pair) for r in chosen})
            ax.set_xticks(ticks, [share_label(t) for t in ticks], rotation=30)
            ax.set_xlabel("cap M as a share of the stream's video tokens")
            ax.set_ylabel("accuracy")
            ax.set_ylim(0, 1.05)
            ax.set_title(f"{size}x{size}, {length} frame pairs: {title} (n per point {len(chosen) // max(1, len(policies) * len({r['budget'] for r in chosen}))})",
                         fontsize=9)
            ax.legend(fontsize=7)
        ax = row[2]
        smallest = min(r["budget"] for r in mine)
        at = [r for r in mine if r["budget"] == smallest and r["age"] is not None]
        bins = sorted({age_bin(r["age"]) for r in at}, key=_bin_order)
        for policy in policies:
            ys = []
            for b in bins:
                cell = [r for r in at if r["policy"] == policy and age_bin(r["age"]) == b]
                ys.append(np.mean([r["correct"] for r in cell]) if cell else np.nan)
            ax.plot(range(len(bins)), ys, marker="o", label=policy)
        ceiling = [np.mean([r["ceiling_correct"] for r in at if age_bin(r["age"]) == b]) for b in bins]
        ax.plot(range(len(bins)), ceiling, "k--", label="ceiling (short stream)")
        ax.axhline(chance, color="grey", lw=0.8, ls=":")
        ax.set_xticks(list(range(len(bins))), bins, rotation=30)
        ax.set_xlabel("event age at the question (frame pairs)")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"by age at the smallest cap (M = {smallest} tokens, {share_label(smallest / (length * per_pair))})",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ceiling_lines(ax, records: list[dict]) -> None:
    if not records:
        return
    full = [r["ceiling_full"] for r in records if r.get("ceiling_full") is not None]
    if full:
        ax.axhline(float(np.mean(full)), color="black", ls="--", lw=1.2, label="full cache, same long stream")
    oracle = [r["ceiling_oracle"] for r in records if r.get("ceiling_oracle") is not None]
    if oracle:
        ax.axhline(float(np.mean(oracle)), color="black", ls=":", lw=1.2, label="full cache cut to the needle pairs")
    ax.axhline(float(np.mean([r["ceiling_correct"] for r in records])), color="dimgrey", ls="-.", lw=1,
               label="full cache, short stream")


def share_label(share: float) -> str:
    """A cap's share of the stream as written on the command line: ``1/64`` (``0.50`` at or above 1)."""
    return f"1/{1 / share:.0f}" if share < 1 else f"{share:.2f}"


def save(result: dict, json_path: str | Path | None, png_path: str | Path | None) -> None:
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1))
    if png_path:
        Path(png_path).parent.mkdir(parents=True, exist_ok=True)
        plot(result, png_path)
