"""Qwen2.5-VL in plain torch: config, M-RoPE positions, vision tower, language model, checkpoint I/O.

transformers is never imported here (it is the tests' oracle only).
"""

from edgekv.model.config import ConfigError, ModelConfig, TextConfig, VisionConfig
from edgekv.model.language import AttendFn, DenseKVCache, Qwen2LM, dense_causal_attend
from edgekv.model.loading import CheckpointError, load_pretrained
from edgekv.model.qwen25vl import Qwen25VL
from edgekv.model.vision import VisionTower

__all__ = [
    "AttendFn",
    "CheckpointError",
    "ConfigError",
    "DenseKVCache",
    "ModelConfig",
    "Qwen25VL",
    "Qwen2LM",
    "TextConfig",
    "VisionConfig",
    "VisionTower",
    "dense_causal_attend",
    "load_pretrained",
]
