"""Battery and temperature from Linux sysfs, as the kernel lays them out (and as tegrastats reads them on a
Jetson): ``/sys/class/power_supply/<name>/{type,capacity,status}`` (Documentation/ABI/testing/sysfs-class-power)
and ``/sys/class/thermal/thermal_zone<N>/{type,temp}`` (millidegrees Celsius; Documentation/driver-api/thermal).
Missing files, unreadable values and absent devices read as "unknown" (None), never as an error: a desktop has
no battery, a container may hide /sys."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


# Jetson Nano/TX2/Xavier's PMIC has no temperature register, only 120 °C and 140 °C threshold flags: its zone reads
# 100 °C while below the first (NVIDIA forum "What does each temperature zone mean", tegrastats' PMIC@100C), then
# 120 or 140. Read as a temperature, every such board would be "hot" at idle; jetson-stats skips it too.
PMIC_STUB_ZONE = "PMIC-Die"


@dataclass(frozen=True)
class Battery:
    name: str
    percent: float
    discharging: bool


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def read_battery(root: str | Path = "/sys/class/power_supply") -> Battery | None:
    """The first battery (``type`` = Battery) with a readable ``capacity``, or None."""
    base = Path(root)
    if not base.is_dir():
        return None
    for supply in sorted(base.iterdir()):
        if _read(supply / "type") != "Battery":
            continue
        capacity = _read(supply / "capacity")
        try:
            percent = float(capacity)
        except (TypeError, ValueError):
            continue
        status = (_read(supply / "status") or "").lower()
        return Battery(supply.name, percent, discharging=status in ("discharging", "not charging"))
    return None


def read_temperatures(root: str | Path = "/sys/class/thermal") -> dict[str, float]:
    """Zone type -> degrees Celsius for every thermal zone with a readable ``temp`` (the hottest of a type)."""
    base = Path(root)
    out: dict[str, float] = {}
    if not base.is_dir():
        return out
    for zone in sorted(base.glob("thermal_zone*")):
        raw = _read(zone / "temp")
        try:
            celsius = int(raw) / 1000.0
        except (TypeError, ValueError):
            continue
        if celsius <= -200:  # some zones report -256000 when the sensor is off
            continue
        kind = _read(zone / "type") or zone.name
        if kind == PMIC_STUB_ZONE and celsius <= 100.0:
            continue  # not a temperature: "below 120 °C" (see PMIC_STUB_ZONE)
        out[kind] = max(celsius, out.get(kind, celsius))
    return out
