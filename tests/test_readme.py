"""The README's Python snippets run as written (issue 25: its OpenAI snippet named a model the server did not
serve). Each ```python block is extracted from README.md and run in a fresh interpreter; the OpenAI one against
a real daemon, found through the ``EDGEKV_URL`` variable the snippet reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _run(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_the_readme_has_its_two_snippets():
    blocks = _blocks()
    assert len(blocks) == 2
    assert "Runtime.from_pretrained" in blocks[0] and "OpenAI(" in blocks[1]


@pytest.mark.slow
def test_the_python_api_snippet_runs_as_written():
    out = _run(_blocks()[0])
    assert out.returncode == 0, out.stderr[-3000:]
    first, stats = out.stdout.strip().splitlines()[-2:]
    assert first.split()[0] == "triangle", out.stdout  # the scene's purple shape
    assert "'cache_capacity_tokens': 1024" in stats


def test_the_openai_snippet_runs_as_written(tmp_path):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon

    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:events?size=112x112&fps=2&frames=100000&seed=2", "fps": 2.0,
               "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"port": 0}, generation={"max_new_tokens": 4}, monitor={"backend": "cpu"})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        out = _run(_blocks()[1], env={"EDGEKV_URL": f"{run.base}/v1", "EDGEKV_TOKEN": "none"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip(), "the streamed answer is empty"
