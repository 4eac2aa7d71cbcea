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

A question is only asked when its answer is defined by the events: ``color`` needs a shape seen in
exactly one colour, ``shape`` a colour seen on exactly one shape, ``order`` two shapes that both
appeared (the answer is the one whose first appearance is earlier). Negatives of ``exists`` are hard
when possible: the shape was seen in another colour, or the colour on another shape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgekv.video.events import COLORS, SHAPES, Event

FAMILIES: tuple[str, ...] = ("color", "shape", "exists", "order", "count")
COUNT_WORDS: tuple[str, ...] = ("zero", "one", "two", "three")
TEMPLATES: dict[str, str] = {
    "color": "What color was the {shape}?",
    "shape": "Which shape was {color}?",
    "exists": "Was there a {color} {shape}?",
    "order": "Which came first, the {a} or the {b}?",
    "count": "How many times did the {shape} appear?",
}
# What a model answering at random among the family's possible answers scores.
CHANCE: dict[str, float] = {"color": 1 / len(COLORS), "shape": 1 / len(SHAPES), "exists": 0.5, "order": 0.5,
                            "count": 1 / len(COUNT_WORDS)}


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


def negative_exists(events: Sequence[Event], rng: np.random.Generator) -> QA:
    """A ``no`` question, hard when possible (shape seen in another colour, or colour on another shape)."""
    seen = {(e.color, e.shape) for e in events}
    hard = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in seen
            and (c in {e.color for e in events} or s in {e.shape for e in events})]
    pool = hard if hard and rng.random() < 0.8 else [(c, s) for c in COLORS for s in SHAPES if (c, s) not in seen]
    color, shape = pool[int(rng.integers(len(pool)))]
    return exists_question(events, color, shape)


def sample_question(events: Sequence[Event], family: str, rng: np.random.Generator) -> QA | None:
    """A random valid question of ``family`` about ``events`` (None when the family has none)."""
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
    else:
        raise ValueError(f"question family {family!r} is not one of {', '.join(FAMILIES)}")
    if not options:
        return None
    return options[int(rng.integers(len(options)))]


def questions_about(event: Event, events: Sequence[Event]) -> list[QA]:
    """Every question whose answer depends on ``event`` (the needle benchmark asks these per age):
    its shape's colour, its colour's shape, ``yes`` for its own combination, its shape's count."""
    out = [color_question(events, event.shape), shape_question(events, event.color),
           exists_question(events, event.color, event.shape), count_question(events, event.shape)]
    return [q for q in out if q is not None and event in q.about]


def answer_of(text: str) -> str:
    """The answer word in a model's reply (first word, lower case, punctuation stripped)."""
    words = text.strip().lower().replace(".", " ").replace(",", " ").split()
    return words[0] if words else ""
