"""One question of a real video benchmark, as every ``eval videoqa`` reader returns it, and the reader's error.

Its own module so the offline readers (``videoqa.py``: MLVU, Video-MME) and the streaming ones
(``streaming_sets.py``: OVO-Bench, StreamingBench, RVS) share it without importing each other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LETTERS = "ABCDEFGH"
VIDEO_SUFFIXES = (".mp4", ".mkv", ".avi", ".mov", ".webm")


@dataclass(frozen=True)
class Item:
    """A question about one video.

    ``options`` are the display lines of a multiple-choice question, in order, and ``answer`` is then the
    correct letter; an open-ended question has no options and ``answer`` is the reference text.
    ``ask_at``: seconds into the video at which the question is asked while the video streams (the frames
    after it are not yet seen); ``None``: after the whole video, as offline benchmarks ask.
    """

    id: str
    video: Path
    question: str
    options: tuple[str, ...]
    answer: str
    task: str
    extra: dict = field(default_factory=dict, compare=False, hash=False)
    ask_at: float | None = None

    @property
    def open_ended(self) -> bool:
        return not self.options


class DatasetError(ValueError):
    """A dataset directory that does not have the published layout; the message names the file (and field)."""


def read_json(path: Path, expect: type = list):
    """A JSON file's value, refused with the file named when it cannot be read or is not an ``expect``."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DatasetError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(value, expect):
        raise DatasetError(f"{path}: expected a JSON {expect.__name__}, found {type(value).__name__}")
    return value
