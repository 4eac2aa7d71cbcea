"""CPU package power from Linux RAPL counters (``/sys/class/powercap/intel-rapl:N/energy_uj``).

On a CPU-only host this is the only honest power figure: the package energy counter (microjoules,
wrapping at ``max_energy_range_uj``) differenced over time. Sub-zones (``intel-rapl:N:M``: cores,
uncore, dram) are inside their package and are not added. Many VMs expose no powercap tree; then there
is no reader and the monitor reports no power rather than a guess.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class RaplReading:
    power_mw: float | None
    rails_mw: dict = field(default_factory=dict)
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    gpu_load_pct: float | None = None
    source: str = "rapl"


class RaplUnavailable(OSError):
    pass


class RaplReader:
    def __init__(self, root: str | Path = "/sys/class/powercap", clock=time.monotonic) -> None:
        base = Path(root)
        self.zones = sorted(p for p in base.glob("intel-rapl:*") if p.name.count(":") == 1
                            and (p / "energy_uj").is_file()) if base.is_dir() else []
        if not self.zones:
            raise RaplUnavailable(f"no RAPL package zones under {base}")
        self.names = [(z / "name").read_text().strip() if (z / "name").is_file() else z.name for z in self.zones]
        self.ranges = [int((z / "max_energy_range_uj").read_text()) if (z / "max_energy_range_uj").is_file()
                       else 2**32 for z in self.zones]
        self.clock = clock
        self._last = None

    def _energy(self) -> list[int]:
        return [int((z / "energy_uj").read_text()) for z in self.zones]

    def read(self) -> RaplReading:
        now, energy = self.clock(), self._energy()
        last, self._last = self._last, (now, energy)
        if last is None or now <= last[0]:
            return RaplReading(None)
        rails = {}
        for name, span, before, after in zip(self.names, self.ranges, last[1], energy):
            delta = after - before if after >= before else after + span - before  # the counter wrapped
            rails[name] = delta / (now - last[0]) / 1000.0  # uJ/s -> mW
        return RaplReading(sum(rails.values()), rails)
