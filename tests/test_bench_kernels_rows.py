"""`edgekv bench kernels`: every row family runs at ``--small`` (Triton in its interpreter, in a process of its
own: ``TRITON_INTERPRET=1`` must be set before Triton is imported), the 8-bit attention and 4-bit rows carry the
bf16 baseline and its ratio, ``--only`` picks families, and the L2-defeating copies are counted as documented.
Speed is never asserted: these are the shapes of the figures, not their values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from edgekv.apps.bench.kernels import FAMILIES, PassTimer, row_families
from edgekv.apps.cli import main


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench-kernels")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("EDGEKV_TRITON", None)
    result = subprocess.run(
        [sys.executable, "-m", "edgekv.apps.cli", "bench", "kernels", "--small", "--device", "cpu", "--warmup", "0",
         "--repeats", "1", "--json", str(out / "k.json"), "--plot", str(out / "k.png")],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return json.loads((out / "k.json").read_text()), result.stdout


@pytest.mark.slow
def test_small_bench_runs_every_family_with_bf16_baselines(small_run):
    record, printed = small_run
    rows = record["rows"]
    assert record["families"] == list(FAMILIES)
    assert {r["kernel"] for r in rows} >= {"attention_mass", "tar_scores", "value_norms", "layer_cv", "pooled_van",
                                           "compact_", "quant_attention", "int4_gemv", "int4_gemm"}
    quant = [r for r in rows if r["kernel"] == "quant_attention"]
    int4 = [r for r in rows if r["kernel"].startswith("int4_")]
    # 2 key counts x (decode, pair) x (int8, fp8); 4 widths x (one row, a pair's 16 rows)
    assert len(quant) == 8 and {r["shape"].split()[0] for r in quant} == {"int8", "fp8"}
    assert {r["shape"].split()[3] for r in quant} == {"P1", "P16"}
    assert len(int4) == 8 and sum(r["kernel"] == "int4_gemv" for r in int4) == 4
    assert record["rotate_bytes"] == 0 and record["graph"] is False  # CPU: one input set, no CUDA graph
    for r in quant + int4:
        assert r["bf16_ms"] > 0 and r["sets"] == 1
    triton_ran = "interpreter" in record["backend"]
    for r in rows:
        assert (r["triton_ms"] is not None) == triton_ran
    if triton_ran:
        for r in quant + int4:
            assert r["bf16_ratio"] == pytest.approx(r["bf16_ms"] / r["triton_ms"]) and r["bf16_ratio"] > 0
            assert r["max_abs_diff"] < 0.05, r  # bf16 roundings of O(1) outputs
            assert r["timing"] == "eager"
    assert "bf16 ms" in printed and "vs bf16" in printed and "issue 32" in printed
    assert printed.count("quant_attention ") == 8


def test_only_selects_families_in_bench_order():
    assert row_families("int4, quant_attention") == ("quant_attention", "int4")
    assert row_families("policy") == ("policy",)


@pytest.mark.parametrize("text", ["int4,gemm", "", " , "])
def test_only_rejects_an_unknown_family(text, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "kernels", "--small", "--only", text])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --only: unknown row family" in err and "choose from attention, policy" in err


def test_copies_read_the_rotation_budget_per_pass():
    inputs = (torch.zeros(250, dtype=torch.int32), torch.ones(10, dtype=torch.bfloat16))  # 1000 + 20 bytes
    timer = PassTimer(torch.device("cpu"), warmup=0, repeats=1, rotate_bytes=4096, graph=False)
    sets = timer.copies(inputs)
    assert len(sets) == 5  # ceil(4096 / 1020)
    assert sets[0] is inputs
    for copy in sets[1:]:
        assert all(torch.equal(a, b) and a.data_ptr() != b.data_ptr() for a, b in zip(copy, inputs))
    one = PassTimer(torch.device("cpu"), warmup=0, repeats=1, rotate_bytes=0, graph=True).copies(inputs)
    assert len(one) == 1


def test_a_pass_calls_once_per_copy_and_reports_per_call_time():
    calls = []
    timer = PassTimer(torch.device("cpu"), warmup=2, repeats=3, rotate_bytes=0, graph=True)
    sets = [(torch.tensor(i),) for i in range(4)]
    ms, how = timer(lambda t: calls.append(int(t)), sets)
    assert calls == [0, 1, 2, 3] * 5 and how == "eager" and ms >= 0  # CPU: no CUDA graph
