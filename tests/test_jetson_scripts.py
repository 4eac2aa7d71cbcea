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
    out = subprocess.run(["bash", str(JETSON / "install.sh"), "--dry-run"], capture_output=True, text=True,
                         env={**os.environ, "EDGEKV_PROFILE": "orin-agx-64gb"})
    assert out.returncode == 0, out.stderr
    assert "python3-libnvinfer" in out.stdout and "--system-site-packages" in out.stdout
    assert "-c /opt/edgekv/torch-pin.txt" in out.stdout
    assert "[server,export]" in out.stdout and "edgekv build --config /etc/edgekv/deploy.yaml" in out.stdout


# ---------------------------------------------------------------------------------------------- issue 25 §3
def _install(model: str | None, tmp_path: Path, mem_kb: int = 64_000_000, **env: str) -> subprocess.CompletedProcess:
    tree, meminfo = tmp_path / "model", tmp_path / "meminfo"
    if model is not None:
        tree.write_bytes(model.encode() + b"\0")  # the device tree's string ends with a NUL
    meminfo.write_text(f"MemTotal:       {mem_kb} kB\nMemFree:         1000000 kB\n")  # /proc/meminfo's layout
    environ = {**os.environ, "EDGEKV_DEVICE_TREE_MODEL": str(tree), "EDGEKV_MEMINFO": str(meminfo), **env}
    return subprocess.run(["bash", str(JETSON / "install.sh"), "--dry-run"], capture_output=True, text=True,
                          env=environ)


@pytest.mark.parametrize("model, profile", [
    ("NVIDIA Jetson Orin Nano Engineering Reference Developer Kit Super", "orin-nano-8gb.yaml"),
    ("NVIDIA Jetson AGX Orin Developer Kit", "orin-agx-64gb.yaml"),
])
def test_install_picks_the_profile_of_the_board(tmp_path, model, profile):
    out = _install(model, tmp_path)
    assert out.returncode == 0, out.stderr
    installs = [line for line in out.stdout.splitlines() if "/etc/edgekv/deploy.yaml" in line and "install -m" in line]
    assert len(installs) == 1 and installs[0].split()[-2].endswith(f"configs/{profile}"), out.stdout


@pytest.mark.parametrize("model, mem_kb, gib", [
    ("NVIDIA Jetson Orin Nano Developer Kit", 3_550_000, 6),  # an Orin Nano 4 GB (~3.4 GiB to Linux)
    ("NVIDIA Jetson AGX Orin Developer Kit", 31_000_000, 48),  # an AGX Orin 32 GB
])
def test_install_refuses_a_profile_too_big_for_the_boards_memory_unless_told(tmp_path, model, mem_kb, gib):
    """The model string does not say the memory: a 4 GB Orin Nano got the 8 GB profile."""
    out = _install(model, tmp_path, mem_kb=mem_kb)
    assert out.returncode == 2 and f"with {mem_kb // 1024} MiB of memory" in out.stderr
    assert "EDGEKV_PROFILE" in out.stderr
    assert f"for one of at least {gib} GiB" in out.stderr and "edgekv plan --config FILE" in out.stderr
    assert _install(model, tmp_path, mem_kb=7_800_000 if gib == 6 else 64_000_000).returncode == 0
    assert _install(model, tmp_path, mem_kb=mem_kb, EDGEKV_PROFILE="orin-nano-8gb").returncode == 0  # told


def test_install_refuses_a_board_it_has_no_profile_for_unless_told(tmp_path):
    out = _install("Raspberry Pi 5 Model B Rev 1.0", tmp_path)
    assert out.returncode == 2 and "EDGEKV_PROFILE" in out.stderr
    out = _install("Raspberry Pi 5 Model B Rev 1.0", tmp_path, EDGEKV_PROFILE="orin-nano-8gb")
    assert out.returncode == 0 and "configs/orin-nano-8gb.yaml /etc/edgekv/deploy.yaml" in out.stdout


def test_install_never_pulls_the_cpu_onnxruntime_on_a_jetson(tmp_path):
    out = _install("NVIDIA Jetson AGX Orin Developer Kit", tmp_path)
    pips = [line for line in out.stdout.splitlines() if "pip install" in line]
    assert pips and not any("engines]" in line or " onnxruntime" in line for line in pips), pips
    assert any("[server,export]" in line for line in pips)  # edgekv build's exporters, without onnxruntime
    out = _install("NVIDIA Jetson AGX Orin Developer Kit", tmp_path, EDGEKV_ORT_WHEEL="/tmp/onnxruntime_gpu.whl")
    assert any("pip install /tmp/onnxruntime_gpu.whl" in line for line in out.stdout.splitlines())


def test_install_makes_the_state_and_archive_folders(tmp_path):
    out = _install("NVIDIA Jetson AGX Orin Developer Kit", tmp_path)
    assert "/var/lib/edgekv" in out.stdout and "audio" in out.stdout


def test_the_unit_lets_the_daemon_write_its_memory_read_home_and_use_a_microphone():
    unit = (JETSON / "edgekv-camera.service").read_text()
    directives = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert directives["StateDirectory"] == "edgekv"  # /var/lib/edgekv: snapshots and the archive (README)
    assert "/var/lib/edgekv" in directives["ReadWritePaths"].split()
    assert directives["ProtectHome"] == "read-only"  # weights under /home stay readable
    assert "audio" in directives["SupplementaryGroups"].split()


def test_the_unit_lets_a_csi_camera_reach_nvargus_through_its_private_tmp():
    """nvarguscamerasrc talks to nvargus-daemon over /tmp/argus_socket (the Dockerfile mounts it for the same
    reason); PrivateTmp=yes alone hides it and every csi: source fails under systemd only."""
    unit = (JETSON / "edgekv-camera.service").read_text()
    directives = [line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#")]
    assert ["PrivateTmp", "yes"] in directives
    binds = [path.lstrip("-").split(":")[0]
             for key, value in directives if key == "BindPaths" for path in value.split()]
    assert "/tmp/argus_socket" in binds


def test_the_container_listens_beyond_itself_and_can_build_engines():
    docker = (JETSON / "Dockerfile").read_text()
    entry = next(line for line in docker.splitlines() if line.startswith("ENTRYPOINT"))
    assert '"--host", "0.0.0.0"' in entry  # 127.0.0.1 inside a container is reached by nothing published
    assert "[server,export]" in docker and "-p 127.0.0.1:8080:8080" in docker


def test_the_ros2_launch_package_parses_and_starts_the_daemon_with_a_valid_config():
    """jetson/ros2/edgekv_ros2 (optional, never imported by edgekv): package.xml is a format-3 ament_python
    package, setup.py and the launch file are valid Python that start edgekv-camera on a ros2: source, and the
    example config loads with edgekv's own config loader. (Whether `ros2 launch` runs it needs ROS: not here.)"""
    import ast
    import xml.etree.ElementTree as ET

    from edgekv.config import load_config

    package = JETSON / "ros2" / "edgekv_ros2"
    root = ET.parse(package / "package.xml").getroot()
    assert root.tag == "package" and root.get("format") == "3" and root.findtext("name") == "edgekv_ros2"
    assert root.find("export/build_type").text == "ament_python"
    assert (package / "resource" / "edgekv_ros2").is_file()
    for file in (package / "setup.py", package / "launch" / "edgekv_camera.launch.py"):
        tree = ast.parse(file.read_text(), filename=str(file))
        imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
        imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
        assert not [name for name in imported if name.split(".")[0] == "edgekv"], file  # it only starts the process
    launch = (package / "launch" / "edgekv_camera.launch.py").read_text()
    assert "def generate_launch_description" in launch and '"ros2:"' in launch and "ros2.enabled=true" in launch
    config = load_config(package / "config" / "robot.yaml")
    assert config.video.source == "ros2:/camera/image_raw" and config.ros2.enabled and config.ros2.namespace == "/edgekv"


def test_install_on_a_machine_without_a_device_tree_says_so_in_one_line(tmp_path):
    """No /proc/device-tree/model (not a Jetson, a container): bash printed its own "No such file or directory"
    error line before the refusal."""
    out = _install(None, tmp_path)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [f"no deployment profile for this board (unknown: no {tmp_path / 'model'}, not "
                                       f"a Jetson?): set EDGEKV_PROFILE to one of configs/*.yaml (without .yaml)"]
    assert _install(None, tmp_path, EDGEKV_PROFILE="orin-nano-8gb").returncode == 0


@pytest.mark.parametrize("release, code", [
    ("# R35 (release), REVISION: 6.0, GCID: 37399711, BOARD: t186ref, EABI: aarch64, DATE: Fri Jul 19 2024\n", 2),
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64, DATE: Wed Jan  8 2025\n", 0),
])
def test_install_refuses_jetpack_5_before_installing_anything(tmp_path, release, code):
    """/etc/nv_tegra_release's first line names the L4T release (R36 = JetPack 6). JetPack 5's Python 3.8 and
    TensorRT 8.5 cannot run edgekv (Python >= 3.10, TensorRT 10): one line saying so, nothing installed."""
    (tmp_path / "nv_tegra_release").write_text(release)
    out = _install("NVIDIA Jetson AGX Orin Developer Kit", tmp_path,
                   EDGEKV_TEGRA_RELEASE=str(tmp_path / "nv_tegra_release"))
    assert out.returncode == code, out.stderr
    if code:
        assert out.stderr.strip().splitlines() == [
            "this board runs L4T R35 (JetPack 5 or older: Python 3.8, TensorRT 8); edgekv needs JetPack 6 (L4T R36: "
            "Python 3.10, TensorRT 10): flash JetPack 6 first"]
        assert "apt-get" not in out.stdout
