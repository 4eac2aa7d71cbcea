"""``edgekv quantize`` (issue 29): round-to-nearest 4-bit weights written in the AutoAWQ GEMM layout exactly.

What it writes must read back as the AWQ layout of ``test_int4_format``'s oracle, keep the vision tower and
every non-linear tensor unquantized, and its 4-bit model must give the logits of its own dequantized
fp32 twin (the same weights, dense) within 1e-3 relative.
"""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from helpers_int4 import awq_unpack_oracle, dequant_oracle
from safetensors import safe_open

from edgekv.apps.cli import main
from edgekv.model import load_pretrained
from edgekv.model.int4 import Int4Linear
from edgekv.model.language import dense_causal_attend
from edgekv.calibration.quantize import dequantize_checkpoint, quantize_checkpoint, quantize_weight
from edgekv.model.rope import text_position_ids
from edgekv.model.tiny import PRESETS, Preset, make_tiny_checkpoint


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt", preset="test-gqa4", seed=5)


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def test_rtn_bounds_and_zero_point():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 64, generator=gen) * 0.1
    weight[3, :32] = 0.25  # a group of one sign (and one value): 0 stays in the range, 0.25 is the top
    q, zeros, scales = quantize_weight(weight, 32)
    assert q.shape == (64, 24) and zeros.shape == scales.shape == (2, 24) and scales.dtype == torch.float16
    back = (q.float() - zeros.float().repeat_interleave(32, 0)) * scales.float().repeat_interleave(32, 0)
    step = scales.float().repeat_interleave(32, 0)
    # the grid is the multiples of the step; the rounded zero point shifts its ends by up to half a step, so
    # a group's extremes may be clamped: most weights within half a step, every one within a step
    error = (back - weight.t()).abs()
    assert bool((error <= 0.5 * step + 1e-6).float().mean() > 0.9)
    assert bool((error <= step + 1e-6).all())
    assert float(error[:32, 3].max()) <= 1e-4


def test_cli_writes_the_autoawq_layout(dense, tmp_path, capsys):
    out = tmp_path / "q4"
    assert main(["quantize", str(dense), str(out), "--bits", "4", "--group-size", "32"]) == 0
    # progress into a log (not a terminal): whole lines, a tenth of the work each, no carriage returns
    err = capsys.readouterr().err
    assert "\r" not in err and "quantize: 100.0 %  14/14 linears" in err, err
    assert len([line for line in err.splitlines() if line.startswith("quantize: ")]) <= 11
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                             "version": "gemm", "modules_to_not_convert": ["visual"]}
    assert config["torch_dtype"] == "float16"
    assert (out / "generation_config.json").is_file()
    source, written = _tensors(dense), _tensors(out)
    linears = [k for k in source if re.match(r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj\.weight$", k)]
    assert len(linears) == 14
    for key in linears:
        prefix = key.removesuffix(".weight")
        assert key not in written
        n, k = source[key].shape
        qweight, qzeros, scales = (written[f"{prefix}.{p}"] for p in ("qweight", "qzeros", "scales"))
        assert (qweight.dtype, tuple(qweight.shape)) == (torch.int32, (k, n // 8))
        assert (qzeros.dtype, tuple(qzeros.shape)) == (torch.int32, (k // 32, n // 8))
        assert (scales.dtype, tuple(scales.shape)) == (torch.float16, (k // 32, n))
        # read back with the independent oracle: the round trip of the source weight within a step
        w = dequant_oracle(awq_unpack_oracle(qweight), awq_unpack_oracle(qzeros), scales.numpy(), 32)
        step = scales.float().repeat_interleave(32, 0).t()
        assert bool(((w - source[key]).abs() <= step + 1e-6).all())
    # nothing else is quantized: the vision tower, norms, embedding and biases are the fp16 source values
    for key, value in source.items():
        if key not in linears:
            assert written[key].dtype == torch.float16 and torch.equal(written[key], value.half()), key


def test_refuses_bad_arguments(dense, tmp_path, capsys):
    assert main(["quantize", str(dense), str(tmp_path / "x"), "--bits", "3"]) == 2
    assert "--bits" in capsys.readouterr().err
    assert main(["quantize", str(dense), str(tmp_path / "x"), "--group-size", "48"]) == 2
    assert "--group-size: 48 does not divide" in capsys.readouterr().err
    quantized = quantize_checkpoint(dense, tmp_path / "q", group_size=32)
    assert main(["quantize", str(quantized), str(tmp_path / "again")]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "nothere"), str(tmp_path / "y")]) == 2
    assert "IN_DIR: " in (err := capsys.readouterr().err) and "nothere: no such directory" in err
    assert main(["quantize", str(tmp_path), str(tmp_path / "y")]) == 2
    assert "has no config.json" in capsys.readouterr().err and not (tmp_path / "y").exists()
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    assert main(["quantize", str(dense), str(tmp_path / "notes")]) == 2
    assert "OUT_DIR: " in (err := capsys.readouterr().err) and "is not a checkpoint folder" in err
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"
    assert main(["quantize", str(dense), str(tmp_path / "z"), "--max-shard-gb", "0"]) == 2
    assert "--max-shard-gb: must be > 0" in capsys.readouterr().err and not (tmp_path / "z").exists()


def _files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_checkpoint_written_over_another_is_the_new_one_alone(dense, tmp_path, monkeypatch):
    """Writing over an earlier 4-bit checkpoint kept its shards and index beside the new files; the index (read
    first) pointed at the old weights: a checkpoint that failed to load (another group size) or loaded the last
    run's weights. Now the folder is replaced whole once every file is written, and a run that fails part way
    leaves the earlier checkpoint as it was, with no partial folder beside it."""
    import edgekv.calibration.quantize as quantize

    fresh = quantize_checkpoint(dense, tmp_path / "fresh", group_size=16)
    out = tmp_path / "out"
    quantize_checkpoint(dense, out, group_size=32, max_shard_bytes=1)  # a shard per tensor, and an index
    assert (out / "model.safetensors.index.json").is_file()
    quantize_checkpoint(dense, out, group_size=16)
    assert _files(out) == _files(fresh)  # no shard, no index of the earlier run
    model = load_pretrained(out, dtype=torch.float32)
    assert any(isinstance(m, Int4Linear) for m in model.modules())
    before = _files(out)

    calls = {"n": 0}
    real_add = quantize._ShardWriter.add

    def interrupted(self, name, tensor):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        return real_add(self, name, tensor)

    monkeypatch.setattr(quantize._ShardWriter, "add", interrupted)
    try:
        quantize_checkpoint(dense, out, group_size=32)
        pytest.fail("the interrupt did not reach the caller")
    except KeyboardInterrupt:
        pass
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        hidden = model.language(model.language.embed_tokens(ids), text_position_ids(0, ids.numel()), dense_causal_attend)
        return model.language.logits(hidden)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_four_bit_model_matches_its_dequantized_twin(dense, tmp_path):
    quantized = quantize_checkpoint(dense, tmp_path / "q", group_size=32)
    twin = dequantize_checkpoint(quantized, tmp_path / "twin")
    model, reference = load_pretrained(quantized), load_pretrained(twin)
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) == 14
    ids = torch.randint(0, 4000, (24,), generator=torch.Generator().manual_seed(1))
    assert _relative(_logits(model, ids), _logits(reference, ids)) <= 1e-3
    # and quantization moved the logits of the unquantized checkpoint, as it should (the twin is not the source)
    assert _relative(_logits(load_pretrained(dense), ids), _logits(reference, ids)) > 1e-3


@pytest.mark.slow
def test_three_b_widths_match_the_twin(tmp_path, monkeypatch):
    """Qwen2.5-VL-3B's linear widths (2048 / 11008, 16 heads of 128, 2 KV heads), one layer, small vocab."""
    base = PRESETS["3b"].config
    text = dataclasses.replace(base.text, num_hidden_layers=1, vocab_size=2048)
    vision = dataclasses.replace(base.vision, depth=1, hidden_size=64, intermediate_size=96, num_heads=2,
                                 fullatt_block_indexes=(0,))
    config = dataclasses.replace(base, text=text, vision=vision, image_token_id=2000, video_token_id=2001,
                                 vision_start_token_id=2002, vision_end_token_id=2003, eos_token_ids=(2004,),
                                 bos_token_id=2005)
    monkeypatch.setitem(PRESETS, "3b-widths", Preset(config, std=0.02))
    dense = make_tiny_checkpoint(tmp_path / "dense", preset="3b-widths", seed=2, dtype=torch.bfloat16)
    quantized = quantize_checkpoint(dense, tmp_path / "q", group_size=128)
    twin = dequantize_checkpoint(quantized, tmp_path / "twin")
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, 2000, 16))
    error = _relative(_logits(load_pretrained(quantized), ids), _logits(load_pretrained(twin), ids))
    assert error <= 1e-3


def test_awq_scaling_beats_round_to_nearest_on_outlier_channels():
    """AWQ section 4.2: scaling salient input channels up before rounding protects them; alpha = 0 is RTN,
    so the searched scales can only lower the calibration error."""
    from edgekv.calibration.quantize import awq_scales, fake_quantized

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 128, generator=gen)
    x[:, :4] *= 30.0  # four salient channels
    weights = [torch.randn(64, 128, generator=gen) * 0.05 for _ in range(2)]

    def error(scales: torch.Tensor) -> float:
        return sum(float(((x / scales) @ fake_quantized(w * scales, 32).t() - x @ w.t()).pow(2).mean()) for w in weights)

    s = awq_scales(weights, x, 32)
    assert s.shape == (128,) and bool((s > 0).all())
    assert error(s) < 0.8 * error(torch.ones(128))
    assert float(s[:4].mean()) > float(s[4:].mean())  # the salient channels are the scaled-up ones


@pytest.mark.slow
def test_awq_method_folds_the_inverse_scales_and_keeps_the_layout(dense, tmp_path):
    quantized = quantize_checkpoint(dense, tmp_path / "awq", group_size=32, method="awq")
    config = json.loads((quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "awq"
    assert config["edgekv_quantize"]["method"] == "awq"
    source, written = _tensors(dense), _tensors(quantized)
    norm = "model.layers.0.input_layernorm.weight"
    assert not torch.equal(written[norm], source[norm].half())  # 1/s folded into the norm
    model = load_pretrained(quantized)
    ids = torch.randint(0, 4000, (24,), generator=torch.Generator().manual_seed(2))
    rtn = load_pretrained(quantize_checkpoint(dense, tmp_path / "rtn", group_size=32))
    reference = _logits(load_pretrained(dense), ids)
    # a scaled model computes the same function: its logits stay as close to the source as RTN's (random
    # weights have no salient channels, so no gain is expected here, only no harm beyond noise)
    assert _relative(_logits(model, ids), reference) < 1.5 * _relative(_logits(rtn, ids), reference)
