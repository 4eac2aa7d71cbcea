"""Power-aware sampling and the privacy switch (issue 31 §2-3): battery and thermal readings from a fake sysfs
tree in the kernel's layout, the policy's hysteresis, a daemon whose sampling rate drops and recovers as the
files change, and pause/resume through the API with the camera released while paused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers_wait import until

from edgekv.apps.daemon.power import PowerPolicy
from edgekv.config import EdgeKVConfig, PowerSection
from edgekv.monitor.conditions import read_battery, read_temperatures


def _tree(root: Path, battery: float | None = 80, status: str = "Discharging", temps: dict | None = None) -> Path:
    """/sys/class as the kernel lays it out: power_supply/<name>/{type,capacity,status}, thermal/thermal_zoneN/."""
    ac = root / "power_supply" / "AC0"
    ac.mkdir(parents=True, exist_ok=True)
    (ac / "type").write_text("Mains\n")
    (ac / "online").write_text("0\n")
    if battery is not None:
        bat = root / "power_supply" / "BAT0"
        bat.mkdir(parents=True, exist_ok=True)
        (bat / "type").write_text("Battery\n")
        (bat / "capacity").write_text(f"{battery:g}\n")
        (bat / "status").write_text(f"{status}\n")
    for index, (kind, celsius) in enumerate((temps or {"cpu-thermal": 45.0, "gpu-thermal": 44.5}).items()):
        zone = root / "thermal" / f"thermal_zone{index}"
        zone.mkdir(parents=True, exist_ok=True)
        (zone / "type").write_text(f"{kind}\n")
        (zone / "temp").write_text(f"{int(celsius * 1000)}\n")
    return root


def test_readers_follow_the_sysfs_layout(tmp_path):
    root = _tree(tmp_path, battery=42, temps={"CPU-therm": 51.5, "GPU-therm": 49.0, "PMIC-Die": -256.0})
    battery = read_battery(root / "power_supply")
    assert battery.name == "BAT0" and battery.percent == 42 and battery.discharging
    assert read_temperatures(root / "thermal") == {"CPU-therm": 51.5, "GPU-therm": 49.0}  # an off sensor left out
    assert read_battery(tmp_path / "nowhere") is None and read_temperatures(tmp_path / "nowhere") == {}
    (root / "power_supply" / "BAT0" / "capacity").write_text("garbage\n")
    assert read_battery(root / "power_supply") is None


def test_the_pmic_stub_zone_of_a_nano_or_xavier_is_not_a_hot_device(tmp_path):
    """Jetson Nano / Xavier thermal zones at idle: PMIC-Die reads a constant 100 °C (only its 120/140 °C threshold
    steps are news), which must not hold the device in power saving forever."""
    temps = {"AO-therm": 38.5, "CPU-therm": 41.0, "GPU-therm": 39.5, "PLL-therm": 37.0, "PMIC-Die": 100.0,
             "thermal-fan-est": 40.0}
    root = _tree(tmp_path, battery=None, temps=temps)
    assert "PMIC-Die" not in read_temperatures(root / "thermal")
    policy = PowerPolicy(PowerSection(enabled=True, sysfs=str(root)), clock=lambda: 0.0)
    assert policy.check() is None and not policy.saving
    (root / "thermal" / "thermal_zone4" / "temp").write_text("140000\n")  # the PMIC crossed its 140 °C flag
    assert read_temperatures(root / "thermal")["PMIC-Die"] == 140.0


def test_the_policy_saves_and_recovers_with_hysteresis(tmp_path):
    root = _tree(tmp_path, battery=50)
    now, watts = [0.0], [5.0]
    policy = PowerPolicy(PowerSection(enabled=True, sysfs=str(root), check_s=1.0, budget_w=10.0),
                         power_w=lambda: watts[0], clock=lambda: now[0])
    bat, zone = root / "power_supply" / "BAT0", root / "thermal" / "thermal_zone0"
    steps = [(lambda: None, None), (lambda: (bat / "capacity").write_text("15"), True),
             (lambda: (bat / "capacity").write_text("22"), None),  # inside the hysteresis band: still saving
             (lambda: (bat / "capacity").write_text("30"), False),
             (lambda: (zone / "temp").write_text("91000"), True), (lambda: (zone / "temp").write_text("82000"), None),
             (lambda: (zone / "temp").write_text("60000"), False),
             (lambda: watts.__setitem__(0, 12.0), True), (lambda: watts.__setitem__(0, 9.5), None),
             (lambda: watts.__setitem__(0, 8.0), False),
             (lambda: ((bat / "capacity").write_text("10"), (bat / "status").write_text("Charging")), None)]
    seen = []
    for change, _ in steps:
        change()
        now[0] += 1.0
        seen.append(policy.check())
    assert seen == [expected for _, expected in steps]
    assert policy.changes == 6
    now[0] += 0.5
    assert policy.check() is None  # not read again before check_s


def test_the_budget_is_held_to_the_mean_power_not_the_instant_a_check_lands_on(tmp_path):
    """A board draws in bursts: instants of 12 and 8 W around a 10 W budget switched saving on and off at every check
    (past the 10 % band); the mean since the last check, from the monitor's energy, is 10 W, under an 11 W budget."""
    root = _tree(tmp_path, battery=50)
    now, joules, seconds, instant = [0.0], [0.0], [0.0], [12.0]

    def policy(**energy) -> PowerPolicy:
        return PowerPolicy(PowerSection(enabled=True, sysfs=str(root), check_s=1.0, budget_w=11.0),
                           power_w=lambda: instant[0], clock=lambda: now[0], **energy)

    averaged, instants = policy(energy=lambda: (joules[0], seconds[0])), policy()
    seen = []
    for check in range(8):
        joules[0], seconds[0] = joules[0] + 10.0, seconds[0] + 1.0  # 12 W for half the second, 8 W for the rest
        instant[0] = 12.0 if check % 2 == 0 else 8.0
        now[0] += 1.0
        seen.append((averaged.check(), instants.check()))
    assert [a for a, _ in seen] == [True] + [None] * 7  # the first check has no mean yet: the instant's 12 W
    assert [i for _, i in seen] == [True, False] * 4  # the instant, as before: flapping
    assert averaged.read().power_w == instant[0]  # no energy covered since: the instant
    joules[0] += 40.0
    seconds[0] += 4.0
    assert averaged.read().power_w == 10.0
    assert policy(energy=lambda: None).read().power_w == instant[0]  # no power reader's energy: the instant


def _config(tmp_path, **sections) -> EdgeKVConfig:
    base = dict(model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
                video={"source": "synthetic:events?size=112x112&fps=8&frames=100000&seed=2", "fps": 4.0,
                       "resolution": [112, 112]},
                cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
                server={"port": 0}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2})
    base.update(sections)
    return EdgeKVConfig().with_overrides(**base)


def test_the_daemon_lowers_and_restores_its_rate_as_the_readings_change(tmp_path):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon

    root = _tree(tmp_path / "sys", battery=80)
    config = _config(tmp_path, power={"enabled": True, "sysfs": str(root), "check_s": 0.05, "save_fps_factor": 0.5})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        daemon = run.daemon
        assert daemon.sampler.fps == 4.0
        (root / "power_supply" / "BAT0" / "capacity").write_text("12\n")
        assert until(lambda: daemon.sampler.fps == 2.0)
        assert daemon.session.ingestor.skipper is not None  # static pairs skipped more eagerly while saving
        (root / "power_supply" / "BAT0" / "capacity").write_text("90\n")
        assert until(lambda: daemon.sampler.fps == 4.0)
        (root / "thermal" / "thermal_zone1" / "temp").write_text("97000\n")
        assert until(lambda: daemon.sampler.fps == 2.0)
        (root / "thermal" / "thermal_zone1" / "temp").write_text("50000\n")
        assert until(lambda: daemon.sampler.fps == 4.0)
        assert daemon.session.ingestor.skipper is None  # as configured (skip_static off)
    log = (tmp_path / "out.txt").read_text()
    assert "power: saving (battery 12 % < 20 %): video.fps 4 -> 2" in log
    assert "gpu-thermal at 97.0 °C > 85 °C" in log and log.count("power: normal (conditions cleared)") == 2


def _track_sources(monkeypatch) -> tuple[list, list]:
    """The video sources the daemon opens, and those closed since (its camera released)."""
    import edgekv.apps.daemon.loop as loop

    opened, closed = [], []
    real = loop.open_video_source

    def tracked(config):
        spec, source = real(config)
        opened.append(source)
        close = source.close
        source.close = lambda: (closed.append(source), close())
        return spec, source

    monkeypatch.setattr(loop, "open_video_source", tracked)
    return opened, closed


def test_pause_releases_the_camera_and_resume_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call

    opened, closed = _track_sources(monkeypatch)
    with RunningDaemon(_config(tmp_path), tmp_path / "out.txt") as run:
        daemon, port = run.daemon, run.port
        status, _, raw = call(port, "POST", "/v1/privacy/pause", {})
        assert status == 200 and json.loads(raw) == {"paused": True, "reason": "privacy switch (API)"}
        assert until(lambda: opened[0] in closed)  # the camera is released
        assert json.loads(call(port, "GET", "/healthz")[2])["stream_state"] == "paused"
        metrics = call(port, "GET", "/metrics")[2].decode()
        assert 'edgekv_stream_state{state="paused"} 1.0' in metrics
        frames = daemon.session.counters.frames
        status, _, raw = call(port, "POST", "/v1/chat/completions",  # still answers about what was seen
                              {"messages": [{"role": "user", "content": "Which shape was purple?"}], "max_tokens": 2})
        assert status == 200
        assert daemon.session.counters.frames == frames  # nothing ingested while paused
        # ... nor collected: an answer while paused started the backlog's collector on the released camera's
        # sampler, whose last frame then went in after the resume stamped as the new source's (the stream's time
        # ran ahead, some seconds a pause)
        assert daemon._collector is None and len(daemon.backlog) == 0
        last_t = daemon.session.clock.last_t
        status, _, raw = call(port, "POST", "/v1/privacy/resume", {})
        assert status == 200 and json.loads(raw)["paused"] is False and len(opened) == 2
        assert until(lambda: daemon.session.counters.frames >= frames + 4)
        assert daemon.session.clock.last_t > last_t  # the stream's time went on after the pause
        assert daemon.session.stats()["clock_jumps"] == 0
        assert json.loads(call(port, "GET", "/healthz")[2])["stream_state"] == "running"


def test_a_pause_holds_across_a_restart_until_resumed(tmp_path, monkeypatch):
    """A device told to stop watching that restarted (a power cycle, a crash, an update) watched again: the pause
    lived in the process. With state.dir it is kept there until the resume; the restarted daemon starts paused,
    its camera's capture never started (no frame read) and the source closed, and answers as before."""
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call

    opened, closed = _track_sources(monkeypatch)
    config = _config(tmp_path).with_overrides(state={"dir": str(tmp_path / "state")})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        assert until(lambda: run.daemon.session.counters.frames >= 2)
        assert call(run.port, "POST", "/v1/privacy/pause", {})[0] == 200
        frames = run.daemon.session.counters.frames
    assert (tmp_path / "state" / "paused.json").is_file()
    with RunningDaemon(config, tmp_path / "out2.txt") as run:
        daemon = run.daemon
        state = json.loads(call(run.port, "GET", "/v1/privacy")[2])
        assert state["paused"] is True and "kept across the restart" in state["reason"], state
        assert daemon.session.counters.frames == frames  # the memory came back, and nothing new went in
        assert opened[-1] in closed and daemon.sampler.stats()["frames_read"] == 0
        status, _, _ = call(run.port, "POST", "/v1/chat/completions",
                            {"messages": [{"role": "user", "content": "Which shape was purple?"}], "max_tokens": 2})
        assert status == 200
        assert call(run.port, "POST", "/v1/privacy/resume", {})[0] == 200
        assert until(lambda: daemon.session.counters.frames >= frames + 2)
    assert not (tmp_path / "state" / "paused.json").exists()
    with RunningDaemon(config, tmp_path / "out3.txt") as run:
        assert json.loads(call(run.port, "GET", "/v1/privacy")[2])["paused"] is False
        assert until(lambda: run.daemon.session.counters.frames >= frames + 4)
