"""Shared fixtures. Keep this file small: put module-specific helpers next to their tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random-weight Qwen2.5-VL checkpoint directory (``tiny`` preset: real tokenizer and special ids)."""
    from edgekv.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", preset="tiny", seed=0)
