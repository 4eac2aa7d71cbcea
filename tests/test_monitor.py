"""Monitor: energy integration, J per frame / per token, CPU-only figures, never raising into the app."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from edgekv.monitor import Monitor


@dataclass
class FakeReading:
    power_mw: float | None
    rails_mw: dict = field(default_factory=dict)
    ram_used_mb: float | None = None
    ram_total_mb: float | None = None
    gpu_load_pct: float | None = None


class TraceReader:
    """Plays back a power trace (mW); raises once to check the monitor survives a bad read."""

    def __init__(self, trace, fail_at=None):
        self.trace, self.index, self.fail_at = trace, 0, fail_at

    def read(self):
        i = self.index
        self.index += 1
        if i == self.fail_at:
            raise OSError("sensor went away")
        return FakeReading(self.trace[min(i, len(self.trace) - 1)], {"VDD_IN": self.trace[min(i, len(self.trace) - 1)]})


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_energy_is_the_trapezoid_of_power_and_j_per_frame_and_token():
    clock = Clock()
    monitor = Monitor(power_reader=TraceReader([10_000, 20_000, 20_000, 10_000]), clock=clock)
    monitor.sample()                     # t=0: 10 W
    monitor.count_frames(0)
    monitor.count_tokens(0)
    clock.t = 1.0
    monitor.sample()                     # t=1: 20 W -> 15 J
    clock.t = 2.0
    monitor.sample()                     # t=2: 20 W -> +20 J
    monitor.count_frames(10)
    clock.t = 4.0
    monitor.sample()                     # t=4: 10 W -> +30 J
    monitor.count_tokens(13)
    snap = monitor.snapshot()
    assert snap["energy_j"] == pytest.approx(65.0)
    assert snap["power_w"] == pytest.approx(10.0)
    assert snap["j_per_frame"] == pytest.approx(35.0 / 10)
    assert snap["j_per_token"] == pytest.approx(65.0 / 13)
    assert snap["rails_mw"] == {"VDD_IN": 10_000}


def test_a_failing_reader_is_counted_not_raised():
    clock = Clock()
    monitor = Monitor(power_reader=TraceReader([5_000] * 5, fail_at=1), clock=clock)
    for step in range(4):
        clock.t = float(step)
        monitor.sample()
    snap = monitor.snapshot()
    assert snap["monitor_errors"] == 1
    # the gap left by the failed read is not integrated across: 5 W over [2, 3] only
    assert snap["energy_j"] == pytest.approx(5.0)
    assert monitor.energy_totals() == pytest.approx((5.0, 1.0))  # the time it covers: a mean power of 5 W


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -4_000.0])
def test_a_power_that_is_not_a_number_is_an_error_not_a_reading(bad):
    """A sensor file that reads "nan" (or a broken driver's -4 W) must not be shown as watts, nor poison the energy
    sum for the rest of the run."""
    clock = Clock()
    monitor = Monitor(power_reader=TraceReader([5_000, bad, 5_000, 5_000]), clock=clock)
    seen = []
    for step in range(4):
        clock.t = float(step)
        monitor.sample()
        seen.append(monitor.snapshot()["power_w"])
    snap = monitor.snapshot()
    assert seen == [5.0, None, 5.0, 5.0]
    assert snap["monitor_errors"] == 1 and snap["energy_j"] == pytest.approx(5.0)  # 5 W over [2, 3] only


def test_cpu_only_reports_memory_and_no_invented_power():
    class Section:
        interval_s = 0.05
        backend = "cpu"

    monitor = Monitor(Section()).start()
    try:
        monitor.count_frames(0)
        monitor.count_frames(4)
        snap = monitor.snapshot()
    finally:
        monitor.stop()
    assert snap["backend"] == "cpu"
    assert snap["power_w"] is None and snap["energy_j"] is None and snap["j_per_frame"] is None
    assert monitor.energy_totals() is None
    assert snap["process_rss_mb"] > 10 and snap["peak_rss_mb"] >= snap["process_rss_mb"] * 0.5
    assert snap["ram_total_mb"] > snap["ram_used_mb"] > 0
    assert snap["cpu_time_s"] > 0


def _rapl_tree(root, energies, span=1000):
    for i, energy in enumerate(energies):
        zone = root / f"intel-rapl:{i}"
        zone.mkdir(parents=True, exist_ok=True)
        (zone / "name").write_text(f"package-{i}\n")
        (zone / "energy_uj").write_text(f"{energy}\n")
        (zone / "max_energy_range_uj").write_text(f"{span}\n")
    sub = root / "intel-rapl:0:0"  # a core sub-zone: inside the package, never added
    sub.mkdir(exist_ok=True)
    (sub / "energy_uj").write_text("5\n")


def test_rapl_reader_differences_the_counter_and_handles_wrap(tmp_path):
    from edgekv.monitor.rapl import RaplReader, RaplUnavailable

    clock = Clock()
    _rapl_tree(tmp_path, [100, 200])
    reader = RaplReader(tmp_path, clock=clock)
    assert reader.read().power_mw is None  # the first read has nothing to difference
    clock.t = 2.0
    _rapl_tree(tmp_path, [900, 50])  # package-1 wrapped: 50 + 1000 - 200 = 850 uJ
    reading = reader.read()
    assert reading.rails_mw == {"package-0": pytest.approx(0.4), "package-1": pytest.approx(0.425)}
    assert reading.power_mw == pytest.approx(0.825)
    with pytest.raises(RaplUnavailable):
        RaplReader(tmp_path / "missing")
