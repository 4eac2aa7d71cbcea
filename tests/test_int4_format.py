"""4-bit checkpoints (issue 29): AWQ and GPTQ layouts read bit-exactly, and refused by name when unsupported.

The oracle here is written from the published format descriptions, not from edgekv's unpacking code:

* AutoAWQ GEMM (``WQLinear_GEMM``): ``qweight [K, N/8]`` / ``qzeros [K/g, N/8]`` int32, value ``i`` of a
  word in bits ``4i..4i+3`` holds column ``8j + [0, 2, 4, 6, 1, 3, 5, 7][i]``; ``scales [K/g, N]`` fp16;
  ``W^T[k, n] = (q - z) * s``.
* GPTQ (AutoGPTQ ``QuantLinear``): ``qweight [K/8, N]`` holds rows ``8r + i`` in value ``i``; ``qzeros``
  packed along N in plain order, storing ``z - 1`` in the v1 format and ``z`` in ``gptq_v2``; ``g_idx [K]``.

Checkpoints are built from known integers with plain Python packing loops (numpy), loaded with
``load_pretrained``, and every 4-bit linear's weight must equal the oracle's exactly.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers_int4 import (
    GROUP,
    ORDER,
    _integers,
    assert_loaded_equals_oracle,
    awq_pack_oracle,
    awq_unpack_oracle,
    dequant_oracle,
    write_quantized,
)
from safetensors import safe_open
from safetensors.torch import save_file

from edgekv.model import CheckpointError, load_pretrained
from edgekv.model.int4 import pack_awq, unpack_awq
from edgekv.model.tiny import make_tiny_checkpoint

@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "ckpt", preset="test-gqa4", seed=3)


# ---------------------------------------------------------------------------------------------- exactness
def test_awq_packing_matches_the_published_order():
    q = np.arange(16 * 16).reshape(16, 16) % 16
    assert torch.equal(pack_awq(torch.from_numpy(q)), awq_pack_oracle(q))
    # one word: column 8j + ORDER[i] in bits 4i..4i+3
    row = np.array([[0, 1, 2, 3, 4, 5, 6, 7]])
    assert int(pack_awq(torch.from_numpy(row))[0, 0]) == sum(ORDER[i] << (4 * i) for i in range(8))
    words = awq_pack_oracle(np.random.default_rng(0).integers(0, 16, size=(5, 64)))
    assert np.array_equal(unpack_awq(words).numpy(), awq_unpack_oracle(words))


def test_awq_checkpoint_loads_bit_exactly(dense, tmp_path):
    truth = write_quantized(dense, tmp_path / "awq", "awq")
    model = load_pretrained(tmp_path / "awq", dtype=torch.float32)
    assert model.quantization.method == "awq" and model.quantization.group_size == GROUP
    assert_loaded_equals_oracle(model, truth)
    reference = load_pretrained(dense, dtype=torch.float32)
    # everything that is not a 4-bit linear (vision tower, norms, embedding, biases) is read as stored
    assert torch.equal(model.visual.blocks[0].mlp.up_proj.weight, reference.visual.blocks[0].mlp.up_proj.weight)
    assert torch.equal(model.language.layers[1].self_attn.q_proj.bias, reference.language.layers[1].self_attn.q_proj.bias)
    assert torch.equal(model.language.embed_tokens.weight, reference.language.embed_tokens.weight)


@pytest.mark.parametrize("fmt,sym", [("gptq", True), ("gptq", False), ("gptq_v2", False)])
def test_gptq_checkpoint_loads_bit_exactly(dense, tmp_path, fmt, sym):
    truth = write_quantized(dense, tmp_path / "gptq", "gptq", sym=sym, fmt=fmt, seed=1)
    model = load_pretrained(tmp_path / "gptq", dtype=torch.float32)
    assert model.quantization.method == "gptq"
    assert_loaded_equals_oracle(model, truth)


def test_gptq_static_groups_act_order_with_row_order_groups_loads(dense, tmp_path):
    truth = write_quantized(dense, tmp_path / "g", "gptq", sym=True, quant_extra={"desc_act": True, "static_groups": True})
    assert_loaded_equals_oracle(load_pretrained(tmp_path / "g"), truth)


def test_per_channel_group_size_minus_one(dense, tmp_path):
    """group_size -1: one group over all K (each linear has its own K)."""
    out = tmp_path / "pc"
    write_quantized(dense, out, "awq", group=GROUP)
    with safe_open(str(out / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    rng = np.random.default_rng(9)
    truth = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        prefix = key.removesuffix(".qweight")
        k, n = tensors[key].shape[0], tensors[key].shape[1] * 8
        q, z, s = _integers((n, k), k, rng)
        truth[prefix] = (q, z, s, k)
        tensors[key], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"] = \
            awq_pack_oracle(q), awq_pack_oracle(z), torch.from_numpy(s)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"]["group_size"] = -1
    (out / "config.json").write_text(json.dumps(config))
    modules = dict(load_pretrained(out).language.named_modules())
    for prefix, (q, z, s, k) in truth.items():
        assert torch.equal(modules[prefix.replace("model.", "", 1)].dequantized_weight(), dequant_oracle(q, z, s, k))


def test_forward_is_dequantize_then_matmul(dense, tmp_path):
    write_quantized(dense, tmp_path / "awq", "awq")
    model = load_pretrained(tmp_path / "awq", dtype=torch.float32)
    module = model.language.layers[0].mlp.down_proj
    x = torch.randn(3, module.in_features, generator=torch.Generator().manual_seed(0))
    want = x.double() @ module.dequantized_weight().double().t()
    assert torch.allclose(module(x).double(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("edit,field", [
    ({"bits": 3}, "quantization_config.bits"),
    ({"bits": 8}, "quantization_config.bits"),
    ({"version": "gemv"}, "quantization_config.version"),
    ({"zero_point": False}, "quantization_config.zero_point"),
    ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method"),
    ({"group_size": 0}, "quantization_config.group_size"),
])
def test_unsupported_awq_config_is_refused_naming_the_field(dense, tmp_path, edit, field):
    write_quantized(dense, tmp_path / "q", "awq", quant_extra=edit)
    with pytest.raises(CheckpointError, match=r"config\.json.*" + re.escape(field)):
        load_pretrained(tmp_path / "q")


@pytest.mark.parametrize("edit,field", [
    ({"desc_act": True}, "quantization_config.desc_act"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format"),
])
def test_unsupported_gptq_config_is_refused_naming_the_field(dense, tmp_path, edit, field):
    write_quantized(dense, tmp_path / "q", "gptq", sym=True, quant_extra=edit)
    with pytest.raises(CheckpointError, match=re.escape(field)):
        load_pretrained(tmp_path / "q")


def _edit_tensors(path: Path, edit) -> None:
    with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_act_order_g_idx_is_refused_naming_the_tensor(dense, tmp_path):
    out = tmp_path / "q"
    write_quantized(dense, out, "gptq", sym=True, quant_extra={"desc_act": True, "static_groups": True})
    name = "model.layers.1.mlp.up_proj.g_idx"
    _edit_tensors(out, lambda t: t.__setitem__(name, t[name].flip(0).contiguous()))
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*act-order") as info:
        load_pretrained(out)
    assert info.value.tensor == name


@pytest.mark.parametrize("part", ["qzeros", "scales", "qweight"])
def test_missing_quantized_tensor_is_named(dense, tmp_path, part):
    out = tmp_path / "q"
    write_quantized(dense, out, "awq")
    name = f"model.layers.0.self_attn.v_proj.{part}"
    _edit_tensors(out, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=re.escape(name)):
        load_pretrained(out)


def test_wrong_dtype_and_shape_are_named(dense, tmp_path):
    out = tmp_path / "q"
    write_quantized(dense, out, "awq")
    name = "model.layers.0.mlp.gate_proj.qweight"
    _edit_tensors(out, lambda t: t.__setitem__(name, t[name].float()))
    with pytest.raises(CheckpointError, match=re.escape(name) + ": expected int32"):
        load_pretrained(out)
    write_quantized(dense, out, "awq")
    _edit_tensors(out, lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()))
    with pytest.raises(CheckpointError, match=re.escape(name) + r": config\.json implies shape"):
        load_pretrained(out)


def test_group_size_that_does_not_divide_in_features_is_named(dense, tmp_path):
    write_quantized(dense, tmp_path / "q", "awq", quant_extra={"group_size": 96})
    with pytest.raises(CheckpointError, match=r"group_size 96"):
        load_pretrained(tmp_path / "q")


def test_gptq_v1_zero_of_sixteen_is_refused(dense, tmp_path):
    out = tmp_path / "q"
    write_quantized(dense, out, "gptq", sym=True)
    name = "model.layers.0.mlp.down_proj.qzeros"
    _edit_tensors(out, lambda t: t.__setitem__(name, torch.full_like(t[name], -1)))  # every stored zero = 15
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*16"):
        load_pretrained(out)


def test_quantized_vision_tensor_is_unexpected(dense, tmp_path):
    out = tmp_path / "q"
    write_quantized(dense, out, "awq")
    _edit_tensors(out, lambda t: t.__setitem__("visual.blocks.0.mlp.up_proj.qweight", torch.zeros(64, 12, dtype=torch.int32)))
    with pytest.raises(CheckpointError, match=r"visual\.blocks\.0\.mlp\.up_proj\.qweight.*decoder layers only"):
        load_pretrained(out)
