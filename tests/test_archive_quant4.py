"""4-bit archive records (edgekv/archive/quant4.py): keys per channel over the pair's tokens, values per token,
asymmetric, 16 levels, two codes a byte; bf16 scales and minima chosen so that nothing clips."""

from __future__ import annotations

import pytest
import torch

from edgekv.archive.quant4 import LEVELS, dequantize_into, layer_bytes, quantize_layers


def _pair(layers=2, heads=2, tokens=16, dim=32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, heads, tokens, dim, generator=g)


def _round_trip(kv: torch.Tensor) -> torch.Tensor:
    layers, _, heads, tokens, dim = kv.shape
    rows = quantize_layers(kv)
    assert rows.shape == (layers, layer_bytes(heads, tokens, dim)) and rows.dtype == torch.uint8
    out = torch.empty(layers, 2, heads, tokens, dim)
    for layer in range(layers):
        dequantize_into(rows[layer], tokens, out[layer, 0], out[layer, 1])
    return out


def test_every_value_is_within_half_a_step_of_its_group():
    """A value comes back within half its group's step (range / 15, rounded up to bf16) plus bf16's rounding of the
    minimum: nothing clips, whatever the group's range; keys' groups are channels, values' groups tokens."""
    kv = _pair()
    kv[:, 0, :, :, 3] = kv[:, 0, :, :, 3] * 40 + 100  # an outlier key channel, far from zero
    got = _round_trip(kv)
    k, v = kv[:, 0], kv[:, 1]
    k_step = (k.amax(dim=-2, keepdim=True) - k.amin(dim=-2, keepdim=True)) / LEVELS
    v_step = (v.amax(dim=-1, keepdim=True) - v.amin(dim=-1, keepdim=True)) / LEVELS
    for x, y, step, lo in ((k, got[:, 0], k_step, k.amin(dim=-2, keepdim=True)),
                           (v, got[:, 1], v_step, v.amin(dim=-1, keepdim=True))):
        bound = step * (0.5 + 2 ** -6) + lo.abs() * 2 ** -7
        assert bool(((x - y).abs() <= bound).all())


def test_per_channel_keys_keep_an_outlier_channel_to_itself():
    """KIVI's reason for per-channel keys: with one channel 50x the others, a per-token scale would give every other
    channel of the token a step of the outlier's size; per channel their error stays at their own ~7 %."""
    kv = _pair(tokens=64, dim=64, seed=1)
    kv[:, 0, :, :, 7] *= 50
    got = _round_trip(kv)
    others = [c for c in range(64) if c != 7]
    k, back = kv[:, 0][..., others], got[:, 0][..., others]
    assert float((back - k).norm() / k.norm()) < 0.1
    v, back_v = kv[:, 1], got[:, 1]
    assert float((back_v - v).norm() / v.norm()) < 0.12


def test_constant_and_zero_groups_come_back_exactly():
    kv = torch.zeros(1, 2, 2, 4, 8)
    assert torch.equal(_round_trip(kv), kv)
    kv[:, 0] = 0.75  # every key channel constant over the tokens; every value token constant over its channels
    kv[:, 1] = torch.arange(4, dtype=torch.float32).view(1, 1, 4, 1) - 1.5
    assert torch.equal(_round_trip(kv), kv)


def test_half_an_8bit_records_bytes_at_the_3b_shape_and_even_head_dims_only():
    heads, tokens, dim = 2, 256, 128
    eight = 2 * heads * tokens * (dim + 2)
    assert layer_bytes(heads, tokens, dim) / eight == pytest.approx(0.515, abs=0.001)
    with pytest.raises(ValueError, match="even head_dim, got 7"):
        quantize_layers(torch.zeros(1, 2, 1, 2, 7))
