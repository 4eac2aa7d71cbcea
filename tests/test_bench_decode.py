"""edgekv bench decode at the tiny shape: JSON + PNG, the bytes it counts, and greedy tokens equal to
transformers' generate on the same checkpoint and prompt (so the two engines decode the same thing)."""

from __future__ import annotations

import json

import pytest


def test_bench_decode_figures_and_same_tokens_as_transformers(tiny_checkpoint, tmp_path):
    from edgekv.apps.cli import main
    from edgekv.model import load_pretrained

    out = tmp_path / "d.json"
    code = main(["bench", "decode", "--model", str(tiny_checkpoint), "--dtypes", "fp32", "--prompt", "5",
                 "--tokens", "4", "--repeats", "1", "--threads", "1", "--bandwidth-mib", "64",
                 "--json", str(out), "--plot", str(tmp_path / "d.png")])
    assert code == 0
    result = json.loads(out.read_text())
    ours, theirs = result["rows"]
    assert (ours["engine"], theirs["engine"]) == ("edgekv", "transformers")
    assert ours["tokens"] == theirs["tokens"] and len(ours["tokens"]) == 4
    language = load_pretrained(tiny_checkpoint, skip=("visual",)).language
    text = language.config
    weights = sum(p.numel() * 4 for p in {id(p): p for p in language.parameters()}.values())
    kv = (5 + 4 // 2) * 2 * text.num_hidden_layers * text.num_key_value_heads * text.head_dim * 4
    assert ours["bytes_per_token"] == theirs["bytes_per_token"] == weights + kv
    for row in (ours, theirs):
        assert row["tok_s"] > 0 and row["bound_tok_s"] == pytest.approx(row["read_bandwidth_gb_s"] * 1e9 / (weights + kv))
    assert (tmp_path / "d.png").stat().st_size > 1000


def test_bench_decode_refuses_bad_arguments(tmp_path, capsys):
    """A mistake is one line naming the option and exit 2 (a SystemExit with text exited 1)."""
    from edgekv.apps.cli import main

    base = ["bench", "decode", "--json", str(tmp_path / "d.json"), "--plot", ""]
    for extra, message in ((["--dtypes", "fp8"], "unknown dtype 'fp8'"), (["--routes", "fast"], "unknown route 'fast'"),
                           (["--tokens", "1"], "--tokens >= 2"), (["--repeats", "0"], "--repeats: at least 1")):
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "d.json").exists()


def test_bench_decode_runs_the_native_route_for_bf16_only(tiny_checkpoint, tmp_path):
    from edgekv.apps.cli import main
    from edgekv.kernels import cpu_gemv

    if cpu_gemv.load() is None:
        pytest.skip(f"the C kernel cannot be built here: {cpu_gemv.unavailable_reason()}")
    out = tmp_path / "d.json"
    code = main(["bench", "decode", "--model", str(tiny_checkpoint), "--dtypes", "fp32,bf16", "--routes", "eager,native",
                 "--prompt", "5", "--tokens", "4", "--repeats", "1", "--threads", "1", "--bandwidth-mib", "64",
                 "--no-hf", "--json", str(out), "--plot", ""])
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["route"], r["dtype"]) for r in rows] == [("eager", "fp32"), ("eager", "bf16"), ("native", "bf16")]
    native = rows[-1]
    assert native["linears"] > 0 and len(native["tokens"]) == 4 and native["share_of_bound"] > 0
    assert native["bytes_per_token"] == rows[1]["bytes_per_token"]


def test_bench_decode_int4_counts_four_bit_bytes_and_packs_the_route(tiny_checkpoint, tmp_path):
    """int4 (issue 29): the tiny checkpoint quantized (group 16: its widths are 64 and 176), bf16 activations;
    the bound counts the 4-bit bytes, the same greedy tokens on both routes."""
    from edgekv.apps.cli import main
    from edgekv.kernels import cpu_gemv

    if cpu_gemv.load() is None:
        pytest.skip(f"the C kernel cannot be built here: {cpu_gemv.unavailable_reason()}")
    out = tmp_path / "d.json"
    code = main(["bench", "decode", "--model", str(tiny_checkpoint), "--dtypes", "bf16,int4", "--routes", "eager,native",
                 "--int4-routes", "eager,native", "--prompt", "5", "--tokens", "4", "--repeats", "1", "--threads", "1", "--bandwidth-mib", "64",
                 "--lm-heads", "as_loaded,int8", "--no-hf", "--json", str(out), "--plot", str(tmp_path / "d.png")])
    assert code == 0
    everything = json.loads(out.read_text())["rows"]
    rows = {(r["route"], r["dtype"]): r for r in everything if r["lm_head"] == "as_loaded"}
    assert set(rows) == {("eager", "bf16"), ("native", "bf16"), ("eager", "int4"), ("native", "int4")}
    # the int8 head (native route only): the tied table once in int8 + fp32 scales per 64 inputs instead of bf16
    heads = {r["dtype"]: r for r in everything if r["lm_head"] == "int8"}
    assert set(heads) == {"bf16", "int4"} and all(r["route"] == "native" and r["tied"] for r in heads.values())
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    vocab, d = config["vocab_size"], config["hidden_size"]
    for dtype, row in heads.items():
        assert rows["native", dtype]["bytes_per_token"] - row["bytes_per_token"] == vocab * d * 2 - vocab * d - vocab * (d // 64) * 4
        assert len(row["tokens"]) == 4
    native = rows["native", "int4"]
    assert native["int4_linears"] == 3 * 7 and native["int4_simd"] in ("avx512", "avx2", "neon", "portable")
    assert native["tokens"] == rows["eager", "int4"]["tokens"]
    # the 3 layers' linears in 4 bits (+ scales, zero points) instead of 16: fewer bytes than bf16
    linears = 3 * (64 * 64 * 2 + 64 * 32 * 2 + 3 * 64 * 176)
    saved = rows["eager", "bf16"]["bytes_per_token"] - rows["eager", "int4"]["bytes_per_token"]
    assert linears * 2 - linears // 2 - linears // 16 * 3 <= saved < linears * 2
