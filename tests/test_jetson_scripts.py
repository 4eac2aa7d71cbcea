"""jetson/: shellcheck on the scripts, systemd-analyze on the unit, and the --dry-run outputs.

What this can show: the scripts are clean shell and do what they print; the unit parses and its
directives are valid for this systemd. What it cannot: that anything works on a Jetson (none of it ran
on one)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

JETSON = Path(__file__).resolve().parents[1] / "jetson"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (apt-get install shellcheck)")
def test_shellcheck_is_clean():
    out = subprocess.run(["shellcheck", "install.sh", "power-mode.sh"], cwd=JETSON, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (apt-get install systemd)")
def test_unit_verifies(tmp_path):
    # ExecStart must name an existing executable for verify; everything else is the shipped unit
    unit = (JETSON / "edgekv-camera.service").read_text().replace(
        "/opt/edgekv/venv/bin/edgekv-camera", shutil.which("true"))
    path = tmp_path / "edgekv-camera.service"
    path.write_text(unit)
    out = subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Type=notify" in unit and "WatchdogSec=" in unit and "Restart=on-failure" in unit


def test_power_mode_dry_run_reads_ids_from_nvpmodel_conf(tmp_path):
    conf = tmp_path / "nvpmodel.conf"
    conf.write_text("< POWER_MODEL ID=0 NAME=MAXN >\n< POWER_MODEL ID=1 NAME=15W >\n< POWER_MODEL ID=2 NAME=30W >\n")
    env = {**os.environ, "NVPMODEL_CONF": str(conf)}
    run = lambda *args: subprocess.run(["bash", str(JETSON / "power-mode.sh"), *args], capture_output=True,
                                       text=True, env=env)
    assert run("set", "30W", "--dry-run").stdout.strip() == "+ nvpmodel -m 2"
    assert run("list").stdout.split() == ["0", "MAXN", "1", "15W", "2", "30W"]
    missing = run("set", "99W", "--dry-run")
    assert missing.returncode == 2 and "no power mode named 99W" in missing.stderr
    assert "jetson_clocks --store" in run("clocks-on", "--dry-run").stdout


def test_install_dry_run_pins_nvidias_torch():
    out = subprocess.run(["bash", str(JETSON / "install.sh"), "--dry-run"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "python3-libnvinfer" in out.stdout and "--system-site-packages" in out.stdout
    assert "-c /opt/edgekv/torch-pin.txt" in out.stdout
    assert "[server,engines]" in out.stdout and "edgekv build --config /etc/edgekv/deploy.yaml" in out.stdout
