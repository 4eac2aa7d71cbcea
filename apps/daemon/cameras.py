"""Several cameras on one model (``video.sources``, issue 28 §3).

The weights load once (``Runtime.sharing``); each camera is a whole ``Daemon`` of its own — its session and
capped cache, capture thread and reconnects, snapshots under ``state.dir/<name>``, archive under
``archive.dir/<name>``, alerts, ROS 2 topics under ``<ros2.namespace>/<name>`` (``-`` written ``_``) — so a camera
that fails reconnects alone while the others go on. What they share:

- **the memory budget**: ``cache.max_mib`` (or ``max_tokens``), ``archive.max_gib``, ``archive.frames_mib`` and
  ``state.max_mib`` are the device's, split by the cameras' ``weight`` at start; every cap is allocated once, so the
  sum never changes.
- **the model, through one lock handed out in arrival order** (``FairLock``): each camera's loop takes it for a
  frame pair or an answer, so when every camera has work the turns go round — a camera's share of the loop stays
  near its share of the frame rate whatever the others do (measured in the closing note of issue 28).
- **one HTTP server** (the first camera's daemon runs it): a chat names its camera (``"camera": "front"``) or
  asks all of them (the default with several cameras: the answers listed per camera); ``/metrics`` adds families
  with a ``camera`` label; ``/v1/edgekv/status`` lists the cameras.
- **one stop flag**: SIGTERM stops every camera, each saving its memory; SIGHUP makes each save and go on.
- **one systemd watchdog and one power monitor** (the first camera's): the watchdog pings only while every camera's
  loop makes progress (``OldestHeartbeat``), so a camera whose loop hangs gets the service restarted; the monitor
  divides the device's energy by every camera's frames (J/frame for the device, in the first camera's summary).
- **the wearer's controls** (apps/controls.py: ``pause_every``, ``resume_every``, ``forget_every``): the privacy
  switch and "forget the last five minutes", from the API or the voice, reach every camera, never the first one
  alone; so do the standing questions' list, events and SSE stream, and the fleet agent (the first camera's) carries
  every camera's alerts.

``--ask front:QUESTION`` asks one camera; a question without a camera's prefix is asked of each. So do a line on
stdin, a spoken question ("Back camera, ...": ``controls.route``) and a fleet question (its ``"camera"``, else one
answer per camera: ``DaemonHost.cameras``); the first camera's speaker says every camera's answers, each after its
camera's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import signal
import sys
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgekv.apps.controls import addressed
from edgekv.apps.daemon.console import StopFlag
from edgekv.config import EdgeKVConfig


class FairLock:
    """A re-entrant lock that waiting threads get in the order they asked for it (FIFO), unlike
    ``threading.RLock``, which lets the thread that just released it take it again at once — one camera's loop
    could then hold the model for many turns in a row while another waits."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._waiting: deque[int] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._waiting:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            self._waiting.append(me)
            try:
                ok = self._cond.wait_for(lambda: self._owner is None and self._waiting[0] == me,
                                         None if timeout is None or timeout < 0 else timeout)
            finally:
                if not (self._owner is None and self._waiting and self._waiting[0] == me):
                    self._waiting.remove(me)
                    self._cond.notify_all()  # the next in line may be free to go now
            if not ok:
                return False
            self._waiting.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("FairLock released by a thread that does not hold it")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class OldestHeartbeat:
    """The systemd watchdog's heartbeat with several cameras: the oldest beat among the loops still serving. Each
    camera's daemon would otherwise run a watchdog of its own, and one camera's progress would keep pinging systemd
    while another's loop hung: the hung camera would never be restarted. A loop that ended by itself (its stream
    done, one-shot) no longer counts."""

    def __init__(self, beats: list[tuple[Any, Any]]) -> None:
        self.beats = beats  # (Heartbeat, serving: () -> bool)

    def age_s(self) -> float:
        return max((beat.age_s() for beat, serving in self.beats if serving()), default=0.0)


def camera_configs(config: EdgeKVConfig) -> dict[str, EdgeKVConfig]:
    """Each camera's whole config: its source and rate, its share of the memory caps, its own folders and topics.
    The first camera keeps the server, the fleet agent, the microphone and the speaker; the others have them off
    (they speak through the first camera's speaker: ``CameraSet``)."""
    cameras = config.video.sources
    total = sum(camera.weight for camera in cameras)
    namespaces = ros_namespaces(config)
    frames_mib = config.archive.frames_mib
    least = min(camera.weight for camera in cameras) / total
    if frames_mib and frames_mib * least < 1:  # a file's pages and log need 1 MiB (ArchiveSection.validate)
        raise ValueError(f"archive.frames_mib {frames_mib:g} is shared by the cameras' weights, and leaves "
                         f"{frames_mib * least:.2f} MiB to the smallest share (at least 1 MiB each): set it to at "
                         f"least {math.ceil(1 / least)}, or 0 for no evidence frames on disk")
    out: dict[str, EdgeKVConfig] = {}
    for index, camera in enumerate(cameras):
        share = camera.weight / total
        cache = ({"max_mib": config.cache.max_mib * share, "max_tokens": None} if config.cache.max_mib is not None
                 else {"max_tokens": max(1, int(config.cache.max_tokens * share)), "max_mib": None})
        sections: dict[str, dict] = {
            "video": {"source": camera.source, "fps": camera.fps or config.video.fps, "sources": []},
            "cache": cache,
            "state": {"dir": _sub(config.state.dir, camera.name), "max_mib": config.state.max_mib * share},
            "archive": {"dir": _sub(config.archive.dir, camera.name), "max_gib": config.archive.max_gib * share,
                        "frames_mib": frames_mib * share},  # each camera's file once filled the whole setting
            "ros2": {"namespace": namespaces[camera.name]},
            "alerts": {"rules": [dataclasses.asdict(rule) for rule in config.alerts.rules
                                 if rule.camera in (None, camera.name)]},
        }
        if index > 0:
            sections["server"] = {"enabled": False}
            sections["fleet"] = {"broker": None}
            speak = {**dataclasses.asdict(config.voice.speak), "enabled": False}
            sections["voice"] = {"enabled": False, "speak": speak}
        out[camera.name] = config.with_overrides(label=f"video.sources[{index}] ({camera.name})", **sections)
    unknown = {rule.camera for rule in config.alerts.rules} - set(out) - {None}
    if unknown:
        raise ValueError(f"alerts.rules: camera {sorted(unknown)[0]!r} is not one of video.sources ({', '.join(out)})")
    return out


def engines_config(config: EdgeKVConfig) -> EdgeKVConfig:
    """The config the engines of ``video.sources`` are built (``edgekv build``) and loaded for: the first camera's,
    as ``CameraSet`` loads the one model for it and every camera shares what it loaded. An LLM engine's graph is built
    for one cache size (M is a fixed dimension of its inputs), so with ``engines.llm`` other than torch every camera
    must get the same cache — equal weights; cameras of unequal weights are refused here, before any weights load
    (the start refused the second camera after loading them, telling the user to build the first camera's bundle,
    which was there; ``edgekv build`` built one for the whole ``cache`` cap, which no camera uses)."""
    if not config.video.sources:
        return config
    cameras = camera_configs(config)
    sizes = {name: (camera.cache.max_tokens if camera.cache.max_mib is None else camera.cache.max_mib)
             for name, camera in cameras.items()}
    if config.engines.llm != "torch" and len(set(sizes.values())) > 1:
        unit = " tokens" if config.cache.max_mib is None else " MiB"
        each = ", ".join(f"{name} {size:g}{unit} (weight {camera.weight:g})"
                         for (name, size), camera in zip(sizes.items(), config.video.sources))
        equal = (f"{config.cache.max_tokens // len(sizes)} tokens" if config.cache.max_mib is None
                 else f"{config.cache.max_mib / len(sizes):g} MiB")
        raise ValueError(f"engines.llm: {config.engines.llm} runs one LLM graph built for one cache size, and "
                         f"video.sources' weights give the cameras different caches ({each}): give every camera the "
                         f"same weight (each then gets {equal}; `edgekv build --config` with that file builds the "
                         f"engines the cameras share), or run the LLM on torch (engines.llm: torch; engines.vision "
                         f"may stay {config.engines.vision})")
    return next(iter(cameras.values()))


def ros_namespaces(config: EdgeKVConfig) -> dict[str, str]:
    """Each camera's ROS 2 namespace, ``<ros2.namespace>/<name>`` with ``-`` written ``_``: a camera name may hold
    ``-`` (``front-left``), a ROS 2 name may not, and every camera's config is checked whole, so such a camera was
    refused at start even with ROS 2 off. A name that cannot be made a ROS 2 token (one starting with a digit, a
    letter outside ASCII) or two names that meet there (``front-left``, ``front_left``) are refused only where
    ROS 2 is used (``ros2.enabled`` or a ``ros2:`` camera); elsewhere the namespace is never read."""
    from edgekv.config import ConfigError, ros_name_problem

    parent = config.ros2.namespace.rstrip("/")
    uses_ros = config.ros2.enabled or any(str(camera.source).startswith("ros2:") for camera in config.video.sources)
    out: dict[str, str] = {}
    for index, camera in enumerate(config.video.sources):
        namespace = f"{parent}/{camera.name.replace('-', '_')}"
        problem = ros_name_problem(namespace)
        if problem is None and namespace in out.values():
            other = next(name for name, taken in out.items() if taken == namespace)
            problem = f"{other!r} has it too"
        if problem is None:
            out[camera.name] = namespace
        elif uses_ros:
            raise ConfigError(f"video.sources[{index}].name: {camera.name!r} cannot name the camera's ROS 2 topics "
                              f"({namespace}: {problem}); choose ASCII letters, digits and '_', a letter first")
        else:
            out[camera.name] = config.ros2.namespace  # ROS 2 is off: never read
    return out


def _sub(folder: str | None, name: str) -> str | None:
    return None if folder is None else str(Path(folder) / name)


def split_asks(questions: list[str], names: list[str], first_only=lambda text: False) -> dict[str, list[str]]:
    """``--ask`` questions per camera: ``front:QUESTION`` (or ``Front camera, QUESTION``: ``controls.addressed``)
    to that camera, anything else to each; ``first_only(text)`` keeps a text on the first camera alone (a spoken
    command, which reaches every camera by itself)."""
    out: dict[str, list[str]] = {name: [] for name in names}
    for text in questions:
        name, rest = addressed(text, names)
        if first_only(text):
            out[names[0]].append(text)
        elif name is not None and not rest:
            raise ValueError(f"--ask {text!r} names the camera {name} but asks it nothing")
        elif name is not None:
            out[name].append(rest)
        else:
            for name in names:
                out[name].append(text)
    return out


class PrefixedOutput:
    """Each camera's printed lines behind ``[name] `` on the one shared output (whole lines, one at a time)."""

    _lock = threading.Lock()

    def __init__(self, out: Any, name: str) -> None:
        self.out, self.prefix, self._partial = out, f"[{name}] ", ""
        self.encoding = getattr(out, "encoding", None)

    def write(self, text: str) -> int:
        self._partial += text
        while "\n" in self._partial:
            line, self._partial = self._partial.split("\n", 1)
            with self._lock:
                self.out.write(self.prefix + line + "\n")
        return len(text)

    def flush(self) -> None:
        with self._lock:
            self.out.flush()


class CameraSet:
    """The daemons of ``video.sources`` around one model (see the module docstring)."""

    def __init__(self, config: EdgeKVConfig, args: argparse.Namespace | Any = None, out=None,
                 prog: str = "edgekv-camera") -> None:
        from edgekv.apps.daemon.loop import Daemon, DaemonOptions

        self.config = config
        self.out = out or sys.stdout
        self.prog = prog
        self.stop = StopFlag()
        self.lock = FairLock()
        options = DaemonOptions.from_namespace(args)
        configs = camera_configs(config)
        asks = split_asks(list(options.ask), list(configs))
        self.daemons: dict[str, Daemon] = {}
        for index, (name, camera_config) in enumerate(configs.items()):
            camera_options = dataclasses.replace(options, ask=asks[name], no_server=options.no_server or index > 0,
                                                 no_stdin=options.no_stdin or index > 0,
                                                 voice_wav=options.voice_wav if index == 0 else None,
                                                 speak_wav=options.speak_wav if index == 0 else None)
            daemon = Daemon(camera_config, camera_options, out=PrefixedOutput(self.out, name), prog=prog)
            daemon.camera, daemon.lock = name, self.lock
            daemon.state.camera = name  # its memory is state.dir/<name>: said so when that is empty
            daemon.stop.event = self.stop.event  # one stop for all; each its own SIGHUP flag (each saves its memory)
            self.daemons[name] = daemon
        self.first = next(iter(self.daemons.values()))
        self.first.cameras = self.daemons  # the server routes questions and figures by camera
        for daemon in list(self.daemons.values())[1:]:
            daemon.asked_through = self.first
        self.ready = threading.Event()
        self._threads: list[threading.Thread] = []

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def _camera_key(self, name: str) -> str:
        """``video.sources[1] (back)``: where a camera's own mistake lies. Its checks name the one-camera key
        (``video.source: ... no such video file``), which a config with ``video.sources`` does not have, and not
        which of the cameras it was."""
        return f"video.sources[{list(self.daemons).index(name)}] ({name})"

    def _say_memory_not_listed(self) -> None:
        """A folder of ``state.dir`` or ``archive.dir`` holding the memory of a camera that ``video.sources`` no
        longer lists (renamed, removed): never read, never counted in the caps, never deleted. A renamed camera
        started empty ("no snapshot in state.dir/door") without a word of its memory under its old name beside it."""
        from edgekv.state import StateKeeper

        sections = (("state.dir", self.config.state.dir, f"{StateKeeper.PREFIX}*{StateKeeper.SUFFIX}"),
                    ("archive.dir", self.config.archive.dir, "seg-*.ekva"))
        for key, folder, pattern in sections:
            root = Path(folder).expanduser() if folder is not None else None
            if root is None or not root.is_dir():
                continue
            for other in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in self.daemons
                                and p.name != StateKeeper.ASIDE):  # set-aside: a one-camera deployment's own
                files = list(other.glob(pattern))
                if files:
                    size = sum(path.stat().st_size for path in files)
                    self.say(f"{key}: {other} holds the memory of a camera named {other.name!r} ({len(files)} "
                             f"file(s), {size / 2**20:.1f} MiB), which video.sources no longer lists: kept, never read "
                             f"nor counted in the caps; give the camera that name again (or rename the folder to the "
                             f"camera's new name) to resume it, or remove the folder")

    def _share_voice(self) -> None:
        """The first camera hears the voice and owns the one speaker (two speakers would talk over each other, and
        two ``--speak-wav`` writers would overwrite one file). Every camera speaks its answers through it, its name
        first ("back: one"); the questions of ``--voice-wav`` go to the camera each names, or to each (a spoken
        command stays with the first camera: it reaches every camera by itself)."""
        from edgekv.apps.voice.commands import parse

        if self.first.spoken:
            said = []
            for text in self.first.spoken:
                name, rest = addressed(text, self.daemons)
                if name is not None and not rest and parse(text) is None:
                    self.first.say(f"{self.first.options.voice_wav}: {text!r} names the camera {name} but asks it "
                                   f"nothing: not asked")
                else:
                    said.append(text)
            spoken = split_asks(said, list(self.daemons), first_only=lambda text: parse(text) is not None)
            for name, daemon in self.daemons.items():
                daemon.spoken = spoken[name]
        if len(self.daemons) > 1:
            for name, daemon in self.daemons.items():
                daemon.speech_name = name
                if daemon is not self.first:
                    daemon.speaker, daemon.speaker_is_shared = self.first.speaker, True

    def _share_monitor(self) -> None:
        """One power monitor and one systemd watchdog for the device, the first camera's. Each camera's daemon
        started its own: two tegrastats readers of the same rails, each dividing the whole device's energy by its
        own camera's frames (a J/frame N times too high), and watchdogs of which any one could vouch for a camera
        whose loop hung. The shared monitor counts every camera's frames and answer tokens."""
        daemons = list(self.daemons.values())
        if len(daemons) < 2:
            return
        for daemon in daemons:
            daemon.monitor_cameras = daemons
        for daemon in daemons[1:]:
            if daemon.watchdog is not None:
                daemon.watchdog.stop()
                daemon.watchdog = None
            if daemon.monitor is not None and daemon.monitor is not self.first.monitor:
                daemon.monitor.stop()
            daemon.monitor, daemon.monitor_is_shared = self.first.monitor, True

    def run(self) -> int:
        self.stop.install()
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGHUP"):
            signal.signal(signal.SIGHUP, lambda _signum, _frame: [d.stop.hangup.set() for d in self.daemons.values()])
        try:
            return self._run()
        finally:
            self.stop.uninstall()

    def _run(self) -> int:
        import edgekv
        from edgekv.runtime import find_engines

        try:
            camera = None  # the camera whose check or start failed, named in the error: its keys are its own
            try:
                shared = engines_config(self.config)  # cameras that cannot share engines: refused before the weights
                for camera, daemon in self.daemons.items():
                    daemon.preflight()
                camera = None
                find_engines(shared)  # the bundles the one load takes, found and checked before the weights load
                runtime = edgekv.Runtime.from_config(self.first.config)
                for camera, daemon in self.daemons.items():
                    daemon.runtime = runtime if daemon is self.first else runtime.sharing(daemon.config)
                    daemon.start()
            except (ValueError, OSError, RuntimeError, ImportError) as exc:  # as Daemon.run: a missing extra too
                from edgekv.apps.daemon.startup import one_line

                where = "" if camera is None else f"{self._camera_key(camera)}: "
                print(f"{self.prog}: cannot start: {where}{one_line(exc)}", file=sys.stderr, flush=True)
                return 2
            self._share_voice()
            self._share_monitor()
            if self.first.fleet is not None:  # the device's one fleet agent carries every camera's alerts
                for daemon in list(self.daemons.values())[1:]:
                    daemon.alert_bus.add(self.first.fleet)
            self._say_memory_not_listed()
            caps = ", ".join(f"{name} {d.session.cache.capacity} tokens = {d.session.cache.capacity_bytes / 2**20:.2f} MiB"
                             for name, d in self.daemons.items())
            self.say(f"{len(self.daemons)} cameras on one model: {caps}")
            for name, daemon in self.daemons.items():
                daemon.ready.set()
                thread = threading.Thread(target=daemon.serve, name=f"edgekv-camera-{name}", daemon=True)
                self._threads.append(thread)
                thread.start()
            if self.first.watchdog is not None:  # it pings systemd only while every camera's loop makes progress
                self.first.watchdog.heartbeat = OldestHeartbeat(
                    [(d.heartbeat, t.is_alive) for d, t in zip(self.daemons.values(), self._threads)])
            self.ready.set()
            while any(thread.is_alive() for thread in self._threads) and not self.stop:
                self.stop.event.wait(0.2)  # a camera's loop may end alone (one-shot, nothing to hear): the others go on
        finally:
            self.stop.event.set()
            self._wait_for_loops()
            self._shutdown()
        return max(daemon.exit_code for daemon in self.daemons.values())  # 3: a camera hung (all restart)

    join_loop: Callable[[threading.Thread, float], None] = staticmethod(threading.Thread.join)  # tests: a fake wait

    def _wait_for_loops(self) -> None:
        """Each camera's loop finishes its step, all within one ``STOP_BUDGET_S`` on the stop's clock; then the stop
        begins whatever a loop still does (it is said). Before, the stop waited for every loop while any ran, then
        up to 60 s for each in turn: one loop stuck in a step (a driver call, a disk) held the stop past systemd's
        TimeoutStopSec (20 s) and every camera was killed before its final snapshot."""
        from edgekv.apps.daemon.loop import STOP_BUDGET_S

        clock = self.first.stop_clock
        deadline = clock() + STOP_BUDGET_S
        for thread in self._threads:
            left = deadline - clock()
            if left <= 0:
                break
            self.join_loop(thread, left)
        stuck = [name for name, thread in zip(self.daemons, self._threads) if thread.is_alive()]
        if stuck:
            self.say(f"shutdown: the loop of {', '.join(stuck)} did not finish its step within the stop's "
                     f"{STOP_BUDGET_S:g} s: stopping without waiting for it")

    def _shutdown(self) -> None:
        """Every camera's ``Daemon.shutdown`` at once, all on one deadline: the process's stop within one
        ``STOP_BUDGET_S`` however many cameras. One after another, each camera began its own budget when the one
        before had finished: with three cameras whose parts hang (a capture that does not close), the third began at
        16 s and its archive spent the budget past the 20 s of systemd's TimeoutStopSec — killed before its final
        snapshot, its memory since the last periodic one lost. At once, the archives are closed side by side; the
        final snapshots take the model's lock in turn (``FairLock``), each extending systemd's stop timeout as it is
        written (``EXTEND_TIMEOUT_USEC``), so a camera waiting for another's snapshot is not killed while it waits.
        The first camera's server is no longer stopped after every other camera's stop: it stops after its own
        final snapshot, a question to a stopping camera being refused (503) or not connected either way."""
        from edgekv.apps.daemon.loop import STOP_BUDGET_S

        deadline = self.first.stop_clock() + STOP_BUDGET_S
        for daemon in self.daemons.values():
            daemon.stop.signal_name = self.stop.signal_name  # the signal came to this set's flag: each says it
        failed: list[BaseException] = []

        def stop(daemon) -> None:
            try:
                daemon.shutdown(deadline)
            except BaseException as exc:  # raised once every camera's stop is over, not lost in a thread
                failed.append(exc)

        threads = [threading.Thread(target=stop, args=(daemon,), name=f"edgekv-stop-{name}")
                   for name, daemon in self.daemons.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()  # each bounded by the one deadline, but for its final snapshot (not cut short)
        if failed:
            raise failed[0]
