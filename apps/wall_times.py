"""Wall-clock times as people write them, for a question's or a forget's window ("between 10:03 and 10:05"):
the chat API's and ``/v1/memory/forget``'s ``from`` / ``to`` given as strings, and ``edgekv ask`` / ``edgekv forget``
``--from`` / ``--to``. Numbers stay stream seconds, as before; the daemon turns a wall-clock window into stream time
with each camera's own map (``edgekv/session/wallclock.py``).

Accepted: an ISO 8601 date and time (``2026-12-04T10:03:00+01:00``, ``2026-12-04 10:03Z``; without an offset it is
the local time of the machine reading it), or a time of day ``HH:MM[:SS[.ffffff]]`` (local): the latest such
moment not after now, so at 00:10 "23:55" is a quarter of an hour ago, not tomorrow. A window's two bounds are read
together (``window_bounds``): its ``to``, a time of day, is the first such moment not before its ``from`` — so at
10:04 "10:00 to 10:30" is the half hour under way (read up to now), and at 00:05 "23:50 to 00:10" runs across
midnight — and its ``from``, a time of day, is the latest such moment not after its ``to`` when that is a date.

Local times are read by the zone's rules on the day they name: one the clocks skipped (02:30 the night they went
forward) or showed twice (01:30 the night they went back) is refused, saying so and, for the latter, giving both
readings with their UTC offsets: read silently as one of them, "forget 01:15 to 01:45" forgot the other hour's
quarter, or none of what the person meant. The zone is read afresh each time (``follow_local_zone``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import re
import time

from edgekv.apps.questions import printable
from edgekv.seconds import real_seconds

_TIME_OF_DAY = re.compile(r"^\d{1,2}:\d{2}(:\d{2}(\.\d{1,6})?)?$")
MAX_TEXT = 64


def is_time_of_day(text) -> bool:
    """``text`` is written as a time of day (``10:03``), whose date the reader supplies."""
    return isinstance(text, str) and bool(_TIME_OF_DAY.match(text.strip()))


def follow_local_zone() -> None:
    """Read this machine's time zone afresh. C reads it once per process and keeps it: a daemon running while the
    wearer flew (systemd-timedated pointing /etc/localtime at the new zone) read "10:03" and printed times in the
    old zone until restarted."""
    time.tzset()


def local_readings(at: dt.datetime) -> tuple[float, ...]:
    """The moments (seconds since the epoch) at which this machine's clock showed ``at`` (naive, local): one; two,
    in order, where the clocks were set back over it; none where they skipped it."""
    first, second = at.replace(fold=0).timestamp(), at.replace(fold=1).timestamp()
    if first == second:
        return (first,)
    return (first, second) if first < second else ()  # in a gap fold=0 reads it by the offset before: later


def _skipped(text: str, at: dt.datetime) -> ValueError:
    forward = at.replace(fold=0).timestamp() - at.replace(fold=1).timestamp()
    return ValueError(f"{text!r}: the clocks here skipped {at:%H:%M} on {at:%Y-%m-%d} (set forward {forward / 60:g} "
                      f"minutes), so no such time was seen: give one before or after the change")


def _twice(text: str, at: dt.datetime) -> ValueError:
    first, second = (dt.datetime.fromtimestamp(unix).astimezone().isoformat() for unix in local_readings(at))
    return ValueError(f"{text!r}: the clocks here showed {at:%Y-%m-%d %H:%M} twice (set back): say which, with its UTC "
                      f"offset: {first} (the first time) or {second} (the second)")


def _time_of_day(text: str, at: dt.datetime, now: float, after: float | None) -> float:
    """``at``, a time of day on the day of ``now`` (or ``after``), as the latest such moment not after ``now``
    (the first not before ``after``): on that day, else the day before (after). A reading the clocks skipped or
    showed twice there is refused unless its time of day is still to come (already gone) on that day."""
    step = dt.timedelta(days=1 if after is not None else -1)
    base = dt.datetime.fromtimestamp(now if after is None else after)
    for day in (at, at + step):
        readings = local_readings(day)
        fits = [unix for unix in readings if (unix <= now if after is None else unix >= after)]
        if len(fits) > 1:
            raise _twice(text, day)
        if fits:
            return fits[0]
        if not readings and (day <= base if after is None else day >= base):
            raise _skipped(text, day)
    raise ValueError(f"{text!r}: no such time of day near {base:%Y-%m-%d} on this machine's clock")


def parse_wall_time(text: str, now: float | None = None, after: float | None = None) -> float:
    """``text`` as seconds since the epoch (the module's docstring), or ``ValueError`` naming what is wrong. A time of
    day is the latest such moment not after ``now``, or with ``after`` the first such moment not before it."""
    if not isinstance(text, str) or not text.strip() or len(text) > MAX_TEXT:
        raise ValueError(f"{printable(repr(text), 40)}: expected a wall time such as 2026-12-04T10:03:00+01:00 or "
                         f"10:03")
    text = text.strip()
    now = time.time() if now is None else now
    follow_local_zone()
    if _TIME_OF_DAY.match(text):
        hour, minute, *rest = text.split(":")
        second = float(rest[0]) if rest else 0.0
        if not (int(hour) < 24 and int(minute) < 60 and second < 60):
            raise ValueError(f"{text!r}: not a time of day (HH:MM or HH:MM:SS, 24-hour)")
        at = dt.datetime.fromtimestamp(now if after is None else after).replace(
            hour=int(hour), minute=int(minute), second=int(second), microsecond=round((second % 1) * 1e6) % 1_000_000,
            fold=0)
        return _time_of_day(text, at, now, after)
    try:
        # a final Z is +00:00: Python 3.10's fromisoformat (JetPack 6's Python) refuses the letter
        moment = dt.datetime.fromisoformat(re.sub(r"[zZ]$", "+00:00", text))
    except ValueError:
        raise ValueError(f"{text!r}: not a wall time: give an ISO 8601 date and time (2026-12-04T10:03:00+01:00; "
                         f"without an offset, local time) or a time of day (10:03)") from None
    try:
        if moment.tzinfo is not None:
            return moment.timestamp()
        readings = local_readings(moment)  # a naive time is local time
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"{text!r}: out of the range this machine's clock can represent") from None
    if len(readings) != 1:
        raise _twice(text, moment) if readings else _skipped(text, moment)
    return readings[0]


def wall_or_stream(name: str, value, now: float | None = None, after: float | None = None) -> tuple[str, float]:
    """A window bound as given to the API: ``("stream", seconds)`` for a number, ``("wall", unix)`` for a string
    (``parse_wall_time``'s ``now`` and ``after``); ``ValueError`` naming the field otherwise."""
    if isinstance(value, str):
        try:
            return "wall", parse_wall_time(value, now=now, after=after)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    seconds = real_seconds(value)  # a JSON integer of 400 digits too
    if seconds is None or not math.isfinite(seconds):
        raise ValueError(f"{name}: expected stream seconds (a finite number) or a wall time (a string such as "
                         f"\"10:03\" or \"2026-12-04T10:03:00+01:00\"), got {printable(repr(value), 40)}")
    return "stream", seconds


MAX_WRAPPED_FORGET_S = 12 * 3600.0


def window_bounds(t_from, t_to, now: float | None = None, forget: bool = False) -> tuple[str, float, float]:
    """``from`` and ``to`` as one kind: ``("stream" | "wall", from, to)``; a mix, or from after to, refused. Wall
    times are read together (the module's docstring): a ``to`` given as a time of day follows ``from``.

    ``forget``: two times of day whose ``to`` comes round only the next day and more than ``MAX_WRAPPED_FORGET_S``
    after ``from`` are refused. "from 01:00 to 00:30" typed at 01:48 for "00:30 to 01:00" read as 23.5 hours and
    forgot everything since 01:00, for good; an inverted stream-seconds window is refused, and a night ("22:00 to
    06:00") or "23:50 to 00:10" still reads across midnight. Questions read any such window (nothing is lost)."""
    now = time.time() if now is None else now
    kind_from, start = wall_or_stream("from", t_from, now=now)  # checked first: a mistake in it is named first
    if is_time_of_day(t_from) and isinstance(t_to, str) and not is_time_of_day(t_to):
        _, dated = wall_or_stream("to", t_to)  # a dated to: a time-of-day from is the latest such moment before it
        _, start = wall_or_stream("from", t_from, now=min(now, dated))
    kind_to, end = wall_or_stream("to", t_to, now=now, after=start if kind_from == "wall" else None)
    if kind_from != kind_to:
        raise ValueError("from and to: give both in stream seconds (numbers) or both as wall times (strings)")
    if start > end:
        shown = (start, end) if kind_from == "stream" else (t_from, t_to)
        raise ValueError(f"from ({shown[0]}) is after to ({shown[1]})")
    if forget and is_time_of_day(t_from) and is_time_of_day(t_to) and end - start > MAX_WRAPPED_FORGET_S:
        raise ValueError(f"from {t_from.strip()} to {t_to.strip()} runs {(end - start) / 3600:.1f} hours, to "
                         f"{t_to.strip()} the next day: not forgotten (did you mean from {t_to.strip()} to "
                         f"{t_from.strip()}?); to forget that long a stretch give dates "
                         f"({dt.datetime.fromtimestamp(start).isoformat(timespec='minutes')})")
    return kind_from, start, end


class WindowError(ValueError):
    """A forget or question window that does not check; ``param`` names the key that is wrong."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def forget_request(body) -> dict:
    """A forget request's JSON (``POST /v1/memory/forget``, ROS 2's ``input_forget``): ``{"from": t0, "to": t1}``
    (stream seconds, or wall times) or ``{"last_s": seconds}``, checked; ``Daemon.forget``'s keywords (``t_from`` /
    ``t_to``, ``unix`` or ``last_s``). ``WindowError`` naming the key that is wrong."""
    if not isinstance(body, dict):
        raise WindowError("the request must be a JSON object: {\"from\": t0, \"to\": t1} (stream seconds) or "
                          "{\"last_s\": seconds}")
    unknown = sorted(set(body) - {"from", "to", "last_s"})
    if unknown:
        raise WindowError(f"unknown field(s) {[printable(str(k), 60) for k in unknown]}: expected from and to, or "
                          f"last_s", param=str(unknown[0]))
    last_s = body.get("last_s")
    if "last_s" in body:
        seconds = real_seconds(last_s)
        if seconds is None or not math.isfinite(seconds):
            raise WindowError(f"last_s: must be a finite number of seconds, got {printable(repr(last_s), 60)}",
                              param="last_s")
        if "from" in body or "to" in body:
            raise WindowError("give either from and to, or last_s, not both", param="last_s")
        if not seconds > 0:
            raise WindowError(f"last_s: must be > 0, got {printable(repr(last_s), 60)}", param="last_s")
        return {"last_s": seconds}
    if body.get("from") is None or body.get("to") is None:
        raise WindowError("from and to are required (stream seconds, or wall times such as \"10:03\" or "
                          "\"2026-12-04T10:03:00+01:00\"; from <= to), or last_s", param="from")
    try:
        kind, start, end = window_bounds(body["from"], body["to"], forget=True)
    except ValueError as exc:
        raise WindowError(str(exc), param="from" if str(exc).startswith("from") else "to") from None
    return {"t_from": start, "t_to": end} if kind == "stream" else {"unix": (start, end)}


class BoundError(ValueError, argparse.ArgumentTypeError):
    """A ``--from`` / ``--to`` that is neither stream seconds nor a wall time. An ``ArgumentTypeError`` so that argparse
    prints what is wrong: for a plain ``ValueError`` it said only "invalid cli_bound value: '25:00'"."""


def cli_bound(text: str) -> float | str:
    """A ``--from`` / ``--to`` typed at ``edgekv ask`` or ``edgekv forget``: a number is stream seconds; anything else
    a wall time, checked here and kept as typed until ``cli_window`` reads the two bounds together."""
    try:
        value = float(text)
    except ValueError:
        try:
            parse_wall_time(text)  # a mistake is said at once, naming the option
        except ValueError as exc:
            raise BoundError(str(exc)) from None
        return text.strip()
    if not math.isfinite(value):
        raise BoundError(f"{text!r}: expected stream seconds (a finite number) or a wall time")
    return value


def cli_window(t_from, t_to, forget: bool = False) -> tuple:
    """``--from`` / ``--to`` as the API takes them: stream seconds as they are; wall times read here, together
    (``window_bounds``, with its ``forget``: a time of day is this machine's local time), and sent as ISO 8601 with
    its UTC offset, so that a daemon in another time zone reads the same moments."""
    if not isinstance(t_from, str) or not isinstance(t_to, str):
        return t_from, t_to  # stream seconds, or a mix the daemon refuses by name
    _, start, end = window_bounds(t_from, t_to, forget=forget)
    return tuple(dt.datetime.fromtimestamp(unix).astimezone().isoformat() for unix in (start, end))


def wall_text(unix: float) -> str:
    """A wall time as this machine's local clock shows it, with its UTC offset where the clock showed that time twice
    (the night it was set back): "01:30:05" alone named either."""
    follow_local_zone()
    local = time.localtime(unix)
    text = time.strftime("%Y-%m-%d %H:%M:%S", local)
    try:
        twice = len(local_readings(dt.datetime(*local[:6]))) > 1
    except (ValueError, OverflowError, OSError):  # a year datetime cannot hold: "forget the last 10**9 s"
        twice = False
    return text + time.strftime("%z", local) if twice else text
