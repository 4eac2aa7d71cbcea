"""Snapshots of a StreamSession: the memory of a stream survives a restart (DESIGN invariant 8).

``session.save(path)`` writes everything the session's future depends on; ``Runtime.restore(path)``
returns a session that continues bit for bit as if it had never stopped: the capped cache (K, V and
every slot's metadata up to its length), the StateKV sink flags and attention mass, positions
(``next_position``, ``t_offset``, re-bases, the video start, the grid), counters, the policy's state
(VaN's CV sums and pool sizes), and the stream clock (first and last timestamp, a frame waiting for
its partner).

One file per snapshot, written in one pass with one layer in memory at a time:

    [16 B magic] [tensor sections, 64-byte aligned] [manifest, JSON] [trailer]
    trailer = u64 manifest offset, u64 manifest length, 32 B sha256 of the manifest, 16 B end magic

The manifest holds the deployment key, the session's scalar state and, per tensor, dtype, shape,
offset, bytes and sha256. It comes last because the checksums are known only once the data is written;
a reader starts from the trailer, so a truncated file is recognised before anything is parsed, and a
flipped byte anywhere is caught by a checksum. Writing is atomic: a temporary file in the same folder,
fsync, rename over the target, fsync of the folder — a crash or ``kill -9`` at any point leaves the
previous file or the new one, never a mix.

A snapshot is restored only into the deployment it was made for: the same model weights (content hash
of the checkpoint, memoized like the engine bundles': ``edgekv/model/checkpoint_hash.py``), dtype, cache
spec (capacity, layers, KV heads, head_dim, dtype), frame grid, policy, sink budget and system prompt.
Anything else is refused with :class:`SnapshotMismatchError` naming the field and both values.

:class:`StateKeeper` is the daemon's side (``state:`` in the YAML): restore the newest valid snapshot
at start (or start fresh, set the old one aside and say why), a snapshot every ``state.every_s`` and
one at stop, at most two generations under ``state.dir`` and never more than ``state.max_mib`` bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from edgekv.config import StateSection
from edgekv.durable import fsync_dir

log = logging.getLogger("edgekv.state")

FORMAT = 1
MAGIC = b"EDGEKV-SNAPSHOT\x01"
SEALED_MAGIC = b"EDGEKV-SNAPSEAL\x01"  # the same layout, every section and the manifest sealed (edgekv/privacy.py)
END_MAGIC = b"EDGEKV-SNAP-END\x01"
_MANIFEST_CHUNKS = 0xFFFF0000  # chunk indices of a sealed manifest (tensor sections count up from 0)
_TRAILER = struct.Struct("<QQ32s16s")
_ALIGN = 64
_MANIFEST_ALLOWANCE = 1 << 16  # manifest bytes assumed when bounding a snapshot's size in advance
# the last alerts kept beside the memory (apps/outputs/alert_log.py ``FOLDER``: the library does not import apps/)
ALERT_EVENTS = "alert-events"
_CACHE_TENSORS = ("k", "v", "kind", "sink", "frame", "row", "col", "tpos")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                                       torch.bool, torch.int16, torch.int32, torch.uint8,
                                                       torch.float8_e4m3fn)}


class SnapshotError(ValueError):
    """A snapshot file that cannot be used; the message names the file and what is wrong."""


class SnapshotMismatchError(SnapshotError):
    """A valid snapshot made for another model, dtype, cache spec, grid, policy or system prompt."""


@dataclass(frozen=True)
class SnapshotInfo:
    path: Path
    bytes: int
    seconds: float       # time taken to write or read it
    cache_tokens: int
    frames: int
    stream_s: float      # stream time it covers: last timestamp - first
    last_t: float | None = None       # the stream clock at the snapshot
    saved_unix: float | None = None   # wall-clock time of the snapshot (time.time())
    last_source_t: float | None = None  # the source's timestamp of the last frame (edgekv/session/clock.py)


@dataclass(frozen=True)
class RestorePlan:
    """What the next start will do with the memory under ``state.dir`` (``StateKeeper.plan_restore``)."""

    action: str  # none (no state.dir) | empty | resume | resume_set_aside | set_aside | unknown
    text: str
    differences: tuple[str, ...] = ()  # the key fields (``_KEY_FIELDS``) the newest snapshot has otherwise
    # what the start says of the recording it reads (``recording_goes_on``) when the memory it resumes stopped in
    # one: goes on at t, ended, or read from its start and why; None otherwise (or ``StateKeeper.source`` not set)
    recording: RecordingGoesOn | None = None


# ---------------------------------------------------------------------------------------------- the key
# What each key field is called in the user's terms, for error messages.
_KEY_FIELDS = {
    "model_hash": "model weights (content hash of model.path)",
    "dtype": "model.dtype",
    "lm_head": "model.lm_head (the weights the tied embedding reads)",
    "cache_capacity": "cache capacity M in tokens (cache.max_tokens / cache.max_mib)",
    "cache_layers": "cache layers (the model's)",
    "cache_kv_heads": "cache KV heads (the model's)",
    "cache_head_dim": "cache head_dim (the model's)",
    "cache_dtype": "cache dtype (cache.kv_dtype, default model.dtype)",
    "resolution": "frame grid in pixels (video.resolution)",
    "policy": "cache.policy",
    "sinks": "cache.sinks",
    "prefix": "system prompt (model.system_prompt)",
}


def deployment_key(runtime, resolution: tuple[int, int] | None) -> dict:
    """The fields a snapshot must share with the session that restores it (see the module docstring)."""
    return _key(runtime.config, runtime.model.config.text, runtime.model_hash(), runtime.tokenizer, runtime.kv_dtype,
                runtime.cache_capacity_tokens(runtime.cache_spec()), resolution)


def planned_key(config) -> dict:
    """``deployment_key`` of the runtime ``config`` would load, read from the checkpoint's ``config.json``, tokenizer
    and content hash without loading the weights (``edgekv-camera --check``: will the start resume the memory?). The
    hash comes from the digests memoized in ``engines.engine_dir`` where the files are unchanged, and nothing is
    written there."""
    from edgekv.tokenizer import QwenTokenizer

    model_dir, text, kv_dtype, spec, capacity = _planned_cache(config)
    resolution = config.video.resolution
    return _key(config, text, _model_hash(model_dir, Path(config.engines.engine_dir).expanduser() / "hashes.json"),
                QwenTokenizer.from_dir(model_dir), kv_dtype, capacity, tuple(resolution) if resolution else None)


def _model_hash(model_dir: Path, memo_file: Path) -> str:
    """``Runtime.model_hash`` of ``model_dir`` (each file's sha256 taken from the memo where its size and mtime are
    unchanged), the memo only read."""
    from edgekv.model.checkpoint_hash import model_hash

    return model_hash(model_dir, memo_file, remember=False)


def _planned_cache(config):
    """The checkpoint folder, its text config, the cache's dtype, spec and capacity in tokens that ``config`` gives
    (``Runtime.cache_spec`` / ``cache_capacity_tokens``), from ``config.json`` alone."""
    from edgekv.cache.specs import KV_DTYPES, CacheSpec
    from edgekv.model.builtin import resolve_model_path
    from edgekv.model.config import ModelConfig

    model_dir = Path(resolve_model_path(config.model.path)).expanduser()
    text = ModelConfig.from_dir(model_dir).text
    kv_dtype = KV_DTYPES[config.cache.kv_dtype or config.model.dtype]
    spec = CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, kv_dtype)
    capacity = (spec.tokens_for_mib(config.cache.max_mib) if config.cache.max_mib is not None
                else int(config.cache.max_tokens))
    return model_dir, text, kv_dtype, spec, capacity


def planned_full_bytes(config) -> int:
    """``estimate_bytes`` of a full cache's snapshot for ``config`` without the weights: the cache (and the StateKV
    sink mass) built on the meta device, shapes without memory (``edgekv-camera --check``: a ``state.max_mib`` too
    small for two snapshots passed the check and stopped the start once the model had loaded)."""
    from types import SimpleNamespace

    from edgekv.cache.capped import CappedKVCache
    from edgekv.policies.statekv import SinkSelector

    _, text, _, spec, capacity = _planned_cache(config)
    rope = (torch.zeros(text.head_dim // 2), 1) if spec.layers[0].quantized else None  # shapes only
    cache = CappedKVCache(spec, capacity, device="meta", rope=rope)
    sinks = SinkSelector(cache, int(config.cache.sinks)) if config.cache.sinks > 0 else None
    return estimate_bytes(SimpleNamespace(capacity=capacity, cache=cache, sinks=sinks,
                                          ingestor=SimpleNamespace(pending=None)))


def _key(config, text, model_hash: str, tokenizer, kv_dtype: torch.dtype, capacity: int,
         resolution: tuple[int, int] | None) -> dict:
    from edgekv.tokenizer import ChatLayout

    prefix = tokenizer.encode(ChatLayout(config.model.system_prompt).stream_prefix())
    return {
        "model_hash": model_hash,
        "dtype": config.model.dtype,
        "lm_head": config.model.lm_head,
        "cache_capacity": capacity,
        "cache_layers": text.num_hidden_layers,
        "cache_kv_heads": text.num_key_value_heads,
        "cache_head_dim": text.head_dim,
        "cache_dtype": str(kv_dtype).removeprefix("torch."),
        "resolution": list(resolution) if resolution is not None else None,
        "policy": config.cache.policy,
        "sinks": int(config.cache.sinks),
        "prefix": hashlib.sha256(json.dumps(prefix).encode()).hexdigest()[:16],
    }


def key_differences(saved: dict, wanted: dict) -> list[str]:
    """Fields that differ, in the user's terms. A grid not yet fixed (``None``) on either side fits any."""
    return list(_differences(saved, wanted).values())


def _differences(saved: dict, wanted: dict) -> dict[str, str]:
    """``key_differences`` by field name (``_KEY_FIELDS``'s)."""
    out = {}
    for name, label in _KEY_FIELDS.items():
        mine, theirs = saved.get(name), wanted.get(name)
        if name == "resolution" and (mine is None or theirs is None):
            continue
        if name == "lm_head":  # snapshots from before model.lm_head existed were made with the head as loaded
            mine, theirs = mine or "as_loaded", theirs or "as_loaded"
        if mine != theirs:
            if name == "model_hash":
                mine, theirs = str(mine)[:12], str(theirs)[:12]
            out[name] = f"{label}: snapshot has {mine!r}, this deployment {theirs!r}"
    return out


# ---------------------------------------------------------------------------------------------- what is saved
def cache_views(cache, length: int, sink_mass: torch.Tensor | None = None) -> dict[str, list[torch.Tensor]]:
    """Each saved tensor as per-layer views into the cache's buffers, ``[:length]`` of every slot axis.

    Saving writes the views one after another; loading reads into the same views. Per layer, so that a
    snapshot of a device-resident cache copies one layer at a time to the host, never the whole cache.
    """
    views = {name: [getattr(cache, name)[layer, :, :length] for layer in range(cache.num_layers)]
             for name in _CACHE_TENSORS + (("k_scale", "v_scale") if cache.quantized else ())}
    if sink_mass is not None:  # [layers, kv_heads, M] fp32 StateKV attention mass
        views["sink_mass"] = [sink_mass[layer, :, :length] for layer in range(cache.num_layers)]
    return views


def _tensor_views(session, length: int) -> dict[str, list[torch.Tensor]]:
    return cache_views(session.cache, length, session.sinks.mass if session.sinks is not None else None)


def _session_state(session) -> dict:
    pending = session.ingestor.pending
    return {
        "cache_length": session.cache.length,
        "counters": dataclasses.asdict(session.counters),
        "next_position": session.next_position,
        "t_offset": session.t_offset,
        "rebases": session.rebases,
        "video_start": session.video_start,
        "prefix_tokens": session.prefix_tokens,
        "grid": list(session.grid) if session.grid is not None else None,
        "t0": session.clock.t0,
        "last_t": session.clock.last_t,
        "pending_t": pending[1] if pending is not None else None,
        "clock": session.clock.state(),
        "sink_updates": session.sinks.updates if session.sinks is not None else 0,
        "pair_times": {str(pair): t for pair, t in session.pair_times.items()},
        "pair_ends": {str(pair): t for pair, t in session.pair_ends.items()},
        "wall": session.wall.state(),
        "policy": session.policy.state(),
    }


ANSWER_COUNTERS = ("questions", "answer_tokens", "probes")  # change with answers, not with the memory
# in session.counters.extra: the source the memory last read (source_record) and, kept by the daemon at each frame in,
# "t" (the source's own time of that frame), "stream_t" (the time the session got for it), "ended" (a recording
# read to its end): a restart goes on in the same recording from there (StateKeeper._recording_goes_on)
SOURCE_KEY = "video_source"


def source_record(spec, loop: bool = False) -> dict:
    """What the persistent memory keeps of the video source ``spec`` (``edgekv.video.sources.SourceSpec``) to know at
    a restart whether it is reading the same recording: the spec as logs show it (credentials redacted), its kind,
    and for a file or a bag its resolved path, size and modification time (another file under the same name is read
    from its start). ``loop``: ``video.loop`` (not compared: an ended recording played again by it)."""
    from edgekv.video.sources import redact

    record = {"spec": redact(spec.raw or spec.target), "kind": spec.kind, "live": bool(spec.live), "loop": bool(loop)}
    if spec.kind in ("file", "rosbag") and not spec.live:
        path = Path(str(spec.target)).expanduser().resolve()
        record["path"] = str(path)
        with contextlib.suppress(OSError):  # gone meanwhile: the open that follows says so
            record["size"], record["mtime_ns"] = _recording_identity(path)
    return record


@dataclass(frozen=True)
class RecordingGoesOn:
    """What a start does with the recording it reads, given where the restored memory stopped (``recording_goes_on``):
    ``line`` says it; ``t`` (None: read from its start, after the wall-clock gap) the recording's own time of the last
    frame the memory holds, ``offset`` the clock offset that continues the stream exactly from there, ``ended`` the
    memory saw the recording to its end and nothing more is read from it."""

    line: str
    t: float | None = None
    offset: float = 0.0
    ended: bool = False


def recording_goes_on(now: dict | None, saved: object) -> RecordingGoesOn | None:
    """Where the recording ``now`` (``source_record`` of the source a start reads) goes on, given ``saved`` (the
    ``SOURCE_KEY`` record the memory to restore kept, its ``counters.extra``'s). A recording's time is its own: the
    time the process was down is no gap in it, as a paused recording's is none. None, with nothing worth saying, for
    a live source (it goes on live), a memory that kept no record, or a record without a usable time."""
    if now is None or now.get("live") or not isinstance(saved, dict):
        return None
    name, t, stream_t = now["spec"], saved.get("t"), saved.get("stream_t")
    if _recording_key(saved) != _recording_key(now):
        return RecordingGoesOn(f"{name} is read from its start: the saved memory last read another source, "
                               f"{saved.get('spec')}")
    if (saved.get("size"), saved.get("mtime_ns")) != (now.get("size"), now.get("mtime_ns")):
        return RecordingGoesOn(f"{name} is read from its start: it is not the recording the saved memory stopped in "
                               f"(its size or modification time changed since: {saved.get('size')} -> "
                               f"{now.get('size')} bytes)")
    if not (isinstance(t, (int, float)) and isinstance(stream_t, (int, float))
            and math.isfinite(t) and math.isfinite(stream_t)):
        return None
    at = f"{float(t):.3f}".rstrip("0").rstrip(".")
    ended = bool(saved.get("ended")) and not now.get("loop")
    if ended:
        line = (f"{name} ended at {at} s in the saved memory: nothing more is read from it (video.loop plays it "
                f"again; another recording, or this one changed, starts from its beginning)")
    else:
        line = f"resuming {name} at {at} s where the saved memory stopped (the recording's own time goes on)"
    return RecordingGoesOn(line, float(t), float(stream_t) - float(t), ended)


def _recording_identity(path: Path) -> tuple[int, int]:
    """A recording's bytes and latest modification: a file's own, a bag folder's files' together (rosbag2 keeps
    metadata.yaml beside its storage files, one level deep)."""
    if not path.is_dir():
        stat = path.stat()
        return stat.st_size, stat.st_mtime_ns
    stats = [p.stat() for p in path.iterdir() if p.is_file()]
    return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)


def _recording_key(record: dict) -> tuple:
    """What makes two ``source_record`` the same recording: a file's or bag's resolved path (and a bag's topic),
    any other recording's spec."""
    spec = str(record.get("spec"))
    if record.get("path") is not None:
        return record.get("kind"), record.get("path"), spec.partition("?")[2] if record.get("kind") == "rosbag" else ""
    return record.get("kind"), spec


def _memory_mark(session) -> str:
    """What a snapshot of ``session`` would restore, as one comparable string, the answer counters left out:
    ``_session_state`` holds every scalar that moves with the cache (its length, positions, counters of frames,
    pairs and compressions, the clock, the pairs' times, the policy's state), so equal marks mean an equal cache."""
    state = _session_state(session)
    state["counters"] = {k: v for k, v in state["counters"].items() if k not in ANSWER_COUNTERS}
    return json.dumps(state, sort_keys=True, default=str)


def _size(path: Path) -> int:
    """A file's bytes; 0 when it went meanwhile (an alert forgotten, a write's temporary file renamed)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _identity(path: Path) -> tuple[int, int]:
    """A file's size and mtime: another file in its place (a rekey rewrites a snapshot) is not taken for it."""
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _covered(low: float, high: float, stretches: list[tuple[float, float]]) -> bool:
    """Whether ``[low, high]`` lies whole within the union of ``stretches`` (closed intervals)."""
    reach = None  # [low, reach] is covered
    for a, b in sorted(stretches):
        start = low if reach is None else reach
        if a > start:
            break  # a gap: the later stretches begin later still
        if b >= start:
            reach = b
            if reach >= high:
                return True
    return False


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def _chunk_bytes(chunk: torch.Tensor) -> int:
    return chunk.numel() * chunk.element_size()


def estimate_bytes(session, length: int | None = None) -> int:
    """Upper bound of a snapshot's size with ``length`` cache slots (default: the cache's capacity), sealed or
    not (a sealed section adds a 16-byte tag per MiB)."""
    from edgekv.privacy import Sealer, sealed_size

    length = session.capacity if length is None else length
    total = len(MAGIC) + Sealer.HEADER.size
    sections = [sum(_chunk_bytes(c) for c in chunks) for chunks in _tensor_views(session, length).values()]
    if session.ingestor.pending is not None:
        sections.append(session.ingestor.pending[0].nbytes)
    for size in sections:
        total = _aligned(total) + sealed_size(size)
    return total + sealed_size(_MANIFEST_ALLOWANCE) + _TRAILER.size


# ---------------------------------------------------------------------------------------------- writing
class _SealedWriter:
    """One section of a sealed snapshot: plaintext in, AES-GCM chunks of ``privacy.CHUNK`` bytes out."""

    def __init__(self, handle, sealer, index: int) -> None:
        self.handle, self.sealer, self.index = handle, sealer, index
        self.buffer = bytearray()
        self.sealed = 0

    def write(self, data) -> None:
        from edgekv.privacy import CHUNK

        self.buffer += memoryview(data).cast("B")
        while len(self.buffer) >= CHUNK:
            self._emit(bytes(self.buffer[:CHUNK]))
            del self.buffer[:CHUNK]

    def close(self) -> None:
        if self.buffer:
            self._emit(bytes(self.buffer))
            self.buffer.clear()

    def _emit(self, plain: bytes) -> None:
        sealed = self.sealer.seal(self.index, plain)
        self.handle.write(sealed)
        self.sealed += len(sealed)
        self.index += 1


def _open_chunk(sealer, index: int, sealed: bytes, what: str) -> bytes:
    """A chunk of a snapshot whose key this deployment has: one that does not authenticate is damage, a
    ``SnapshotError`` — the keeper then tries the older generation and sets this one aside. As a ``SealError`` (a
    wrong key's error) one flipped byte stopped every start while a good older snapshot lay beside it."""
    from edgekv.privacy import SealError

    try:
        return sealer.open(index, sealed, what)
    except SealError as exc:
        raise SnapshotError(str(exc)) from None


class _SealedReader:
    """Reads one sealed section back as plaintext, chunk by chunk (each authenticated)."""

    def __init__(self, handle, sealer, index: int, sealed_bytes: int, what: str) -> None:
        self.handle, self.sealer, self.index, self.what = handle, sealer, index, what
        self.remaining = sealed_bytes  # the section's sealed bytes not read yet (the next section follows)
        self.plain = b""

    def readinto(self, out) -> int:
        from edgekv.privacy import CHUNK, TAG

        view, filled = memoryview(out).cast("B"), 0
        while filled < len(view):
            if not self.plain:
                sealed = self.handle.read(min(CHUNK + TAG, self.remaining))
                if not sealed:
                    return filled
                self.remaining -= len(sealed)
                self.plain = _open_chunk(self.sealer, self.index, sealed, self.what)
                self.index += 1
            take = min(len(self.plain), len(view) - filled)
            view[filled:filled + take] = self.plain[:take]
            self.plain, filled = self.plain[take:], filled + take
        return filled


def _write_tensor(handle, chunks: list[torch.Tensor], offset: int) -> tuple[dict, int]:
    """Write ``chunks`` back to back at ``offset`` (already aligned); returns the manifest entry and the plaintext
    bytes (``handle`` may be a ``_SealedWriter``)."""
    digest = hashlib.sha256()
    written = 0
    for chunk in chunks:
        host = chunk.detach().contiguous().cpu()
        raw = host.view(torch.uint8).numpy().reshape(-1) if host.numel() else np.empty(0, np.uint8)
        handle.write(raw)
        digest.update(raw)
        written += raw.size
    entry = {"dtype": str(chunks[0].dtype).removeprefix("torch."), "shape": [len(chunks), *chunks[0].shape],
             "offset": offset, "bytes": written, "sha256": digest.hexdigest()}
    return entry, written


PACE_BYTES = 8 << 20  # a snapshot written with ``progress`` reaches the disk this much at a time


def _sync_data(fd: int) -> None:
    (getattr(os, "fdatasync", None) or os.fsync)(fd)


class _Paced:
    """The snapshot's file, sent to the disk ``PACE_BYTES`` at a time as it is written (the data synced), and
    ``progress`` called after each step. Written whole and synced once at the end, a snapshot filled the page cache in
    a moment and then sat in one ``fsync`` for as long as the flash took — 224 MiB at the 3B shape, many seconds on
    an SD card — with no sign of life: the main loop's heartbeat went stale and systemd's watchdog (``WatchdogSec`` 30
    in jetson/edgekv-camera.service, a ping withheld after 15 s) killed a daemon that was only saving its memory.
    Paced, each step is a bounded stretch of real writing: a disk that stops answering stops the steps, and the
    watchdog still restarts a daemon truly stuck. It also keeps the dirty pages of a snapshot to one step, not the
    whole file, on a board whose memory the model already fills."""

    def __init__(self, handle, progress: Callable[[], None], every: int | None = None) -> None:
        self.handle, self.progress = handle, progress
        self.every = PACE_BYTES if every is None else every
        self.unsynced = 0

    def write(self, data) -> None:
        self.handle.write(data)
        self.unsynced += memoryview(data).nbytes
        if self.unsynced >= self.every:
            self.handle.flush()
            _sync_data(self.handle.fileno())
            self.unsynced = 0
            self.progress()

    def flush(self) -> None:
        self.handle.flush()

    def fileno(self) -> int:
        return self.handle.fileno()


def write_snapshot(path: Path, manifest: dict, views: dict[str, list[torch.Tensor]], sealer=None,
                   progress: Callable[[], None] | None = None) -> int:
    """Write ``views`` and ``manifest`` (its ``tensors`` filled in here) to ``path`` atomically; returns bytes.
    With ``sealer`` (``edgekv.privacy.Sealer``) every section and the manifest are sealed (AES-256-GCM). With
    ``progress``, the file reaches the disk a step at a time and ``progress`` is called after each (``_Paced``: the
    daemon's watchdog heartbeat)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    manifest = {**manifest, "tensors": {}}
    with _replacing(path) as file:
        handle = file if progress is None else _Paced(file, progress)
        head = MAGIC if sealer is None else SEALED_MAGIC + sealer.header
        handle.write(head)
        offset, index = len(head), 0
        for name, chunks in views.items():
            start = _aligned(offset)
            handle.write(b"\0" * (start - offset))
            if sealer is None:
                manifest["tensors"][name], written = _write_tensor(handle, chunks, start)
                offset = start + written
            else:
                writer = _SealedWriter(handle, sealer, index)
                entry, _ = _write_tensor(writer, chunks, start)
                writer.close()
                entry.update(first_chunk=index, sealed_bytes=writer.sealed)
                manifest["tensors"][name], index, offset = entry, writer.index, start + writer.sealed
        _write_manifest(handle, manifest, offset, sealer)
    return path.stat().st_size


@contextlib.contextmanager
def _replacing(path: Path):
    """A file written whole or not at all: the handle of a temporary sibling, renamed over ``path`` (the folder
    fsynced) when the block ends; an error removes it and leaves ``path`` as it was (the writer fsyncs the file).
    The owner's only (0600), whatever the umask: a snapshot holds what the camera saw (a shell's umask 022 made it
    readable by every local account; the unit's UMask=0077 covered the service alone)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as handle:
            yield handle
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_manifest(handle, manifest: dict, offset: int, sealer) -> None:
    """The manifest at ``offset`` (sealed with ``sealer`` when given), the trailer, then fsync."""
    body = json.dumps(manifest, sort_keys=True).encode()
    if sealer is not None:
        sink = io.BytesIO()
        writer = _SealedWriter(sink, sealer, _MANIFEST_CHUNKS)
        writer.write(body)
        writer.close()
        body = sink.getvalue()
    handle.write(body)
    handle.write(_TRAILER.pack(offset, len(body), hashlib.sha256(body).digest(), END_MAGIC))
    handle.flush()
    os.fsync(handle.fileno())


def reseal_snapshot(path: str | Path, keys) -> bool:
    """Rewrite the snapshot at ``path`` sealed with ``keys.current`` (``edgekv.privacy.KeyRing``), from a file in
    the clear or sealed with any key of ``keys``; False (untouched) when it already is. For ``edgekv rekey``: after
    a key leaks, or when a key is first set, the memory is sealed with the new key at once instead of as new
    snapshots replace the old. The file is read section by section (``privacy.CHUNK`` bytes at a time, each
    section checked against its sha256 as it goes) and written as ``write_snapshot`` writes one: a temporary
    file, fsync, rename — a crash leaves the old file or the new one. A damaged or truncated file, or one no key
    of ``keys`` opens, is ``SnapshotError`` / ``SealError`` naming it, and is left as it is."""
    from edgekv.privacy import CHUNK, Sealer

    path = Path(path).expanduser()
    if keys is None or keys.current is None:
        raise ValueError("reseal_snapshot: no current key to seal with (privacy.key_file, key_env or key_credential)")
    manifest = read_manifest(path, keys)
    old = manifest.pop("_sealer", None)
    if old is not None and old.key.id == keys.current.id:
        return False
    new = Sealer(keys.current)
    out = {**manifest, "tensors": {}}
    with open(path, "rb") as source, _replacing(path) as handle:
        head = SEALED_MAGIC + new.header
        handle.write(head)
        offset, index, buffer = len(head), 0, bytearray(CHUNK)
        for name, entry in sorted(manifest["tensors"].items(), key=lambda item: item[1]["offset"]):
            start = _aligned(offset)
            handle.write(b"\0" * (start - offset))
            source.seek(entry["offset"])
            reader = source if old is None else _SealedReader(
                source, old, int(entry["first_chunk"]), int(entry["sealed_bytes"]), f"{path}: tensor {name}")
            writer, digest, left = _SealedWriter(handle, new, index), hashlib.sha256(), int(entry["bytes"])
            while left:
                view = memoryview(buffer)[:min(CHUNK, left)]
                if reader.readinto(view) != len(view):
                    raise SnapshotError(f"{path}: truncated inside tensor {name}")
                digest.update(view)
                writer.write(view)
                left -= len(view)
            writer.close()
            if digest.hexdigest() != entry["sha256"]:
                raise SnapshotError(f"{path}: damaged: tensor {name} does not match its sha256")
            out["tensors"][name] = {**{field: entry[field] for field in _TENSOR_FIELDS}, "offset": start,
                                    "first_chunk": index, "sealed_bytes": writer.sealed}
            index, offset = writer.index, start + writer.sealed
        _write_manifest(handle, out, offset, new)
    return True


def save_session(session, path: str | Path, progress: Callable[[], None] | None = None) -> SnapshotInfo:
    """Write ``session`` to ``path`` atomically (call through ``StreamSession.save``, under its lock); ``progress``:
    see ``write_snapshot``."""
    started = time.perf_counter()
    path = Path(path).expanduser()
    if path.is_dir():  # else the whole snapshot was written, then os.replace said "Is a directory" of the temp file
        raise IsADirectoryError(f"{path}: is a folder; save takes the snapshot file's path "
                                f"(e.g. {path / 'session.snap'})")
    state = _session_state(session)
    resolution = session.preprocessor.resolution if session.preprocessor is not None else None
    saved_unix = time.time()
    manifest = {"format": FORMAT, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(saved_unix)),
                "saved_unix": saved_unix, "key": deployment_key(session.runtime, resolution), "session": state}
    views = _tensor_views(session, session.cache.length)
    if session.ingestor.pending is not None:
        views["pending_frame"] = [torch.from_numpy(np.ascontiguousarray(session.ingestor.pending[0]))]
    keys = getattr(session.runtime, "keys", None)
    sealer = None
    if keys is not None and keys.enabled:
        from edgekv.privacy import Sealer

        sealer = Sealer(keys.current)
    size = write_snapshot(path, manifest, views, sealer, progress)
    return _info(path, size, time.perf_counter() - started, state, saved_unix)


def _info(path: Path, size: int, seconds: float, state: dict, saved_unix: float | None) -> SnapshotInfo:
    t0, last = state.get("t0"), state.get("last_t")
    span = (last - t0) if t0 is not None and last is not None else 0.0
    clock = state.get("clock") if isinstance(state.get("clock"), dict) else {}
    return SnapshotInfo(path, size, seconds, int(state["cache_length"]), int(state["counters"]["frames"]), span,
                        last, saved_unix, clock.get("last_source_t", last))


# ---------------------------------------------------------------------------------------------- reading
def read_manifest(path: str | Path, keys=None) -> dict:
    """The manifest of a complete, undamaged snapshot file; ``SnapshotError`` naming the file otherwise. A sealed
    snapshot needs ``keys`` (``edgekv.privacy.KeyRing``) holding its key: ``SealError`` when it does not (the file
    is left as it is)."""
    from edgekv.privacy import SealError, Sealer

    path = Path(path).expanduser()
    sealer = None
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(len(MAGIC))
            if head == SEALED_MAGIC:
                if keys is None or not keys.keys:
                    raise SealError(f"{path}: the snapshot is encrypted; set privacy.key_file (or key_env, "
                                    "key_credential) to its key. The file is left as it is")
                sealer = Sealer.for_header(handle.read(Sealer.HEADER.size), keys, str(path))
            elif head != MAGIC:
                raise SnapshotError(f"{path}: not an edgekv snapshot (no snapshot header)")
            if size < len(MAGIC) + _TRAILER.size:
                raise SnapshotError(f"{path}: truncated ({size} bytes): the snapshot is incomplete")
            handle.seek(size - _TRAILER.size)
            offset, length, digest, end = _TRAILER.unpack(handle.read(_TRAILER.size))
            if end != END_MAGIC or offset + length + _TRAILER.size != size:
                raise SnapshotError(f"{path}: truncated or damaged ({size} bytes, no valid end marker): "
                                    f"the snapshot is incomplete")
            handle.seek(offset)
            body = handle.read(length)
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such snapshot file") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read the snapshot ({exc})") from None
    if hashlib.sha256(body).digest() != digest:
        raise SnapshotError(f"{path}: damaged: the manifest's sha256 does not match")
    if sealer is not None:
        from edgekv.privacy import CHUNK, TAG

        step = CHUNK + TAG
        body = b"".join(_open_chunk(sealer, _MANIFEST_CHUNKS + i, body[i * step:(i + 1) * step], f"{path}: manifest")
                        for i in range(-(-len(body) // step)))
    try:
        manifest = json.loads(body)
    except ValueError as exc:
        raise SnapshotError(f"{path}: damaged manifest ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        newer = isinstance(found, int) and not isinstance(found, bool) and found > FORMAT
        raise SnapshotError(f"{path}: snapshot format {found!r}, this edgekv reads {FORMAT}"
                            + (" (written by a newer edgekv: upgrade this one to resume it)" if newer else ""))
    _check_fields(path, manifest)
    if sealer is not None:
        manifest["_sealer"] = sealer  # not JSON: read_tensors opens the sections with it
    return manifest


_TENSOR_FIELDS = {"dtype": str, "shape": list, "offset": int, "bytes": int, "sha256": str}


def _check_fields(path: Path, manifest: dict) -> None:
    """A manifest whose checksums hold can still lack what a reader needs (another writer, a hand edit): name
    the missing field, so that the keeper sets the file aside instead of crashing every start (issue 26)."""
    for name in ("key", "session", "tensors"):
        if not isinstance(manifest.get(name), dict):
            raise SnapshotError(f"{path}: the manifest has no {name!r} section")
    for name in ("cache_length", "counters", "next_position", "t_offset", "rebases", "video_start", "grid", "t0",
                 "last_t", "pending_t", "policy"):
        if name not in manifest["session"]:
            raise SnapshotError(f"{path}: the manifest's session state has no {name!r}")
    for tensor, entry in manifest["tensors"].items():
        for name, kind in _TENSOR_FIELDS.items():
            if not isinstance(entry, dict) or not isinstance(entry.get(name), kind):
                raise SnapshotError(f"{path}: tensor {tensor!r} has no valid {name!r} in the manifest")


def check_key(path: Path, manifest: dict, runtime) -> None:
    """Refuse a snapshot made for another deployment, naming every field that differs."""
    resolution = runtime.config.video.resolution
    diff = key_differences(manifest["key"], deployment_key(runtime, tuple(resolution) if resolution else None))
    if diff:
        raise SnapshotMismatchError(f"{path}: made for another deployment — " + "; ".join(diff))


def _read_tensor(handle, path: Path, name: str, entry: dict, chunks: list[torch.Tensor], sealer=None) -> None:
    """Read a tensor section into ``chunks`` (views of the session's buffers), checking its sha256."""
    expected = [len(chunks), *chunks[0].shape]
    if entry["shape"] != expected or entry["dtype"] != str(chunks[0].dtype).removeprefix("torch."):
        raise SnapshotError(f"{path}: tensor {name} is {entry['dtype']} {entry['shape']}, the session needs "
                            f"{str(chunks[0].dtype).removeprefix('torch.')} {expected}")
    handle.seek(entry["offset"])
    if sealer is not None:
        handle = _SealedReader(handle, sealer, int(entry["first_chunk"]), int(entry["sealed_bytes"]),
                               f"{path}: tensor {name}")
    digest = hashlib.sha256()
    for chunk in chunks:
        staging = torch.empty(chunk.shape, dtype=chunk.dtype)
        raw = staging.view(torch.uint8).numpy().reshape(-1) if staging.numel() else np.empty(0, np.uint8)
        if handle.readinto(raw) != raw.size:
            raise SnapshotError(f"{path}: truncated inside tensor {name}")
        digest.update(raw)
        chunk.copy_(staging)
    if digest.hexdigest() != entry["sha256"]:
        raise SnapshotError(f"{path}: damaged: tensor {name} does not match its sha256")


def read_tensors(path: Path, manifest: dict, views: dict[str, list[torch.Tensor]]) -> None:
    """Fill ``views`` from the snapshot's tensor sections, each checked against its sha256."""
    try:
        with open(path, "rb") as handle:
            for name, chunks in views.items():
                _read_tensor(handle, path, name, manifest["tensors"][name], chunks, manifest.get("_sealer"))
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read the snapshot ({exc})") from None


def _apply_state(session, state: dict, length: int, pending) -> None:
    session.cache.length = length
    session.counters = type(session.counters)(**state["counters"])
    session.next_position, session.t_offset = int(state["next_position"]), int(state["t_offset"])
    session.rebases, session.video_start = int(state["rebases"]), int(state["video_start"])
    session.grid = tuple(state["grid"]) if state["grid"] is not None else None
    session.clock.load_state(state["t0"], state["last_t"], state.get("clock"))
    session.ingestor.pending = pending
    session.pair_times = {int(pair): float(t) for pair, t in state.get("pair_times", {}).items()}
    # absent in a snapshot written before them: each pair is then its first frame's time alone, as it was read then
    session.pair_ends = {int(pair): float(t) for pair, t in state.get("pair_ends", {}).items()}
    session.wall.load_state(state.get("wall"))  # absent in a snapshot written before the wall-clock map
    if session.sinks is not None:
        session.sinks.updates = int(state["sink_updates"])
    session.policy.load_state(state["policy"])


def load_session(runtime, path: str | Path):
    """A new session of ``runtime`` holding the state saved in ``path`` (``Runtime.restore``); a snapshot that
    cannot be used raises ``SnapshotError`` naming the file (never a bare KeyError or TypeError)."""
    try:
        return _load_session(runtime, path)
    except (KeyError, TypeError, IndexError) as exc:
        raise SnapshotError(f"{path}: the manifest is unusable ({type(exc).__name__}: {exc})") from None


def _load_session(runtime, path: str | Path):
    started = time.perf_counter()
    path = Path(path).expanduser()
    manifest = read_manifest(path, getattr(runtime, "keys", None))
    check_key(path, manifest, runtime)
    session = runtime.session()
    try:
        return _fill_session(session, path, manifest, started)
    except BaseException:  # a snapshot that does not load leaves no session holding the archive folder
        session.close()
        raise


def _fill_session(session, path: Path, manifest: dict, started: float):
    runtime, state = session.runtime, manifest["session"]
    resolution = manifest["key"]["resolution"]
    if session.preprocessor is None and resolution is not None:  # video.resolution null: the memory's grid stays
        session.preprocessor = runtime.make_preprocessor(resolution=tuple(resolution))
        try:  # checked as a first frame's grid is (``StreamSession.ingest``): else the first pair failed, mid-stream
            session._check_budget()
        except ValueError as exc:
            raise type(exc)(f"{path}: its memory was seen at {tuple(resolution)} (video.resolution null keeps the "
                            f"grid of the memory it resumes), which this config cannot hold: {exc}; or move the "
                            f"snapshot out of its folder to start with an empty memory") from None
    length = int(state["cache_length"])
    views = _tensor_views(session, length)
    names = set(views) | ({"pending_frame"} if state["pending_t"] is not None else set())
    if set(manifest["tensors"]) != names:
        raise SnapshotError(f"{path}: holds tensors {sorted(manifest['tensors'])}, expected {sorted(names)}")
    read_tensors(path, manifest, views)
    pending = None
    if state["pending_t"] is not None:
        entry = manifest["tensors"]["pending_frame"]
        frame = torch.empty(entry["shape"][1:], dtype=torch.uint8)
        read_tensors(path, manifest, {"pending_frame": [frame]})
        pending = (frame.numpy(), float(state["pending_t"]))
    try:
        _apply_state(session, state, length, pending)
    except (KeyError, TypeError, ValueError) as exc:
        raise SnapshotError(f"{path}: the session state in the manifest is unusable ({type(exc).__name__}: {exc})") from None
    session.restored_from = _info(path, path.stat().st_size, time.perf_counter() - started, state,
                                  manifest.get("saved_unix"))
    return session


# ---------------------------------------------------------------------------------------------- the daemon's keeper
def describe_span(seconds: float) -> str:
    """56 years, 3 days, 3 h 12 min, 12 min, 45 s."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    if minutes < 48 * 60:
        return f"{minutes // 60} h {minutes % 60} min"
    days = seconds / 86400
    return f"{days:.0f} days" if days < 730 else f"{days / 365.25:.0f} years"


class StateKeeper:
    """Persistent memory for a long-running process (``state:`` in the YAML).

    ``restore(runtime)`` at start returns the session to use: the newest snapshot under ``state.dir``
    that loads, or a fresh one — then the snapshot that could not be used is renamed into
    ``state.dir/set-aside/`` (the latest one only) and the reason is said. ``maybe_snapshot(session)``
    each loop iteration writes one every ``state.every_s``; ``final_snapshot(session)`` at stop (SIGTERM
    included). Before each write every generation but the newest is removed, so the folder holds at most
    two (the newest and the one being written) and, with the set-aside file, at most ``state.max_mib``.
    A snapshot that cannot be written (disk full, permissions) is logged and the stream goes on.
    A restarted source counts time from 0 again: ``stream_time(t)`` moves its timestamps past the
    restored stream's last one, plus the time the process was down by the wall clock — at most
    ``video.max_gap_s``, and said when the wall clock moved back or further than that (a board without an RTC
    battery saves in 1970 and restarts after NTP: 56 years of "downtime", DESIGN invariant 12).
    """

    PREFIX, SUFFIX, ASIDE = "snapshot-", ".ekv", "set-aside"

    def __init__(self, section: StateSection, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self.section = section
        self.say = say
        self.clock = clock
        self.wall = wall  # the wall clock, only to measure how long the process was down
        self.dir = Path(section.dir).expanduser() if section.dir else None
        self.max_bytes = int(section.max_mib * 2**20)
        self.last_saved: float | None = None
        self.failures = 0
        self.last_error: str | None = None  # why the last snapshot that failed was not written
        self.clock_offset = 0.0  # added to the source's timestamps after a restore: see stream_time
        self.source: dict | None = None  # source_record of the video source this start reads (set before restore)
        self.resumed_source_t: float | None = None  # the recording goes on after this time of its own (restore)
        self.recording_ended = False  # the restored memory saw the recording to its end: nothing more to read
        self._lock_fd: int | None = None  # state.dir/state.lock while hold() is in force
        self._saved_mark: str | None = None  # _memory_mark of the session as the last snapshot saved it
        self.unchanged = 0  # snapshots not written: the memory had not changed since the last one
        self.written = 0  # snapshots written by this keeper (periodic, SIGHUP, forget, final)
        self.written_at: float | None = None  # clock() of the last one written (or of the snapshot restored)
        self.camera: str | None = None  # one camera of video.sources: dir is state.dir/<camera>
        self.alerts_removed = 0  # kept alerts' files removed to stay within state.max_mib (_make_room)
        self._beside_mark: int | None = None  # mtime of alert-events/ when _make_room last looked
        # snapshot name -> (its size and mtime, the stretches a forget had just removed when this keeper wrote it)
        self._written_without: dict[str, tuple[tuple[int, int], list[tuple[float, float]]]] = {}

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def hold(self) -> None:
        """Claim ``state.dir`` for this keeper until ``release()`` or the process's end (edgekv/folder_lock.py):
        two daemons given one folder numbered their snapshots past each other's and deleted each other's
        generations, and the next start resumed whichever stream wrote last. Another holder is a
        ``RuntimeError`` naming it. The daemon holds it from before the restore to after the final snapshot."""
        if self.enabled and self._lock_fd is None:
            from edgekv.folder_lock import lock_folder

            self.dir.mkdir(parents=True, exist_ok=True)
            self._lock_fd = lock_folder(self.dir, "state.lock", "state.dir", "edgekv daemon",
                                        "another daemon in this process watches with the same state.dir")

    def release(self) -> None:
        from edgekv.folder_lock import unlock_folder

        unlock_folder(self._lock_fd)
        self._lock_fd = None

    # ------------------------------------------------------------------ files
    def generations(self) -> list[Path]:
        """Complete snapshot files, oldest first."""
        if self.dir is None or not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob(f"{self.PREFIX}*{self.SUFFIX}") if p.name[len(self.PREFIX):-len(self.SUFFIX)].isdigit())

    def _next_path(self) -> Path:
        existing = self.generations()
        number = int(existing[-1].name[len(self.PREFIX):-len(self.SUFFIX)]) + 1 if existing else 1
        return self.dir / f"{self.PREFIX}{number:08d}{self.SUFFIX}"

    def _remove_leftovers(self) -> None:
        """Temporary files of writes a crash interrupted: never valid, never needed. ``set-aside/`` too: ``edgekv
        rekey`` rewrites the set-aside snapshot in place, and one killed there left its temporary file, which every
        later rekey named as a snapshot "left as it is" (exit 1: keep the old keys) and nothing ever removed."""
        for folder in (self.dir, self.dir / self.ASIDE):
            for leftover in folder.glob(f".{self.PREFIX}*.tmp-*"):
                leftover.unlink(missing_ok=True)

    def set_aside_files(self) -> list[Path]:
        """The snapshots under ``state.dir/set-aside`` (a temporary file of a write cut short there is none)."""
        aside = self.dir / self.ASIDE
        return sorted(p for p in aside.iterdir() if p.is_file() and p.name.startswith(self.PREFIX)
                      and p.name.endswith(self.SUFFIX)) if aside.is_dir() else []

    def _elsewhere(self) -> str:
        """Where memory of this folder's other layout lies: a one-camera deployment keeps its snapshots in
        ``state.dir``, several cameras (``video.sources``) each in ``state.dir/<name>`` — one that went from one to
        several (or back) started empty without a word about the memory beside it."""
        if self.camera is not None and self._holds_snapshots(self.dir.parent):
            return (f" ({self.dir.parent} itself holds the memory of a one-camera deployment; with video.sources "
                    f"each camera keeps its own in state.dir/<name>: move those snapshot files into {self.dir} to "
                    f"resume from them, if this camera's cache is the same)")
        cameras = sorted(p.name for p in self.dir.iterdir()
                         if p.is_dir() and p.name != self.ASIDE and self._holds_snapshots(p))
        if self.camera is None and cameras:
            return (f" ({self.dir} holds the memory of cameras {', '.join(cameras)} of a deployment with "
                    f"video.sources, each in its own folder; it is not read without video.sources)")
        return ""

    def _holds_snapshots(self, folder: Path) -> bool:
        return any(p.name[len(self.PREFIX):-len(self.SUFFIX)].isdigit()
                   for p in folder.glob(f"{self.PREFIX}*{self.SUFFIX}"))

    def _set_aside(self, path: Path) -> Path:
        aside = self.dir / self.ASIDE
        aside.mkdir(exist_ok=True)
        for old in aside.iterdir():
            old.unlink()
        target = aside / path.name
        os.replace(path, target)
        return target

    def _aside_bytes(self) -> int:
        aside = self.dir / self.ASIDE
        return sum(p.stat().st_size for p in aside.iterdir()) if aside.is_dir() else 0

    def _remove_set_aside(self, why: str) -> None:
        log.warning("state: removing the set-aside snapshot to stay within state.max_mib=%g (%s)",
                    self.section.max_mib, why)
        for old in (self.dir / self.ASIDE).iterdir():
            old.unlink()

    def files_beside(self) -> tuple[int, list[Path]]:
        """What ``state.dir`` holds beside the snapshots, counted in ``state.max_mib`` with them: the bytes of the files
        the keeper leaves alone (the API's standing questions ``alerts.json``, ``paused.json``, the lock, a file set
        aside as damaged, a write in progress) and the kept alerts' files (``alert-events/``, oldest first), which go,
        oldest first, when the snapshots need their room. Only the snapshots were counted: 64 alerts with their
        keyframes (a megabyte each from a 4K camera) grew the folder past the bound the user had set for it. Folders
        of other cameras' memory (another layout's) are not this keeper's and not counted (``_elsewhere`` says them)."""
        fixed = 0
        for path in self.dir.iterdir() if self.dir.is_dir() else ():
            if path.is_file() and not self._is_generation(path) and not path.name.startswith(f".{self.PREFIX}"):
                fixed += _size(path)
        alerts: list[Path] = []
        folder = self.dir / ALERT_EVENTS
        for path in sorted(folder.iterdir()) if folder.is_dir() else ():
            if path.name.startswith("."):  # a write in progress: counted, never removed
                fixed += _size(path)
            elif path.is_file():
                alerts.append(path)
        return fixed, alerts

    def _is_generation(self, path: Path) -> bool:
        return (path.name.startswith(self.PREFIX) and path.name.endswith(self.SUFFIX)
                and path.name[len(self.PREFIX):-len(self.SUFFIX)].isdigit())

    def _make_room(self, needed: int) -> None:
        """Remove the set-aside snapshot, then the oldest kept alerts, until the files under ``dir`` and ``needed``
        more bytes (a snapshot about to be written) fit in ``state.max_mib``; what is removed is logged. When the files
        the keeper leaves alone and the snapshots already take the room, nothing goes: removing would not help."""
        fixed, alerts = self.files_beside()
        kept = sum(_size(p) for p in self.generations()) + fixed + needed
        alert_bytes = [_size(p) for p in alerts]
        over = kept + sum(alert_bytes) + self._aside_bytes() - self.max_bytes
        if over <= 0 or kept > self.max_bytes:
            return
        if self._aside_bytes():
            self._remove_set_aside("the snapshots and the kept alerts need its room")
            over = kept + sum(alert_bytes) - self.max_bytes
        removed = 0
        for path, size in zip(alerts, alert_bytes):
            if over <= 0:
                break
            path.unlink(missing_ok=True)
            over -= size
            removed += 1
        if removed:
            self.alerts_removed += removed
            log.warning("state: removed the %d oldest kept alert(s) in %s to stay within state.max_mib=%g (they are "
                        "listed until the restart; %d kept)", removed, self.dir / ALERT_EVENTS, self.section.max_mib,
                        len(alerts) - removed)

    def _watch_beside(self) -> None:
        """``_make_room`` when the kept alerts changed (a new alert's file: the folder's mtime moves), so that the
        folder stays within ``state.max_mib`` between snapshots too; one ``stat`` a loop iteration otherwise."""
        try:
            mark = (self.dir / ALERT_EVENTS).stat().st_mtime_ns
        except OSError:
            return
        if mark != self._beside_mark:
            self._beside_mark = mark
            try:
                self._make_room(0)
            except OSError as exc:
                log.warning("state: could not keep %s within state.max_mib (%s)", self.dir, exc)

    # ------------------------------------------------------------------ start
    def check_keys(self, keys) -> None:
        """``SealError`` when ``restore`` would stop on a snapshot no key of ``keys`` (``edgekv.privacy.KeyRing`` or
        None) opens, found from the manifests alone, before the model loads: ``--check`` said "the daemon would
        start" of a config whose new key lacked the old one in ``previous_key_files``, and the start stopped only
        once the weights had loaded. Damaged files are skipped here as ``restore`` skips them."""
        for path in reversed(self.generations()):
            try:
                read_manifest(path, keys)
            except SnapshotError:
                continue
            return

    def plan_restore(self, config, keys=None) -> RestorePlan:
        """What ``restore`` will do for ``config`` (the runtime's; ``keys``: its ``edgekv.privacy.KeyRing``), read from
        the snapshots' manifests and ``planned_key(config)`` before the model loads: resume, start empty, or set the
        memory aside — with the fields that changed and where the memory goes. A config whose cameras, weights, cap,
        model or prompt changed set every snapshot aside at the restart, and ``--check`` had said nothing of it."""
        from edgekv.privacy import SealError

        if not self.enabled:
            return RestorePlan("none", "no state.dir: the memory is not kept over a restart")
        newest, damaged = None, []
        for path in reversed(self.generations()):
            try:
                newest = (path, read_manifest(path, keys))
                break
            except SnapshotError as exc:  # restore skips it for an older generation and sets it aside
                damaged.append(f"{path.name} ({exc})")
            except SealError as exc:
                return RestorePlan("unknown", f"not compared: {exc}")
        skipped = f" (skipped, unreadable: {'; '.join(damaged)})" if damaged else ""
        if newest is None and not self.set_aside_files():
            return RestorePlan("empty", (f"no snapshot in {self.dir}: the start begins with an empty memory"
                                         f"{self._elsewhere()}") if not damaged else
                               f"no snapshot in {self.dir} reads: the start begins with an empty memory{skipped}")
        wanted = planned_key(config)
        differences = _differences(newest[1]["key"], wanted) if newest is not None else {}
        if newest is not None and not differences:
            return RestorePlan("resume", f"resumes {self._describe(*newest)}{skipped}",
                               recording=self._recording_in(newest[1]))
        why = "made for another deployment — " + "; ".join(differences.values())
        for candidate in self.set_aside_files():
            try:
                aside = read_manifest(candidate, keys)
            except (SnapshotError, SealError):
                continue
            if not _differences(aside["key"], wanted):
                rest = (f"; the newer {newest[0].name}, {why}, is set aside in its place" if newest is not None
                        else "")
                return RestorePlan("resume_set_aside", f"resumes the memory set aside earlier for this deployment, "
                                   f"{self._describe(candidate, aside)}{rest}{skipped}", tuple(differences),
                                   self._recording_in(aside))
        if newest is None:
            return RestorePlan("empty", f"no snapshot in {self.dir}: the start begins with an empty memory (the one "
                                        f"in {self.ASIDE}/ was made for another deployment){skipped}")
        return RestorePlan("set_aside", self._set_aside_text(*newest, why) + skipped, tuple(differences))

    def _set_aside_text(self, path: Path, manifest: dict, why: str) -> str:
        """Where the memory that no longer fits goes, and how to have it back."""
        older = [p.name for p in self.generations() if p != path]
        replaced = [p.name for p in self.set_aside_files()]
        return (f"the memory will be SET ASIDE and the start begins with an empty memory: "
                f"{self._describe(path, manifest)}, {why}. It is kept (not deleted) as "
                f"{self.dir / self.ASIDE / path.name}"
                + (f", in place of {', '.join(replaced)} set aside before it (deleted)" if replaced else "")
                + f", until new snapshots or the kept alerts need its room under state.max_mib="
                  f"{self.section.max_mib:g}; put the config back and restart to resume it"
                + (f". The older generation {', '.join(older)} is deleted" if older else ""))

    def _recording_in(self, manifest: dict) -> RecordingGoesOn | None:
        """``recording_goes_on`` for ``self.source`` and the memory a snapshot's ``manifest`` holds, as ``restore``
        decides it once that memory is loaded."""
        counters = manifest.get("session", {}).get("counters", {})
        return recording_goes_on(self.source, counters.get("extra", {}).get(SOURCE_KEY))

    @staticmethod
    def _describe(path: Path, manifest: dict) -> str:
        info = _info(path, path.stat().st_size, 0.0, manifest["session"], manifest.get("saved_unix"))
        saved = f", saved {manifest['created']}" if isinstance(manifest.get("created"), str) else ""
        return (f"{path.name} ({describe_span(info.stream_s)} of memory, {info.cache_tokens:,} tokens, "
                f"{info.frames:,} frames{saved})")

    def restore(self, runtime):
        """The session to run: restored from the newest usable snapshot, or fresh (and why)."""
        if not self.enabled:
            return runtime.session()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._remove_leftovers()
        runtime.model_hash()  # hashed here, once (seconds for a 7 GB checkpoint, then memoized), not in the loop
        problem, rejected = None, None
        for path in reversed(self.generations()):
            try:
                session = load_session(runtime, path)
            except SnapshotMismatchError as exc:  # older generations were made for it too
                problem, rejected = str(exc), path
                break
            except SnapshotError as exc:  # damaged: an older generation may still be good
                problem, rejected = problem or str(exc), rejected or path
                continue
            self._check_budget(session)
            info = session.restored_from
            going_on = self._recording_goes_on(session)
            self.clock_offset = going_on[1] if going_on else self._resume_offset(info, runtime.config.video.max_gap_s)
            self.say(f"resumed {describe_span(info.stream_s)} of memory, {info.cache_tokens:,} tokens "
                     f"({info.frames:,} frames; {path} read in {info.seconds:.2f} s)")
            if rejected is not None:
                self.say(f"(newer snapshot {rejected.name} skipped: {problem}; set aside as "
                         f"{self._set_aside(rejected)})")
            if going_on:
                self.say(going_on[2])
            self.last_saved = self.written_at = self.clock()
            self._saved_mark = _memory_mark(session)  # what that file holds: not written again until it changes
            return session
        session = self._resume_set_aside(runtime, rejected, problem)
        if session is not None:
            return session
        session = runtime.session()
        self._check_budget(session)
        if rejected is None:
            self.say(f"no snapshot in {self.dir}: starting with an empty memory{self._elsewhere()}")
        else:
            aside = self._set_aside(rejected)
            for other in self.generations():
                other.unlink()  # older generations of the memory that was set aside
            self.say(f"starting with an empty memory: {problem}. The old snapshot is kept as {aside}")
        self.last_saved = self.clock()
        return session

    def _resume_set_aside(self, runtime, rejected: Path | None, problem: str | None):
        """The set-aside snapshot resumed when it fits this deployment and no generation does: a config changed and
        changed back (a cache cap tried and reverted) set this deployment's memory aside, then the next start set the
        other deployment's aside over it — the memory there to resume was deleted and the start was empty. Swapped:
        the set-aside file becomes the newest generation and ``rejected`` is set aside in its place. With no
        generation at all (``rejected`` None: the changed config's daemon stopped before its first snapshot, killed or
        powered off) it is resumed too: that start said "no snapshot" beside this deployment's memory. None (nothing
        moved) when there is none or it does not load (another deployment's, damaged, a key no longer held)."""
        from edgekv.privacy import SealError

        for candidate in self.set_aside_files():
            path = self._next_path()
            try:
                check_key(candidate, read_manifest(candidate, getattr(runtime, "keys", None)), runtime)
                os.replace(candidate, path)
                session = load_session(runtime, path)
            except (SnapshotError, SealError):
                if path.exists() and not candidate.exists():
                    os.replace(path, candidate)  # damaged past its manifest: back where it was
                continue
            self._check_budget(session)
            info = session.restored_from
            going_on = self._recording_goes_on(session)
            self.clock_offset = going_on[1] if going_on else self._resume_offset(info, runtime.config.video.max_gap_s)
            if rejected is not None:
                moved = self._set_aside(rejected)
                for other in self.generations():
                    if other != path:
                        other.unlink()  # older generations of the memory that was set aside
            self.say(f"resumed {describe_span(info.stream_s)} of memory, {info.cache_tokens:,} tokens "
                     f"({info.frames:,} frames) from the snapshot set aside earlier, made for this deployment (now "
                     f"{path}); " + (f"the newer one could not be used: {problem}; set aside as {moved}"
                                     if rejected is not None else "no newer snapshot was written"))
            if going_on:
                self.say(going_on[2])
            self.last_saved = self.written_at = self.clock()
            self._saved_mark = _memory_mark(session)
            return session
        return None

    def _recording_goes_on(self, session) -> tuple[float, float, str] | None:
        """Where the recording this start reads (``self.source``) goes on, when the restored memory stopped in it
        (``recording_goes_on``): ``(t, offset, line)``, ``t`` also kept as ``resumed_source_t``. None when the memory
        stopped elsewhere, what the start does then said where it is worth saying."""
        self.resumed_source_t, self.recording_ended = None, False
        going_on = recording_goes_on(self.source, session.counters.extra.get(SOURCE_KEY))
        if going_on is None:
            return None
        if going_on.t is None:
            self.say(going_on.line)
            return None
        self.resumed_source_t, self.recording_ended = going_on.t, going_on.ended
        return going_on.t, going_on.offset, going_on.line

    def _resume_offset(self, info: SnapshotInfo, max_gap_s: float) -> float:
        """A restarted source counts from 0 again; the restored stream continues after its last frame plus
        the wall-clock time the process was down (a 5-minute outage is a 5-minute gap in the video), bounded
        by ``max_gap_s`` when the wall clock jumped in between."""
        last = info.last_source_t if info.last_source_t is not None else info.last_t
        if last is None:
            return 0.0
        down = self.wall() - info.saved_unix if info.saved_unix is not None else 0.0
        if not 0.0 <= down <= max_gap_s:
            bounded = 0.0 if down < 0 else max_gap_s
            # Forward, it is as often a device that was off for a day or a backup of state.dir put back as a clock
            # set late: "a clock set after the snapshot" alone sent the owner of yesterday's backup to check NTP.
            why = (f"the wall clock moved back {describe_span(-down)} between the snapshot and now (a clock set "
                   f"after the snapshot, e.g. by NTP on a board without an RTC battery?)" if down < 0 else
                   f"the snapshot was saved {describe_span(down)} ago by the wall clock (the daemon was down that "
                   f"long, a backup of state.dir was put back, or the clock was set after the snapshot, e.g. by NTP "
                   f"on a board without an RTC battery)")
            self.say(f"{why}: the memory continues {describe_span(bounded)} after its last frame "
                     f"(video.max_gap_s={max_gap_s:g})")
            down = bounded
        return last + down

    def stream_time(self, t: float) -> float:
        """The session's time for a frame the (restarted) source stamped ``t``."""
        return t + self.clock_offset

    def _check_budget(self, session) -> None:
        """Two snapshots of a full cache and the files the keeper leaves alone must fit in ``state.max_mib``; what is
        left is the kept alerts' (their oldest go first when it runs out)."""
        problem = self.budget_problem(estimate_bytes(session))
        if problem is not None:
            raise ValueError(problem)

    def budget_problem(self, full: int) -> str | None:
        """Why ``state.max_mib`` cannot hold two snapshots of ``full`` bytes beside the files already under ``dir``
        (``files_beside``), with the bound that would; None when it can."""
        fixed, _ = self.files_beside()
        if 2 * full + fixed <= self.max_bytes:
            return None
        beside = f" beside the {fixed / 2**20:.2f} MiB of other files in {self.dir}" if fixed >= 2**16 else ""
        least = math.ceil((2 * full + fixed) / 2**20 * 10) / 10  # rounded up: "at least 0" was said of 0.36 MiB
        return (f"state.max_mib={self.section.max_mib:g} cannot hold two snapshots of a full cache "
                f"({full / 2**20:.2f} MiB each){beside}: raise state.max_mib to at least {least:g}, and more for the "
                f"last alerts kept in {ALERT_EVENTS}/ (64 at most, each with its keyframe)")

    # ------------------------------------------------------------------ snapshots
    def maybe_snapshot(self, session, progress: Callable[[], None] | None = None) -> SnapshotInfo | None:
        """A snapshot if ``state.every_s`` has passed since the last one (call it every loop iteration) and the memory
        changed since: a daemon paused, at the end of its stream, waiting for a camera that is gone, or only
        answering questions rewrote the same cache whole every ``every_s`` (224 MiB at the 3B shape: 65 GB a day of
        flash worn for nothing). What counts as a change is everything the snapshot restores but the answer
        counters (questions, answer tokens: statistics; the cache an answer used is as it was)."""
        if not self.enabled:
            return None
        self._watch_beside()
        if self.last_saved is not None and self.clock() - self.last_saved < self.section.every_s:
            return None
        if self._saved_mark is not None and self._saved_mark == _memory_mark(session):
            self.last_saved = self.clock()  # looked at again after every_s
            self.unchanged += 1
            return None
        info = self.snapshot(session, progress)
        if info is not None:
            log.info("state: %s (%.1f MiB, %.0f ms)", info.path.name, info.bytes / 2**20, info.seconds * 1e3)
        return info

    def final_snapshot(self, session, progress: Callable[[], None] | None = None) -> SnapshotInfo | None:
        """The snapshot at stop (SIGTERM, end of the source); says where the memory went. ``progress``: see
        ``write_snapshot`` (the daemon's tells systemd, a step at a time, that the stop goes on)."""
        if not self.enabled:
            return None
        info = self.snapshot(session, progress)
        if info is not None:
            self.say(f"memory saved: {describe_span(info.stream_s)}, {info.cache_tokens:,} tokens in {info.path} "
                     f"({info.bytes / 2**20:.1f} MiB, {info.seconds * 1e3:.0f} ms)")
            return info
        # Said, not only logged: a stop on a full disk printed a warning and the usual summary, and nothing told the
        # operator that the stretch since the last snapshot is gone at the next start.
        kept = self.generations()
        since = f", written {describe_span(self.wall() - kept[-1].stat().st_mtime)} before the stop" if kept else ""
        self.say(f"memory NOT saved at the stop: no snapshot could be written in state.dir {self.dir} "
                 f"({self.last_error}); " + (f"the next start resumes {kept[-1].name}{since}" if kept else
                                              "the next start begins with an empty memory"))
        return None

    FORGET_NOT_HELD = "no snapshot held the window: none rewritten"

    def rewrite_after_forget(self, session, stretches: list[tuple[float, float]] | None = None,
                             progress: Callable[[], None] | None = None) -> dict:
        """After ``session.forget`` of ``stretches`` (stream seconds; None: anywhen): a new snapshot of the session as
        it is now, then every other file under ``state.dir`` that may hold the forgotten window deleted — older
        generations and the set-aside snapshot (made for another deployment, on another stream clock: it cannot be
        rewritten here, nor told whether it holds the window). The generations are rewritten only when one of them
        can hold a frame of ``stretches`` (``_may_hold``): a snapshot is written every ``every_s`` (300 s by default),
        so "forget the last 30 seconds" is usually in none, and rewriting one (224 MiB at the 3B shape) for it wore
        the flash and held the session's lock meanwhile. Then none is written or removed (``"note"`` says so). Returns
        what was written and removed."""
        if not self.enabled:
            return {"snapshot": None, "removed": []}
        keys = getattr(session.runtime, "keys", None)
        if stretches is not None and not any(self._may_hold(path, stretches, keys) for path in self.generations()):
            return {"snapshot": None, "removed": self._remove_aside(), "note": self.FORGET_NOT_HELD}
        info = self.snapshot(session, progress)
        if info is None:
            raise OSError(f"state: the snapshot after forgetting could not be written in {self.dir} "
                          f"({self.last_error}); the older ones are kept (they still hold the window)")
        removed = []
        for old in self.generations():
            if old != info.path:
                old.unlink()
                removed.append(old.name)
        self._written_without = {}
        if stretches is not None:
            self._written_without[info.path.name] = (_identity(info.path), [(float(a), float(b)) for a, b in stretches])
        return {"snapshot": info.path.name, "removed": removed + self._remove_aside()}

    def _remove_aside(self) -> list[str]:
        aside, removed = self.dir / self.ASIDE, []
        if aside.is_dir():
            for old in aside.iterdir():
                old.unlink()
                removed.append(f"{self.ASIDE}/{old.name}")
        return removed

    def _may_hold(self, path: Path, stretches: list[tuple[float, float]], keys) -> bool:
        """Whether the snapshot ``path`` can hold a frame of ``stretches``: its frames were all seen between its first
        frame and its last (``t0`` .. ``last_t``, a frame waiting for its partner at ``pending_t``; the stream clock
        never goes back, edgekv/session/clock.py), less what a forget had just removed when this keeper wrote it. In
        doubt it can: a manifest that does not read (damaged, sealed with a key not held) or times that are not
        numbers."""
        from edgekv.privacy import SealError

        try:
            session = read_manifest(path, keys)["session"]
            identity = _identity(path)
        except (SnapshotError, SealError, OSError):
            return True
        times = [session.get(name) for name in ("t0", "last_t", "pending_t")]
        if not all(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t))
                   for t in times):
            return True
        times = [float(t) for t in times if t is not None]
        if not times:
            return False  # no frame was ever seen in it
        first, last = min(times), max(times)
        known = self._written_without.get(path.name)
        without = known[1] if known is not None and known[0] == identity else []
        return any(not _covered(max(a, first), min(b, last), without) for a, b in stretches if a <= last and b >= first)

    def snapshot(self, session, progress: Callable[[], None] | None = None) -> SnapshotInfo | None:
        """A new generation of the session now, the oldest beyond two removed; None when it could not be written (the
        previous one stays; ``last_error`` says why). ``progress``: see ``write_snapshot``."""
        self.last_saved = self.clock()
        mark = _memory_mark(session)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            for old in self.generations()[:-1]:
                old.unlink()
            estimate = estimate_bytes(session, session.cache.length)
            self._make_room(estimate)
            previous = sum(p.stat().st_size for p in self.generations())
            fixed, _ = self.files_beside()
            needed = estimate + previous + fixed
            if needed > self.max_bytes:
                raise OSError(f"{needed / 2**20:.1f} MiB needed (this snapshot {estimate / 2**20:.1f}, the previous "
                              f"one {previous / 2**20:.1f}, other files in state.dir {fixed / 2**20:.1f}) exceeds "
                              f"state.max_mib={self.section.max_mib:g}")
            info = session.save(self._next_path(), progress)
        except OSError as exc:
            self.failures += 1
            self.last_error = exc.strerror or str(exc)
            log.warning("state: snapshot not written in %s (%s); the previous one stays", self.dir, self.last_error)
            return None
        for old in self.generations()[:-2]:
            old.unlink()
        self._saved_mark = mark
        self.written += 1
        self.written_at = self.clock()
        return info
