"""``edgekv-camera --config X.yaml --check``: the start's checks, every one, without loading the model.

The daemon already checks at start, before the model loads, everything it can (``Daemon.preflight_steps``: the
config, the files it names, its folders, the port, the certificates, the fleet's settings, the video source) and
stops at the first mistake. On a Jetson that start then loads a 3B model for a minute or more, and a restart after
an edited config takes the robot's memory offline for as long; a mistake found then costs that downtime, one
mistake at a time. ``--check`` is the operator's ``nginx -t``: every step run and said, ``ok`` / ``note`` /
``FAIL``, exit 0 when the daemon would start and 2 when it would not — run beside the daemon already serving,
before ``systemctl restart``.

Beside a running daemon two steps find its own holds, not mistakes: its ``state.dir`` lock and its port. Each is a
``note`` naming the holder (the lock's pid; an edgekv answering ``/healthz`` on the port), which the restart takes
over. What only the check does: one frame read from the video source (a camera that opens but never delivers is
found too: ``READ_BOUND_S``), the cache's budget as the session checks it once the model has loaded
(``PlannedBudget``: from config.json and tokenizer.json, no weights; an ``archive.top_k`` too large for the cap is
named with the one that fits), archive segments a newer edgekv wrote, a TCP connection to the fleet's broker, and what
the start will do with the memory saved under ``state.dir`` (``memory_result``): resume it, or set it aside because
the config no longer fits it (the cameras or their weights, the cap, the model, the prompt), said before the restart;
resumed, where the recording it stopped in goes on (the start's own line: at its time, ended, or from its start).
The engine bundles ``engines.vision`` / ``engines.llm`` name are found and checked as the start's load finds them
(``engines_result``: key, manifest, every file's size and sha256), none loaded.
Nothing is written but what the start's checks make (the folders, ``state.dir``'s lock file) and the file digests the
engines' lookup memoizes in ``engines.engine_dir``/hashes.json, as the start's does (a multi-GB plan is read whole once,
not by the check and again by the start): no log line to ``logging.file``, no snapshot, no frame.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CheckResult", "READ_BOUND_S", "check_daemon", "run_check"]

READ_BOUND_S = 20.0  # a source that opened: its first frame within this long (a network stream's timeout is 10 s)
CONNECT_BOUND_S = 5.0


@dataclass(frozen=True)
class CheckResult:
    key: str
    status: str  # ok | note | FAIL
    detail: str = ""


def check_daemon(daemon: Any, deployment: Any = None, camera: str | None = None,
                 seen: dict[str, Any] | None = None, shared: tuple[str, Any] | None = None) -> list[CheckResult]:
    """Every preflight step of ``daemon`` (an ``apps.daemon.loop.Daemon``), each said, then what its start will do
    with the memory under ``state.dir``; the folder lock and the source it opened are let go again. ``deployment``:
    the whole config (its ``video.sources``), ``camera``: which of them ``daemon`` is. ``seen`` (filled when given):
    the first frame's shape (``frame_shape``) and the grid of the memory the start resumes (``resumed``). ``shared``:
    the first camera's name and config when ``daemon`` is a later one of ``video.sources``, whose engines it runs."""
    from edgekv.apps.daemon.startup import one_line

    daemon.checking = True
    results: list[CheckResult] = []
    seen = {} if seen is None else seen  # the first frame's shape (``video.resolution`` null: it fixes the grid)
    try:
        for key, step in daemon.preflight_steps():
            try:
                found = step()
            except (ValueError, OSError, RuntimeError, ImportError) as exc:
                results.append(_held_by_the_running_daemon(daemon, key, exc)
                               or CheckResult(key, "FAIL", one_line(exc)))
                continue
            results.append(_found(daemon, key, found, seen))
    finally:
        daemon.state.release()
        source = getattr(daemon, "_source", None)
        if source is not None:
            source.close()
    plan: Any = None  # what the start does with the memory under state.dir (RestorePlan, or why not known)
    if daemon.config.state.dir is not None:
        daemon.state.source = _source_record(daemon)  # as the start sets it before its restore
        plan = restore_plan(daemon.state, daemon.config)
    snapshot = resumed_snapshot(daemon.state, daemon.config, plan)
    resumed = seen["resumed"] = resumed_grid(daemon.config, snapshot)
    if not any(result.key == "model.path" and result.status == "FAIL" for result in results):
        results += [engines_result(daemon.config, shared, deployment),  # as the start's Runtime finds them
                    budget_result(daemon.config, seen.get("frame_shape"), resumed)]
    if daemon.config.archive.dir is not None:
        newer = newer_result(daemon.config.archive.dir)
        if newer is not None:
            results.append(newer)
    if daemon.config.state.dir is not None:
        results += [bound_result(daemon.state, daemon.config, snapshot),
                    memory_result(daemon.state, daemon.config, deployment, camera, plan)]
        kept = daemon._kept_pause()
        if kept is not None:  # the privacy switch was on at the last stop: the start keeps the camera closed
            results.append(CheckResult("privacy pause", "note", f"paused ({kept}) at the last stop: the start keeps "
                                       "the camera closed and ingests nothing until POST /v1/privacy/resume (or "
                                       "'resume' said); questions are answered about what was seen"))
    return results


def bound_result(keeper: Any, config: Any, resumed: tuple[str, dict] | None = None) -> CheckResult:
    """``state.max_mib`` against two snapshots of a full cache (``StateKeeper.budget_problem``, the start's check,
    sized from the checkpoint's config.json): a bound too small passed ``--check`` and stopped the start once the
    model had loaded. ``resumed`` (``resumed_snapshot``): a memory resumed with a frame waiting for its partner has
    it in every snapshot until that pair comes, and the start sizes the snapshots with it (a 1920x1080 camera's 6 MB:
    ``state.max_mib`` passed here for the cache alone, and the restart was refused)."""
    from edgekv.apps.daemon.startup import one_line
    from edgekv.state import planned_full_bytes

    try:
        full = planned_full_bytes(config)
    except (ValueError, OSError, KeyError) as exc:  # model.path's own step names what is wrong with it
        return CheckResult("state.max_mib", "note", f"not compared (the cache's size: {one_line(exc)})")
    pending = _pending_bytes(resumed)
    full = _with_pending(full, pending)
    waiting = (f" with the frame waiting for its partner in {resumed[0]} ({pending / 2**20:.2f} MiB), which the "
               "start resumes" if pending else "")
    problem = keeper.budget_problem(full)
    if problem is not None:
        return CheckResult("state.max_mib", "FAIL", problem + (f" ({waiting.strip()})" if waiting else ""))
    fixed, alerts = keeper.files_beside()
    left = keeper.max_bytes - 2 * full - fixed
    return CheckResult("state.max_mib", "ok", f"two snapshots of a full cache ({full / 2**20:.2f} MiB each{waiting}) "
                                              f"fit in {keeper.section.max_mib:g} MiB; {left / 2**20:.2f} MiB left for "
                                              f"the kept alerts ({len(alerts)} there now) and a snapshot set aside")


def _with_pending(full: int, pending: int) -> int:
    """``edgekv.state.estimate_bytes`` of a full cache's snapshot (``full``, without a waiting frame) with a waiting
    frame of ``pending`` bytes: its section is the last before the manifest, aligned as the writer aligns it."""
    from edgekv.privacy import sealed_size
    from edgekv.state import _MANIFEST_ALLOWANCE, _TRAILER, _aligned

    if not pending:
        return full
    tail = sealed_size(_MANIFEST_ALLOWANCE) + _TRAILER.size
    return _aligned(full - tail) + sealed_size(pending) + tail


ENGINES_KEY = "engines"


def engines_result(config: Any, shared: tuple[str, Any] | None = None, deployment: Any = None) -> CheckResult:
    """The engine bundles the start loads, found and checked as its load finds and checks them
    (``edgekv.runtime.find_engines``: the build key, the manifest, every file's size and sha256, digests memoized in
    ``engines.engine_dir`` as the start memoizes them), no engine loaded: ``ok`` naming each bundle, when it was built
    and for what; ``FAIL`` with the start's own message (no bundle, one built for another model, config, TensorRT
    version or GPU, a damaged file; with the ``edgekv build`` command that fixes it); a ``note`` when torch runs both
    (no engines). Before, ``--check`` passed an empty ``engines.engine_dir`` that stopped the start.

    ``shared`` (a later camera of ``video.sources``: the first camera's name and config): the start loads the engines
    once, for the first camera, and every camera runs them (``Runtime.sharing``); an LLM engine takes the cache size
    it was built for, and a camera whose weight gives it another stopped the start though each camera's own bundle
    was there; the start now refuses cameras that cannot share them before the weights load (``engines_config``
    of ``deployment``, the whole config), said here on the later camera's row in its words."""
    from edgekv.apps.daemon.cameras import engines_config
    from edgekv.apps.daemon.startup import one_line
    from edgekv.runtime import find_engines

    engines = config.engines
    if engines.vision == "torch" and engines.llm == "torch":
        return CheckResult(ENGINES_KEY, "note", "torch runs the vision tower and the LLM from model.path: no engines "
                                                "to find (engines.vision / engines.llm: onnxruntime or tensorrt run "
                                                "the ones `edgekv build` makes)")
    if shared is not None and deployment is not None:
        try:
            engines_config(deployment)
        except ValueError as exc:
            return CheckResult(ENGINES_KEY, "FAIL", one_line(exc))
    try:
        found = find_engines(config if shared is None else shared[1])
    except (ValueError, OSError, RuntimeError, ImportError) as exc:  # what stops the start (Daemon.run)
        if shared is not None:  # said on the first camera's row, where the start stops
            return CheckResult(ENGINES_KEY, "note", f"runs the engines loaded for {shared[0]!r}, not found (above)")
        return CheckResult(ENGINES_KEY, "FAIL", one_line(exc))
    if shared is not None:
        return _shared_result(config, shared[0], found)
    texts = [_bundle_text(backend, [part for part in ("vision", "llm") if getattr(engines, part) == backend],
                          bundle, manifest, gone) for backend, bundle, manifest, gone in found]
    if engines.vision == "torch" or engines.llm == "torch":
        texts.append(f"{'vision' if engines.vision == 'torch' else 'llm'}: torch (from model.path)")
    return CheckResult(ENGINES_KEY, "note" if any(gone for *_, gone in found) else "ok", "; ".join(texts))


def _shared_result(config: Any, first: str, found: list) -> CheckResult:
    """A later camera on the engines loaded for the ``first`` camera (``found``): its cache must be the size their LLM
    engine takes (``engines.runner.GraphLLM``: "built for a cache of N slots; this session's cache has M")."""
    from edgekv.state import _planned_cache

    bundles = ", ".join(str(bundle) for _, bundle, _, _ in found)
    llm = next((manifest for backend, _, manifest, _ in found if backend == config.engines.llm), None)
    capacity = _planned_cache(config)[4]
    if llm is not None and llm.key.get("cache_tokens") != capacity:
        built, backend = llm.key.get("cache_tokens"), config.engines.llm
        return CheckResult(ENGINES_KEY, "FAIL", f"the cameras run one set of engines, loaded for {first!r} "
                                                f"({bundles}), whose {backend} LLM engine takes a cache of {built} "
                                                f"tokens; this camera's share of the cache cap is {capacity} tokens: "
                                                f"the start stops at it (\"the {backend} LLM engine was built for a "
                                                f"cache of {built} slots; this session's cache has {capacity}\"), "
                                                "whatever bundles are built. Give the cameras equal video.sources "
                                                "weights (one cache size), or run engines.llm: torch")
    return CheckResult(ENGINES_KEY, "ok", f"runs the engines loaded for {first!r} ({bundles})")


def _bundle_text(backend: str, parts: list[str], bundle: Path, manifest: Any,
                 gone: tuple[tuple[str, str, str], ...]) -> str:
    """A found bundle, said: which, built when, for what, its files; a build input a rebuild needs that is gone."""
    from edgekv.archive.store import size_text

    key = manifest.key
    trt = (f", {key.get('precision')} precision, TensorRT {key.get('tensorrt_version')} on {key.get('gpu')}"
           if backend == "tensorrt" else "")
    stored = f" stored {key.get('kv_dtype')}" if key.get("kv_dtype") else ""
    size = sum(int(entry.get("bytes", 0)) for entry in manifest.files.values())
    missing = "".join(f"; engines.{name}: {why}: the engines are used as they are, building them again needs it"
                      for name, _, why in gone)
    return (f"{backend} ({' and '.join(parts)}): {bundle}, built {manifest.created or 'at an unknown time'} for grid "
            f"{key.get('grid_thw')} (T, H, W patches), a cache of {key.get('cache_tokens')} tokens{stored}, "
            f"{key.get('dtype')}, chunks up to {key.get('max_chunk_tokens')} tokens{trt}; {len(manifest.files)} "
            f"graph file(s), {size_text(size)}, each of the size and sha256 its manifest lists{missing}")


BUDGET_KEY = "cache budget"


class PlannedBudget:
    """What the session's budget check (``StreamSession._check_budget``: the prefix, two frame pairs, the text reserve
    and the retrieval reserve under the cap, then the policy's own check, and with an archive the ``archive.top_k``
    that fits) reads of a session, from the config, the checkpoint's ``config.json`` and ``tokenizer.json`` alone: no
    weights. The check run on it is the session's own, so ``--check`` says what the start would refuse, word for word
    (it passed an ``archive.top_k`` the start then refused). ``frame_shape``: the first frame's, which fixes the grid
    when ``video.resolution`` is null (None then: checked at the first frame, as the session does); ``resumed``: the
    grid of the memory the start resumes (``resumed_grid``), which the restored session keeps instead."""

    def __init__(self, config: Any, frame_shape: tuple[int, ...] | None = None,
                 resumed: tuple[int, int] | None = None) -> None:
        from edgekv.archive.recall import RetrievalReserve
        from edgekv.model.config import ModelConfig
        from edgekv.policies import make_policy
        from edgekv.preprocess import FramePreprocessor
        from edgekv.runtime import _policy_kwargs
        from edgekv.state import _planned_cache
        from edgekv.tokenizer import ChatLayout, QwenTokenizer

        model_dir, _, _, _, self.capacity = _planned_cache(config)
        vision = ModelConfig.from_dir(model_dir).vision
        self.text_reserve = int(config.cache.text_reserve_tokens)
        self.sink_budget = int(config.cache.sinks)
        self.policy = make_policy(config.cache.policy, **_policy_kwargs(config))
        tokenizer = QwenTokenizer.from_dir(model_dir)
        self.prefix_tokens = len(tokenizer.encode(ChatLayout(config.model.system_prompt).stream_prefix()))
        resolution = start_grid(config, frame_shape, resumed)
        self.preprocessor = None if resolution is None else FramePreprocessor(
            resolution=tuple(resolution), patch_size=vision.patch_size, temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size, resize=config.video.resize)
        self.recall = RetrievalReserve(self, config.archive.top_k) if config.archive.dir is not None else None

    @property
    def video_limit(self) -> int:
        from edgekv.session.stream import StreamSession

        return StreamSession.video_limit.fget(self)

    @property
    def recall_reserve(self) -> int:
        from edgekv.session.stream import StreamSession

        return StreamSession.recall_reserve.fget(self)

    @property
    def tokens_per_pair(self) -> int:
        return self.preprocessor.tokens_per_pair

    def _check_room(self) -> None:
        from edgekv.session.stream import StreamSession

        StreamSession._check_room(self)

    def check(self) -> None:
        """The start's checks of the budget: a ``ValueError`` with the session's own message, or nothing."""
        from edgekv.session.stream import StreamSession

        StreamSession._check_budget(self)  # (a policy that needs sinks without any: refused by the config already)

    def text(self) -> str:
        """The budget that passed, in tokens."""
        recall = (f", the retrieval reserve {self.recall_reserve} (archive.top_k={self.recall.top_k})"
                  if self.recall is not None else "")
        height, width = self.preprocessor.resolution
        return (f"{self.capacity:,} tokens hold the prefix {self.prefix_tokens}, the text reserve {self.text_reserve}"
                f"{recall} and {(self.video_limit - self.prefix_tokens) // self.tokens_per_pair} frame pairs of "
                f"{self.tokens_per_pair} tokens ({width}x{height})")


def start_grid(config: Any, frame_shape: tuple[int, ...] | None = None,
               resumed: tuple[int, int] | None = None) -> tuple[int, int] | None:
    """The frame grid (height, width) the start's session uses: ``video.resolution``; null, the grid of the memory
    it resumes (``resumed``), else ``Runtime.make_preprocessor``'s for the first frame (its shape ``frame_shape``);
    None when neither is known."""
    from types import SimpleNamespace

    from edgekv.model.builtin import resolve_model_path
    from edgekv.preprocess import smart_resize
    from edgekv.runtime import Runtime

    resolution = config.video.resolution or resumed  # a restored stream keeps its grid (resolution null)
    if resolution is None and frame_shape is not None:
        model_dir = Path(resolve_model_path(config.model.path)).expanduser()
        low, high = Runtime.pixel_limits(SimpleNamespace(model_dir=model_dir))
        resolution = smart_resize(frame_shape[0], frame_shape[1], min_pixels=low, max_pixels=high)
    return None if resolution is None else (int(resolution[0]), int(resolution[1]))


def budget_result(config: Any, frame_shape: tuple[int, ...] | None = None,
                  resumed: tuple[tuple[int, int], str] | None = None) -> CheckResult:
    """The start's budget check on ``config`` (``PlannedBudget``): ``FAIL`` with the message the start would stop
    with, or ``ok`` with the budget; a ``note`` when it cannot be checked here (a model folder the steps above
    refused, ``video.resolution`` null and no frame read). ``resumed``: the grid of the memory the start resumes and
    its snapshot's name (``resumed_grid``): with ``video.resolution`` null the budget is that grid's, not the frame's
    (the memory of a 160x120 camera resumed beside a 1280x720 one now: the frames are scaled to the memory's grid,
    and the check had failed the 1280x720 grid that the start never uses)."""
    from edgekv.apps.daemon.startup import one_line

    try:
        planned = PlannedBudget(config, frame_shape, resumed[0] if resumed is not None else None)
    except (ValueError, OSError, KeyError) as exc:
        return CheckResult(BUDGET_KEY, "note", f"not checked ({one_line(exc)})")
    if planned.preprocessor is None:
        return CheckResult(BUDGET_KEY, "note", "video.resolution null and no frame read: the first frame fixes the "
                                               "grid and the budget is checked then")
    whence = ""
    if resumed is not None and config.video.resolution is None:
        (height, width), name = resumed
        frame = (f"; the camera's {frame_shape[1]}x{frame_shape[0]} frames are scaled to it"
                 if frame_shape is not None else "")
        whence = (f" — {width}x{height} is the grid of the memory resumed from {name} (video.resolution null: the "
                  f"restored stream keeps its grid{frame}; a video.resolution set to another grid sets that memory "
                  "aside)")
    try:
        planned.check()
    except ValueError as exc:
        return CheckResult(BUDGET_KEY, "FAIL", one_line(exc) + whence)
    return CheckResult(BUDGET_KEY, "ok", planned.text() + whence)


def newer_result(folder: Any) -> CheckResult | None:
    """Archive segments a newer edgekv wrote under ``folder`` (``edgekv.archive.store.newer_segments``), named with
    what the archive does with them: the start goes on (a ``note``); None when there are none."""
    from edgekv.archive.store import newer_segments_text

    text = newer_segments_text(folder)
    return CheckResult("archive.dir newer segments", "note", text) if text else None


MEMORY_KEY = "state.dir memory"


def restore_plan(keeper: Any, config: Any) -> Any:
    """``StateKeeper.plan_restore`` for ``config``: the ``RestorePlan``, or the one-line reason it could not be made
    (a ``str``: a bad key, model or folder, which the steps above name)."""
    from edgekv.apps.daemon.startup import one_line
    from edgekv.privacy import SealError
    from edgekv.runtime import deployment_keys

    try:
        return keeper.plan_restore(config, deployment_keys(config))
    except (ValueError, OSError, KeyError, SealError) as exc:
        return one_line(exc)


def resumed_snapshot(keeper: Any, config: Any, plan: Any) -> tuple[str, dict] | None:
    """The file name and manifest of the snapshot the start resumes (``plan``: ``restore_plan``'s answer): the newest
    generation that reads, or the one set aside earlier that fits. Read from the manifests only (the trailer and the
    JSON at the file's end: no tensor); None when the start resumes nothing."""
    from edgekv.privacy import SealError
    from edgekv.runtime import deployment_keys
    from edgekv.state import SnapshotError, key_differences, planned_key, read_manifest

    if getattr(plan, "action", None) not in ("resume", "resume_set_aside"):
        return None
    try:
        keys = deployment_keys(config)
        wanted = planned_key(config) if plan.action == "resume_set_aside" else None
    except (ValueError, OSError, KeyError, SealError):
        return None
    candidates = list(reversed(keeper.generations())) if wanted is None else keeper.set_aside_files()
    for path in candidates:
        try:
            manifest = read_manifest(path, keys)
        except (SnapshotError, SealError):  # as plan_restore: a damaged generation is skipped for an older one
            continue
        if wanted is None or not key_differences(manifest["key"], wanted):
            return path.name, manifest
    return None


def resumed_grid(config: Any, resumed: tuple[str, dict] | None) -> tuple[tuple[int, int], str] | None:
    """The frame grid the start takes from the memory it resumes (``resumed_snapshot``), and that snapshot's file
    name: with ``video.resolution`` null a restored session keeps the grid its stream had
    (``edgekv.state._fill_session``), whatever size the camera's frames are now. None when the config fixes the
    grid, the start resumes nothing, or the memory was saved before its first frame."""
    if config.video.resolution is not None or resumed is None:
        return None
    grid = resumed[1]["key"].get("resolution")
    if (isinstance(grid, list) and len(grid) == 2
            and all(isinstance(side, int) and not isinstance(side, bool) and side > 0 for side in grid)):
        return (grid[0], grid[1]), resumed[0]
    return None


def _pending_bytes(resumed: tuple[str, dict] | None) -> int:
    """The bytes of the frame waiting for its partner that the resumed snapshot holds (the camera's frame as it came:
    6 MB at 1920x1080), 0 without one."""
    entry = resumed[1]["tensors"].get("pending_frame") if resumed is not None else None
    size = entry.get("bytes") if isinstance(entry, dict) else None
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 0


def memory_result(keeper: Any, config: Any, deployment: Any = None, camera: str | None = None,
                  plan: Any = None) -> CheckResult:
    """What the start will do with the saved memory (``StateKeeper.plan_restore``; ``plan``: ``restore_plan``'s
    answer, made here when not given): ``ok`` when it resumes it or there is none, a ``note`` when it will be set
    aside (the start goes on, empty), naming what changed and where the memory goes. With several cameras a changed
    cap is explained by the cameras' shares."""
    plan = restore_plan(keeper, config) if plan is None else plan
    if isinstance(plan, str):
        return CheckResult(MEMORY_KEY, "note", f"not compared with the snapshots ({plan})")
    detail = plan.text
    if "cache_capacity" in plan.differences and deployment is not None and deployment.video.sources:
        detail += f". {_share_text(deployment, camera)}"
    if plan.recording is not None:  # the start's own line: where the recording goes on, or why from its start
        detail += f"; {plan.recording.line}"
    ended = plan.recording is not None and plan.recording.ended  # the start ingests nothing more
    status = "note" if plan.action in ("set_aside", "unknown") or ended else "ok"
    return CheckResult(MEMORY_KEY, status, detail)


def _source_record(daemon: Any) -> dict | None:
    """``edgekv.state.source_record`` of the source the start would read: the one the ``video.source`` step opened,
    else ``video.source`` parsed (None when it does not parse: that step names why)."""
    from edgekv.state import source_record
    from edgekv.video.sources import parse_spec

    spec = getattr(daemon, "_spec", None)
    if spec is None:
        try:
            spec = parse_spec(daemon.config.video.source)
        except ValueError:
            return None
    return source_record(spec, daemon.config.video.loop)


def _share_text(deployment: Any, camera: str | None) -> str:
    """How a camera's cache cap follows from ``video.sources`` (apps/daemon/cameras.py ``camera_configs``)."""
    cameras = deployment.video.sources
    total = sum(one.weight for one in cameras)
    mine = next((one for one in cameras if one.name == camera), None)
    key, value = (("cache.max_mib", f"{deployment.cache.max_mib:g} MiB") if deployment.cache.max_mib is not None
                  else ("cache.max_tokens", f"{deployment.cache.max_tokens:,} tokens"))
    weights = ", ".join(f"{one.name} {one.weight:g}" for one in cameras)
    share = f"{camera!r} has weight {mine.weight:g} of {total:g}: " if mine is not None else ""
    return (f"With video.sources each camera's cache is its weight's share of {key} ({value}; weights now "
            f"{weights}; {share}the cap above): a camera added or removed, or a weight changed, changes the "
            f"cameras' caps, and the memory of each camera whose cap changed is set aside")


def _found(daemon: Any, key: str, found: object, seen: dict[str, Any] | None = None) -> CheckResult:
    """What a step that passed found, said."""
    cfg = daemon.config
    unset = {"cache.calibration": (cfg.cache.calibration is None, "none set"),
             "state.dir lock": (cfg.state.dir is None, "no state.dir"),
             "archive.dir records": (cfg.archive.dir is None, "no archive.dir"),
             "server TLS": (cfg.server.tls_cert_file is None, "plain HTTP (no server.tls_cert_file)"),
             "client TLS (escalate:, alerts:)": (cfg.escalate.url is None and not cfg.alerts.webhooks,
                                                 "nothing reached (no escalate.url, no alerts.webhooks)")}
    if key in unset and unset[key][0]:
        return CheckResult(key, "ok", unset[key][1])
    if key == "state.dir lock":
        return CheckResult(key, "ok", f"{daemon.state.dir} free to take")
    if key == "model.path":
        return CheckResult(key, "ok", _model_text(cfg.model.path))
    if key == "state.dir, archive.dir":
        folders = [f"{k} {v}" for k, v in (("state.dir", cfg.state.dir), ("archive.dir", cfg.archive.dir)) if v]
        return CheckResult(key, "ok", ", ".join(folders) + " writable" if folders else "none set (nothing kept)")
    if key == "server.host:port":
        return CheckResult(key, "ok", f"{cfg.server.host}:{cfg.server.port} free")
    if key == "fleet":
        return _broker_result(cfg.fleet.broker)
    if key == "video.source":
        return _source_result(found, seen)
    from edgekv.apps.daemon.startup import ARCHIVE_OTHER_DTYPE

    if key == "archive.dir records" and isinstance(found, str) and found.startswith(ARCHIVE_OTHER_DTYPE):
        return CheckResult(key, "note", found)
    return CheckResult(key, "ok", str(found) if isinstance(found, str) else "")


def _model_text(path: str) -> str:
    from edgekv.model.builtin import resolve_model_path

    folder = Path(resolve_model_path(path)).expanduser()
    weights = [f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern)]
    from edgekv.archive.store import size_text

    size = sum(f.stat().st_size for f in weights)
    return f"{folder} (config.json, {len(weights)} weight file(s), {size_text(size)})"


def _held_by_the_running_daemon(daemon: Any, key: str, exc: Exception) -> CheckResult | None:
    """The running daemon's own holds, found by a check beside it: a ``note``, not a mistake."""
    text = str(exc)
    if key == "state.dir lock" and "is in use by another" in text:
        return CheckResult(key, "note", f"{text.split(' (')[0]} now ({text.split('(', 1)[-1].split(':')[0]}); "
                                        "a restart takes it over once that one has stopped")
    if "no $CREDENTIALS_DIRECTORY" in text:  # a systemd credential is handed over to the service only
        return CheckResult(key, "note", f"{text.split(':')[0]} is a systemd credential, handed over to the service "
                                        "only: not checked from here")
    if key == "server.host:port" and "already in use" in text:
        who = _edgekv_on(daemon.config.server)
        if who is not None:
            return CheckResult(key, "note", f"{daemon.config.server.host}:{daemon.config.server.port} served now by "
                                            f"{who}; a restart takes it over once that one has stopped")
    return None


def _edgekv_on(server: Any) -> str | None:
    """How an edgekv daemon answering ``/healthz`` (public, as liveness probes need) at the configured address
    describes itself, or None when what holds the port is not one."""
    scheme = "https" if server.tls() else "http"
    host = "127.0.0.1" if server.host in ("0.0.0.0", "", "::") else server.host
    host = f"[{host}]" if ":" in host else host
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # who it is, not whether to trust it
    token = server.token or os.environ.get(server.token_env) or None  # its details are given with the token
    request = urllib.request.Request(f"{scheme}://{host}:{server.port}/healthz",
                                     headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=CONNECT_BOUND_S,
                                    context=context if scheme == "https" else None) as response:
            data = json.loads(response.read())
    except urllib.error.HTTPError as err:  # 503 while starting or stalled: still its answer
        try:
            data = json.loads(err.read())
        except ValueError:
            return None
    except (OSError, ValueError, ssl.SSLError):
        return None
    if isinstance(data, dict) and set(data) == {"status"} and data["status"] in ("ok", "degraded", "starting",
                                                                                 "stalled"):
        return f"an edgekv daemon ({data['status']}; its details need its token)"  # another token than this config's
    if not (isinstance(data, dict) and "stream_state" in data):
        return None
    return f"an edgekv daemon ({data.get('status')}, {data.get('stream_state')}, {data.get('frames')} frames)"


def _broker_result(broker: str) -> CheckResult:
    from edgekv.config import broker_address

    host, port, tls = broker_address(broker)
    try:
        with socket.create_connection((host, port), timeout=CONNECT_BOUND_S):
            pass
    except OSError as exc:
        return CheckResult("fleet", "note", f"settings ok; the broker {host}:{port} does not answer now ({exc}): the "
                                            "daemon starts anyway and joins the fleet when it does")
    return CheckResult("fleet", "ok", f"settings ok; the broker {host}:{port} accepts connections"
                                      + (" (TLS not tried)" if tls else ""))


def _source_result(source: Any, seen: dict[str, Any] | None = None) -> CheckResult:
    """One frame read from the opened source within ``READ_BOUND_S`` (in a thread: a driver call may block); its
    shape put in ``seen["frame_shape"]``."""
    waiting = getattr(source, "waiting", None)
    if waiting is not None:
        return CheckResult("video.source", "note", f"{waiting}: not reachable now; the daemon would start and "
                                                   "connect it when it answers (video.wait_for_stream)")
    got: dict[str, Any] = {}

    def read() -> None:
        try:
            got["frame"] = source.read()[0]
        except Exception as exc:  # SourceLost, CorruptFrame, EndOfStream, a backend's own error
            got["error"] = exc

    thread = threading.Thread(target=read, name="edgekv-check-read", daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(READ_BOUND_S)
    kind = "live" if source.live else "recorded"
    if thread.is_alive():
        source.interrupt()
        return CheckResult("video.source", "FAIL", f"opened ({kind}) but no frame within {READ_BOUND_S:g} s")
    if "error" in got:
        return CheckResult("video.source", "FAIL", f"opened ({kind}) but its first frame failed: "
                                                   f"{type(got['error']).__name__}: {got['error']}")
    height, width = got["frame"].shape[:2]
    if seen is not None:
        seen["frame_shape"] = got["frame"].shape
    return CheckResult("video.source", "ok", f"{kind}; a {width}x{height} frame read in "
                                             f"{time.monotonic() - started:.2f} s")


def flash_result(configs: list[Any], grids: list[tuple[int, int] | None] | None = None) -> CheckResult | None:
    """What the deployment's memory writes to flash a day, every camera's summed (``edgekv plan``'s figure: flash
    wears by it), when it keeps any (``state.dir`` or ``archive.dir``); None otherwise, or when a model cannot be
    read for it. ``grids``: each camera's frame grid as the start takes it (``start_grid``; None, or not given:
    ``video.resolution``, else 448x448)."""
    import re

    from edgekv.calibration.plan import flash_lines
    from edgekv.model.builtin import resolve_model_path

    total = 0.0
    for config, grid in zip(configs, grids or [None] * len(configs)):
        if config.state.dir is None and config.archive.dir is None:
            continue
        try:
            height, width = grid or config.video.resolution or (448, 448)
            lines = flash_lines(config, resolve_model_path(str(config.model.path)), (height // 28) * (width // 28))
        except (OSError, ValueError, KeyError):
            return None
        found = [re.search(r"; ([\d,.]+) GB a day", line) for line in lines if line.startswith("writes to flash")]
        if not found or found[0] is None:
            return None
        total += float(found[0].group(1).replace(",", ""))
    if not total:
        return None
    return CheckResult("flash", "note", f"the memory writes about {total:,.1f} GB a day, {total * 365 / 1e3:,.1f} TB a "
                                        "year (edgekv plan --config ... --flash-tbw TB: by part, and the years to the "
                                        "flash's rating)")


def device_results(config: Any, root: str = "/", nvpmodel_output: str | None = None) -> list[CheckResult]:
    """The device the daemon would run on: its memory against the cache cap (``edgekv plan``'s estimate, a
    ``note`` when it says the cap does not fit: an estimate, not a refusal), and on a Jetson its power mode (decode
    rates are quoted at MAXN; users who measured less ran another mode, NanoLLM#38). ``root`` and
    ``nvpmodel_output`` are for tests."""
    from edgekv.calibration.plan import check_config, memory_here
    from edgekv.monitor.jetson import is_jetson, power_mode

    results = []
    try:
        memory, where = memory_here(config.model.device, root=root)
        _, verdict = check_config(config, memory)
        results.append(CheckResult("device memory", "ok", f"{memory:.1f} GiB ({where.split(' (')[0]}): "
                                                          f"{verdict.split(': ', 1)[-1]}"))
    except ValueError as exc:
        results.append(CheckResult("device memory", "note", f"the plan's estimate: {str(exc).split(': ', 1)[-1]} "
                                                            "(edgekv plan --config ...)"))
    except (OSError, KeyError) as exc:
        results.append(CheckResult("device memory", "note", f"not estimated ({exc})"))
    if is_jetson(root):
        mode = power_mode(nvpmodel_output, status_path=f"{root.rstrip('/')}/var/lib/nvpmodel/status",
                          conf_path=f"{root.rstrip('/')}/etc/nvpmodel.conf")
        if mode is None:
            results.append(CheckResult("power mode", "note", "not known (no nvpmodel, no /var/lib/nvpmodel/status)"))
        elif mode[1].upper().startswith("MAXN"):
            results.append(CheckResult("power mode", "ok", f"{mode[1]} (id {mode[0]})"))
        else:
            results.append(CheckResult("power mode", "note", f"{mode[1]} (id {mode[0]}), not MAXN: decode runs "
                                                             "slower than the figures quoted for MAXN "
                                                             "(jetson/power-mode.sh set MAXN)"))
    return results


def run_check(daemons: dict[str, Any], out: Any, config_name: str, deployment: Any = None) -> int:
    """Say every camera's checks, then the deployment's (``deployment``: the whole config, every camera's cap
    together; default: the first camera's); 0 when the daemon would start, 2 when it would not."""
    failed = 0
    print(f"edgekv-camera --check: {config_name} (the model is not loaded)", file=out)
    grids = []
    first = next(iter(daemons))
    for name, daemon in daemons.items():
        prefix = f"[{name}] " if len(daemons) > 1 else ""
        seen: dict[str, Any] = {}
        shared = (first, daemons[first].config) if name != first else None  # the engines are loaded for the first
        results = check_daemon(daemon, deployment, name or None, seen, shared)
        try:
            resumed = seen.get("resumed")
            grids.append(start_grid(daemon.config, seen.get("frame_shape"), resumed[0] if resumed else None))
        except (ValueError, OSError, KeyError):  # model.path's own step names what is wrong with it
            grids.append(None)
        for result in results:
            failed += result.status == "FAIL"
            print(f"{prefix}{result.status:<4}  {result.key}{': ' + result.detail if result.detail else ''}",
                  file=out)
    if not failed:  # the deployment's own: said once, after every camera's steps
        whole = deployment if deployment is not None else next(iter(daemons.values())).config
        if len(grids) == 1 and grids[0] is not None and whole.video.resolution is None:
            whole = whole.with_overrides(video={"resolution": list(grids[0])})  # the plan's activations at it
        for result in [*device_results(whole),
                       flash_result([daemon.config for daemon in daemons.values()], grids)]:
            if result is not None:
                print(f"{result.status:<4}  {result.key}: {result.detail}", file=out)
    print(f"{failed} problem(s): the daemon would not start" if failed else
          "every check passed: the daemon would start", file=out, flush=True)
    return 2 if failed else 0
