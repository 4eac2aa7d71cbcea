"""How edgekv is packaged: one `edgekv` import namespace over the design card's folders (from a wheel and from
an editable install), one version, the licence, the configs a wheel user reaches by name, and an sdist the suite
runs from."""

from __future__ import annotations

import email
import importlib.metadata
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import sysconfig
import tarfile
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


# what a checkout holds beside the project's own files (.gitignore's, where git cannot say)
NOT_THE_PROJECT = (".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", "*.pyc", ".pytest_cache",
                   ".hypothesis", ".cache", ".import_linter_cache", "models", "out")


@pytest.fixture(scope="module")
def project_copy(tmp_path_factory) -> Path:
    """The project's files (git's tracked and new ones) copied without the checkout's build output: setuptools
    builds the sdist from a stale edgekv.egg-info/SOURCES.txt when one is there, and the wheel's package data from
    it, so a build in the checkout can hold files that MANIFEST.in no longer names."""
    dest = tmp_path_factory.mktemp("project") / "edgekv"
    listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard", "-z"],
                            capture_output=True, text=True) if shutil.which("git") else None
    if listed is None or listed.returncode != 0:  # not a git checkout (an unpacked sdist)
        shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*NOT_THE_PROJECT))
        return dest
    for name in filter(None, listed.stdout.split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the work tree is not part of it
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


@pytest.fixture(scope="module")
def wheel_build(tmp_path_factory, project_copy) -> tuple[Path, str]:
    """The wheel as ``pip wheel .`` builds it, and the build's log (setuptools' warnings are in it)."""
    wheels = tmp_path_factory.mktemp("wheels")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v",
                            "-w", str(wheels), str(project_copy)], capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    (built,) = wheels.glob("edgekv-*.whl")
    return built, build.stdout + build.stderr


@pytest.fixture(scope="module")
def wheel(wheel_build) -> Path:
    return wheel_build[0]


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
def _core_requirements(wheel: Path, extra: str = "") -> list[Requirement]:
    """The wheel's Requires-Dist without any extra: what ``pip install edgekv`` installs (with ``extra``: what
    ``pip install 'edgekv[extra]'`` adds to it)."""
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.message_from_bytes(archive.read(metadata))
    requirements = [Requirement(line) for line in message.get_all("Requires-Dist") or []]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": extra})]


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
from pathlib import Path
from edgekv.video.sources import SourceUnavailable, iter_frames, open_source
synthetic_frames = len(list(iter_frames("synthetic:events?size=112x112&fps=2&frames=4")))  # drawn without OpenCV
Path("clip.mp4").write_bytes(bytes(64))
try:
    open_source("clip.mp4")  # a file needs OpenCV's decoder
    video_error = None
except SourceUnavailable as exc:
    video_error = str(exc)
from edgekv.model.builtin import BUILTINS, builtin_path
shipped = {name: (builtin_path(name) / "model.safetensors").is_file() for name in BUILTINS}
print(json.dumps({"edgekv": edgekv.__file__, "builtins": shipped, "pairs": session.stats()["frame_pairs"], "tokens": answer.token_ids,
                  "cv2": importlib.util.find_spec("cv2") is not None, "video_error": video_error,
                  "synthetic_frames": synthetic_frames,
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
    assert "pip install 'edgekv[video]'" in found["video_error"] and found["synthetic_frames"] == 4
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


# ---------------------------------------------------------------------------------------------- version and licence
def test_the_version_is_written_once(tmp_path):
    """setup.cfg said ``version = 0.1.0`` and edgekv/__init__.py ``__version__ = "0.1.0"``: a release that bumped one
    shipped a wheel whose ``edgekv --version`` disagreed with pip's. setup.cfg reads the package's now (without
    importing it): a tree whose __init__ says 9.8.7 is version 9.8.7, and setup.cfg parses without a warning."""
    import warnings

    import edgekv
    from setuptools.config.setupcfg import read_configuration

    tree = tmp_path / "tree"
    (tree / "edgekv").mkdir(parents=True)
    for name in ("setup.cfg", "README.md", "LICENSE"):
        shutil.copyfile(ROOT / name, tree / name)
    (tree / "edgekv" / "__init__.py").write_text('__version__ = "9.8.7"\n')
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metadata = read_configuration(tree / "setup.cfg")["metadata"]
    assert metadata["version"] == "9.8.7"
    assert metadata["license_expression"] == "Apache-2.0" and metadata["license_files"] == ["LICENSE"]
    assert importlib.metadata.version("edgekv") == edgekv.__version__  # this install's (pip install -e .)


@pytest.mark.slow
def test_the_wheel_declares_its_licence_version_readme_and_configs(wheel_build):
    """There was no LICENSE: the wheel said ``License: Apache-2.0`` and carried no licence text. Now PEP 639's
    License-Expression and the file itself in .dist-info/licenses. configs/ was not in the wheel at all."""
    import edgekv

    wheel, log = wheel_build
    info = f"edgekv-{edgekv.__version__}.dist-info"
    with zipfile.ZipFile(wheel) as archive:
        message = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        licence = archive.read(f"{info}/licenses/LICENSE")
        configs = {Path(n).name: archive.read(n) for n in archive.namelist() if n.startswith("edgekv/configs/")}
    assert message["Version"] == edgekv.__version__ and message["Requires-Python"] == ">=3.10"
    assert message["License-Expression"] == "Apache-2.0" and message.get_all("License-File") == ["LICENSE"]
    assert licence == (ROOT / "LICENSE").read_bytes()
    assert b"Apache License" in licence and b"Version 2.0, January 2004" in licence
    assert not [c for c in message.get_all("Classifier") or [] if c.startswith("License ::")]
    assert message["Description-Content-Type"] == "text/markdown"
    assert message.get_payload().startswith("# edgekv\n")  # the README is the project page
    assert configs == {path.name: path.read_bytes() for path in (ROOT / "configs").glob("*.yaml")}
    # setuptools' warnings are boxes between "!!" lines (a data folder missing from packages, a deprecated key)
    assert "\n!!\n" not in log and "SetuptoolsDeprecationWarning" not in log, log[-4000:]


# ---------------------------------------------------------------------------------------------- a user's install
def _pip(python: Path, *args: str) -> subprocess.CompletedProcess:
    """This environment's pip acting on the venv of ``python`` (which has no pip of its own)."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(python), *args], capture_output=True,
                          text=True, timeout=600)


INSTALLED_PROBE = """
import importlib.metadata, json
import edgekv
from edgekv.apps.config_names import shipped_configs
dist = importlib.metadata.distribution("edgekv")
commands = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
for ep in dist.entry_points:
    ep.load()  # every entry point imports in an install without the test extras
print(json.dumps({"version": dist.version, "package": edgekv.__version__, "commands": commands,
                  "configs": {name: str(path) for name, path in shipped_configs().items()}}))
"""


@pytest.mark.slow
def test_the_wheel_with_the_video_extra_runs_the_readme_demo_from_a_folder_without_configs(tmp_path, wheel):
    """``pip install 'edgekv[video]'``: the wheel installed by pip (console scripts written) into a venv holding
    exactly the distributions the core and the video extra pull in. configs/ was not in the wheel: the README's
    ``edgekv-camera --config configs/cpu-demo.yaml ...`` was "config file not found" outside a source checkout."""
    import edgekv

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    install = _pip(python, "install", "-q", "--no-deps", str(wheel))
    assert install.returncode == 0, install.stderr
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    _link_distributions(_closure(_core_requirements(wheel, extra="video")), site)
    check = _pip(python, "check")
    assert check.returncode == 0, check.stdout + check.stderr
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "EDGEKV_DEBUG")}
    env["EDGEKV_CACHE_DIR"] = str(tmp_path / "cache")
    user = tmp_path / "user"  # a folder of the user's, with no configs/
    user.mkdir()

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(a) for a in argv], cwd=user, env=env, capture_output=True, text=True, timeout=600)

    probe = run(python, "-c", INSTALLED_PROBE)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["version"] == found["package"] == edgekv.__version__
    assert found["commands"] == {"edgekv": "edgekv.apps.cli:main", "edgekv-camera": "edgekv.apps.daemon.camera:main"}
    assert sorted(found["configs"]) == sorted(path.stem for path in (ROOT / "configs").glob("*.yaml"))
    assert all(Path(path).is_relative_to(site / "edgekv" / "configs") for path in found["configs"].values())
    for command in found["commands"]:
        shown = run(env_dir / "bin" / command, "--version")
        assert shown.returncode == 0 and shown.stdout.strip() == f"edgekv {edgekv.__version__}", shown.stderr
    demo = ["--no-stdin", "--no-server", "--exit-at-end", "--quiz", "10"]
    runs = [run(env_dir / "bin" / "edgekv-camera", "--config", given, *demo)
            for given in ("configs/cpu-demo.yaml", "cpu-demo")]
    assert all(r.returncode == 0 for r in runs), [r.stderr[-2000:] for r in runs]
    scores = [re.search(r"quiz: \d+/10 correct about \d+ events? seen.*", r.stdout) for r in runs]
    assert all(scores) and scores[0].group(0) == scores[1].group(0), [r.stdout[-2000:] for r in runs]
    assert f"using the one shipped with edgekv, {found['configs']['cpu-demo']}" in runs[0].stderr


# ---------------------------------------------------------------------------------------------- the sdist
@pytest.fixture(scope="module")
def sdist(tmp_path_factory, project_copy) -> Path:
    """The sdist as ``python -m build --sdist`` makes it (the same setuptools hook, without the build package)."""
    out = tmp_path_factory.mktemp("sdist")
    build = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                            "print(build_meta.build_sdist(sys.argv[1]))", str(out)],
                           cwd=project_copy, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    return out / build.stdout.strip().splitlines()[-1]


def _git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    inside = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if inside.returncode != 0 or Path(inside.stdout.strip()).resolve() != ROOT.resolve():
        pytest.skip("not a git checkout of edgekv (an unpacked sdist): nothing to compare the sdist with")
    return subprocess.run(["git", "-C", str(ROOT), *args], input=stdin, capture_output=True, text=True, timeout=120)


def _sdist_files(sdist: Path) -> set[str]:
    with tarfile.open(sdist) as archive:
        return {member.name.split("/", 1)[1] for member in archive.getmembers() if member.isfile()}


@pytest.mark.slow
def test_the_sdist_holds_every_tracked_file_and_nothing_git_ignores(sdist):
    """The sdist had the tests without tests/conftest.py, their helpers_*.py and fixtures, and no configs, docs,
    tools or LICENSE: ``pytest`` from an unpacked sdist could not run. Now all that git tracks is in it but the
    repository's own .gitignore and CI script; and no build output, byte code or a run's state."""
    tracked = {name for name in _git("ls-files", "-z").stdout.split("\0") if name and (ROOT / name).is_file()}
    files = _sdist_files(sdist)
    missing = sorted(name for name in tracked - files if name != ".gitignore" and not name.startswith(".ci/"))
    assert not missing, missing
    assert {"LICENSE", "README.md", "tests/conftest.py", "configs/cpu-demo.yaml"} <= files
    generated = {name for name in files if name == "PKG-INFO" or name.startswith("edgekv.egg-info/")}
    ignored = _git("check-ignore", "--no-index", "--stdin", stdin="\n".join(sorted(files - generated)))
    assert ignored.returncode == 1 and not ignored.stdout.strip(), ignored.stdout  # 1: none of them is ignored


@pytest.mark.slow
def test_the_suite_collects_from_the_unpacked_sdist(tmp_path, sdist):
    """Every test module, its helpers and conftest's fixtures are found from the unpacked sdist (edgekv itself is
    imported from this environment's install)."""
    with tarfile.open(sdist) as archive:
        if hasattr(tarfile, "data_filter"):  # 3.10.12+, 3.11.4+
            archive.extractall(tmp_path, filter="data")
        else:
            archive.extractall(tmp_path)
    (unpacked,) = tmp_path.iterdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PYTEST_") and key != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider"],
                         cwd=unpacked, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert re.search(r"^\d+ tests collected", out.stdout, re.M), out.stdout[-2000:]
