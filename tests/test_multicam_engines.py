"""Several cameras (``video.sources``) on engines (apps/daemon/cameras.py ``engines_config``, ``edgekv build``).

The start loads the engines once, for the first camera's cache, and every camera shares them. Before:
``edgekv build --config multi.yaml`` built the LLM graph for the whole ``cache`` cap, which no camera uses, so the
start found no bundle and told the user to run the same build again (a loop); with unequal weights the cameras' caches
differ, one LLM graph (its cache size M a fixed dimension) cannot serve both, and the start refused the second camera
after loading the weights, again pointing at a build of the first camera's bundle, which was there."""

from __future__ import annotations

import contextlib
import io
import threading
from pathlib import Path

import pytest
import yaml

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from edgekv.apps.cli import main
from edgekv.config import load_config

FRONT = "synthetic:events?size=112x112&fps=2&frames=600&seed=1&rate=0.08"
BACK = "synthetic:events?size=112x112&fps=2&frames=600&seed=7&rate=0.08"


def _write(root: Path, ckpt: Path, weights: tuple[int, int], llm: str = "onnxruntime") -> Path:
    config = {
        "model": {"path": str(ckpt), "dtype": "fp32", "device": "cpu"},
        "video": {"sources": [{"name": "front", "source": FRONT, "weight": weights[0]},
                              {"name": "back", "source": BACK, "weight": weights[1]}],
                  "fps": 2.0, "resolution": [112, 112]},
        "cache": {"policy": "infinipot_v", "max_tokens": 800, "text_reserve_tokens": 64},
        "engines": {"vision": "onnxruntime", "llm": llm, "engine_dir": str(root / "engines"),
                    "onnx_providers": ["CPUExecutionProvider"]},
        "state": {"dir": str(root / "state"), "every_s": 3600}, "monitor": {"backend": "cpu"},
        "server": {"port": 0}, "generation": {"max_new_tokens": 2, "temperature": 0.0},
    }
    path = root / f"multi-{weights[0]}-{weights[1]}-{llm}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _edgekv(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


def test_equal_weights_build_the_engines_the_cameras_load_and_they_start(tiny_checkpoint, tmp_path):
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet
    from edgekv.engines.manifest import Manifest

    path = _write(tmp_path, tiny_checkpoint, (1, 1))
    code, said = _edgekv("build", "--config", str(path), "--quiet")
    assert code == 0, said
    manifests = list((tmp_path / "engines").glob("*/manifest.json"))
    assert len(manifests) == 1
    assert Manifest.read(manifests[0].parent).key["cache_tokens"] == 400  # each camera's half of 800, not 800
    cameras = CameraSet(load_config(path), daemon_args(), out=open(tmp_path / "out.txt", "w"))
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(cameras.run()), daemon=True)
    thread.start()
    try:
        assert cameras.ready.wait(300) or codes, (tmp_path / "out.txt").read_text()
    finally:
        cameras.stop.event.set()
        thread.join(300)
    said = (tmp_path / "out.txt").read_text()
    assert codes == [0] and "2 cameras on one model: front 400 tokens" in said and "back 400 tokens" in said, said
    for daemon in cameras.daemons.values():
        assert daemon.runtime.llm_backend.name == "onnxruntime"


def test_unequal_weights_with_an_llm_engine_are_refused_before_any_build_or_weights(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch, capsys):
    import edgekv
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet, engines_config

    path = _write(tmp_path, tiny_checkpoint, (3, 1))
    code, said = _edgekv("build", "--config", str(path), "--quiet")
    assert code == 2
    assert "engines.llm: onnxruntime runs one LLM graph built for one cache size" in said, said
    assert "front 600 tokens (weight 3), back 200 tokens (weight 1)" in said
    assert "same weight (each then gets 400 tokens" in said and "engines.llm: torch" in said
    assert not (tmp_path / "engines").exists()  # nothing exported

    def no_weights(*_args, **_kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(edgekv.Runtime, "from_config", no_weights)
    cameras = CameraSet(load_config(path), daemon_args(), out=open(tmp_path / "out.txt", "w"))
    assert cameras.run() == 2
    err = capsys.readouterr().err
    assert "cannot start: engines.llm: onnxruntime runs one LLM graph built for one cache size" in err, err
    # the LLM on torch: unequal weights share a vision engine, built for the first camera's config as loaded
    torch_llm = load_config(_write(tmp_path, tiny_checkpoint, (3, 1), llm="torch"))
    first = engines_config(torch_llm)
    assert first.cache.max_tokens == 600 and first.video.source == FRONT
