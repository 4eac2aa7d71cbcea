"""Desktop/server GPU power, energy, memory and load through NVML (``pynvml`` from nvidia-ml-py).

``nvmlDeviceGetPowerUsage`` (mW, a 1 s average on Ampere and newer), ``nvmlDeviceGetMemoryInfo``,
``nvmlDeviceGetUtilizationRates``. On a Jetson NVML initializes but power/memory/utilization answer
NotSupported (JETSON.md): that is reported as unavailable so the monitor moves on to tegrastats/INA3221.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from edgekv.monitor.tegrastats import ReaderError


@dataclass(frozen=True)
class NvmlReading:
    power_mw: float | None
    rails_mw: dict = field(default_factory=dict)
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    gpu_load_pct: float | None = None
    device_mem_used_mb: float | None = None
    source: str = "nvml"


class NvmlReader:
    def __init__(self, index: int = 0) -> None:
        try:
            import pynvml
        except ImportError as exc:
            raise ReaderError("NVML needs the nvidia-ml-py package (import pynvml)") from exc
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
            self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            pynvml.nvmlDeviceGetPowerUsage(self.handle)  # NotSupported on Jetson: fail here, not later
        except pynvml.NVMLError as exc:
            raise ReaderError(f"NVML has no power reading for GPU {index}: {exc}") from exc

    def read(self) -> NvmlReading:
        nvml = self.nvml
        try:
            power = float(nvml.nvmlDeviceGetPowerUsage(self.handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(self.handle)
            load = float(nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except nvml.NVMLError:
            return NvmlReading(None)
        return NvmlReading(power, {"GPU": power}, gpu_load_pct=load, device_mem_used_mb=memory.used / 2**20)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass  # already shut down: nothing to release
