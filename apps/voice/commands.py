"""Spoken commands the wearer gives instead of a question (issue 31): "forget the last five minutes", "forget from
half past two to three", "forget everything since noon", "pause", "resume". Matched on the transcription
(faster-whisper writes numbers as words or digits, times as "2:30 pm" or "14:00", with punctuation); anything else
is a question — except an utterance that starts like a forget ("forget", "delete", "erase", "wipe"): one that is not
understood is answered with the forms that are and that nothing was forgotten. Asked to the model, the wearer heard
an answer and believed it forgotten.

A forget by the clock reads its window as the CLI and ``/v1/memory/forget`` do (``window_bounds`` with
``forget=True``: a swapped window, or a time the clocks skipped or showed twice, is refused the same way). A
12-hour time said without am or pm ("half past two") is the latest such moment not after now — as "14:30" is — and
the reply says which was taken; a window's other end follows it ("from half past two to three": 3 pm after 2:30 pm).
"since X" is from X to now, and refused when X is more than 12 hours back (``MAX_WRAPPED_FORGET_S``): "since
14:00" said at 13:00 would forget 23 hours for good."""

from __future__ import annotations

import datetime as dt
import re
import time
import unicodedata
from dataclasses import dataclass

_UNITS = {"second": 1.0, "sec": 1.0, "minute": 60.0, "min": 60.0, "hour": 3600.0, "hr": 3600.0}
_ONES = {"zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
         "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14, "fifteen": 15,
         "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19}
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70, "eighty": 80, "ninety": 90}
_FORGET = re.compile(r"^(?:please\s+)?(?:(?:can|could|would)\s+you\s+)?(?:please\s+)?(?:forget|delete|erase|wipe)\b"
                     r"\s*(?P<rest>.*?)(?:\s+please)?$")
_WHAT = re.compile(r"^(?:(?:everything|all|anything|what(?:ever)?\s+(?:you|i|we)\s+(?:saw|have\s+seen|recorded)"
                   r"|what\s+happened)(?:\s+(?:you|i)\s+(?:saw|recorded))?\s+)?(?P<rest>.*)$")
_LAST = re.compile(r"^(?:(?:in|from|during|over|for|of)\s+)?(?:the\s+)?(?:last|past)\s+(?P<span>.+)$")
_UNIT = re.compile(r"^(?:seconds?|secs?|minutes?|mins?|hours?|hrs?)$")
_PAUSE = re.compile(r"^(?:please\s+)?(?:pause|stop (?:watching|looking|recording)|privacy(?: mode)?(?: on)?)$")
_RESUME = re.compile(r"^(?:please\s+)?(?:resume|start (?:watching|looking|recording)(?: again)?"
                     r"|privacy(?: mode)? off)$")
UNDERSTOOD = ('Nothing was forgotten: I did not understand that. Say how long, "forget the last five minutes", or '
              'between which times, "forget from half past two to three", "forget everything since noon" or '
              '"forget between 14:00 and 14:30".')


@dataclass(frozen=True)
class ClockTime:
    """A time of day as said: ``hour`` 0-23, or 0-11 with ``twelve_hour`` (no am or pm said: ``hour`` or
    ``hour + 12``, chosen when the window is read)."""
    hour: int
    minute: int
    said: str
    twelve_hour: bool = False

    def minutes(self) -> list[int]:
        """The minutes of the day it may be, in order."""
        first = self.hour * 60 + self.minute
        return [first, first + 720] if self.twelve_hour else [first]


@dataclass(frozen=True)
class Command:
    action: str                 # "forget" | "pause" | "resume"
    last_s: float | None = None  # forget: the last so many seconds
    t_from: ClockTime | None = None  # forget by the clock: from this time of day ...
    t_to: ClockTime | None = None    # ... to this one (None: to now)
    understood: bool = True          # False: a forget whose window was not understood; nothing is forgotten


def parse(text: str) -> Command | None:
    """The command ``text`` says, or None when it is a question."""
    words = _words(text)
    if _PAUSE.match(words):
        return Command("pause")
    if _RESUME.match(words):
        return Command("resume")
    found = _FORGET.match(words)
    if found is None:
        return None
    rest = _WHAT.match(found["rest"])["rest"]
    last = _LAST.match(rest)
    seconds = _duration(last["span"]) if last else None
    if seconds:
        return Command("forget", last_s=seconds)
    window = _clock_window(rest)
    if window is not None:
        return Command("forget", t_from=window[0], t_to=window[1])
    return Command("forget", understood=False)


def _words(text: str) -> str:
    """``text`` lower-case, marks off its letters (a transcript's Turkish "İ": ``lower`` makes it "i" and a combining
    dot, which split "FİVE" in two), punctuation gone but a time's colon ("2:30") and "a.m." read as "am"."""
    text = "".join(c for c in unicodedata.normalize("NFKD", text) if not unicodedata.combining(c))
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text.replace("ı", "i").lower())  # "1,000 seconds"
    text = re.sub(r"\b([ap])\.\s?m\b\.?", r"\1m", text)  # "2:30 p.m."
    text = re.sub(r"(?<=\d)(?=[ap]m\b)", " ", text)  # "2pm"
    text = re.sub(r"(?<!\d):|:(?!\d)", " ", text)  # a colon only between digits
    words = re.sub(r"[^a-z0-9.:\- ]+", " ", text).replace(" - ", " ").strip(" .")
    return re.sub(r"\s+", " ", words)


def _duration(span: str) -> float | None:
    """Seconds of a spoken span of time, as faster-whisper writes it ("90 seconds", "one and a half minutes", "a
    minute and a half", "half an hour", "a quarter of an hour", "twenty-five minutes", "5 minutes and 30 seconds");
    None when it is not one. (Only the amounts that once matched were understood: "one and a half minutes" went to
    the model as a question and nothing was forgotten.)"""
    words = [w for w in re.sub(r"(?<=[a-z])-(?=[a-z])|(?<=\d)-(?=[a-z])", " ", span).split() if w != "of"]
    total, i = 0.0, 0
    while i < len(words):
        if words[i] in ("half", "quarter") and i + 1 < len(words):  # "half an hour", "quarter of an hour"
            amount, i = (0.5 if words[i] == "half" else 0.25), i + (2 if words[i + 1] in ("a", "an") else 1)
        else:
            amount, i = _number(words, i)
            if amount is not None and words[i:i + 1] in (["quarter"], ["quarters"]):  # "three quarters of an hour"
                amount, i = amount * 0.25, i + (2 if words[i + 1:i + 2] in (["a"], ["an"]) else 1)
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


_NOW = ("now", "right now")
_HALF_OF_DAY = [(["am"], "am"), (["pm"], "pm"), (["in", "the", "morning"], "am"), (["this", "morning"], "am"),
                (["in", "the", "afternoon"], "pm"), (["this", "afternoon"], "pm"), (["in", "the", "evening"], "pm"),
                (["this", "evening"], "pm"), (["tonight"], "pm"), (["at", "night"], "pm"), (["today"], None),
                (["o", "clock"], None), (["oclock"], None)]


def _clock_window(rest: str) -> tuple[ClockTime, ClockTime | None] | None:
    """The window of "between X and Y", "(from) X to / until / till Y" (Y may be "now"), "since X", "from X (on)":
    ``(from, to)``, ``to`` None for now; None when ``rest`` is none of them. Every place the joining word could
    split is tried ("from quarter to ten to half past ten"), and two bounds before one: "from ten to three" is
    10 to 3, not since 2:50."""
    two = re.fullmatch(r"(?P<kind>between|from) (?P<both>.+)", rest)
    kind, both = (two["kind"], two["both"]) if two else ("from", rest)
    joins = ("and",) if kind == "between" else ("to", "until", "till", "til", "through", "up to")
    for join in re.finditer(r" (?:%s) " % "|".join(joins), both):
        first, second = both[:join.start()], both[join.end():]
        start = _clock_time(first)
        end = None if second in _NOW else _clock_time(second)
        if start is not None and (end is not None or second in _NOW):
            return start, end
    one = re.fullmatch(r"(?:since|from|starting(?: from| at)?) (?P<a>.+?)(?: on| onwards?)?", rest)
    if one and one["a"] not in _NOW:
        start = _clock_time(one["a"])
        if start is not None:
            return start, None
    return None


def _clock_time(phrase: str) -> ClockTime | None:
    """A time of day as said: "14:00", "2:30 pm", "2 pm", "half past two", "quarter to ten", "ten past nine", "nine
    thirty", "nine oh five", "three o'clock", "noon", "midnight", "quarter past two in the afternoon"; None when
    ``phrase`` is none."""
    words = phrase.replace("-", " ").split()
    said = " ".join(words)
    while words and words[0] in ("at", "about", "around", "a"):
        words = words[1:]
    half_of_day = None
    for suffix, half in _HALF_OF_DAY:
        if len(words) > len(suffix) and words[-len(suffix):] == suffix:
            words, half_of_day = words[:-len(suffix)], half or half_of_day
    for join, sign in (("past", 1), ("after", 1), ("to", -1)):
        if join in words[1:-1]:
            at = words.index(join)
            minutes, hour = _minutes(words[:at]), _hour(words[at + 1:], half_of_day)
            if minutes is None or hour is None or not 0 < minutes < 60:
                return None
            total = (hour[0] * 60 + sign * minutes) % (720 if hour[1] else 1440)
            return ClockTime(total // 60, total % 60, said, hour[1])
    if len(words) == 1 and re.fullmatch(r"\d{1,2}:\d{2}", words[0]):  # "14:00", "2:30"
        hour_text, minute_text = words[0].split(":")
        hour = _hour([hour_text], half_of_day)
        return ClockTime(hour[0], int(minute_text), said, hour[1]) if hour and int(minute_text) < 60 else None
    hour = _hour(words[:1], half_of_day)
    if hour is None:
        return None
    if len(words) == 1:  # "two", "noon"
        return ClockTime(hour[0], 0, said, hour[1])
    after = words[1:]
    if after[0] in ("oh", "o") and len(after) == 2 and after[1] in _ONES and 0 < _ONES[after[1]] < 10:  # "nine oh five"
        return ClockTime(hour[0], _ONES[after[1]], said, hour[1])
    minutes = _minutes(after)
    if minutes is None or not 10 <= minutes < 60 or words[0] in ("noon", "midnight"):  # "nine thirty"
        return None
    return ClockTime(hour[0], minutes, said, hour[1])


def _hour(words: list[str], half_of_day: str | None) -> tuple[int, bool] | None:
    """The hour a clock time names and whether it is a 12-hour one (0-11, am or pm not said): one word, "noon",
    "midnight", "twelve noon", a number 0-23, or "14" of "14:00" (two digits with a leading zero are 24-hour)."""
    if words in (["noon"], ["midday"], ["twelve", "noon"], ["12", "noon"]):
        return (12, False) if half_of_day != "am" else None
    if words in (["midnight"], ["twelve", "midnight"], ["12", "midnight"]):
        return (0, False) if half_of_day != "pm" else None
    if len(words) != 1:
        return None
    word = words[0]
    hour = int(word) if re.fullmatch(r"\d{1,2}", word) else _ONES.get(word)
    if hour is None or hour > 23:
        return None
    if half_of_day is not None:
        return (hour % 12 + (12 if half_of_day == "pm" else 0), False) if 1 <= hour <= 12 else None
    if 1 <= hour <= 12 and not word.startswith("0"):
        return hour % 12, True
    return hour, False


def _minutes(words: list[str]) -> int | None:
    """The minutes of "half", "quarter", "ten", "twenty five", "10 minutes"; None when it is none."""
    if words and words[-1] in ("minute", "minutes", "mins", "min"):
        words = words[:-1]
    if words in (["half"], ["quarter"]):
        return 30 if words == ["half"] else 15
    if not words:
        return None
    amount, end = _number(words, 0)
    return int(amount) if amount is not None and end == len(words) and amount == int(amount) else None


MAX_TWELVE_HOUR_TO_S = 10 * 3600.0


class WindowRefused(ValueError):
    """A spoken window the wall clock refuses (swapped, a time the clocks skipped or showed twice, too long)."""


@dataclass(frozen=True)
class ClockWindow:
    start: float  # seconds since the epoch
    end: float
    taken: list[str]  # how each 12-hour time was read: "half past two as 2:30 pm"


def clock_window(command: Command, now: float) -> ClockWindow:
    """``command``'s window by the clock at ``now``, read by ``window_bounds(forget=True)`` as the CLI's and the
    API's; ``WindowRefused`` saying why not. Which of am / pm a 12-hour time is: the from, the latest such moment
    not after now (or not after a to said with am / pm or in 24 hours); the to, the first such moment not before
    the from — unless that is more than ``MAX_TWELVE_HOUR_TO_S`` after it: "from nine thirty to nine oh five" read
    as 9:30 am to 9:05 pm would forget 11.6 hours for a swapped quarter of an hour, so it is refused as
    ``window_bounds`` refuses "from 09:30 to 09:05"."""
    from edgekv.apps.wall_times import MAX_WRAPPED_FORGET_S, follow_local_zone, window_bounds

    follow_local_zone()
    local = time.localtime(now)
    minute_now = local.tm_hour * 60 + local.tm_min
    t_from, t_to = command.t_from, command.t_to
    if t_to is not None and t_from.twelve_hour and not t_to.twelve_hour:
        end = t_to.minutes()[0]
        start = min(t_from.minutes(), key=lambda minute: (end - minute) % 1440)
    else:
        start = min(t_from.minutes(), key=lambda minute: (minute_now - minute) % 1440)
        end = None if t_to is None else min(t_to.minutes(), key=lambda minute: (minute - start) % 1440)
    to_text = (dt.datetime.fromtimestamp(now).astimezone().isoformat() if end is None
               else f"{end // 60:02d}:{end % 60:02d}")
    try:
        _, unix_from, unix_to = window_bounds(f"{start // 60:02d}:{start % 60:02d}", to_text, now=now, forget=True)
    except ValueError as exc:
        raise WindowRefused(str(exc)) from None
    if t_to is not None and t_to.twelve_hour and unix_to - unix_from > MAX_TWELVE_HOUR_TO_S:
        raise WindowRefused(f"from {_twelve_hour(start)} to {_twelve_hour(end)} is {(unix_to - unix_from) / 3600:.1f} "
                            f"hours: not forgotten (did you mean from {t_to.said} to {t_from.said}?)")
    if end is None and start > minute_now and unix_to - unix_from > MAX_WRAPPED_FORGET_S:  # yesterday's, not today's
        raise WindowRefused(f"{_clock(start)} today is still to come, and since {_clock(start)} yesterday is "
                            f"{(unix_to - unix_from) / 3600:.1f} hours: not forgotten")
    taken = [f"{said.said} as {_twelve_hour(minute)}" for said, minute in ((t_from, start), (t_to, end))
             if said is not None and said.twelve_hour]
    return ClockWindow(unix_from, unix_to, taken)


def _clock(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


def _twelve_hour(minute: int) -> str:
    hour, part = (minute // 60) % 12 or 12, "am" if minute < 720 else "pm"
    return f"{hour}:{minute % 60:02d} {part}" if minute % 60 else f"{hour} {part}"


def _spoken(unix: float, now: float) -> str:
    """A bound as the reply says it: "14:30", "23:50 yesterday"."""
    moment, today = dt.datetime.fromtimestamp(unix), dt.datetime.fromtimestamp(now).date()
    day = {today: "", today - dt.timedelta(days=1): " yesterday", today + dt.timedelta(days=1): " tomorrow"}
    return f"{moment:%H:%M}" + day.get(moment.date(), f" on {moment:%Y-%m-%d}")


def run(daemon, command: Command, now: float | None = None) -> str:
    """Carry ``command`` out on the daemon — on every camera where it watches several; returns what to say
    back. ``now``: the wall time a window by the clock is read at (default: the daemon's wall clock)."""
    from edgekv.apps.controls import forget_every, pause_every, resume_every

    if command.action == "forget":
        if not command.understood:
            return UNDERSTOOD
        if command.t_from is not None:
            now = getattr(daemon, "wall_clock", time.time)() if now is None else now
            try:
                window = clock_window(command, now)
            except WindowRefused as exc:
                return f"Nothing was forgotten: {exc}."
            result = forget_every(daemon, unix=(window.start, window.end))
            to = "now" if command.t_to is None else _spoken(window.end, now)
            what = f"from {_spoken(window.start, now)} to {to}" + (
                f" (I took {' and '.join(window.taken)})" if window.taken else "")
        else:
            result = forget_every(daemon, last_s=command.last_s)
            what = f"the last {command.last_s:g} seconds"
        archived = result["archive"]["pairs"] if result.get("archive") else 0
        return (f"Forgotten: {what}, {result['pairs']} moments in memory"
                + (f" and {archived} archived" if archived else "") + ".")
    if command.action == "pause":
        return "Paused: I am not watching." if pause_every(daemon, "privacy switch (voice)") else "Already paused."
    return "Watching again." if resume_every(daemon) else "I was not paused."
