"""The decode fast path (GQA folded onto the query axis, no mask for one query) against the masked path.

Tolerance (STYLE: kernel tolerance): against an fp32 reference, the fast path's error is at most twice a
same-precision masked SDPA run's error plus one unit of that precision's rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgekv.attention import CacheAttention, chunk_causal_mask, folded_attention
from edgekv.cache import CacheSpec, CappedKVCache
from edgekv.model.language import expand_kv

EPS = {torch.float32: 1e-6, torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11}


def masked_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """The path decode took before: SDPA with the [P, N] chunk-causal bool mask over expanded KV heads."""
    group = q.shape[0] // keys.shape[0]
    mask = chunk_causal_mask(start, q.shape[1], q.device)
    return F.scaled_dot_product_attention(q, expand_kv(keys, group), expand_kv(values, group), attn_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("heads_q,heads_kv", [(8, 2), (16, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("start,num_new", [(0, 1), (1, 1), (37, 1), (2062, 1), (29, 5), (300, 16)])
def test_folded_attention_matches_the_masked_path(dtype, heads_q, heads_kv, start, num_new):
    gen = torch.Generator().manual_seed(start * 31 + num_new + heads_q)
    dim = 32
    q32 = torch.randn(heads_q, num_new, dim, generator=gen)
    k32, v32 = torch.randn(2, heads_kv, start + num_new, dim, generator=gen) * 2
    want = masked_reference(q32.double(), k32.double(), v32.double(), start)
    q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
    got = folded_attention(q, k, v, start)
    assert got.shape == (heads_q, num_new, dim) and got.dtype == dtype
    same_precision = masked_reference(q, k, v, start)
    bound = 2 * (same_precision.double() - want).abs().max().item() + EPS[dtype]
    assert (got.double() - want).abs().max().item() <= bound


def test_folded_attention_refuses_mismatched_shapes():
    q = torch.zeros(6, 1, 8)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        folded_attention(q, torch.zeros(4, 3, 8), torch.zeros(4, 3, 8), 2)
    with pytest.raises(ValueError, match="start \\+ P"):
        folded_attention(q, torch.zeros(2, 5, 8), torch.zeros(2, 5, 8), 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_new", [1, 6])
def test_cache_attention_without_visibility_equals_the_all_visible_masked_path(dtype, num_new):
    """CacheAttention with no visibility takes the fast path; with an all-true visibility it takes the
    masked path. Both write the chunk into the cache and return the same attention."""
    layers, heads_kv, heads_q, dim, capacity, start = 2, 2, 8, 16, 96, 50
    gen = torch.Generator().manual_seed(11)
    caches = [CappedKVCache(CacheSpec.uniform(layers, heads_kv, dim, dtype), capacity) for _ in range(2)]
    k0, v0 = torch.randn(2, *caches[0].k.shape, generator=gen).to(dtype)
    for cache in caches:
        cache.k.copy_(k0)
        cache.v.copy_(v0)
    fast = CacheAttention(caches[0], start, num_new)
    masked = CacheAttention(caches[1], start, num_new, visible=torch.ones(layers, heads_kv, start, dtype=torch.bool))
    for layer in range(layers):
        q = torch.randn(heads_q, num_new, dim, generator=gen).to(dtype)
        k_new, v_new = torch.randn(2, heads_kv, num_new, dim, generator=gen).to(dtype)
        got, want = fast(layer, q, k_new, v_new), masked(layer, q, k_new, v_new)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_answers_are_unchanged_by_the_fast_path(tiny_checkpoint, monkeypatch, dtype):
    """A session's question prefill and decode go through the fast path; swapping in the masked path
    (what decode ran before) gives the same greedy tokens on the same stream."""
    import numpy as np

    import edgekv
    import edgekv.attention as attention

    def run() -> list[int]:
        rt = edgekv.Runtime.from_pretrained(
            tiny_checkpoint, model={"dtype": dtype, "device": "cpu"}, video={"resolution": [112, 112], "fps": 2.0},
            cache={"policy": "full", "max_tokens": 512, "text_reserve_tokens": 64})
        session = rt.session()
        rng = np.random.default_rng(5)
        for i in range(6):
            session.ingest(rng.integers(0, 256, size=(120, 160, 3), dtype=np.uint8), t=i / 2.0)
        return session.ask("What is in the scene?", max_new_tokens=10).token_ids

    fast = run()
    monkeypatch.setattr(attention, "folded_attention", masked_reference)
    assert run() == fast
    assert len(fast) >= 1


def test_folded_attention_takes_a_non_contiguous_sdpa_result(monkeypatch):
    """CUDA's memory-efficient SDPA returned [1, Hkv, G * P, D] in a transposed layout (fp32 on an H200, issue
    32), which ``view`` refused: every fp32 question of a CUDA session failed. Here SDPA is made to return the
    same values in that layout on the CPU; the result must not change."""
    import edgekv.kernels.sdpa as sdpa_module

    real = F.scaled_dot_product_attention

    def transposed(*args, **kwargs):
        out = real(*args, **kwargs)  # [1, Hkv, G * P, D]
        strided = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, not viewable as [Hq, P, D]
        assert not strided.is_contiguous()
        return strided

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(8, 3, 16, generator=gen)
    k, v = torch.randn(2, 2, 10 + 3, 16, generator=gen)
    want = folded_attention(q, k, v, 10)
    monkeypatch.setattr(sdpa_module.F, "scaled_dot_product_attention", transposed)
    assert torch.equal(folded_attention(q, k, v, 10), want)
