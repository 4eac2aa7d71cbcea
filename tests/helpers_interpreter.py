"""The Triton kernel modules run once, together, in Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the interpreted run is a pytest process of its
own; each module's ``test_*_in_triton_interpreter`` used to start one (about 5 s of interpreter, torch, Triton
and collection each). The first of them to run starts it for every module in ``MODULES``, and each reads its own
module's outcome from the run's JUnit XML.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

MODULES = ("test_int4_kernels.py", "test_kernels.py", "test_decode_attention_kernel.py")


@dataclass(frozen=True)
class InterpretedRun:
    returncode: int
    output: str  # stdout, then stderr
    cases: tuple[tuple[str, str, str], ...]  # (module, test, outcome): passed, failed, error or skipped

    def outcomes(self, module_file: str) -> dict[str, list[str]]:
        """Test names of ``module_file`` by outcome."""
        module = Path(module_file).stem
        found: dict[str, list[str]] = {}
        for owner, name, outcome in self.cases:
            if owner == module:
                found.setdefault(outcome, []).append(name)
        return found


def interpreted_run(rootpath: Path, markexpr: str) -> InterpretedRun:
    return _run(str(rootpath), markexpr)


@functools.cache
def _run(rootpath: str, markexpr: str) -> InterpretedRun:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("EDGEKV_TRITON", None)
    with tempfile.TemporaryDirectory(prefix="edgekv-interpreted-") as scratch:
        report = Path(scratch) / "junit.xml"
        command = [sys.executable, "-m", "pytest", *(str(Path(rootpath) / "tests" / m) for m in MODULES), "-q",
                   "-p", "no:cacheprovider", f"--junitxml={report}"]
        if markexpr:
            command += ["-m", markexpr]
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1200, cwd=rootpath)
        cases = tuple(_cases(report)) if report.is_file() else ()
    return InterpretedRun(result.returncode, result.stdout + result.stderr, cases)


def _cases(report: Path):
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").rpartition(".")[2] or case.get("name", "").rpartition(".")[2]
        children = {child.tag for child in case}
        outcome = ("failed" if "failure" in children else "error" if "error" in children
                   else "skipped" if "skipped" in children else "passed")
        yield module, case.get("name", ""), outcome
