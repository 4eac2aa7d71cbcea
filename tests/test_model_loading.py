"""Checkpoint directories: config layouts, both tensor-name layouts, shards, dtypes, the tokenizer, and
errors that name the file and the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from edgekv.model import CheckpointError, ConfigError, ModelConfig, load_pretrained
from edgekv.model.loading import INDEX_FILE
from edgekv.model.tiny import PRESETS, make_tiny_checkpoint
from helpers_checkpoints import build_prompt, rewrite_as_transformers5, rewrite_safetensors

# config.json of Qwen/Qwen2.5-VL-3B-Instruct (the released layout), as published.
REAL_3B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653, "vision_token_id": 151654,
    "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 128000,
    "max_window_layers": 70, "model_type": "qwen2_5_vl", "num_attention_heads": 16, "num_hidden_layers": 36,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.41.2", "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {"depth": 32, "hidden_act": "silu", "hidden_size": 1280, "intermediate_size": 3420,
                      "num_heads": 16, "in_chans": 3, "out_hidden_size": 2048, "patch_size": 14,
                      "spatial_merge_size": 2, "spatial_patch_size": 14, "window_size": 112,
                      "fullatt_block_indexes": [7, 15, 23, 31], "tokens_per_second": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 151936,
}

PRESET = "test-gqa4"  # untied head: lm_head.weight must load too


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("src") / "ckpt", preset=PRESET, seed=2)


@pytest.fixture(scope="module")
def reference(source):
    return load_pretrained(source)


@pytest.fixture
def copy(source, tmp_path) -> Path:
    """A private copy of the checkpoint that a test may break."""
    return Path(shutil.copytree(source, tmp_path / "ckpt"))


def _state(model) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def _assert_same_weights(a, b) -> None:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


# ------------------------------------------------------------------------------------------------- config
def test_real_3b_config_reads_and_round_trips():
    config = ModelConfig.from_dict(REAL_3B_CONFIG)
    t, v = config.text, config.vision
    assert (t.hidden_size, t.num_hidden_layers, t.num_attention_heads, t.num_key_value_heads, t.head_dim) == \
        (2048, 36, 16, 2, 128)
    assert t.mrope_section == (16, 24, 24) and t.tie_word_embeddings and t.vocab_size == 151936
    assert (v.depth, v.hidden_size, v.num_heads, v.intermediate_size, v.window_size) == (32, 1280, 16, 3420, 112)
    assert v.fullatt_block_indexes == (7, 15, 23, 31) and v.out_hidden_size == 2048 and v.tokens_per_second == 2
    assert config.video_token_id == 151656 and config.eos_token_ids == (151645,)
    assert ModelConfig.from_dict(config.to_hf_dict()) == config


def test_3b_preset_has_the_released_shapes():
    ours = PRESETS["3b"].config
    released = ModelConfig.from_dict(REAL_3B_CONFIG)
    assert ours.text == released.text and ours.vision == released.vision


@pytest.mark.parametrize("edit, key", [
    (lambda c: c["vision_config"].pop("depth"), "vision_config.depth"),
    (lambda c: c["rope_scaling"].update(mrope_section=[16, 24, 20]), "mrope_section"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c.pop("rope_scaling"), "rope_scaling"),
    (lambda c: c["vision_config"].update(fullatt_block_indexes=[7, 40]), "fullatt_block_indexes"),
    (lambda c: c.update(hidden_size="2048"), "hidden_size"),
])
def test_config_errors_name_the_key(edit, key):
    data = json.loads(json.dumps(REAL_3B_CONFIG))
    edit(data)
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(data)


# ------------------------------------------------------------------------------------------------- loading
def test_written_directory_looks_like_a_released_checkpoint(source):
    names = {p.name for p in source.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "preprocessor_config.json"} <= names
    config = json.loads((source / "config.json").read_text())
    assert config["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert config["model_type"] == "qwen2_5_vl" and "text_config" not in config
    assert config["rope_scaling"] == {"type": "mrope", "mrope_section": [2, 3, 3]}
    pre = json.loads((source / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["temporal_patch_size"], pre["merge_size"]) == (14, 2, 2)


def test_sharded_equals_single_file(source, reference, tmp_path):
    sharded = make_tiny_checkpoint(tmp_path / "sharded", preset=PRESET, seed=2, max_shard_bytes=300_000)
    index = json.loads((sharded / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) >= 3
    assert not (sharded / "model.safetensors").exists()
    _assert_same_weights(load_pretrained(sharded), reference)


def test_a_checkpoint_written_over_a_sharded_one_is_the_new_one(source, reference, tmp_path):
    """The index of an earlier sharded checkpoint in the same folder is read before a new single file: it loaded
    the old shards (here: another seed's weights) under the new config. Writers now remove them first."""
    out = make_tiny_checkpoint(tmp_path / "ckpt", preset=PRESET, seed=7, max_shard_bytes=300_000)
    assert (out / INDEX_FILE).is_file()
    make_tiny_checkpoint(out, preset=PRESET, seed=2)
    assert not (out / INDEX_FILE).exists() and not list(out.glob("model-*-of-*.safetensors"))
    _assert_same_weights(load_pretrained(out), reference)
    from edgekv.toy.model import init_model, save_checkpoint, toy_config

    make_tiny_checkpoint(out, preset=PRESET, seed=7, max_shard_bytes=300_000)
    toy = init_model(toy_config(width=32, layers=2, vision_width=32, vision_depth=2), 3)
    save_checkpoint(toy, out, {"note": "test"})
    load_pretrained(out)  # the toy's own shapes, not the tiny preset's shards
    assert not (out / INDEX_FILE).exists() and not list(out.glob("model-*-of-*.safetensors"))


def test_transformers5_layout_loads(source, reference, tmp_path):
    v5 = rewrite_as_transformers5(source, tmp_path / "v5")
    assert "text_config" in json.loads((v5 / "config.json").read_text())
    model = load_pretrained(v5)
    assert model.config.text == reference.config.text and model.config.vision == reference.config.vision
    _assert_same_weights(model, reference)


def test_transformers5_layout_is_what_transformers_reads(source, reference, tmp_path):
    transformers = pytest.importorskip("transformers")
    v5 = rewrite_as_transformers5(source, tmp_path / "v5")
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(v5, dtype=torch.float32).eval()
    prompt = build_prompt(reference.config, [("text", 4), ("image", (1, 8, 8)), ("text", 3)])
    with torch.inference_mode():
        expected = hf(**prompt.hf_kwargs()).logits
        got = load_pretrained(v5)(**prompt.our_kwargs())
    assert (got - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_loading(source, reference, dtype):
    model = load_pretrained(source, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    prompt = build_prompt(reference.config, [("text", 5), ("video", (2, 8, 8), 0.5), ("text", 4)])
    with torch.inference_mode():
        expected = reference(**prompt.our_kwargs())
        got = model(**prompt.our_kwargs())
    assert got.dtype == dtype
    assert torch.isfinite(got).all()
    error = (got.float() - expected).abs().max().item()
    assert error <= 0.05 * expected.abs().max().item()


def test_half_precision_checkpoint_loads_as_fp32(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "bf16", preset=PRESET, seed=2, dtype=torch.bfloat16)
    model = load_pretrained(path)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_tied_checkpoint_needs_no_head(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tied", preset="test-hd32")
    model = load_pretrained(path)
    assert model.language.lm_head.weight is model.language.embed_tokens.weight


# ------------------------------------------------------------------------------------------------- errors
def test_missing_shard_names_the_file_and_a_tensor(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "sharded", preset=PRESET, seed=2, max_shard_bytes=300_000)
    weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
    victim = sorted(set(weight_map.values()))[1]
    (path / victim).unlink()
    with pytest.raises(CheckpointError) as info:
        load_pretrained(path)
    message = str(info.value)
    assert victim in message and info.value.tensor in message
    assert weight_map[info.value.tensor] == victim


def test_truncated_safetensors_names_the_file_and_the_tensor(copy):
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated") as info:
        load_pretrained(copy)
    assert "model.safetensors" in str(info.value) and info.value.tensor in str(info.value)


def test_corrupt_header_names_the_file(copy):
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:20] = b"not json at!"
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(copy)


def test_shape_mismatch_names_the_tensor_and_both_shapes(copy):
    config = json.loads((copy / "config.json").read_text())
    config["intermediate_size"] += 8
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        load_pretrained(copy)
    message = str(info.value)
    assert "model.safetensors" in message and "mlp" in info.value.tensor and info.value.tensor in message
    assert "[256, 128]" in message or "[128, 256]" in message  # found
    assert "[264, 128]" in message or "[128, 264]" in message  # expected from config.json


def test_missing_tensor_is_named(copy):
    rewrite_safetensors(copy / "model.safetensors", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_pretrained(copy)


def test_unexpected_tensor_is_named_with_its_file(copy):
    rewrite_safetensors(copy / "model.safetensors",
                        lambda t: t.update({"model.layers.7.mlp.gate_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*model\.layers\.7\.mlp\.gate_proj\.weight"):
        load_pretrained(copy)


def test_index_promising_a_tensor_the_shard_lacks(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "sharded", preset=PRESET, seed=2, max_shard_bytes=300_000)
    index = json.loads((path / INDEX_FILE).read_text())
    shard = index["weight_map"]["model.norm.weight"]
    rewrite_safetensors(path / shard, lambda t: t.pop("model.norm.weight"))
    with pytest.raises(CheckpointError, match=rf"{shard}.*model\.norm\.weight"):
        load_pretrained(path)


def test_no_weights_at_all(copy):
    (copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_pretrained(copy)


def test_bad_config_is_a_checkpoint_error_naming_config_json(copy):
    config = json.loads((copy / "config.json").read_text())
    del config["vision_config"]["hidden_size"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config\.json.*vision_config\.hidden_size"):
        load_pretrained(copy)


# ------------------------------------------------------------------------------------------------- tokenizer
def test_tiny_checkpoint_tokenizer_matches_its_special_ids(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "tiny", preset="tiny")
    config = ModelConfig.from_dir(path)
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text, token_id in (("<|video_pad|>", config.video_token_id), ("<|image_pad|>", config.image_token_id),
                           ("<|vision_start|>", config.vision_start_token_id),
                           ("<|vision_end|>", config.vision_end_token_id), ("<|im_end|>", 151645)):
        assert tokenizer.encode(text, add_special_tokens=False).ids == [token_id], text
    assert 151645 in config.eos_token_ids and 151643 in config.eos_token_ids  # generation_config merged
    template = json.loads((path / "tokenizer_config.json").read_text())["chat_template"]
    assert "<|vision_start|><|video_pad|><|vision_end|>" in template
    jinja2 = pytest.importorskip("jinja2")
    rendered = jinja2.Environment().from_string(template).render(
        messages=[{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "What?"}]}],
        add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
                        "<|vision_start|><|video_pad|><|vision_end|>What?<|im_end|>\n<|im_start|>assistant\n")


def test_small_vocab_presets_skip_the_mismatched_tokenizer(source):
    assert not (source / "tokenizer.json").exists()


def test_skip_leaves_engine_parts_unloaded(tiny_checkpoint):
    """Parts an engine runs are validated but never read: no second copy of their weights in memory."""
    full = load_pretrained(tiny_checkpoint)
    lean = load_pretrained(tiny_checkpoint, skip=("visual", "language.layers"))
    assert lean.visual is None and len(lean.language.layers) == 0
    kept = {name: p for name, p in lean.named_parameters()}
    assert set(kept) == {"language.embed_tokens.weight", "language.norm.weight"}  # tied lm_head shares the embedding
    assert torch.equal(kept["language.embed_tokens.weight"], full.language.embed_tokens.weight)
    assert sum(p.numel() for p in lean.parameters()) == sum(p.numel() for p in kept.values())
    assert all(p.device.type == "cpu" for p in lean.parameters())  # nothing left on the meta device
    with pytest.raises(ValueError, match=r"skip: unknown model parts \['vision'\]"):
        load_pretrained(tiny_checkpoint, skip=("vision",))
