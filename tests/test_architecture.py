"""The layer rules of docs/architecture.md, checked on the package as it installs: import-linter's contracts
(setup.cfg ``[importlinter]``) and no import circle between any two modules of ``edgekv``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from stage_package import stage  # noqa: E402

pytest.importorskip("importlinter", reason="import-linter not installed (pip install 'edgekv[test]')")


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    return stage(tmp_path_factory.mktemp("staged"))


def _run(code: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(code, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_the_staged_tree_is_the_installed_layout(staged):
    assert (staged / "edgekv" / "apps" / "daemon" / "loop.py").is_file()
    assert (staged / "edgekv" / "kernels" / "sdpa.py").is_file()
    assert (staged / "edgekv" / "session" / "stream.py").is_file()
    assert not (staged / "edgekv" / "apps" / "apps").exists()


def test_import_linter_contracts_hold(staged):
    out = _run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
                "sys.exit(lint_imports_command())", str(ROOT / "setup.cfg")], staged)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


PROBE = """
import json, grimp
graph = grimp.build_graph("edgekv", exclude_type_checking_imports=True)
circles = []
for module in sorted(graph.modules):
    for imported in sorted(graph.find_modules_directly_imported_by(module)):
        back = graph.find_shortest_chain(importer=imported, imported=module)
        if back is not None:
            circles.append([module, *back])
print(json.dumps({"modules": len(graph.modules), "circles": circles}))
"""


def test_no_import_circle_between_modules(staged):
    out = _run([sys.executable, "-c", PROBE], staged)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["modules"] > 100
    assert found["circles"] == [], "\n".join(" -> ".join(c) for c in found["circles"][:10])
