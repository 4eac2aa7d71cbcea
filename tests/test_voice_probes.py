"""The voice path as a deployment meets it. Spoken commands as faster-whisper writes them (apps/voice/commands.py):
a forget whose amount of time was not understood went to the model as a question — the wearer asked for privacy,
heard an answer, and nothing was forgotten. Spoken answers (apps/voice/speak.py) whose engine fails: the answer's
text went into the log."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from edgekv.apps.voice.commands import parse


@pytest.mark.parametrize("text, last_s", [
    ("Forget the last one and a half minutes.", 90.0), ("forget the last minute and a half", 90.0),
    ("Forget the last half an hour.", 1800.0), ("Forget the last half hour.", 1800.0),
    ("Forget the last twenty-five minutes.", 1500.0), ("Forget the last twenty five minutes.", 1500.0),
    ("Forget the last seventy seconds.", 70.0), ("Forget the last one hundred and twenty seconds.", 120.0),
    ("Forget the last 1,000 seconds.", 1000.0), ("Forget the last 5 minutes and 30 seconds.", 330.0),
    ("Forget the last hour and a half.", 5400.0), ("Forget the last two and a half hours.", 9000.0),
    ("Forget the last 5 minutes, please.", 300.0), ("Forget the last 3 hrs.", 10800.0),
    ("Forget the last 90 seconds.", 90.0), ("Forget the last ninety seconds.", 90.0),
])
def test_a_spoken_amount_of_time_is_understood(text, last_s):
    command = parse(text)
    assert command is not None and command.action == "forget", text
    assert command.last_s == last_s


@pytest.mark.parametrize("text", ["Forget the last few minutes.", "Forget the last 0 minutes.",
                                  "Forget the last minutes and", "Forget the last half."])
def test_what_is_no_amount_of_time_is_a_forget_not_understood(text):
    """Once asked to the model as a question: the wearer heard an answer and believed it forgotten. Now answered that
    nothing was forgotten (apps/voice/commands.py, UNDERSTOOD)."""
    command = parse(text)
    assert command is not None and command.action == "forget" and not command.understood and command.last_s is None


def test_a_question_about_forgetting_stays_a_question():
    assert parse("Did I forget the last key?") is None


class _Daemon:
    """A stand-in for the camera daemon: records forgets and questions."""

    def __init__(self) -> None:
        self.forgot: list[float] = []
        self.asked: list[str] = []
        self.said: list[str] = []

    def forget(self, t_from=None, t_to=None, last_s=None, unix=None) -> dict:
        self.forgot.append(last_s)
        return {"pairs": 3, "cache_slots": 48, "archive": None}

    def submit(self, question) -> None:
        self.asked.append(question.text)

    def say(self, text: str) -> None:
        self.said.append(text)


def test_a_spoken_forget_with_a_fraction_is_carried_out_not_asked():
    from edgekv.apps.voice.listen import VoiceLoop
    from edgekv.config import VoiceSection

    class Heard:
        def transcribe(self, audio):
            return "Forget the last one and a half minutes."

    daemon = _Daemon()
    loop = VoiceLoop(daemon, VoiceSection(enabled=True), source=[], transcriber=Heard())
    loop._ask(np.zeros(1600, np.float32))
    assert daemon.forgot == [90.0] and daemon.asked == []
    assert daemon.said == ["voice command: Forgotten: the last 90 seconds, 3 moments in memory."]


SECRET = "the spare key is under the blue mat"


def test_a_sentence_that_cannot_be_spoken_is_not_written_to_the_log(caplog):
    """The answer's text went into the log (``could not speak 'the spare key ...'``) on every TTS failure, where
    ``privacy.log_text`` keeps answers out of it (journald on flash, which forget cannot reach)."""
    from edgekv.apps.voice.speak import Speaker

    class Failing:
        def synthesize(self, text):
            raise RuntimeError("espeak-ng failed (1): b'no voice'")

    class Nowhere:
        def play(self, audio, rate, stop):
            raise AssertionError("nothing to play")

        def close(self):
            pass

    speaker = Speaker(Failing(), Nowhere()).start()
    try:
        with caplog.at_level(logging.INFO, "edgekv.speak"):
            speaker.say(SECRET + ".")
            assert speaker.wait_idle(30)
    finally:
        speaker.close()
    assert "could not speak a sentence of 36 characters" in caplog.text
    assert "spare key" not in caplog.text


def test_an_espeak_that_hangs_fails_without_the_answer_in_the_error(tmp_path, monkeypatch):
    """``subprocess.TimeoutExpired`` says the whole command line, the answer in it, into the speaker's log."""
    from edgekv.apps.voice.speak import EspeakEngine

    fake = tmp_path / "espeak-ng"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setattr(EspeakEngine, "TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="espeak-ng did not finish in 0.2 s") as raised:
        EspeakEngine().synthesize(SECRET)
    assert "spare key" not in str(raised.value)
