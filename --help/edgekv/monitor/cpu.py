"""CPU-only figures: this process's RSS (and peak), CPU time, and system memory (psutil).

There is no power sensor on a plain CPU machine: ``power_mw`` is None and the monitor says so rather
than inventing watts.
"""

from __future__ import annotations

import resource

import psutil


class ProcessReader:
    """Memory and CPU time of the current process and the machine."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak_rss_mb = 0.0

    def read(self) -> dict:
        info = self.process.memory_info()
        rss_mb = info.rss / 2**20
        self.peak_rss_mb = max(self.peak_rss_mb, rss_mb, _ru_maxrss_mb())
        times = self.process.cpu_times()
        memory = psutil.virtual_memory()
        return {
            "process_rss_mb": rss_mb,
            "peak_rss_mb": self.peak_rss_mb,
            "cpu_time_s": times.user + times.system,
            "ram_used_mb": (memory.total - memory.available) / 2**20,
            "ram_total_mb": memory.total / 2**20,
        }


def _ru_maxrss_mb() -> float:
    # ru_maxrss is in KiB on Linux: the kernel's own high-water mark, catches peaks between samples
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
