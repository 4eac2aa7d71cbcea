"""Spoken answers (``voice.speak``): the answer's text, sentence by sentence as its tokens stream, through a
text-to-speech engine that runs on the device, to the default audio device or a WAV file.

    answer tokens ──► TokenSpeech (whole characters, then whole sentences) ──► Speaker (a thread, a queue)
                      ──► engine: Piper (an ONNX voice the user gives as voice.speak.piper_model; nothing is
                          downloaded) or espeak-ng (Debian's command: the fallback that always works)
                      ──► output: the default audio device (sounddevice) or --speak-wav OUT.wav

The first sentence plays while the rest of the answer is still being decoded. The wearer speaking again stops
playback and drops what was queued (barge-in: the listening loop's VAD calls ``Speaker.interrupt`` at the
start of an utterance). Each question's time to first audio — from the question being handed to the daemon to
its first sound leaving for the output — is kept (``Speaker.first_audio_s``).

What was run where: espeak-ng to a WAV file, and the WAV transcribed back by faster-whisper, on the x86-64 dev
VM and in CI (tests/test_speak.py). The Piper engine is written against piper-tts 1.x's ``PiperVoice`` API and
runs only where a voice model is given (no voice model can be downloaded here: its test runs when
``EDGEKV_PIPER_VOICE`` names one); the sounddevice output was not run (no audio device).
"""

from __future__ import annotations

import io
import logging
import queue
import re
import shutil
import subprocess
import threading
import time
import wave
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger("edgekv.speak")
SENTENCE_END = re.compile(r"[.!?;:](?=\s)|\n")


# ---------------------------------------------------------------------------------------------- engines
class EspeakEngine:
    """espeak-ng's command: ``--stdout`` is a 16-bit mono WAV at its voice's rate (22,050 Hz)."""

    name = "espeak-ng"
    TIMEOUT_S = 60.0

    def __init__(self, voice: str = "en-us", words_per_minute: int = 160) -> None:
        self.command = shutil.which("espeak-ng")
        if self.command is None:
            raise RuntimeError("voice.speak: espeak-ng is not installed (apt-get install espeak-ng)")
        self.voice, self.wpm = voice, words_per_minute

    def synthesize(self, text: str) -> tuple[np.ndarray, int]:
        try:
            out = subprocess.run([self.command, "--stdout", "-v", self.voice, "-s", str(self.wpm), "--", text],
                                 capture_output=True, timeout=self.TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:  # its message holds the command line, so the answer: not logged
            raise RuntimeError(f"espeak-ng did not finish in {self.TIMEOUT_S:g} s") from None
        if out.returncode != 0 or not out.stdout:
            raise RuntimeError(f"espeak-ng failed ({out.returncode}): {out.stderr[:200]!r}")
        with wave.open(io.BytesIO(out.stdout)) as wav:
            rate, width = wav.getframerate(), wav.getsampwidth()
            frames = wav.readframes(wav.getnframes())
        if width != 2:
            raise RuntimeError(f"espeak-ng wrote {8 * width}-bit audio; expected 16-bit")
        return np.frombuffer(frames, np.int16).astype(np.float32) / 32768.0, rate


class PiperEngine:
    """Piper (``piper-tts``): a VITS voice exported to ONNX, run by onnxruntime on the device."""

    name = "piper"

    def __init__(self, model: str | Path) -> None:
        try:
            from piper import PiperVoice
        except ImportError as exc:
            raise RuntimeError("voice.speak.piper_model needs piper-tts (pip install piper-tts; edgekv[voice] does not "
                               "bring it), or set voice.speak.engine: espeak-ng") from exc
        path = Path(model).expanduser()
        if not path.is_file() or not Path(str(path) + ".json").is_file():
            raise RuntimeError(f"voice.speak.piper_model: {path} (and {path}.json beside it) not found")
        self.voice = PiperVoice.load(str(path))

    def synthesize(self, text: str) -> tuple[np.ndarray, int]:
        chunks, rate = [], None
        for chunk in self.voice.synthesize(text):
            chunks.append(np.asarray(chunk.audio_float_array, dtype=np.float32))
            rate = chunk.sample_rate
        if rate is None:
            return np.zeros(0, np.float32), 22050
        return np.concatenate(chunks), int(rate)


def make_engine(section) -> EspeakEngine | PiperEngine:
    """Piper where a voice model is configured and loads; espeak-ng otherwise (the reason logged)."""
    if section.engine in ("auto", "piper") and section.piper_model:
        try:
            return PiperEngine(section.piper_model)
        except RuntimeError as exc:
            if section.engine == "piper":
                raise
            log.warning("%s; speaking with espeak-ng instead", exc)
    return EspeakEngine(section.espeak_voice, section.words_per_minute)


# ---------------------------------------------------------------------------------------------- outputs
def resample(audio: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Band-limited resampling (polyphase, scipy when present; linear interpolation otherwise)."""
    if rate == target or not audio.size:
        return audio
    try:
        from math import gcd

        from scipy.signal import resample_poly

        g = gcd(rate, target)
        return resample_poly(audio, target // g, rate // g).astype(np.float32)
    except ImportError:
        positions = np.arange(0, len(audio) * target / rate) * rate / target
        return np.interp(positions, np.arange(len(audio)), audio).astype(np.float32)


class WavOutput:
    """Everything spoken, one after another, in one 16-bit mono WAV (``--speak-wav``): for tests and headless
    runs. A barge-in truncates nothing already written (a file cannot be unheard)."""

    def __init__(self, path: str | Path, rate: int = 22050) -> None:
        self.path, self.rate = Path(path), rate
        self.wav = wave.open(str(self.path), "wb")
        self.wav.setnchannels(1)
        self.wav.setsampwidth(2)
        self.wav.setframerate(rate)
        self.lock = threading.Lock()

    def play(self, audio: np.ndarray, rate: int, stop: threading.Event) -> None:
        samples = resample(audio, rate, self.rate)
        with self.lock:
            self.wav.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())
            self.wav._file.flush()  # readers (tests) see whole sentences as they are written

    def close(self) -> None:
        with self.lock:
            self.wav.close()


class DeviceOutput:
    """The default audio device (or ``voice.speak.output_device``) through sounddevice/PortAudio."""

    def __init__(self, device=None) -> None:
        try:
            import sounddevice
        except (ImportError, OSError) as exc:
            raise RuntimeError("voice.speak needs sounddevice and PortAudio (apt-get install libportaudio2) "
                               "or --speak-wav FILE") from exc
        self.sd, self.device = sounddevice, device

    def play(self, audio: np.ndarray, rate: int, stop: threading.Event) -> None:
        self.sd.play(audio, rate, device=self.device)
        duration = len(audio) / rate
        if stop.wait(duration):  # barge-in: cut the sound now
            self.sd.stop()
        else:
            self.sd.wait()

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------- speaker
class Speaker:
    """Speaks sentences in order from its own thread; ``interrupt`` stops the sound and drops what waits."""

    def __init__(self, engine, output, clock: Callable[[], float] = time.time) -> None:
        self.engine, self.output, self.clock = engine, output, clock
        self.queue: queue.Queue = queue.Queue(maxsize=64)
        self.sentences = self.interrupted = 0
        self.first_audio_s: dict[int, float] = {}  # question id -> seconds from asked to its first sound
        self._stop_sound = threading.Event()
        self._epoch = 0  # bumped by interrupt: queued sentences of an older epoch are dropped
        self._closed = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._pending = 0  # sentences queued and not yet spoken or dropped (under _lock)
        self._thread = threading.Thread(target=self._run, name="edgekv-speak", daemon=True)

    def start(self) -> "Speaker":
        self._thread.start()
        return self

    def say(self, text: str, question_id: int | None = None, asked_at: float | None = None) -> None:
        text = text.strip()
        if not text:
            return
        with self._lock:  # counted before it is queued: the thread never finds the queue empty with it pending
            try:
                self.queue.put_nowait((self._epoch, text, question_id, asked_at))
            except queue.Full:
                log.warning("speech queue full: a sentence was not spoken")
                return
            self._pending += 1
            self._idle.clear()

    def interrupt(self) -> None:
        """The wearer spoke: stop the sound now and drop every sentence waiting."""
        self._epoch += 1
        self._stop_sound.set()
        self.interrupted += 1
        while True:
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
            self._done()

    def _done(self) -> None:
        """One queued sentence spoken or dropped; idle when none is left."""
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """True once everything queued was spoken (or dropped)."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        self.wait_idle(timeout)
        self._closed.set()
        self.queue.put((None, None, None, None))
        self._thread.join(timeout)
        self.output.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            epoch, text, question_id, asked_at = self.queue.get()
            if text is None:
                return
            if epoch == self._epoch:
                try:
                    audio, rate = self.engine.synthesize(text)
                    if epoch == self._epoch:
                        self._stop_sound.clear()
                        if question_id is not None and asked_at is not None and question_id not in self.first_audio_s:
                            self.first_audio_s[question_id] = self.clock() - asked_at
                        self.output.play(audio, rate, self._stop_sound)
                        self.sentences += 1
                except Exception:  # a TTS failure must never reach the camera loop
                    # the sentence is an answer: the log holds its length, never its text (privacy.log_text)
                    log.exception("could not speak a sentence of %d characters", len(text))
            self._done()


class TokenSpeech:
    """One answer's tokens → whole sentences for the speaker, as they are decoded."""

    def __init__(self, tokenizer, speaker: Speaker, question_id: int | None = None,
                 asked_at: float | None = None, prefix: str = "") -> None:
        self.tokenizer, self.speaker = tokenizer, speaker
        self.question_id, self.asked_at = question_id, asked_at
        self.prefix = prefix  # said with the first sentence (several cameras: the camera's name)
        self.ids: list[int] = []
        self.spoken = 0  # characters of the decoded text already handed to the speaker

    def _say(self, text: str) -> None:
        if text.strip():
            self.speaker.say(self.prefix + text, self.question_id, self.asked_at)
            self.prefix = ""

    def on_token(self, token: int) -> None:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return  # half a character: wait for the rest
        end = None
        for match in SENTENCE_END.finditer(text, self.spoken):
            end = match.end()
        if end is not None:
            self._say(text[self.spoken:end])
            self.spoken = end

    def finish(self, final_text: str) -> None:
        """The answer is complete (``final_text`` is its text): speak what is left — all of it when it does not go on
        from what was spoken (the check compared ``final_text`` with itself, so another text lost its start)."""
        spoken = self.tokenizer.decode(self.ids)[:self.spoken]
        rest = final_text[len(spoken):] if final_text.startswith(spoken) else final_text
        self._say(rest)
