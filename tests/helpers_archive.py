"""Shared by the sealed-archive tests (test_archive_private.py, test_rekey.py): a small KV shape, each pair's K/V
drawn from its number, an archive filled with such pairs, and byte runs to look for in the files."""

from __future__ import annotations

import json
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import torch

from edgekv.archive.store import (_HEAD, _MAGIC_NAME, _META, _SEGMENT_HEAD, ARCHIVE_FORMAT, FrameArchive, KVShape,
                                  _segment_fields)

SHAPE = KVShape(layers=3, kv_heads=2, head_dim=8, dtype="float32")
TOKENS = 4
STREAM = b"s" * 16
# a segment the edgekv before records said their frame count wrote: ``fill_at`` of pairs 0-3 at 0, 0.5, 1 and 1.5 s
EARLIER_SEGMENT = Path(__file__).parent / "fixtures" / "archive_before_frames.ekva"


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


def fill_at(archive: FrameArchive, times, stream: bytes = STREAM, one_frame: frozenset[int] = frozenset()) -> None:
    """Pairs ``times`` (pair, stream time) of ``stream`` archived, each waited for; those of ``one_frame`` as one
    frame prefilled as a pair of itself (an odd last frame)."""
    for pair, t in times:
        k, v = pair_kv(pair)
        while not archive.submit(k, v, frame=pair, t=t, tpos=10 + pair, t_offset=0, rows=2, cols=2, stream=stream,
                                 frames=1 if pair in one_frame else 2):
            archive.flush()
    assert archive.flush()


def records(path: Path) -> list[tuple[tuple, bytes, bytes]]:
    """The records of an unsealed segment: (head fields, meta, kv bytes) each."""
    data = path.read_bytes()
    with open(path, "rb") as handle:
        found = _segment_fields(handle)
    assert found is not None, path
    out, at = [], found[1]
    while at < len(data):
        head = _HEAD.unpack_from(data, at)
        meta_end = at + _HEAD.size + head[1]
        out.append((head, data[at + _HEAD.size:meta_end], data[meta_end:meta_end + head[2]]))
        at = meta_end + head[2]
    return out


def earlier_layout(folder: Path) -> int:
    """The unsealed segments under ``folder`` as the edgekv before records said their frame count wrote the same pairs:
    ``rows`` positive in every record (its meta's CRC made anew). Returns the records changed."""
    changed = 0
    for path in sorted(folder.glob("seg-*.ekva")):
        data = bytearray(path.read_bytes())
        at = len(data) - sum(_HEAD.size + len(meta) + len(kv) for _, meta, kv in records(path))
        for head, meta, kv in records(path):
            fields = list(_META.unpack_from(meta))
            if fields[5] < 0:
                fields[5] = -fields[5]
                meta = _META.pack(*fields) + meta[_META.size:]
                data[at:at + _HEAD.size + len(meta)] = _HEAD.pack(head[0], head[1], head[2], zlib.crc32(meta),
                                                                  head[4]) + meta
                changed += 1
            at += _HEAD.size + len(meta) + len(kv)
        path.write_bytes(bytes(data))
    return changed


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
