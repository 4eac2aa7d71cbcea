"""Power-aware sampling (``power:`` in the config): a device on a battery, hot, or over its power budget samples
fewer frames (``video.fps`` x ``power.save_fps_factor``) and skips static frame pairs more eagerly
(``video.skip_static`` on, at ``power.save_skip_threshold``), and returns to the configured rate when the
conditions clear. Every change is logged with its reason.

Readings: the battery and the thermal zones from sysfs (``edgekv.monitor.conditions``), the board power from
the daemon's monitor (tegrastats / INA3221 / NVML). Hysteresis keeps a reading at the line from flapping: the
battery must recover 5 points above ``battery_low_pct`` (or the device be charging), the temperature fall 5 °C
below ``hot_c``, the power 10 % below ``budget_w``. The power is the mean since the last check (the monitor's
energy over the time it covers), not the instant the check lands on: a board draws in bursts (a pair's prefill,
then idle until the next frame), and instants of 12 and 8 W around a 10 W budget switched saving on and off at
every check, past any 10 % band.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgekv.monitor.conditions import read_battery, read_temperatures

log = logging.getLogger("edgekv.power")


@dataclass(frozen=True)
class Reading:
    battery_pct: float | None
    discharging: bool
    hottest: tuple[str, float] | None
    power_w: float | None


class PowerPolicy:
    def __init__(self, section, power_w: Callable[[], float | None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 energy: Callable[[], tuple[float, float] | None] | None = None) -> None:
        """``power_w``: the board power now; ``energy``: (joules, seconds) integrated so far (``Monitor``'s
        ``energy_totals``), whose difference between two checks is the mean power used instead when it covers any
        time."""
        self.section, self.power_w, self.clock, self.energy = section, power_w, clock, energy
        self.saving = False
        self.reasons: list[str] = []
        self.changes = 0
        self._last: float | None = None
        self._energy_mark: tuple[float, float] | None = None

    def read(self) -> Reading:
        root = Path(self.section.sysfs)
        battery = read_battery(root / "power_supply")
        temps = read_temperatures(root / "thermal")
        hottest = max(temps.items(), key=lambda item: item[1]) if temps else None
        return Reading(battery.percent if battery else None, bool(battery and battery.discharging), hottest,
                       self._power())

    def _power(self) -> float | None:
        """The mean board power since the last reading where the energy covers some of that time, else now's."""
        totals = self.energy() if self.energy is not None else None
        mark, self._energy_mark = self._energy_mark, totals
        if totals is not None and mark is not None:
            joules, seconds = totals[0] - mark[0], totals[1] - mark[1]
            if seconds > 0 and joules >= 0:
                return joules / seconds
        return self.power_w()

    def causes(self, reading: Reading) -> list[str]:
        """Why the device should save now (with hysteresis when it already does); empty: normal."""
        s, out = self.section, []
        low = s.battery_low_pct + (5.0 if self.saving else 0.0)
        if reading.battery_pct is not None and reading.discharging and reading.battery_pct < low:
            out.append(f"battery {reading.battery_pct:.0f} % < {low:g} %")
        if reading.hottest is not None:
            hot = s.hot_c - (5.0 if self.saving else 0.0)
            zone, celsius = reading.hottest
            if celsius > hot:
                out.append(f"{zone} at {celsius:.1f} °C > {hot:g} °C")
        if s.budget_w is not None and reading.power_w is not None:
            budget = s.budget_w * (0.9 if self.saving else 1.0)
            if reading.power_w > budget:
                out.append(f"board power {reading.power_w:.1f} W > {budget:g} W")
        return out

    def check(self) -> bool | None:
        """Read the conditions if ``check_s`` passed; True = start saving, False = back to normal, None = no
        change."""
        now = self.clock()
        if self._last is not None and now - self._last < self.section.check_s:
            return None
        self._last = now
        causes = self.causes(self.read())
        if bool(causes) == self.saving:
            self.reasons = causes or self.reasons
            return None
        self.saving, self.changes = bool(causes), self.changes + 1
        self.reasons = causes
        return self.saving
