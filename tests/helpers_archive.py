"""Shared by the sealed-archive tests (test_archive_private.py, test_rekey.py): a small KV shape, each pair's K/V
drawn from its number, an archive filled with such pairs, and byte runs to look for in the files."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from edgekv.archive.store import _MAGIC_NAME, _SEGMENT_HEAD, ARCHIVE_FORMAT, FrameArchive, KVShape

SHAPE = KVShape(layers=3, kv_heads=2, head_dim=8, dtype="float32")
TOKENS = 4
STREAM = b"s" * 16


def pair_kv(pair: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(pair)
    k = torch.randn(SHAPE.layers, SHAPE.kv_heads, TOKENS, SHAPE.head_dim, generator=g)
    return k, k * 2 + 1


def read_back(dtype: str, pair: int) -> torch.Tensor:
    """The pair's K/V [layers, 2, kv_heads, P, head_dim] as an archive of records of ``dtype`` reads it back: exactly,
    as float32; through the 8-bit cache's scheme for int8 (edgekv/cache/quant.py); through edgekv/archive/quant4.py
    for int4."""
    from edgekv.archive.quant4 import dequantize_into, quantize_layers
    from edgekv.cache.quant import dequantize, quantize

    k, v = pair_kv(pair)
    if dtype == "float32":
        return torch.stack((k, v), dim=1)
    if dtype == "int8":
        return torch.stack([dequantize(*quantize(x, torch.int8), torch.float32) for x in (k, v)], dim=1)
    rows, out = quantize_layers(torch.stack((k, v), dim=1)), torch.empty(SHAPE.layers, 2, *k.shape[1:])
    for layer in range(SHAPE.layers):
        dequantize_into(rows[layer], TOKENS, out[layer, 0], out[layer, 1])
    return out


def fill(archive: FrameArchive, pairs: range, stream: bytes = STREAM) -> None:
    for pair in pairs:
        k, v = pair_kv(pair)
        while not archive.submit(k, v, frame=pair, t=float(pair), tpos=10 + pair, t_offset=0, rows=2, cols=2,
                                 stream=stream):
            archive.flush()
    assert archive.flush()


def byte_runs(pair: int) -> list[bytes]:
    """Byte runs of the pair's K and V as the cache holds them (each layer and head's first 32 bytes)."""
    k, v = pair_kv(pair)
    return [t[layer, head].numpy().tobytes()[:32] for t in (k, v) for layer in range(SHAPE.layers)
            for head in range(SHAPE.kv_heads)]


def aging_archive(folder: Path, max_age_s: float | None) -> FrameArchive:
    """An archive of two records a segment, its pairs aged out after ``max_age_s`` (archive.max_age_s)."""
    record = SHAPE.record_bytes(TOKENS)
    return FrameArchive(folder, SHAPE, max_bytes=1 << 20, segment_bytes=2 * record + 200, max_age_s=max_age_s)


def fill_at(archive: FrameArchive, times, stream: bytes = STREAM) -> None:
    """Pairs ``times`` (pair, stream time) of ``stream`` archived, each waited for."""
    for pair, t in times:
        k, v = pair_kv(pair)
        while not archive.submit(k, v, frame=pair, t=t, tpos=10 + pair, t_offset=0, rows=2, cols=2, stream=stream):
            archive.flush()
    assert archive.flush()


def segment_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("seg-*.ekva"))


class MonotonicLater:
    """The ``time`` module with its monotonic clock ``seconds`` on (for ``monkeypatch.setattr(module, "time", ...)``):
    retention's ages stepped, never slept."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __getattr__(self, name):
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.seconds


def newer_segment(path: Path, extra: bytes = b"") -> bytes:
    """A segment as a newer edgekv might write it: the magic with format ARCHIVE_FORMAT + 1, a header this one could
    parse (so only the format says it is not its own), then ``extra``: records of a layout it cannot know."""
    key = json.dumps({**asdict(SHAPE), "format": ARCHIVE_FORMAT + 1}, sort_keys=True).encode()
    data = (_MAGIC_NAME + (ARCHIVE_FORMAT + 1).to_bytes(2, "little") + _SEGMENT_HEAD.pack(len(key), zlib.crc32(key))
            + key + extra)
    path.write_bytes(data)
    return data
