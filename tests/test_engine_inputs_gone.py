"""Engine bundles whose build inputs moved or went away after the build: what a load and ``edgekv build`` do.

A robot is provisioned (``edgekv build --backend tensorrt``, an hour on the board), then its operator cleans ``/data``
(the INT8 calibration clip goes), renames the checkpoint's folder or points ``model.path`` at a symlink. The engines on
disk still fit: a load uses them, saying once that the clip is gone and that a rebuild needs it, and ``edgekv build``
calls them up to date. A clip that is there with other frames still makes other engines.

Probes that failed before their fix:

* the clip deleted after the build: the daemon's load refused the bundle ("INT8 calibration frames ... built for
  '…', this deployment has '/data/calib.avi (not found)'") and ``edgekv build`` said "no such video file";
* the checkpoint folder renamed (or reached through a symlink of another name): ``edgekv build`` exported again
  though a load took the bundle (``locate`` reads manifests, ``build`` only looked for its own folder name);
* ``engines.engine_dir`` at one bundle (engines copied in): ``edgekv build`` built a second bundle *inside* it, which
  no load reads, and, for another config, the load refused the outer one again;
* a calibration input that is a folder (a ROS 2 bag) was keyed by its name only, and a stream URL's password was
  written into the bundle key in clear;
* TensorRT 10.0 (calibrator) read the calibration frames only after loading and exporting the model.

The TensorRT build runs through the stand-in (``helpers_tensorrt``, TensorRT 10.3 on an "Orin"), as the other engine
tests do; the onnxruntime build has its export stubbed (what is checked is the up-to-date decision).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
cv2 = pytest.importorskip("cv2")

import helpers_tensorrt as fake_trt  # noqa: E402
import test_tensorrt_contract as contract  # noqa: E402

from edgekv.config import EdgeKVConfig, load_config  # noqa: E402
from edgekv.engines.manifest import MANIFEST, EngineError, EngineMismatchError, Manifest, locate  # noqa: E402

RESOLUTION = [112, 168]


def _clip(path: Path, shade: int, frames: int = 12) -> Path:
    """A small MJPG clip whose frames depend on ``shade``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (168, 112))
    rng = np.random.default_rng(shade)
    for _ in range(frames):
        writer.write(rng.integers(0, 256, (112, 168, 3), dtype=np.uint8))
    writer.release()
    return path


@contextlib.contextmanager
def _gone(path: Path):
    """``path`` deleted for the block (put back, same bytes and mtime, after it)."""
    kept = path.with_name(path.name + ".kept")
    shutil.move(path, kept)
    try:
        yield
    finally:
        shutil.move(kept, path)


def _no_model_load(mp: pytest.MonkeyPatch) -> None:
    import edgekv.model as model_module

    mp.setattr(model_module, "load_pretrained", lambda *a, **k: pytest.fail("the model was loaded: a rebuild"))


@pytest.fixture(scope="module")
def int8_built(tmp_path_factory):
    """An fp16 ``precision: int8`` deployment built by ``edgekv build --backend tensorrt`` (stand-in TensorRT 10.3)
    from a calibration clip under ``data/``: (config, bundle, manifest, clip)."""
    from edgekv.model.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("gone")
    ckpt = make_tiny_checkpoint(root / "ckpt", preset="test-stream", seed=3)
    clip = _clip(root / "data" / "calib.avi", shade=1)
    (root / "deploy.yaml").write_text(yaml.safe_dump({
        "model": {"path": str(ckpt), "dtype": "fp16", "device": "cpu"},
        "video": {"source": "synthetic:shapes?size=200x150&fps=4&frames=20", "fps": 2.0, "resolution": RESOLUTION},
        "cache": {"policy": "infinipot_v", "max_tokens": 512, "text_reserve_tokens": 96, "sinks": 32},
        "engines": {"vision": "tensorrt", "llm": "tensorrt", "engine_dir": str(root / "cache"),
                    "max_chunk_tokens": 40, "precision": "int8", "int8_calibration": "data/calib.avi"},
    }))
    config = load_config(root / "deploy.yaml")
    assert config.engines.int8_calibration == str(clip)  # relative to the YAML file
    bundle, manifest = contract.build_as_on_a_jetson(config)
    return config, bundle, manifest, clip


def _load_vision(config: EdgeKVConfig):
    """What the daemon's ``Runtime`` does for ``engines.vision: tensorrt`` (``tensorrt_runtime.load``), on a runtime
    that is only what the loader reads."""
    from edgekv.engines import tensorrt_runtime

    runtime = SimpleNamespace(config=config, model_dir=Path(config.model.path), device=torch.device("cuda"),
                              dtype=torch.float16)
    backend = tensorrt_runtime.load(runtime, "vision")
    return backend, runtime._trt_engines[0].bundle


def _calibration_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "engines.int8_calibration" in r.getMessage()]


# ---------------------------------------------------------------------------------------------- the calibration clip
def test_a_deleted_calibration_clip_keeps_the_int8_engines(int8_built, monkeypatch, caplog):
    """Before: ``EngineMismatchError`` at load, naming INT8 calibration frames; ``edgekv build`` failed with
    "no such video file" though its engines were there."""
    from edgekv.engines.build import build

    config, bundle, manifest, clip = int8_built
    contract._as_if_on_a_jetson(monkeypatch)
    _no_model_load(monkeypatch)
    caplog.set_level(logging.WARNING, logger="edgekv.engines.manifest")
    with _gone(clip):
        backend, loaded = _load_vision(config)
        assert loaded == bundle and backend.grid_thw == (1, 8, 12)
        said = _calibration_warnings(caplog)
        assert len(said) == 1, said
        assert str(clip) in said[0] and "is not there" in said[0] and "needs it back" in said[0]
        _load_vision(config)  # the next runtime of this process (another camera): said once
        assert len(_calibration_warnings(caplog)) == 1
        found, _ = build(config, "tensorrt", progress=False)  # up to date: no model load, no export
        assert found == bundle
        with pytest.raises(EngineError, match=r"engines\.int8_calibration: .*calib\.avi.*no such video file"):
            build(config, "tensorrt", force=True, progress=False)  # a rebuild does need it: said before the model
    assert (bundle / MANIFEST).is_file()  # the refused rebuild left the bundle as it was
    assert Manifest.read(bundle).inputs == {"int8_calibration": str(clip)}  # which clip: told among several


def test_a_calibration_clip_with_other_frames_still_makes_other_engines(int8_built, monkeypatch):
    config, bundle, _, clip = int8_built
    contract._as_if_on_a_jetson(monkeypatch)
    original = clip.read_bytes()
    stat = clip.stat()
    try:
        _clip(clip, shade=2)
        with pytest.raises(EngineMismatchError, match=r"INT8 calibration frames"):
            _load_vision(config)
    finally:
        clip.write_bytes(original)
        os.utime(clip, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert _load_vision(config)[1] == bundle


def _other_clip_bundle(bundle: Path, name: str, source: str) -> Path:
    """A copy of ``bundle`` as if built from another clip (``source``): its key's calibration digest and its
    recorded input differ, its files are the same."""
    copy = bundle.parent / name
    shutil.copytree(bundle, copy)
    manifest = Manifest.read(copy)
    manifest.key["int8_calibration"] = "0123456789abcdef"
    manifest.inputs = {"int8_calibration": source}
    manifest.write(copy)
    return copy


def test_with_the_clip_gone_the_bundle_built_from_its_path_is_taken_among_several(int8_built, monkeypatch, tmp_path):
    """Bundles of two clips differ only in the calibration digest: with the configured clip gone, the one built from
    the configured path is loaded even when the other is newer; a path neither was built from takes the newest."""
    from edgekv.engines.build import deployment

    config, bundle, _, clip = int8_built
    cache = tmp_path / "cache"
    shutil.copytree(bundle, cache / bundle.name)
    ours = cache / bundle.name
    newer = _other_clip_bundle(ours, "from-another-clip", "/data/other.avi")
    os.utime(newer / MANIFEST, ns=(ours.stat().st_mtime_ns + 10**9,) * 2)
    local = config.with_overrides(engines={"engine_dir": str(cache)})
    with _gone(clip):
        dep = deployment(local, "tensorrt", tensorrt_identity=contract.IDENTITY)
        assert locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)[0] == ours
        assert [name for name, _, _ in dep.key.unverified] == ["int8_calibration"]
    elsewhere = local.with_overrides(engines={"int8_calibration": str(tmp_path / "never-built.avi")})
    dep = deployment(elsewhere, "tensorrt", tensorrt_identity=contract.IDENTITY)
    assert locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)[0] == newer
    # every other field is still compared: another cache size is refused, the clip's absence said with the hint
    smaller = elsewhere.with_overrides(cache={"max_tokens": 256})
    dep = deployment(smaller, "tensorrt", tensorrt_identity=contract.IDENTITY)
    with pytest.raises(EngineMismatchError, match=r"cache capacity M.*never-built\.avi is not there; building the "
                                                  r"engines again needs it"):
        locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)


def test_tensorrt_10_0_calibrator_reads_the_clip_before_loading_the_model(int8_built, monkeypatch, tmp_path):
    """Before: the 10.0 build loaded the model and exported both graphs, then failed in the calibrator."""
    from edgekv.engines.build import build

    config = int8_built[0].with_overrides(engines={"engine_dir": str(tmp_path / "cache"),
                                                   "int8_calibration": str(tmp_path / "gone.avi")})
    contract._as_if_on_a_jetson(monkeypatch)
    monkeypatch.setattr(fake_trt, "__version__", "10.0.1")
    _no_model_load(monkeypatch)
    with pytest.raises(EngineError, match=r"engines\.int8_calibration: .*gone\.avi.*no such video file"):
        build(config, "tensorrt", progress=False)


def test_a_bag_folder_is_keyed_by_its_content_and_a_stream_password_stays_out_of_the_key(tmp_path):
    from edgekv.engines.int8_qdq import calibration_digest

    bag = tmp_path / "bag"
    bag.mkdir()
    (bag / "metadata.yaml").write_text("rosbag2_bagfile_information: {}\n")
    (bag / "bag_0.mcap").write_bytes(b"frames one")

    def key(spec: str) -> str | None:
        return calibration_digest(EdgeKVConfig().with_overrides(engines={"int8_calibration": spec}))

    first = key(str(bag))
    assert key(f"rosbag:{bag}") == first
    (bag / "bag_0.mcap").write_bytes(b"frames two")  # same size, other frames
    assert key(str(bag)) != first
    url = "rtsp://admin:hunter2@10.0.0.9/live"
    assert "hunter2" not in key(url) and key(url) != key(url.replace("hunter2", "other"))


# ---------------------------------------------------------------------------------------------- checkpoint folder
@pytest.fixture
def stubbed_export(monkeypatch):
    """The graph exports write small files and record which ran."""
    from helpers_checkpoints import stub_graph_exports

    return stub_graph_exports(monkeypatch)


def _ort_config(model: Path, engine_dir: Path, **cache) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": str(model), "dtype": "fp32", "device": "cpu"}, video={"resolution": [112, 112]},
        cache={"max_tokens": 400, "text_reserve_tokens": 96, **cache},
        engines={"vision": "onnxruntime", "llm": "onnxruntime", "engine_dir": str(engine_dir)})


def _ort_load(config: EdgeKVConfig) -> Path:
    """The bundle the onnxruntime loader takes for ``config`` (``onnx_backend._sessions_for``, as a Runtime)."""
    from edgekv.engines import onnx_backend

    runtime = SimpleNamespace(config=config, model_dir=Path(config.model.path), device=torch.device("cpu"))
    return onnx_backend._sessions_for(runtime)[0].bundle


def test_a_renamed_or_symlinked_checkpoint_folder_keeps_its_engines(tiny_checkpoint, tmp_path, stubbed_export):
    """Before: ``edgekv build`` exported again for the checkpoint moved to another folder name, or reached through a
    symlink of another name, though the load took the bundle already there."""
    from edgekv.engines.build import build

    model = tmp_path / "models" / "qwen-2025-01"
    shutil.copytree(tiny_checkpoint, model)
    bundle, _ = build(_ort_config(model, tmp_path / "engines"), progress=False)
    assert stubbed_export == ["vision", "llm"]
    moved = tmp_path / "models" / "qwen-current"
    shutil.move(model, moved)
    link = tmp_path / "models" / "active"
    link.symlink_to(moved, target_is_directory=True)
    for path in (moved, link):
        config = _ort_config(path, tmp_path / "engines")
        assert _ort_load(config) == bundle
        assert build(config, progress=False)[0] == bundle
    assert stubbed_export == ["vision", "llm"]  # nothing exported again
    changed = {**json.loads((moved / "config.json").read_text()), "edgekv_probe": 1}
    (moved / "config.json").write_text(json.dumps(changed, indent=2))  # another checkpoint: other engines
    with pytest.raises(EngineMismatchError, match=r"model weights"):
        _ort_load(_ort_config(link, tmp_path / "engines"))


def test_engine_dir_at_a_bundle_is_up_to_date_or_rebuilt_in_place(tiny_checkpoint, tmp_path, stubbed_export):
    """Before: with ``engines.engine_dir`` at a bundle copied in, ``edgekv build`` wrote a new bundle inside it
    (exported again when it fit; for another config a bundle no load reads, so the load refused the outer one
    again, and again after every build)."""
    from edgekv.engines.build import build

    bundle, _ = build(_ort_config(tiny_checkpoint, tmp_path / "built"), progress=False)
    copied = tmp_path / "opt" / "engines"
    shutil.copytree(bundle, copied)
    config = _ort_config(tiny_checkpoint, copied)
    assert build(config, progress=False)[0] == copied
    assert stubbed_export == ["vision", "llm"]
    bigger = _ort_config(tiny_checkpoint, copied, max_tokens=480)
    with pytest.raises(EngineMismatchError, match=r"cache capacity M"):
        _ort_load(bigger)
    assert build(bigger, progress=False)[0] == copied  # rebuilt where the load looks
    assert stubbed_export == ["vision", "llm"] * 2
    assert not [p for p in copied.iterdir() if p.is_dir()]  # no bundle inside the bundle
    assert _ort_load(bigger) == copied
