"""tegrastats parser on every captured line (tests/fixtures/tegrastats, sources in its README)."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from edgekv.monitor.tegrastats import ReaderError, TegrastatsReader, parse
from helpers_mqtt import until

FIXTURES = Path(__file__).parent / "fixtures" / "tegrastats"


def _line(name: str) -> str:
    return (FIXTURES / name).read_text().strip().splitlines()[0]


def test_agx_orin_jetpack5_sums_the_three_input_rails():
    s = parse(_line("agx-orin-64gb-jp5.txt"))
    assert (s.ram_used_mb, s.ram_total_mb, s.swap_used_mb) == (1282, 62795, 0)
    assert s.gpu_load_pct == 0 and s.emc_load_pct == 0 and len(s.cpu_load_pct) == 12
    assert s.rails_mw == {"VDD_GPU_SOC": 2399, "VDD_CPU_CV": 400, "VIN_SYS_5V0": 4032, "VDDQ_VDD2_1V8AO": 301}
    assert s.total_power_mw == 2399 + 400 + 4032  # VDDQ_VDD2_1V8AO is fed from VIN_SYS_5V0
    assert "CV0" not in s.temps_c and s.temps_c["tj"] == pytest.approx(42.593)
    assert s.timestamp.year == 2023


def test_agx_orin_jetpack6():
    s = parse(_line("agx-orin-64gb-jp6.2.1.txt"))
    assert (s.ram_used_mb, s.ram_total_mb) == (18202, 62841)
    assert s.gpu_load_pct == 0 and s.gpu_freq_mhz == 0
    assert s.rails_mw == {"VDD_GPU_SOC": 2412, "VDD_CPU_CV": 1607, "VIN_SYS_5V0": 4607}
    assert s.rails_avg_mw["VIN_SYS_5V0"] == 4657
    assert s.total_power_mw == 2412 + 1607 + 4607


def test_agx_orin_jetpack7_current_avg_max():
    s = parse(_line("agx-orin-jp7.2.txt"))
    assert s.swap_used_mb is None and s.gpu_load_pct == 12 and s.gpu_freq_mhz == 1300
    assert s.rails_mw == {"VDD_GPU_SOC": 5139, "VDD_CPU_CV": 3268, "VIN_SYS_5V0": 5500}
    assert s.total_power_mw == 5139 + 3268 + 5500
    assert s.temps_c["gpu"] == pytest.approx(47.625)


@pytest.mark.parametrize("name, rails, gpu", [
    ("agx-xavier-jp4-idle.txt", {"GPU": 0, "CPU": 311, "SOC": 932, "CV": 0, "VDDRQ": 621, "SYS5V": 1482}, 0),
    ("agx-xavier-jp4-yolov3.txt", {"GPU": 18401, "CPU": 2301, "SOC": 4602, "CV": 0, "VDDRQ": 2914, "SYS5V": 4632}, 95),
])
def test_agx_xavier_total_is_the_sum_of_its_six_rails(name, rails, gpu):
    """AGX Xavier has no board-total rail; its total is GPU + CPU + SOC + CV + VDDRQ + SYS5V (JETSON.md).
    Its CPU rail shares a name with the CPU load list and must not be lost to it."""
    s = parse(_line(name))
    assert s.rails_mw == rails and s.total_power_mw == sum(rails.values())
    assert s.gpu_load_pct == gpu and len(s.cpu_load_pct) == 8 and s.temps_c["CPU"] > 0


def test_agx_xavier_averages_are_kept_apart_from_currents():
    s = parse(_line("agx-xavier-jp4-yolov3.txt"))
    assert s.rails_avg_mw["GPU"] == 18525 and s.rails_avg_mw["CPU"] == 2330 and s.rails_mw["CPU"] == 2301


def test_orin_nano_uses_vdd_in():
    s = parse(_line("orin-nano-8gb-jp6.txt"))
    assert (s.ram_used_mb, s.ram_total_mb) == (6185, 7620)
    assert s.gpu_load_pct == 63 and s.gpu_freq_mhz == 621
    assert s.total_power_mw == 12479
    assert s.rails_mw == {"VDD_IN": 12479, "VDD_CPU_GPU_CV": 4667, "VDD_SOC": 2817}


def test_orin_nano_without_root_has_no_emc_and_no_gpu_frequency():
    s = parse(_line("orin-nano-jp6-nonroot.txt"))
    assert s.gpu_load_pct == 0 and s.gpu_freq_mhz is None and s.emc_load_pct is None
    assert s.total_power_mw == 4824


def test_jetpack4_style_rails_without_mw_and_unknown_totals():
    s = parse("RAM 1500/3964MB (lfb 100x4MB) CPU [10%@1479,off,off,5%@1479] EMC_FREQ 3%@1600 GR3D_FREQ 9%@921 "
              "POM_5V_IN 2444/2444 POM_5V_GPU 40/40 POM_5V_CPU 531/531")
    assert s.cpu_load_pct == [10, None, None, 5] and s.total_power_mw == 2444
    assert parse("RAM 1/2MB CPU [1%@1] GPU_X 5mW/5mW").total_power_mw is None


def test_malformed_lines_say_what_is_missing():
    with pytest.raises(ValueError, match="RAM used/totalMB"):
        parse("hello world")


def test_reader_runs_a_tegrastats_binary(tmp_path):
    script = tmp_path / "tegrastats"
    lines = "\n".join(_line(name) for name in sorted(os.listdir(FIXTURES)) if name.endswith(".txt"))
    script.write_text(f"#!/bin/sh\necho 'garbage'\ncat <<'EOF'\n{lines}\nEOF\nsleep 5\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    reader = TegrastatsReader(str(script), interval_ms=100)
    try:
        deadline = time.monotonic() + 5
        while reader.latest is None or reader.latest.ram_total_mb != 7620 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        reading = reader.read()
    finally:
        reader.close()
    assert reader.bad_lines == 1
    assert reading.power_mw == 4824 and reading.source == "tegrastats"  # the last fixture line (sorted)


def _fake_tegrastats(tmp_path: Path, body: str) -> str:
    script = tmp_path / "tegrastats"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def _wait_for(condition) -> None:
    assert until(condition)  # helpers_mqtt.until: polls with a generous bound


def test_a_tegrastats_that_exited_is_an_error_not_its_last_line(tmp_path):
    line = _line("orin-nano-8gb-jp6.txt")
    reader = TegrastatsReader(_fake_tegrastats(tmp_path, f"echo '{line}'\nexit 3"), interval_ms=100)
    try:
        _wait_for(lambda: reader.process.poll() is not None and not reader._thread.is_alive())
        assert reader.latest is not None and reader.latest.total_power_mw == 12479  # it did print one line
        with pytest.raises(ReaderError, match="exited with code 3"):
            reader.read()
    finally:
        reader.close()


def test_a_hung_tegrastats_is_an_error_once_its_line_is_stale(tmp_path):
    now = [100.0]
    line = _line("orin-nano-8gb-jp6.txt")
    reader = TegrastatsReader(_fake_tegrastats(tmp_path, f"echo '{line}'\nexec sleep 60"), interval_ms=1000,
                              clock=lambda: now[0])
    try:
        _wait_for(lambda: reader.latest is not None)
        assert reader.read().power_mw == 12479
        now[0] += 4.9  # within five intervals (5 s): still today's reading
        assert reader.read().power_mw == 12479
        now[0] += 1.0
        with pytest.raises(ReaderError, match="no line for 6 s"):
            reader.read()
    finally:
        reader.close()


def test_bytes_that_are_not_utf8_are_a_bad_line_not_the_end_of_the_reader(tmp_path):
    line = _line("orin-nano-jp6-nonroot.txt")
    body = f"printf 'RAM \\377\\376/7620MB garbled\\n'\necho '{line}'\nexec sleep 60"
    reader = TegrastatsReader(_fake_tegrastats(tmp_path, body), interval_ms=100)
    try:
        _wait_for(lambda: reader.latest is not None)
        assert reader._thread.is_alive() and reader.bad_lines == 1
        assert reader.read().power_mw == 4824
    finally:
        reader.close()
