"""CappedKVCache bookkeeping on toy specs: exact slots, eviction order, bytes, no allocation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgekv.cache import CacheFullError, CacheSpec, CappedKVCache, ChunkMeta, SlotKind


def _cache(capacity: int = 16, layers: int = 2, heads: int = 2, dim: int = 4) -> CappedKVCache:
    return CappedKVCache(CacheSpec.uniform(layers, heads, dim, torch.float32), capacity)


def _write(cache: CappedKVCache, num: int, frame: int, base: float) -> torch.Tensor:
    """Write ``num`` tokens whose K values encode (layer, head, token) so moves can be traced."""
    start = cache.length
    values = torch.empty(cache.num_layers, cache.kv_heads, num, cache.head_dim)
    for layer in range(cache.num_layers):
        for head in range(cache.kv_heads):
            values[layer, head] = (base + torch.arange(num, dtype=torch.float32)).unsqueeze(-1) + 1000 * layer + 100 * head
        cache.write_layer(layer, start, values[layer], -values[layer])
    index = torch.arange(num)
    cache.write_meta(start, num, ChunkMeta(SlotKind.VISION, frame=frame, rows=index // 2, cols=index % 2, tpos=index + start))
    cache.commit(num)
    return values


def test_capacity_bytes_come_from_the_spec():
    spec = CacheSpec.uniform(36, 2, 128, torch.bfloat16)
    # K and V, 36 layers, 2 KV heads, head_dim 128, 2 bytes: the Qwen2.5-VL-3B shape.
    assert spec.layers[0].kv_bytes_per_token * 36 == 2 * 36 * 2 * 128 * 2
    cache = CappedKVCache(CacheSpec.uniform(3, 2, 8, torch.float16), 40)
    assert cache.capacity_bytes == cache.spec.bytes_for(40)
    assert cache.spec.tokens_for_bytes(cache.capacity_bytes) == 40


def test_write_commit_truncate_metadata():
    cache = _cache()
    _write(cache, 4, frame=0, base=0)
    _write(cache, 3, frame=1, base=10)
    assert cache.length == 7
    assert cache.frame[0, 0, :7].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert cache.kind[1, 1, :8].tolist() == [int(SlotKind.VISION)] * 7 + [int(SlotKind.EMPTY)]
    cache.truncate(4)
    assert cache.length == 4
    assert cache.frame[0, 0, 4:7].tolist() == [-1, -1, -1]
    with pytest.raises(ValueError):
        cache.truncate(5)


def test_full_cache_raises_instead_of_dropping():
    cache = _cache(capacity=8)
    _write(cache, 6, frame=0, base=0)
    with pytest.raises(CacheFullError, match="6 of 8"):
        cache.commit(3)
    assert cache.length == 6


def test_compaction_keeps_exact_slots_per_head_in_order():
    cache = _cache(capacity=12)
    values = _write(cache, 10, frame=3, base=0)
    keep = torch.tensor([
        [[0, 2, 4, 9], [1, 3, 5, 7]],
        [[5, 6, 7, 8], [0, 1, 8, 9]],
    ])
    cache.compact(keep)
    assert cache.length == 4
    for layer in range(2):
        for head in range(2):
            expected = values[layer, head, keep[layer, head]]
            assert torch.equal(cache.k[layer, head, :4], expected)
            assert torch.equal(cache.v[layer, head, :4], -expected)
            assert cache.tpos[layer, head, :4].tolist() == keep[layer, head].tolist()
            assert cache.row[layer, head, :4].tolist() == (keep[layer, head] // 2).tolist()
    assert cache.kind[:, :, 4:].eq(int(SlotKind.EMPTY)).all()


@pytest.mark.parametrize("bad", [
    torch.tensor([[[2, 1]] * 2] * 2),           # not increasing
    torch.tensor([[[0, 0]] * 2] * 2),           # repeated
    torch.tensor([[[0, 9]] * 2] * 2),           # beyond length
    torch.tensor([[0, 1]]),                     # wrong shape
])
def test_bad_keep_is_refused_and_leaves_the_cache_untouched(bad):
    cache = _cache()
    _write(cache, 5, frame=0, base=0)
    k_before, tpos_before = cache.k.clone(), cache.tpos.clone()
    with pytest.raises(ValueError):
        cache.compact(bad)
    assert cache.length == 5
    assert torch.equal(cache.k, k_before) and torch.equal(cache.tpos, tpos_before)


def test_no_allocation_across_many_writes_and_compactions():
    cache = _cache(capacity=32)
    pointers, nbytes = cache.data_ptrs(), cache.capacity_bytes
    for step in range(100):
        if cache.length + 5 > cache.capacity:
            keep = torch.arange(0, cache.length, 2)[:12].expand(cache.num_layers, cache.kv_heads, -1).contiguous()
            cache.compact(keep)
        _write(cache, 5, frame=step, base=step)
    assert cache.data_ptrs() == pointers
    assert cache.capacity_bytes == nbytes


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_property_cap_never_exceeded_and_matches_a_list_model(data):
    capacity = data.draw(st.integers(4, 40))
    cache = _cache(capacity=capacity, layers=2, heads=2, dim=2)
    model = [[[] for _ in range(2)] for _ in range(2)]  # per layer/head: list of token ids (tpos)
    pointers = cache.data_ptrs()
    token = 0
    for _ in range(data.draw(st.integers(1, 25))):
        num = data.draw(st.integers(1, capacity))
        if cache.length + num > capacity:
            with pytest.raises(CacheFullError):
                cache.commit(num)
            target = data.draw(st.integers(0, cache.length))
            keep = torch.stack([
                torch.stack([torch.sort(torch.randperm(cache.length)[:target]).values for _ in range(2)])
                for _ in range(2)
            ])
            cache.compact(keep)
            model = [[[model[l][h][i] for i in keep[l, h].tolist()] for h in range(2)] for l in range(2)]
            if cache.length + num > capacity:
                continue
        start = cache.length
        for layer in range(2):
            cache.write_layer(layer, start, torch.zeros(2, num, 2), torch.zeros(2, num, 2))
        cache.write_meta(start, num, ChunkMeta(SlotKind.TEXT, tpos=torch.arange(token, token + num)))
        cache.commit(num)
        for l in range(2):
            for h in range(2):
                model[l][h].extend(range(token, token + num))
        token += num
        assert cache.length <= capacity
        for l in range(2):
            for h in range(2):
                assert cache.tpos[l, h, : cache.length].tolist() == model[l][h]
    assert cache.data_ptrs() == pointers
