"""Spoken commands the wearer gives instead of a question (issue 31): "forget the last five minutes", "pause",
"resume". Matched on the transcription (faster-whisper writes numbers as words or digits, with punctuation);
anything else is a question."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"second": 1.0, "sec": 1.0, "minute": 60.0, "min": 60.0, "hour": 3600.0}
_WORDS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
          "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20, "thirty": 30,
          "forty": 40, "forty-five": 45, "fifty": 50, "sixty": 60, "ninety": 90}
_FORGET = re.compile(r"^(?:please\s+)?(?:forget|delete|erase)\s+(?:the\s+)?(?:last|past)\s+"
                     r"(?P<count>\d+(?:\.\d+)?|[a-z-]+)?\s*(?P<unit>seconds?|secs?|minutes?|mins?|hours?)$")
_PAUSE = re.compile(r"^(?:please\s+)?(?:pause|stop (?:watching|looking|recording)|privacy(?: mode)?(?: on)?)$")
_RESUME = re.compile(r"^(?:please\s+)?(?:resume|start (?:watching|looking|recording)(?: again)?|privacy(?: mode)? off)$")


@dataclass(frozen=True)
class Command:
    action: str                 # "forget" | "pause" | "resume"
    last_s: float | None = None  # forget: the last so many seconds


def parse(text: str) -> Command | None:
    """The command ``text`` says, or None when it is a question."""
    words = re.sub(r"[^a-z0-9.\- ]+", " ", text.lower()).replace(" - ", " ").strip(" .")
    words = re.sub(r"\s+", " ", words)
    if _PAUSE.match(words):
        return Command("pause")
    if _RESUME.match(words):
        return Command("resume")
    found = _FORGET.match(words)
    if found is None:
        return None
    count = found["count"]
    if count is None:  # "forget the last minute"
        amount = 1.0
    elif count[0].isdigit():
        amount = float(count)
    elif count in _WORDS:
        amount = float(_WORDS[count])
    else:
        return None
    unit = next(value for name, value in _UNITS.items() if found["unit"].startswith(name))
    return Command("forget", last_s=amount * unit) if amount > 0 else None


def run(daemon, command: Command) -> str:
    """Carry ``command`` out on the daemon — on every camera where it watches several; returns what to say
    back."""
    from edgekv.apps.controls import forget_every, pause_every, resume_every

    if command.action == "forget":
        result = forget_every(daemon, last_s=command.last_s)
        archived = result["archive"]["pairs"] if result.get("archive") else 0
        return (f"Forgotten: the last {command.last_s:g} seconds, {result['pairs']} moments in memory"
                + (f" and {archived} archived" if archived else "") + ".")
    if command.action == "pause":
        return "Paused: I am not watching." if pause_every(daemon, "privacy switch (voice)") else "Already paused."
    return "Watching again." if resume_every(daemon) else "I was not paused."
