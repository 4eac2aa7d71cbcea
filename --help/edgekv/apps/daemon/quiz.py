"""``--quiz N``: the toy model's demo graded against the scene's ground truth."""

from __future__ import annotations

from edgekv.apps.daemon.startup import StartupError
from edgekv.apps.questions import Question, printable


class Quiz:
    """``--quiz N``: when a ``synthetic:events`` stream ends, N questions (the five families in turn) about
    the events of frame pairs the session ingested, each graded against the scene's ground truth."""

    def __init__(self, scene, count: int) -> None:
        self.scene = scene
        self.count = count
        self.seen: set[int] = set()  # indices into scene.events (bounded by the scene's event count)
        self.on_screen: dict[int, list[int]] = {}  # pair -> indices of the events shown in it (built once)
        for index, event in enumerate(scene.events):
            for pair in range(event.first_pair, event.last_pair + 1):
                self.on_screen.setdefault(pair, []).append(index)
        self.asked: dict[int, object] = {}  # question id -> QA (at most ``count``)
        self.graded: list[bool] = []

    @classmethod
    def for_source(cls, source, count: int) -> "Quiz":
        scene = getattr(source, "scene", None)
        if count < 1 or scene is None:
            raise StartupError("--quiz needs a positive count and a synthetic:events video source (the one whose "
                               f"ground truth is known); video.source is {getattr(source, 'spec', source)!r}")
        return cls(scene, count)

    def saw(self, t: float) -> None:
        """A frame stamped ``t`` (the source's clock) was ingested: the events on screen count as seen."""
        self.seen.update(self.on_screen.get(int(round(t * self.scene.fps)) // 2, ()))

    def questions(self, max_new_tokens: int) -> list[Question]:
        from edgekv.toy.quiz import make_quiz

        events = [self.scene.events[i] for i in sorted(self.seen)]
        out = []
        for qa in make_quiz(events, self.count, seed=self.scene.seed):
            question = Question(qa.question, max_new_tokens=min(max_new_tokens, 4), temperature=0.0, source="quiz")
            self.asked[question.id] = qa
            out.append(question)
        return out

    def grade(self, question: Question) -> str:
        from edgekv.toy.quiz import QuizItem, format_item

        if question.answer is None:
            self.graded.append(False)
            return f"   quiz: not answered ({printable(str(question.error))})"
        item = QuizItem(self.asked[question.id], question.answer.text)
        self.graded.append(item.correct)
        return "   " + format_item(item, self.scene.fps).split("\n", 1)[1].strip()

    def score(self) -> str:
        right = sum(self.graded)
        seen = len(self.seen)
        return (f"quiz: {right}/{len(self.graded)} correct about {seen} event{'s' if seen != 1 else ''} seen "
                f"(of {len(self.scene.events)} in the stream)")
