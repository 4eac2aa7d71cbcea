"""One `edgekv` import namespace over the design card's folders, from a wheel and from an editable install."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["edgekv", "edgekv.model", "edgekv.cache", "edgekv.policies", "edgekv.monitor", "edgekv.video",
               "edgekv.kernels", "edgekv.engines", "edgekv.calibration", "edgekv.apps"]
PROBE = (
    "import importlib, importlib.resources, json\n"
    f"mods = {SUBPACKAGES!r}\n"
    "paths = {m: importlib.import_module(m).__file__ for m in mods}\n"
    "page = importlib.resources.files('edgekv.apps').joinpath('static/index.html').is_file()\n"
    "print(json.dumps({'paths': paths, 'page': page}))\n"
)


def _probe(python: str, cwd: Path) -> dict:
    import json

    out = subprocess.run([python, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_editable_install_maps_the_top_level_folders(tmp_path):
    found = _probe(sys.executable, tmp_path)
    assert found["page"]
    assert Path(found["paths"]["edgekv.kernels"]).parent == ROOT / "kernels"
    assert Path(found["paths"]["edgekv.apps"]).parent == ROOT / "apps"
    assert Path(found["paths"]["edgekv.model"]).parent == ROOT / "edgekv" / "model"


@pytest.mark.slow
def test_wheel_installs_into_a_throwaway_venv(tmp_path):
    wheels = tmp_path / "wheels"
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (wheel,) = wheels.glob("edgekv-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    site = Path(subprocess.run([str(env_dir / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    # dependencies (torch, numpy, ...) come from this environment as a plain path: its .pth files (and so
    # the editable finder that maps edgekv to the source tree) are not processed there
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    found = _probe(str(env_dir / "bin" / "python"), tmp_path)
    assert found["page"]
    for module, path in found["paths"].items():
        assert Path(path).is_relative_to(site), (module, path)
