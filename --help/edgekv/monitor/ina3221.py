"""Board power from the INA3221 sensors' sysfs (JETSON.md "Power without tegrastats").

JetPack 5+: ``/sys/bus/i2c/devices/*/name == ina3221`` → ``hwmon/hwmon*/in{K}_label``, ``in{K}_input``
(mV), ``curr{K}_input`` (mA); mW = mV × mA / 1000. The hwmon index changes between boots, so it is
globbed; labels containing ``NC`` and the ``in7`` sum channel are skipped. JetPack 4: the ``ina3221x``
IIO driver, ``rail_name_K`` and ``in_powerK_input`` (mW), channels from 0. Board total by the module
rule shared with tegrastats (``board_total_mw``).
"""

from __future__ import annotations

from pathlib import Path

from edgekv.monitor.tegrastats import PowerReading, ReaderError, board_total_mw


def _read(path: Path) -> str:
    return path.read_text().strip()


def find_ina3221(sysfs_root: str | Path = "/sys") -> list[dict[str, tuple[Path, ...]]]:
    """Every INA3221 device's channels: [{label: (voltage_mV_file, current_mA_file) or (power_mW_file,)}]."""
    devices = []
    for name_file in sorted(Path(sysfs_root).glob("bus/i2c/devices/*/name")):
        kind = _read(name_file)
        device = name_file.parent
        if kind == "ina3221":
            for hwmon in sorted(device.glob("hwmon/hwmon*")):
                channels = {}
                for label_file in sorted(hwmon.glob("in*_label")):
                    index = label_file.name[2:-len("_label")]
                    label = _read(label_file)
                    if index == "7" or "NC" in label.split("_") or label.startswith("NC"):
                        continue
                    channels[label] = (hwmon / f"in{index}_input", hwmon / f"curr{index}_input")
                if channels:
                    devices.append(channels)
        elif kind == "ina3221x":
            for iio in sorted(device.glob("iio:device*")):
                channels = {}
                for rail_file in sorted(iio.glob("rail_name_*")):
                    index = rail_file.name.rsplit("_", 1)[1]
                    label = _read(rail_file)
                    if "NC" not in label:
                        channels[label] = (iio / f"in_power{index}_input",)
                if channels:
                    devices.append(channels)
    return devices


class Ina3221Reader:
    def __init__(self, sysfs_root: str | Path = "/sys") -> None:
        self.devices = find_ina3221(sysfs_root)
        if not self.devices:
            raise ReaderError(f"no INA3221 sensors under {sysfs_root}/bus/i2c/devices")

    def read(self) -> PowerReading:
        rails: dict[str, float] = {}
        for channels in self.devices:
            for label, files in channels.items():
                try:
                    if len(files) == 2:
                        rails[label] = int(_read(files[0])) * int(_read(files[1])) / 1000.0
                    else:
                        rails[label] = float(_read(files[0]))
                except (OSError, ValueError):
                    continue  # a channel that did not answer this time; the next sample tries again
        return PowerReading(board_total_mw(rails), rails, source="ina3221")
