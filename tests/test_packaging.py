"""One `edgekv` import namespace over the design card's folders, from a wheel and from an editable install."""

from __future__ import annotations

import email
import importlib.metadata
import json
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
SUBPACKAGES = ["edgekv", "edgekv.model", "edgekv.cache", "edgekv.policies", "edgekv.monitor", "edgekv.video",
               "edgekv.kernels", "edgekv.engines", "edgekv.calibration", "edgekv.apps", "edgekv.apps.daemon",
               "edgekv.apps.server", "edgekv.apps.bench", "edgekv.apps.voice"]
PROBE = (
    "import importlib, importlib.resources, json\n"
    f"mods = {SUBPACKAGES!r}\n"
    "paths = {m: importlib.import_module(m).__file__ for m in mods}\n"
    "page = importlib.resources.files('edgekv.apps.server').joinpath('static/index.html').is_file()\n"
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(wheels), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    (built,) = wheels.glob("edgekv-*.whl")
    return built


@pytest.mark.slow
def test_wheel_installs_into_a_throwaway_venv(tmp_path, wheel):
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


# ---------------------------------------------------------------------------------------------- no extras
def _core_requirements(wheel: Path) -> list[Requirement]:
    """The wheel's Requires-Dist without any extra: what ``pip install edgekv`` installs."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.message_from_bytes(archive.read(metadata))
    requirements = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(requirements: list[Requirement]) -> dict[str, importlib.metadata.Distribution]:
    """Those distributions and everything they need (no extras), as installed in this environment."""
    found: dict[str, importlib.metadata.Distribution] = {}
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = importlib.metadata.distribution(requirement.name)
        for line in found[name].requires or []:
            nested = Requirement(line)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                todo.append(nested)
    return found


def _link_distributions(dists: dict[str, importlib.metadata.Distribution], site: Path) -> None:
    """Make exactly these installed distributions importable from ``site`` (symlinks, no copies)."""
    for dist in dists.values():
        root = Path(dist.locate_file(""))
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (site / top).exists():
                (site / top).symlink_to(root / top)


SESSION_PROBE = """
import importlib.util, json, sys
import numpy as np
import edgekv
rt = edgekv.Runtime.from_pretrained(sys.argv[1], model={"dtype": "fp32", "device": "cpu"},
                                    video={"resolution": [56, 84]}, cache={"max_tokens": 512, "text_reserve_tokens": 64})
session = rt.session()
rng = np.random.default_rng(0)
for i in range(4):  # 60x80 frames: each is resized to the 56x84 grid (Pillow bicubic)
    session.ingest(rng.integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=i * 0.5)
answer = session.ask("What is there?", max_new_tokens=3)
# bf16 on CPU: decode through the C kernel the wheel ships as source (built here at first use) when a
# compiler is on PATH
bf16 = edgekv.Runtime.from_pretrained(sys.argv[1], model={"dtype": "bf16", "device": "cpu"},
                                      video={"resolution": [56, 84]}, cache={"max_tokens": 512, "text_reserve_tokens": 64})
bf16_session = bf16.session()
bf16_session.ingest(rng.integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=0.0)
bf16_session.ingest(rng.integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=0.5)
bf16_tokens = bf16_session.ask("What is there?", max_new_tokens=3).token_ids
try:
    import edgekv.video
    video_error = None
except ModuleNotFoundError as exc:
    video_error = str(exc)
from edgekv.model.builtin import BUILTINS, builtin_path
shipped = {name: (builtin_path(name) / "model.safetensors").is_file() for name in BUILTINS}
print(json.dumps({"edgekv": edgekv.__file__, "builtins": shipped, "pairs": session.stats()["frame_pairs"], "tokens": answer.token_ids,
                  "cv2": importlib.util.find_spec("cv2") is not None, "video_error": video_error,
                  "decode_route": bf16.decode_route, "bf16_tokens": bf16_tokens}))
"""


@pytest.mark.slow
def test_the_wheel_without_extras_runs_a_session(tmp_path, wheel, tiny_checkpoint):
    """``pip install edgekv`` (no extras) is enough for Runtime.from_pretrained, ingest and ask: the venv
    holds the wheel and exactly the distributions its core requirements pull in, nothing else."""
    requirements = _core_requirements(wheel)
    names = {canonicalize_name(r.name) for r in requirements}
    assert {"torch", "pillow"} <= names and not names & {"opencv-python-headless", "matplotlib", "fastapi"}
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = str(env_dir / "bin" / "python")
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                             capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr
    _link_distributions(_closure(requirements), site)
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env["EDGEKV_CACHE_DIR"] = str(tmp_path / "cache")  # the C kernel is built afresh from the wheel's source
    out = subprocess.run([python, "-c", SESSION_PROBE, str(tiny_checkpoint)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(found["edgekv"]).is_relative_to(site)
    assert found["pairs"] == 2 and len(found["tokens"]) == 3
    assert not found["cv2"]  # the venv really is bare: no OpenCV
    assert "pip install 'edgekv[video]'" in found["video_error"]
    assert len(found["bf16_tokens"]) == 3
    assert found["builtins"] == {"builtin:toy": True, "builtin:toy-224": True}  # both trained toys are package data
    assert found["decode_route"] == ("native" if shutil.which(os.environ.get("CC", "cc")) else "eager")


def test_tiny_checkpoints_are_world_readable(tmp_path):
    """The systemd unit's service user must be able to read a checkpoint someone else wrote."""
    from edgekv.model.tiny import make_tiny_checkpoint

    previous = os.umask(0o022)
    try:
        out = make_tiny_checkpoint(tmp_path / "ckpt", preset="test-hd32")
    finally:
        os.umask(previous)
    files = sorted(out.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    for path in files:
        assert path.stat().st_mode & stat.S_IROTH, f"{path.name} is not world-readable ({oct(path.stat().st_mode)})"
