"""Typed, validated Qwen2.5-VL configuration read from a checkpoint's ``config.json``.

Two on-disk layouts exist and both are read:

* the released checkpoints (e.g. ``Qwen/Qwen2.5-VL-3B-Instruct``): language-model fields at the top level,
  M-RoPE as ``rope_scaling: {"type": "mrope", "mrope_section": [16, 24, 24]}`` (older files say
  ``"type"``, newer ``"rope_type"``), the ViT under ``vision_config`` (with ``in_chans``);
* transformers 5 ``save_pretrained``: the language model under ``text_config`` with
  ``rope_parameters: {"rope_type": "default", "mrope_section": [...], "rope_theta": ...}``.

``ModelConfig.to_hf_dict()`` writes the first layout, which every transformers version reads.
Every error names the offending key, so a broken file can be fixed without reading this code.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

_ACTIVATIONS = ("silu", "swish", "gelu", "gelu_pytorch_tanh", "quick_gelu", "relu")


class ConfigError(ValueError):
    """A config.json that cannot describe a Qwen2.5-VL model; the message names the key."""


def _positive(section: str, name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{section}.{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class VisionConfig:
    """The Qwen2.5-VL ViT (``vision_config``).

    ``window_size`` is in pixels: a window covers ``window_size // patch_size`` patches per side, i.e.
    ``window_size // patch_size // spatial_merge_size`` merged tokens (4 for the released 112 / 14 / 2).
    Blocks listed in ``fullatt_block_indexes`` attend over a whole temporal slice instead of a window.
    """

    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    window_size: int = 112
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    out_hidden_size: int
    hidden_act: str = "silu"
    tokens_per_second: int | float = 2

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "window_size", "out_hidden_size"):
            _positive("vision_config", name, getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ConfigError(f"vision_config.num_heads: {self.num_heads} does not divide "
                              f"hidden_size {self.hidden_size}")
        if self.head_dim % 4:
            # The 2D rotary splits each head into (h, w) halves, each rotated as pairs.
            raise ConfigError(f"vision_config.hidden_size: head_dim {self.head_dim} must be a multiple of 4")
        object.__setattr__(self, "fullatt_block_indexes", tuple(self.fullatt_block_indexes))
        for index in self.fullatt_block_indexes:
            if not isinstance(index, int) or not 0 <= index < self.depth:
                raise ConfigError(f"vision_config.fullatt_block_indexes: {index!r} is not a block in "
                                  f"0..{self.depth - 1}")
        if self.merger_window < 1:
            raise ConfigError(f"vision_config.window_size: {self.window_size} is smaller than one merged token "
                              f"({self.patch_size * self.spatial_merge_size} px)")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"vision_config.hidden_act: {self.hidden_act!r} is not one of {_ACTIVATIONS}")
        if not isinstance(self.tokens_per_second, (int, float)) or self.tokens_per_second <= 0:
            raise ConfigError(f"vision_config.tokens_per_second: must be positive, got {self.tokens_per_second!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def merger_window(self) -> int:
        """Window side in merged (LLM) tokens, as transformers computes it (integer division)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

    @property
    def patch_dim(self) -> int:
        """Length of one flattened pixel patch: ``C * temporal_patch_size * patch_size**2``."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size


@dataclass(frozen=True, kw_only=True)
class TextConfig:
    """The Qwen2 language model. ``head_dim`` must equal ``hidden_size // num_attention_heads``
    (transformers derives it that way); ``sum(mrope_section) == head_dim // 2``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, ...] = (16, 24, 24)
    max_position_embeddings: int = 128_000
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            _positive("text_config", name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"text_config.num_key_value_heads: {self.num_key_value_heads} does not divide "
                              f"num_attention_heads {self.num_attention_heads}")
        if self.head_dim * self.num_attention_heads != self.hidden_size:
            raise ConfigError(f"text_config.head_dim: {self.head_dim} * num_attention_heads {self.num_attention_heads} "
                              f"!= hidden_size {self.hidden_size}")
        object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
        if len(self.mrope_section) != 3 or any(not isinstance(s, int) or s < 0 for s in self.mrope_section):
            raise ConfigError(f"rope_scaling.mrope_section: expected three non-negative ints (t, h, w), "
                              f"got {list(self.mrope_section)}")
        if sum(self.mrope_section) != self.head_dim // 2:
            raise ConfigError(f"rope_scaling.mrope_section: {list(self.mrope_section)} sums to "
                              f"{sum(self.mrope_section)}, but head_dim // 2 = {self.head_dim // 2}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"text_config.rms_norm_eps: must be positive, got {self.rms_norm_eps!r}")
        if not self.rope_theta > 0:
            raise ConfigError(f"text_config.rope_theta: must be positive, got {self.rope_theta!r}")
        if self.hidden_act not in _ACTIVATIONS:
            raise ConfigError(f"text_config.hidden_act: {self.hidden_act!r} is not one of {_ACTIVATIONS}")

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    eos_token_ids: tuple[int, ...] = (151645, 151643)
    bos_token_id: int | None = 151643
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 0 <= value < self.text.vocab_size:
                raise ConfigError(f"{name}: {value!r} is not a token id below vocab_size {self.text.vocab_size}")
        for value in self.eos_token_ids:
            if not isinstance(value, int) or not 0 <= value < self.text.vocab_size:
                raise ConfigError(f"eos_token_id: {value!r} is not a token id below vocab_size {self.text.vocab_size}")
        if self.vision.out_hidden_size != self.text.hidden_size:
            raise ConfigError(f"vision_config.out_hidden_size: {self.vision.out_hidden_size} must equal the language "
                              f"model hidden_size {self.text.hidden_size} (merged tokens replace text embeddings)")

    # ------------------------------------------------------------------------------------------ reading
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Read ``config.json`` (and the stop ids of ``generation_config.json`` when present)."""
        path = Path(path)
        config_path = path / "config.json"
        if not config_path.is_file():
            raise ConfigError(f"{config_path}: no config.json in the model directory")
        try:
            data = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{config_path}: not valid JSON ({exc})") from exc
        try:
            config = cls.from_dict(data)
        except ConfigError as exc:
            raise ConfigError(f"{config_path}: {exc}") from exc
        generation_path = path / "generation_config.json"
        if generation_path.is_file():
            try:
                generation = json.loads(generation_path.read_text())
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{generation_path}: not valid JSON ({exc})") from exc
            extra_eos = _as_id_tuple(generation.get("eos_token_id"), "generation_config.eos_token_id")
            merged = tuple(dict.fromkeys(config.eos_token_ids + extra_eos))
            config = cls(text=config.text, vision=config.vision, image_token_id=config.image_token_id,
                         video_token_id=config.video_token_id, vision_start_token_id=config.vision_start_token_id,
                         vision_end_token_id=config.vision_end_token_id, eos_token_ids=merged,
                         bos_token_id=config.bos_token_id, extra=config.extra)
        return config

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        if not isinstance(d, Mapping):
            raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
        nested = d.get("text_config")
        if nested is not None and not isinstance(nested, Mapping):
            raise ConfigError(f"text_config: expected an object, got {type(nested).__name__}")
        # transformers 5 nests the LM; released checkpoints keep it at the top level. Top-level values
        # fill anything the nested dict lacks (pre-v5 saves put tie_word_embeddings in either place).
        text_src: dict[str, Any] = {**d, **(nested or {})}
        prefix = "text_config." if nested is not None else ""
        text = _text_from_dict(text_src, prefix, top=d)

        vision_src = d.get("vision_config")
        if not isinstance(vision_src, Mapping):
            raise ConfigError("vision_config: missing or not an object (a Qwen2.5-VL config has a ViT section)")
        vision = _vision_from_dict(vision_src)

        eos_raw = d.get("eos_token_id", text_src.get("eos_token_id", 151645))
        kwargs: dict[str, Any] = {"eos_token_ids": _as_id_tuple(eos_raw, "eos_token_id")}
        for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            if name in d:
                kwargs[name] = _int(d, name, "")
        bos = d.get("bos_token_id", text_src.get("bos_token_id"))
        kwargs["bos_token_id"] = bos if isinstance(bos, int) else None
        return cls(text=text, vision=vision, extra=dict(d), **kwargs)

    # ------------------------------------------------------------------------------------------ writing
    def to_hf_dict(self) -> dict[str, Any]:
        """The released-checkpoint layout (LM fields at the top level, ``rope_scaling`` for M-RoPE)."""
        t, v = self.text, self.vision
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else list(self.eos_token_ids),
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "hidden_act": t.hidden_act,
            "hidden_size": t.hidden_size,
            "initializer_range": 0.02,
            "intermediate_size": t.intermediate_size,
            "max_position_embeddings": t.max_position_embeddings,
            "max_window_layers": t.num_hidden_layers,
            "num_attention_heads": t.num_attention_heads,
            "num_hidden_layers": t.num_hidden_layers,
            "num_key_value_heads": t.num_key_value_heads,
            "rms_norm_eps": t.rms_norm_eps,
            "rope_theta": t.rope_theta,
            "rope_scaling": {"type": "mrope", "mrope_section": list(t.mrope_section)},
            "sliding_window": t.max_position_embeddings,
            "use_sliding_window": False,
            "tie_word_embeddings": t.tie_word_embeddings,
            "use_cache": True,
            "vocab_size": t.vocab_size,
            "vision_config": {
                "depth": v.depth,
                "hidden_act": v.hidden_act,
                "hidden_size": v.hidden_size,
                "intermediate_size": v.intermediate_size,
                "num_heads": v.num_heads,
                "in_chans": v.in_channels,
                "out_hidden_size": v.out_hidden_size,
                "patch_size": v.patch_size,
                "spatial_merge_size": v.spatial_merge_size,
                "spatial_patch_size": v.patch_size,
                "window_size": v.window_size,
                "fullatt_block_indexes": list(v.fullatt_block_indexes),
                "tokens_per_second": v.tokens_per_second,
                "temporal_patch_size": v.temporal_patch_size,
            },
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain dataclass view (for logs and hashing engine caches)."""
        out = asdict(self)
        out.pop("extra")
        return out


# ---------------------------------------------------------------------------------------------- helpers
_MISSING = object()


def _get(d: Mapping[str, Any], key: str, prefix: str, default: Any = _MISSING) -> Any:
    if key in d and d[key] is not None:
        return d[key]
    if default is _MISSING:
        raise ConfigError(f"{prefix}{key}: missing")
    return default


def _int(d: Mapping[str, Any], key: str, prefix: str, default: Any = _MISSING) -> int:
    value = _get(d, key, prefix, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{prefix}{key}: expected an integer, got {value!r}")
    return value


def _float(d: Mapping[str, Any], key: str, prefix: str, default: Any = _MISSING) -> float:
    value = _get(d, key, prefix, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"{prefix}{key}: expected a number, got {value!r}")
    return float(value)


def _as_id_tuple(value: Any, key: str) -> tuple[int, ...]:
    if value is None:
        return ()
    values = value if isinstance(value, (list, tuple)) else [value]
    if any(not isinstance(v, int) or isinstance(v, bool) for v in values):
        raise ConfigError(f"{key}: expected an int or a list of ints, got {value!r}")
    return tuple(values)


def _text_from_dict(d: Mapping[str, Any], prefix: str, top: Mapping[str, Any]) -> TextConfig:
    rope = d.get("rope_scaling") or d.get("rope_parameters")
    rope_key = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    if rope is None:
        raise ConfigError(f"{prefix}rope_scaling: missing (Qwen2.5-VL needs M-RoPE: "
                          '{"type": "mrope", "mrope_section": [t, h, w]})')
    if not isinstance(rope, Mapping):
        raise ConfigError(f"{prefix}{rope_key}: expected an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type"))
    # transformers 5 rewrites "mrope" to "default" when it saves; the sections are what matter.
    if kind not in ("mrope", "default", None):
        raise ConfigError(f"{prefix}{rope_key}.type: {kind!r} is not supported (expected 'mrope')")
    section = rope.get("mrope_section")
    if not isinstance(section, (list, tuple)):
        raise ConfigError(f"{prefix}{rope_key}.mrope_section: missing or not a list, got {section!r}")
    theta = rope.get("rope_theta", d.get("rope_theta", 1_000_000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool):
        raise ConfigError(f"{prefix}rope_theta: expected a number, got {theta!r}")

    hidden = _int(d, "hidden_size", prefix)
    heads = _int(d, "num_attention_heads", prefix)
    if heads <= 0:
        raise ConfigError(f"{prefix}num_attention_heads: must be a positive integer, got {heads}")
    tie = top.get("tie_word_embeddings")
    if tie is None:
        tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"tie_word_embeddings: expected true/false, got {tie!r}")
    hidden_act = _get(d, "hidden_act", prefix, "silu")
    if not isinstance(hidden_act, str):
        raise ConfigError(f"{prefix}hidden_act: expected a string, got {hidden_act!r}")
    return TextConfig(
        vocab_size=_int(d, "vocab_size", prefix),
        hidden_size=hidden,
        intermediate_size=_int(d, "intermediate_size", prefix),
        num_hidden_layers=_int(d, "num_hidden_layers", prefix),
        num_attention_heads=heads,
        num_key_value_heads=_int(d, "num_key_value_heads", prefix, heads),
        head_dim=_int(d, "head_dim", prefix, hidden // heads),
        rms_norm_eps=_float(d, "rms_norm_eps", prefix, 1e-6),
        rope_theta=float(theta),
        mrope_section=tuple(section),
        max_position_embeddings=_int(d, "max_position_embeddings", prefix, 128_000),
        tie_word_embeddings=tie,
        hidden_act=hidden_act,
    )


def _vision_from_dict(d: Mapping[str, Any]) -> VisionConfig:
    p = "vision_config."
    fullatt = _get(d, "fullatt_block_indexes", p, (7, 15, 23, 31))
    if not isinstance(fullatt, (list, tuple)):
        raise ConfigError(f"{p}fullatt_block_indexes: expected a list of ints, got {fullatt!r}")
    in_channels = d.get("in_channels", d.get("in_chans", 3))
    tokens_per_second = _get(d, "tokens_per_second", p, 2)
    if not isinstance(tokens_per_second, (int, float)) or isinstance(tokens_per_second, bool):
        raise ConfigError(f"{p}tokens_per_second: expected a number, got {tokens_per_second!r}")
    hidden_act = _get(d, "hidden_act", p, "silu")
    if not isinstance(hidden_act, str):
        raise ConfigError(f"{p}hidden_act: expected a string, got {hidden_act!r}")
    return VisionConfig(
        depth=_int(d, "depth", p),
        hidden_size=_int(d, "hidden_size", p),
        intermediate_size=_int(d, "intermediate_size", p),
        num_heads=_int(d, "num_heads", p),
        in_channels=in_channels,
        patch_size=_int(d, "patch_size", p, 14),
        spatial_merge_size=_int(d, "spatial_merge_size", p, 2),
        temporal_patch_size=_int(d, "temporal_patch_size", p, 2),
        window_size=_int(d, "window_size", p, 112),
        fullatt_block_indexes=tuple(fullatt),
        out_hidden_size=_int(d, "out_hidden_size", p),
        hidden_act=hidden_act,
        tokens_per_second=tokens_per_second,
    )
