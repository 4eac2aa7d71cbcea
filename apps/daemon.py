"""The camera daemon's main loop (``edgekv-camera``): capture -> sampler -> session, questions in between.

Only the main loop touches the session: stdin lines, ``--ask`` questions and HTTP requests are queued
and answered between frame pairs, while the capture thread keeps reading (latest frame wins), so a
question never races an ingest and frames are dropped — counted — rather than queued behind it.
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import sys
import threading
import time
from pathlib import Path

from edgekv.apps.camera import (
    RANDOM_WEIGHTS_NOTE,
    Question,
    StopFlag,
    answer_question,
    format_pair,
    is_random_checkpoint,
)
from edgekv.cache import CacheFullError
from edgekv.config import EdgeKVConfig, load_config
from edgekv.logs import setup_logging

log = logging.getLogger("edgekv.daemon")


class Daemon:
    def __init__(self, config: EdgeKVConfig, args: argparse.Namespace, out=None) -> None:
        self.config = config
        self.args = args
        self.out = out or sys.stdout
        self.stop = StopFlag()
        self.questions: queue.Queue[Question] = queue.Queue(maxsize=config.server.queue_size)
        self.session = None
        self.sampler = None
        self.monitor = None
        self.server = None
        self.ingest_stopped: str | None = None
        self.started = time.monotonic()
        self.created = time.time()
        self.ready = threading.Event()
        self.lock = threading.RLock()  # held while the session changes; the HTTP thread reads under it
        self._latest_frame = None
        self.voice = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Daemon":
        return cls(load_config(args.config), args)

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    # ------------------------------------------------------------------ setup
    def _start(self) -> None:
        import edgekv
        from edgekv.monitor import Monitor
        from edgekv.video.capture import Sampler
        from edgekv.video.sources import parse_spec

        cfg = self.config
        model_dir = Path(cfg.model.path) if cfg.model.path else None
        if model_dir is not None and is_random_checkpoint(model_dir):
            self.say(RANDOM_WEIGHTS_NOTE.format(path=model_dir))
        runtime = edgekv.Runtime.from_config(cfg)
        self.session = runtime.session()
        stats = self.session.stats()
        self.say(f"edgekv {edgekv.__version__}: model {model_dir} ({cfg.model.dtype}, {runtime.device}), policy "
                 f"{stats['policy']}, engines {stats['vision_backend']}/{stats['llm_backend']}, cache cap {stats['cache_capacity_tokens']} tokens = "
                 f"{stats['cache_capacity_bytes'] / 2**20:.2f} MiB allocated once")
        self.monitor = Monitor(cfg.monitor)
        self.monitor.start()
        spec = parse_spec(cfg.video.source)
        deterministic = not spec.live and not getattr(self.args, "realtime", False)
        self.sampler = Sampler.open(spec, cfg.video.fps, deterministic=deterministic)
        self.say(f"source {cfg.video.source!r} ({'live' if spec.live else 'recorded'}), sampling at "
                 f"{cfg.video.fps} fps{' (every frame by timestamp)' if deterministic else ''}")
        if cfg.server.enabled and not self.args.no_server:
            from edgekv.apps.server import ApiServer

            self.server = ApiServer(self)
            self.server.start()
            self.say(f"HTTP API on http://{self.server.host}:{self.server.port} (OpenAI-compatible /v1, /metrics, /)")
        if not self.args.no_stdin and sys.stdin is not None and not sys.stdin.closed:
            threading.Thread(target=self._read_stdin, name="edgekv-stdin", daemon=True).start()
        if cfg.voice.enabled:
            from edgekv.apps.voice import VoiceLoop

            self.voice = VoiceLoop(self, cfg.voice).start()
            self.say(f"listening for spoken questions (ASR model {cfg.voice.asr_model})")
        notify_systemd("READY=1")

    def _read_stdin(self) -> None:
        try:
            for line in sys.stdin:
                text = line.strip()
                if text:
                    self.submit(Question(text, source="stdin"))
        except (OSError, ValueError):
            return

    def submit(self, question: Question, timeout: float | None = None) -> None:
        """Queue a question for the main loop (raises queue.Full when the queue stays full)."""
        self.questions.put(question, timeout=timeout)

    # ------------------------------------------------------------------ loop
    def run(self) -> int:
        setup_logging(self.config.logging)
        self.stop.install()
        try:
            try:
                self._start()
            except (ValueError, OSError) as exc:  # config, checkpoint, engines, camera: say what, not a traceback
                print(f"edgekv-camera: cannot start: {exc}", file=sys.stderr, flush=True)
                return 2
            self.ready.set()
            self._loop()
            self._finish_questions()
        finally:
            self._shutdown()
        return 0

    def _loop(self) -> None:
        max_frames = self.args.max_frames or self.config.video.max_frames
        scheduled = list(self.args.ask)
        while not self.stop:
            if max_frames is not None and self.session.counters.frames >= max_frames:
                break
            item = self.sampler.next_frame(timeout=0.2) if self.ingest_stopped is None else None
            if item is None:
                self._answer_queued()
                if self.ingest_stopped is None and self.sampler.exhausted:
                    self.ingest_stopped = "the source ended"
                if self.ingest_stopped is not None:
                    break
                continue
            frame, t = item
            self._ingest(frame, t)
            notify_systemd("WATCHDOG=1")
            self._answer_queued()
            pairs = self.session.counters.frame_pairs
            if self.args.ask_every and scheduled and pairs and pairs % self.args.ask_every == 0 \
                    and self.session.counters.frames % 2 == 0:
                for text in scheduled:
                    self._answer(Question(text))

    def latest_jpeg(self) -> bytes | None:
        frame = self._latest_frame
        if frame is None:
            return None
        import cv2

        ok, data = cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, 80])
        return data.tobytes() if ok else None

    def _ingest(self, frame, t: float) -> None:
        try:
            with self.lock:
                result = self.session.ingest(frame, t=t)
            self._latest_frame = frame
        except ValueError as exc:
            log.warning("frame skipped: %s", exc)
            return
        except CacheFullError as exc:
            self.ingest_stopped = "the cache is full"
            self.say(f"ingest stopped: {exc}")
            return
        self.monitor.count_frames(self.session.counters.frames)
        if self.server is not None:
            self.server.pair_ingested(result)
        if result.pair_index is not None and not self.args.quiet:
            self.say(format_pair(result, self.session.stats()))

    def _answer_queued(self) -> None:
        while True:
            try:
                question = self.questions.get_nowait()
            except queue.Empty:
                return
            self._answer(question)

    def _answer(self, question: Question) -> None:
        with self.lock:
            answer_question(self.session, question, self.out)
        if self.server is not None:
            self.server.question_answered(question)
        self.monitor.count_tokens(self.session.counters.answer_tokens)

    def _finish_questions(self) -> None:
        if not self.args.ask_every:
            for text in self.args.ask:
                self._answer(Question(text))
        self._answer_queued()

    # ------------------------------------------------------------------ shutdown and report
    def summary(self) -> str:
        stats = self.session.stats()
        elapsed = time.monotonic() - self.started
        snap = self.monitor.snapshot() if self.monitor else {}
        pairs = max(stats["frame_pairs"], 1)
        lines = [
            f"frames {stats['frames']} ({stats['frame_pairs']} pairs) in {elapsed:.1f} s; mean ingest "
            f"{stats['ingest_ms_total'] / pairs:.1f} ms per pair; compressions {stats['compressions']} "
            f"({stats['compression_ms_total']:.1f} ms in all)",
            f"cache {stats['cache_tokens']}/{stats['cache_capacity_tokens']} tokens, "
            f"{stats['cache_capacity_bytes'] / 2**20:.2f} MiB (fixed); positions up to {stats['position_max']}",
            f"memory: process RSS {snap.get('process_rss_mb', float('nan')):.0f} MiB "
            f"(peak {snap.get('peak_rss_mb', float('nan')):.0f} MiB)",
        ]
        if snap.get("power_w") is not None:
            lines.append(f"power {snap['power_w']:.1f} W, energy {snap['energy_j']:.1f} J, "
                         f"{snap.get('j_per_frame') or float('nan'):.2f} J/frame, "
                         f"{snap.get('j_per_token') or float('nan'):.2f} J/answer token")
        else:
            lines.append(f"power: no sensor on this machine ({snap.get('backend', 'cpu')} monitor); J/frame unknown")
        if self.sampler is not None:
            capture = self.sampler.stats()
            lines.append(f"capture: {capture.get('frames_read', 0)} read, {capture.get('frames_dropped', 0)} dropped, "
                         f"{capture.get('frames_corrupt', 0)} corrupt, {capture.get('reconnects', 0)} reconnects")
        return "\n".join(lines)

    def _shutdown(self) -> None:
        if self.stop.signal_name:
            self.say(f"{self.stop.signal_name}: finishing the current step and shutting down")
        if self.voice is not None:
            self.voice.stop()
        if self.server is not None:
            self.server.stop()
        if self.sampler is not None:
            self.sampler.close()
        if self.monitor is not None:
            self.monitor.stop()
        if self.session is not None:
            self.say(self.summary())
        notify_systemd("STOPPING=1")


def notify_systemd(state: str) -> None:
    """sd_notify without a dependency: a datagram to $NOTIFY_SOCKET (Type=notify units, watchdog)."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return
    import socket

    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(address)
            sock.sendall(state.encode())
        except OSError as exc:
            log.warning("sd_notify failed: %s", exc)
