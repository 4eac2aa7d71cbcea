"""Monitor: a sampling thread that reads what the machine has and turns it into W, J per frame,
J per answer token and peak memory.

Power sources, picked by ``monitor.backend`` (``auto``: tegrastats on a Jetson, else its INA3221 sysfs
rails, NVML on a desktop/server GPU, else none): Jetson power comes from tegrastats or the INA3221
sensors because NVML reports NotSupported there (JETSON.md). Energy is the trapezoidal integral of
power over the sampling times; frames and answer tokens are counted by the app, so J per frame is the
energy spent between the first and the last counted frame divided by their number. A reader failure is
counted and logged once; the thread never raises into the app (a monitor crashing the VLM app is a
complaint users of today's Jetson stacks have, live-vlm-webui#12).
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
import time
from dataclasses import dataclass

from edgekv.monitor.cpu import ProcessReader
from edgekv.monitor.jetson import is_jetson

log = logging.getLogger("edgekv.monitor")


@dataclass
class _Energy:
    joules: float = 0.0
    seconds: float = 0.0  # the time ``joules`` covers (a gap without a reading is in neither)
    last_t: float | None = None
    last_w: float | None = None

    def add(self, t: float, watts: float | None) -> None:
        if watts is None:
            self.last_t, self.last_w = None, None
            return
        if self.last_t is not None and self.last_w is not None:
            self.joules += 0.5 * (watts + self.last_w) * (t - self.last_t)
            self.seconds += t - self.last_t
        self.last_t, self.last_w = t, watts


_READERS = {  # backend -> (module, class); modules are imported only when tried
    "tegrastats": ("edgekv.monitor.tegrastats", "TegrastatsReader"),
    "ina3221": ("edgekv.monitor.ina3221", "Ina3221Reader"),
    "nvml": ("edgekv.monitor.nvml", "NvmlReader"),
    "rapl": ("edgekv.monitor.rapl", "RaplReader"),
}


def _make_reader(name: str):
    module, cls = _READERS[name]
    return getattr(importlib.import_module(module), cls)()


def choose_power_reader(backend: str):
    """The power reader for ``backend``: ``auto`` tries tegrastats then INA3221 on a Jetson, NVML then
    RAPL elsewhere, and returns None when nothing is there; ``cpu`` only tries RAPL. A named backend
    this machine lacks raises."""
    if backend not in ("auto", "cpu"):
        return _make_reader(backend)
    order = ("rapl",) if backend == "cpu" else (("tegrastats", "ina3221") if is_jetson() else ("nvml", "rapl"))
    for name in order:
        try:
            return _make_reader(name)
        except (ImportError, RuntimeError, OSError) as exc:
            log.info("monitor: %s unavailable (%s)", name, exc)
    return None


def _power_mode() -> str | None:
    """nvpmodel's current mode name ("MAXN", "30W", ...): `nvpmodel -q`, else its status/conf files."""
    import subprocess

    from edgekv.monitor.jetson import power_mode

    try:
        output = subprocess.run(["nvpmodel", "-q"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        output = None
    mode = power_mode(output)
    return None if mode is None else mode[1]


class Monitor:
    """Samples power/memory every ``interval_s`` in a thread; the app reports frames and tokens."""

    def __init__(self, section=None, power_reader=None, clock=time.monotonic) -> None:
        self.interval_s = float(getattr(section, "interval_s", 1.0))
        self.backend = getattr(section, "backend", "auto")
        self._power = power_reader
        self._choose = power_reader is None
        self._process = ProcessReader()
        self._clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._energy = _Energy()
        self._latest: dict = {}
        self._errors = 0
        self._frames: list[tuple[int, float]] = []  # (count, energy J) at the first and latest report
        self._tokens: list[tuple[int, float]] = []
        self.peak_device_mem_mb = 0.0
        self.power_mode: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "Monitor":
        if self._choose:
            try:
                self._power = choose_power_reader(self.backend)
            except Exception as exc:  # a named backend this machine lacks: say so, keep running without it
                log.warning("monitor: backend %s unavailable: %s", self.backend, exc)
                self._power = None
        self.power_mode = _power_mode() if is_jetson() else None
        self.sample()
        self._thread = threading.Thread(target=self._run, name="edgekv-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(2.0, 2 * self.interval_s))
        close = getattr(self._power, "close", None)
        if close is not None:
            close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    # ------------------------------------------------------------------ sampling
    @property
    def source(self) -> str:
        return type(self._power).__name__ if self._power is not None else "cpu"

    def sample(self) -> None:
        now = self._clock()
        figures = {}
        try:
            figures.update(self._process.read())
        except Exception as exc:
            self._count_error("process", exc)
        watts = None
        if self._power is not None:
            try:
                reading = self._power.read()
                if reading.power_mw is not None and not 0.0 <= reading.power_mw < math.inf:
                    # NaN would poison the energy sum for good, and no board draws negative or infinite power
                    raise ValueError(f"{self.source} read a board power of {reading.power_mw} mW")
                watts = None if reading.power_mw is None else reading.power_mw / 1000.0
                figures["rails_mw"] = dict(reading.rails_mw)
                if reading.gpu_load_pct is not None:
                    figures["gpu_load_pct"] = reading.gpu_load_pct
                if reading.ram_used_mb is not None:
                    figures["ram_used_mb"] = reading.ram_used_mb
                    figures["ram_total_mb"] = reading.ram_total_mb
                device_mem = getattr(reading, "device_mem_used_mb", None)
                if device_mem is not None:
                    figures["device_mem_used_mb"] = device_mem
                    self.peak_device_mem_mb = max(self.peak_device_mem_mb, device_mem)
            except Exception as exc:
                self._count_error("power", exc)
        with self._lock:
            self._energy.add(now, watts)
            figures["power_w"] = watts
            self._latest = figures

    def _count_error(self, what: str, exc: Exception) -> None:
        self._errors += 1
        if self._errors == 1:
            log.warning("monitor: %s reading failed (%s); counting further failures silently", what, exc)

    # ------------------------------------------------------------------ app reports
    def count_frames(self, total: int) -> None:
        """The app's running frame count; J per frame is energy between the first and latest report."""
        with self._lock:
            self._mark(self._frames, total)

    @property
    def frames_counted(self) -> int:
        """The latest frame total the app reported (with several cameras sharing a monitor: all of theirs)."""
        with self._lock:
            return self._frames[-1][0] if self._frames else 0

    def count_tokens(self, total: int) -> None:
        with self._lock:
            self._mark(self._tokens, total)

    def _mark(self, marks: list, total: int) -> None:
        entry = (total, self._energy.joules)
        if not marks:
            marks.append(entry)
        elif len(marks) == 1:
            marks.append(entry)
        else:
            marks[1] = entry

    @staticmethod
    def _per_unit(marks: list) -> float | None:
        if len(marks) < 2 or marks[1][0] <= marks[0][0]:
            return None
        return (marks[1][1] - marks[0][1]) / (marks[1][0] - marks[0][0])

    def energy_totals(self) -> tuple[float, float] | None:
        """(joules, seconds) integrated so far from the board power; None without a power reader. Two of them give
        the mean power between (``PowerPolicy``: a budget is about the power drawn, not one instant of it)."""
        with self._lock:
            return None if self._power is None else (self._energy.joules, self._energy.seconds)

    def snapshot(self) -> dict:
        with self._lock:
            snap = dict(self._latest)
            has_power = self._power is not None and snap.get("power_w") is not None
            snap.update({
                "backend": self.source,
                "energy_j": self._energy.joules if has_power else None,
                "j_per_frame": self._per_unit(self._frames) if has_power else None,
                "j_per_token": self._per_unit(self._tokens) if has_power else None,
                "monitor_errors": self._errors,
                "peak_device_mem_mb": self.peak_device_mem_mb or None,
                "power_mode": self.power_mode,
            })
        return snap
