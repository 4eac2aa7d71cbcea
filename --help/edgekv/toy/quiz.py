"""A quiz about a synthetic event stream: questions from its ground truth, the model's answers beside it.

The demo (``edgekv-camera --quiz N`` on a ``synthetic:events`` source) ends by asking N questions, one
family after the other, about the events the session actually ingested (an event counts as seen when a
frame pair holding it was ingested: the answers are about what was shown to the model), and prints each
question with the model's answer, the correct answer, and the ground truth that decides it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from edgekv.toy.questions import FAMILIES, QA, answer_of, sample_question
from edgekv.video.events import Event, EventScene


@dataclass(frozen=True)
class QuizItem:
    qa: QA
    reply: str

    @property
    def predicted(self) -> str:
        return answer_of(self.reply)

    @property
    def correct(self) -> bool:
        return self.predicted == self.qa.answer


def seen_events(scene: EventScene, ingested_times: Sequence[float]) -> list[Event]:
    """The events of ``scene`` shown in at least one ingested frame (frame index = round(t * fps))."""
    frames = {int(round(t * scene.fps)) for t in ingested_times}
    return [e for e in scene.events if any(f // 2 in range(e.first_pair, e.last_pair + 1) for f in frames)]


def make_quiz(events: Sequence[Event], count: int, seed: int = 0) -> list[QA]:
    """``count`` distinct questions, the families taken in turn, each valid for ``events``."""
    rng = np.random.default_rng(seed)
    out: list[QA] = []
    asked: set[str] = set()
    for attempt in range(count * 20):
        if len(out) >= count:
            break
        qa = sample_question(events, FAMILIES[attempt % len(FAMILIES)], rng)
        if qa is not None and qa.question not in asked:
            asked.add(qa.question)
            out.append(qa)
    return out


def format_item(item: QuizItem, fps: float) -> str:
    mark = "correct" if item.correct else "WRONG"
    truth = "; ".join(e.describe(fps) for e in item.qa.about) or "no such event in the stream"
    return (f"Q: {item.qa.question}\n   model: {item.predicted or repr(item.reply)}   truth: {item.qa.answer}   "
            f"[{mark}]   ground truth: {truth}")
