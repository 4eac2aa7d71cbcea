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
        self._ranges: list[list[int]] | None = []  # ``seen`` as runs [first, last], kept with the memory (None: stale)

    @classmethod
    def for_source(cls, source, count: int) -> "Quiz":
        scene = getattr(source, "scene", None)
        if count < 1 or scene is None:
            raise StartupError("--quiz needs a positive count and a synthetic:events video source (the one whose "
                               f"ground truth is known); video.source is {getattr(source, 'spec', source)!r}")
        return cls(scene, count)

    def saw(self, t: float) -> None:
        """A frame stamped ``t`` (the source's clock) was ingested: the events on screen count as seen."""
        before = len(self.seen)
        self.seen.update(self.on_screen.get(self._pair(t), ()))
        if len(self.seen) != before:
            self._ranges = None

    def _pair(self, t: float) -> int:
        return int(round(t * self.scene.fps)) // 2

    def seen_ranges(self) -> list[list[int]]:
        """``seen`` as sorted runs ``[first, last]`` of event indices: what the persistent memory keeps of the quiz
        (``restore``), so a daemon restarted in the same recording grades what the model was shown before it too."""
        if self._ranges is None:
            runs: list[list[int]] = []
            for index in sorted(self.seen):
                if runs and runs[-1][1] == index - 1:
                    runs[-1][1] = index
                else:
                    runs.append([index, index])
            self._ranges = runs
        return self._ranges

    def restore(self, ranges: object, span: tuple[float, float] | None = None) -> str | None:
        """The events seen before a restart in the same recording: ``ranges`` as ``seen_ranges`` gave them; where
        the saved memory kept none (its run had no ``--quiz``), every event on screen in the source-time ``span`` it
        read (the recording's first and last frame it holds), said in the line returned (None when nothing to say)."""
        events = len(self.scene.events)
        if isinstance(ranges, list) and all(isinstance(run, list) and len(run) == 2 for run in ranges):
            for first, last in ranges:
                self.seen.update(range(max(0, int(first)), min(events, int(last) + 1)))
            self._ranges = None
            return None
        if span is None:
            return None
        for pair in range(self._pair(span[0]), self._pair(span[1]) + 1):
            self.seen.update(self.on_screen.get(pair, ()))
        self._ranges = None
        return (f"quiz: the saved memory kept no record of the events it was shown (its run had no --quiz): every "
                f"event on screen from {span[0]:g} s to {span[1]:g} s of the recording counts as seen")

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
