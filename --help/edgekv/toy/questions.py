"""The five question families the toy model answers, and their answers from a scene's ground truth.

Exact texts (the toy's vocabulary is fixed, so any tool can ask):

============  ==================================================  ===================================
family        question                                            answer
============  ==================================================  ===================================
``color``     ``What color was the {shape}?``                     ``{color}``
``shape``     ``Which shape was {color}?``                        ``{shape}``
``exists``    ``Was there a {color} {shape}?``                    ``yes`` / ``no`` (half negatives)
``order``     ``Which came first, the {shape} or the {shape}?``   ``{shape}``
``count``     ``How many times did the {shape} appear?``          ``zero`` / ``one`` / ``two`` / ``three``
============  ==================================================  ===================================

Three more families (issue 27; ``EXTRA_FAMILIES``), the vocabulary still fixed:

============  ==================================================  ===================================
``where``     ``Where was the {color} {shape}?``                  ``left`` / ``right`` / ``top`` /
                                                                  ``bottom`` / ``center``
``second``    ``What color was the second {shape}?``              ``{color}`` of its second appearance
``binding``   ``Was there a {color} {shape}?``                    ``yes`` / ``no``, only where the
                                                                  colour and the shape were both seen
                                                                  and one of them with another partner
============  ==================================================  ===================================

A question is only asked when its answer is defined by the events: ``color`` needs a shape seen in
exactly one colour, ``shape`` a colour seen on exactly one shape, ``order`` two shapes that both
appeared (the answer is the one whose first appearance is earlier). Negatives of ``exists`` are hard
when possible: the shape was seen in another colour, or the colour on another shape. ``where`` needs
every appearance of the pair in one clear region of the frame (``region_of``: the centre square, or
well to one side of both diagonals); ``second`` a shape seen at least twice, its first two appearances
starting at different pairs; ``binding`` asks the ``exists`` question where it takes binding the colour
to the shape: a repeated shape in another colour, or a colour on another shape (half negatives, each
of a seen colour and a seen shape that never appeared together).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgekv.video.events import COLORS, SHAPES, Event

FAMILIES: tuple[str, ...] = ("color", "shape", "exists", "order", "count")
EXTRA_FAMILIES: tuple[str, ...] = ("where", "second", "binding")
ALL_FAMILIES: tuple[str, ...] = FAMILIES + EXTRA_FAMILIES
COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three")
WHERE_WORDS: tuple[str, ...] = ("left", "right", "top", "bottom", "center")
TEMPLATES: dict[str, str] = {
    "color": "What color was the {shape}?",
    "shape": "Which shape was {color}?",
    "exists": "Was there a {color} {shape}?",
    "order": "Which came first, the {a} or the {b}?",
    "count": "How many times did the {shape} appear?",
    "where": "Where was the {color} {shape}?",
    "second": "What color was the second {shape}?",
    "binding": "Was there a {color} {shape}?",
}
# What a model answering at random among the family's possible answers scores.
CHANCE: dict[str, float] = {"color": 1 / len(COLORS), "shape": 1 / len(SHAPES), "exists": 0.5, "order": 0.5,
                            "count": 1 / len(COUNT_WORDS), "where": 1 / len(WHERE_WORDS),
                            "second": 1 / len(COLORS), "binding": 0.5}
DEFAULT_SIZE = (112, 112)  # (width, height) of the frames the events' centres are in


@dataclass(frozen=True)
class QA:
    family: str
    question: str
    answer: str
    about: tuple[Event, ...] = ()  # the events the answer depends on (empty for a "no" / "zero")


def _shapes_of(events: Sequence[Event], color: str) -> set[str]:
    return {e.shape for e in events if e.color == color}


def _colors_of(events: Sequence[Event], shape: str) -> set[str]:
    return {e.color for e in events if e.shape == shape}


def color_question(events: Sequence[Event], shape: str) -> QA | None:
    colors = _colors_of(events, shape)
    if len(colors) != 1:
        return None
    (color,) = colors
    return QA("color", TEMPLATES["color"].format(shape=shape), color, tuple(e for e in events if e.shape == shape))


def shape_question(events: Sequence[Event], color: str) -> QA | None:
    shapes = _shapes_of(events, color)
    if len(shapes) != 1:
        return None
    (shape,) = shapes
    return QA("shape", TEMPLATES["shape"].format(color=color), shape, tuple(e for e in events if e.color == color))


def exists_question(events: Sequence[Event], color: str, shape: str) -> QA:
    about = tuple(e for e in events if e.color == color and e.shape == shape)
    return QA("exists", TEMPLATES["exists"].format(color=color, shape=shape), "yes" if about else "no", about)


def order_question(events: Sequence[Event], a: str, b: str) -> QA | None:
    if a == b:
        return None
    firsts = {s: min((e.first_pair for e in events if e.shape == s), default=None) for s in (a, b)}
    if firsts[a] is None or firsts[b] is None or firsts[a] == firsts[b]:
        return None
    answer = a if firsts[a] < firsts[b] else b
    about = tuple(e for e in events if e.shape in (a, b))
    return QA("order", TEMPLATES["order"].format(a=a, b=b), answer, about)


def count_question(events: Sequence[Event], shape: str) -> QA | None:
    about = tuple(e for e in events if e.shape == shape)
    if len(about) >= len(COUNT_WORDS):
        return None
    return QA("count", TEMPLATES["count"].format(shape=shape), COUNT_WORDS[len(about)], about)


def region_of(center: tuple[float, float], width: int, height: int) -> str | None:
    """``center`` (x, y px) as one of ``WHERE_WORDS``, or None where it is not clearly one: ``center``
    within the middle square (a quarter of each half-side), a side when well past the middle (40 % of
    the half-side) and nearer that side's axis than either diagonal by 15 % of the half-side."""
    u = (center[0] - (width - 1) / 2) / (width / 2)   # -1 left .. 1 right
    v = (center[1] - (height - 1) / 2) / (height / 2)  # -1 top .. 1 bottom
    reach = max(abs(u), abs(v))
    if reach <= 0.25:
        return "center"
    if reach < 0.4:
        return None
    if abs(u) >= abs(v) + 0.15:
        return "left" if u < 0 else "right"
    if abs(v) >= abs(u) + 0.15:
        return "top" if v < 0 else "bottom"
    return None


def where_question(events: Sequence[Event], color: str, shape: str, size: tuple[int, int] = DEFAULT_SIZE
                   ) -> QA | None:
    about = tuple(e for e in events if e.color == color and e.shape == shape)
    regions = {region_of(e.center, *size) for e in about}
    if not about or len(regions) != 1 or None in regions:
        return None
    (region,) = regions
    return QA("where", TEMPLATES["where"].format(color=color, shape=shape), region, about)


def second_question(events: Sequence[Event], shape: str) -> QA | None:
    seen = sorted((e for e in events if e.shape == shape), key=lambda e: e.first_pair)
    if len(seen) < 2 or seen[0].first_pair == seen[1].first_pair:
        return None
    return QA("second", TEMPLATES["second"].format(shape=shape), seen[1].color, tuple(seen[:2]))


def binding_options(events: Sequence[Event]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(positives, negatives) of the ``binding`` family: seen (colour, shape) pairs whose shape also came
    in another colour or whose colour also came on another shape; and unseen pairs of a seen colour and a
    seen shape."""
    seen = {(e.color, e.shape) for e in events}
    colors = {c for c, _ in seen}
    shapes = {s for _, s in seen}
    positives = sorted((c, s) for c, s in seen
                       if len({c2 for c2, s2 in seen if s2 == s}) > 1 or len({s2 for c2, s2 in seen if c2 == c}) > 1)
    negatives = sorted((c, s) for c in colors for s in shapes if (c, s) not in seen)
    return positives, negatives


def binding_question(events: Sequence[Event], color: str, shape: str) -> QA:
    qa = exists_question(events, color, shape)
    return QA("binding", qa.question, qa.answer, qa.about)


def negative_exists(events: Sequence[Event], rng: np.random.Generator) -> QA:
    """A ``no`` question, hard when possible (shape seen in another colour, or colour on another shape)."""
    seen = {(e.color, e.shape) for e in events}
    hard = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in seen
            and (c in {e.color for e in events} or s in {e.shape for e in events})]
    pool = hard if hard and rng.random() < 0.8 else [(c, s) for c in COLORS for s in SHAPES if (c, s) not in seen]
    color, shape = pool[int(rng.integers(len(pool)))]
    return exists_question(events, color, shape)


def sample_question(events: Sequence[Event], family: str, rng: np.random.Generator,
                    size: tuple[int, int] = DEFAULT_SIZE) -> QA | None:
    """A random valid question of ``family`` about ``events`` (None when the family has none);
    ``size`` (width, height) is the frame the events' centres are in (``where``)."""
    shapes_seen = sorted({e.shape for e in events})
    colors_seen = sorted({e.color for e in events})
    if family == "color":
        options = [q for s in shapes_seen if (q := color_question(events, s))]
    elif family == "shape":
        options = [q for c in colors_seen if (q := shape_question(events, c))]
    elif family == "exists":
        if events and rng.random() < 0.5:
            event = events[int(rng.integers(len(events)))]
            return exists_question(events, event.color, event.shape)
        return negative_exists(events, rng)
    elif family == "order":
        options = [q for a in shapes_seen for b in shapes_seen if (q := order_question(events, a, b))]
    elif family == "count":
        # zero is as likely as any other answer among the shapes' actual counts
        options = [q for s in SHAPES if (q := count_question(events, s))]
        if options:
            by_answer: dict[str, list[QA]] = {}
            for q in options:
                by_answer.setdefault(q.answer, []).append(q)
            answers = sorted(by_answer)
            group = by_answer[answers[int(rng.integers(len(answers)))]]
            return group[int(rng.integers(len(group)))]
    elif family == "where":
        # each answer word as likely as any other among those the stream allows
        options = [q for e in events if (q := where_question(events, e.color, e.shape, size))]
        if options:
            answers = sorted({q.answer for q in options})
            pick = answers[int(rng.integers(len(answers)))]
            options = [q for q in options if q.answer == pick]
    elif family == "second":
        options = [q for s in shapes_seen if (q := second_question(events, s))]
    elif family == "binding":
        positives, negatives = binding_options(events)
        pool = positives if positives and (not negatives or rng.random() < 0.5) else negatives
        if not pool:
            return None
        color, shape = pool[int(rng.integers(len(pool)))]
        return binding_question(events, color, shape)
    else:
        raise ValueError(f"question family {family!r} is not one of {', '.join(ALL_FAMILIES)}")
    if not options:
        return None
    return options[int(rng.integers(len(options)))]


def questions_about(event: Event, events: Sequence[Event], kinds: Sequence[str] = FAMILIES,
                    size: tuple[int, int] = DEFAULT_SIZE) -> list[QA]:
    """Every question of the families in ``kinds`` whose answer depends on ``event`` (the needle benchmark
    asks these per age): its shape's colour, its colour's shape, ``yes`` for its own combination, its
    shape's count; with the extra families, where it was, the colour of its shape's second appearance
    (when it is that one) and ``yes`` for its combination where that takes binding."""
    out = []
    if "color" in kinds:
        out.append(color_question(events, event.shape))
    if "shape" in kinds:
        out.append(shape_question(events, event.color))
    if "exists" in kinds:
        out.append(exists_question(events, event.color, event.shape))
    if "count" in kinds:
        out.append(count_question(events, event.shape))
    if "where" in kinds:
        out.append(where_question(events, event.color, event.shape, size))
    if "second" in kinds:
        qa = second_question(events, event.shape)
        out.append(qa if qa is not None and qa.about[-1] == event else None)
    if "binding" in kinds and (event.color, event.shape) in binding_options(events)[0]:
        out.append(binding_question(events, event.color, event.shape))
    return [q for q in out if q is not None and event in q.about]


def answer_of(text: str) -> str:
    """The answer word in a model's reply (first word, lower case, punctuation stripped)."""
    words = text.strip().lower().replace(".", " ").replace(",", " ").split()
    return words[0] if words else ""
