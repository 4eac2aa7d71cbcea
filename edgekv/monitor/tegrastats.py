"""tegrastats lines -> samples (RAM, GPU load, rails, board power), and a reader that runs the binary.

Format (captured lines in tests/fixtures/tegrastats; jetson_stats' tegra_parse documents the variants):
optional ``MM-DD-YYYY HH:MM:SS``; ``RAM used/totalMB (lfb ...)``; optional ``SWAP used/totalMB``;
``CPU [load%@MHz,...]`` with ``off`` cores; ``EMC_FREQ X%@MHz`` or ``X%``; GPU as ``GR3D_FREQ X%@MHz``
(JetPack 5), ``X%@[MHz,...]`` (JetPack 6/7) or ``X%`` (no root); temperatures ``name@C`` (JetPack 7:
``cur/max``; -256C = no sensor); power rails ``NAME curmW/avgmW`` (JetPack 7 adds ``/max``; JetPack 4
has no ``mW``); ``NC`` rails are not connected.

Board total (JETSON.md): ``VDD_IN`` on Orin Nano/NX and Xavier NX; AGX Orin has none, so
VDD_GPU_SOC + VDD_CPU_CV + VIN_SYS_5V0 (never VDDQ_VDD2_1V8AO, which VIN_SYS_5V0 feeds); the original
Nano ``POM_5V_IN``; AGX Xavier the sum of its GPU CPU SOC CV VDDRQ SYS5V rails. Otherwise unknown (None).
"""

from __future__ import annotations

import re
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime


class ReaderError(RuntimeError):
    """A power source that is not there (binary missing, sensor tree absent)."""


@dataclass(frozen=True)
class PowerReading:
    power_mw: float | None
    rails_mw: dict[str, float] = field(default_factory=dict)
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    gpu_load_pct: float | None = None
    source: str = ""


@dataclass(frozen=True)
class TegrastatsSample:
    timestamp: datetime | None
    ram_used_mb: float
    ram_total_mb: float
    swap_used_mb: float | None
    swap_total_mb: float | None
    cpu_load_pct: list[float | None]
    gpu_load_pct: float | None
    gpu_freq_mhz: float | None
    emc_load_pct: float | None
    temps_c: dict[str, float]
    rails_mw: dict[str, float]
    rails_avg_mw: dict[str, float]
    total_power_mw: float | None


_TIME = re.compile(r"^(\d{2}-\d{2}-\d{4} \d{2}:\d{2}:\d{2})\s+")
_RAM = re.compile(r"\bRAM (\d+)/(\d+)MB")
_SWAP = re.compile(r"\bSWAP (\d+)/(\d+)MB")
_CPU = re.compile(r"\bCPU \[([^\]]*)\]")
_EMC = re.compile(r"\bEMC_FREQ (\d+)%")
_GPU = re.compile(r"\bGR3D_FREQ (\d+)%(?:@\[?([\d,]+)\]?)?")
_TEMP = re.compile(r"\b([A-Za-z][\w]*)@(-?[\d.]+)C(?:/-?[\d.]+C)?")
_RAIL = re.compile(r"\b([A-Z][A-Z0-9_]+) (\d+)(?:mW)?/(\d+)(?:mW)?(?:/(\d+)(?:mW)?)?")
_AGX_ORIN = ("VDD_GPU_SOC", "VDD_CPU_CV", "VIN_SYS_5V0")
_AGX_XAVIER = ("GPU", "CPU", "SOC", "CV", "VDDRQ", "SYS5V")


def board_total_mw(rails: dict[str, float]) -> float | None:
    """The module's input power by JETSON.md's rule, or None when it cannot be known."""
    if "VDD_IN" in rails:
        return rails["VDD_IN"]
    if "POM_5V_IN" in rails:
        return rails["POM_5V_IN"]
    if all(name in rails for name in _AGX_ORIN):
        return sum(rails[name] for name in _AGX_ORIN)
    if all(name in rails for name in _AGX_XAVIER):
        return sum(rails[name] for name in _AGX_XAVIER)
    return None


def parse(line: str) -> TegrastatsSample:
    """Parse one tegrastats line; ``ValueError`` names what is missing."""
    ram = _RAM.search(line)
    if ram is None:
        raise ValueError(f"not a tegrastats line (no 'RAM used/totalMB'): {line[:80]!r}")
    stamp = _TIME.match(line)
    swap = _SWAP.search(line)
    cpu = _CPU.search(line)
    emc = _EMC.search(line)
    gpu = _GPU.search(line)
    rails, averages = {}, {}
    tail = line[cpu.end():] if cpu else line
    for name, current, average, _peak in _RAIL.findall(tail):
        # "CPU" is a rail name on AGX Xavier ("CPU 311/311"); the "CPU [..]" load list never matches _RAIL
        if name == "NC" or name in ("RAM", "SWAP", "EMC_FREQ", "GR3D_FREQ", "GR3D2_FREQ"):
            continue
        rails[name], averages[name] = float(current), float(average)
    temps = {name: float(value) for name, value in _TEMP.findall(tail)
             if float(value) > -256 and not name.endswith("FREQ")}
    freqs = [float(f) for f in gpu.group(2).split(",")] if gpu and gpu.group(2) else []
    return TegrastatsSample(
        timestamp=datetime.strptime(stamp.group(1), "%m-%d-%Y %H:%M:%S") if stamp else None,
        ram_used_mb=float(ram.group(1)), ram_total_mb=float(ram.group(2)),
        swap_used_mb=float(swap.group(1)) if swap else None, swap_total_mb=float(swap.group(2)) if swap else None,
        cpu_load_pct=[None if c.strip() == "off" else float(c.split("%")[0]) for c in cpu.group(1).split(",")]
        if cpu else [],
        gpu_load_pct=float(gpu.group(1)) if gpu else None,
        gpu_freq_mhz=max(freqs) if freqs else None,
        emc_load_pct=float(emc.group(1)) if emc else None,
        temps_c=temps, rails_mw=rails, rails_avg_mw=averages, total_power_mw=board_total_mw(rails),
    )


class TegrastatsReader:
    """Runs ``tegrastats --interval N`` and keeps the newest parsed line; never raises into the app.

    ``read`` raises ``ReaderError`` once tegrastats has exited, or has printed no line for ``stale_s`` (default
    five intervals, at least 5 s): the last line of a dead or hung tegrastats is not today's power. Bytes that are
    not UTF-8 are replaced, so one garbled line is a bad line rather than the end of the reading thread."""

    def __init__(self, path: str = "tegrastats", interval_ms: int = 1000, stale_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        try:
            self.process = subprocess.Popen([path, "--interval", str(interval_ms)], stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, text=True, errors="replace", bufsize=1)
        except OSError as exc:
            raise ReaderError(f"cannot run {path!r}: {exc}") from exc
        self.stale_s = max(5.0, 5 * interval_ms / 1000.0) if stale_s is None else stale_s
        self.clock = clock
        self.latest: TegrastatsSample | None = None
        self.latest_at: float | None = None
        self.bad_lines = 0
        self._thread = threading.Thread(target=self._pump, name="edgekv-tegrastats", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            try:
                sample = parse(line)
            except ValueError:
                self.bad_lines += 1
                continue
            self.latest_at = self.clock()  # before ``latest``: a reader that sees a sample also sees its time
            self.latest = sample

    def read(self) -> PowerReading:
        sample, at = self.latest, self.latest_at
        if self.process.poll() is not None:
            raise ReaderError(f"tegrastats exited with code {self.process.returncode}")
        if sample is None:
            return PowerReading(None, source="tegrastats")
        if self.clock() - at > self.stale_s:
            raise ReaderError(f"tegrastats printed no line for {self.clock() - at:.0f} s (hung?); its last "
                              "reading is not reported")
        return PowerReading(sample.total_power_mw, dict(sample.rails_mw), sample.ram_used_mb, sample.ram_total_mb,
                            sample.gpu_load_pct, "tegrastats")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._thread.join(timeout=2)
