"""The camera daemon's main loop (``edgekv-camera``, ``edgekv serve``): capture -> sampler -> session,
questions in between.

Only the main loop touches the session. Questions from ``--ask``, stdin, the HTTP API and the voice loop
are queued (``Daemon.submit`` never blocks; a full queue or a stopping daemon refuse at once); the
loop takes one step at a time, an ingest or an answer, chosen by the fair-share rule of
``edgekv.apps.scheduling`` (frames first; under load answers get at most ``1 - video.min_ingest_share``
of the loop), and while it answers a collector keeps sampling the camera into a bounded backlog that
is ingested right after (no blind spot). The capture thread never waits for either.

Life cycle, in ``run()``: ``preflight()`` (config, files, the video source and the HTTP port, before the
model loads: a mistake is one line and exit 2) -> ``start()`` (model, session, capture, HTTP, voice,
systemd READY and watchdog) -> ``serve()`` (the loop) -> ``shutdown()`` (refuse what waits, stop
everything within a bound, print the summary). Persistent-state hooks: ``_on_session_ready`` (restore),
``_on_loop_tick`` (periodic snapshot), ``_on_stop`` (final snapshot).

When the stream ends (end of a file without ``video.loop``, ``--max-frames``, or a cache that cannot
evict) the daemon keeps answering questions about what it saw (``stream_state == "ended"``) until
SIGTERM; with ``--max-frames`` or ``--exit-at-end`` it answers what is queued and exits (one-shot).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING

from edgekv.apps.controls import route
from edgekv.apps.daemon.health import StallWatch, problems
from edgekv.apps.daemon.forget_passes import ForgetAsk, ForgetQueue, LoopWatch
from edgekv.apps.daemon.console import (
    RANDOM_WEIGHTS_NOTE,
    StopFlag,
    format_answer,
    format_pair,
    is_random_checkpoint,
    whole_reply,
)
from edgekv.apps.daemon.quiz import Quiz
from edgekv.apps.questions import AskerLeft, DaemonBusy, DaemonStopping, Question, printable
from edgekv.apps.daemon.scheduling import Collector, FairShare, FrameBacklog
from edgekv.apps.daemon.startup import (
    StartupError,
    bind_error,
    check_archive_shape,
    check_calibration,
    check_folders,
    check_logging_file,
    check_model_dir,
    check_server_address,
    check_server_packages,
    check_voice_packages,
    one_line,
    open_video_source,
    resolve_voice_model,
)
from edgekv.apps.daemon.systemd import Heartbeat, Watchdog, notify_systemd
from edgekv.config import EdgeKVConfig, load_config
from edgekv.durable import replace_durably
from edgekv.apps.wall_times import wall_text
from edgekv.seconds import MAX_ABS_SECONDS, real_seconds

if TYPE_CHECKING:
    from edgekv.video.capture import Sampler

log = logging.getLogger("edgekv.daemon")
STOP_BUDGET_S = 8.0  # shutdown after the current step; systemd's TimeoutStopSec is 20 s (jetson/edgekv-camera.service)
# the final snapshot reaches the disk PACE_BYTES at a time, each step extending systemd's stop timeout by this much
# (EXTEND_TIMEOUT_USEC): slow flash is waited for while it writes; a step this slow is a disk that stopped answering
# (the watchdog's own rule: WatchdogSec / 2 is 15 s in the unit)
SNAPSHOT_STEP_S = 15.0
HISTORY = 64  # finished questions kept for the status page
REACH_EVERY_S = 10.0  # how far back the memory goes (Daemon.reach), worked out at most this often


class AnswerCancelled(Exception):
    """Raised from the token callback to cut an answer short when the daemon stops."""


@dataclass
class DaemonOptions:
    """How this run behaves (command-line flags that are not deployment config)."""

    ask: list[str] = field(default_factory=list)
    ask_every: int = 0
    max_frames: int | None = None
    exit_at_end: bool = False
    realtime: bool = False
    no_server: bool = False
    no_stdin: bool = False
    quiet: bool = False
    voice_wav: str | None = None
    speak_wav: str | None = None
    quiz: int = 0

    @classmethod
    def from_namespace(cls, args: argparse.Namespace | None) -> "DaemonOptions":
        if args is None:
            return cls()
        if isinstance(args, cls):
            return args
        values = {f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None}
        return cls(**values)

    @property
    def one_shot(self) -> bool:
        """Exit by itself once the stream ended and every question was answered."""
        return self.max_frames is not None or self.exit_at_end


class Daemon:
    def __init__(self, config: EdgeKVConfig, args: argparse.Namespace | DaemonOptions | None = None, out=None,
                 prog: str = "edgekv-camera") -> None:
        self.config = config
        self.options = DaemonOptions.from_namespace(args)
        self.args = self.options
        self.out = out or sys.stdout
        self.prog = prog
        self.checking = False  # edgekv-camera --check: the start's checks only (apps/daemon/check.py)
        self.exit_code = 0  # what run() returns: 3 after a hung camera (video.exit_when_hung_s)
        self.stop = StopFlag()
        self.questions: queue.Queue[Question] = queue.Queue(maxsize=config.server.queue_size)
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.heartbeat = Heartbeat()
        self.fair = FairShare(config.video.min_ingest_share)
        self.backlog = FrameBacklog(config.video.answer_backlog_s, int(config.video.answer_backlog_mib * 2**20))
        self.stall = StallWatch(config.video.stall_s, config.video.fps)  # ingesting nothing for long: "stalled"
        self.session = None
        self.runtime = None  # set before start() to share loaded weights (several cameras: apps/daemon/cameras.py)
        self.camera: str | None = None  # this daemon's camera name among video.sources
        self.cameras: dict | None = None  # on the daemon that runs the server: every camera's daemon by name
        self.asked_through = None  # the camera daemon whose server and voice bring this one's questions
        self.sampler = None
        self.monitor = None
        self.monitor_cameras: list | None = None  # several cameras: the daemons whose frames one monitor counts
        self.monitor_is_shared = False  # several cameras: the first camera's monitor (it stops it)
        self.server = None
        self.certificate = None  # what HTTPS serves (apps/server/tls.py), for the start-up line
        self.voice = None
        self.forgotten_at: float | None = None  # wall time of the last forget: no conversation reaches across it
        self._history_lock = threading.Lock()  # the history and forgotten_at change together (forget, _finish)
        self._read_under: dict[int, float | None] = {}  # question id -> forgotten_at when its answer was read
        self.speaker = None  # Speaker: answers spoken aloud (voice.speak, --speak-wav)
        self.speaker_is_shared = False  # several cameras: the first camera's speaker (it closes it)
        self.speech_name: str | None = None  # several cameras: said before each spoken answer ("back: ...")
        self.push_to_talk = None  # PushToTalk: voice.trigger: push_to_talk
        self.power = None  # PowerPolicy: power-aware sampling (power: in the YAML)
        self._skipper_before_saving = None
        self.paused: str | None = None  # why ingest is paused (privacy switch), None while it runs
        self._paused_at: float | None = None
        self._resume_offset = 0.0  # added to a reopened source's timestamps: stream time goes on after a pause
        self._source_t: float | None = None  # the source's own time of the last frame in: a paused recording goes on
        self._source_record: dict | None = None  # edgekv.state.source_record of the source, kept with each frame in
        self._source_first_t: float | None = None  # the source's time of the first frame of it the memory holds
        self._source_read_out = False  # the recording was read to its end: kept with the memory, none read again
        self._expired_at: float | None = None  # when max_age_s was last applied to the files (_expire_kept)
        self._frames_at_start = 0  # the restored memory's frames: --max-frames / video.max_frames count this run's
        self._pause_seen = threading.Event()  # the loop saw the pause (no step in flight)
        self._loop_thread: threading.Thread | None = None
        self.ros2 = None  # questions, answers and status on ROS 2 topics (ros2.enabled; apps/outputs/ros2.py)
        self.spoken: list[str] = []  # --voice-wav: the file's questions, asked on --ask's schedule
        self.watchdog: Watchdog | None = None
        self.started = time.monotonic()
        self.created = time.time()
        self.wall_clock: Callable[[], float] = time.time  # stamps sampled frames' wall times (tests set it)
        self.ready = threading.Event()
        self.lock = threading.RLock()  # held while the session changes; the HTTP thread reads under it
        self._latest_frame = None
        self._latest_jpeg: tuple | None = None  # (frame, its JPEG): encoded once per frame
        self._source = None
        self._spec = None
        self._asr_model: str | None = None
        self._stream_end: str | None = None
        self.stream_ended = threading.Event()  # set once the source has ended (stream_state "ended" from then on)
        self._scheduled: deque[Question] = deque()  # --ask questions: never refused, answered first
        self._current: Question | None = None
        self._closed = False  # no more questions accepted (stopping)
        self._submit_lock = threading.Lock()
        self._wake = threading.Event()
        self._stdin_reader: threading.Thread | None = None
        self._ingest_s_per_frame: float | None = None  # moving average (what the machine can sustain)
        self._collector: Collector | None = None
        self.quiz: Quiz | None = None  # --quiz: ground-truth questions about a synthetic:events stream
        self.alerts = None  # AlertEngine: standing questions (alerts: in the YAML, /v1/alerts)
        self.frames = None  # FrameStore: evidence frames on disk (archive.frames_mib; apps/daemon/frame_store.py)
        self._reach: tuple[float, dict] | None = None  # (monotonic time, reach()) worked out last
        self._capacity_bytes: tuple | None = None  # (the session's cache, its bytes), for each pair's line
        self.escalator = None  # Escalator: hard questions to a bigger model (escalate: in the YAML)
        self._forget_queue = ForgetQueue()  # forgets waiting for a pass (apps/daemon/forget_passes.py)
        self._loop_watch = LoopWatch()  # the first camera's is shared by the daemons of its lock (_forgets)
        self.image_session = None  # answers questions that carry images (server.image_requests)
        self.alert_bus = None
        self.webhooks: list = []
        self.fleet = None  # FleetAgent (fleet: in the YAML): MQTT status, alerts and fleet questions
        self._fleet_password: str | None = None
        self._probes: deque = deque()  # standing questions due for an evaluation
        self._question_went_last = False  # questions and evaluations take turns (_answer_next)
        from edgekv.state import StateKeeper  # imports torch: only once a daemon is made, not for --help

        self.state = StateKeeper(config.state, say=self.say)  # persistent memory (state: in the YAML)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Daemon":
        return cls(load_config(args.config), args)

    _say_lock = threading.Lock()  # every daemon's lines in this process, each written whole

    def say(self, text: str) -> None:
        """Print a line; text the output's encoding cannot carry is escaped, never an exception. The line and its
        newline go out in one write under a lock: ``print`` wrote them apart, and a forget said from the HTTP
        thread while the main loop said SIGTERM's line printed "...older removedSIGTERM: finishing..." as one."""
        with self._say_lock:
            try:
                self.out.write(text + "\n")
            except UnicodeEncodeError:
                encoding = getattr(self.out, "encoding", None) or "ascii"
                self.out.write(text.encode(encoding, "backslashreplace").decode(encoding) + "\n")
            self.out.flush()

    # ------------------------------------------------------------------ questions in
    def submit(self, question: Question, timeout: float | None = None) -> None:
        """Queue a question for the main loop. Never blocks (``timeout`` is accepted for older callers and
        ignored); thread-safe. Raises ``DaemonBusy`` (also a ``queue.Full``) when ``server.queue_size``
        questions already wait and ``DaemonStopping`` once the daemon shuts down: both mean HTTP 503.
        The answer (or the refusal) lands in ``question.answer`` / ``question.error``, then
        ``question.done`` is set."""
        with self._submit_lock:
            if self._closed or self.stop:
                raise DaemonStopping("the daemon is shutting down")
            try:
                self.questions.put_nowait(question)
            except queue.Full:
                raise DaemonBusy(f"{self.questions.maxsize} questions are already waiting; try again shortly") from None
        self._wake.set()

    def _read_stdin(self) -> None:
        stream = sys.stdin
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(errors="replace")  # a stray byte must not end the reader
        try:
            for line in stream:
                text = line.strip()
                if not text:
                    continue
                try:
                    routed = route(self, text)  # several cameras: the one it names, or each
                except ValueError as exc:  # a camera's name and no question
                    self.say(f"stdin question refused: {exc}")
                    continue
                for _name, daemon, question in routed:
                    try:
                        daemon.submit(Question(question, source="stdin"))
                    except DaemonBusy as exc:
                        daemon.say(f"stdin question refused: {exc}")
        except (OSError, ValueError, DaemonStopping):
            return

    # ------------------------------------------------------------------ life cycle
    def run(self) -> int:
        self.stop.install()
        try:
            try:
                self.preflight()
                self.start()
            except (ValueError, OSError, RuntimeError, ImportError) as exc:  # config, files, engines, camera, port,
                # an installed package that does not import (fastapi 0.165 without opentelemetry, seen on a GPU image)
                print(f"{self.prog}: cannot start: {one_line(exc)}", file=sys.stderr, flush=True)
                return 2
            self.ready.set()
            self.serve()
        finally:
            self.shutdown()
            self.stop.uninstall()
        return self.exit_code

    def preflight(self) -> None:
        """Everything that can be checked before the model loads; raises ``StartupError`` naming the key."""
        for _key, step in self.preflight_steps():
            step()
        self._say_waiting()
        if self.options.quiz:
            self.quiz = Quiz.for_source(self._source, self.options.quiz)

    def preflight_steps(self) -> list[tuple[str, Callable[[], object]]]:
        """The start's checks in their order, each named by what it checks: ``preflight`` runs them and stops at
        the first that raises; ``edgekv-camera --check`` runs every one and says each (apps/daemon/check.py). A
        step returns what it found worth saying (or None)."""
        cfg = self.config
        steps: list[tuple[str, Callable[[], object]]] = [
            ("logging.file", self._check_logging),
            ("model.path", lambda: check_model_dir(cfg)),
            ("cache.calibration", lambda: check_calibration(cfg)),
            ("state.dir, archive.dir", lambda: check_folders(cfg)),
            ("archive.dir records", lambda: check_archive_shape(cfg)),
            ("privacy keys", self._check_keys),
            # state.dir is this daemon's alone until it stops (another's is refused, naming it)
            ("state.dir lock", self.state.hold),
        ]
        if cfg.voice.enabled or self.options.voice_wav:
            steps.append(("voice", self._check_voice))
        if self.options.voice_wav:
            steps.append(("--voice-wav", lambda: self._check_wav(self.options.voice_wav)))
        if cfg.ros2.enabled:
            from edgekv.apps.outputs.ros2 import check_ros2

            steps.append(("ros2", lambda: check_ros2(cfg.ros2)))
        if cfg.server.enabled and not self.options.no_server:
            steps += [("server packages", check_server_packages),
                      ("server.host:port", lambda: check_server_address(cfg)), ("server TLS", self._check_server_tls)]
        steps.append(("client TLS (escalate:, alerts:)", lambda: self._check_client_tls(cfg)))
        if cfg.fleet.broker is not None:
            steps.append(("fleet", self._check_fleet))
        if self.runtime is None and self.camera is None and not self.checking:  # the engines this start loads
            steps.append(("engines", self._check_engines))  # after the quick checks: it may read every engine file
        steps.append(("video.source", self._open_source))
        return steps

    def _check_keys(self) -> str | None:
        """The ``privacy:`` keys read, and each snapshot the restore would read opened with them (the manifest only),
        before the model loads: a missing, unreadable or wrong key stopped the start only after the weights had
        loaded, and ``--check`` passed it."""
        from edgekv.runtime import deployment_keys

        keys = deployment_keys(self.config)
        self.state.check_keys(keys)
        return "no key: nothing is sealed" if keys is None else f"key {keys.current.id.hex()} read"

    def _check_engines(self) -> None:
        """The engine bundles ``engines:`` names, found and checked as the start's load finds them
        (``edgekv.runtime.find_engines``: the key, the manifest, each file's size and sha256) before the weights load:
        a missing or mismatched bundle stopped the start only once the weights had loaded (minutes for the 3B on a
        Jetson), with the same message. Not here: with ``--check`` (its own engines row, apps/daemon/check.py), a
        runtime given (loaded already), a camera of several (``CameraSet`` checks the engines it loads once)."""
        from edgekv.runtime import find_engines

        find_engines(self.config)

    def _check_logging(self) -> None:
        from edgekv.logs import setup_logging

        check_logging_file(self.config)
        if not self.checking:  # a check beside the running daemon leaves its log file alone
            setup_logging(self.config.logging)

    def _check_voice(self) -> None:
        cfg = self.config
        self._asr_model = resolve_voice_model(cfg.with_overrides(voice={"enabled": True}))
        check_voice_packages(cfg, microphone=cfg.voice.enabled)

    def _check_server_tls(self):
        from edgekv.apps.server.tls import check_server_tls

        try:
            self.certificate = check_server_tls(self.config.server)
        except ValueError as exc:
            raise StartupError(str(exc)) from None
        return self.certificate.describe() if self.certificate is not None else None

    def _check_fleet(self) -> None:
        from edgekv.apps.outputs.mqtt import FleetError, preflight

        try:
            self._fleet_password = preflight(self.config.fleet)
        except FleetError as exc:
            raise StartupError(str(exc)) from None

    def _open_source(self):
        self._spec, self._source = open_video_source(self.config)
        return self._source

    def _say_waiting(self) -> None:
        """A network stream not reachable at start (``video.wait_for_stream``): said once, the daemon goes on."""
        waiting = getattr(self._source, "waiting", None)
        if waiting is not None:
            self.say(f"video.source: {one_line(waiting)}; starting anyway, connecting when it answers "
                     f"(video.reconnect_backoff_s {self.config.video.reconnect_backoff_s}; /healthz says "
                     "\"reconnecting\" until then; video.wait_for_stream: false refuses to start instead)")

    @staticmethod
    def _check_client_tls(cfg) -> None:
        """The TLS files of what the daemon reaches over HTTPS (escalate:, alerts: webhooks), read before the model
        loads: a missing or unreadable one named by its key."""
        from edgekv.apps.server.tls import client_context

        reached = [(cfg.escalate.url, cfg.escalate.ca_file, cfg.escalate.cert_file, cfg.escalate.key_file,
                    ("escalate.ca_file", "escalate.cert_file", "escalate.key_file"))]
        reached += [(url, cfg.alerts.webhook_ca_file, cfg.alerts.webhook_cert_file, cfg.alerts.webhook_key_file,
                     ("alerts.webhook_ca_file", "alerts.webhook_cert_file", "alerts.webhook_key_file"))
                    for url in cfg.alerts.webhooks]
        for url, ca, cert, key, names in reached:
            if url is not None:
                try:
                    client_context(url, ca, cert, key, names=names)
                except ValueError as exc:
                    raise StartupError(str(exc)) from None
        # an HTTPS_PROXY they cannot use (socks5://): named before the model loads
        from edgekv.apps.outputs.proxy import proxy_for

        proxied = [(cfg.escalate.url, cfg.escalate.proxy, "escalate.proxy")] if cfg.escalate.url is not None else []
        proxied += [(url, cfg.alerts.webhook_proxy, "alerts.webhook_proxy") for url in cfg.alerts.webhooks]
        for url, configured, key in proxied:
            try:
                proxy_for(url, configured, key)
            except ValueError as exc:
                raise StartupError(str(exc)) from None

    @staticmethod
    def _check_wav(path: str) -> None:
        from edgekv.apps.voice.listen import read_wav

        try:
            read_wav(path)
        except ValueError as exc:
            raise StartupError(f"--voice-wav: {one_line(exc)}") from None

    def start(self) -> None:
        import edgekv
        from edgekv.monitor import Monitor
        from edgekv.state import source_record
        from edgekv.video.capture import Backoff, CaptureThread, Sampler
        from edgekv.video.sources import redact, resume_after

        from edgekv.model.builtin import resolve_model_path

        cfg = self.config
        model_dir = Path(resolve_model_path(cfg.model.path))
        if is_random_checkpoint(model_dir):
            self.say(RANDOM_WEIGHTS_NOTE.format(path=model_dir))
        runtime = self.runtime if self.runtime is not None else edgekv.Runtime.from_config(cfg)
        self.runtime = runtime
        self.state.source = self._source_record = source_record(self._spec, cfg.video.loop)
        self.session = self.state.restore(runtime)  # a fresh session unless a matching snapshot is on disk
        self._frames_at_start = self.session.counters.frames
        self._go_on_in_recording()
        self._say_archive_elsewhere()
        self._say_archive_room()
        self._on_session_ready()
        stats = self.session.stats()
        self.say(f"edgekv {edgekv.__version__}: model {model_dir} ({cfg.model.dtype}, {runtime.device}), policy "
                 f"{stats['policy']}, engines {stats['vision_backend']}/{stats['llm_backend']}, cache cap "
                 f"{stats['cache_capacity_tokens']} tokens = {stats['cache_capacity_bytes'] / 2**20:.2f} MiB allocated once"
                 f"{self._video_room_text()}")
        self.monitor = Monitor(cfg.monitor).start()
        deterministic = not self._spec.live and not self.options.realtime
        base, most = cfg.video.reconnect_backoff_s
        if self._source_t is not None and not self._source_read_out:  # from its next tick after the memory's last frame
            self._source = resume_after(self._source, self._source_t + 1.0 / cfg.video.fps)
        capture = CaptureThread(self._source, lossless=deterministic, backoff=Backoff(base_s=base, max_s=most))
        kept = self._kept_pause()  # paused before a restart: no frame goes in, the camera is released at once
        idle = kept is not None or self._source_read_out  # an ended recording is not read again to its end
        self.sampler = Sampler(capture.start() if not idle else capture, cfg.video.fps)
        self.say(f"source {printable(redact(cfg.video.source))} ({'live' if self._spec.live else 'recorded'}"
                 f"{', looping' if cfg.video.loop else ''}), sampling at {cfg.video.fps} fps"
                 f"{' (every frame by timestamp)' if deterministic else ''}")
        if kept is not None:
            self.pause(f"{kept}, kept across the restart", _restored=True)
        if idle:
            self._source.close()  # its capture never started, so nothing else closes it
        self._start_alerts()
        self._start_frames()
        self._finish_pending_forgets()  # before the first frame goes in, and before anyone can ask
        if self._source_read_out:
            self._end_stream("the recording was read to its end before the restart")
        if cfg.power.enabled:
            from edgekv.apps.daemon.power import PowerPolicy

            self.power = PowerPolicy(cfg.power, power_w=lambda: self.monitor.snapshot().get("power_w"),
                                     energy=lambda: self.monitor.energy_totals())  # the shared one, once shared
        if cfg.escalate.url is not None:
            from edgekv.apps.outputs.escalate import Escalator

            self.escalator = Escalator(cfg.escalate, done=self._escalated,  # nothing leaves while paused
                                       withheld=lambda: f"paused ({self.paused})" if self.paused is not None else None
                                       ).start()
            self.say(f"hard questions escalate to {cfg.escalate.model} at {cfg.escalate.url}")
        if cfg.server.image_requests:
            self.image_session = runtime.session(archive=False)
            self.say("questions with images are answered in a second session "
                     f"({self.image_session.cache.capacity_bytes / 2**20:.2f} MiB allocated once)")
        self._start_fleet()
        self._start_inputs()
        notify_systemd("READY=1")
        self.watchdog = Watchdog.from_environment(self.heartbeat)
        if self.watchdog is not None:
            self.watchdog.start()

    def _start_frames(self) -> None:
        """Evidence frames on disk beside this camera's archive (``archive.frames_mib`` > 0 with ``archive.dir``)."""
        section = self.config.archive
        if not section.frames_mib or self.session.recall is None:
            return
        import sqlite3

        from edgekv.apps.daemon.frame_store import FrameStore

        try:
            self.frames = FrameStore(self.session.recall.archive.dir, max_bytes=int(section.frames_mib * 2**20),
                                     px=section.frames_px, keys=self.runtime.keys, max_age_s=section.max_age_s,
                                     wait_when_full=section.when_full == "wait",
                                     keep_free_bytes=int(section.keep_free_gib * 2**30))
        except (sqlite3.Error, OSError) as exc:  # a disk that cannot take it: the memory goes on without pictures
            self.say(f"evidence frames off: {self.session.recall.archive.dir} cannot hold them "
                     f"({type(exc).__name__}: {printable(str(exc), 200)}); answers still give their evidence times")
            return
        # a restored stream's pairs after its snapshot may have frames here and no archive record (dropped, queued)
        self.session.number_pairs_after(self.frames.last_pair(self._frame_stream()), "the evidence frames")
        kept = self.frames.stats()
        self.say(f"evidence frames: {self.frames.path} ({kept['frames_kept']} kept, files "
                 f"{kept['frames_file_bytes'] / 2**20:.1f} of {section.frames_mib:g} MiB, {section.frames_px} px)"
                 + (f"; a damaged file was set aside as {self.frames.set_aside.name}" if self.frames.set_aside else ""))

    def _frame_stream(self) -> str | None:
        """The archive's id of this stream (what the frame store keys a pair by), None before its first pair."""
        stream = self.session.recall.stream if self.session.recall is not None else None
        return stream.hex() if stream is not None else None

    def _start_alerts(self) -> None:
        """Standing questions and their outputs (apps/outputs/): always on, so the API can add rules."""
        from edgekv.apps.outputs.alerts import AlertBus, AlertEngine, KeyframeRing, RuleStore
        from edgekv.apps.outputs.webhooks import WebhookSender

        from edgekv.apps.outputs.alert_log import EventLog

        section = self.config.alerts
        # the last alerts, kept with the memory: listed and their keyframes served again after a restart
        self.alert_bus = AlertBus(EventLog(self.state.dir, self.runtime.keys) if self.state.enabled else None)
        if self.alert_bus.recent:
            self.say(f"{len(self.alert_bus.recent)} alert(s) of earlier runs kept (GET /v1/alerts/events)")
        store = RuleStore(self.state.dir, self.runtime.keys) if self.state.enabled else None  # the API's rules
        self.alerts = AlertEngine(section.rules, self.alert_bus, KeyframeRing(section.keyframe_pairs),
                                  camera=self.camera,  # video.sources: this camera's name on its rules and alerts
                                  max_rules=section.max_rules, store=store, check=self._fits_the_reserve,
                                  log_text=self.config.privacy.logs_text())
        if self.alerts.restored:  # users' questions: their text only where privacy.log_text lets the log hold it
            self.say(f"standing questions added through the API, restored from {store.path}: "
                     + "; ".join(f"{state.id} {printable(state.rule.question)}" if self.alerts.log_text else state.id
                                 for state in self.alerts.restored))
        resumed = [state for state in self.alerts.list() if state.verdict]
        if resumed:  # restored from alerts.json with the memory: what they saw is not alerted again
            self.say("standing questions resumed at 'yes' (no alert until they fall back to 'no'): "
                     + "; ".join(f"{state.id} {printable(state.name)}" for state in resumed))
        if self.alerts.dropped:
            self.say(f"{len(self.alerts.dropped)} standing question(s) of {store.path} left out: over "
                     f"alerts.max_rules ({section.max_rules}) with the config's ({', '.join(self.alerts.dropped)})")
        from edgekv.apps.server.tls import client_context

        for url in section.webhooks:  # an https:// receiver of a private CA: ValueError naming the key, at start
            context = client_context(url, section.webhook_ca_file, section.webhook_cert_file, section.webhook_key_file,
                                     names=("alerts.webhook_ca_file", "alerts.webhook_cert_file",
                                            "alerts.webhook_key_file"))
            sender = WebhookSender(url, section.webhook_timeout_s, section.webhook_retries, section.queue,
                                   context=context, proxy=section.webhook_proxy).start()
            self.webhooks.append(sender)
            self.alert_bus.add(sender)
        if section.rules:
            self.say(f"standing questions: {len(section.rules)} ("
                     + "; ".join(printable(rule.question) for rule in section.rules) + ")")

    def _fits_the_reserve(self, rule) -> None:
        """A standing question is evaluated over a full cache, in its ``cache.text_reserve_tokens`` slots: one that
        does not fit was taken, then failed every evaluation once the cache filled (a warning a frame pair)."""
        session = self.session
        tokens = len(session.layout.question_suffix_ids(session.tokenizer, rule.question))
        if tokens + 1 > session.text_reserve:
            raise ValueError(f"alert.question: {tokens} tokens, more than a standing question can have: it is "
                             f"evaluated over the full cache in the cache.text_reserve_tokens slots "
                             f"({session.text_reserve}, one for the answer); shorten it or raise that")

    def _start_fleet(self) -> None:
        """The fleet over MQTT (apps/outputs/mqtt.py): a question channel and an alert output; an unreachable
        broker is retried in the background, never a reason not to start."""
        section = self.config.fleet
        if section.broker is None:
            return
        from edgekv.apps.outputs.mqtt import DaemonHost, FleetAgent

        self.fleet = FleetAgent(section, DaemonHost(self), self._fleet_password).start()
        self.alert_bus.add(self.fleet)
        self.say(f"fleet: device {printable(self.fleet.device)} on {section.broker} (topics under "
                 f"{printable(section.topic_prefix)}/)")

    def _start_inputs(self) -> None:
        cfg = self.config
        if cfg.server.enabled and not self.options.no_server:
            from edgekv.apps.server.app import ApiServer

            self.server = ApiServer(self)
            try:
                self.server.start()
            except OSError as exc:  # taken between the preflight check and now
                raise bind_error(cfg.server.host, cfg.server.port, exc) from None
            address = f"{self.server.scheme}://{self.server.host}:{self.server.port}"
            self.say(f"HTTP API on {address} (OpenAI-compatible /v1, /metrics, /)" + self._tls_text())
        if not self.options.no_stdin and sys.stdin is not None and not sys.stdin.closed:
            self._stdin_reader = threading.Thread(target=self._read_stdin, name="edgekv-stdin", daemon=True)
            self._stdin_reader.start()
        if cfg.voice.speak.enabled or self.options.speak_wav:
            from edgekv.apps.voice.speak import DeviceOutput, Speaker, WavOutput, make_engine

            engine = make_engine(cfg.voice.speak)
            output = (WavOutput(self.options.speak_wav) if self.options.speak_wav
                      else DeviceOutput(cfg.voice.speak.output_device))
            self.speaker = Speaker(engine, output).start()
            where = self.options.speak_wav or "the audio device"
            self.say(f"answers to {', '.join(cfg.voice.speak.sources)} questions are spoken ({engine.name}, to {where})")
        if cfg.voice.enabled and cfg.voice.trigger == "push_to_talk":
            from edgekv.apps.voice.listen import PushToTalk

            self.push_to_talk = PushToTalk(cfg.voice.push_to_talk).start()
        if cfg.voice.enabled or self.options.voice_wav:
            from edgekv.apps.voice.listen import Transcriber, VoiceLoop, questions_in_wav

            transcriber = Transcriber(self._asr_model)
            if self.options.voice_wav:  # recorded speech is a spoken --ask: transcribed now, asked on its schedule
                self.spoken = questions_in_wav(self.options.voice_wav, transcriber, cfg.voice)
                when = f"every {self.options.ask_every} pairs" if self.options.ask_every else "when the stream ends"
                self.say(f"{self.options.voice_wav}: {len(self.spoken)} spoken question(s), asked {when}")
            if cfg.voice.enabled:
                self.voice = VoiceLoop(self, cfg.voice, transcriber=transcriber).start()
                self.say(f"listening for spoken questions (ASR model {self._asr_model})")
        if cfg.ros2.enabled:
            from edgekv.apps.outputs.ros2 import Ros2Channel

            self.ros2 = Ros2Channel(self, cfg.ros2).start()
            self.say(f"ROS 2: {self.ros2.describe()}")

    # ------------------------------------------------------------------ the loop
    def serve(self) -> None:
        """One step per turn (ingest a frame or answer a question) until stopped or, one-shot, done."""
        self._loop_thread = threading.current_thread()
        self.stall.start()
        while not self.stop:
            self._wake.clear()
            self.heartbeat.beat()
            self._on_loop_tick()
            if self.power is not None:
                self._check_power()
            if self.paused is not None:
                self._pause_seen.set()  # the loop is between steps: nothing more goes in until resumed
                self._wake.wait(0.25)
                if self._question_waiting():
                    self._answer_next(jumped_ahead=False)  # paused: questions are answered about what was seen
                continue
            self._update_collector(answering=False)
            if self._stream_end is not None and not self.stream_ended.is_set() and not len(self.backlog):
                self._settle_end()  # the frames read before the end have gone in (a frame limit may leave some)
            if self._ingesting() and self._collector is None and not len(self.backlog):
                self._pull(timeout=0.0)
            step = self.fair.next_step(self._frame_waiting(), self._question_waiting())
            if step == "ingest":
                if not len(self.backlog):
                    self._pull(timeout=0.05)  # a recorded source: its reader delivers the next frame shortly
                if len(self.backlog):
                    self._ingest_next()
            elif step == "answer":
                self._answer_next(jumped_ahead=self._frame_waiting())
            elif self._ingesting() and self._collector is None:
                self._pull(timeout=0.05)
            elif self._ingesting():
                self._wake.wait(0.02)  # the collector is sampling; a question or a frame comes shortly
            elif self._finished():
                return
            else:
                self._wake.wait(0.25)
        self._stop_collector()

    # ------------------------------------------------------------------ power and privacy
    def _check_power(self) -> None:
        change = self.power.check()
        if change is None or self.sampler is None:
            return
        from edgekv.frameskip import StaticPairSkipper

        cfg = self.config
        old = self.sampler.fps
        fps = cfg.video.fps * (cfg.power.save_fps_factor if change else 1.0)
        with self.lock:
            self.sampler.set_fps(fps)
            ingest = self.session.ingestor
            if change:
                self._skipper_before_saving = ingest.skipper
                ingest.skipper = StaticPairSkipper(cfg.power.save_skip_threshold, cfg.video.skip_static.max_gap_pairs)
            else:
                ingest.skipper = self._skipper_before_saving
        why = "; ".join(self.power.reasons) if change else "conditions cleared"
        self.say(f"power: {'saving' if change else 'normal'} ({why}): video.fps {old:g} -> {fps:g}, skipping static "
                 f"pairs {'at ' + format(cfg.power.save_skip_threshold, 'g') + ' grey levels' if change else 'as configured'}")

    PAUSE_FILE = "paused.json"  # under state.dir while paused: a restart keeps the pause

    def pause(self, reason: str = "privacy switch", _restored: bool = False) -> bool:
        """Stop ingest and release the camera until ``resume``; questions are still answered about what was seen.
        False if already paused. With ``state.dir`` the pause is kept there (``paused.json``) until ``resume``: a
        device told to stop watching that restarts (a power cycle, a crash, an update) starts paused."""
        with self._submit_lock:
            if self.paused is not None or self.sampler is None:
                return False
            self.paused, self._paused_at = reason, time.monotonic()
            paused_at, sampler = self._paused_at, self.sampler  # a resume while this waits opens a capture of its own
            if not _restored:
                self._keep_pause(reason)  # under the lock: a resume racing this pause cannot leave the file behind
        self._pause_seen.clear()
        self._wake.set()
        if threading.current_thread() is not self._loop_thread and self._loop_thread is not None:
            self._pause_seen.wait(STOP_BUDGET_S)  # a step in flight (a frame, an answer) finishes first
        with self._submit_lock:  # a resume now waits for the camera to be released
            if self._paused_at != paused_at:  # resumed (maybe paused again) while the step went on: with a capture
                sampler.close()  # of its own, the pause's already closed by it; nothing else to undo
                return True
            self._stop_collector()
            sampler.close()  # the capture thread ends and the source (the camera) is closed
            if self._spec.live:  # a camera goes on live
                self.backlog.clear()
            # a recording's frames handed out and not in yet go in after the resume, which reads on after them
            # (Sampler.handed_out_t); an ended stream's too: nothing reads them again (resume opens nothing)
        self.say(f"paused ({reason}): the camera is released; nothing is seen until resumed")
        self._wake.set()
        return True

    def resume(self) -> bool:
        """Reopen the source and go on: a live one live, the pause a gap in the stream's time; a recorded one (a file,
        a synthetic video, a bag) where it stopped, on its own clock, as a video player does. A stream that has
        ended (a recording read to its end, before a restart too; ``--max-frames``) reads no more, so its source is
        not opened again (an ended file was decoded to its end for nothing, a camera's light came on): said."""
        from edgekv.video.capture import Backoff, CaptureThread, Sampler
        from edgekv.video.sources import resume_after

        with self._submit_lock:
            if self.paused is None:
                return False
            cfg = self.config
            self._stop_collector()  # nothing sampled before the pause goes in after it, stamped as if new
            ended = self._stream_end
            if ended is None:  # a recording's frames handed out before the pause were kept by it, to go in now
                old = self.sampler
                old.close()  # a pause still waiting for the step in flight has not: the camera let go before reopening
                if self._spec.live:
                    self.backlog.clear()
                self._spec, self._source = open_video_source(cfg)
                self._say_waiting()
                last = self.session.clock.last_t
                # after the last frame handed out, not the last one in: one in flight (a pause that gave up waiting for
                # the step) or kept in the backlog goes in too, and is not read again
                handed = old.handed_out_t if old.handed_out_t is not None else self._source_t
                if not self._spec.live and handed is not None:  # from its next tick after that frame
                    self._source = resume_after(self._source, handed + 1.0 / old.fps)
                elif last is not None:
                    self._resume_offset = (last + (time.monotonic() - self._paused_at) - self.state.stream_time(0.0)
                                           + 1e-6)
                deterministic = not self._spec.live and not self.options.realtime
                base, most = cfg.video.reconnect_backoff_s
                capture = CaptureThread(self._source, lossless=deterministic,
                                        backoff=Backoff(base_s=base, max_s=most))
                self.sampler = Sampler(capture.start(), self.sampler.fps)
            paused_for = time.monotonic() - self._paused_at
            self.paused = self._paused_at = None
            self.stall.start()  # the pause was no stall: count from the resume
            self._keep_pause(None)
        self.say(f"resumed after {paused_for:.0f} s paused" if ended is None else
                 f"resumed after {paused_for:.0f} s paused; the stream has ended ({ended}): the source is not opened "
                 "again, questions are answered about what was seen")
        self._wake.set()
        return True

    def _say_archive_elsewhere(self) -> None:
        """Archive segments of the other layout (one camera: ``archive.dir``; several: ``archive.dir/<name>``) are
        never read nor counted in ``archive.max_gib``, nor deleted by retention: say so, with what they take."""
        folder = self.config.archive.dir
        if folder is None:
            return
        folder = Path(folder).expanduser()
        where = ([folder.parent] if self.camera is not None else
                 [p for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else [])
        for other in where:
            segments = list(other.glob("seg-*.ekva"))
            if segments:
                size = sum(p.stat().st_size for p in segments)
                self.say(f"archive: {other} holds {len(segments)} segment(s) ({size / 2**20:.1f} MiB) of a "
                         f"{'one-camera deployment' if self.camera is not None else 'camera of video.sources'}, "
                         f"which this deployment never reads, counts in archive.max_gib nor deletes; remove them")

    def _video_room_text(self) -> str:
        """How the cap is shared, for the start-up line: the video's room (and the frame pairs it holds at
        ``video.resolution``), the text reserve, the retrieval reserve; and a note where the reserves take most of it
        (``--max-tokens 640`` with the default 512-token text reserve left the video 8 pairs, unsaid)."""
        session = self.session
        room = session.video_limit - session.prefix_tokens
        resolution = self.config.video.resolution
        per_pair = (resolution[0] // 28) * (resolution[1] // 28) if resolution else None
        held = f", {room // per_pair} frame pairs at {resolution[0]}x{resolution[1]}" if per_pair else ""
        text = (f" (video {room} tokens{held}; {session.text_reserve} kept for a question and its answer, "
                f"cache.text_reserve_tokens"
                + (f"; {session.recall_reserve} for recalled pairs, archive.top_k" if session.recall_reserve else "")
                + ")")
        if room < session.capacity // 2:
            text += (f"\nnote: the reserves take most of the cap, the video keeps {room} of its "
                     f"{session.capacity} tokens{held}: raise cache.max_tokens or lower cache.text_reserve_tokens")
        answer = self.config.generation.max_new_tokens
        if session.text_reserve - answer < self.QUESTION_ROOM:
            text += (f"\nnote: generation.max_new_tokens {answer} leaves {max(0, session.text_reserve - answer)} of "
                     f"cache.text_reserve_tokens {session.text_reserve} for a question: once the cache is full, a "
                     f"question asked without its own max_tokens is refused; lower generation.max_new_tokens or "
                     f"raise cache.text_reserve_tokens")
        return text

    QUESTION_ROOM = 24  # tokens: the chat template's turn around a short question (about 10) and the question

    def _say_archive_room(self) -> None:
        """A disk that cannot hold ``archive.max_gib`` (and ``frames_mib``) beside ``keep_free_gib``: said at start,
        since the archive will then give up its oldest segments to the floor before it reaches its budget."""
        from edgekv.archive.store import disk_free_bytes, size_text

        recall = self.session.recall if self.session is not None else None
        if recall is None:
            return
        section, archive = self.config.archive, recall.archive
        other = {d: n for d, n in archive.segments_by_dtype().items() if d != archive.shape.dtype}
        if other:  # archive.kv_dtype was changed: the old records are read as they are
            self.say(f"archive: {', '.join(f'{n} segment(s) of {d} records' for d, n in other.items())} from before "
                     f"archive.kv_dtype was changed are read as they are; new records are {archive.shape.dtype}")
        free = disk_free_bytes(archive.dir)
        if free is None:
            return
        held = archive.bytes_on_disk + sum(p.stat().st_size for p in archive.dir.glob("frames.sqlite*"))
        wanted = int(section.max_gib * 2**30 + section.frames_mib * 2**20)
        floor = int(section.keep_free_gib * 2**30)
        if free + held < wanted + floor:
            self.say(f"archive: the disk holding {archive.dir} has {size_text(free)} free ({size_text(held)} more "
                     f"held by the archive), less than archive.max_gib ({section.max_gib:g} GiB)"
                     + (f" and frames_mib ({section.frames_mib:g} MiB)" if section.frames_mib else "")
                     + f" beside keep_free_gib ({section.keep_free_gib:g} GiB): the oldest segments will go to keep "
                     f"the floor before the budget is reached (about {size_text(max(0, free + held - floor))} of "
                     f"memory on flash)")

    def _keep_pause(self, reason: str | None) -> None:
        """``state.dir/paused.json`` written while paused (temporary file, fsync, rename), removed at the resume; a
        failing disk is said, the pause holds in this process all the same."""
        if not self.state.enabled:
            return
        path = self.state.dir / self.PAUSE_FILE
        try:
            if reason is None:
                path.unlink(missing_ok=True)
                return
            replace_durably(path, json.dumps({"reason": reason, "since_unix": time.time()}).encode())
        except OSError as exc:
            self.say(f"privacy: could not {'keep' if reason else 'clear'} the pause in {path} ({exc}); "
                     f"{'a restart would watch again' if reason else 'a restart would start paused'}")

    def _kept_pause(self) -> str | None:
        """The reason of a pause kept in ``state.dir`` by the process before this one (None: not paused)."""
        if not self.state.enabled:
            return None
        path = self.state.dir / self.PAUSE_FILE
        try:
            kept = json.loads(path.read_text())
            return str(kept["reason"])
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError):  # unreadable: paused all the same (the safe side)
            return "privacy switch"

    def forget(self, t_from: float | None = None, t_to: float | None = None, last_s: float | None = None,
               unix: tuple[float, float] | None = None) -> dict:
        """Remove a window of stream time from everything the device keeps: the live cache, the snapshots (a new
        one written, the older deleted — when one of them can hold the window), the archive (its segments rewritten
        without those pairs), the keyframes and alerts held in memory, and the answers kept for the status page (any
        may tell of the window).
        ``last_s``: the last so many seconds up to now (by the wall clock where the frames have wall times, so a
        camera gone dark or paused loses nothing it saw before; by the stream clock for a recording read as fast as
        it goes); ``unix``: what was seen between two wall times (this
        camera's wall-clock map) — every stretch of it where the wall clock lived that time twice (set back in
        between: forgetting both is the side a wearer asking to forget takes), nothing where nothing was seen.
        Forgets asked at the same time are done in one pass under the session's lock, after the main loop's step
        (apps/daemon/forget_passes.py); each caller gets its own window's answer.
        Refused with ``DaemonStopping`` (HTTP 503) once the daemon shuts down."""
        ask = ForgetAsk(*self._checked_window(t_from, t_to, last_s, unix))
        forgets, _watch = self._forgets()
        return forgets.run(ask, self.lock, self._forget_pass, self._let_the_loop_step)

    @staticmethod
    def _checked_window(t_from, t_to, last_s, unix) -> tuple:
        """``forget``'s window checked before it is queued or noted: a window the forget cannot do, noted in the
        journal, was done again at every start, which then failed ("cannot start: forget: expected a window from <=
        to") — the daemon never came back."""
        if last_s is not None:
            seconds = real_seconds(last_s)
            if seconds is None or not math.isfinite(seconds) or not seconds > 0:
                raise ValueError(f"last_s: must be a number of seconds > 0, got {last_s!r:.60}")
            return None, None, seconds, unix
        if unix is not None:
            return None, None, None, unix
        if t_from is None or t_to is None:
            raise ValueError("forget: give from and to (stream seconds), or last_s")
        low, high = real_seconds(t_from), real_seconds(t_to)
        if low is None or high is None or not (math.isfinite(low) and math.isfinite(high)) or low > high:
            raise ValueError(f"forget: expected a window from <= to in stream seconds (finite numbers), got "
                             f"from={t_from!r:.40} to={t_to!r:.40}")
        return low, high, None, None

    def _forgets(self):
        """This daemon's ``ForgetQueue`` and the ``LoopWatch`` of the daemons sharing its lock (several cameras: the
        first camera's)."""
        return self._forget_queue, (self.asked_through or self)._loop_watch

    def _loops_held_up(self) -> list:
        """The heartbeats of the main loops a forget's lock holds up: this camera's, and with several cameras (one
        lock for the model) every camera's; a loop that is not running is not held up."""
        lead = self.asked_through or self
        daemons = list(lead.cameras.values()) if lead.cameras else [self]
        return [d.heartbeat for d in daemons
                if d.lock is self.lock and d._loop_thread is not None and d._loop_thread.is_alive()]

    def _snapshot_beats(self) -> Callable[[], None]:
        """What a snapshot written by this loop beats as it reaches the disk a step at a time (``write_snapshot``'s
        ``progress``): this loop's heartbeat, and with several cameras (one lock) the heartbeats of the others it holds
        up that were fresh when it began — a loop hung elsewhere is not kept looking alive by a long write.

        Made at every turn of the loop (``maybe_snapshot`` writes a snapshot every ``state.every_s``), so the loops
        are looked at by the first beat only, a loop's age then less the time since this was made (on the heartbeats'
        clock) being its age when the snapshot began: looking at them every turn was ~0.1 ms of the dev VM's CPU a
        turn, two turns a pair."""
        clock = getattr(self.heartbeat, "clock", time.monotonic)  # a Heartbeat's (tests wrap it)
        made = clock()
        alive: list | None = None

        def beat() -> None:
            nonlocal alive
            if alive is None:
                alive = self._fresh_heartbeats(clock() - made)
            for heartbeat in alive:
                heartbeat.beat()
        return beat

    def _fresh_heartbeats(self, since_s: float) -> list:
        """This loop's heartbeat, and those of the loops held up (``_loops_held_up``) that were fresh ``since_s``
        seconds ago: within the watchdog's stall then."""
        watchdog = (self.asked_through or self).watchdog
        stall = watchdog.stall_s if watchdog is not None else None
        alive = [beat for beat in self._loops_held_up()
                 if beat is self.heartbeat or (stall is not None and beat.age_s() - since_s <= stall)]
        if self.heartbeat not in alive:
            alive.append(self.heartbeat)
        return alive

    def _let_the_loop_step(self) -> bool:
        """Before a pass: the main loop's step first (a frame ingested, one turn), at most ``LoopWatch.wait_s``; not
        when the loop is this thread (a spoken forget) or is not running."""
        loop = self._loop_thread
        if loop is None or not loop.is_alive() or loop is threading.current_thread():
            return False
        _forgets, watch = self._forgets()
        return watch.wait_for_step(self.heartbeat, self.stop.event)

    def _forget_pass(self, asks: list) -> None:
        """Every forget waiting (``asks``), under the lock: each window out of the cache, the archive, the evidence
        frames and the alerts, one note in the journal for all, one snapshot rewrite (only when a snapshot can hold
        one of the windows), then each caller answered — with ``OSError`` naming what was not done. Between its parts
        the heartbeats of the loops it holds up beat, if they had stepped since the last pass."""
        if self._closed:  # shutting down: the final snapshot is written, or waits for this lock, then state.dir
            # is let go; a forget after it would rewrite the snapshots and the archive as they are being closed
            for ask in asks:
                ask.fail(DaemonStopping("the daemon is shutting down: nothing was forgotten; ask again once it is "
                                        "back"))
            return
        _forgets, watch = self._forgets()
        held_up = self._loops_held_up()
        alive = watch.alive(held_up)
        watch.beat(alive)  # they stepped since the last pass: alive as this one begins
        try:
            self._forget_windows(asks, lambda: watch.beat(alive))
        finally:
            watch.passed(held_up)

    def _forget_windows(self, asks: list, progress: Callable[[], None]) -> None:
        """The body of ``_forget_pass``: ``asks`` (``ForgetAsk``) each done in turn, as many forgets one after the other
        would be (a window already taken by an earlier one finds nothing more), then what they share once."""
        now = self.session.clock.last_t
        planned = []
        for ask in asks:
            stretches, unix = self._stretches_of(ask, now)
            if stretches:
                planned.append((ask, stretches, unix))
                continue
            note = f"nothing of this stream was seen between {wall_text(unix[0])} and {wall_text(unix[1])}"
            self.say(f"forget: {note}")
            ask.finish({"from": None, "to": None, "pairs": 0, "cache_tokens_freed": 0, "cache_slots": 0,
                        "cache_tokens": self.session.cache.length, "snapshots": {"snapshot": None, "removed": []},
                        "archive": None, "note": note, "wall": {"from": unix[0], "to": unix[1]}})
        if not planned:
            return
        every = [stretch for _ask, stretches, _unix in planned for stretch in stretches]
        noted = self._note_forget(every)  # on disk before the first file is touched
        done = []
        for ask, stretches, unix in planned:
            pairs, tokens, slots, archive, failed = 0, 0, 0, None, []
            for t_from, t_to in stretches:
                result = self._forget_stretch(t_from, t_to, now, progress=progress)
                failed += result.pop("failed")
                pairs, slots = pairs + len(result["pairs"]), slots + result["slots"]
                tokens += result["tokens"]
                if result["archive"] is not None:
                    archive = {key: (archive or {}).get(key, 0) + value for key, value in result["archive"].items()}
            done.append((ask, stretches, unix, pairs, (tokens, slots), archive, failed))
        snapshot_failed = []
        try:
            snapshots = self.state.rewrite_after_forget(self.session, every, progress)
        except OSError as exc:  # the rest is still done; the caller hears what was not (HTTP: forget_incomplete)
            snapshot_failed.append(f"snapshots: {exc}")
            snapshots = {"snapshot": None, "removed": []}
        progress()
        # the answers given so far (the status page's recent questions): any of them may tell of the window
        with self._history_lock:
            self.history.clear()
            telemetry = getattr(self.server, "telemetry", None)
            if telemetry is not None:
                telemetry.answered.clear()
            self.forgotten_at = time.time()
        if self.voice is not None:  # the spoken questions heard and their answers (a follow-up's conversation)
            self.voice.forget_conversation()
        if self.escalator is not None:  # questions waiting to be escalated, with keyframes that may be of the window
            self.escalator.forget()
        if noted is not None and not snapshot_failed and not any(item[-1] for item in done):
            self._strike_forget(noted)  # a part that failed stays noted: the next start does it again
        for ask, stretches, unix, pairs, freed, archive, failed in done:
            self._answer_forget(ask, stretches, unix, pairs, freed, archive, snapshots, failed + snapshot_failed,
                                len(done) - 1)

    def _stretches_of(self, ask, now: float | None) -> tuple[list[tuple[float, float]], tuple[float, float] | None]:
        """The stretches of stream time ``ask`` names (the clock held still: nothing is ingested under the lock), and
        the wall-clock window it was read from; its frames waiting to be ingested dropped."""
        unix, last_s = ask.unix, ask.last_s
        if unix is None and last_s is not None and now is not None and self.session.wall_time(now) is not None:
            # A live stream: the last seconds by the clock on the wall, as the person asking means them. By the
            # stream's own clock a camera that went dark (or was paused) an hour ago lost its last minutes
            # before that, and kept nothing less for it.
            wall_now = self.wall_clock()
            unix = (max(wall_now - last_s, -MAX_ABS_SECONDS), wall_now)  # "the last 10**9 s": all of it
        if unix is not None:
            self._forget_backlog(unix=unix)
            return self.session.wall_stretches(*unix), unix
        if last_s is not None:
            t_to = now if now is not None else 0.0
            stretch = (t_to - last_s, t_to)
        else:
            stretch = (ask.t_from, ask.t_to)
        self._forget_backlog(stream=stretch)
        return [stretch], None

    def _answer_forget(self, ask, stretches, unix, pairs, freed: tuple[int, int], archive, snapshots, failed,
                       others: int) -> None:
        """One caller's answer (and its line): what its own window took, the snapshots of the pass it was done in.
        ``freed``: the cache tokens (positions) freed, and the slots over every layer and KV head (``--json``'s
        ``cache_slots``: a token counts once in each, so 6 pairs of the toy, 96 tokens, read as 768)."""
        tokens, slots = freed
        out = {"from": stretches[0][0], "to": stretches[-1][1], "pairs": pairs, "cache_tokens_freed": tokens,
               "cache_slots": slots,
               "cache_tokens": self.session.cache.length, "snapshots": snapshots, "archive": archive}
        if unix is not None:
            out["wall"] = {"from": unix[0], "to": unix[1]}
            if len(stretches) > 1:
                out["stretches"] = [list(stretch) for stretch in stretches]
        if others:
            out["done_with"] = others  # the other forgets of its pass (one snapshot rewrite for all)
        recall = self.session.recall
        if recall is not None and recall.archive.newer:  # their records cannot be read here: neither found nor removed
            out["archive_not_searched"] = recall.archive.newer_text()
            self.say(f"forget: not searched: {out['archive_not_searched']}")
        if snapshots["snapshot"]:
            said = f", snapshot {snapshots['snapshot']} written, {len(snapshots['removed'])} older removed"
        elif snapshots.get("note"):
            said = f", {snapshots['note']}" + (f" ({', '.join(snapshots['removed'])} removed)"
                                               if snapshots["removed"] else "")
        else:
            said = ""
        self.say(f"forgot t={', '.join(f'{a:g}..{b:g}' for a, b in stretches)} s: {pairs} frame pairs, "
                 f"{tokens} cache tokens freed"
                 + (f", {archive['pairs']} archived pairs ({archive['bytes']} bytes freed)"
                    if archive and "pairs" in archive else "")
                 + (f", {archive['frames']} evidence frames" if archive and "frames" in archive else "")
                 + said + (f" (in one pass with {others} other forget(s))" if others else ""))
        if failed:
            self.say(f"forget incomplete: {'; '.join(failed)}")
            ask.fail(OSError("; ".join(failed)))
        else:
            ask.finish(out)

    def _journal(self):
        """Where forgets are noted while they run (``apps/daemon/forget_journal.py``): ``state.dir``, else the archive's
        folder; None when nothing is kept on disk (the cache alone goes with the process)."""
        from edgekv.apps.daemon.forget_journal import ForgetJournal

        if self.state.enabled:
            return ForgetJournal(self.state.dir)
        if self.session is not None and self.session.recall is not None:
            return ForgetJournal(self.session.recall.archive.dir)
        return None

    def _note_forget(self, stretches) -> dict | None:
        """The forget about to run, noted in the journal (None: nothing on disk to forget, or the note failed —
        said: a crash before the forget ends would leave the window in the files until it is forgotten again)."""
        journal = self._journal()
        if journal is None:
            return None
        recall = self.session.recall
        try:
            return journal.add(stretches, self._pair_span_s(),
                               recall.stream.hex() if recall is not None and recall.stream is not None else None,
                               self._frame_stream() if self.frames is not None else None)
        except OSError as exc:
            self.say(f"forget: could not note it in {journal.path} ({exc}); it goes on, but power lost before it "
                     "ends would leave the window in the files until it is forgotten again")
            return None

    def _strike_forget(self, noted: dict) -> None:
        journal = self._journal()
        try:
            journal.done(noted["id"])
        except OSError as exc:  # done again at the next start: forgetting twice removes nothing more
            self.say(f"forget: done, but could not strike it off {journal.path} ({exc}); the next start does it again")

    def _finish_pending_forgets(self) -> None:
        """At the start, before the first frame: the forgets a crash (power lost, kill -9, a watchdog restart) cut
        short, done again from the journal — the cache restored from an older snapshot, the archive, the evidence
        frames and the alerts — then a snapshot without them (one for all, when a snapshot can hold one of them) and
        the older ones deleted. A window no forget can do (backwards, not a number: noted by an edgekv that did not
        check it) is struck off and said, never left to stop every start."""
        journal = self._journal()
        if journal is None:
            return
        try:
            entries = journal.pending()
        except OSError as exc:
            self.say(f"forget: {exc}")
            return
        with self.lock:
            done = []
            for noted in entries:
                window = ", ".join(f"{a:g}..{b:g}" for a, b in noted["stretches"])
                if not all(math.isfinite(a) and math.isfinite(b) and a <= b for a, b in noted["stretches"]):
                    self.say(f"forget noted in {journal.path} with a window no forget can do (t={window} s): struck "
                             "off; nothing was forgotten by it")
                    self._strike_forget(noted)
                    continue
                failed, pairs = [], 0
                for t_from, t_to in noted["stretches"]:
                    result = self._forget_stretch(t_from, t_to, None, noted=noted)
                    failed += result["failed"]
                    pairs += len(result["pairs"])
                done.append((noted, window, failed, pairs))
            if not done:
                return
            try:
                self.state.rewrite_after_forget(self.session, [s for noted, *_ in done for s in noted["stretches"]])
            except OSError as exc:
                for _noted, _window, failed, _pairs in done:
                    failed.append(f"snapshots: {exc}")
            for noted, window, failed, pairs in done:
                if failed:
                    self.say(f"forget cut short by the last stop (t={window} s): done again, but not all of it: "
                             f"{'; '.join(failed)}; it stays noted in {journal.path} for the next start")
                    continue
                self.say(f"forget cut short by the last stop (t={window} s) done again: {pairs} frame pairs left the "
                         "restored memory")
                self._strike_forget(noted)

    def _forget_backlog(self, unix: tuple[float, float] | None = None, stream: tuple[float, float] | None = None):
        """The frames of a forgotten window sampled while an answer ran, still waiting to go in: dropped (they would
        have gone into the memory after the forget). By their wall time, or their stream time."""
        if unix is not None:
            dropped = self.backlog.drop(lambda t, wall: wall is not None and unix[0] <= wall <= unix[1])
        else:
            dropped = self.backlog.drop(lambda t, wall: stream[0] <= self._stream_time(t) <= stream[1])
        if dropped:
            log.info("forget: %d frames of the window waiting to be ingested dropped", dropped)

    def _forget_stretch(self, t_from: float, t_to: float, now: float | None, noted: dict | None = None,
                        progress: Callable[[], None] | None = None) -> dict:
        """One stretch of ``forget`` (under its lock): the cache, the archive and its evidence frames, the alerts'
        keyframes and events. A part that fails does not stop the others: it is named in ``failed``. ``noted``: a
        forget of the journal finished at the start (its streams and pad, as they were when it began).
        ``progress``: called after each part (the watchdog's heartbeat: ``_forget_pass``)."""
        progress = progress or (lambda: None)
        result = self.session.forget(t_from, t_to)  # the pairs with a frame in the window (StreamSession.pairs_in)
        removed = set(result["pairs"])
        progress()
        # What is kept by the pair's stamp alone (its first frame's time) — evidence pictures (the pair's second
        # frame), keyframes, alerts — goes from one frame interval before the window: the pair whose second frame is
        # the window's first was kept whole, picture included. An archive record says where it ends
        # (``ArchivedPair.t_last``: a recording's odd last frame, archived as a pair of itself, ends where it starts),
        # so the archive gives up exactly the pairs with a frame in the window, as the cache does.
        pad = self._pair_span_s() if noted is None else noted["pad_s"]
        t_lo = t_from - pad
        archive, failed = None, []
        if self.session.recall is not None:  # this stream's records (another stream's times are its own)
            stream = self.session.recall.stream
            if noted is not None:
                stream = bytes.fromhex(noted["archive_stream"]) if noted["archive_stream"] else None
            try:
                if noted is None or stream is not None:
                    archive = self.session.recall.archive.forget(t_from, t_to, stream=stream, progress=progress,
                                                                 frame_s=pad)
            except OSError as exc:  # not a full disk (that deletes the segment whole): an I/O error, said at the end
                failed.append(f"archive: {exc}")
            progress()
        if self.frames is not None:  # its evidence frames on disk, overwritten (or, no room, all dropped)
            frame_stream = self._frame_stream() if noted is None else noted["frame_stream"]
            archive = {**(archive or {}), "frames": self.frames.forget(t_lo, t_to, frame_stream)}
            progress()
        if self.alerts is not None:
            ring = self.alerts.keyframes
            for pair in [p for p, t in ring.times.items() if t_lo <= t <= t_to or p in removed]:
                ring.frames.pop(pair, None)
                ring.times.pop(pair, None)
            if ring.latest is not None and ring.latest[0] in removed:
                ring.latest = None
            self.alerts.bus.forget(t_lo, t_to)
            progress()
        if now is not None and t_from <= now <= t_to:
            self._latest_frame = None  # the status page shows nothing of the window
        return {**result, "archive": archive, "failed": failed}

    def _pair_span_s(self) -> float:
        """The longest a frame pair's two frames lie apart at this deployment's sampling rate: one interval of
        ``video.fps``, or of its power-saving rate (``power.save_fps_factor``) when that is on."""
        cfg = self.config
        fps = cfg.video.fps * (cfg.power.save_fps_factor if cfg.power.enabled else 1.0)
        return 1.0 / fps

    def _stream_time(self, t: float) -> float:
        return self.state.stream_time(t) + self._resume_offset

    def _frame_waiting(self) -> bool:
        """A frame is there to ingest: in the backlog, or (a recorded source read losslessly) always
        next from its reader until it ends."""
        return len(self.backlog) > 0 or (self._ingesting() and self.sampler.deterministic)

    def _update_collector(self, answering: bool) -> None:
        """Run the collector from the start of an answer until the backlog has drained (while ingest
        can catch up); the main loop pulls frames itself otherwise."""
        want = (self.paused is None and self._ingesting() and self._backlog_enabled() and self._ingest_keeps_up()
                and (answering or len(self.backlog) > 0))  # paused: the camera is released, nothing is collected
        if want and self._collector is None:
            self._collector = Collector(self.backlog, self._sample).start()
        elif not want and self._collector is not None:
            self._stop_collector()

    def _stop_collector(self) -> None:
        if self._collector is not None:
            self._collector.stop()
            self._collector = None

    def _ingesting(self) -> bool:
        return self._stream_end is None

    def _backlog_enabled(self) -> bool:
        """A live (or paced) capture drops what nobody takes, so frames are collected during answers; a
        recorded source read losslessly waits by itself."""
        return not self.sampler.deterministic and self.config.video.answer_backlog_s > 0

    def _ingest_keeps_up(self) -> bool:
        """Ingest can catch up a backlog even while answers take their whole share: mean ingest time per
        frame x fps < video.min_ingest_share. On a slower machine frames are dropped anyway (latest frame
        wins) and collecting them would only make the stream lag the camera by the backlog's length."""
        average, video = self._ingest_s_per_frame, self.config.video
        return average is None or average * video.fps < video.min_ingest_share

    def _question_waiting(self) -> bool:
        return bool(self._scheduled) or bool(self._probes) or not self.questions.empty()

    def _pull(self, timeout: float) -> None:
        """Move the next sampled frame (if one is due) into the backlog; notice the end of the source. A sampler
        closed while this step read it (a pause that gave up waiting for the step, ``STOP_BUDGET_S``) is no end of
        the source: its stopped capture read as exhausted, the stream was ended during the pause, and after the
        resume the daemon watched nothing."""
        if self._frame_limit_reached(len(self.backlog)):
            self._end_stream(self._frame_limit_reason())
            return
        sampler = self.sampler  # the one whose end is judged: a resume may put a new one in place meanwhile
        item = self._sample(timeout)
        if item is not None:
            self.backlog.push(*item, bounded=False)
        elif sampler.exhausted and not sampler.closed:
            if sampler.stats().get("ended") in ("eof", "truncated") and not self._spec.live:
                self._source_read_out = True  # kept with the frames still to go in (_went_in) and the memory
                self._keep_source_point()
            self._end_stream(self._source_end_reason(sampler))

    def _sample(self, timeout: float):
        """The next sampled frame as ``(frame, t, unix)``: ``unix`` the wall time it was sampled at (within a frame
        interval of its capture), kept in the session's wall-clock map so questions and forgets can name a stretch
        by the clock; None for a recorded source read losslessly, whose frames come as fast as they are ingested
        and were seen at no particular wall time."""
        item = self.sampler.next_frame(timeout=timeout)
        if item is None:
            return None
        return (*item, None if self.sampler.deterministic else self.wall_clock())

    def _source_end_reason(self, sampler: Sampler | None = None) -> str:
        ended = (sampler if sampler is not None else self.sampler).stats().get("ended")
        return {"eof": "the source ended", "truncated": "the file ended early (truncated)",
                "gave_up": "the camera did not come back", "error": "the source failed"}.get(ended, "the source ended")

    def _frame_limit(self) -> int | None:
        return self.options.max_frames if self.options.max_frames is not None else self.config.video.max_frames

    def _frame_limit_reason(self) -> str:
        flag = "--max-frames" if self.options.max_frames is not None else "video.max_frames"
        return f"{flag} {self._frame_limit()} reached"

    def _frame_limit_reached(self, waiting: int = 0) -> bool:
        """This run's frames (a restored memory's were counted too: restarted with 560 frames in its memory,
        ``--max-frames 500`` stopped at once, ingesting nothing) and those ``waiting`` reach the limit."""
        limit = self._frame_limit()
        return limit is not None and self.session.counters.frames - self._frames_at_start + waiting >= limit

    def _end_stream(self, reason: str) -> None:
        """Read no more frames. The stream has ended (``stream_ended``, the line said, the end's questions scheduled)
        once the frames already read have gone in: at once, or when the backlog has drained (``_settle_end``)."""
        if self._stream_end is not None:
            return
        self._stream_end = reason
        self._stop_collector()
        if not len(self.backlog):
            self._settle_end()

    def _settle_end(self) -> None:
        """The end of the stream, after its last frame: an odd last frame (whatever ended the stream: the source,
        ``--max-frames``, the camera gone) is seen as a pair of itself, then the end is said."""
        reason = self._stream_end
        if reason is None or self.stream_ended.is_set():
            return
        if not reason.startswith("the cache is full"):
            self._finish_pair()
        self.stream_ended.set()
        frames = self.session.counters.frames
        if self.options.one_shot:
            self.say(f"stream ended: {reason} after {frames} frames")
        else:
            self.say(f"stream ended: {reason} after {frames} frames; still answering questions about what was "
                     "seen (SIGTERM to stop)")
        if not self.options.ask_every:
            self._scheduled.extend(self._own_questions())
        if self.quiz is not None:
            self._scheduled.extend(self.quiz.questions(self.config.generation.max_new_tokens))

    def _finished(self) -> bool:
        """Nothing left to do: one-shot and every input answered, or no channel can bring a question."""
        if self._question_waiting() or not self.stream_ended.is_set():
            return False  # not settled: frames read before the end still wait to go in
        if self.options.one_shot:
            return True
        through = self.asked_through  # several cameras: the first one's API, stdin, microphone and fleet ask this one
        listening = (self._hears() or self.ros2 is not None or self.fleet is not None
                     or (through is not None and (through._hears() or through.fleet is not None)))
        if not listening:
            self.say("no question can arrive (no HTTP API, no stdin, no microphone, no fleet): exiting")
        return not listening

    def _tls_text(self) -> str:
        """The served certificate in words, for the start-up line (HTTPS only)."""
        info = self.certificate
        if info is None:
            return ""
        said = info.describe()
        client = ", client certificates required" if self.config.server.tls_client_ca_file else ""
        return f"; TLS{client}{': certificate ' + said if said else ''}"

    def _hears(self) -> bool:
        """A channel this daemon runs can still bring a question to it or to the cameras it asks for."""
        stdin = self._stdin_reader is not None and self._stdin_reader.is_alive()
        return self.server is not None or self.voice is not None or stdin

    def _ingest_next(self) -> None:
        from edgekv.cache import CacheFullError

        frame, t, unix = self.backlog.pop()
        if self._frame_limit_reached():
            self._end_stream(self._frame_limit_reason())
            return
        started = time.perf_counter()
        try:
            with self.lock:
                stream_t = self._stream_time(t)
                result = self.session.ingest(frame, t=stream_t, captured_unix=unix)
                self._went_in(t, stream_t)
        except ValueError as exc:
            log.warning("frame skipped: %s", printable(str(exc)))
            return
        except CacheFullError as exc:
            self.say(f"ingest stopped: {exc}")
            self._end_stream("the cache is full (this policy never evicts)")
            return
        finally:
            spent = time.perf_counter() - started
            self.fair.ingested(spent)
            average = self._ingest_s_per_frame
            self._ingest_s_per_frame = spent if average is None else average + 0.1 * (spent - average)
        self.heartbeat.beat()
        self.stall.progressed()
        self._latest_frame = frame
        self.monitor.count_frames(self._monitor_total("frames"))
        self._after_ingest(result, frame, t, unix)

    def _went_in(self, t: float, stream_t: float) -> None:
        """The frame the source stamped ``t`` went in at ``stream_t`` (under the lock): the quiz counts it, and the
        persistent memory keeps the point (``edgekv.state.SOURCE_KEY``) for a restart to go on in a recording from
        the next frame, on the recording's own clock."""
        self._source_t = t
        if self._source_first_t is None:
            self._source_first_t = t
        if self.quiz is not None:
            self.quiz.saw(t)
        self._keep_source_point(stream_t)

    def _keep_source_point(self, stream_t: float | None = None) -> None:
        from edgekv.state import SOURCE_KEY

        with self.lock:  # a snapshot (a forget's, from the HTTP thread) reads it under the lock
            extra = self.session.counters.extra
            if stream_t is None:  # the end of the recording, noticed after its last frame went in
                stream_t = extra.get(SOURCE_KEY, {}).get("stream_t")
            if self._source_record is None or self._source_t is None or stream_t is None:
                return
            point = {**self._source_record, "first_t": self._source_first_t, "t": self._source_t, "stream_t": stream_t}
            if self._source_read_out and not len(self.backlog):  # its frames read before the end have all gone in
                point["ended"] = True
            if self.quiz is not None:
                point["quiz_seen"] = self.quiz.seen_ranges()
            extra[SOURCE_KEY] = point

    def _go_on_in_recording(self) -> None:
        """After the restore: a recording the saved memory stopped in goes on from its next frame (``start`` opens it
        there, ``resume`` too after a pause kept across the restart), the quiz counting what was shown before."""
        from edgekv.state import SOURCE_KEY

        self._source_t = self.state.resumed_source_t
        if self._source_t is None:
            return
        saved = self.session.counters.extra.get(SOURCE_KEY, {})
        first = saved.get("first_t")
        self._source_first_t = float(first) if isinstance(first, (int, float)) else self._source_t
        self._source_read_out = self.state.recording_ended
        if self.quiz is not None:
            line = self.quiz.restore(saved.get("quiz_seen"), (self._source_first_t, self._source_t))
            if line is not None:
                self.say(line)
        self._go_on_past_the_archive()

    def _go_on_past_the_archive(self) -> None:
        """A process killed (``kill -9``, a power cut) after its last snapshot left this recording's pairs ingested
        since in the archive: the recording goes on after the newest of them, not from the snapshot's point. Read
        again, that stretch was archived twice under new pair numbers (``number_pairs_after``), so a recall could bring
        one moment back twice, and its alerts fired twice. The cache lacks those pairs, as if its policy had let them
        go, and recall brings them back by the numbers their evidence frames have too. The session's times are the
        recording's (plus the restored offset) and a pair's position comes from its time, so the clock goes on
        without a jump and new pairs sit after the archived ones."""
        recall = self.session.recall
        if recall is None or self._source_read_out or self._source_t is None:
            return
        seen = recall.seen_after_snapshot()
        if not seen:
            return
        period = 1.0 / self.config.video.fps
        to_source = self.session.clock.shift + self._stream_time(0.0)  # session time - the recording's
        last = seen[-1].t_last(period) - to_source  # the newest archived pair's last frame, in the recording's time
        # or the frame the snapshot held waiting for its partner, archived as a pair of itself: the stream ended on it
        alone = (seen[-1].frames == 1 and self.session.ingestor.pending is not None
                 and abs(last - self._source_t) < period / 2)
        if not (last > self._source_t or alone):  # not this recording's time (a clock jump in between): read on from
            return  # the snapshot
        with self.lock:
            clock, pending = self.session.clock, self.session.ingestor.pending
            if clock.t0 is None:  # the snapshot held no pair: positions count from the first pair archived since
                clock.t0 = seen[0].t
            self.session.ingestor.pending = None  # it was paired and archived after the snapshot (or an earlier one)
        if self.quiz is not None:  # the model was shown that stretch: its events were seen
            for k in range(1, int(round((last - self._source_t) / period)) + 1):
                self.quiz.saw(self._source_t + k * period)
        paired = "" if pending is None else (
            "; the frame it held waiting for its partner was archived as a pair of itself then (the stream ended on it)"
            if alone else "; the frame it held waiting for its partner was paired then")
        self.say(f"the archive holds {len(seen)} pair(s) of this recording seen after the saved memory's snapshot "
                 f"(the daemon stopped without saving: killed, or the power went): the recording goes on after them, "
                 f"from {last + period:g} s{paired}; they are recalled from the archive, not held in the cache")
        self._source_t = last

    def _finish_pair(self) -> None:
        """At the end of the stream, the frame still waiting for its partner (an odd last frame; the only
        frame of a still image) prefilled as a pair of itself (``StreamSession.finish_pair``): it was read and
        never seen, and a photo given as the source left the model with nothing."""
        from edgekv.cache import CacheFullError

        pending = self.session.ingestor.pending
        if pending is None:
            return
        try:
            with self.lock:
                result = self.session.finish_pair()  # archived as one frame: a restart goes on at the next
        except (ValueError, CacheFullError) as exc:
            log.warning("the last frame was not seen: %s", printable(str(exc)))
            return
        if result is not None:
            self._after_ingest(result, pending[0], None, self.session.wall_time(pending[1]))

    def _after_ingest(self, result, frame, t, unix) -> None:
        """What follows an ingested frame: the server's counters; for a pair, its picture kept (evidence frames,
        keyframes), the standing questions due, the pair's line, the ``--ask-every`` questions."""
        if self.server is not None:
            self.server.pair_ingested(result)
        if result.pair_index is None:
            return
        # the pair's time as the session stamps it (its first frame's): what a forget's window and an answer's evidence
        # name it by (this frame, the pair's second, is half a pair later)
        t_pair = self.session.pair_times.get(result.pair_index)
        t_pair = self._stream_time(t) if t_pair is None else t_pair
        if self.frames is not None:
            self.frames.submit(self._frame_stream(), result.pair_index, t_pair,
                               self.session.wall_time(t_pair) if unix is not None else None, frame)
        if self.alerts is not None:
            self.alerts.keyframes.add(result.pair_index, frame, t_pair)
            waiting = {state.id for state in self._probes}
            self._probes.extend(s for s in self.alerts.due(result.pair_index) if s.id not in waiting)
        if not self.options.quiet:
            self.say(format_pair(result, self._pair_figures()))
        every = self.options.ask_every
        if every and (result.pair_index + 1) % every == 0:
            for question in self._own_questions():  # the user's own schedule: now, not subject to the fair share
                self._answer(question)

    def _pair_figures(self) -> dict:
        """The four figures of a pair's line, read as they are: ``session.stats()`` was built for every pair to print
        them (some sixty figures, the archive's and the policy's among them, and a sum over the cache's sink flags:
        a device-to-host read on CUDA), ~1.5 ms a pair on the dev VM's CPU."""
        session = self.session
        cache = session.cache
        if self._capacity_bytes is None or self._capacity_bytes[0] is not cache:  # allocated once with its cache
            self._capacity_bytes = (cache, cache.capacity_bytes)
        return {"cache_tokens": cache.length, "cache_capacity_tokens": cache.capacity,
                "cache_capacity_bytes": self._capacity_bytes[1], "compressions": session.counters.compressions}

    def _spoken_command(self, question: Question) -> bool:
        """A ``--voice-wav`` utterance that is a forget command (apps/voice/commands.py) is carried out, not asked
        (pause and resume are for the live microphone: the loop cannot wait for its own step)."""
        if question.source != "voice":
            return False
        from edgekv.apps.voice.commands import parse, run

        command = parse(question.text)
        if command is None or command.action != "forget":
            return False
        try:
            reply = run(self, command)
        except (ValueError, OSError) as exc:
            reply = f"Could not forget: {exc}"
        self.say(f"voice command: {reply}")
        if self.speaker is not None:
            self.speaker.say(reply)
        return True

    def _own_questions(self) -> list[Question]:
        """The command line's questions: ``--ask`` and those spoken in ``--voice-wav``."""
        return ([Question(text, source="cli") for text in self.options.ask]
                + [Question(text, source="voice") for text in self.spoken])

    def _answer_next(self, jumped_ahead: bool) -> None:
        """One answer step: a standing question's evaluation (short, and late if it waits) or a question — a
        command-line one first, else the next from the API, stdin or voice — taking turns when both wait. (The
        evaluations went first always: with a rule due every pair and frames always waiting — a slow device, a
        recording replayed — every answer step the fair share allowed went to them and a question waited until
        the stream ended.)"""
        self._update_collector(answering=True)
        started = time.perf_counter()
        asked = bool(self._scheduled) or not self.questions.empty()
        if self._probes and (not asked or self._question_went_last):
            self._question_went_last = False
            self._evaluate(self._probes.popleft())
        else:
            self._question_went_last = True
            self._answer(self._scheduled.popleft() if self._scheduled else self.questions.get_nowait())
        self.fair.answered(time.perf_counter() - started, jumped_ahead)

    def _evaluate(self, rule) -> None:
        if rule.id not in self.alerts.rules:
            return  # deleted while it waited
        try:
            with self.lock:
                event = self.alerts.evaluate(rule, self.session, self.session.counters.frame_pairs - 1)
        except Exception as exc:  # a rule that cannot be evaluated must not stop the stream
            log.warning("standing question %r not evaluated: %s", rule.name, printable(str(exc)))
            return
        self.heartbeat.beat()
        if event is not None:
            self.say(f"ALERT [{printable(event.name)}]: yes (P {event.p_yes:.2f}) at t={event.stream_t} s; "
                     f"evidence: {event.keyframe_note}")

    def _answer(self, question: Question) -> None:
        if self._spoken_command(question):  # "forget the last five minutes" in --voice-wav
            question.done.set()
            return
        user_on_token = question.on_token
        # an escalated streamed answer sends the remote's text, not the local tokens
        quiet = question.stream and question.escalate is True and self.escalator is not None
        decoded = [0]

        def on_token(token: int) -> None:
            if self.stop or question.cancelled.is_set():  # stopping, or the asker left: nobody to decode for
                raise AnswerCancelled
            decoded[0] += 1
            self.heartbeat.beat()
            if callable(user_on_token) and not quiet:
                user_on_token(token)

        speech = None
        if self.speaker is not None and self._speaks(question) and not quiet:
            from edgekv.apps.voice.speak import TokenSpeech

            # the reply the asker hears begins with the start it gave (continue_final_message), said with the
            # first sentence the model completes
            speech = TokenSpeech(self.session.tokenizer, self.speaker, question.id, question.asked_at,
                                 prefix=self._speech_prefix() + question.answer_prefix)
            voiced = on_token

            def on_token(token: int) -> None:  # noqa: F811 - the same callback, also spoken
                voiced(token)
                speech.on_token(token)

        self._current = question
        deferred = False
        try:
            evidence = self.config.escalate.keyframes if self.escalator is not None else 0
            if question.cancelled.is_set():
                raise AnswerCancelled
            with self.lock:
                self._read_under[question.id] = self.forgotten_at  # no forget runs while this answer reads
                if question.images:
                    question.answer = self._answer_images(question, on_token)
                else:
                    question.answer = self.session.ask(
                        question.text, max_new_tokens=question.max_new_tokens, temperature=question.temperature,
                        top_p=question.top_p, seed=question.seed, on_token=on_token, recall=question.recall,
                        evidence=max(evidence, int(question.evidence)), history=question.history,
                        window=self._window(question), answer_prefix=question.answer_prefix)
                if question.evidence and question.answer.evidence:  # the pair the question attended most
                    question.evidence_pair = question.answer.evidence[0]
                    question.evidence_seen = tuple(self.seen(pair)
                                                   for pair in question.answer.evidence[:int(question.evidence)])
                if speech is not None:  # queued before another camera's answer can speak (several cameras)
                    speech.finish(question.answer.text)
            deferred = self._escalate(question)
        except AnswerCancelled:
            if question.cancelled.is_set():
                question.error = AskerLeft(f"the client disconnected: the answer was stopped after {decoded[0]} "
                                           f"token(s)")
            else:
                question.error = DaemonStopping("the daemon is shutting down: the answer was cut short")
        except Exception as exc:  # a bad question must not stop the stream; the asker gets the error
            question.error = exc
        finally:
            self._current = None
            if not deferred:
                self._finish(question)
        self.monitor.count_tokens(self._monitor_total("answer_tokens"))

    def _monitor_total(self, counter: str) -> int:
        """What the monitor divides the device's energy by: this camera's count, or every camera's sharing it."""
        daemons = self.monitor_cameras or [self]
        return sum(getattr(d.session.counters, counter) for d in daemons if d.session is not None)

    def _finish(self, question: Question) -> None:
        """The question is answered (or refused): record it, print it, wake whoever waits for it."""
        self.stall.progressed()
        question.answered_at = time.time()
        read_under = self._read_under.pop(question.id, self.forgotten_at)
        with self._history_lock:  # an answer read before a forget may tell of its window: not kept after it
            if read_under == self.forgotten_at:
                self._record(question)
        self.say(format_answer(question, self.config.privacy.logs_text()))
        if self.quiz is not None and question.source == "quiz":
            self.say(self.quiz.grade(question))
        question.done.set()
        if self.server is not None:
            self.server.question_answered(question)
        answer = question.answer
        if self.speaker is not None and answer is not None and answer.escalated and self._speaks(question):
            self.speaker.say(self._speech_prefix() + whole_reply(question), question.id,  # the remote's, whole
                             question.asked_at)

    def _speech_prefix(self) -> str:
        return f"{self.speech_name}: " if self.speech_name else ""

    def _speaks(self, question: Question) -> bool:
        sources = self.config.voice.speak.sources
        return "all" in sources or question.source in sources

    def _escalate(self, question: Question) -> bool:
        """Hand the question to the escalation server when it should go there; True if it went (the
        escalator finishes it)."""
        if self.escalator is None:
            if question.escalate is True:  # asked for, and it cannot be: the answer says so
                question.answer = dataclasses.replace(question.answer, escalation_note=(
                    "not escalated: this daemon has no escalation server (escalate.url is null)"))
            return False
        reason = self.escalator.reason(question, question.answer, question.stream)
        if reason is None:
            return False
        from edgekv.apps.outputs.escalate import Escalation

        # the frames the answer attended most: from the keyframe ring, else the evidence frames on disk. One no
        # longer kept is left out — the latest frame in its place showed the remote model now as "an hour ago".
        # Only a question with no evidence at all (asked before anything was attended) gets the latest frame.
        # A question about its own images (server.image_requests) goes with those, and no frame of the camera.
        keyframes = []
        for pair in () if question.images else question.answer.evidence:
            jpeg = self.keyframe_jpeg(pair)
            if jpeg is not None and jpeg not in keyframes:
                keyframes.append(jpeg)
        if not question.answer.evidence and not question.images:
            jpeg, _ = self.alerts.keyframes.jpeg(None)
            keyframes += [jpeg] if jpeg is not None else []
        if self.escalator.submit(Escalation(question, keyframes, reason)):
            return True
        question.answer = dataclasses.replace(question.answer, escalation_note=(
            f"not escalated: {self.config.escalate.queue} escalations already wait (escalate.queue)"))
        return False

    def _escalated(self, question: Question) -> None:  # the escalator's thread
        self._finish(question)

    def _answer_images(self, question: Question, on_token):
        """A question about the images it carries (server.image_requests): the second session, emptied, gets
        each image as a frame pair, then the question."""
        from edgekv.images import decode_bgr

        if self.image_session is None:
            raise ValueError("this server does not take images (server.image_requests: false)")
        session = self.image_session
        session.reset()
        step = 1.0 / self.config.video.fps
        for index, data in enumerate(question.images):
            frame = decode_bgr(data)  # OpenCV's IMREAD_COLOR, or the same pixels from Pillow without the extra
            if frame is None:
                raise ValueError(f"image {index + 1} of the question is not a readable JPEG or PNG")
            for copy in range(2):  # an image is a frame pair of two equal frames (Qwen2.5-VL's own rule)
                session.ingest(frame, t=(2 * index + copy) * step)
        return session.ask(question.text, max_new_tokens=question.max_new_tokens, temperature=question.temperature,
                           top_p=question.top_p, seed=question.seed, on_token=on_token, history=question.history,
                           answer_prefix=question.answer_prefix)

    def _window(self, question: Question) -> tuple[float, float] | None:
        """The stretch of stream time a question reads: its own, the stretch seen between its wall times (this
        camera's wall-clock map), or its last seconds up to the newest frame."""
        if question.window_unix is not None:
            return self.session.wall_window(*question.window_unix)
        if question.window_last_s is None:
            return question.window
        return self.session.last_seconds(question.window_last_s)

    def seen(self, pair: int) -> tuple[int, float | None, float | None, bool, str | None]:
        """An answer's evidence pair, the stream time it was seen at (the cache's pairs, else the alerts' keyframe
        ring's), that moment's wall time by this camera's clock map (None where either is not known), whether its
        frame is still kept (the keyframe ring's last pairs, else the evidence frames on disk: ``keyframe_jpeg``), and
        this camera's name."""
        t = self.session.pair_times.get(pair)
        ring = self.alerts.keyframes if self.alerts is not None else None
        if t is None and ring is not None:
            t = ring.times.get(pair)
        kept = (ring is not None and pair in ring.frames) or (
            self.frames is not None and self.frames.has(self._frame_stream(), pair))
        return pair, t, self.session.wall_time(t) if t is not None else None, kept, self.camera

    def keyframe_jpeg(self, pair: int) -> bytes | None:
        """Frame pair ``pair``'s frame as JPEG while the keyframe ring keeps it (the last ``alerts.keyframe_pairs``
        pairs), else from the evidence frames on disk (``archive.frames_mib``), else None. Any thread."""
        data = self.alerts.keyframes.jpeg_of(pair) if self.alerts is not None else None
        if data is None and self.frames is not None:
            data = self.frames.jpeg(self._frame_stream(), pair)
        return data

    def _record(self, question: Question) -> None:
        answer = question.answer
        self.history.append({
            "id": question.id, "source": question.source, "question": question.text,
            "asked_at": question.asked_at, "answered_at": question.answered_at,
            "answer": whole_reply(question) if answer is not None else None,  # with the start it was given
            "error": str(question.error) if question.error is not None else None,
            "finish_reason": getattr(answer, "finish_reason", None),
            "tokens": len(answer.token_ids) if answer is not None else 0,
            "ttft_s": getattr(answer, "ttft_s", None), "decode_tok_s": getattr(answer, "decode_tok_s", None),
        })

    # ------------------------------------------------------------------ state for the page and /metrics
    @property
    def stream_state(self) -> str:
        """``starting``, ``running``, ``reconnecting`` (a lost camera, backoff running), ``stalled`` (frames come
        but none went in for ``video.stall_s``: apps/daemon/health.py), ``ended`` (answers about what was seen,
        ingests nothing) or ``stopping``."""
        if self.stop or self._closed:
            return "stopping"
        if self.paused is not None:
            return "paused"
        if not self.ready.is_set() or self.sampler is None:
            return "starting"
        if self.stream_ended.is_set():
            return "ended"
        if self.sampler.capture.reconnecting:
            return "reconnecting"
        return "stalled" if self._current is None and self.stall.stalled() else "running"

    def problems(self) -> list[str]:
        """What is wrong without stopping the memory (``/healthz``: ``degraded``); apps/daemon/health.py."""
        return problems(self)

    @property
    def stream_detail(self) -> str | None:
        """Why the stream ended, or None."""
        return self._stream_end

    @property
    def ingest_stopped(self) -> str | None:  # the name the first daemon used
        return self._stream_end

    def recent_questions(self) -> list[dict]:
        """Finished questions from every channel (newest last), with answers or refusals."""
        return list(self.history)

    def status(self) -> dict:
        """The daemon's own figures (the session's are ``session.stats()``)."""
        current = self._current
        return {
            "stream_state": self.stream_state, "stream_detail": self.stream_detail,
            "seconds_since_progress": self.stall.idle_s(),
            "questions_waiting": self.questions.qsize() + len(self._scheduled),
            "answering": {"id": current.id, "source": current.source} if current is not None else None,
            **self.backlog.stats(),
            "ingest_s": self.fair.ingest_s, "answer_s": self.fair.answer_s, "answers_ahead_of_frames": self.fair.answers_ahead,
            "watchdog_pings": self.watchdog.pings if self.watchdog else None,
            "fleet": self.fleet.stats() if self.fleet is not None else None,
            "frames": self.frames.stats() if self.frames is not None else None,
            "reach": self.reach(),
        }

    def reach(self) -> dict | None:
        """How far back the memory goes, for people (the status page, ``/v1/edgekv/status``): the stream time and the
        wall time of the newest pair and of the oldest one the cache, the archive and the evidence frames on disk
        still hold (None where there is none, or no wall time: a recording read as fast as it goes). Worked out
        at most every ``REACH_EVERY_S`` (the page asks every second); any thread, no session lock."""
        session = self.session
        if session is None:
            return None
        now = time.monotonic()
        if self._reach is not None and now - self._reach[0] < REACH_EVERY_S:
            return self._reach[1]
        held = list(session.pair_times.values())  # one C-level copy: safe beside the main loop's changes
        recall = session.recall
        oldest = {"cache": min(held) if held else None,
                  "archive": recall.archive.oldest_t(recall.stream) if recall is not None else None,
                  "frames": self.frames.oldest_t(self._frame_stream()) if self.frames is not None else None}
        newest = max(held) if held else None
        wall = session.wall  # its anchors only grow at the end: read without the session's lock

        def unix(t):
            return wall.unix_of(t) if t is not None else None

        out = {"newest_t": newest, "newest_unix": unix(newest),
               **{f"{k}_t": t for k, t in oldest.items()}, **{f"{k}_unix": unix(t) for k, t in oldest.items()}}
        self._reach = (now, out)
        return out

    def jpeg_cached(self) -> bool:
        """``latest_jpeg()`` would return without encoding."""
        cached = self._latest_jpeg
        return self._latest_frame is None or (cached is not None and cached[0] is self._latest_frame)

    def latest_jpeg(self) -> bytes | None:
        """The latest ingested frame as JPEG, encoded once per frame however many clients poll it."""
        frame = self._latest_frame
        if frame is None:
            return None
        cached = self._latest_jpeg
        if cached is not None and cached[0] is frame:
            return cached[1]
        from edgekv.images import encode_jpeg

        try:
            data = encode_jpeg(frame, 80)  # OpenCV's, or the same bytes from Pillow without the `video` extra
        except ValueError:
            return None
        self._latest_jpeg = (frame, data)
        return self._latest_jpeg[1]

    # ------------------------------------------------------------------ persistent-state hooks
    def _on_session_ready(self) -> None:
        """Right after the session exists (restored by ``StateKeeper.restore`` when a snapshot matched)."""

    def _on_loop_tick(self) -> None:
        """Once per turn of the main loop (between steps, the session idle): the periodic snapshot, and one
        at once after SIGHUP."""
        if self.stop.hangup.is_set():
            self.stop.hangup.clear()
            self._reload_tls()
            self._save_now("SIGHUP")
        if self.state.enabled:  # no lock taken on every loop turn when persistent memory is off
            with self.lock:
                self.state.maybe_snapshot(self.session, self._snapshot_beats())
        self._expire_kept()
        self._check_hung()

    EXPIRE_EVERY_S = 60.0  # how often max_age_s is applied to what is kept on disk with nothing written

    def _expire_kept(self) -> None:
        """``archive.max_age_s`` applied to the archive and the evidence frames on disk every ``EXPIRE_EVERY_S``,
        written to or not: retention ran only before each new record, so a camera paused for hours by the privacy
        switch, gone dark, or at the end of its stream kept what was past the age the config promised it would not
        keep (``FrameArchive.expire``, ``FrameStore.expire``). Under the lock: a forget rewrites those files under
        it."""
        recall = self.session.recall if self.session is not None else None
        if self.frames is None and recall is None:
            return
        now = time.monotonic()
        if self._expired_at is not None and now - self._expired_at < self.EXPIRE_EVERY_S:
            return
        self._expired_at = now
        gone = [0, 0]
        for index, kept in enumerate((self.frames, recall.archive if recall is not None else None)):
            if kept is None:
                continue
            try:
                with self.lock:
                    gone[index] = kept.expire()
            except Exception:  # a bug or a fault in one store must not end the camera loop; the next minute tries again
                log.exception("archive.max_age_s: applying it to %s failed", type(kept).__name__)
        if max(gone) > 0:  # (-1: the evidence frames could not be written; the store logged why)
            log.info("archive.max_age_s: %d evidence frame(s) and %d archive segment(s) past it deleted",
                     max(gone[0], 0), gone[1])

    HANG_KINDS = ("camera", "gstreamer", "csi")  # sources whose driver call can block with no timeout of ours

    def _check_hung(self) -> None:
        """``video.exit_when_hung_s``: the camera's driver has returned nothing, no frame and no error, for that long
        (a hung Argus or GStreamer pipeline): stop, saving the memory, with exit status 3 for the service manager to
        restart the daemon — the one way out of a driver call that never returns."""
        limit = self.config.video.exit_when_hung_s
        if (limit is None or self.sampler is None or self.paused is not None or self._stream_end is not None
                or self._spec is None or self._spec.kind not in self.HANG_KINDS or self.exit_code):
            return
        silent = self.sampler.capture.silent_s()
        if silent is None or silent < limit:
            return
        self.exit_code = 3
        self.say(f"video.source: the camera's driver has returned nothing, no frame and no error, for {silent:.0f} s "
                 f"(a hung {self._spec.kind} pipeline?): saving the memory and exiting with status 3 for the service "
                 f"manager to restart the daemon (video.exit_when_hung_s {limit:g})")
        self.stop.event.set()

    def _reload_tls(self) -> None:
        """SIGHUP with HTTPS: the certificate files read again (``ApiServer.reload_tls``), so a renewed certificate
        is served without a restart; files that do not load leave the served certificate in place, said why."""
        if self.server is None or getattr(self.server, "tls", None) is None:
            return
        try:
            info = self.server.reload_tls()
        except (ValueError, OSError) as exc:
            self.say(f"SIGHUP: the TLS files did not load ({one_line(exc)}); still serving the certificate loaded "
                     "before")
            return
        self.certificate = info
        said = info.describe() if info is not None else ""
        self.say(f"SIGHUP: TLS certificate read again{': ' + said if said else ''}")

    def _save_now(self, why: str) -> None:
        if not self.state.enabled:
            self.say(f"{why}: no state.dir in the config, so there is no memory to save; going on")
            return
        with self.lock:
            info = self.state.snapshot(self.session, self._snapshot_beats())
        self.say(f"{why}: memory saved in {info.path} ({info.bytes / 2**20:.1f} MiB); going on" if info is not None
                 else f"{why}: the memory could not be saved (the log says why); going on")

    def _on_stop(self) -> None:
        """After the loop ended and the archive was closed, before the capture stops: the final snapshot (SIGTERM
        included), written a step at a time (``edgekv.state._Paced``), each step beating the loops' heartbeats and
        telling systemd the stop goes on (``EXTEND_TIMEOUT_USEC``, ``SNAPSHOT_STEP_S`` from now). Written whole and
        synced once, a 3B cache's 224 MiB on an SD card outlasted TimeoutStopSec (20 s): systemd killed the daemon
        mid-write and the memory since the last periodic snapshot was lost. A disk that stops answering stops the
        steps, and systemd kills the stop as before."""
        beat = self._snapshot_beats()
        extend = f"EXTEND_TIMEOUT_USEC={int(SNAPSHOT_STEP_S * 1e6)}"

        def progress() -> None:
            beat()
            notify_systemd(extend)

        with self.lock:
            self.state.final_snapshot(self.session, progress)

    def _close_archive(self, deadline: float) -> list[str]:
        """Before the final snapshot: the evidence frames and the archive closed — their queued pairs written and
        synced, the archive's folder let go — within what is left of the stop's budget; returns the parts that were
        not done in it. They are a few pairs (``archive.queue_pairs`` at most), the snapshot the whole cache (224 MiB at
        the 3B shape). Closed after it, on slow flash (an SD card) the snapshot spent the budget, the archive got no
        time and its queued pairs went with the process, though the snapshot held them: a hole in the archive. Closed
        first, the archive holds every pair up to the snapshot's last: a stop that completes restarts from the
        snapshot, nothing of the archive after it; one killed while the snapshot is written restarts from the one
        before and goes on after the archive's newest pair (``_go_on_past_the_archive``), as after any kill."""
        left = []
        if self.frames is not None and not _bounded("evidence frames", self.frames.close, deadline, self.stop_clock):
            left.append("evidence frames")  # before the archive lets its folder go
        recall = self.session.recall
        if recall is None or _bounded("archive", self.session.close, deadline, self.stop_clock):
            return left
        queued = recall.archive.stats()["archive_pending"]
        self.say(f"shutdown: the archive did not write its queued frame pairs within the stop's {STOP_BUDGET_S:g} s "
                 f"({queued} still queued): they are written while the final snapshot is, and lost if the process "
                 f"is killed first; the next start goes on from what reached the disk")
        return [*left, "archive"]

    # ------------------------------------------------------------------ shutdown and report
    def _refuse_waiting(self) -> None:
        """Close the door and answer every waiting question with ``DaemonStopping`` (HTTP 503)."""
        with self._submit_lock:
            self._closed = True
        refused = 0
        waiting = list(self._scheduled)
        self._scheduled.clear()
        while True:
            try:
                waiting.append(self.questions.get_nowait())
            except queue.Empty:
                break
        for question in waiting:
            question.error = DaemonStopping("the daemon is shutting down; the question was not answered")
            question.answered_at = time.time()
            question.done.set()
            refused += 1
        if refused:
            self.say(f"refused {refused} waiting question(s): shutting down")

    stop_clock: Callable[[], float] = staticmethod(time.monotonic)  # what the stop's budget is kept on (tests: fake)

    def shutdown(self, deadline: float | None = None) -> None:
        """Stop everything within ``STOP_BUDGET_S`` (each part gets what is left of it), in the order that loses least
        on slow flash: the archive's queued pairs first (``_close_archive``), then the final snapshot (not cut short:
        half a snapshot is none), then the other parts. A part the budget has no time left for is started and not
        waited for; they are said in one line. ``deadline`` (on ``stop_clock``): one shared by several cameras
        (``CameraSet._shutdown``), each stopping in its own thread."""
        if deadline is None:
            deadline = self.stop_clock() + STOP_BUDGET_S
        notify_systemd("STOPPING=1")
        self._refuse_waiting()
        if self.stop.signal_name:
            self.say(f"{self.stop.signal_name}: finishing the current step and shutting down")
        left, snapshot_s = [], None
        if self.session is not None:
            left = self._close_archive(deadline)
            began = self.stop_clock()
            self._on_stop()
            snapshot_s = self.stop_clock() - began
        self.state.release()  # after the final snapshot: the next daemon may take state.dir
        parts = [("speaker", None if self.speaker_is_shared else self.speaker, lambda s: s.close()),
                 ("push-to-talk", self.push_to_talk, lambda p: p.stop()),
                 *(("webhook", sender, lambda w: w.stop()) for sender in self.webhooks),
                 ("escalator", self.escalator, lambda e: e.stop()),
                 ("voice", self.voice, lambda v: v.stop()), ("ROS 2", self.ros2, lambda r: r.stop()),
                 ("HTTP server", self.server, lambda s: s.stop()), ("capture", self.sampler, lambda s: s.close()),
                 ("monitor", None if self.monitor_is_shared else self.monitor, lambda m: m.stop()),
                 ("watchdog", self.watchdog, lambda w: w.stop()),
                 ("fleet", self.fleet, lambda f: f.stop())]  # last: a broker out of reach costs no other part time
        for name, part, stop in parts:
            if part is not None and not _bounded(name, lambda: stop(part), deadline, self.stop_clock):
                left.append(name)
        if left:
            took = "" if snapshot_s is None else f"; the final snapshot took {snapshot_s:.1f} s"
            self.say(f"shutdown: past the stop's budget of {STOP_BUDGET_S:g} s{took}: not waited for: "
                     f"{', '.join(left)}")
        if self._source is not None and self.sampler is None:
            self._source.close()  # opened by the preflight, never handed to a capture thread
        if self.session is not None:
            self.say(self.summary())

    def _power_line(self, snap: dict) -> str:
        several = f" (device, {len(self.monitor_cameras)} cameras)" if self.monitor_cameras else ""
        if snap.get("power_w") is None:
            return f"power{several}: no sensor on this machine ({snap.get('backend', 'cpu')} monitor); J/frame unknown"
        return (f"power{several} {snap['power_w']:.1f} W, energy {snap['energy_j']:.1f} J, "
                f"{snap.get('j_per_frame') or float('nan'):.2f} J/frame, "
                f"{snap.get('j_per_token') or float('nan'):.2f} J/answer token")

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
        if not self.monitor_is_shared:  # shared: the device's power is the first camera's line, over every camera
            lines.append(self._power_line(snap))
        if self.sampler is not None:
            capture = self.sampler.stats()
            lines.append(f"capture: {capture.get('frames_read', 0)} read, {capture.get('frames_decoded', 0)} decoded, "
                         f"{capture.get('frames_dropped', 0)} dropped, "
                         f"{capture.get('frames_corrupt', 0)} corrupt, {capture.get('reconnects', 0)} reconnects")
        backlog = self.backlog.stats()
        if stats["questions"]:
            lines.append(f"questions {stats['questions']}: frames sampled while answering "
                         f"{backlog['frames_kept_while_answering']} kept, {backlog['frames_lost_while_answering']} lost "
                         f"(backlog bound {self.config.video.answer_backlog_s:g} s / "
                         f"{self.config.video.answer_backlog_mib:g} MiB); loop time ingesting "
                         f"{self.fair.ingest_s:.1f} s, answering {self.fair.answer_s:.1f} s")
        if self.quiz is not None and self.quiz.graded:
            lines.append(self.quiz.score())
        if self.speaker is not None and not self.speaker_is_shared:  # the owner's summary counts every camera's
            waits = sorted(self.speaker.first_audio_s.values())
            first = (f"time to first audio after the question: median {1e3 * waits[len(waits) // 2]:.0f} ms, "
                     f"max {1e3 * waits[-1]:.0f} ms over {len(waits)} answer(s)") if waits else "nothing spoken"
            lines.append(f"speech: {self.speaker.sentences} sentence(s) spoken by {self.speaker.engine.name}, "
                         f"{self.speaker.interrupted} barge-in(s); {first}")
        return "\n".join(lines)


def _bounded(name: str, action, deadline: float, clock: Callable[[], float] = time.monotonic) -> bool:
    """Run ``action`` in a helper thread and wait at most until ``deadline`` (on ``clock``): one part stuck in a
    driver call must not hold the whole shutdown past systemd's stop timeout. Whether it was done in time; with no
    time left it is started (it may finish before the process exits) and not waited for."""
    worker = threading.Thread(target=action, name=f"edgekv-stop-{name}", daemon=True)
    worker.start()
    left = deadline - clock()
    if left <= 0:
        log.warning("shutdown: no time left for %s; not waited for", name)
        return False
    worker.join(left)
    if worker.is_alive():
        log.warning("shutdown: %s did not stop in time; leaving it behind", name)
        return False
    return True
