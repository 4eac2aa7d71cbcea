"""What an engine bundle was built from, and the check that it fits the deployment that loads it.

A bundle is a directory under ``engines.engine_dir`` named ``<model dir name>-<key>``; ``key`` hashes
everything an engine depends on, so a cache of bundles can hold several models, configs and GPUs side by
side:

* the **model**: a content hash of ``config.json`` and every weight file (random and real weights of one
  shape must not share engines). Hashing 7 GB takes seconds, so digests are remembered per file in
  ``<engine_dir>/hashes.json`` keyed by (path, size, mtime) and recomputed only when a file changes;
* the **config** fields the graphs bake in: frame grid (from ``video.resolution``), cache capacity M, model
  dtype, the largest prefill chunk, the graph format version, and — for ``tensorrt`` — the precision;
* for ``tensorrt`` also the **TensorRT version** and the **GPU** (name and compute capability): a plan file
  only runs on the TensorRT build and the GPU model it was built for.

``manifest.json`` inside the bundle records all of it plus the files built and their digests. Loading
checks each recorded field against the running deployment and, on any difference, raises
:class:`EngineMismatchError` naming the field, both values and the ``edgekv build`` command that rebuilds.

An input only a build reads may be gone when the engines load: the INT8 calibration clip, deleted after
provisioning. Its field cannot be computed then (``BuildKey.unverified``), so a load takes the bundle whose other
fields fit — the one built from the same configured path, the newest of those — says once in the log that the
input is missing and that a rebuild needs it, and runs. A clip that is there with other content still mismatches.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from edgekv.model.checkpoint_hash import NotACheckpoint, file_digest, read_memo, write_memo
from edgekv.model.checkpoint_hash import model_hash as checkpoint_hash

__all__ = ["DamagedEngineError", "EngineError", "EngineMismatchError", "file_digest", "model_hash", "read_memo",
           "write_memo"]

log = logging.getLogger(__name__)

GRAPH_FORMAT = 2  # bump when the graphs' inputs/outputs or semantics change (2: one llm graph)
MANIFEST = "manifest.json"


class EngineError(ValueError):
    """An engine cannot be used; the message says what to run to fix it."""


class EngineMismatchError(EngineError):
    """A bundle exists but was built for another model, config, TensorRT version or GPU."""


class DamagedEngineError(EngineError):
    """A bundle's file is missing, truncated or not the one its manifest lists."""


def rebuild_hint(model_dir: str | Path, config, backend: str) -> str:
    """The ``edgekv build`` command that builds engines for ``config`` (an ``EdgeKVConfig`` or a file path):
    ``--config FILE`` when it came from a file, else its non-default keys as ``--set`` (a config made in
    Python, e.g. ``Runtime.from_pretrained(d, cache={...})``), so the command runs as printed."""
    import shlex

    source = getattr(config, "source", config)
    command = f"edgekv build --model {shlex.quote(str(model_dir))}"
    if source and Path(str(source)).is_file():
        command += f" --config {shlex.quote(str(source))}"
    elif hasattr(config, "assignments"):
        keep = ("model.", "video.", "cache.", "engines.")
        command += "".join(f" --set {shlex.quote(a)}" for a in config.assignments(skip=("model.path",))
                           if a.startswith(keep))
    return f"build the engines with: {command} --backend {backend}"


def model_hash(model_dir: Path, memo_file: Path | None = None) -> str:
    """Content hash of a checkpoint directory (``edgekv.model.checkpoint_hash``, shared with the snapshots)."""
    try:
        return checkpoint_hash(model_dir, memo_file)
    except NotACheckpoint as exc:
        raise EngineError(str(exc)) from None


@dataclass(frozen=True)
class BuildKey:
    """The fields an engine bundle depends on (see the module docstring)."""

    backend: str  # onnxruntime | tensorrt
    model_hash: str
    grid_thw: tuple[int, int, int]  # vision grid of one frame pair, in patches
    cache_tokens: int  # M
    dtype: str  # fp32 | fp16 | bf16: the graphs' I/O dtype (= the KV cache's)
    max_chunk_tokens: int  # the largest prefill chunk the LLM engine accepts
    precision: str | None = None  # tensorrt only: fp16 | bf16 | fp32 | int8 | fp8
    tensorrt_version: str | None = None
    gpu: str | None = None  # "NVIDIA H100 80GB HBM3 (sm_90)"
    graph_format: int = GRAPH_FORMAT
    kv_dtype: str | None = None  # "int8": the llm graph takes an 8-bit cache (codes + scales); None: model dtype
    tf32: bool | None = None  # tensorrt fp32 engines: False, TF32 cleared (IEEE FP32); None: the builder's default
    int8: str | None = None  # tensorrt int8: "qdq" (explicit, TensorRT >= 10.1) | "calibrator" (implicit, 10.0)
    int8_calibration: str | None = None  # tensorrt int8: digest of the calibration input (int8_qdq.calibration_digest)
    int8_float_products: tuple[str, ...] | None = None  # int8 qdq: block products left in float (sorted)
    # (field, input as configured, why): fields whose input a build reads is gone now (the calibration clip), so
    # their value above is a placeholder; ``locate`` compares the other fields. Not a key field itself.
    unverified: tuple[tuple[str, str, str], ...] = ()

    def fields(self) -> dict:
        return {
            "backend": self.backend, "model_hash": self.model_hash, "grid_thw": list(self.grid_thw),
            "cache_tokens": self.cache_tokens, "dtype": self.dtype, "max_chunk_tokens": self.max_chunk_tokens,
            "precision": self.precision, "tensorrt_version": self.tensorrt_version, "gpu": self.gpu,
            "graph_format": self.graph_format,
            **({"kv_dtype": self.kv_dtype} if self.kv_dtype is not None else {}),  # absent: bundles before it match
            **({"tf32": self.tf32} if self.tf32 is not None else {}),  # fp32 plans built with TF32 on do not match
            **({"int8": self.int8} if self.int8 is not None else {}),  # int8 plans of the calibrator are not Q/DQ ones
            **({"int8_calibration": self.int8_calibration} if self.int8_calibration is not None else {}),
            **({"int8_float_products": list(self.int8_float_products)} if self.int8_float_products is not None else {}),
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.fields(), sort_keys=True).encode()).hexdigest()[:16]

    def bundle_dir(self, engine_dir: Path, model_name: str) -> Path:
        return engine_dir / f"{model_name}-{self.backend}-{self.digest()}"


# What each key field is called in the user's terms, for error messages.
_FIELD_NAMES = {
    "backend": "backend",
    "model_hash": "model weights (content hash of model.path)",
    "grid_thw": "frame grid [T, H, W] in patches (video.resolution)",
    "cache_tokens": "cache capacity M in tokens (cache.max_tokens / cache.max_mib)",
    "dtype": "graph dtype (model.dtype)",
    "max_chunk_tokens": "largest prefill chunk (engines.max_chunk_tokens)",
    "precision": "TensorRT precision (engines.precision)",
    "tensorrt_version": "TensorRT version",
    "gpu": "GPU",
    "graph_format": "edgekv graph format",
    "kv_dtype": "cache storage the LLM graph takes (cache.kv_dtype; None: model.dtype)",
    "tf32": "TensorRT's TF32 for fp32 math (False: IEEE fp32; None: TensorRT's default, on)",
    "int8": "INT8 method ('qdq': explicit Q/DQ vision graph, TensorRT >= 10.1; 'calibrator': implicit, 10.0)",
    "int8_calibration": "INT8 calibration frames (digest of engines.int8_calibration: the spec or the file's content, "
                        "and video.fps)",
    "int8_float_products": "ViT products left in float in the INT8 vision graph (engines.int8_float_products)",
}


def differences(built: dict, wanted: dict, skip: tuple[str, ...] = ()) -> list[str]:
    """Human-readable differences between a manifest's key fields and the deployment's (but those in ``skip``)."""
    out = []
    for name in dict.fromkeys([*_FIELD_NAMES, *built, *wanted]):  # every key field, named or not: none is skipped
        if name in skip:
            continue
        label = _FIELD_NAMES.get(name, name)
        a, b = built.get(name), wanted.get(name)
        if a != b:
            if name == "model_hash":
                a, b = str(a)[:12], str(b)[:12]
            out.append(f"{label}: built for {a!r}, this deployment has {b!r}")
    return out


@dataclass
class Manifest:
    key: dict
    model_dir: str
    files: dict = field(default_factory=dict)  # graph name -> {file, sha256, bytes, inputs, outputs, ...}
    versions: dict = field(default_factory=dict)
    created: str = ""
    build_s: float = 0.0
    inputs: dict = field(default_factory=dict)  # key field -> its input as configured (the calibration clip's path)

    def write(self, bundle: Path) -> Path:
        path = bundle / MANIFEST
        data = {"edgekv_manifest": 1, "created": self.created or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "model_dir": self.model_dir, "key": self.key, "files": self.files, "versions": self.versions,
                "build_s": round(self.build_s, 3), **({"inputs": self.inputs} if self.inputs else {})}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
        return path

    @classmethod
    def read(cls, bundle: Path) -> Manifest:
        path = bundle / MANIFEST
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise EngineError(f"{path}: no manifest — not an edgekv engine bundle") from None
        except (OSError, ValueError) as exc:
            raise EngineError(f"{path}: unreadable manifest ({exc})") from None
        if data.get("edgekv_manifest") != 1 or not isinstance(data.get("key"), dict):
            raise EngineError(f"{path}: not an edgekv manifest (format {data.get('edgekv_manifest')!r})")
        return cls(key=data["key"], model_dir=data.get("model_dir", ""), files=data.get("files", {}),
                   versions=data.get("versions", {}), created=data.get("created", ""),
                   build_s=float(data.get("build_s", 0.0)),
                   inputs=data.get("inputs") if isinstance(data.get("inputs"), dict) else {})

    def path_of(self, bundle: Path, graph: str) -> Path:
        entry = self.files.get(graph)
        if entry is None:
            raise EngineError(f"{bundle / MANIFEST}: the bundle has no {graph!r} graph (has: {', '.join(self.files)})")
        return bundle / entry["file"]


def locate(engine_dir: Path, model_dir: Path, key: BuildKey, hint: str) -> tuple[Path, Manifest]:
    """The bundle built for ``key``, or an error that says what exists instead and how to rebuild.

    ``engine_dir`` may also be a bundle itself (a directory holding ``manifest.json``, e.g. engines built
    elsewhere and copied in): then its manifest must match ``key`` field by field. So may a bundle of this cache
    under another folder name (copied in, renamed, or built from the checkpoint under another folder name): its
    manifest is what it was built for, not its name. Fields of ``key.unverified`` (an input a build reads is
    gone) are not compared; the log says so once (see the module docstring).
    """
    wanted = key.fields()
    skip = tuple(name for name, _, _ in key.unverified)
    gone = "".join(f" ({_INPUT_NAMES.get(name, name)}: {why}; building the engines again needs it.)"
                   for name, _, why in key.unverified)

    def diff(built: dict) -> list[str]:
        return differences(built, wanted, tuple(name for name in skip if name in built))

    if (engine_dir / MANIFEST).is_file():
        bundle = engine_dir
    else:
        bundle = key.bundle_dir(engine_dir, model_dir.name)
        if not (bundle / MANIFEST).is_file():
            bundle = _fitting(engine_dir, key, diff, bundle, f"{gone} {hint}".strip())
    manifest = Manifest.read(bundle)
    found = diff(manifest.key)
    if found:
        raise EngineMismatchError(f"engines in {bundle} do not fit this deployment — " + "; ".join(found) +
                                  f".{gone} {hint}")
    check_files(bundle, manifest, hint, engine_dir / "hashes.json")
    for name, source, why in key.unverified:
        _say_once(name, bundle, f"{_INPUT_NAMES.get(name, name)}: {why}; the engines in {bundle} built from "
                                f"{manifest.inputs.get(name, 'it')} are used as they are (their other build inputs "
                                f"fit this deployment). Building them again (`edgekv build --force`, another "
                                f"config) needs it back.")
    return bundle, manifest


# What the config calls the input of a key field that ``BuildKey.unverified`` can name.
_INPUT_NAMES = {"int8_calibration": "engines.int8_calibration"}
_said: set[tuple[str, str]] = set()  # (field, bundle) already logged by this process: the log says it once


def _say_once(name: str, bundle: Path, message: str) -> None:
    if (name, str(bundle)) not in _said:
        _said.add((name, str(bundle)))
        log.warning("%s", message)


def _fitting(engine_dir: Path, key: BuildKey, diff, expected: Path, hint: str) -> Path:
    """The bundle under ``engine_dir`` that ``diff`` finds no difference in, by manifest, whatever its folder's
    name. Among several (only possible with ``key.unverified`` fields, or copies): the ones built from the
    configured inputs, the newest of those. Else an error naming the nearest bundle's differences."""
    candidates = []
    for path in sorted(engine_dir.glob(f"*/{MANIFEST}")) if engine_dir.is_dir() else []:
        try:
            other = Manifest.read(path.parent)
        except EngineError:
            continue
        if other.key.get("backend") == key.backend:
            candidates.append((diff(other.key), path.parent, other))
    if not candidates:
        raise EngineError(f"no {key.backend} engines built for this model and config under {engine_dir} "
                          f"(expected {expected}). {hint}")
    fitting = [(bundle, other) for found, bundle, other in candidates if not found]
    if not fitting:
        found, nearest, _ = min(candidates, key=lambda item: (len(item[0]), str(item[1])))
        raise EngineMismatchError(f"no {key.backend} engines for this deployment under {engine_dir}; the nearest "
                                  f"bundle {nearest} differs — " + "; ".join(found) + f". {hint}")

    def preference(item: tuple[Path, Manifest]) -> tuple[int, int, str]:
        bundle, other = item
        same = sum(other.inputs.get(name) == source for name, source, _ in key.unverified)
        return same, (bundle / MANIFEST).stat().st_mtime_ns, str(bundle)

    return max(fitting, key=preference)[0]


def check_files(bundle: Path, manifest: Manifest, hint: str, memo_file: Path | None = None) -> None:
    """Every file the manifest lists is there, of its size and its sha256 (an engine file replaced by one of the
    same size — another build's, a partial copy written over it, flash that flipped a byte — loaded and ran
    without a word). Digests are remembered in ``memo_file`` by size and mtime, as the checkpoint's are, so only
    a file written since its last check is read whole again."""
    memo = read_memo(memo_file)
    for graph, entry in manifest.files.items():
        path = bundle / entry["file"]
        if not path.is_file():
            raise DamagedEngineError(f"{path}: engine file missing ({graph} graph listed in {bundle / MANIFEST}). "
                                     f"{hint}")
        if "bytes" in entry and path.stat().st_size != entry["bytes"]:
            raise DamagedEngineError(f"{path}: engine file is {path.stat().st_size} bytes, the manifest says "
                                     f"{entry['bytes']} (truncated or replaced). {hint}")
        if "sha256" in entry and file_digest(path, memo) != entry["sha256"]:
            write_memo(memo_file, memo)
            raise DamagedEngineError(f"{path}: engine file's sha256 is not the one in {bundle / MANIFEST} (changed "
                                     f"since the build: replaced or damaged). {hint}")
    write_memo(memo_file, memo)
