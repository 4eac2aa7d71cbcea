"""The prepared device calls (tools/gpu/, issue 32) parse and their CPU checks run: device time is 15 minutes a
session, and a script that fails at its first line wastes a machine start."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools" / "gpu"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", sorted(p.name for p in TOOLS.glob("*.sh")))
def test_the_lease_scripts_parse(script):
    run = subprocess.run(["bash", "-n", str(TOOLS / script)], capture_output=True, text=True)
    assert run.returncode == 0, f"{script}: {run.stderr}"


def test_the_helpers_the_lease_scripts_call_are_defined():
    setup = (TOOLS / "setup.sh").read_text()
    for helper in ("stamp", "checkpoint_3b", "gpu_tests", "stream_3b"):
        assert f"{helper}()" in setup, helper


def test_products_3b_checks_itself_on_the_cpu(tmp_path):
    out = tmp_path / "products.json"
    run = subprocess.run([sys.executable, str(TOOLS / "products_3b.py"), "--small", "--replays", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=TOOLS, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 11 and all("us" in row and "error" not in row for row in rows)
