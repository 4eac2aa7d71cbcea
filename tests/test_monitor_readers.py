"""INA3221 sysfs (JetPack 5+ hwmon and JetPack 4 IIO), meminfo, devfreq GPU load, nvpmodel — on fake trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgekv.monitor.ina3221 import Ina3221Reader
from edgekv.monitor.jetson import gpu_load_pct, is_jetson, power_mode, read_meminfo
from edgekv.monitor.tegrastats import ReaderError


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_hwmon_layout_orin_nano_uses_vdd_in_and_skips_nc_and_the_sum(tmp_path):
    dev = tmp_path / "bus/i2c/devices/1-0040"
    _write(dev / "name", "ina3221\n")
    hw = dev / "hwmon/hwmon5"  # the index varies between boots
    for k, (label, mv, ma) in enumerate([("VDD_IN", 5000, 2400), ("VDD_CPU_GPU_CV", 5000, 900), ("NC", 1, 1)], 1):
        _write(hw / f"in{k}_label", label + "\n")
        _write(hw / f"in{k}_input", f"{mv}\n")
        _write(hw / f"curr{k}_input", f"{ma}\n")
    _write(hw / "in7_label", "sum of shunt voltages\n")
    _write(hw / "in7_input", "999\n")
    _write(hw / "curr7_input", "999\n")
    reading = Ina3221Reader(tmp_path).read()
    assert reading.rails_mw == {"VDD_IN": 12000.0, "VDD_CPU_GPU_CV": 4500.0}
    assert reading.power_mw == 12000.0


def test_hwmon_layout_agx_orin_adds_the_three_input_rails(tmp_path):
    rails = {"VDD_GPU_SOC": (5000, 480), "VDD_CPU_CV": (5000, 80), "VIN_SYS_5V0": (5000, 806),
             "VDDQ_VDD2_1V8AO": (5000, 60)}
    for device, names in (("1-0040", list(rails)[:3]), ("1-0041", list(rails)[3:])):
        _write(tmp_path / f"bus/i2c/devices/{device}/name", "ina3221\n")
        for k, name in enumerate(names, 1):
            hw = tmp_path / f"bus/i2c/devices/{device}/hwmon/hwmon{k + 2}"
            _write(hw / f"in{k}_label", name)
            _write(hw / f"in{k}_input", str(rails[name][0]))
            _write(hw / f"curr{k}_input", str(rails[name][1]))
    reading = Ina3221Reader(tmp_path).read()
    assert reading.power_mw == pytest.approx(2400 + 400 + 4030)  # VDDQ_VDD2_1V8AO is not added


def test_jetpack4_iio_layout(tmp_path):
    dev = tmp_path / "bus/i2c/devices/6-0040"
    _write(dev / "name", "ina3221x\n")
    iio = dev / "iio:device0"
    for k, (label, mw) in enumerate([("POM_5V_IN", 2444), ("POM_5V_GPU", 40), ("NC", 0)]):
        _write(iio / f"rail_name_{k}", label)
        _write(iio / f"in_power{k}_input", str(mw))
    reading = Ina3221Reader(tmp_path).read()
    assert reading.rails_mw == {"POM_5V_IN": 2444.0, "POM_5V_GPU": 40.0} and reading.power_mw == 2444.0


def test_no_sensor_is_a_reader_error(tmp_path):
    with pytest.raises(ReaderError, match="no INA3221"):
        Ina3221Reader(tmp_path)


def test_meminfo_devfreq_nvpmodel_and_jetson_detection(tmp_path):
    _write(tmp_path / "meminfo", "MemTotal: 7802232 kB\nMemFree: 1000000 kB\nBuffers: 102400 kB\n"
                                 "Cached: 2048000 kB\nNvMapMemUsed: 1048576 kB\n")
    mem = read_meminfo(tmp_path / "meminfo")
    assert mem["ram_used_mb"] == pytest.approx((7802232 - 1000000 - 102400 - 2048000) / 1024)
    assert mem["nvmap_used_mb"] == 1024
    gpu = tmp_path / "devfreq/17000000.gpu"
    _write(gpu / "device/of_node/name", "ga10b\x00")
    _write(gpu / "load", "632\n")
    _write(tmp_path / "devfreq/other/device/of_node/name", "emc")
    assert gpu_load_pct(tmp_path / "devfreq") == pytest.approx(63.2)
    assert power_mode("NV Power Mode: MAXN_SUPER\n2\n") == (2, "MAXN_SUPER")
    _write(tmp_path / "status", "pmode:0001 fmode:quiet\n")
    _write(tmp_path / "nvpmodel.conf", "< POWER_MODEL ID=0 NAME=15W >\n< POWER_MODEL ID=1 NAME=7W >\n")
    assert power_mode(None, tmp_path / "status", tmp_path / "nvpmodel.conf") == (1, "7W")
    assert power_mode(None, tmp_path / "missing", tmp_path / "nvpmodel.conf") is None
    assert not is_jetson(tmp_path)
    _write(tmp_path / "etc/nv_tegra_release", "# R36 (release), REVISION: 4.0\n")
    assert is_jetson(tmp_path)


def test_gpu_load_is_read_from_the_gpu_device_beside_its_devfreq_folder(tmp_path):
    """Orin JetPack 6 as the kernel lays it out: /sys/class/devfreq/17000000.gpu is the devfreq class folder
    (cur_freq, governor, ...); its ``device`` link is /sys/devices/platform/bus@0/17000000.gpu, which holds of_node
    and ``load`` (JETSON.md; jetson-stats reads it there)."""
    platform = tmp_path / "devices/platform/bus@0/17000000.gpu"
    _write(platform / "of_node/name", "gpu\x00")
    _write(platform / "load", "417\n")
    devfreq = tmp_path / "devfreq/17000000.gpu"
    _write(devfreq / "cur_freq", "305000000\n")
    (devfreq / "device").symlink_to(platform)
    assert gpu_load_pct(tmp_path / "devfreq") == pytest.approx(41.7)


def test_nvml_reader_with_a_fake_driver_and_without_one(monkeypatch):
    import sys
    import types

    from edgekv.monitor.nvml import NvmlReader

    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    with pytest.raises(ReaderError, match="nvidia-ml-py"):
        NvmlReader()

    fake = types.SimpleNamespace(
        NVMLError=RuntimeError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda i: "gpu0", nvmlDeviceGetPowerUsage=lambda h: 71_500,
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(used=3 * 2**30, total=80 * 2**30),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    reading = NvmlReader().read()
    assert (reading.power_mw, reading.gpu_load_pct, reading.device_mem_used_mb) == (71_500, 87, 3072)

    def not_supported(handle):
        raise RuntimeError("Not Supported")  # what Jetson's NVML answers

    fake.nvmlDeviceGetPowerUsage = not_supported
    with pytest.raises(ReaderError, match="no power reading"):
        NvmlReader()
