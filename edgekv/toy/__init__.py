"""The toy Qwen2.5-VL: trained here on synthetic event streams, shipped as package data.

``builtin:toy`` as ``model.path`` (or ``Runtime.from_pretrained("builtin:toy")``) names the shipped checkpoint.
This module stays import-light: the runtime resolves the name without loading the training code.
"""

from __future__ import annotations

from pathlib import Path

BUILTIN_DIR = Path(__file__).parent / "checkpoint"
BUILTIN_NAME = "builtin:toy"


def builtin_path() -> Path:
    """The shipped trained toy checkpoint (package data)."""
    if not (BUILTIN_DIR / "config.json").is_file():
        raise FileNotFoundError(f"{BUILTIN_DIR}: the shipped toy checkpoint is missing; train one with "
                                "`edgekv train-toy DIR` and point model.path at DIR")
    return BUILTIN_DIR


def resolve_model_path(path: str) -> str:
    """``builtin:toy`` -> the shipped checkpoint's directory; any other path unchanged."""
    return str(builtin_path()) if path == BUILTIN_NAME else path
