"""`edgekv plan` on the real Qwen2.5-VL-3B shape (config.json only, no weights)."""

from __future__ import annotations

import json

import pytest

from edgekv.apps.cli import main
from edgekv.calibration.plan import plan
from edgekv.model.tiny import PRESETS


@pytest.fixture
def model_3b(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["3b"].config.to_hf_dict()))
    return tmp_path


def test_bytes_per_token_is_the_3b_kv_shape_plus_metadata(model_3b):
    result = plan(64, model_3b)
    kv = 2 * 36 * 2 * 128 * 2                # K and V, 36 layers, 2 KV heads, head_dim 128, bf16
    metadata = 36 * 2 * 14 + 128 * 2 + 2 * 14  # slot metadata + compaction scratch
    assert result.bytes_per_token == kv + metadata
    assert 3.5 < result.weight_bytes / 2**30 < 7.5  # ~3.75 B parameters in bf16
    assert result.tokens_per_pair == 256


def test_monotone_in_device_memory_and_clear_when_too_small(model_3b):
    sizes = [plan(gb, model_3b).max_tokens for gb in (10, 11, 12)]
    assert sizes[0] < sizes[1] < sizes[2]
    with pytest.raises(ValueError, match="short by"):
        plan(6, model_3b)


def test_plan_command_prints_the_budget(model_3b, capsys):
    assert main(["plan", "--device-memory", "64", "--model", str(model_3b)]) == 0
    out = capsys.readouterr().out
    assert "cache.max_tokens:" in out and "not measured on a device" in out


def test_quantized_weights_let_an_8gb_device_fit_and_big_devices_cap_at_the_position_range(model_3b):
    small = plan(8, model_3b, weights_gb=2.9)
    assert small.max_tokens > 2 * small.tokens_per_pair + small.text_reserve_tokens
    assert plan(6, model_3b, weights_gb=2.9).max_tokens < small.max_tokens
    assert plan(64, model_3b).capped_by_positions
