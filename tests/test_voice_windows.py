"""Spoken forgets by the clock (apps/voice/commands.py): "forget from half past two to three", "forget everything
since noon" went to the model as questions — the wearer heard an answer and nothing was forgotten. They are read
onto the window the CLI and the API use (``window_bounds(forget=True)``: swapped, skipped or doubled times refused
the same way), a 12-hour time as the latest such moment not after now, said back; and an utterance that starts like
a forget but is not understood is answered, never asked."""

from __future__ import annotations

import datetime as dt
import threading
import time

import numpy as np
import pytest

from edgekv.apps.voice.commands import UNDERSTOOD, ClockTime, Command, WindowRefused, clock_window, parse, run


@pytest.fixture
def berlin(monkeypatch):
    """Europe/Berlin is this process's local zone for the test; the machine's is back after it."""
    monkeypatch.setenv("TZ", "Europe/Berlin")
    time.tzset()
    try:
        yield
    finally:
        monkeypatch.undo()
        time.tzset()


def _at(text: str, fold: int = 0) -> float:
    """``text`` (naive ISO 8601) as the local clock showed it."""
    return dt.datetime.fromisoformat(text).replace(fold=fold).timestamp()


def _bounds(command: Command) -> tuple:
    def one(clock: ClockTime | None):
        return None if clock is None else (clock.hour, clock.minute, clock.twelve_hour)

    return one(command.t_from), one(command.t_to)


@pytest.mark.parametrize("text, t_from, t_to", [
    ("Forget from half past two to three.", (2, 30, True), (3, 0, True)),
    ("Forget everything between 14:00 and 14:30.", (14, 0, False), (14, 30, False)),
    ("Forget what you saw since noon.", (12, 0, False), None),
    ("Forget from ten past nine until now.", (9, 10, True), None),
    ("Delete from 2:30 pm to 3 pm.", (14, 30, False), (15, 0, False)),
    ("Erase everything since 2:30 p.m.", (14, 30, False), None),
    ("Forget from quarter to ten to half past ten.", (9, 45, True), (10, 30, True)),
    ("Wipe everything since midnight.", (0, 0, False), None),
    ("Forget from 11 pm to midnight.", (23, 0, False), (0, 0, False)),
    ("Forget 14:00 to 14:10, please.", (14, 0, False), (14, 10, False)),
    ("Forget since nine thirty.", (9, 30, True), None),
    ("Forget from nine oh five till nine thirty.", (9, 5, True), (9, 30, True)),
    ("Forget from three o'clock on.", (3, 0, True), None),
    ("Forget since twenty-five past eleven in the morning.", (11, 25, False), None),
    ("Forget from 12:15 to 12:45.", (0, 15, True), (0, 45, True)),
    ("Forget from 09:30 to 10:00.", (9, 30, False), (10, 0, True)),  # a leading zero: 24-hour; 10:00 may be pm
    ("Forget from ten to three.", (10, 0, True), (3, 0, True)),  # two bounds, not "since 2:50"
    ("Forget since ten to three.", (2, 50, True), None),
])
def test_a_forget_by_the_clock_is_a_command(text, t_from, t_to):
    command = parse(text)
    assert command is not None and command.action == "forget" and command.understood, text
    assert command.last_s is None and _bounds(command) == (t_from, t_to)


@pytest.mark.parametrize("text, last_s", [
    ("Delete the last quarter of an hour.", 900.0), ("Forget the last three quarters of an hour.", 2700.0),
    ("Forget the last a quarter of an hour.", 900.0), ("FORGET THE LAST FİVE MİNUTES", 300.0),
    ("Wipe the last 10 minutes.", 600.0), ("Forget everything in the last two minutes.", 120.0),
])
def test_more_spoken_spans_of_time_are_understood(text, last_s):
    """"A quarter of an hour"; a Turkish capital İ in the transcript ("FİVE".lower() is "fi̇ve", a combining dot
    that split the word); "wipe"; "everything in the last ...". Each went to the model as a question."""
    command = parse(text)
    assert command is not None and command.understood and command.last_s == last_s, text


@pytest.mark.parametrize("text", [
    "Forget it.", "Forget the last few minutes.", "Delete everything from yesterday.", "Erase.",
    "Forget from half past two.5 to never.", "Forget between noon.", "Wipe from 25:00 to 26:00.",
    "Forget since 14:75.", "Please forget what I said about the keys.",
])
def test_a_forget_not_understood_is_answered_not_asked(text):
    command = parse(text)
    assert command == Command("forget", understood=False), text

    class NoForget:
        def forget(self, *args, **kwargs):
            raise AssertionError("nothing is forgotten for a forget not understood")

    reply = run(NoForget(), command)
    assert reply == UNDERSTOOD and reply.startswith("Nothing was forgotten")
    assert "forget the last five minutes" in reply and "forget from half past two to three" in reply


@pytest.mark.parametrize("text", ["Did I forget the last key?", "What did I forget on the table?",
                                  "Forgetful people lose keys, where are mine?", "What happened since noon?"])
def test_questions_that_mention_forgetting_or_times_stay_questions(text):
    assert parse(text) is None


@pytest.mark.parametrize("text, now, start, end, taken", [
    ("Forget from half past two to three.", "2026-06-10T14:45:00", "2026-06-10T14:30:00", "2026-06-10T15:00:00",
     ["half past two as 2:30 pm", "three as 3 pm"]),
    ("Forget from half past two to three.", "2026-06-10T09:00:00", "2026-06-10T02:30:00", "2026-06-10T03:00:00",
     ["half past two as 2:30 am", "three as 3 am"]),
    ("Forget from half past two to three.", "2026-06-10T01:00:00", "2026-06-09T14:30:00", "2026-06-09T15:00:00",
     ["half past two as 2:30 pm", "three as 3 pm"]),  # 2:30 am still to come: yesterday's 2:30 pm
    ("Forget what you saw since noon.", "2026-06-10T14:45:00", "2026-06-10T12:00:00", "2026-06-10T14:45:00", []),
    # today's midnight, 15 h back: once refused as "00:00 today is still to come" (the 12 h bound is for yesterday's)
    ("Forget everything since midnight.", "2026-06-10T15:20:00", "2026-06-10T00:00:00", "2026-06-10T15:20:00", []),
    ("Forget from ten past nine until now.", "2026-06-10T14:45:00", "2026-06-10T09:10:00", "2026-06-10T14:45:00",
     ["ten past nine as 9:10 am"]),
    ("Forget from 11 to 1.", "2026-06-10T14:45:00", "2026-06-10T11:00:00", "2026-06-10T13:00:00",
     ["11 as 11 am", "1 as 1 pm"]),
    ("Forget from two to 14:30.", "2026-06-10T23:00:00", "2026-06-10T14:00:00", "2026-06-10T14:30:00",
     ["two as 2 pm"]),  # a from said in 12 hours before a 24-hour to: the latest not after it
    ("Forget between 23:50 and 00:10.", "2026-06-10T00:15:00", "2026-06-09T23:50:00", "2026-06-10T00:10:00", []),
])
def test_a_spoken_window_is_read_as_the_cli_reads_it(berlin, text, now, start, end, taken):
    window = clock_window(parse(text), _at(now))
    assert (window.start, window.end, window.taken) == (_at(start), _at(end), taken)


@pytest.mark.parametrize("text, now, why", [
    ("Forget from 14:30 to 14:00.", "2026-06-10T14:45:00", "runs 23.5 hours"),  # swapped: window_bounds refuses
    ("Forget between nine thirty and nine oh five.", "2026-06-10T14:45:00",
     "from 9:30 am to 9:05 pm is 11.6 hours: not forgotten (did you mean from nine oh five to nine thirty?)"),
    ("Forget since 15:00.", "2026-06-10T14:45:00", "15:00 today is still to come"),
    ("Forget from half past two to three.", "2026-10-25T03:30:00", "showed 2026-10-25 02:30 twice"),
    ("Forget since 2:30.", "2026-03-29T04:00:00", "the clocks here skipped 02:30 on 2026-03-29"),
])
def test_a_spoken_window_the_clock_refuses_forgets_nothing_and_says_why(berlin, text, now, why):
    with pytest.raises(WindowRefused, match=None) as refused:
        clock_window(parse(text), _at(now))
    assert why in str(refused.value)

    class NoForget:
        def forget(self, *args, **kwargs):
            raise AssertionError("a refused window forgets nothing")

    reply = run(NoForget(), parse(text), now=_at(now))
    assert reply.startswith("Nothing was forgotten: ") and why in reply


class _Daemon:
    """A stand-in for the camera daemon: records the windows forgotten."""

    def __init__(self) -> None:
        self.forgot: list[tuple] = []

    def forget(self, t_from=None, t_to=None, last_s=None, unix=None) -> dict:
        self.forgot.append(unix)
        return {"pairs": 3, "cache_slots": 48, "archive": {"pairs": 2, "bytes": 10}}


def test_the_reply_says_the_window_and_which_twelve_hour_time_was_taken(berlin):
    daemon = _Daemon()
    reply = run(daemon, parse("Forget from half past two to three."), now=_at("2026-06-10T14:45:00"))
    assert daemon.forgot == [(_at("2026-06-10T14:30:00"), _at("2026-06-10T15:00:00"))]
    assert reply == ("Forgotten: from 14:30 to 15:00 (I took half past two as 2:30 pm and three as 3 pm), 3 moments in "
                     "memory and 2 archived.")
    reply = run(daemon, parse("Forget everything since 23:00."), now=_at("2026-06-10T01:00:00"))
    assert daemon.forgot[-1] == (_at("2026-06-09T23:00:00"), _at("2026-06-10T01:00:00"))
    assert reply == "Forgotten: from 23:00 yesterday to now, 3 moments in memory and 2 archived."


def _config(model_dir):
    from edgekv.config import EdgeKVConfig

    return EdgeKVConfig().with_overrides(
        model={"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=48", "fps": 8.0, "resolution": [56, 56]},
        cache={"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64}, server={"port": 0},
        monitor={"backend": "cpu"}, generation={"max_new_tokens": 2, "temperature": 0.0})


def test_a_running_daemon_forgets_by_the_spoken_clock(berlin, tiny_checkpoint, tmp_path):
    """A paced camera whose frames are stamped from 08:00:30 (a fixed wall clock): a forget not understood is
    answered and forgets nothing (from the microphone and from ``--voice-wav``), a swapped window is refused, and
    "forget what you saw since 8 am" removes every moment."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.loop import Daemon
    from edgekv.apps.questions import Question
    from edgekv.apps.voice.listen import VoiceLoop
    from edgekv.config import VoiceSection

    base, started = _at("2026-06-10T08:00:30"), time.monotonic()

    class Heard:
        text = ""

        def transcribe(self, audio):
            return self.text

    heard = Heard()
    with open(tmp_path / "out.txt", "w") as out:
        daemon = Daemon(_config(tiny_checkpoint), daemon_args(realtime=True), out=out)
        daemon.wall_clock = lambda: base + (time.monotonic() - started)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        try:
            assert daemon.ready.wait(120) and daemon.stream_ended.wait(300), "the stream did not end"
            held = dict(daemon.session.pair_times)
            assert held and daemon.session.wall_time(daemon.session.clock.last_t) >= base
            loop = VoiceLoop(daemon, VoiceSection(enabled=True), source=[], transcriber=heard)
            for text in ("Forget the last few minutes.", "Forget from five past eight to eight."):
                heard.text = text
                loop._ask(np.zeros(1600, np.float32))
            assert not loop.questions and daemon.session.pair_times == held
            assert daemon._spoken_command(Question("Forget it.", source="voice"))  # --voice-wav: answered too
            assert daemon.session.pair_times == held
            heard.text = "Forget what you saw since 8 am."
            loop._ask(np.zeros(1600, np.float32))
            assert not loop.questions and not daemon.session.pair_times
        finally:
            daemon.stop.event.set()
            thread.join(60)
    said = (tmp_path / "out.txt").read_text()
    assert said.count(f"voice command: {UNDERSTOOD}") == 2
    assert ("voice command: Nothing was forgotten: from 8:05 pm to 8 am is 11.9 hours: not forgotten (did you mean "
            "from eight to five past eight?).") in said
    assert f"voice command: Forgotten: from 08:00 to now, {len(held)} moments in memory." in said
