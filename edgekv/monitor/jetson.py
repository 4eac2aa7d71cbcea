"""Jetson facts from files: unified memory, GPU load, power mode (paths are parameters, for tests).

- ``/proc/meminfo``: used = MemTotal − MemFree − Buffers − Cached; ``NvMapMemUsed`` is GPU-shared memory.
- GPU load: the devfreq device whose ``of_node/name`` is the GPU (``ga10b``, ``gv11b``, ``gpu``); the ``load`` file
  of that GPU device (``devfreq/X/device/load``) is per-mille (it may appear only some time after boot).
- Power mode: ``nvpmodel -q`` prints ``NV Power Mode: NAME`` and the id on the next line; without the
  binary, ``/var/lib/nvpmodel/status`` (``pmode:0002 ...``) mapped through ``/etc/nvpmodel.conf``'s
  ``< POWER_MODEL ID=n NAME=X >`` lines.
"""

from __future__ import annotations

import re
from pathlib import Path

GPU_NODE_NAMES = ("ga10b", "gv11b", "gp10b", "gpu")


def read_meminfo(path: str | Path = "/proc/meminfo") -> dict[str, float]:
    values = {}
    for line in Path(path).read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) / 1024.0  # kB -> MiB
    used = values["MemTotal"] - values["MemFree"] - values.get("Buffers", 0.0) - values.get("Cached", 0.0)
    return {"ram_total_mb": values["MemTotal"], "ram_used_mb": used, "nvmap_used_mb": values.get("NvMapMemUsed")}


def gpu_load_pct(devfreq_root: str | Path = "/sys/class/devfreq") -> float | None:
    for device in sorted(Path(devfreq_root).glob("*")):
        name_file = device / "device" / "of_node" / "name"
        if not name_file.is_file():
            name_file = device / "of_node" / "name"
        try:
            name = name_file.read_text().strip("\x00\n ")
            if name in GPU_NODE_NAMES:
                # ``load`` is the GPU device's attribute (devfreq/X/device/load, i.e. .../17000000.gpu/load), not
                # one of the devfreq class's own files (a ``load`` in the class folder itself is read otherwise)
                load = device / "device" / "load"
                load = load if load.is_file() else device / "load"
                return int(load.read_text().split()[0]) / 10.0
        except (OSError, ValueError, IndexError):
            continue
    return None


_CONF_MODEL = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)\s*>")


def power_mode(nvpmodel_output: str | None = None, status_path: str | Path = "/var/lib/nvpmodel/status",
               conf_path: str | Path = "/etc/nvpmodel.conf") -> tuple[int, str] | None:
    """(id, name) of the current nvpmodel mode, or None when it cannot be known."""
    if nvpmodel_output:
        match = re.search(r"NV Power Mode:\s*(\S+)\s*\n\s*(\d+)", nvpmodel_output)
        if match:
            return int(match.group(2)), match.group(1)
    try:
        status = Path(status_path).read_text()
        mode = int(re.search(r"pmode:(\d+)", status).group(1))
        names = {int(i): n for i, n in _CONF_MODEL.findall(Path(conf_path).read_text())}
    except (OSError, AttributeError):
        return None
    return mode, names.get(mode, f"mode {mode}")


def is_jetson(root: str | Path = "/") -> bool:
    base = Path(root)
    if (base / "etc" / "nv_tegra_release").exists():
        return True
    try:
        return b"nvidia,tegra" in (base / "proc" / "device-tree" / "compatible").read_bytes()
    except OSError:
        return False
