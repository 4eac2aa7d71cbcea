"""The toy Qwen2.5-VL: trained here on synthetic event streams, shipped as package data.

``builtin:toy`` as ``model.path`` (or ``Runtime.from_pretrained("builtin:toy")``) names the shipped checkpoint.
This module stays import-light: the runtime resolves the name without loading the training code.
"""

from __future__ import annotations

from edgekv.model.builtin import BUILTIN_DIR, BUILTIN_NAME, builtin_path, resolve_model_path

__all__ = ["BUILTIN_DIR", "BUILTIN_NAME", "builtin_path", "resolve_model_path"]
