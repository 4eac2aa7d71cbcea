"""edgekv as a user installs it: ``python -m edgekv``, a command whose modules need an extra that is not installed,
``edgekv build`` without its exporter, and the oldest Python that setup.cfg's ``python_requires`` admits."""

from __future__ import annotations

import configparser
import glob
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from stage_package import stage  # noqa: E402


def _run(code: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "EDGEKV_DEBUG"}
    return subprocess.run(code, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_python_dash_m_edgekv_is_the_edgekv_command(tmp_path):
    """Where the console scripts are not on PATH (pip install --user, a venv not activated) ``python -m edgekv``
    is the command; it said "No module named edgekv.__main__"."""
    import edgekv

    out = _run([sys.executable, "-m", "edgekv", "--version"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"edgekv {edgekv.__version__}"
    out = _run([sys.executable, "-m", "edgekv", "--help"], tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: edgekv ") and "make-tiny-checkpoint" in out.stdout


WITHOUT_OPENCV = "import sys; sys.modules['cv2'] = None; from edgekv.apps.cli import main; sys.exit(main(sys.argv[1:]))"


@pytest.mark.parametrize("argv", [["eval", "--help"], ["average-toy", "--help"], ["bag", "--help"],
                                  ["bench", "stream", "--help"]])
def test_commands_that_import_edgekv_video_start_without_opencv(tmp_path, argv):
    """``pip install edgekv`` has no OpenCV (the ``video`` extra). These commands import edgekv.video while their
    options are added: each was a 25-line traceback, even for ``--help``, then one line naming the extra; edgekv.video
    now imports without OpenCV (the synthetic: videos need none), so their help is there."""
    out = _run([sys.executable, "-c", WITHOUT_OPENCV, *argv], tmp_path)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr and out.stdout.startswith(f"usage: edgekv {argv[0]}")


def test_a_video_file_without_opencv_is_refused_in_one_line_naming_the_extra(tmp_path):
    """What does need OpenCV (a video file) says which extra, in one line, and exits 2."""
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\0" * 64)
    out = _run([sys.executable, "-c", WITHOUT_OPENCV, "bench", "stream", "--model", "builtin:toy", "--source",
                str(clip), "--frames", "4", "--json", str(tmp_path / "out.json")], tmp_path)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.strip().splitlines() if line.startswith("edgekv bench: ")]
    assert len(lines) == 1 and "pip install 'edgekv[video]'" in lines[0] and "clip.mp4" in lines[0], out.stderr


def test_edgekv_build_without_the_exporter_names_the_extra(tmp_path, monkeypatch, capsys):
    """``edgekv build`` in an install without ``[engines]`` / ``[export]`` loaded the model and then stopped at
    "No module named 'onnxscript'", naming no extra."""
    from edgekv.apps.cli import main

    monkeypatch.setitem(sys.modules, "onnxscript", None)  # find_spec and import both see it missing
    monkeypatch.delenv("EDGEKV_DEBUG", raising=False)
    code = main(["build", "builtin:toy", "--dtype", "fp32", "--resolution", "112", "112", "--max-tokens", "640",
                 "--engine-dir", str(tmp_path / "engines"), "--quiet"])
    err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("edgekv build: ") and "onnxscript" in lines[0]
    assert "pip install 'edgekv[engines]'" in lines[0] and "'edgekv[export]'" in lines[0]
    assert not list((tmp_path / "engines").glob("*/*.onnx"))


def _core_requirement(name: str) -> Requirement:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in config["options"]["install_requires"].splitlines() if line.strip()]
    (found,) = [Requirement(line) for line in lines if Requirement(line).name == name]
    return found


def test_the_torch_floor_is_the_first_torch_the_code_runs_on():
    """``torch>=2.3`` installed beside torch 2.3 or 2.4, whose SDPA has no ``enable_gqa`` (edgekv/attention.py passes
    it on every chunk prefill) and whose torch.onnx.export has no ``dynamo``: a TypeError at the first question. The
    floor is 2.5, written so that NVIDIA's JetPack 6.1/6.2 wheel (a 2.5 pre-release) is in it; pip compares an
    installed torch with pre-releases allowed (jetson/install.sh pins the installed one)."""
    torch = _core_requirement("torch")
    assert not torch.specifier.contains("2.4.1", prereleases=True)
    assert torch.specifier.contains("2.5.0a0+872d972e41.nv24.08", prereleases=True)
    assert torch.specifier.contains("2.5.1") and torch.specifier.contains("2.13.0")


def _oldest_python() -> str | None:
    """An interpreter of the oldest Python version setup.cfg admits (JetPack 6's 3.10), if this machine has one."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floor = config["options"]["python_requires"].strip()
    assert floor.startswith(">="), floor
    version = floor[2:].strip()
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(os.path.expanduser(f"~/.pyenv/versions/{version}.*/bin/python{version}")))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True, timeout=60)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return candidate
    return None


OLDEST_PROBE = """
import compileall, sys
sys.path.insert(0, sys.argv[1])
assert compileall.compile_dir(sys.argv[1] + "/edgekv", quiet=1, force=True, legacy=False), "a syntax error"
from edgekv.apps.wall_times import parse_wall_time
for text in ("2026-12-04T10:03:00Z", "2026-12-04 10:03z"):
    assert parse_wall_time(text) == parse_wall_time(text[:-1] + "+00:00"), text
print("ok")
"""


def test_the_oldest_python_admitted_compiles_the_package_and_reads_wall_times(tmp_path):
    """requires-python >= 3.10 is JetPack 6's Python; the suite runs on 3.11. Python 3.10's datetime.fromisoformat
    refuses a final "Z", so ``edgekv ask --from 2026-12-04T10:03:00Z`` (the form wall_times.py documents) was refused
    there as "not a wall time". Runs where this machine has that interpreter (pyenv's here); the modules read are
    the standard library's alone."""
    python = _oldest_python()
    if python is None:
        pytest.skip("no interpreter of the oldest Python version setup.cfg admits on this machine")
    staged = stage(tmp_path / "staged")
    out = _run([python, "-c", OLDEST_PROBE, str(staged)], tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


class _OpenCV48:
    """The parts of ``cv2`` 4.8.0 (``opencv-python-headless==4.8.0.76``, edgekv[video]'s floor) that start-up
    touches: ``cv2.utils`` without ``logging``; the log level is set with ``cv2.setLogLevel``."""

    def __init__(self) -> None:
        self.utils = types.SimpleNamespace()
        self.levels: list[int] = []

    def setLogLevel(self, level: int) -> int:  # noqa: N802 (OpenCV's name)
        self.levels.append(level)
        return 0


def test_the_daemon_starts_with_the_oldest_opencv_the_video_extra_admits(monkeypatch):
    """``opencv-python-headless==4.8.0.76`` satisfies ``edgekv[video]`` (>=4.8) but has no ``cv2.utils.logging``:
    every daemon start stopped at an AttributeError traceback before reading a frame."""
    from edgekv.apps.daemon.startup import quiet_native_stderr

    old = _OpenCV48()
    monkeypatch.setitem(sys.modules, "cv2", old)
    with quiet_native_stderr():
        pass
    assert old.levels == [2]  # cv::utils::logging::LOG_LEVEL_ERROR
    levels = []
    new = types.SimpleNamespace(utils=types.SimpleNamespace(logging=types.SimpleNamespace(
        LOG_LEVEL_ERROR=2, setLogLevel=levels.append)))  # 5.1 (what pip takes now): no cv2.setLogLevel
    monkeypatch.setitem(sys.modules, "cv2", new)
    with quiet_native_stderr():
        pass
    assert levels == [2]


@pytest.mark.slow
def test_the_help_s_example_runs_from_a_folder_without_configs(tmp_path):
    """``edgekv-camera --help`` named configs/cpu-demo.yaml, which a wheel did not install; the shipped configs are
    package data now, found by name. The help's run (from a folder with no configs/) answers the demo's quiz as
    the source tree's file does."""
    import re
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from edgekv.apps.daemon.camera import build_parser

    command = shlex.split(build_parser().epilog.split("example: ")[1].splitlines()[0])
    assert command[:3] == ["edgekv-camera", "--config", "cpu-demo"]
    ask = command.index("--ask")
    command = command[:ask] + command[ask + 2:] + ["--no-server"]  # the quiz alone, on no port
    root = Path(__file__).resolve().parents[1]
    runs = [subprocess.run([sys.executable, "-m", "edgekv.apps.daemon.camera", *args], cwd=cwd, capture_output=True,
                           text=True, timeout=600)
            for args, cwd in ((command[1:], tmp_path),
                              (["--config", "configs/cpu-demo.yaml", "--no-stdin", "--no-server", "--exit-at-end",
                                "--quiz", "10"], root))]
    scores = [re.search(r"quiz: \d+/10 correct about \d+ events? seen.*", run.stdout) for run in runs]
    assert all(run.returncode == 0 for run in runs) and all(scores), [run.stderr[-500:] for run in runs]
    assert scores[0].group(0) == scores[1].group(0)


def test_a_terminal_that_cannot_show_an_answer_gets_it_escaped_not_an_exit(tmp_path):
    """``PYTHONIOENCODING=ascii edgekv ask ...`` exited 2 on an answer with a non-ASCII character ("'ascii' codec
    can't encode"); stdout is escaped now, as the daemon's own lines are. Any command's stdout: here a path."""
    import subprocess
    import sys

    folder = tmp_path / "caméra"
    out = subprocess.run([sys.executable, "-m", "edgekv", "make-tiny-checkpoint", str(folder)], capture_output=True,
                         env={**os.environ, "PYTHONIOENCODING": "ascii"}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert b"cam\\xe9ra" in out.stdout and (folder / "config.json").is_file()
