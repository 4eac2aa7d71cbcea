"""``edgekv bench decode --device cuda``: its code on the CPU (the graph routes' static step runs eagerly there),
its refusals, and one gpu-marked run. Figures are never asserted: only that they were measured and agree."""

from __future__ import annotations

import argparse

import pytest
import torch

from edgekv.apps.bench.decode_gpu import kernel_kind, run_decode_cuda


def _args(**overrides) -> argparse.Namespace:
    values = dict(device="cpu", dtypes="fp32", cuda_routes="eager,graph", prompt=12, tokens=5, repeats=2,
                  capacity=40, profile=True, no_hf=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_the_gpu_decode_bench_code_runs_on_the_cpu(tiny_checkpoint):
    result = run_decode_cuda(_args(), str(tiny_checkpoint), allow_cpu=True)
    rows = {(r["engine"], r["route"]): r for r in result["rows"]}
    assert set(rows) == {("edgekv", "eager"), ("edgekv", "graph"), ("transformers", "generate")}
    eager, graph, hf = rows["edgekv", "eager"], rows["edgekv", "graph"], rows["transformers", "generate"]
    assert len(eager["tokens"]) == 5 and graph["tokens_match_eager"] and eager["tokens_match_eager"]
    assert hf["tokens"] == eager["tokens"]  # transformers' greedy tokens: the same model, the same prompt
    for row in result["rows"]:
        assert row["tok_s"] > 0 and 0 < row["share_of_bound"] and row["bound_tok_s"] > 0
    # the graph reads every slot of the cache, the eager route the valid prefix
    assert graph["bytes_per_token"] > eager["bytes_per_token"]
    assert graph["tok_s_chained"] > 0 and len(graph["tok_s_chained_runs"]) == 2
    profile = graph["profile"]
    assert profile["top"] and profile["device_us_per_token"] > 0
    assert any(k["kind"] == "matrix products" for k in profile["top"]) or "matrix products" in profile["by_kind_us_per_token"]
    assert result["copy_bandwidth_tb_s"] > 0 and result["read_bandwidth_tb_s"] > 0


def test_the_gpu_decode_bench_refuses_what_it_cannot_run(tiny_checkpoint):
    with pytest.raises(SystemExit, match="not a CUDA device"):
        run_decode_cuda(_args(), str(tiny_checkpoint))
    with pytest.raises(ValueError, match="--capacity"):
        run_decode_cuda(_args(capacity=10), str(tiny_checkpoint), allow_cpu=True)
    with pytest.raises(ValueError, match="route"):
        run_decode_cuda(_args(cuda_routes="eager,warp"), str(tiny_checkpoint), allow_cpu=True)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            run_decode_cuda(_args(device="cuda"), str(tiny_checkpoint))


def test_kernel_kinds():
    assert kernel_kind("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "matrix products"
    assert kernel_kind("nvjet_hsh_64x8_64x16_2x1_v_bz_splitK_TNT") == "matrix products"
    assert kernel_kind("fmha_cutlassF_bf16_aligned_64x128_rf_sm80") == "attention"
    assert kernel_kind("void at::native::index_copy_kernel_impl") == "copies and index writes"
    assert kernel_kind("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "fused (Triton)"
    assert kernel_kind("triton_poi_fused_mul_silu_1") == "fused (Triton)"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add>") == \
        "elementwise and reductions"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_bench_on_cuda(tiny_checkpoint):
    result = run_decode_cuda(_args(device="cuda", dtypes="bf16", cuda_routes="eager,graph,compiled", no_hf=True),
                             str(tiny_checkpoint))
    assert [r["route"] for r in result["rows"]] == ["eager", "graph", "compiled"]
    assert all(r["tok_s"] > 0 for r in result["rows"])
    assert result["rows"][1]["profile"]["kernels_per_token"] > 0
