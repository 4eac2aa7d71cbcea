"""Desktop/server GPU power, energy, memory and load through NVML (``pynvml`` from nvidia-ml-py).

``nvmlDeviceGetPowerUsage`` (mW, a 1 s average on Ampere and newer), ``nvmlDeviceGetMemoryInfo``,
``nvmlDeviceGetUtilizationRates``. On a Jetson NVML initializes but power/memory/utilization answer
NotSupported (JETSON.md): that is reported as unavailable so the monitor moves on to tegrastats/INA3221.
``NvmlEnergy`` reads ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded): the energy of a
run is the difference of two readings (``edgekv bench stream``: J per frame and per token).
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


def _pynvml():
    """The NVML binding (nvidia-ml-py), or ReaderError saying it is missing."""
    try:
        import pynvml
    except ImportError as exc:
        raise ReaderError("NVML needs the nvidia-ml-py package (import pynvml)") from exc
    return pynvml


class NvmlReader:
    def __init__(self, index: int = 0) -> None:
        self.nvml = pynvml = _pynvml()
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


class NvmlEnergy:
    """A GPU's total energy counter: ``nvmlDeviceGetTotalEnergyConsumption``, millijoules the whole board
    has used since the driver last loaded (Volta and newer). The difference of two readings is the energy
    the GPU used in between, for every process on it, idle time included; the host's CPU and memory are
    not in it. The GPU is found by ``uuid`` ("GPU-…", as ``torch.cuda.get_device_properties(i).uuid``
    prints it after that prefix) when given, else by NVML ``index``; ``where`` says which.

    Raises ``ReaderError`` saying why when pynvml is missing or the GPU has no energy counter, so a caller
    reports the figures as unavailable instead of failing.
    """

    def __init__(self, index: int = 0, uuid: str | None = None) -> None:
        self.nvml = pynvml = _pynvml()
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise ReaderError(f"NVML did not initialize: {exc}") from exc
        try:
            if uuid is not None:
                self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
                self.where = f"GPU {uuid}"
            else:
                self.handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                self.where = f"NVML GPU index {index}"
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)  # NotSupported before Volta: fail here
        except pynvml.NVMLError as exc:
            self.close()
            found = f"GPU {uuid}" if uuid is not None else f"GPU {index}"
            raise ReaderError(f"NVML has no total energy counter for {found}: {exc}") from exc

    def read_mj(self) -> int:
        """Millijoules since the driver loaded (monotonic); ``ReaderError`` when NVML cannot answer (a
        measurement that loses a reading halfway has no difference to report)."""
        try:
            return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))
        except self.nvml.NVMLError as exc:
            raise ReaderError(f"NVML's total energy counter of {self.where} did not answer: {exc}") from exc

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass  # already shut down: nothing to release
