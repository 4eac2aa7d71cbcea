"""``builtin:toy``: the name of the toy checkpoint that ships in the package (``edgekv/toy/checkpoint``, trained
by ``edgekv train-toy``), and ``builtin:toy-224``, its 224 x 224 variant (``edgekv/toy/checkpoint-224``: 64 tokens a
frame pair, so that which tokens of a frame a cache keeps matters; issue 27). Resolved here, beside checkpoint
loading, so the runtime and the engines find them without importing the toy's training code."""

from __future__ import annotations

from pathlib import Path

BUILTIN_NAME = "builtin:toy"
BUILTIN_DIR = Path(__file__).resolve().parents[1] / "toy" / "checkpoint"
BUILTINS: dict[str, Path] = {BUILTIN_NAME: BUILTIN_DIR, "builtin:toy-224": BUILTIN_DIR.with_name("checkpoint-224")}


def builtin_path(name: str = BUILTIN_NAME) -> Path:
    """A shipped trained toy checkpoint (package data of ``edgekv.toy``)."""
    if name not in BUILTINS:
        raise FileNotFoundError(f"{name}: not a shipped checkpoint (shipped: {', '.join(BUILTINS)})")
    folder = BUILTINS[name]
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder}: the shipped toy checkpoint is missing; train one with "
                                "`edgekv train-toy DIR` and point model.path at DIR")
    return folder


def resolve_model_path(path: str) -> str:
    """``builtin:toy`` / ``builtin:toy-224`` -> the shipped checkpoint's directory; any other path unchanged."""
    return str(builtin_path(path)) if isinstance(path, str) and path.startswith("builtin:") else path
