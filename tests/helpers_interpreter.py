"""The Triton kernel modules run once, together, in Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before Triton is imported, so the interpreted run is a pytest process of its
own; each module's ``test_*_in_triton_interpreter`` used to start one (about 5 s of interpreter, torch, Triton
and collection each). The first of them to run starts it for every module in ``MODULES``, and each reads its own
module's outcome from the run's JUnit XML. Under pytest-xdist the modules may land on different workers: the
first worker to get there runs it under a file lock and leaves the outcome beside the lock for the others (one
run per test session, ``PYTEST_XDIST_TESTRUNUID``), instead of each worker running all of it again.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.util
import json
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
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not session:
        return _interpret(rootpath, markexpr)
    key = hashlib.sha256(f"{session}\0{rootpath}\0{markexpr}".encode()).hexdigest()[:16]
    shared = Path(tempfile.gettempdir()) / f"edgekv-interpreted-{key}"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes: the other workers wait for the run
        saved = shared / "run.json"
        if saved.is_file():
            data = json.loads(saved.read_text())
            return InterpretedRun(data["returncode"], data["output"], tuple(tuple(case) for case in data["cases"]))
        run = _interpret(rootpath, markexpr)
        saved.write_text(json.dumps({"returncode": run.returncode, "output": run.output, "cases": run.cases}))
        return run


def _interpret(rootpath: str, markexpr: str) -> InterpretedRun:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("EDGEKV_TRITON", None)
    with tempfile.TemporaryDirectory(prefix="edgekv-interpreted-") as scratch:
        report = Path(scratch) / "junit.xml"
        command = [sys.executable, "-m", "pytest", *(str(Path(rootpath) / "tests" / m) for m in MODULES), "-q",
                   "-p", "no:cacheprovider", f"--junitxml={report}"]
        if importlib.util.find_spec("xdist") is not None:
            command += ["-n", "0"]  # one process: the interpreted kernels are one run, not split over workers
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
