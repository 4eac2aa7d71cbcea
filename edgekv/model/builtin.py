"""``builtin:toy``: the name of the toy checkpoint that ships in the package (``edgekv/toy/checkpoint``, trained
by ``edgekv train-toy``). Resolved here, beside checkpoint loading, so the runtime and the engines find it
without importing the toy's training code."""

from __future__ import annotations

from pathlib import Path

BUILTIN_NAME = "builtin:toy"
BUILTIN_DIR = Path(__file__).resolve().parents[1] / "toy" / "checkpoint"


def builtin_path() -> Path:
    """The shipped trained toy checkpoint (package data of ``edgekv.toy``)."""
    if not (BUILTIN_DIR / "config.json").is_file():
        raise FileNotFoundError(f"{BUILTIN_DIR}: the shipped toy checkpoint is missing; train one with "
                                "`edgekv train-toy DIR` and point model.path at DIR")
    return BUILTIN_DIR


def resolve_model_path(path: str) -> str:
    """``builtin:toy`` -> the shipped checkpoint's directory; any other path unchanged."""
    return str(builtin_path()) if path == BUILTIN_NAME else path
