"""Power, memory and load monitoring: tegrastats lines, INA3221 sysfs rails, NVML, or CPU-only."""

from edgekv.monitor.sampler import Monitor

__all__ = ["Monitor"]
