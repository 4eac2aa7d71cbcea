"""``edgekv-camera --check`` judges the engines as the start loads them (``edgekv.runtime.find_engines``: the start's
``deployment`` and ``locate`` — key fields, manifest, every file's size and sha256 — no engine or weight loaded).

Probe that failed before: ``engines.vision/llm: onnxruntime`` and an empty ``engines.engine_dir``; ``--check`` said
"every check passed: the daemon would start" and the start then stopped with "no onnxruntime engines built ...".
Each case here runs both, ``--check`` and the start, and compares: the check's ``FAIL`` is the start's "cannot start"
line word for word, with the ``edgekv build`` command that fixes it. The TensorRT cases run on the stand-in
(``helpers_tensorrt``, TensorRT 10.3 on an "Orin") against the start's own TensorRT load.
"""

from __future__ import annotations

import contextlib
import io
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from helpers_check import check_config, run_check

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from edgekv.apps.daemon.camera import main as camera_main  # noqa: E402
from edgekv.apps.daemon.check import engines_result  # noqa: E402
from edgekv.config import load_config  # noqa: E402

ONNX = {"vision": "onnxruntime", "llm": "onnxruntime", "onnx_providers": ["CPUExecutionProvider"]}


@pytest.fixture(scope="module")
def built(tiny_checkpoint, tmp_path_factory) -> Path:
    """The onnxruntime bundle of ``helpers_check``'s deployment, built by ``edgekv build`` (in this process)."""
    from edgekv.apps.cli import main

    root = tmp_path_factory.mktemp("check-engines")
    path = check_config(root, tiny_checkpoint, engines={**ONNX, "engine_dir": str(root / "engines")})
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert main(["build", "--config", str(path), "--quiet"]) == 0, out.getvalue()
    bundles = [p.parent for p in (root / "engines").glob("*/manifest.json")]
    assert len(bundles) == 1
    return bundles[0]


def _engines(tmp_path: Path, bundle: Path) -> Path:
    """A cache of engines holding a copy of ``bundle`` (its own: a test may damage it)."""
    root = tmp_path / "engines"
    shutil.copytree(bundle, root / bundle.name)
    return root


def _start(path: Path, capsys) -> tuple[int, str]:
    """The real start of ``path`` (two frames, then it exits): its exit status and its stderr."""
    code = camera_main(["--config", str(path), "--no-server", "--no-stdin", "--max-frames", "2", "--quiet"])
    return code, capsys.readouterr().err


def _both(path: Path, capsys) -> tuple[tuple[str, str], int, str]:
    """``--check``'s engines row, and the start's exit status and stderr."""
    code, results = run_check(path, capsys)
    assert "engines" in results, results  # before: no row at all (the engines were never looked at)
    status, detail = results["engines"]
    assert code == (2 if status == "FAIL" else 0), results
    return results["engines"], *_start(path, capsys)


def _fails_as_the_start(path: Path, capsys) -> str:
    (status, detail), code, err = _both(path, capsys)
    assert status == "FAIL", detail
    assert code == 2
    assert f"cannot start: {detail}\n" in err, (detail, err)  # the start's own line, word for word
    return detail


def test_no_bundle_fails_as_the_start_does_with_the_build_command(tiny_checkpoint, tmp_path, capsys):
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(tmp_path / "empty")})
    detail = _fails_as_the_start(path, capsys)
    assert detail.startswith(f"no onnxruntime engines built for this model and config under {tmp_path / 'empty'}")
    assert detail.endswith(f"build the engines with: edgekv build --model {tiny_checkpoint} --config {path} "
                           "--backend onnxruntime")


def test_a_bundle_built_for_another_cache_fails_naming_the_field(built, tiny_checkpoint, tmp_path, capsys):
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(_engines(tmp_path, built))},
                        cache={"max_tokens": 384})
    detail = _fails_as_the_start(path, capsys)
    assert "the nearest bundle" in detail and "cache capacity M" in detail
    assert "built for 400, this deployment has 384" in detail and "edgekv build --model" in detail


@pytest.mark.parametrize("damage", ["byte flipped", "truncated", "missing"])
def test_a_damaged_engine_file_fails_as_the_start_does(built, tiny_checkpoint, tmp_path, capsys, damage):
    engines = _engines(tmp_path, built)
    target = engines / built.name / "vision.onnx"
    data = bytearray(target.read_bytes())
    if damage == "byte flipped":  # same size: only its sha256 tells
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    elif damage == "truncated":
        target.write_bytes(bytes(data[: len(data) // 2]))
    else:
        target.unlink()
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(engines)})
    detail = _fails_as_the_start(path, capsys)
    said = {"byte flipped": "engine file's sha256 is not the one in", "truncated": "the manifest says",
            "missing": "engine file missing (vision graph"}[damage]
    assert detail.startswith(f"{target}: ") and said in detail, detail
    assert "build the engines with: edgekv build" in detail


def test_a_good_bundle_is_named_and_the_start_runs_on_it(built, tiny_checkpoint, tmp_path, capsys):
    from edgekv.engines.manifest import Manifest

    engines = _engines(tmp_path, built)
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(engines)})
    (status, detail), code, err = _both(path, capsys)
    assert status == "ok" and code == 0, (detail, err)
    assert "cannot start" not in err
    created = Manifest.read(built).created
    assert detail.startswith(f"onnxruntime (vision and llm): {engines / built.name}, built {created} for grid "
                             "[1, 8, 8]"), detail
    assert "a cache of 400 tokens, fp32, chunks up to 256 tokens; 2 graph file(s)" in detail


def test_the_check_hashes_no_more_than_the_start(built, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A multi-GB plan on a Jetson takes a while to hash: the check memoizes digests in ``engine_dir/hashes.json`` as
    the start does, so a second check, and the start after it, read no engine file whole again."""
    from edgekv.model import checkpoint_hash

    engines = _engines(tmp_path, built)  # a copy: the build's memo (by path) does not cover it
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(engines)})
    read: list[str] = []

    def counted(file, *args, **kwargs):
        read.append(Path(file).name)
        return open(file, *args, **kwargs)

    monkeypatch.setattr(checkpoint_hash, "open", counted, raising=False)  # file_digest's reads
    assert run_check(path, capsys)[1]["engines"][0] == "ok"
    assert {"vision.onnx", "llm.onnx"} <= set(read)
    read.clear()
    assert run_check(path, capsys)[1]["engines"][0] == "ok"
    assert _start(path, capsys)[0] == 0
    assert not {"vision.onnx", "llm.onnx"} & set(read), read


def test_torch_is_a_note_and_a_torch_vision_beside_an_engine_llm_is_said(built, tiny_checkpoint, tmp_path, capsys):
    path = check_config(tmp_path, tiny_checkpoint)
    code, results = run_check(path, capsys)
    assert code == 0 and results["engines"][0] == "note"
    assert "torch runs the vision tower and the LLM" in results["engines"][1]
    engines = _engines(tmp_path, built)
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "vision": "torch", "engine_dir": str(engines)})
    (status, detail), code, err = _both(path, capsys)
    assert status == "ok" and code == 0, (detail, err)
    assert detail.startswith("onnxruntime (llm): ") and detail.endswith("; vision: torch (from model.path)")


def test_a_provider_this_onnxruntime_lacks_fails_as_the_start_does(built, tiny_checkpoint, tmp_path, capsys):
    engines = _engines(tmp_path, built)
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(engines),
                                                            "onnx_providers": ["NoSuchExecutionProvider"]})
    detail = _fails_as_the_start(path, capsys)
    assert detail.startswith("engines.onnx_providers: NoSuchExecutionProvider is not available")


def _cameras(tmp_path: Path, model: Path, engines: Path, max_tokens: int, weights: tuple[float, float]) -> Path:
    """Two cameras (``video.sources``) of these weights sharing ``cache.max_tokens``, on the engines under
    ``engines``."""
    path = check_config(tmp_path, model, engines={**ONNX, "engine_dir": str(engines)}, cache={"max_tokens": max_tokens})
    data = yaml.safe_load(path.read_text())
    source = data["video"].pop("source")
    data["video"]["sources"] = [{"name": name, "source": source, "weight": weight}
                                for name, weight in zip(("front", "back"), weights)]
    path.write_text(yaml.safe_dump(data))
    return path


def _camera_rows(path: Path, capsys) -> tuple[int, dict[str, tuple[str, str]]]:
    """``--check``'s exit status and each camera's engines row: ``{camera: (status, detail)}``."""
    code = camera_main(["--config", str(path), "--check"])
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        camera, _, rest = line.partition("] ")
        status, _, item = rest.partition("  ")
        if item.strip().startswith("engines: "):
            rows[camera.lstrip("[")] = (status.strip(), item.strip().removeprefix("engines: "))
    return code, rows


def test_cameras_of_unequal_weights_on_one_llm_engine_fail_as_the_start_does(built, tiny_checkpoint, tmp_path,
                                                                             capsys):
    """The start loads the engines once, for the first camera, and every camera runs them: a second camera whose
    weight gives it another cache stopped the start (here: front's 400 tokens are the bundle's, back has 200), and
    ``--check`` had said nothing of the engines."""
    engines = _engines(tmp_path, built)
    code, rows = _camera_rows(_cameras(tmp_path, tiny_checkpoint, engines, 600, (2.0, 1.0)), capsys)
    assert code == 2 and rows["front"][0] == "ok", rows
    status, detail = rows["back"]
    assert status == "FAIL" and "front 400 tokens (weight 2), back 200 tokens (weight 1)" in detail, detail
    assert "give every camera the same weight" in detail and "engines.llm: torch" in detail, detail
    code, err = _start(tmp_path / "deploy.yaml", capsys)
    assert code == 2 and f"cannot start: {detail}" in err, err  # before the weights load (engines_config)
    # equal weights, 400 tokens each: both on the one bundle, and the start runs
    path = _cameras(tmp_path, tiny_checkpoint, engines, 800, (1.0, 1.0))
    code, rows = _camera_rows(path, capsys)
    assert code == 0 and rows["front"][0] == "ok", rows
    assert rows["back"] == ("ok", f"runs the engines loaded for 'front' ({engines / built.name})")
    code, err = _start(path, capsys)
    assert code == 0 and "cannot start" not in err, err
    # no bundle for them: the first camera's row fails as the start does, the second's points there
    code, rows = _camera_rows(_cameras(tmp_path, tiny_checkpoint, engines, 600, (1.0, 1.0)), capsys)
    assert code == 2 and rows["front"][0] == "FAIL" and "cache capacity M" in rows["front"][1]
    assert rows["back"] == ("note", "runs the engines loaded for 'front', not found (above)")


# ------------------------------------------------------------------------------------------ TensorRT (the stand-in)
@pytest.fixture(scope="module")
def trt_built(tiny_checkpoint, tmp_path_factory):
    """A TensorRT bundle of ``helpers_check``'s deployment built with the stand-in (TensorRT 10.3, "Orin"):
    (config, bundle)."""
    import test_tensorrt_contract as contract

    import edgekv.model as model_module
    from edgekv.engines import build as build_module

    root = tmp_path_factory.mktemp("check-trt")
    path = check_config(root, tiny_checkpoint,
                        engines={"vision": "tensorrt", "llm": "tensorrt", "engine_dir": str(root / "engines")})
    config = load_config(path).with_overrides(model={"device": "cuda"})
    load_pretrained = model_module.load_pretrained
    with pytest.MonkeyPatch.context() as mp:
        contract._as_if_on_a_jetson(mp)
        mp.setattr(model_module, "load_pretrained",
                   lambda path, dtype, device: load_pretrained(path, dtype=dtype, device=torch.device("cpu")))
        bundle, _ = build_module.build(config, "tensorrt", progress=False)
    return config, bundle


@pytest.fixture
def jetson(monkeypatch):
    """The stand-in and an "Orin" as ``_as_if_on_a_jetson`` gives them, and CUDA for ``model.device: cuda`` too."""
    import test_tensorrt_contract as contract

    contract._as_if_on_a_jetson(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the check runs no torch internals on it


def _trt_load(config) -> Path:
    """What the start's ``Runtime`` does for ``engines.vision: tensorrt`` (``tensorrt_runtime.load``), on a runtime
    that is only what the loader reads: the bundle it loads, or its error."""
    from edgekv.engines import tensorrt_runtime

    runtime = SimpleNamespace(config=config, model_dir=Path(config.model.path),
                              device=torch.device(config.model.device), dtype=torch.float32)
    tensorrt_runtime.load(runtime, "vision")
    return runtime._trt_engines[0].bundle


def test_tensorrt_a_good_bundle_names_its_tensorrt_and_gpu(trt_built, jetson):
    config, bundle = trt_built
    result = engines_result(config)
    assert result.status == "ok", result.detail
    assert result.detail.startswith(f"tensorrt (vision and llm): {bundle}, built ")
    assert "fp32 precision, TensorRT 10.3.0 on Orin (sm_87)" in result.detail
    assert _trt_load(config) == bundle


def test_tensorrt_a_bundle_of_another_tensorrt_fails_as_the_load_does(trt_built, jetson, monkeypatch):
    """JetPack upgraded (TensorRT 10.3 -> 10.7): the plans on disk no longer run."""
    import helpers_tensorrt as fake_trt

    config, _ = trt_built
    monkeypatch.setattr(fake_trt, "__version__", "10.7.0")
    result = engines_result(config)
    assert result.status == "FAIL"
    with pytest.raises(ValueError) as raised:
        _trt_load(config)
    assert result.detail == str(raised.value)
    assert "TensorRT version: built for '10.3.0', this deployment has '10.7.0'" in result.detail
    assert "edgekv build --model" in result.detail and "--backend tensorrt" in result.detail


def test_tensorrt_on_a_cpu_device_fails_as_the_load_does(trt_built, jetson):
    config, _ = trt_built
    config = config.with_overrides(model={"device": "cpu"})
    result = engines_result(config)
    with pytest.raises(ValueError) as raised:
        _trt_load(config)
    assert result.status == "FAIL" and result.detail == str(raised.value)
    assert "the tensorrt backend runs on a CUDA device" in result.detail



def test_tensorrt_int8_engines_whose_calibration_clip_is_gone_are_a_note(tiny_checkpoint, tmp_path, jetson):
    """The clip deleted after provisioning: the start loads the engines (saying once that a rebuild needs the clip),
    so the check passes them, with that said."""
    cv2 = pytest.importorskip("cv2")
    import numpy as np
    import test_tensorrt_contract as contract

    import edgekv.model as model_module
    from edgekv.engines import build as build_module

    clip = tmp_path / "calib.avi"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (112, 112))
    for frame in np.random.default_rng(0).integers(0, 256, (8, 112, 112, 3), dtype=np.uint8):
        writer.write(frame)
    writer.release()
    path = check_config(tmp_path, tiny_checkpoint, engines={
        "vision": "tensorrt", "llm": "tensorrt", "precision": "int8", "int8_calibration": str(clip),
        "engine_dir": str(tmp_path / "engines")})
    config = load_config(path).with_overrides(model={"device": "cuda"})
    load_pretrained = model_module.load_pretrained
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(model_module, "load_pretrained",
                   lambda path, dtype, device: load_pretrained(path, dtype=dtype, device=torch.device("cpu")))
        mp.setattr(torch.cuda, "is_available", contract._cuda_for_edgekv_engines_only)  # the export runs on CPU
        bundle, _ = build_module.build(config, "tensorrt", progress=False)
    clip.unlink()
    result = engines_result(config)
    assert result.status == "note", result.detail
    assert result.detail.startswith(f"tensorrt (vision and llm): {bundle}, built ")
    said = f"engines.int8_calibration: {clip} is not there: the engines are used as they are, building them again"
    assert said in result.detail
    assert _trt_load(config) == bundle
