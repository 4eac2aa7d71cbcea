"""Thread policy (edgekv/threads.py): runtime.threads / --threads, the auto rule, and the OpenMP wait policy
set before torch loads."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import edgekv.threads as threads
from edgekv.config import ConfigError, EdgeKVConfig


@pytest.mark.parametrize("cpus,want", [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (8, 4), (12, 4), (64, 4)])
def test_auto_is_one_thread_per_two_cores_capped_at_four(cpus, want):
    assert threads.default_threads(cpus) == want


def test_runtime_threads_in_the_config():
    assert EdgeKVConfig().runtime.threads == "auto"
    assert EdgeKVConfig().with_overrides(runtime={"threads": 3}).runtime.threads == 3
    for bad, reason in ((0, ">= 1"), ("many", "positive integer or 'auto'"), (True, "expected int or str"),
                        (1.5, "expected int or str")):
        with pytest.raises(ConfigError, match=rf"runtime\.threads.*{reason}"):
            EdgeKVConfig().with_overrides(runtime={"threads": bad})


def test_threads_argument_and_parse_refuse_bad_values():
    import argparse

    assert threads.threads_argument("2") == 2 and threads.threads_argument("AUTO") == "auto"
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'auto'"):
            threads.threads_argument(bad)


def test_apply_threads_explicit_count_wins_over_auto(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.setattr(threads, "_explicit", None)
    monkeypatch.setattr(threads, "usable_cpus", lambda: 8)
    try:
        assert threads.apply_threads("auto") == 4  # nothing chosen yet: the rule
        assert threads.apply_threads(1) == 1
        assert threads.apply_threads("auto") == 1  # a bench's --threads 1, then a Runtime's auto: 1 stays
        assert threads.apply_threads(None) == 1
    finally:
        torch.set_num_threads(before)


def test_camera_threads_flag_sets_runtime_threads(tmp_path):
    from edgekv.apps.args import config_from_args
    from edgekv.apps.daemon.camera import build_parser

    args = build_parser().parse_args(["--model", str(tmp_path), "--threads", "2"])
    assert config_from_args(args).runtime.threads == 2
    args = build_parser().parse_args(["--model", str(tmp_path), "--set", "runtime.threads=auto"])
    assert config_from_args(args).runtime.threads == "auto"


_PROBE = textwrap.dedent("""
    import os, sys
    seen = {}
    class RecordAtTorchImport:  # what OMP_WAIT_POLICY was when torch was first imported
        def find_spec(self, name, path=None, target=None):
            if name == "torch" and "torch" not in seen:
                seen["torch"] = os.environ.get("OMP_WAIT_POLICY")
            return None
    sys.meta_path.insert(0, RecordAtTorchImport())
    from edgekv.apps.cli import main
    assert "torch" not in sys.modules, "importing the CLI must not import torch"
    code = main(["bench", "compression", "--layers", "1", "--tokens", "40", "--head-dim", "8", "--grid", "2", "2",
                 "--dtypes", "fp32", "--policies", "van", "--repeats", "1", "--json", sys.argv[1], "--plot", ""])
    import torch
    print("policy", seen.get("torch"), "threads", torch.get_num_threads(), "code", code)
""")


@pytest.mark.parametrize("environment,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_wait_policy_is_set_before_torch_loads_and_the_environment_wins(tmp_path, environment, want):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    if environment is not None:
        env["OMP_WAIT_POLICY"] = environment
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path / "b.json")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    auto = threads.default_threads()
    assert f"policy {want} threads {auto} code 0" in out.stdout


def test_bench_threads_refuses_an_unknown_wait_policy(tmp_path, capsys):
    from edgekv.apps.cli import main

    assert main(["bench", "threads", "--wait", "spin", "--json", str(tmp_path / "t.json"), "--plot", ""]) == 2
    assert "unknown OMP_WAIT_POLICY 'SPIN'" in capsys.readouterr().err  # one line, the CLI's exit 2 for a mistake
