"""The content hash of a checkpoint folder: what an engine bundle (``engines/manifest.py``) and a snapshot
(``edgekv/state.py``) record of the weights they were made for, so random and real weights of one shape never share
either. Hashing 7 GB takes seconds, so each file's digest is remembered in a memo file (``<engine_dir>/hashes.json``)
keyed by (path, size, mtime) and taken again only when the file changes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_HASH_CHUNK = 1 << 24


class NotACheckpoint(FileNotFoundError):
    """``config.json`` or the weight files are missing: the message names the folder and what is missing."""


def file_digest(path: Path, memo: dict | None = None) -> str:
    """sha256 of a file; ``memo`` maps ``str(path)`` -> {size, mtime_ns, sha256} and is updated."""
    stat = path.stat()
    key = str(path.resolve())
    if memo is not None:
        known = memo.get(key)
        if isinstance(known, dict) and known.get("size") == stat.st_size and known.get("mtime_ns") == stat.st_mtime_ns:
            return str(known["sha256"])
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    if memo is not None:
        memo[key] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": value}
    return value


def read_memo(memo_file: Path | None) -> dict:
    """The digests remembered in ``memo_file`` (empty when there is none or it does not read as a memo)."""
    if memo_file is None or not memo_file.is_file():
        return {}
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        return {}
    return memo if isinstance(memo, dict) else {}


def write_memo(memo_file: Path | None, memo: dict) -> None:
    if memo_file is None:
        return
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
        os.replace(tmp, memo_file)
    except OSError:
        pass  # a read-only engine dir only costs a re-hash next time


def model_hash(model_dir: Path, memo_file: Path | None = None, remember: bool = True) -> str:
    """Content hash of a checkpoint directory: config.json plus every ``*.safetensors`` file, by name.
    ``remember``: write the digests taken back to ``memo_file`` (``edgekv-camera --check`` only reads it)."""
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise NotACheckpoint(f"model.path: {model_dir} is not a checkpoint directory (missing {', '.join(missing)})")
    memo = read_memo(memo_file)
    total = hashlib.sha256()
    for path in files:
        total.update(path.name.encode() + b"\0" + file_digest(path, memo).encode() + b"\n")
    if remember:
        write_memo(memo_file, memo)
    return total.hexdigest()
