"""Shared builders for the model tests: processor-shaped prompts and checkpoint rewrites.

Prompts are built as token ids directly (no HF processor: torchvision is not installable here), with the
exact layout Qwen2.5-VL's processor produces: ``<|vision_start|>`` + ``T*H*W/4`` pad tokens +
``<|vision_end|>`` per image / video, and random pixel patches of the right shape.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edgekv.model.config import ModelConfig


@dataclass
class Prompt:
    input_ids: torch.Tensor  # [1, S]
    mm_token_type_ids: torch.Tensor  # [1, S]: 0 text, 1 image, 2 video (what HF 5.23 needs for positions)
    vision: dict = field(default_factory=dict)  # pixel_values(_videos), *_grid_thw, second_per_grid_ts

    def hf_kwargs(self) -> dict:
        return {"input_ids": self.input_ids, "mm_token_type_ids": self.mm_token_type_ids, **self.vision}

    def our_kwargs(self) -> dict:
        return {"input_ids": self.input_ids, **self.vision}


def build_prompt(config: ModelConfig, parts: list, seed: int = 0) -> Prompt:
    """parts: ("text", n) | ("image", (1, h, w)) | ("video", (t, h, w), second_per_grid)."""
    generator = torch.Generator().manual_seed(seed)
    patch_dim = config.vision.patch_dim
    merge = config.vision.spatial_merge_size ** 2
    ids: list[int] = []
    images, image_grids, videos, video_grids, seconds = [], [], [], [], []
    for part in parts:
        kind = part[0]
        if kind == "text":
            # Ordinary tokens below every special id of the test presets.
            ids.extend(torch.randint(10, 1000, (part[1],), generator=generator).tolist())
            continue
        t, h, w = part[1]
        pad = config.image_token_id if kind == "image" else config.video_token_id
        ids.extend([config.vision_start_token_id] + [pad] * (t * h * w // merge) + [config.vision_end_token_id])
        pixels = torch.randn(t * h * w, patch_dim, generator=generator)
        if kind == "image":
            images.append(pixels)
            image_grids.append(part[1])
        else:
            videos.append(pixels)
            video_grids.append(part[1])
            seconds.append(part[2])
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids)
    types[input_ids == config.image_token_id] = 1
    types[input_ids == config.video_token_id] = 2
    vision: dict = {}
    if images:
        vision["pixel_values"] = torch.cat(images)
        vision["image_grid_thw"] = torch.tensor(image_grids)
    if videos:
        vision["pixel_values_videos"] = torch.cat(videos)
        vision["video_grid_thw"] = torch.tensor(video_grids)
        vision["second_per_grid_ts"] = torch.tensor(seconds, dtype=torch.float32)
    return Prompt(input_ids, types, vision)


def rewrite_as_transformers5(src: Path, dst: Path) -> Path:
    """Copy a released-layout checkpoint into the transformers-5 layout: nested ``text_config`` with
    ``rope_parameters`` and ``model.language_model.*`` / ``model.visual.*`` tensor names."""
    dst.mkdir(parents=True, exist_ok=True)
    flat = json.loads((src / "config.json").read_text())
    text_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps", "bos_token_id",
                 "eos_token_id", "attention_dropout", "initializer_range", "use_cache")
    text = {key: flat.pop(key) for key in text_keys if key in flat}
    rope = flat.pop("rope_scaling")
    text["rope_parameters"] = {"rope_type": "default", "mrope_section": rope["mrope_section"],
                               "rope_theta": flat.pop("rope_theta")}
    text["model_type"] = "qwen2_5_vl_text"
    for key in ("sliding_window", "use_sliding_window", "max_window_layers"):
        flat.pop(key, None)
    flat["text_config"] = text
    flat["vision_config"]["in_channels"] = flat["vision_config"].pop("in_chans")
    (dst / "config.json").write_text(json.dumps(flat, indent=2))
    for name in ("generation_config.json", "preprocessor_config.json"):
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as handle:
        for key in handle.keys():
            if key.startswith("visual."):
                new = "model." + key
            elif key.startswith("model."):
                new = "model.language_model." + key[len("model."):]
            else:
                new = key
            tensors[new] = handle.get_tensor(key)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def rewrite_safetensors(path: Path, edit) -> None:
    """Rewrite one safetensors file with ``edit(dict_of_tensors)`` applied in place."""
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def filled_cache(text, capacity: int, length: int, seed: int):
    """A float32 ``CappedKVCache`` of ``text``'s (a model's text config) shape holding ``length`` random slots: what
    an engine's prefill and decode read, filled alike for each backend compared."""
    from edgekv.cache.capped import CappedKVCache
    from edgekv.cache.specs import CacheSpec

    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, torch.float32)
    cache = CappedKVCache(spec, capacity)
    g = torch.Generator().manual_seed(seed)
    cache.k[:, :, :length] = torch.randn(cache.k[:, :, :length].shape, generator=g)
    cache.v[:, :, :length] = torch.randn(cache.v[:, :, :length].shape, generator=g)
    cache.commit(length)
    return cache


def stub_graph_exports(monkeypatch) -> list[str]:
    """``edgekv.engines.export``'s graph exports replaced by ones that write small files: the names of those that
    ran, in order (a test of which builds are up to date, not of the graphs)."""
    from edgekv.engines import export

    exported: list[str] = []

    def fake_export(name: str):
        def write(_model, _shape, path: Path, **_kw) -> dict:
            exported.append(name)
            path.write_bytes(b"graph " + name.encode() + b" " * 64)
            return {}
        return write

    monkeypatch.setattr(export, "export_vision", fake_export("vision"))
    monkeypatch.setattr(export, "export_llm", fake_export("llm"))
    return exported
