"""Spoken commands the wearer gives instead of a question (issue 31): "forget the last five minutes", "pause",
"resume". Matched on the transcription (faster-whisper writes numbers as words or digits, with punctuation);
anything else is a question."""

from __future__ import annotations

import re
from dataclasses import dataclass

_UNITS = {"second": 1.0, "sec": 1.0, "minute": 60.0, "min": 60.0, "hour": 3600.0, "hr": 3600.0}
_ONES = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
         "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
         "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_FORGET = re.compile(r"^(?:please\s+)?(?:forget|delete|erase)\s+(?:the\s+)?(?:last|past)\s+"
                     r"(?P<span>.+?)(?:\s+please)?$")
_UNIT = re.compile(r"^(?:seconds?|secs?|minutes?|mins?|hours?|hrs?)$")
_PAUSE = re.compile(r"^(?:please\s+)?(?:pause|stop (?:watching|looking|recording)|privacy(?: mode)?(?: on)?)$")
_RESUME = re.compile(r"^(?:please\s+)?(?:resume|start (?:watching|looking|recording)(?: again)?|privacy(?: mode)? off)$")


@dataclass(frozen=True)
class Command:
    action: str                 # "forget" | "pause" | "resume"
    last_s: float | None = None  # forget: the last so many seconds


def parse(text: str) -> Command | None:
    """The command ``text`` says, or None when it is a question."""
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.lower())  # "1,000 seconds"
    words = re.sub(r"[^a-z0-9.\- ]+", " ", text).replace(" - ", " ").strip(" .")
    words = re.sub(r"\s+", " ", words)
    if _PAUSE.match(words):
        return Command("pause")
    if _RESUME.match(words):
        return Command("resume")
    found = _FORGET.match(words)
    if found is None:
        return None
    seconds = _duration(found["span"])
    return Command("forget", last_s=seconds) if seconds else None


def _duration(span: str) -> float | None:
    """Seconds of a spoken span of time, as faster-whisper writes it ("90 seconds", "one and a half minutes", "a
    minute and a half", "half an hour", "twenty-five minutes", "5 minutes and 30 seconds"); None when it is not
    one. (Only the amounts that once matched were understood: "one and a half minutes" went to the model as a
    question and nothing was forgotten.)"""
    words = [w for w in re.sub(r"(?<=[a-z])-(?=[a-z])|(?<=\d)-(?=[a-z])", " ", span).split() if w != "of"]
    total, i = 0.0, 0
    while i < len(words):
        if words[i] == "half" and i + 1 < len(words):  # "half an hour", "half a minute", "half hour"
            amount, i = 0.5, i + (2 if words[i + 1] in ("a", "an") else 1)
        else:
            amount, i = _number(words, i)
            if words[i:i + 3] == ["and", "a", "half"]:  # "one and a half minutes"
                amount, i = (amount or 0.0) + 0.5, i + 3
        if i >= len(words) or not _UNIT.match(words[i]):
            return None
        unit = next(value for name, value in _UNITS.items() if words[i].startswith(name))
        i += 1
        if amount is None:  # "the last minute", "the last minute and a half"
            amount = 1.0
            if words[i:i + 3] == ["and", "a", "half"]:
                amount, i = 1.5, i + 3
        total += amount * unit
        if i < len(words):
            if words[i] != "and" or i + 1 == len(words):  # "5 minutes and 30 seconds"
                return None
            i += 1
    return total if total > 0 else None


def _number(words: list[str], i: int) -> tuple[float | None, int]:
    """The number spoken at ``words[i]`` (digits, "a"/"an", or number words up to the hundreds: "one hundred and
    twenty") and the index after it; None (and ``i``) when there is none."""
    if re.fullmatch(r"\d+(?:\.\d+)?", words[i]):
        return float(words[i]), i + 1
    if words[i] in ("a", "an"):
        if words[i + 1:i + 2] != ["hundred"]:
            return 1.0, i + 1
        words = [*words[:i], "one", *words[i + 1:]]
    value, start = None, i
    while i < len(words):
        word, after = words[i], words[i + 1] if i + 1 < len(words) else ""
        if word in _ONES or word in _TENS:
            value = (value or 0) + _ONES.get(word, _TENS.get(word, 0))
        elif word == "hundred" and value is not None:
            value *= 100
        elif not (word == "and" and words[i - 1] == "hundred" and (after in _ONES or after in _TENS)):
            break
        i += 1
    return (float(value), i) if value is not None else (None, start)


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
