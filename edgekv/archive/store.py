"""FrameArchive: every frame pair's KV on flash, appended by a background writer, crash-safe.

What is stored, and when: **the whole frame pair at ingest**, not the slots a compression evicts.
- Retrieval then does not depend on what the query-agnostic policy chose (DESIGN invariant 3): a pair
  comes back with every patch, in every layer and KV head, as it was prefilled. Evicted slots are a
  different subset per (layer, head) (invariant 2), so storing evictions would archive fragments: a
  pair recalled from them would be whatever each head happened to drop, never the whole frame.
- The bytes per hour are the same either way in the long run: under a hard cap every token ingested
  is evicted once the stream is long enough (the cache only holds ``C`` of them), so evictions carry
  the ingest rate's KV bytes, plus per-slot provenance (frame, row, col, position per layer and head,
  ~12 B against 512 B of K+V per slot-head at the 3B shape) that a whole-pair record does not need.
  ``edgekv bench archive`` prints both rates at the 3B shape.
- Ingest writes are steady (one record per pair) where evictions arrive in bursts of a compression's
  worth of pairs; and the pair's keys are stored rotated at the position they were prefilled with, so
  one temporal delta re-rotates them exactly at recall (edgekv/positions.py), whatever re-basing did
  to the cache since.
ReKV (seed 001, §3 "Video Stream Encoding") keeps all video KV the same way and offloads it to RAM/disk.

Writing never blocks ingest: ``submit`` copies the pair's K/V from the cache into one of
``queue_pairs`` preallocated staging buffers and hands it to the writer thread; when every buffer is
taken (the disk is slower than the stream) the pair is **dropped and counted** (``dropped``) — the
live cache has it anyway, and a stalled camera loop would lose frames for everyone. A stream replayed
faster than real time (an evaluation, a file) sets ``when_full = "wait"`` instead: ingest waits for the
writer, and every pair is archived whatever the machine's load. The writer takes
pairs in batches (up to half the buffers, gathered for at most 0.2 s) so that its Python and torch work
per pair, which holds the GIL the ingest thread needs, stays small (``_write_loop``). Host memory of
the archive is bounded: the staging buffers (``queue_pairs`` pairs, allocated at the first pair) and the
index, one row per archived pair of ``index_keys`` fp16 keys per layer and KV head (18 KiB per key at the
3B shape, 0.2 % of its 9.5 MB record; ``index_keys = 2``: 0.4 %) in a matrix grown by a quarter as needed (and
cut to what is in use after an open), plus ~0.6 KiB of bookkeeping a pair, so at most ~1.25 x 0.4 % of
``max_gib`` (e.g. 80 MiB for 16 GiB). Many small records (4-bit, a small grid, a large disk) are many rows, all in
RAM, so the index has a bound of its own, ``max_index_bytes`` (``archive.max_index_mib``; by default an eighth of the
machine's RAM, 1 GiB on an 8 GB board): past it the oldest segments go, as past ``max_gib`` (the open segment may
take it past by its own pairs), a lowered bound trims them at open, and the first pair says when the bound, not
``max_gib``, decides how far back the archive reaches (``index_bound``). Measured (the archive_scale probe, dev VM):
10^5 toy pairs open in 1.5 s (13 s when each record was indexed on its own) and hold 1.2 KiB of RSS a pair; 10^4
pairs of the 3B shape, 43 KiB a pair (37.3 KiB of rows).

Files, under ``dir``: ``seg-00000001.ekva``, ... Each starts with a header (magic, JSON shape key with a
CRC) followed by records. The magic is ``EDGEKV-ARCHIVE`` and a u16 format, ``ARCHIVE_FORMAT`` (1); a layout this
edgekv could not read bumps it, and a segment of a later format (a newer edgekv's, met after a downgrade) is named once
at open and left alone: never read, deleted by retention, repaired, forgotten in nor resealed (``newer``)::

    record = head [magic 'EKVA', u32 meta bytes, u64 kv bytes, u32 crc(meta), u32 0]
             meta [struct _META: pair, frame, t, tpos, t_offset, rows (< 0: one frame), cols, tokens; 16 B stream id;
                   u32 crc per layer of that layer's KV; the index row: fp16 keys [layers, kv_heads,
                   index_keys, head_dim], then fp16 weights [layers, kv_heads, index_keys] when
                   index_keys > 1 (with one key the row is the first format's mean key)]
             kv   per layer: K [kv_heads, P, head_dim] then V [kv_heads, P, head_dim], the cache's dtype;
                  or, 8-bit records (``archive.kv_dtype: int8 | fp8``, the shape key's dtype): K codes, V codes,
                  then K scales [kv_heads, P] and V scales in bf16 — the 8-bit cache's scheme (one absmax scale
                  per layer, KV head and token: edgekv/cache/quant.py), quantized by the writer from the float
                  cache's K/V and dequantized into the cache's slots at recall: (head_dim + 2) / (2 x head_dim)
                  of a bf16 record's K/V, 1.96x the pairs in ``max_gib`` at the 3B shape (``edgekv plan``);
                  or 4-bit records (``archive.kv_dtype: int4``, shape key dtype "int4"): K and V codes two a byte,
                  then K scales and minima per channel [kv_heads, head_dim], V's per token [kv_heads, P], bf16
                  (edgekv/archive/quant4.py): 3.8x the pairs of bf16 records at the 3B shape

A record is stamped ``t``, its pair's first frame's time; ``rows`` < 0 marks a pair of one frame (an odd last frame at
the end of a finite stream, prefilled as a pair of itself: ``StreamSession.finish_pair``), which ends where it starts
(a pair of two ends a frame interval on: ``ArchivedPair.t_last``). The restart after a ``kill -9`` goes on after
the newest record's last frame, and a question about a window recalls the records with a frame in it. No edgekv ever
read ``rows`` back (the grid is ``tokens / cols`` rows), so the sign needs no new format: an earlier edgekv reads these
records as its own (a one-frame one as a pair of two, as it wrote them), and this one reads an earlier one's records
(rows positive) as pairs of two, as before.

The index row summarizes the pair's post-RoPE keys with their temporal rotation undone (all tokens of a
pair share one temporal position, so undoing it on the summary is exact), so retrieval scores do not
depend on when the pair was seen: one key per layer and KV head is the pair's mean key (ReKV's
representative vector); more are k-means centroids of its keys with the share of tokens each stands for
(``summarize_keys``), which lets ``attention_scores`` estimate the attention a question would pay the
pair's tokens, an object that covers a few patches included. Per-layer CRCs let retrieval read and verify one layer
of one pair (ReKV's per-layer internal retrieval reads only what each layer chose).

Crash safety: a record becomes visible in the index only after it is written; a ``kill -9`` during a write
loses that record and the pairs still waiting in the staging buffers (at most a batch gathered for 0.2 s
beyond them), nothing else. Records are written at explicit offsets through ``SegmentFiles`` (the file-system
boundary tests inject faults at). A write that fails part way — a full disk — is rolled back: the segment is
truncated to its last complete record (or, if even that fails, sealed, the next record starting a new
segment), so what is written after the disk frees up follows a complete record. The pair is lost and counted
(``dropped``, ``write_errors``); ``disk_full`` / ``failing`` / ``last_error`` say so until a write succeeds
(``/healthz`` reports the archive ``degraded``; ``/metrics`` counts both).

A disk shared with other writers (a robot's bag recorder, logs, the OS): ``keep_free_bytes``
(``archive.keep_free_gib``) is a floor of free space on the file system. Before each record the writer asks the
file system (``statvfs``: the blocks an unprivileged writer may still take); while the record would leave less
free than the floor, the oldest sealed segments are deleted, as past ``max_bytes`` (counted:
``segments_yielded``); when none is left to give, the pair is not archived (an ``ENOSPC``: ``disk_full``), so
the archive never takes the last of a disk whatever else fills it, and takes the room back as it is freed.

Damage (DESIGN invariant 13: one bad byte costs one record). On reopen every segment is scanned: each record's
head and meta are checked (magic, length, meta CRC, a KV length that matches the meta's token count), and the
newest segment's KV too (layer CRCs; older segments were sealed with an fsync and their KV is checked when
read). A record that does not check is skipped and counted (``bad_records``, ``skipped_bytes``) and the scan
resynchronizes on the next offset where a record checks — found by its magic, proven by its meta's CRC, the
way leveldb's log reader (``doc/log_format.md``) drops a damaged record and resumes at the next block boundary
instead of dropping the rest of the file. Fixed-size blocks are not needed for that here: every record's meta
is checksummed and fixes the record's length, so no format change was made and archives already on devices
read as they are (including those the old writer left after a full disk: half a record, then complete ones
appended after it; the complete ones are found inside the partial one's extent and kept). A record whose meta
checks but one KV layer does not keeps its other layers (``damaged_layers``; the damaged layer is never handed
out). A damaged segment header no longer condemns its records: they are read with this archive's shape, each
checked on its own. Only a tail that is the start of a record cut by the end of the file is a torn write: it
is cut off (``torn_bytes``); damaged bytes are left in place, never truncated away with the good records after
them. Retention: segments are ``segment_mib`` each; the oldest are deleted while the files would pass
``max_gib`` or the index its bound; with ``max_age_s``, a segment of the stream being written goes when its newest
pair is older than that behind the pair being written (stream time), an earlier stream's (a restart without the saved
memory) when its file was last written longer ago by the wall clock, or this process has held it that long
(``_too_old``: a clock set back or never set ages nothing by the wall clock and is said once).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import json
import logging
import os
import queue
import struct
import threading
import time
import uuid
import weakref
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from edgekv.durable import fsync_dir
from edgekv.folder_lock import lock_folder, unlock_folder
from edgekv.positions import rotate_temporal

log = logging.getLogger("edgekv.archive")

ARCHIVE_FORMAT = 1                         # the segment format this edgekv writes, and the newest it reads
_MAGIC_NAME = b"EDGEKV-ARCHIVE"
_MAGIC_FORMAT = struct.Struct("<H")        # after the name: the segment's format (a newer layout bumps it)
SEGMENT_MAGIC = _MAGIC_NAME + _MAGIC_FORMAT.pack(ARCHIVE_FORMAT)
RECORD_MAGIC = b"EKVA"
_HEAD = struct.Struct("<4sIQII")           # magic, meta bytes, kv bytes, crc(meta), reserved
_SEGMENT_HEAD = struct.Struct("<II")       # json bytes, crc(json)
_META = struct.Struct("<qqdqqhhi")         # pair (archive key), frame (session's pair index), t, tpos, t_offset,
#                                            rows (negative: a pair of one frame), cols, tokens
_FSYNC_EVERY_S = 2.0                       # a power cut loses at most this much of the open segment
_LINGER_S = 0.2                            # the writer gathers queued pairs this long (or half the staging
                                           # buffers) and writes them as one batch
_INDEX_ROWS = 256                          # initial rows of the index matrix (grown by a quarter as needed)
_SCORE_CHUNK = 512                         # index rows scored at a time
_SCAN_BATCH = 64                           # records read at open indexed at a time
_PACE_BYTES = 8 << 20                      # a forget's rewrite reaches the disk this much at a time (``progress``)
_WALL_FLOOR = 1735689600.0                 # 2025-01-01 UTC: a wall time before it is a clock that was not set
_WALL_SLACK_S = 60.0                       # a segment's wall time this far past now is still "now" (NTP's slew)
ENTRY_BYTES = 640                          # an index entry's Python bookkeeping beside its row (ArchivedPair, the
                                           # dicts' slots), measured: 0.5-0.6 KiB on CPython 3.11
_TAG = 16                                  # AES-GCM tag of each sealed meta and layer (edgekv.privacy)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn,  # 8-bit: codes + a bf16 scale per row
           "int4": torch.uint8}  # 4-bit: two codes a byte + bf16 scales and minima (edgekv/archive/quant4.py)
_ITEM_BYTES = {name: torch.empty((), dtype=dtype).element_size() for name, dtype in _DTYPES.items()}
_QUANTIZED = ("int8", "float8_e4m3fn", "int4")
_KV_DTYPE_NAMES = {"int8": "int8", "float8_e4m3fn": "fp8", "int4": "int4"}  # archive.kv_dtype's names of them
# archive.kv_dtype -> the records' dtype, as ``KVShape.of`` takes it ("auto": the cache's own, not here)
ARCHIVE_KV_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": "int4"}


class ArchiveError(RuntimeError):
    """An archive folder that cannot be used; the message names the file and what is wrong."""


class ArchiveMismatchError(ArchiveError):
    """An archive written for another KV shape (layers, heads, head_dim, dtype)."""


@dataclass(frozen=True)
class KVShape:
    """The per-pair KV an archive holds: [layers, kv_heads, P, head_dim] of ``dtype`` for K and for V."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # "float32" | "float16" | "bfloat16", or "int8" | "float8_e4m3fn" | "int4": quantized records
    index_keys: int = 1  # representative keys per pair, layer and KV head in the index (1: the mean key)

    def __post_init__(self) -> None:
        if min(self.layers, self.kv_heads, self.head_dim) <= 0:
            raise ValueError(f"KVShape needs positive layers, kv_heads and head_dim, got {self}")
        if not 1 <= self.index_keys <= 64:
            raise ValueError(f"KVShape.index_keys: must be 1 to 64, got {self.index_keys}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVShape.dtype: {self.dtype!r} is not one of {sorted(_DTYPES)}")

    @classmethod
    def of(cls, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype | str,
           index_keys: int = 1) -> "KVShape":
        """``dtype``: a torch dtype, or ``"int4"`` (4-bit records)."""
        return cls(layers, kv_heads, head_dim, str(dtype).removeprefix("torch."), int(index_keys))

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def quantized(self) -> bool:
        """8-bit records (``archive.kv_dtype``): a layer is K codes [kv_heads, P, head_dim], V codes, then K scales
        [kv_heads, P] and V scales in bf16 — one scale per (layer, KV head, token), absmax over ``head_dim``, as
        the 8-bit cache (edgekv/cache/quant.py) — written from the float cache's K/V, read back dequantized; or
        4-bit records (``"int4"``: edgekv/archive/quant4.py, keys per channel and values per token)."""
        return self.dtype in _QUANTIZED

    def layer_bytes(self, tokens: int) -> int:
        """K and V of one layer of one pair (with a quantized record's scales)."""
        if self.dtype == "int4":
            from edgekv.archive.quant4 import layer_bytes

            return layer_bytes(self.kv_heads, tokens, self.head_dim)
        if self.quantized:
            return 2 * self.kv_heads * tokens * (self.head_dim + 2)
        return 2 * self.kv_heads * tokens * self.head_dim * _ITEM_BYTES[self.dtype]

    def index_entry_bytes(self) -> int:
        """RAM a pair takes in the index: its row (fp16 keys and weights, fp32 norms) and ``ENTRY_BYTES`` of
        bookkeeping."""
        cells = self.layers * self.kv_heads * self.index_keys
        return 2 * cells * (self.head_dim + 1) + 4 * self.layers + ENTRY_BYTES

    def summary_bytes(self) -> int:
        """The index row in a record's meta: fp16 keys [layers, kv_heads, index_keys, head_dim], then (when
        index_keys > 1) their fp16 weights [layers, kv_heads, index_keys]. With one key the layout is the
        first format's mean key [layers, kv_heads * head_dim], so those archives read unchanged."""
        cells = self.layers * self.kv_heads * self.index_keys
        return 2 * cells * self.head_dim + (2 * cells if self.index_keys > 1 else 0)

    def meta_bytes(self) -> int:
        return _META.size + 16 + 4 * self.layers + self.summary_bytes()

    def record_bytes(self, tokens: int) -> int:
        return _HEAD.size + self.meta_bytes() + self.layers * self.layer_bytes(tokens)


@dataclass(frozen=True, slots=True)
class ArchivedPair:
    """One index entry (what retrieval needs without touching the disk). Slots and the layer CRCs as packed bytes:
    an archive of 10^5 pairs holds 10^5 of these (as a ``__dict__`` and a tuple of ints one took 1.7 KiB at the 3B
    shape, 5 % of its index row; now about 0.5 KiB)."""

    pair: int        # the archive's key: unique, in write order, continuing across restarts
    frame: int       # the session's frame-pair index (what the cache's ``frame`` metadata holds)
    t: float
    tpos: int        # the temporal position its keys were rotated with
    t_offset: int    # the session's re-basing offset when it was prefilled
    rows: int
    cols: int
    tokens: int
    stream: bytes    # 16 B id of the stream (a new session's stream gets a new id)
    segment: int
    offset: int      # of the record's head in the segment file
    crcs: bytes      # u32 little-endian per layer: the CRC of that layer's K/V as stored (``layer_crcs``)
    seq: int = 0     # the record's number in a sealed segment (its AES-GCM nonces); 0 in the clear
    frames: int = 2  # 1: one frame prefilled as a pair of itself (an odd last frame); stored as the sign of rows

    @property
    def layer_crcs(self) -> tuple[int, ...]:
        return struct.unpack(f"<{len(self.crcs) // 4}I", self.crcs)

    def t_last(self, frame_s: float) -> float:
        """The stream time of the pair's last frame, ``frame_s`` (a frame interval) after ``t`` for a pair of two: the
        second frame of a recording sampled at its fps, within the sampler's jitter for a live one."""
        return self.t if self.frames == 1 else self.t + frame_s


@dataclass
class _Staged:
    kv: torch.Tensor  # [layers, 2, kv_heads, P, head_dim], host memory (each layer's record block contiguous)
    pair: int = 0
    frame: int = 0
    t: float = 0.0
    tpos: int = 0
    t_offset: int = 0
    rows: int = 0
    cols: int = 0
    tokens: int = 0
    stream: bytes = b""
    frames: int = 2


class SegmentFiles:
    """The archive's file-system boundary: every byte the writer puts on flash goes through these calls, at an
    explicit offset (so a failed write can be cut back and the next record written where it belongs). Tests
    override them to inject faults — a short write, ENOSPC, a failing fsync — as RocksDB's FaultInjectionFS
    (``utilities/fault_injection_fs.h``) and SQLite's I/O-error tests do, instead of hoping for them."""

    def create(self, path: Path) -> int:
        # 0600: what the camera saw, for the daemon's user alone (0644 let every local account read it in the clear)
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)

    def pwrite(self, fd: int, data, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def truncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def free_bytes(self, folder: Path) -> int | None:
        return disk_free_bytes(folder)


def size_text(size: float) -> str:
    """``size`` bytes for a person: 512 B, 96.0 KiB, 12.3 MiB, 1.50 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GiB" else f"{size / scale:.1f} {unit}"
    return f"{int(size)} B"


def _wall_text(unix: float) -> str:
    """A wall time for a log line (UTC, whatever the wall clock's state)."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))
    except (OverflowError, OSError, ValueError):
        return f"{unix:.0f} s after the epoch"


def _duration_text(seconds: float) -> str:
    for unit, scale in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f} {unit}"
    return f"{seconds:.0f} s"


def default_index_bytes() -> int | None:
    """The index's bound when ``archive.max_index_mib`` is not set: an eighth of this machine's RAM (1 GiB on an 8 GB
    board); None where the RAM cannot be asked."""
    ram = _ram_bytes()
    return ram // 8 if ram else None


def _ram_bytes() -> int | None:
    """This machine's physical memory (None where it cannot be asked)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def disk_free_bytes(folder: str | Path) -> int | None:
    """The bytes an unprivileged writer may still put on the file system holding ``folder`` (``statvfs``'s
    ``f_bavail`` blocks: the root-reserved ones left out); None when it cannot be asked."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return int(st.f_bavail) * int(st.f_frsize)


class FrameArchive:
    """Segments of frame-pair records under ``folder`` plus their index; see the module docstring.

    Threads: ``submit`` is called by the ingesting thread, the writer thread appends, and retrieval reads
    (``read_layer``) from the asking thread; ``_lock`` guards the index and segment deletion.
    """

    def __init__(self, folder: str | Path, shape: KVShape, *, max_bytes: int, segment_bytes: int = 256 << 20,
                 queue_pairs: int = 8, max_age_s: float | None = None, inv_freq: torch.Tensor | None = None,
                 temporal_section: int = 0, when_full: str = "drop", files: "SegmentFiles | None" = None,
                 keys=None, keep_free_bytes: int = 0, stage_dtype: torch.dtype | None = None,
                 max_index_bytes: int | None = None) -> None:
        if segment_bytes <= 0 or max_bytes < 2 * segment_bytes:
            raise ValueError(f"archive: max bytes ({max_bytes}) must hold at least two segments of {segment_bytes}")
        if queue_pairs < 1:
            raise ValueError(f"archive.queue_pairs: must be >= 1, got {queue_pairs}")
        if when_full not in ("drop", "wait"):
            raise ValueError(f"archive.when_full: must be 'drop' or 'wait', got {when_full!r}")
        self.when_full = when_full
        self.keys = keys  # edgekv.privacy.KeyRing: new segments sealed with its current key (see "Sealed")
        self._sealers: dict[int, object] = {}  # segment number -> its Sealer (sealed segments only)
        self._scan_sealer = None  # the sealer of the segment being scanned
        self._scan_dtype: str | None = None  # the records' dtype of the segment being scanned (its header's)
        self._dtypes: dict[int, str] = {}  # segment number -> its records' dtype, where not ``shape.dtype``
        self._seq = 0  # the next record's number in the open segment
        self._write_lock = threading.Lock()  # the writer's batch, or a forget's rewrite
        self.forgotten = 0  # pairs removed by forget
        self.lost_to_forget = 0  # other pairs of a segment a forget had to delete whole (no room to rewrite it)
        self.files = files if files is not None else SegmentFiles()
        self.dir = Path(folder).expanduser()
        self.shape = shape
        # the dtype pairs are staged and read back in: the archive's own, or for 8-bit records the cache's float
        # dtype (quantized by the writer, dequantized by ``read_into``)
        self.stage_dtype = stage_dtype if shape.quantized and stage_dtype is not None else (
            torch.float16 if shape.quantized else shape.torch_dtype)
        self.max_bytes, self.segment_bytes = int(max_bytes), int(segment_bytes)
        self.queue_pairs, self.max_age_s = int(queue_pairs), max_age_s
        self.inv_freq, self.temporal_section = inv_freq, int(temporal_section)
        self._lock = threading.RLock()
        self._entries: dict[int, ArchivedPair] = {}   # pair -> entry (newest record wins)
        # the index, one row per archived pair: its representative keys, fp16 [rows, layers, kv_heads,
        # index_keys, head_dim], their weights (share of the pair's tokens each stands for, summing to 1) and
        # the norm of the weighted mean (= the pair's mean key) per layer, so a question scores every pair
        # with one pass over a matrix
        cells = (shape.layers, shape.kv_heads, shape.index_keys)
        self._matrix = torch.zeros(_INDEX_ROWS, *cells, shape.head_dim, dtype=torch.float16)
        self._weights = torch.zeros(_INDEX_ROWS, *cells, dtype=torch.float16)
        self._norms = torch.zeros(_INDEX_ROWS, shape.layers)
        self._row_of: dict[int, int] = {}             # pair -> row
        self._free_rows: list[int] = []
        self._rows_used = 0
        self._ordered = True  # _entries' insertion order is pair order (always, as written): no sort a question
        self._streams: dict[bytes, bytes] = {}  # each stream id's one bytes object, shared by its entries
        self._shapes: dict[str, KVShape] = {}  # records' dtype -> this archive's shape in it (``_shape_in``)
        self._segments: dict[int, int] = {}           # segment number -> bytes on disk
        # segments a newer edgekv wrote (their format is past ARCHIVE_FORMAT): number -> (format, bytes). Never read,
        # counted in max_gib, deleted, repaired, forgotten in nor resealed: an upgrade back reads them as they are
        self.newer: dict[int, tuple[int, int]] = {}
        # age retention (``max_age_s``): per segment, the stream of its last record and the newest stream time of that
        # stream's records in it; the wall time of its last write (its file's mtime); and the monotonic time this
        # process last wrote it or, for one found at open, opened the archive (see ``_age``)
        self._segment_last: dict[int, tuple[bytes, float]] = {}
        self._wall_written: dict[int, float] = {}
        self._seen_mono: dict[int, float] = {}
        self._opened_mono = time.monotonic()
        self._last_record: tuple[bytes, float, float] | None = None  # the newest record this process wrote: its
        # stream, that stream's newest time and when (monotonic): ``expire``'s stream time now
        self._clock_said = False  # the warning that the wall clock cannot age a segment, given once
        self.dropped = 0          # pairs not archived: every staging buffer was taken, or their write failed
        self._pending = 0         # pairs submitted and not yet written or dropped by the writer (under _lock)
        self.wait_ms_total = 0.0  # ingest time spent waiting for a staging buffer (when_full = "wait")
        self.written = 0          # records written by this process
        self.torn_bytes = 0       # bytes cut off torn tails on open
        self.bad_records = 0      # damaged records skipped on open, or layers refused on read, for a failed checksum
        self.skipped_bytes = 0    # bytes of damaged records skipped on open (left in place)
        self.damaged_layers = 0   # layers of otherwise good records that failed their CRC at open (never handed out)
        self.write_errors = 0
        self.disk_full = False    # the last write failed for want of space (ENOSPC, EDQUOT)
        self.failing = False      # the last write failed (any reason); cleared by the next one that succeeds
        self.last_error: str | None = None
        self._failed_in_a_row = 0
        self.segments_deleted = 0
        self._expire_error: str | None = None  # why expire last failed to delete a segment (said once a run)
        self.segments_yielded = 0  # of them, deleted only because the disk's free space fell to keep_free_bytes
        self.keep_free_bytes = max(0, int(keep_free_bytes))
        # the index's bound in RAM (archive.max_index_mib; None: an eighth of this machine's RAM), in pairs: past it
        # the oldest segments go, as past max_bytes (``index_bound``)
        if max_index_bytes is not None and max_index_bytes <= 0:
            raise ValueError(f"archive.max_index_mib: must be > 0, got {max_index_bytes} bytes")
        self.max_index_bytes = max_index_bytes if max_index_bytes is not None else default_index_bytes()
        self.index_auto = max_index_bytes is None
        self.max_index_pairs = (None if self.max_index_bytes is None
                                else max(1, self.max_index_bytes // self.index_entry_bytes))
        self.segments_over_index = 0  # of the segments deleted, those deleted to keep the index within its bound
        self.write_ms_total = 0.0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_folder(self.dir)  # before anything reads, repairs or removes a file of it
        try:
            for leftover in self.dir.glob("seg-*.ekva.tmp"):  # a forget's rewrite cut short: the original stands
                leftover.unlink()
            self._scan()
            self._trim_index()
        except BaseException:  # an archive that does not open lets go of the folder
            unlock_folder(self._lock_fd)
            raise
        self._next_key = max(self._entries, default=-1) + 1
        self._current: int | None = None
        self._fd: int | None = None  # the open segment, written at explicit offsets (pwrite)
        self._last_fsync = time.monotonic()
        self._free: queue.SimpleQueue[_Staged] = queue.SimpleQueue()
        self._staging_tokens: int | None = None
        self._work: queue.Queue[_Staged | None] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._hurry = threading.Event()  # flush() waits: no gathering
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="edgekv-archive-writer", daemon=True)
        self._writer.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ------------------------------------------------------------------ index
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pairs(self) -> int:
        with self._lock:
            return len(self._entries)

    def oldest_t(self, stream: bytes | None) -> float | None:
        """The stream time of the oldest pair of ``stream`` the archive still holds (None: none). Entries are
        kept in the order they were written, so this walks only past earlier streams' pairs."""
        with self._lock:
            for entry in self._entries.values():
                if entry.stream == stream:
                    return entry.t
        return None

    @property
    def bytes_on_disk(self) -> int:
        with self._lock:
            return sum(self._segments.values())

    @property
    def next_pair(self) -> int:
        """The key the next submitted pair gets: one past every key this folder has held."""
        with self._lock:
            return self._next_key

    def last_frame(self, stream: bytes | None) -> int | None:
        """The highest frame pair number of ``stream`` the archive holds (None: none of its pairs)."""
        with self._lock:
            return max((e.frame for e in self._entries.values() if e.stream == stream), default=None)

    def entries(self, stream: bytes | None = None) -> list[ArchivedPair]:
        """Index entries in pair order (of one stream when given)."""
        with self._lock:
            return self._stream_entries(stream)

    def mean_keys(self, pairs: list[int]) -> torch.Tensor:
        """fp32 [n, layers, kv_heads * head_dim] time-undone mean keys of ``pairs`` (the weighted mean of
        each pair's representative keys: its mean key, to fp16 rounding)."""
        with self._lock:
            rows = torch.tensor([self._row_of[p] for p in pairs], dtype=torch.long)
            return _weighted_mean(self._matrix[rows], self._weights[rows])

    def summaries(self, pairs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The index rows of ``pairs``: fp32 keys [n, layers, kv_heads, index_keys, head_dim] and weights
        [n, layers, kv_heads, index_keys]."""
        with self._lock:
            rows = torch.tensor([self._row_of[p] for p in pairs], dtype=torch.long)
            return self._matrix[rows].float(), self._weights[rows].float()

    def cosine_scores(self, query: torch.Tensor,
                      stream: bytes | None = None) -> tuple[list[ArchivedPair], torch.Tensor]:
        """The entries (of one stream when given, pair order) and the cosine similarity of their mean keys
        to ``query`` [layers, kv_heads * head_dim] per layer: fp32 [n, layers] (ReKV's retrieval score). One
        pass over the index matrix, in chunks of _SCORE_CHUNK rows."""
        query = query.float()
        unit = query / query.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        with self._lock:
            entries = self._stream_entries(stream)
            rows = torch.tensor([self._row_of[e.pair] for e in entries], dtype=torch.long)
            used = self._rows_used
            out = torch.empty(used, self.shape.layers)
            for start in range(0, used, _SCORE_CHUNK):
                end = min(start + _SCORE_CHUNK, used)
                mean = _weighted_mean(self._matrix[start:end], self._weights[start:end])
                out[start:end] = torch.einsum("nlw,lw->nl", mean, unit)
            out /= self._norms[:used].clamp_min(1e-12)
            return entries, out[rows]

    def attention_scores(self, queries: torch.Tensor, stream: bytes | None = None,
                         exclude=None) -> tuple[list[ArchivedPair], torch.Tensor]:
        """The entries (of one stream when given, pair order) and the share of the question's attention each
        would draw among them, per layer: fp32 [n, layers], each finite column summing to 1.

        queries: [layers, q_heads, T, head_dim], the question's queries with their temporal rotation undone
        (what ``Recall.probe`` records). For every layer, query head and question token, a pair's logit is
        ``log sum_c w_c exp(q . c / sqrt(d))`` over its representative keys ``c`` (weights ``w_c``: the
        share of its tokens each stands for) — the log of its tokens' attention mass, exact when every
        token of a cluster has its centroid's key — and a softmax over the candidate pairs gives each one's
        share of that head's attention; the score is the share averaged over query heads and tokens.
        ``exclude(entries)``, when given, returns a bool mask [n, layers] (or [n, 1]) of entries that are
        not candidates (score -inf, not in any softmax). Runs on ``queries``' device, in chunks of
        _SCORE_CHUNK index rows, two passes (the softmax's normalizer, then the shares)."""
        device = queries.device
        layers, q_heads, tokens, dim = queries.shape
        kv_heads = self.shape.kv_heads
        if q_heads % kv_heads or dim != self.shape.head_dim or layers != self.shape.layers:
            raise ValueError(f"archive: queries [layers, q_heads, T, head_dim] = {tuple(queries.shape)} do not "
                             f"match the archive's {self.shape}")
        # [layers, kv_heads, group * T, head_dim]: each KV head's query heads and tokens on one axis
        q = (queries.float() / dim ** 0.5).reshape(layers, kv_heads, (q_heads // kv_heads) * tokens, dim)
        with self._lock:
            entries = self._stream_entries(stream)
            if not entries:
                return entries, torch.empty(0, layers)
            rows = torch.tensor([self._row_of[e.pair] for e in entries], dtype=torch.long)
            mask = torch.zeros(len(entries), layers, dtype=torch.bool)
            if exclude is not None:
                mask |= exclude(entries).to(torch.bool).cpu()
            mask = mask.to(device)

            m, cells = self.shape.index_keys, layers * kv_heads
            flat_q = q.reshape(cells, q.shape[2], dim)  # [L H, J, D]
            heads_mask = mask.t().repeat_interleave(kv_heads, dim=0)  # [L H, N]

            def logits(start: int, end: int) -> torch.Tensor:  # [L H, J, m, n]: q . c / sqrt(d) + log w_c
                index = rows[start:end]
                n = index.shape[0]
                # [L H, D, m n]: one batched matmul per chunk, each (layer, head) its queries x every key
                keys = self._matrix[index].to(device, torch.float32).permute(1, 2, 4, 3, 0).reshape(cells, dim, m * n)
                bias = self._weights[index].to(device, torch.float32).log()  # [n, L, H, m]; log 0 = -inf
                out = torch.bmm(flat_q, keys).view(cells, -1, m, n)
                out += bias.permute(1, 2, 3, 0).reshape(cells, 1, m, n)
                return out.masked_fill_(heads_mask[:, None, None, start:end], float("-inf"))

            # pass 1: the softmax's normalizer per (layer, head, query), online over chunks (max and sum)
            peak = torch.full((cells, q.shape[2], 1, 1), float("-inf"), device=device)
            total = torch.zeros(cells, q.shape[2], 1, 1, device=device)
            for start in range(0, len(entries), _SCORE_CHUNK):
                chunk = logits(start, start + _SCORE_CHUNK)
                new = torch.maximum(peak, chunk.amax(dim=(2, 3), keepdim=True))
                shift = new.masked_fill(new.isinf(), 0.0)  # no candidate yet: nothing to scale
                total = total * (peak - shift).exp() + (chunk - shift).exp().sum(dim=(2, 3), keepdim=True)
                peak = new
            shift = peak.masked_fill(peak.isinf(), 0.0)
            total = total.clamp_min(torch.finfo(torch.float32).tiny)  # a layer with no candidate: every share 0
            # pass 2: each pair's share (summed over its keys), averaged over the query heads and tokens
            out = torch.empty(len(entries), layers, device=device)
            for start in range(0, len(entries), _SCORE_CHUNK):
                share = ((logits(start, start + _SCORE_CHUNK) - shift).exp().sum(dim=2) / total[..., 0])  # [L H, J, n]
                out[start:start + share.shape[-1]] = share.view(layers, -1, share.shape[-1]).mean(dim=1).t()
        return entries, out.masked_fill(mask, float("-inf")).cpu()

    def _stream_entries(self, stream: bytes | None) -> list[ArchivedPair]:
        """Entries in pair order (of ``stream`` when given). Pairs are indexed in the order they were written, so
        the dict's own order is pair order; sorting 10^5 entries took 140-270 ms of every question on the dev VM."""
        entries = self._entries.values() if self._ordered else [e for _, e in sorted(self._entries.items())]
        return [e for e in entries if stream is None or e.stream == stream]

    @property
    def index_bytes(self) -> int:
        """Host memory of the index's matrices (keys, weights, norms), rows held for growth included; the entries'
        Python bookkeeping (about 0.5 KiB a pair) is beside it."""
        with self._lock:
            return self._matrix.nbytes + self._weights.nbytes + self._norms.nbytes

    def _reserve_rows(self, rows: int) -> None:
        """Room for ``rows`` rows in the index matrices: grown by a quarter (not doubled: a doubled matrix stays
        twice the pairs it holds for as long as the archive is open, and an archive at its ``max_gib`` keeps about
        as many pairs as at its peak), or to ``rows`` when a batch (a segment read at open) needs more."""
        have = self._matrix.shape[0]
        if rows <= have:
            return
        grown = max(rows, have + have // 4)
        for name in ("_matrix", "_weights", "_norms"):
            old = getattr(self, name)
            new = torch.zeros(grown, *old.shape[1:], dtype=old.dtype)
            new[:have] = old
            setattr(self, name, new)

    def _add_many(self, entries: list[ArchivedPair], keys: torch.Tensor, weights: torch.Tensor) -> None:
        """``_add`` for a batch: the rows assigned one by one, the matrix and norms written in one go."""
        with self._lock:
            new = sum(1 for entry in entries if entry.pair not in self._row_of)
            self._reserve_rows(self._rows_used + max(0, new - len(self._free_rows)))
            rows = []
            for entry in entries:
                if entry.pair in self._row_of:
                    row = self._row_of[entry.pair]
                else:
                    if self._entries and entry.pair < next(reversed(self._entries)):
                        self._ordered = False
                    if self._free_rows:
                        row = self._free_rows.pop()
                    else:
                        row = self._rows_used
                        self._rows_used += 1
                self._entries[entry.pair] = entry
                self._row_of[entry.pair] = row
                rows.append(row)
                self._note_last(entry.segment, entry.stream, entry.t)
            index = torch.tensor(rows)
            self._matrix[index] = keys
            self._weights[index] = weights
            self._norms[index] = _weighted_mean(keys, weights).norm(dim=-1)

    def _add(self, entry: ArchivedPair, keys: torch.Tensor, weights: torch.Tensor) -> None:
        self._add_many([entry], keys.unsqueeze(0), weights.unsqueeze(0))

    # ------------------------------------------------------------------ opening
    def _segment_path(self, number: int) -> Path:
        return self.dir / f"seg-{number:08d}.ekva"

    def _segment_numbers(self) -> list[int]:
        out = []
        for path in self.dir.glob("seg-*.ekva"):
            digits = path.name[4:-5]
            if digits.isdigit():
                out.append(int(digits))
        return sorted(out)

    def _header_bytes(self, sealer=None, shape: KVShape | None = None) -> bytes:
        fields = asdict(shape or self.shape)
        if sealer is not None:
            fields["sealed"] = sealer.header.hex()  # key id + salt (edgekv.privacy.Sealer)
        key = json.dumps(fields, sort_keys=True).encode()
        return SEGMENT_MAGIC + _SEGMENT_HEAD.pack(len(key), zlib.crc32(key)) + key

    def _read_header(self, path: Path, handle) -> int:
        """Check a segment's header against this archive's shape; returns where its records start."""
        found = _segment_fields(handle)
        if found is None:
            return -1
        saved, start = found
        if saved.get("sealed"):
            from edgekv.privacy import SealError, Sealer

            if self.keys is None or not self.keys.keys:
                raise ArchiveError(f"{path}: sealed (encrypted) and this deployment has no key; set privacy.key_file "
                                   "(or key_env / key_credential) to the key it was written with. The file is left "
                                   "as it is")
            try:
                self._scan_sealer = Sealer.for_header(bytes.fromhex(saved["sealed"]), self.keys, str(path))
            except SealError as exc:
                raise ArchiveError(str(exc)) from None
        wanted = asdict(self.shape)
        if saved.get("dtype") in _DTYPES:  # another kv_dtype's records are read as they are (see ``_shape_of``)
            self._scan_dtype = saved["dtype"]
            wanted["dtype"] = saved["dtype"]
        for name, value in wanted.items():
            if saved.get(name) != value:
                if name == "index_keys":
                    raise ArchiveMismatchError(
                        f"{path}: indexed with archive.index_keys={saved[name]!r}, this config has "
                        f"archive.index_keys={value!r}; set archive.index_keys: {saved[name]!r} or point "
                        f"archive.dir at another folder")
                if name == "dtype" and (saved.get(name) in _QUANTIZED or value in _QUANTIZED):
                    raise ArchiveMismatchError(
                        f"{path}: archived as dtype={saved.get(name)!r}, this config stores {value!r} "
                        f"(archive.kv_dtype: {_KV_DTYPE_NAMES.get(saved.get(name), 'auto')} wrote it); set "
                        f"archive.kv_dtype back, or point archive.dir at another folder")
                raise ArchiveMismatchError(
                    f"{path}: archived for {name}={saved.get(name)!r}, this model's cache has {name}={value!r}; "
                    f"point archive.dir at another folder (or remove this one)")
        return start

    def _scan(self) -> None:
        numbers = []
        for number in self._segment_numbers():
            found = segment_format(self._segment_path(number))
            if found is not None and found > ARCHIVE_FORMAT:
                self.newer[number] = (found, self._segment_path(number).stat().st_size)
            else:
                numbers.append(number)
        for number in numbers:
            self._scan_segment(number, verify_kv=number == numbers[-1])
        self._fit_rows()
        if self.newer:
            log.warning("archive: %s", self.newer_text())

    def newer_text(self) -> str:
        """What the segments a newer edgekv wrote are, and what is done with them (empty: none)."""
        return newer_segments_text(self.dir, {self._segment_path(number): found
                                              for number, found in self.newer.items()})

    def _fit_rows(self) -> None:
        """The index matrices cut to the rows in use and a sixteenth more (at least ``_INDEX_ROWS``): what growth
        by a quarter left over while the segments were read is not kept for as long as the archive is open."""
        keep = max(_INDEX_ROWS, self._rows_used + self._rows_used // 16)
        if keep < self._matrix.shape[0]:
            self._matrix, self._weights, self._norms = (t[:keep].clone() for t in (self._matrix, self._weights,
                                                                                     self._norms))

    def _scan_segment(self, number: int, verify_kv: bool) -> None:
        self._scan_sealer = self._scan_dtype = None
        try:
            self._scan_segment_records(number, verify_kv)
            if self._scan_sealer is not None and number in self._segments:
                self._sealers[number] = self._scan_sealer
            if self._scan_dtype not in (None, self.shape.dtype) and number in self._segments:
                self._dtypes[number] = self._scan_dtype
        finally:
            self._scan_sealer = self._scan_dtype = None

    def _scan_segment_records(self, number: int, verify_kv: bool) -> None:
        """Index every record of a segment that checks (see "Damage" in the module docstring): a damaged
        record is skipped and counted and the scan resynchronizes on the next record that checks; a torn tail
        is cut; nothing that checks is ever removed."""
        path = self._segment_path(number)
        size = path.stat().st_size
        with open(path, "rb") as handle:
            start = self._read_header(path, handle)
            if start < 0:
                if size <= len(self._header_bytes()) and self._find_record(handle, 0, size) is None:
                    log.warning("archive: %s: a header torn before its first record (%d bytes); removed", path, size)
                    self.torn_bytes += size
                    handle.close()
                    path.unlink()
                    return
                log.warning("archive: %s: its header is damaged; reading its records with this archive's shape "
                            "(each record is checked on its own)", path)
                start = self._find_record(handle, 0, size)
                if start is None:
                    start = size
                    self._skipped(path, 0, size, "no record in it checks")
            size = self._scan_records(path, handle, number, start, size, verify_kv)
        self._segments[number] = size
        self._wall_written[number] = path.stat().st_mtime
        self._seen_mono[number] = self._opened_mono

    def _scan_records(self, path: Path, handle, number: int, offset: int, size: int, verify_kv: bool) -> int:
        """The records of one segment from ``offset``, indexed together once the segment is read (one by one, the
        index's torch work took half of an open: 13 s for 10^5 toy pairs on the dev VM); returns the segment's size
        (less a torn tail cut off)."""
        found: dict[int, tuple[ArchivedPair, bytes, bytes]] = {}  # pair -> its entry and index row as stored
        try:
            return self._scan_records_into(found, path, handle, number, offset, size, verify_kv)
        finally:
            self._index_found(found, len(found))

    def _index_found(self, found: dict[int, tuple[ArchivedPair, bytes, bytes]], count: int) -> None:
        """Index the first ``count`` records the scan found (and drop them from ``found``)."""
        if count <= 0:
            return
        pairs = list(found)[:count]
        entries, keys, weights = zip(*(found.pop(pair) for pair in pairs))
        self._add_many(list(entries), *self._index_rows(list(keys), list(weights)))

    def _scan_records_into(self, found: dict, path: Path, handle, number: int, offset: int, size: int,
                           verify_kv: bool) -> int:
        previous: ArchivedPair | None = None  # the last record indexed: a partial one ends inside the next
        while offset < size:
            kind, parsed = self._parse_record(handle, number, offset, size, verify_kv)
            if kind == "ok":
                entry, keys, weights, end, damaged = parsed
                if damaged:  # a layer failed its CRC: a damaged record, or one cut short with more written after
                    inside = self._find_record(handle, offset + 1, end)
                    if inside is not None:
                        self._skipped(path, offset, inside, "a partial record with records written after it")
                        offset = inside
                        continue
                    self.damaged_layers += len(damaged)
                    log.warning("archive: %s: pair %d at byte %d: layer(s) %s damaged (failed their CRC); its other "
                                "layers are kept", path, entry.pair, offset, sorted(damaged))
                found[entry.pair] = (entry, keys, weights)
                previous, offset = entry, end
                if len(found) > _SCAN_BATCH:  # the last one stays: it may prove partial (a record found inside it)
                    self._index_found(found, len(found) - 1)
                continue
            # sealed segments' KV is not read at open, so the record before may be a partial one: look in it too
            since = previous.offset + 1 if previous is not None and not verify_kv else offset + 1
            inside = self._find_record(handle, since, size)
            if inside is None:
                if kind == "torn":
                    self.torn_bytes += size - offset
                    log.warning("archive: %s: %d bytes after the last complete record (a torn write) cut off", path,
                                size - offset)
                    handle.close()
                    os.truncate(path, offset)
                    return offset
                self._skipped(path, offset, size, "a damaged record at the end (left in place)")
                return size
            if inside < offset:  # the record before was partial: the one found starts inside it
                del found[previous.pair]
                self._skipped(path, previous.offset, inside, "a partial record with records written after it")
            else:
                self._skipped(path, offset, inside, "a damaged record")
            previous, offset = None, inside
        return size

    def _skipped(self, path: Path, start: int, end: int, why: str) -> None:
        self.bad_records += 1
        self.skipped_bytes += end - start
        log.warning("archive: %s: bytes %d-%d skipped: %s (damaged: failed its checksum); the scan goes on at "
                    "the next record that checks", path, start, end, why)

    def _find_record(self, handle, start: int, limit: int) -> int | None:
        """The first offset in [start, limit) where a record's head and meta check (leveldb's reader skips to
        the next block; records here are found by their magic, then proven by the meta's CRC)."""
        chunk = 1 << 20
        at = start
        while at < limit:
            handle.seek(at)
            data = handle.read(min(chunk, limit - at) + len(RECORD_MAGIC) - 1)
            if not data:
                return None
            hit = data.find(RECORD_MAGIC)
            while hit >= 0 and at + hit < limit:
                if self._record_head(handle, at + hit) is not None:
                    return at + hit
                hit = data.find(RECORD_MAGIC, hit + 1)
            at += chunk
        return None

    def _meta_len(self, sealed: bool) -> int:
        return self.shape.meta_bytes() + (_TAG if sealed else 0)

    def _layer_len(self, tokens: int, sealed: bool, segment: int | None = None) -> int:
        """A record's layer on disk (``segment``'s records dtype; None: this archive's own, or while scanning, the
        segment being scanned)."""
        shape = self._shape_of(segment) if segment is not None else self._shape_in(self._scan_dtype)
        return shape.layer_bytes(tokens) + (_TAG if sealed else 0)

    def _shape_in(self, dtype: str | None) -> KVShape:
        """This archive's shape with records of ``dtype`` (None: its own), made once a dtype (the scan asks for
        every record)."""
        if dtype is None or dtype == self.shape.dtype:
            return self.shape
        shape = self._shapes.get(dtype)
        if shape is None:
            shape = self._shapes[dtype] = replace(self.shape, dtype=dtype)
        return shape

    def _shape_of(self, segment: int) -> KVShape:
        """The shape of segment ``segment``'s records: this archive's, but for the dtype of a segment written with
        another ``archive.kv_dtype`` (or another model dtype) before it was changed — read as they are, until
        retention or a forget removes them, while new records are written in ``shape.dtype``."""
        return self._shape_in(self._dtypes.get(segment))

    def segments_by_dtype(self) -> dict[str, int]:
        """Segments held, by their records' dtype (more than one after ``archive.kv_dtype`` was changed)."""
        with self._lock:
            counts: dict[str, int] = {}
            for number in self._segments:
                dtype = self._dtypes.get(number, self.shape.dtype)
                counts[dtype] = counts.get(dtype, 0) + 1
            return counts

    def _nonce_index(self, seq: int, layer: int) -> int:
        """The AES-GCM chunk index of a sealed record's layer (``layer = layers``: its meta)."""
        return seq * (self.shape.layers + 1) + layer

    def _record_head(self, handle, offset: int) -> tuple[bytes, int, int] | None:
        """(meta, end, seq) of a record whose head and meta check at ``offset`` (in a sealed segment: the meta
        opens under the segment's key), wherever it ends; None otherwise."""
        sealer = self._scan_sealer
        handle.seek(offset)
        head = handle.read(_HEAD.size)
        if len(head) < _HEAD.size:
            return None
        magic, meta_len, kv_len, meta_crc, seq = _HEAD.unpack(head)
        if magic != RECORD_MAGIC or meta_len != self._meta_len(sealer is not None):
            return None
        meta = handle.read(meta_len)
        if len(meta) != meta_len or zlib.crc32(meta) != meta_crc:
            return None
        if sealer is not None:
            from edgekv.privacy import SealError

            try:
                meta = sealer.open(self._nonce_index(seq, self.shape.layers), meta, "archive record")
            except SealError:
                return None
        tokens = _META.unpack_from(meta)[7]
        if tokens <= 0 or kv_len != self.shape.layers * self._layer_len(tokens, sealer is not None):
            return None
        return meta, offset + _HEAD.size + meta_len + kv_len, seq

    def _parse_record(self, handle, number: int, offset: int, size: int, verify_kv: bool) -> tuple[str, tuple | None]:
        """("ok", (entry, keys, weights, end, damaged layers)), ("torn", None): the start of a record cut by the
        end of the file, or ("bad", None): bytes that are not a record that checks."""
        checked = self._record_head(handle, offset)
        if checked is None:
            handle.seek(offset)
            head = handle.read(_HEAD.size)
            if len(head) < _HEAD.size:
                return "torn", None
            magic, meta_len, kv_len, _, _ = _HEAD.unpack(head)
            wanted = self._meta_len(self._scan_sealer is not None)
            if magic == RECORD_MAGIC and meta_len == wanted and offset + _HEAD.size + meta_len > size:
                return "torn", None  # the meta itself was cut
            if magic == RECORD_MAGIC and meta_len == wanted and offset + _HEAD.size + meta_len + kv_len > size:
                return "torn", None
            return "bad", None
        meta, end, seq = checked
        if end > size:
            return "torn", None
        entry, keys, weights = self._unpack_meta(meta, number, offset, seq)
        damaged: set[int] = set()
        if verify_kv:
            sealer = self._scan_sealer
            layer_len = self._layer_len(entry.tokens, sealer is not None)  # the scanned segment's records dtype
            handle.seek(offset + _HEAD.size + self._meta_len(sealer is not None))
            for layer, crc in enumerate(entry.layer_crcs):
                data = handle.read(layer_len)
                if sealer is not None:
                    try:
                        data = sealer.open(self._nonce_index(seq, layer), data, "archive record")
                    except ValueError:
                        damaged.add(layer)
                        continue
                if zlib.crc32(data) != crc:
                    damaged.add(layer)
        return "ok", (entry, keys, weights, end, damaged)

    def _unpack_meta(self, meta: bytes, segment: int, offset: int, seq: int = 0) -> tuple[ArchivedPair, bytes, bytes]:
        """The entry and its index row's bytes as stored: fp16 keys, then fp16 weights (empty with one key a cell);
        ``_index_rows`` turns a segment's worth of them into tensors at once."""
        layers = self.shape.layers
        pair, frame, t, tpos, t_offset, rows, cols, tokens = _META.unpack_from(meta)
        frames = 1 if rows < 0 else 2  # the sign of rows marks a pair of one frame (see the module docstring)
        at = _META.size
        stream = bytes(meta[at:at + 16])
        stream = self._streams.setdefault(stream, stream)  # one bytes object a stream, not one a pair
        at += 16
        crcs = bytes(meta[at:at + 4 * layers])
        at += 4 * layers
        cells = layers * self.shape.kv_heads * self.shape.index_keys
        keys = bytes(meta[at:at + 2 * cells * self.shape.head_dim])
        at += len(keys)
        weights = bytes(meta[at:at + 2 * cells]) if self.shape.index_keys > 1 else b""
        entry = ArchivedPair(pair, frame, t, tpos, t_offset, abs(rows), cols, tokens, stream, segment, offset, crcs,
                             seq, frames)
        return entry, keys, weights

    def _index_rows(self, keys: list[bytes], weights: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Index rows as stored (``_unpack_meta``) -> fp16 keys [n, layers, kv_heads, index_keys, head_dim] and
        weights [n, layers, kv_heads, index_keys] (all 1 with one key a cell), in one copy for the batch."""
        cells = (len(keys), self.shape.layers, self.shape.kv_heads, self.shape.index_keys)
        out = torch.from_numpy(np.frombuffer(b"".join(keys), dtype="<f2").astype(np.float16)).view(*cells, -1)
        if self.shape.index_keys == 1:
            return out, torch.ones(cells, dtype=torch.float16)
        return out, torch.from_numpy(np.frombuffer(b"".join(weights), dtype="<f2").astype(np.float16)).view(cells)

    # ------------------------------------------------------------------ ingest side
    def submit(self, k: torch.Tensor, v: torch.Tensor, *, frame: int, t: float, tpos: int, t_offset: int,
               rows: int, cols: int, stream: bytes, frames: int = 2) -> bool:
        """Queue frame pair ``frame`` for writing under the next archive key (``next_pair``). When no staging
        buffer is free: with ``when_full = "drop"`` (a live camera: ingest never waits on the disk) False and
        ``dropped`` + 1; with ``"wait"`` (a replayed file or an evaluation, where ingest runs faster than
        real time and every pair should be archived) it waits for the writer to free one.

        k, v: [layers, kv_heads, P, head_dim] (views of the cache are fine: copied here, before returning).
        ``frames``: 1 for one frame prefilled as a pair of itself (it ends where it starts), else 2.
        """
        if self._closed:
            raise ArchiveError(f"{self.dir}: the archive is closed")
        tokens = k.shape[2]
        expected = (self.shape.layers, self.shape.kv_heads, tokens, self.shape.head_dim)
        if tuple(k.shape) != expected or tuple(v.shape) != expected:
            raise ValueError(f"archive: K/V must be [layers, kv_heads, P, head_dim] = {expected}, got "
                             f"{tuple(k.shape)} and {tuple(v.shape)}")
        if len(stream) != 16:
            raise ValueError(f"archive: stream id must be 16 bytes, got {len(stream)}")
        if frames not in (1, 2) or not 0 < rows < 2**15:  # rows' sign carries a one-frame pair (int16 on disk)
            raise ValueError(f"archive: frames must be 1 or 2 and rows 1 to {2**15 - 1}, got frames={frames!r}, "
                             f"rows={rows!r}")
        self._ensure_staging(tokens)
        try:
            staged = self._free.get_nowait()
        except queue.Empty:
            if self.when_full == "drop":
                with self._lock:
                    self.dropped += 1
                return False
            staged = self._wait_for_buffer()
        staged.kv[:, 0].copy_(k)
        staged.kv[:, 1].copy_(v)
        staged.frame, staged.t, staged.tpos, staged.t_offset = int(frame), float(t), int(tpos), int(t_offset)
        staged.rows, staged.cols, staged.tokens, staged.stream = int(rows), int(cols), tokens, stream
        staged.frames = int(frames)
        with self._lock:  # counted before it is queued: the writer can never see the queue empty with it pending
            staged.pair = self._next_key
            self._next_key += 1
            self._pending += 1
            self._idle.clear()
        self._work.put(staged)
        return True

    def _wait_for_buffer(self) -> "_Staged":
        started = time.perf_counter()
        try:
            while True:
                try:
                    return self._free.get(timeout=0.5)
                except queue.Empty:
                    if not self._writer.is_alive():
                        raise ArchiveError(f"{self.dir}: the archive writer stopped; no staging buffer will "
                                           f"come free") from None
        finally:
            self.wait_ms_total += (time.perf_counter() - started) * 1e3

    def _ensure_staging(self, tokens: int) -> None:
        if self._staging_tokens == tokens:
            return
        if self._staging_tokens is not None:
            raise ValueError(f"archive: a pair of {tokens} tokens after pairs of {self._staging_tokens}; the frame "
                             f"grid is fixed for a session")
        self._check_index_room(tokens)
        shape = (self.shape.layers, 2, self.shape.kv_heads, tokens, self.shape.head_dim)
        pin = torch.cuda.is_available()
        for _ in range(self.queue_pairs):
            self._free.put(_Staged(torch.empty(shape, dtype=self.stage_dtype, pin_memory=pin)))
        self._staging_tokens = tokens

    @property
    def index_entry_bytes(self) -> int:
        return self.shape.index_entry_bytes()

    def index_bound(self, tokens: int) -> tuple[int, int]:
        """The most pairs of ``tokens`` tokens the archive keeps — those ``max_bytes`` holds, fewer when the index's
        bound (``max_index_bytes``) holds fewer — and the RAM their index takes. The index lives in RAM whole."""
        pairs = self.max_bytes // self.shape.record_bytes(tokens)
        if self.max_index_pairs is not None:
            pairs = min(pairs, self.max_index_pairs)
        return pairs, pairs * self.index_entry_bytes

    def _index_text(self) -> str:
        return (f"archive.max_index_mib {self.max_index_bytes / 2**20:g}" if not self.index_auto else
                f"the index's bound, an eighth of this machine's RAM ({size_text(self.max_index_bytes)}; "
                f"archive.max_index_mib sets it)")

    def _check_index_room(self, tokens: int) -> None:
        """Say it (once, at the first pair) when the index's bound, not ``max_gib``, decides how far back the archive
        reaches: a large ``max_gib`` of small records (4-bit, a small grid) is many pairs, and the index holds every
        one of them in RAM (600,000 pairs at the 3B shape: 22 GB), which would take the memory the model and the
        cache need long after the start looked fine (an 8 GB board). And when the bound holds less than two
        segments' pairs: retention deletes whole segments, so the open one alone would be over it."""
        if self.max_index_pairs is None:
            return
        disk_pairs = self.max_bytes // self.shape.record_bytes(tokens)
        if disk_pairs <= self.max_index_pairs:
            return
        per_segment = max(1, self.segment_bytes // self.shape.record_bytes(tokens))
        log.warning("archive: archive.max_gib %s holds %s pairs of %d tokens, whose index would take %s of RAM; %s "
                    "keeps the newest %s (%s of the disk), the oldest segments going first%s",
                    f"{self.max_bytes / 2**30:g}", f"{disk_pairs:,}", tokens,
                    size_text(disk_pairs * self.index_entry_bytes), self._index_text(), f"{self.max_index_pairs:,}",
                    size_text(self.max_index_pairs * self.shape.record_bytes(tokens)),
                    "" if self.max_index_pairs >= 2 * per_segment else
                    f". It holds less than two segments ({per_segment:,} pairs each): raise archive.max_index_mib or "
                    f"lower archive.segment_mib")

    def _over_index(self, extra: int = 0) -> bool:
        return self.max_index_pairs is not None and len(self._entries) + extra > self.max_index_pairs

    def _trim_index(self) -> None:
        """At open: the oldest segments deleted while the index is past its bound (lowered since they were written)."""
        doomed = []
        with self._lock:
            for number in sorted(self._segments):
                if not self._over_index():
                    break
                doomed.append(f"seg-{number:08d}.ekva")
                self._delete_segment(number)
                self.segments_over_index += 1
        if doomed:
            log.warning("archive: %d segment(s) deleted at open (%s): the index held more than the %s pairs of %s",
                        len(doomed), ", ".join(doomed[:3]) + (", ..." if len(doomed) > 3 else ""),
                        f"{self.max_index_pairs:,}", self._index_text())

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every submitted pair is on disk (True) or ``timeout`` passes (False); the writer stops
        gathering a batch (``_LINGER_S``) and writes what is queued."""
        if self._idle.is_set():
            return True
        self._hurry.set()
        return self._idle.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued, fsync, stop the writer, let go of the folder (another archive may open it).
        Idempotent."""
        if self._closed:
            return
        self.flush(timeout)
        self._closed = True
        self._work.put(None)
        self._writer.join(timeout)
        if not self._writer.is_alive():  # a writer still stuck in a write keeps the folder to itself
            unlock_folder(self._lock_fd)
            self._lock_fd = None

    # ------------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        """Write queued pairs in batches: after the first pair the writer waits up to ``_LINGER_S`` for more
        (at most half the staging buffers, so ingest always finds free ones), then computes the batch's
        index rows in one pass and appends its records with one flush. Per pair it costs a few struct packs,
        a checksum per layer and file writes; the torch work is per batch (measured on the toy model, where
        ingest is ~5 ms per pair: ~0.5 ms of writer CPU per pair record by record, which the ingest thread
        felt through the GIL)."""
        largest = max(1, self.queue_pairs // 2)
        stop = False
        while not stop:
            first = self._work.get()
            if first is None:
                break
            batch = [first]
            deadline = time.monotonic() + _LINGER_S
            while len(batch) < largest:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                hurry = self._hurry.is_set()  # someone waits in flush(): write what is queued now
                try:
                    item = self._work.get_nowait() if hurry else self._work.get(timeout=min(remaining, 0.02))
                except queue.Empty:
                    if hurry:
                        break
                    continue
                if item is None:
                    stop = True
                    break
                batch.append(item)
            started = time.perf_counter()
            try:
                with self._write_lock:
                    self._append_batch(batch)
            finally:
                self.write_ms_total += (time.perf_counter() - started) * 1e3
                for staged in batch:
                    self._free.put(staged)
                with self._lock:  # idle only when every submitted pair is written or dropped (not when the queue
                    self._pending -= len(batch)  # merely looks empty: a submit may be between its count and put)
                    if self._pending == 0:
                        self._idle.set()
                        self._hurry.clear()
        with self._write_lock:
            self._close_segment()

    def _summaries(self, batch: list[_Staged]) -> tuple[torch.Tensor, torch.Tensor]:
        """Each pair's index row with its temporal rotation undone: fp16 keys [n, layers, kv_heads,
        index_keys, head_dim] and weights [n, layers, kv_heads, index_keys] (``summarize_keys``). All tokens
        of a pair share one temporal position, so undoing it on the summary is exact: the mean of rotated
        keys is the rotated mean, and a rotation keeps distances, so the clusters are the same."""
        keys = torch.stack([staged.kv[:, 0] for staged in batch]).float()  # [n, layers, kv_heads, P, D]
        centroids, weights = summarize_keys(keys, self.shape.index_keys)
        if self.inv_freq is not None and self.temporal_section > 0:
            back = torch.tensor([-staged.tpos for staged in batch]).view(-1, 1, 1, 1).expand(centroids.shape[:-1])
            centroids = rotate_temporal(centroids, back, self.inv_freq, self.temporal_section)
        return centroids.to(torch.float16), weights.to(torch.float16)

    def _append_batch(self, batch: list[_Staged]) -> None:
        """Append each pair's record (a failing one — disk full, folder removed — is lost and counted, the
        rest are written), fsync now and then, then index the written ones."""
        keys, weights = self._summaries(batch)
        written: list[tuple[ArchivedPair, int]] = []
        for i, staged in enumerate(batch):
            try:
                written.append((self._append(staged, keys[i], weights[i]), i))
            except Exception as exc:  # the stream goes on; this pair is lost
                with self._lock:
                    self.dropped += 1
                self._write_failed(f"pair {staged.pair} not written", exc)
            else:
                with self._lock:
                    self.written += 1
                self._write_succeeded()
        if self._fd is not None and time.monotonic() - self._last_fsync > _FSYNC_EVERY_S:
            try:
                self.files.fsync(self._fd)
            except OSError as exc:  # a sync that fails may have lost pages: start afresh in a new segment
                self._write_failed("fsync failed; the segment is sealed and a new one begun", exc)
                self._close_segment(sync=False)
            self._last_fsync = time.monotonic()
        kept = [(entry, i) for entry, i in written if entry.segment in self._segments]  # retention may have
        if kept:                                                     # deleted a segment later in the batch
            index = torch.tensor([i for _, i in kept])
            self._add_many([entry for entry, _ in kept], keys[index], weights[index])

    def _write_failed(self, what: str, exc: BaseException) -> None:
        """Count a failed write and say so: the first of a run of failures, then every 100th (a full disk
        fails every pair until space returns)."""
        self.write_errors += 1
        self.failing = True
        self.disk_full = isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
        self.last_error = f"{type(exc).__name__}: {exc}"
        self._failed_in_a_row += 1
        if self._failed_in_a_row == 1 or self._failed_in_a_row % 100 == 0:
            log.warning("archive: %s (%s); %d write error(s) in a row, %d pair(s) not archived so far", what,
                        self.last_error, self._failed_in_a_row, self.dropped)

    def _write_succeeded(self) -> None:
        if self._failed_in_a_row:
            log.warning("archive: writing again after %d failed write(s); %d pair(s) not archived so far",
                        self._failed_in_a_row, self.dropped)
        self._failed_in_a_row = 0
        self.failing = self.disk_full = False

    def _append(self, staged: _Staged, keys: torch.Tensor, weights: torch.Tensor) -> ArchivedPair:
        """Write one record at the end of the open segment. A write that fails part way (a full disk) is
        rolled back: the segment is truncated to its last complete record, so the next record follows a
        complete one (or, when even that fails, the segment is sealed and the next record begins a new one)."""
        flat = self._layer_blocks(staged.kv)  # the record's layer blocks
        crcs = np.array([zlib.crc32(chunk) for chunk in flat], dtype="<u4")
        meta = b"".join((
            _META.pack(staged.pair, staged.frame, staged.t, staged.tpos, staged.t_offset,
                       -staged.rows if staged.frames == 1 else staged.rows, staged.cols, staged.tokens),
            staged.stream, crcs.tobytes(), keys.numpy().astype("<f2").tobytes(),
            weights.numpy().astype("<f2").tobytes() if self.shape.index_keys > 1 else b"",
        ))
        sealed = self.keys is not None and self.keys.enabled
        kv_len = self.shape.layers * self._layer_len(staged.tokens, sealed)
        record_len = _HEAD.size + self._meta_len(sealed) + kv_len
        self._make_room(record_len, staged.t, staged.stream)
        offset = self._segments[self._current]
        sealer, seq = self._sealers.get(self._current), 0
        if sealer is not None:  # every nonce once: a record's number is never reused in its segment, even when
            seq, self._seq = self._seq, self._seq + 1  # a failed write is rolled back
            meta = sealer.seal(self._nonce_index(seq, self.shape.layers), meta)
            body = b"".join(sealer.seal(self._nonce_index(seq, layer), flat[layer].data)
                            for layer in range(self.shape.layers))
        else:
            body = flat.data
        head = _HEAD.pack(RECORD_MAGIC, len(meta), kv_len, zlib.crc32(meta), seq) + meta
        try:
            self._write_at(head, offset)
            self._write_at(body, offset + len(head))
        except BaseException:
            self._roll_back(offset)
            raise
        with self._lock:
            self._segments[self._current] = offset + record_len
            self._note_last(self._current, staged.stream, staged.t)
            self._wall_written[self._current] = time.time()
            self._seen_mono[self._current] = time.monotonic()
            last = self._last_record
            newest = last[1] if last is not None and last[0] == staged.stream else staged.t
            self._last_record = (staged.stream, max(newest, staged.t), self._seen_mono[self._current])
        return ArchivedPair(staged.pair, staged.frame, staged.t, staged.tpos, staged.t_offset, staged.rows,
                            staged.cols, staged.tokens, staged.stream, self._current, offset,
                            crcs.tobytes(), seq, staged.frames)

    def _layer_blocks(self, kv: torch.Tensor) -> np.ndarray:
        """A staged pair's K/V [layers, 2, kv_heads, P, head_dim] as the record's bytes, one row a layer: as they
        are, or 8-bit codes then bf16 scales (``KVShape.quantized``)."""
        layers = self.shape.layers
        if not self.shape.quantized:
            return kv.view(torch.uint8).numpy().reshape(layers, -1)
        if self.shape.dtype == "int4":
            from edgekv.archive.quant4 import quantize_layers

            return quantize_layers(kv).numpy()
        from edgekv.cache.quant import quantize

        codes, scales = quantize(kv, self.shape.torch_dtype)
        return torch.cat((codes.view(torch.uint8).reshape(layers, -1), scales.view(torch.uint8).reshape(layers, -1)),
                         dim=1).numpy()

    def _write_at(self, data, offset: int) -> None:
        """All of ``data`` at ``offset`` of the open segment (a short write is continued; a failure raises)."""
        self._write_to(self._fd, data, offset)

    def _roll_back(self, offset: int) -> None:
        """Cut what a failed write left after the last complete record."""
        try:
            self.files.truncate(self._fd, offset)
        except OSError as exc:
            log.warning("archive: a failed write could not be cut back (%s); the segment is sealed and the next "
                        "record begins a new one (the reader skips the partial record)", exc)
            self._close_segment(sync=False)

    def _make_room(self, record_len: int, t: float, stream: bytes = b"") -> None:
        """Open a segment if needed (a new one when the current would pass segment_bytes) and delete the
        oldest sealed segments while the folder would pass max_bytes or they are older than max_age_s."""
        if (self._current is None or self._segments[self._current] + record_len > self.segment_bytes
                or (self._current in self._sealers and self._nonce_index(self._seq + 1, 0) >= 1 << 32)):
            self._close_segment()
            self._open_segment()
        floor = self.keep_free_bytes
        free = self.files.free_bytes(self.dir) if floor else None  # None: no floor, or the disk cannot be asked
        with self._lock:
            sealed = sorted(n for n in self._segments if n != self._current)
            for number in sealed:
                too_big = sum(self._segments.values()) + record_len > self.max_bytes
                if not too_big and self._over_index(1):  # the index's bound in RAM: the oldest go, as past max_gib
                    too_big = True
                    self.segments_over_index += 1
                too_old = self.max_age_s is not None and self._too_old(number, t, stream)
                low = free is not None and free - record_len < floor
                if not (too_big or too_old or low):
                    if self.max_age_s is None:
                        break
                    continue  # a young earlier stream's segment may come before this stream's old ones
                size = self._segments.get(number, 0)
                if low and not (too_big or too_old):
                    self.segments_yielded += 1
                    log.warning("archive: the disk has %s free, below archive.keep_free_gib (%s): the oldest "
                                "segment, seg-%08d.ekva (%s), deleted to keep it", size_text(free),
                                size_text(floor), number, size_text(size))
                self._delete_segment(number)
                if free is not None:
                    free += size
        if sum(self._segments.values()) + record_len > self.max_bytes:
            raise OSError(f"a record of {record_len} bytes does not fit archive.max_gib beside the open segment")
        if free is not None and free - record_len < floor:
            raise OSError(errno.ENOSPC, f"the disk has {size_text(free)} free and archive.keep_free_gib keeps "
                                        f"{size_text(floor)} free (no older segment left to give up)")

    def _note_last(self, segment: int, stream: bytes, t: float) -> None:
        """A record of ``stream`` at stream time ``t`` written (or found) last in ``segment``, in write order."""
        last = self._segment_last.get(segment)
        newest = last[1] if last is not None and last[0] == stream else float("-inf")
        self._segment_last[segment] = (stream, max(newest, t))

    def _too_old(self, number: int, t: float, stream: bytes | None) -> bool:
        """Whether sealed segment ``number`` is past ``max_age_s`` as a record of ``stream`` at ``t`` is written.

        A segment whose last record is of this stream is aged in stream time, behind ``t``: it only goes forward
        and a clock jump moves it by ``video.max_gap_s`` at most (edgekv/session/clock.py). An earlier stream's (a
        restart without the saved memory, another stream's time on another scale) is aged by the wall clock since
        its file was last written, and at least by the monotonic time since this process opened or wrote it. A
        wall time the clock calls the future (set back) or before 2025 (not set: a board without an RTC battery)
        ages nothing: that segment goes at the latest ``max_age_s`` after this start, and it is said once. A
        deletion by the wall clock is said with both times, so a clock stepped forward does not empty the archive
        unsaid."""
        last = self._segment_last.get(number)
        if last is not None and last[0] == stream:
            return last[1] < t - self.max_age_s
        at_least = time.monotonic() - self._seen_mono.get(number, self._opened_mono)
        if at_least > self.max_age_s:
            return True
        written, now = self._wall_written.get(number), time.time()
        if written is None:
            return False
        if not _WALL_FLOOR <= written <= now + _WALL_SLACK_S:
            if not self._clock_said:
                self._clock_said = True
                log.warning("archive.max_age_s: %s, of an earlier stream, was last written at %s by the wall clock, "
                            "which reads %s now (%s): its age is counted from this start instead, so it goes at the "
                            "latest archive.max_age_s (%g s) after it (said once for every such segment)",
                            self._segment_path(number).name, _wall_text(written), _wall_text(now),
                            "set back since" if written > now else "not set then", self.max_age_s)
            return False
        if now - written <= self.max_age_s:
            return False
        log.warning("archive.max_age_s: %s, of an earlier stream, last written %s, is %s old by the wall clock "
                    "(now %s), past archive.max_age_s %g s: deleted", self._segment_path(number).name,
                    _wall_text(written), _duration_text(now - written), _wall_text(now), self.max_age_s)
        return True

    def expire(self) -> int:
        """``max_age_s`` applied now, with no record being written: the segments a paused camera (the privacy switch,
        for hours), one gone dark or a stream that has ended kept past it are deleted, which retention before each
        record never reached — the open segment too, sealed first, once its newest record is past it. The stream last
        written is aged in its stream time, taken to have gone on since its last record by the monotonic clock (a
        live stream's time after a pause is the pause's length later; a paused recording, which resumes on its own
        clock, has its pause counted too: its segments go sooner, never later); before this process wrote any, every
        segment is aged as an earlier stream's (``_too_old``: the wall clock, with its guards, and the monotonic time
        since the open). For the daemon to call every minute or so; returns how many segments went."""
        if self.max_age_s is None or self._closed:
            return 0
        deleted, failed = 0, []
        with self._write_lock:  # never beside the writer's batch or a forget's rewrite
            with self._lock:
                last = self._last_record
                stream, now_t = (None, 0.0) if last is None else (last[0], last[1] + time.monotonic() - last[2])
                for number in sorted(self._segments):
                    if not self._too_old(number, now_t, stream):
                        continue
                    if number == self._current:
                        self._close_segment()  # the next record begins a new one
                    try:
                        self._delete_segment(number)
                    except OSError as exc:  # kept and indexed: the next call tries again; raised, it ended the
                        failed.append((number, exc))  # daemon's main loop (a minute's turn, nothing written)
                        continue
                    deleted += 1
            self._expire_failed(failed)
            if deleted:
                fsync_dir(self.dir)
                log.info("archive: archive.max_age_s: %d segment(s) past it deleted with nothing being written",
                         deleted)
        return deleted

    def _expire_failed(self, failed: list[tuple[int, OSError]]) -> None:
        """Say the segments ``expire`` could not delete: once a run of failures with the same error (it is tried
        again every minute), and again once it clears."""
        said = f"{failed[0][1].strerror or failed[0][1]}" if failed else None
        if said is not None and said != self._expire_error:
            names = ", ".join(self._segment_path(number).name for number, _exc in failed)
            log.warning("archive: archive.max_age_s: %d segment(s) past it could not be deleted (%s): %s; kept, "
                        "tried again at the next expire", len(failed), said, names)
        elif said is None and self._expire_error is not None:
            log.warning("archive: archive.max_age_s: segments past it deleted again (was: %s)", self._expire_error)
        self._expire_error = said
        if failed:
            self.last_error = f"archive.max_age_s: {type(failed[0][1]).__name__}: {failed[0][1]}"

    def _forget(self, pair: int) -> None:
        """Drop ``pair`` from the index (its row is reused)."""
        with self._lock:
            del self._entries[pair]
            row = self._row_of.pop(pair)
            self._norms[row] = 0.0
            self._weights[row] = 0.0
            self._free_rows.append(row)

    def _delete_segment(self, number: int) -> None:
        """Segment ``number``'s file removed, then its pairs from the index. A file that cannot be removed (a disk
        remounted read-only after an I/O error, EIO) raises and stays indexed: dropped from the index first, its
        file stayed on the disk unknown to retention, past max_age_s and max_gib, until the next start."""
        with self._lock:
            self._segment_path(number).unlink(missing_ok=True)
            for pair in [p for p, e in self._entries.items() if e.segment == number]:
                self._forget(pair)
            self._segments.pop(number, None)
            self._segment_last.pop(number, None)
            self._wall_written.pop(number, None)
            self._seen_mono.pop(number, None)
            self._sealers.pop(number, None)
            self._dtypes.pop(number, None)
            self.segments_deleted += 1

    # ------------------------------------------------------------------ forget (issue 31)
    def forget(self, t_from: float, t_to: float, stream: bytes | None = None,
               progress: Callable[[], None] | None = None, frame_s: float | None = None) -> dict:
        """Remove every archived pair stamped in ``[t_from, t_to]`` (of ``stream``, or of every stream) — with
        ``frame_s`` (a frame interval), every pair with a frame in it: stamped at most ``t_to``, its last frame
        (``ArchivedPair.t_last``) at least ``t_from``, as ``StreamSession.pairs_in`` picks the cache's — from the
        files, not only from the index: each segment holding one is rewritten without it — the records kept are
        copied byte for byte (a sealed record keeps its nonce and its bytes) into ``seg-N.ekva.tmp``, which is
        fsynced and renamed over the segment — and a segment left with no record is deleted. Queued pairs are
        written first; when the open segment holds one of the window it is sealed, so the writer's next record begins
        a new segment (a forget of nothing archived, or of older segments only, leaves it open: a storm of forgets
        left a trail of small segments).
        A crash part way leaves each segment either whole as it was or rewritten (a leftover ``.tmp`` is
        removed at the next open). What it does not do: erase the flash blocks the old file used (the FTL
        reuses them later); with ``privacy:`` keys set those blocks are ciphertext. Returns what was removed.
        ``progress``: called as each rewrite reaches the disk, ``_PACE_BYTES`` at a time, and after each segment (the
        daemon's watchdog heartbeat: a 256 MiB segment copied on an SD card outlasts ``WatchdogSec / 2``)."""
        self.flush()
        removed_pairs, rewritten, deleted, freed = 0, 0, 0, 0
        with self._write_lock:
            with self._lock:
                # t_last(frame_s) >= t_from, written as the daemon's forget wrote it for a pair of two (the same
                # float at a window's edge: from a frame interval before the window)
                doomed = sorted((e for e in self._entries.values() if e.t <= t_to
                                 and e.t >= (t_from if frame_s is None or e.frames == 1 else t_from - frame_s)
                                 and (stream is None or e.stream == stream)), key=lambda e: (e.segment, e.offset))
            if any(entry.segment == self._current for entry in doomed):
                self._close_segment()  # the open one is rewritten: a window in it alone ends it (not every forget)
            by_segment: dict[int, set[int]] = {}
            for entry in doomed:
                by_segment.setdefault(entry.segment, set()).add(entry.pair)
            for number, pairs in by_segment.items():
                before = self._segments.get(number, 0)
                try:
                    kept = self._rewrite_segment(number, pairs, progress)
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    # no room to write the segment anew (its .tmp is gone again): it goes whole, its other pairs
                    # with it — the archive is recall's, and a forget must never leave the window on the disk
                    with self._lock:
                        others = sum(1 for e in self._entries.values() if e.segment == number) - len(pairs)
                    self._delete_segment(number)
                    self.segments_deleted -= 1  # not retention
                    self.lost_to_forget += others
                    log.warning("archive: no room to rewrite %s without the forgotten pair(s) (%s): deleted whole, "
                                "%d other pair(s) with it", self._segment_path(number).name, exc.strerror, others)
                    kept = False
                if kept:
                    rewritten += 1
                    freed += before - self._segments[number]
                else:
                    deleted += 1
                    freed += before
                removed_pairs += len(pairs)
                if progress is not None:
                    progress()
            if by_segment:
                fsync_dir(self.dir)
        self.forgotten += removed_pairs
        if self.newer:  # their records cannot be read here, so neither found nor removed
            log.warning("archive: forget %g..%g s did not search %s", t_from, t_to, self.newer_text())
        if removed_pairs:
            log.info("archive: forgot %d pair(s) stamped %g..%g s (%d segment(s) rewritten, %d deleted, %d bytes "
                     "freed)", removed_pairs, t_from, t_to, rewritten, deleted, freed)
        return {"pairs": removed_pairs, "segments_rewritten": rewritten, "segments_deleted": deleted,
                "bytes": freed}

    def _rewrite_segment(self, number: int, drop: set[int], progress: Callable[[], None] | None = None) -> bool:
        """Segment ``number`` without the records of ``drop`` (False: none was left, the segment is deleted)."""
        with self._lock:
            keep = sorted((e for e in self._entries.values() if e.segment == number and e.pair not in drop),
                          key=lambda e: e.offset)
        if not keep:
            self._delete_segment(number)
            self.segments_deleted -= 1  # not retention
            return False
        path, sealed = self._segment_path(number), number in self._sealers

        def record(source, entry: ArchivedPair, index: int) -> tuple[bytes, int]:  # byte for byte, nonces kept
            length = _HEAD.size + self._meta_len(sealed) + self.shape.layers * self._layer_len(entry.tokens, sealed,
                                                                                                 number)
            source.seek(entry.offset)
            data = source.read(length)
            if len(data) != length:
                raise ArchiveError(f"{path}: pair {entry.pair} at byte {entry.offset} is cut short")
            return data, entry.seq

        def forget_dropped() -> None:
            for pair in drop:
                self._forget(pair)

        self._replace_segment(number, keep, lambda source: self._segment_header(source, keep[0].offset), record,
                              forget_dropped, progress)
        return True

    def _replace_segment(self, number: int, keep: list[ArchivedPair], header, record, after=None,
                         progress: Callable[[], None] | None = None) -> int:
        """Segment ``number`` written anew into ``seg-N.ekva.tmp`` — ``header(source)``, then for each of ``keep``
        (in order) the bytes and record number ``record(source, entry, index)`` gives — fsynced and renamed over
        it (a crash leaves it whole as it was or rewritten; a leftover ``.tmp`` is removed at the next open). The
        index follows the records; ``after()`` runs with the rename, under the lock readers hold. With ``progress``
        the copy reaches the disk ``_PACE_BYTES`` at a time, ``progress()`` after each step. Returns the new size."""
        path = self._segment_path(number)
        tmp = path.with_name(path.name + ".tmp")
        moved: list[ArchivedPair] = []
        with open(path, "rb") as source:
            fd = self.files.create(tmp)
            try:
                data = header(source)
                self._write_to(fd, data, 0)
                at = synced = len(data)
                for index, entry in enumerate(keep):
                    data, seq = record(source, entry, index)
                    self._write_to(fd, data, at)
                    moved.append(ArchivedPair(**{**asdict(entry), "offset": at, "seq": seq}))
                    at += len(data)
                    if progress is not None and at - synced >= _PACE_BYTES:
                        self.files.fsync(fd)
                        synced = at
                        progress()
                written = os.fstat(source.fileno())  # a rewrite is not a new record: max_age_s still ages it
                os.utime(tmp, ns=(written.st_atime_ns, written.st_mtime_ns))
                self.files.fsync(fd)
            except BaseException:
                self.files.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            self.files.close(fd)
        with self._lock:  # readers hold this lock while they read a segment
            os.replace(tmp, path)
            if after is not None:
                after()
            for entry in moved:
                self._entries[entry.pair] = entry
            self._segments[number] = at
        return at

    # ------------------------------------------------------------------ rekey
    def reseal(self, dry_run: bool = False) -> dict:
        """Rewrite every segment not sealed with the key ring's current key — in the clear, or under an older key
        of ``previous_key_files`` — sealed with it (``edgekv rekey``): after a key leaks, or when a key is first
        set, the archive no longer needs the old key (nor holds frames in the clear) once this returns, instead of
        once retention has deleted the old segments. Each segment is rewritten as ``forget`` rewrites one (a
        ``.tmp`` copy, fsync, rename; a crash leaves it whole as it was or rewritten) with a new random salt, its
        records renumbered from 0 so every nonce is used once. A layer that does not open (damaged) is carried
        as the bytes that were there, so its checksum still fails and it is never handed out; records the scan
        skipped as damaged are not carried. Queued pairs are written first and the open segment is sealed.
        ``dry_run``: count what would be rewritten, write nothing."""
        if self.keys is None or self.keys.current is None:
            raise ValueError("archive: no current key to seal with (privacy.key_file, key_env or key_credential)")
        self.flush()
        resealed, current, written = 0, 0, 0
        with self._write_lock:
            self._close_segment()
            for number in sorted(self._segments):
                sealer = self._sealers.get(number)
                if sealer is not None and sealer.key.id == self.keys.current.id:
                    current += 1
                    continue
                written += 0 if dry_run else self._reseal_segment(number)
                resealed += 1
            if resealed and not dry_run:
                fsync_dir(self.dir)
        if self.newer:
            log.warning("archive: not resealed: %s", self.newer_text())
        return {"segments_resealed": resealed, "segments_current": current, "bytes": written}

    def _reseal_segment(self, number: int) -> int:
        """Segment ``number`` rewritten under the current key (see ``reseal``); returns its new size."""
        from edgekv.privacy import Sealer

        path = self._segment_path(number)
        old, new = self._sealers.get(number), Sealer(self.keys.current)
        layers = self.shape.layers
        with self._lock:
            keep = sorted((e for e in self._entries.values() if e.segment == number), key=lambda e: e.offset)

        def record(source, entry: ArchivedPair, seq: int) -> tuple[bytes, int]:  # renumbered: new salt, new nonces
            source.seek(entry.offset + _HEAD.size)
            meta = source.read(self._meta_len(old is not None))
            parts = [source.read(self._layer_len(entry.tokens, old is not None, number)) for _ in range(layers)]
            if len(meta) != self._meta_len(old is not None) or any(
                    len(part) != self._layer_len(entry.tokens, old is not None, number) for part in parts):
                raise ArchiveError(f"{path}: pair {entry.pair} at byte {entry.offset} is cut short")
            if old is not None:
                meta = old.open(self._nonce_index(entry.seq, layers), meta, str(path))
                parts = [self._open_or_carry(old, entry.seq, layer, part) for layer, part in enumerate(parts)]
            meta = new.seal(self._nonce_index(seq, layers), meta)
            body = b"".join(new.seal(self._nonce_index(seq, layer), part) for layer, part in enumerate(parts))
            return _HEAD.pack(RECORD_MAGIC, len(meta), len(body), zlib.crc32(meta), seq) + meta + body, seq

        def sealed_with_new() -> None:
            self._sealers[number] = new

        return self._replace_segment(number, keep, lambda source: self._header_bytes(new, self._shape_of(number)),
                                     record, sealed_with_new)

    def _open_or_carry(self, sealer, seq: int, layer: int, sealed: bytes) -> bytes:
        """A sealed layer's plaintext; one that does not authenticate is carried as its bytes less the tag (its
        CRC in the record's meta will not match them, so it stays a damaged layer)."""
        from edgekv.privacy import SealError

        try:
            return sealer.open(self._nonce_index(seq, layer), sealed, "archive record")
        except SealError:
            return sealed[:-_TAG]

    def _segment_header(self, handle, first_record: int) -> bytes:
        """The segment's header bytes as written (a damaged header: this archive's own, unsealed)."""
        handle.seek(0)
        data = handle.read(first_record)
        if data.startswith(SEGMENT_MAGIC):
            size, crc = _SEGMENT_HEAD.unpack_from(data, len(SEGMENT_MAGIC))
            end = len(SEGMENT_MAGIC) + _SEGMENT_HEAD.size + size
            if end <= len(data) and zlib.crc32(data[len(SEGMENT_MAGIC) + _SEGMENT_HEAD.size:end]) == crc:
                return data[:end]
        return self._header_bytes()

    def _write_to(self, fd: int, data, offset: int) -> None:
        """All of ``data`` at ``offset`` of ``fd`` (a short write is continued; a failure raises)."""
        view = memoryview(data).cast("B")
        while len(view):
            done = self.files.pwrite(fd, view, offset)
            if done <= 0:
                raise OSError(errno.EIO, f"write returned {done}")
            view, offset = view[done:], offset + done

    def _open_segment(self) -> None:
        numbers = self._segment_numbers()
        number = max([*numbers, *self._segments, 0]) + 1
        path = self._segment_path(number)
        sealer = None
        if self.keys is not None and self.keys.enabled:
            from edgekv.privacy import Sealer

            sealer = Sealer(self.keys.current)  # a new random salt: the segment's nonces are its own
        self._fd = self.files.create(path)
        header = self._header_bytes(sealer)
        try:
            self._write_at(header, 0)
        except BaseException:  # a disk too full for a header: nothing in this segment, so no segment
            self.files.close(self._fd)
            self._fd = None
            path.unlink(missing_ok=True)
            raise
        with self._lock:
            self._segments[number] = len(header)
            if sealer is not None:
                self._sealers[number] = sealer
        self._current, self._seq = number, 0
        fsync_dir(self.dir)

    def _close_segment(self, sync: bool = True) -> None:
        """Seal the open segment (fsync, close); the next record begins a new one. Never raises: a failing
        fsync is counted (the records stay indexed; a reader checks each on its own)."""
        fd, self._fd, self._current = self._fd, None, None
        if fd is None:
            return
        try:
            if sync:
                self.files.fsync(fd)
        except OSError as exc:
            self._write_failed("fsync at the end of a segment failed", exc)
        finally:
            try:
                self.files.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------------ retrieval side
    def read_into(self, entry: ArchivedPair, targets: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> set[int]:
        """Read layers of one archived pair straight into ``targets``: layer -> (k, v) destinations, each
        [kv_heads, P, head_dim] of the archive's dtype whose rows per head are contiguous (slices of a
        cache). Returns the layers read and verified; a layer failing its checksum is left out (counted in
        ``bad_records``), all are when the record is gone (retention deleted its segment)."""
        good: set[int] = set()
        with self._lock:  # retention cannot delete the segment while it is read
            if entry.segment not in self._segments:
                return good
            shape = self._shape_of(entry.segment)
            layer_bytes = shape.layer_bytes(entry.tokens)
            sealer = self._sealers.get(entry.segment)
            layer_len = self._layer_len(entry.tokens, sealer is not None, entry.segment)
            base = entry.offset + _HEAD.size + self._meta_len(sealer is not None)
            try:
                fd = os.open(self._segment_path(entry.segment), os.O_RDONLY)
            except OSError:
                return good
            try:
                for layer, (k, v) in targets.items():
                    if shape.quantized:  # codes and scales into a buffer of their own, dequantized into k, v
                        host = [torch.empty(layer_bytes, dtype=torch.uint8)]
                        views = [_bytes_of(host[0])]
                    else:  # straight into the targets where they are host memory of the records' dtype
                        host = [t if t.device.type == "cpu" and t.dtype == shape.torch_dtype
                                else torch.empty(t.shape, dtype=shape.torch_dtype) for t in (k, v)]
                        views = [_bytes_of(t[head]) for t in host for head in range(t.shape[0])]
                    if sealer is not None:
                        if not self._read_sealed(fd, sealer, entry, layer, base + layer * layer_len, views):
                            continue
                    elif os.preadv(fd, views, base + layer * layer_bytes) != layer_bytes:
                        continue
                    crc = 0
                    for view in views:
                        crc = zlib.crc32(view, crc)
                    if crc != struct.unpack_from("<I", entry.crcs, 4 * layer)[0]:
                        self.bad_records += 1
                        continue
                    if shape.quantized:
                        self._dequantize_into(host[0], entry.tokens, k, v, shape)
                    else:
                        for target, read in zip((k, v), host):
                            if read is not target:
                                target.copy_(read)
                    good.add(layer)
            finally:
                os.close(fd)
        return good

    def _dequantize_into(self, block: torch.Tensor, tokens: int, k: torch.Tensor, v: torch.Tensor,
                         shape: KVShape) -> None:
        """A quantized record's layer (codes, then scales) dequantized into ``k``, ``v`` [kv_heads, P, head_dim]."""
        if shape.dtype == "int4":
            from edgekv.archive.quant4 import dequantize_into

            dequantize_into(block, tokens, k, v)
            return
        from edgekv.cache.quant import dequantize

        heads, dim = shape.kv_heads, shape.head_dim
        codes = block[:2 * heads * tokens * dim].view(shape.torch_dtype).view(2, heads, tokens, dim)
        scales = block[2 * heads * tokens * dim:].view(torch.bfloat16).view(2, heads, tokens)
        for index, target in enumerate((k, v)):
            target.copy_(dequantize(codes[index], scales[index], target.dtype))

    def _read_sealed(self, fd: int, sealer, entry: ArchivedPair, layer: int, at: int, views: list) -> bool:
        """One sealed layer opened into ``views`` (False when short or when it does not authenticate)."""
        length = self._layer_len(entry.tokens, True, entry.segment)
        data = os.pread(fd, length, at)
        if len(data) != length:
            return False
        try:
            plain = memoryview(sealer.open(self._nonce_index(entry.seq, layer), data, "archive record"))
        except ValueError:
            self.bad_records += 1
            return False
        for view in views:
            view[:] = plain[:len(view)]
            plain = plain[len(view):]
        return True

    def read_layers(self, entry: ArchivedPair, layers: list[int]) -> dict[int, torch.Tensor]:
        """K and V of some layers of one pair: layer -> [2, kv_heads, P, head_dim] (new tensors)."""
        shape = (2, self.shape.kv_heads, entry.tokens, self.shape.head_dim)
        out = {layer: torch.empty(shape, dtype=self.stage_dtype) for layer in layers}
        good = self.read_into(entry, {layer: (t[0], t[1]) for layer, t in out.items()})
        return {layer: t for layer, t in out.items() if layer in good}

    def read_layer(self, entry: ArchivedPair, layer: int) -> torch.Tensor | None:
        """One layer of one pair (``read_layers``), None when it cannot be read."""
        return self.read_layers(entry, [layer]).get(layer)

    def stats(self) -> dict:
        return {"archive_pairs": self.pairs, "archive_bytes": self.bytes_on_disk, "archive_dropped": self.dropped,
                "archive_written": self.written, "archive_pending": self._pending,
                "archive_write_errors": self.write_errors,
                "archive_torn_bytes": self.torn_bytes, "archive_bad_records": self.bad_records,
                "archive_skipped_bytes": self.skipped_bytes, "archive_damaged_layers": self.damaged_layers,
                "archive_disk_full": int(self.disk_full), "archive_failing": int(self.failing),
                "archive_last_error": self.last_error,
                "archive_segments": len(self._segments), "archive_segments_deleted": self.segments_deleted,
                "archive_segments_yielded": self.segments_yielded,
                "archive_write_ms_total": round(self.write_ms_total, 3), "archive_forgotten": self.forgotten,
                "archive_lost_to_forget": self.lost_to_forget,
                "archive_sealed_segments": len(self._sealers), "archive_index_bytes": self.index_bytes,
                "archive_newer_segments": len(self.newer), "archive_segments_over_index": self.segments_over_index,
                "archive_wait_ms_total": round(self.wait_ms_total, 3)}


def _bytes_of(rows: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor (bf16 included: numpy sees its bytes)."""
    if not rows.is_contiguous():
        raise ValueError("archive: read targets must be contiguous per KV head")
    return memoryview(rows.view(torch.uint8).numpy()).cast("B")


def _weighted_mean(keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """fp32 [..., layers, kv_heads * head_dim] from keys [..., layers, kv_heads, m, head_dim] and weights
    [..., layers, kv_heads, m]: each pair's mean key."""
    mean = (keys.float() * weights.float().unsqueeze(-1)).sum(dim=-2)
    return mean.flatten(start_dim=-2)


def summarize_keys(keys: torch.Tensor, m: int, iters: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """A pair's keys in ``m`` representative keys per (pair, layer, head): keys [..., P, D] (fp32) ->
    centroids [..., m, D] and weights [..., m], the share of the P tokens each one stands for.

    ``m == 1``: the mean key, ReKV's representative vector (seed 001, §3). ``m > 1``: k-means (Lloyd,
    ``iters`` rounds) seeded deterministically with the mean and then, one at a time, the key farthest from
    the seeds so far — so an object that covers a few of a frame's patches gets a key of its own instead
    of being averaged into the background. A cluster left empty keeps its seed with weight 0. With the toy,
    2, 4 and 8 rounds recalled the same pairs (the tenth session's note on issue 11); each round costs ~5-10
    ms per pair at the 3B shape (36 layers x 2 heads x 256 tokens x 128) on one core of the dev VM.
    """
    *lead, tokens, dim = keys.shape
    x = keys.reshape(-1, tokens, dim)
    mean = x.mean(dim=1, keepdim=True)
    if m == 1:
        return mean.view(*lead, 1, dim), torch.ones(*lead, 1, dtype=keys.dtype)
    rows = torch.arange(x.shape[0])
    norms = torch.einsum("bpd,bpd->bp", x, x)  # |x|^2, so |x - c|^2 = |x|^2 - 2 x.c + |c|^2 takes one matmul

    def distance(c: torch.Tensor) -> torch.Tensor:  # [B, P] squared distance of every key to c [B, D]
        return torch.baddbmm(norms.unsqueeze(-1), x, c.unsqueeze(-1), alpha=-2.0)[..., 0] + c.pow(2).sum(-1, keepdim=True)

    seeds = [mean[:, 0]]
    nearest = distance(mean[:, 0])  # [B, P] squared distance to the closest seed
    for _ in range(m - 1):
        far = x[rows, nearest.argmax(dim=1)]
        seeds.append(far)
        nearest = torch.minimum(nearest, distance(far))
    centroids = torch.stack(seeds, dim=1)  # [B, m, D]

    def assign(centroids: torch.Tensor) -> torch.Tensor:  # [B, P, m] one-hot of the nearest centroid
        # argmin |x - c|^2 = argmax (2 x.c - |c|^2): one batched matmul, no [B, P, m, D] difference tensor
        score = torch.baddbmm(centroids.pow(2).sum(-1).neg().unsqueeze(1), x, centroids.transpose(1, 2), alpha=2.0)
        return torch.nn.functional.one_hot(score.argmax(dim=-1), m).to(x.dtype)

    for _ in range(iters):
        onehot = assign(centroids)
        counts = onehot.sum(dim=1)  # [B, m]
        sums = torch.bmm(onehot.transpose(1, 2), x)  # [B, m, D]
        centroids = torch.where(counts.unsqueeze(-1) > 0, sums / counts.clamp_min(1).unsqueeze(-1), centroids)
    weights = assign(centroids).mean(dim=1)
    return centroids.view(*lead, m, dim), weights.view(*lead, m)


def _segment_fields(handle) -> tuple[dict, int] | None:
    """A segment header's JSON fields (``index_keys`` 1 for the first format) and where its records start, read
    from the start of ``handle``; None when the header does not check (magic, length, CRC)."""
    head = handle.read(len(SEGMENT_MAGIC) + _SEGMENT_HEAD.size)
    if len(head) < len(SEGMENT_MAGIC) + _SEGMENT_HEAD.size or not head.startswith(SEGMENT_MAGIC):
        return None
    size, crc = _SEGMENT_HEAD.unpack(head[len(SEGMENT_MAGIC):])
    key = handle.read(size)
    if len(key) != size or zlib.crc32(key) != crc:
        return None
    saved = json.loads(key)
    saved.setdefault("index_keys", 1)  # segments of the first format: one mean key per pair
    return saved, len(head) + size


def segment_format(path: Path) -> int | None:
    """The format number in a segment's magic (``ARCHIVE_FORMAT`` for this edgekv's own; more: a newer edgekv wrote
    it), None when the file does not start with an archive's magic (a damaged header, or a file cut short)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(len(SEGMENT_MAGIC))
    except OSError:
        return None
    if len(head) < len(SEGMENT_MAGIC) or not head.startswith(_MAGIC_NAME):
        return None
    return _MAGIC_FORMAT.unpack_from(head, len(_MAGIC_NAME))[0]


def newer_segments(folder: str | Path) -> dict[Path, int]:
    """The segments under ``folder`` a newer edgekv wrote, with their format (``--check`` and ``edgekv rekey`` name
    them; the archive leaves them as they are)."""
    folder = Path(folder).expanduser()
    paths = sorted(folder.glob("seg-*.ekva")) if folder.is_dir() else []
    return {path: found for path in paths if (found := segment_format(path)) is not None and found > ARCHIVE_FORMAT}


def newer_segments_text(folder: str | Path, found: dict[Path, tuple[int, int]] | None = None) -> str:
    """What the segments under ``folder`` a newer edgekv wrote are and what this edgekv does with them, said the same
    by the archive at open, ``edgekv-camera --check`` and ``edgekv rekey``; ``found``: path -> (format, bytes),
    default read from the folder. Empty when there are none."""
    folder = Path(folder).expanduser()
    if found is None:
        found = {}
        for path, number in newer_segments(folder).items():
            with contextlib.suppress(OSError):  # removed since: not there to speak of
                found[path] = (number, path.stat().st_size)
    if not found:
        return ""
    names = [path.name for path in sorted(found)]
    formats = sorted({number for number, _ in found.values()})
    return (f"{len(names)} segment(s) of {folder} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}; "
            f"{size_text(sum(size for _, size in found.values()))}) written by a newer edgekv (format "
            f"{', '.join(map(str, formats))}, this one reads up to {ARCHIVE_FORMAT}): not recalled, forgotten in "
            f"nor counted in archive.max_gib, and never deleted; upgrade edgekv to read them again, or remove "
            f"them to free the space")


def archived_shape(folder: str | Path) -> KVShape | None:
    """The KV shape the archive under ``folder`` was written for, read from the first segment whose header checks
    (``edgekv rekey`` opens an archive without loading the model); None when no segment's header does."""
    return next((shape for _, shape in _segment_shapes(folder)), None)  # the first header read, no more


def archived_shapes(folder: str | Path) -> dict[Path, KVShape]:
    """Each segment's KV shape under ``folder`` (those whose header checks), oldest first: an edgekv from before
    ``index_keys`` rolled back to appends its own segments to today's archive, so the first does not speak for all
    (``--check`` passed such an archive, then the start refused it at a later segment)."""
    return dict(_segment_shapes(folder))


def _segment_shapes(folder: str | Path):
    folder = Path(folder).expanduser()
    for path in sorted(folder.glob("seg-*.ekva")) if folder.is_dir() else []:
        with open(path, "rb") as handle:
            found = _segment_fields(handle)
        if found is not None:
            saved = found[0]
            yield path, KVShape(int(saved["layers"]), int(saved["kv_heads"]), int(saved["head_dim"]),
                                str(saved["dtype"]), int(saved["index_keys"]))


def new_stream_id() -> bytes:
    return uuid.uuid4().bytes


LOCK_NAME = "archive.lock"


def _lock_folder(folder: Path) -> int | None:
    """One open archive a folder (edgekv/folder_lock.py): two archives appending to one folder each wrote their
    next records at the same segment offsets as the other, and an opener's scan cut the other's record being
    written as a torn tail — records lost without an error."""
    return lock_folder(folder, LOCK_NAME, "archive.dir", "open archive",
                       "close the other session's archive first, session.close()", ArchiveError)


def _close_at_exit(ref: "weakref.ref[FrameArchive]") -> None:
    archive = ref()
    if archive is not None:
        archive.close(timeout=10.0)
