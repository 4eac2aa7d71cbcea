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
    for helper in ("stamp", "gpu_info", "checkpoint_3b", "gpu_tests", "stream_3b"):
        assert f"{helper}()" in setup, helper


def test_products_3b_checks_itself_on_the_cpu(tmp_path):
    out = tmp_path / "products.json"
    run = subprocess.run([sys.executable, str(TOOLS / "products_3b.py"), "--small", "--replays", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=TOOLS, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 11 and all("us" in row and "error" not in row for row in rows)


def test_vit_mlp_3b_checks_itself_on_the_cpu(tmp_path):
    """The padded vision-MLP timing (a lead for the next device call): every width runs, and zero padding leaves
    the MLP's output as it was (on the CPU, bit for bit at this toy width)."""
    out = tmp_path / "vit.json"
    run = subprocess.run([sys.executable, str(TOOLS / "vit_mlp_3b.py"), "--small", "--replays", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=TOOLS, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    import json

    rows = json.loads(out.read_text())["rows"]
    assert [row["width"] for row in rows] == [84, 88, 96]
    assert all("error" not in row and row["mlp_us"] > 0 and row["max_abs_diff"] < 1e-5 for row in rows)


def test_toy_budget_sizes_the_run_to_the_time_left(tmp_path):
    """``toy_budget.py`` (lease_toy.sh): from a calibration card's timed warm-up and question steps, the steps that
    fill the seconds given (the warm-up's share of them); a card without timed steps is refused by name."""
    import json

    card = tmp_path / "card.json"
    # warm-up: 20 steps in 10 s (0.5 s each); questions between the two log lines: 20 steps in 10 s (the first
    # 20 took 50 s with the workers' start-up, which is not a step's time)
    card.write_text(json.dumps({"vision_history": [{"vision_step": 20, "seconds": 10.0}],
                                "history": [{"step": 20, "seconds": 60.0}, {"step": 40, "seconds": 70.0}]}))
    run = subprocess.run([sys.executable, str(TOOLS / "toy_budget.py"), str(card), "--seconds", "330",
                          "--vision-share", "0.3"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["180", "420"]  # (330 - 30) s: 90 s of warm-up, 210 s of questions
    card.write_text(json.dumps({"vision_history": [{"vision_step": 20, "seconds": 6.0},
                                                   {"vision_step": 40, "seconds": 8.0}],
                                "history": [{"step": 20, "seconds": 20.0}, {"step": 40, "seconds": 21.0}]}))
    run = subprocess.run([sys.executable, str(TOOLS / "toy_budget.py"), str(card), "--seconds", "130",
                          "--overhead", "30"], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["300", "1400"]  # 0.1 s and 0.05 s a step: 30 s and 70 s of the 100 s
    card.write_text(json.dumps({"history": [{"step": 40, "seconds": 30.0}]}))
    run = subprocess.run([sys.executable, str(TOOLS / "toy_budget.py"), str(card), "--seconds", "330"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no timed warm-up" in run.stderr


def test_toy_budget_picks_the_batch_with_the_most_streams_a_second(tmp_path):
    """``toy_budget.py --pick-batch`` (lease_toy.sh's BATCH=auto): from a step profile, the batch whose TF32 step
    trains on the most samples a second (samples a step over wall ms, not the batch asked: long stages take fewer);
    a missing or empty profile gives the fallback."""
    import json

    def pick(*args: str) -> str:
        run = subprocess.run([sys.executable, str(TOOLS / "toy_budget.py"), *args], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    profile = tmp_path / "toy-step.json"
    rows = [{"products": "tf32", "batch": 32, "samples": 8, "wall_ms_per_step": 60.0},     # 0.133 a ms
            {"products": "tf32", "batch": 64, "samples": 16, "wall_ms_per_step": 100.0},   # 0.160
            {"products": "tf32", "batch": 128, "samples": 32, "wall_ms_per_step": 210.0},  # 0.152
            {"products": "fp32", "batch": 128, "samples": 32, "wall_ms_per_step": 150.0}]  # not the products trained
    profile.write_text(json.dumps({"rows": rows}))
    assert pick("--pick-batch", str(profile)) == "64"
    profile.write_text(json.dumps({"rows": []}))
    assert pick("--pick-batch", str(profile), "--fallback", "16") == "16"
    assert pick("--pick-batch", str(tmp_path / "missing.json")) == "32"
    run = subprocess.run([sys.executable, str(TOOLS / "toy_budget.py")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--pick-batch" in run.stderr


def test_int4_variants_check_themselves_in_the_interpreter(tmp_path):
    """The 4-bit GEMV variants the next device call times (``--only magic``: bits or'ed into 2^23 instead of an
    int -> float conversion, the zero point out of the K sum) give the product the shipped kernel gives, at toy
    shapes with a partial last tile (N 200: 25 words in a 16-word tile) in Triton's CPU interpreter."""
    import json
    import os

    pytest.importorskip("triton")
    out = tmp_path / "variants.json"
    run = subprocess.run([sys.executable, str(TOOLS / "int4_variants.py"), "--small", "--replays", "1", "--only",
                          "magic", "--json", str(out)], capture_output=True, text=True, cwd=TOOLS, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    names = [row["variant"] for row in rows]
    assert names.count("magic-128x128") == 2 and names.count("shipped") == 2 and "lanes-128x128" not in names
    assert all("error" not in row for row in rows), rows
    shipped = {row["k"]: row["max_abs_diff"] for row in rows if row["variant"] == "shipped"}
    for row in rows:
        if row["variant"].startswith("magic"):
            # bf16 activations and output: the output's rounding dominates, as for the shipped kernel
            assert row["max_abs_diff"] <= 1.01 * shipped[row["k"]] + 1e-6, row


def test_attention_mass_variants_check_themselves_in_the_interpreter(tmp_path):
    """The StateKV prefill's attention + mass with its occupancy knobs (tools/gpu/attention_mass_3b.py, the next
    device call): every variant's out and mass within float error of the fp64 reference in the interpreter."""
    import json
    import os

    pytest.importorskip("triton")
    out = tmp_path / "mass.json"
    run = subprocess.run([sys.executable, str(TOOLS / "attention_mass_3b.py"), "--small", "--replays", "1",
                          "--splits", "1,8", "--json", str(out)], capture_output=True, text=True, cwd=TOOLS,
                         timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r.get("forward_block_m"), r.get("mass_split")) for r in rows] == [
        (None, None), (16, 1), (16, 8), (32, 1), (32, 8)]
    assert all("error" not in row and row["max_diff_out"] < 1e-5 and row["max_diff_mass"] < 1e-5 for row in rows), rows


def test_toy_step_profile_checks_itself_on_the_cpu(tmp_path):
    """The toy training step's profile (lease_toy.sh, issue 27): a tiny toy's steps run and are counted."""
    import json

    out = tmp_path / "steps.json"
    run = subprocess.run([sys.executable, str(TOOLS / "toy_step_profile.py"), "--small", "--batches", "2",
                          "--progress", "0.3", "--steps", "1", "--json", str(out)],
                         capture_output=True, text=True, cwd=TOOLS, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["products"] for row in rows] == ["tf32", "fp32"]  # each timed (on the CPU the same products)
    for row in rows:
        assert row["batch"] == 2 and row["tokens"] > 0 and row["wall_ms_per_step"] > 0 and row["aten_ops_per_step"] > 0
    bad = subprocess.run([sys.executable, str(TOOLS / "toy_step_profile.py"), "--small", "--products", "fp16"],
                         capture_output=True, text=True, cwd=TOOLS, timeout=600)
    assert bad.returncode == 2 and "--products" in bad.stderr
