"""Runtime: a loaded model plus a deployment config; it opens StreamSessions.

    rt = edgekv.Runtime.from_config("deploy.yaml")
    rt = edgekv.Runtime.from_pretrained(model_dir, cache={"policy": "infinipot_v", "max_tokens": 2048})
    s = rt.session()
"""

from __future__ import annotations

import copy

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from edgekv.cache.specs import KV_DTYPES, CacheSpec
from edgekv.config import ConfigError, EdgeKVConfig, config_from_dict, load_config
from edgekv.config_names import config_file
from edgekv.engines.registry import make_backends
from edgekv.hostmem import configure_host_memory
from edgekv.model import load_pretrained
from edgekv.policies import CachePolicy, make_policy
from edgekv.preprocess import FramePreprocessor, smart_resize
from edgekv.session import StreamSession
from edgekv.threads import apply_threads
from edgekv.tokenizer import QwenTokenizer
from edgekv.model.builtin import resolve_model_path

log = logging.getLogger(__name__)

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# The vision MLP width a padded tower runs at is a multiple of this (model.vision_mlp_width): 8 bf16 values are
# the 16 bytes a row must be aligned to for Hopper's TMA kernels (edgekv/model/vision.py pad_mlp_width).
VISION_MLP_MULTIPLE = 8


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device: {name!r} was asked for but no CUDA device is available")
    return device


class Runtime:
    """Holds the model weights and the deployment config shared by every session."""

    def __init__(self, config: EdgeKVConfig) -> None:
        if config.model.path is None:
            raise ValueError("model.path: no model directory given (a Qwen2.5-VL checkpoint directory)")
        self.config = config
        self.keys = deployment_keys(config)  # the key that seals snapshots (privacy:), checked before the weights load
        self.threads = apply_threads(config.runtime.threads)  # before the weights load (edgekv/threads.py)
        self.device = resolve_device(config.model.device)
        self.dtype = _DTYPES[config.model.dtype]
        model_dir = Path(resolve_model_path(config.model.path)).expanduser()
        engines = config.engines
        skip = tuple(part for part, backend in (("visual", engines.vision), ("language.layers", engines.llm))
                     if backend != "torch")  # an engine holds those weights: never load them twice
        self.model = load_pretrained(model_dir, dtype=self.dtype, device=self.device, skip=skip).eval()
        self.tokenizer = QwenTokenizer.from_dir(model_dir)
        self.model_dir = model_dir
        self._model_hash: str | None = None
        if config.model.lm_head != "as_loaded":  # before the backends: an engine's runner keeps the torch head
            from edgekv.model.decode_routes import quantize_lm_head

            try:
                quantize_lm_head(self.model.language, config.model.lm_head)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        self.vision_mlp_width = self._vision_mlp_width(config.model.vision_mlp_width)
        self.vision_route = self._vision_route(config.model.vision_route)  # after the padding: a graph captures it
        self.prefill_route = self._prefill_route(config.model.prefill_route)
        self.pair_route = self._pair_route(config.model.pair_route)
        self.vision_backend, self.llm_backend = make_backends(self)
        self.decode_route, self.decode_route_note = self._prepare_decode(config.model.decode_route)
        self.host_memory = configure_host_memory(config.model.host_memory)  # after loading: see edgekv/hostmem.py

    def _vision_mlp_width(self, choice: str) -> int | None:
        """``model.vision_mlp_width`` applied to the torch vision tower; the width its MLPs run at (None when
        another backend runs the tower, whose weights are not loaded here)."""
        if self.config.engines.vision != "torch":
            return None
        visual = self.model.visual
        if choice == "padded" or (choice == "auto" and self.device.type == "cuda"):
            width = visual.pad_mlps(VISION_MLP_MULTIPLE)
            if width != visual.config.intermediate_size:
                log.info("vision tower: MLP width %d padded to %d (model.vision_mlp_width)",
                         visual.config.intermediate_size, width)
            return width
        return visual.config.intermediate_size

    def _vision_route(self, route: str) -> str:
        """``model.vision_route`` resolved for this device ("graph" or "eager"; "engine" when another backend
        runs the tower)."""
        if self.config.engines.vision != "torch":
            return "engine"
        from edgekv.engines.torch_backend import resolve_vision_route

        try:
            return resolve_vision_route(route, self.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _prefill_route(self, route: str) -> str:
        """``model.prefill_route`` resolved and applied to the torch language model ("fused" or "eager"; "engine"
        when another backend runs the LLM)."""
        if self.config.engines.llm != "torch":
            return "engine"
        from edgekv.model.prefill_fused import prepare_prefill, resolve_prefill_route

        try:
            chosen = resolve_prefill_route(route, self.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if chosen == "fused" and not prepare_prefill(self.model.language, "fused"):
            if route == "fused":
                raise ConfigError("model.prefill_route: fused: no layer of this model can take it (a 16/32-bit "
                                  "model, torch or 4-bit linears, SiLU and a power-of-two head_dim are needed)")
            return "eager"  # "auto" on a model no layer of which can take it (an fp64 model, another activation)
        return chosen

    def _pair_route(self, route: str) -> str:
        """``model.pair_route`` resolved for this device ("graph" or "eager"; "engine" when another backend runs
        the LLM)."""
        if self.config.engines.llm != "torch":
            return "engine"
        from edgekv.session.pair_graph import resolve_pair_route

        try:
            return resolve_pair_route(route, self.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _prepare_decode(self, route: str) -> tuple[str, str | None]:
        """Apply ``model.decode_route`` to the torch language model (edgekv/model/decode_routes.py);
        an engine's LLM reads its own weights, so the torch route is only recorded then."""
        from edgekv.model.decode_routes import prepare_decode, resolve_route

        if self.config.engines.llm != "torch":
            return "engine", f"the LLM runs on {self.config.engines.llm}"
        from edgekv.model.int4 import is_quantized

        try:
            chosen, note = resolve_route(route, self.dtype, self.device, quantized=is_quantized(self.model.language))
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        prepare_decode(self.model.language, "eager" if chosen == "graph" else chosen)
        if note and route == "auto" and self.dtype is torch.bfloat16 and self.device.type == "cpu":
            log.info("decode: torch's bf16 kernels (%s)", note)
        return chosen, note

    @classmethod
    def from_config(cls, config: str | Path | dict | EdgeKVConfig) -> "Runtime":
        """A YAML file's path or the name of a config shipped with edgekv (``"cpu-demo"``, as ``--config`` takes it:
        ``edgekv.config_names``), an ``EdgeKVConfig``, or the file's content as a dict of sections (validated alike:
        a dict was opened as a path, "expected str, bytes or os.PathLike object, not dict")."""
        if isinstance(config, dict):
            config = config_from_dict(config)
        elif not isinstance(config, EdgeKVConfig):
            if not isinstance(config, (str, Path)):
                raise TypeError(f"from_config: expected a YAML file's path, a dict of sections or an EdgeKVConfig, "
                                f"got {type(config).__name__}")
            config = load_config(config_file(config, say=log.warning) if isinstance(config, str) else config)
        return cls(config)

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **overrides: dict) -> "Runtime":
        model = overrides.pop("model", {})
        if not isinstance(model, dict):
            raise ConfigError(f"model: expected a mapping of keys, got {type(model).__name__}")
        model = {"path": str(model_dir), **model}
        return cls(EdgeKVConfig().with_overrides(model=model, **overrides))

    SHARED_SECTIONS = ("model", "engines", "runtime", "privacy")

    def sharing(self, config: EdgeKVConfig) -> "Runtime":
        """A runtime for another camera of this deployment (``video.sources``): these weights, tokenizer and
        engines, loaded once, with ``config``'s own video, cache, archive and state sections. The sections the
        loaded weights depend on must be the same; a difference is a ValueError naming the section."""
        for name in self.SHARED_SECTIONS:
            if getattr(config, name) != getattr(self.config, name):
                raise ValueError(f"{name}: a runtime shared by several cameras has one {name} section; this camera's "
                                 "differs")
        twin = copy.copy(self)
        twin.config = config
        return twin

    def session(self, archive: bool = True) -> StreamSession:
        """A new stream session with its own capped cache (``archive=False``: without the configured archive,
        e.g. a session that answers about a request's images)."""
        return StreamSession(self, archive=archive)

    def restore(self, path: str | Path) -> StreamSession:
        """A session resumed from a snapshot written by ``StreamSession.save`` (edgekv/state.py).

        Raises ``edgekv.state.SnapshotError`` naming the file when it is truncated or damaged, and
        ``SnapshotMismatchError`` naming the field when it was made for other weights, dtype, cache or grid.
        """
        from edgekv.state import load_session

        return load_session(self, path)

    def model_hash(self) -> str:
        """Content hash of the checkpoint (memoized per file like the engine bundles', in engine_dir)."""
        if self._model_hash is None:
            from edgekv.engines.manifest import model_hash

            memo = Path(self.config.engines.engine_dir).expanduser() / "hashes.json"
            self._model_hash = model_hash(self.model_dir, memo)
        return self._model_hash

    # ------------------------------------------------------------------ pieces a session needs
    @property
    def kv_dtype(self) -> torch.dtype:
        """The cache's storage dtype: ``cache.kv_dtype``, or the model's."""
        name = self.config.cache.kv_dtype
        return self.dtype if name is None else KV_DTYPES[name]

    def cache_spec(self) -> CacheSpec:
        text = self.model.config.text
        return CacheSpec.uniform(text.num_hidden_layers, text.num_key_value_heads, text.head_dim, self.kv_dtype)

    def cache_capacity_tokens(self, spec: CacheSpec) -> int:
        cache = self.config.cache
        if cache.max_mib is not None:
            return spec.tokens_for_mib(cache.max_mib)
        return int(cache.max_tokens)

    def make_policy(self) -> CachePolicy:
        return make_policy(self.config.cache.policy, **_policy_kwargs(self.config))

    def make_preprocessor(self, frame: np.ndarray | None = None,
                          resolution: tuple[int, int] | None = None) -> FramePreprocessor | None:
        """The fixed frame grid: ``resolution`` if given (a restored stream's), else ``video.resolution``,
        else from the first frame via smart_resize."""
        resolution = resolution or self.config.video.resolution
        if resolution is None:
            if frame is None:
                return None
            FramePreprocessor.check_frame(frame)
            limits = self.pixel_limits()
            resolution = smart_resize(frame.shape[0], frame.shape[1], min_pixels=limits[0], max_pixels=limits[1])
        vision = self.model.config.vision
        return FramePreprocessor(resolution=tuple(resolution), patch_size=vision.patch_size,
                                 temporal_patch_size=vision.temporal_patch_size, merge_size=vision.spatial_merge_size,
                                 resize=self.config.video.resize)


    def pixel_limits(self) -> tuple[int, int]:
        """min/max pixels of the checkpoint's preprocessor_config.json (HF defaults when absent)."""
        path = self.model_dir / "preprocessor_config.json"
        data = json.loads(path.read_text()) if path.is_file() else {}
        return int(data.get("min_pixels", 3136)), int(data.get("max_pixels", 12845056))


def _policy_kwargs(config: EdgeKVConfig) -> dict:
    cache = config.cache
    return {"target_tokens": cache.target_tokens, "recent_ratio": cache.recent_ratio, "tar_ratio": cache.tar_ratio,
            "calibration": cache.calibration, "tar_rope": cache.tar_rope, "van_pooling": cache.van_pooling,
            "chunk_pairs": cache.adaptive_chunk_pairs, "floor": cache.adaptive_floor,
            "min_slots": cache.adaptive_min_slots}


def deployment_keys(config: EdgeKVConfig):
    """The deployment's ``privacy:`` keys; None (nothing sealed) when none is configured, without importing
    ``cryptography`` (an optional dependency: ``pip install 'edgekv[privacy]'``). With a key, ``cryptography`` is
    imported here: without it a daemon ran for ``state.every_s`` and then lost its first snapshot to a traceback."""
    section = config.privacy
    if not (section.key_file or section.key_env or section.key_credential):
        return None
    from edgekv.privacy import KeyRing

    try:
        import cryptography.hazmat.primitives.ciphers.aead  # noqa: F401  (what edgekv.privacy.Sealer seals with)
    except ImportError as exc:
        raise ImportError("privacy: encryption at rest needs cryptography (pip install 'edgekv[privacy]')") from exc
    return KeyRing.from_section(section)


def find_engines(config: EdgeKVConfig) -> list[tuple[str, Path, Any, tuple[tuple[str, str, str], ...]]]:
    """The engine bundle of each backend other than torch that ``config.engines`` names, found and checked as the
    start's load finds and checks it (``engines.registry.make_backends``: that backend's own requirements, then
    ``engines.build.deployment`` and ``engines.manifest.locate`` — the key's fields, the manifest, every file's size
    and sha256, the digests memoized in ``engines.engine_dir``/hashes.json as the load memoizes them), without loading
    the weights or any engine (``edgekv-camera --check``). ``[(backend, bundle, manifest, gone)]`` in the order the
    start loads them, ``gone`` the build inputs a rebuild needs that are missing (``BuildKey.unverified``: field, input
    as configured, why); [] when torch runs both. Raises what the load raises, with its message: ``EngineError`` (a
    ValueError) for no bundle, another model, config, TensorRT version or GPU, a damaged file, a backend not
    installed."""
    from edgekv.engines.base import check_backend_name
    from edgekv.engines.build import deployment
    from edgekv.engines.manifest import locate

    engines = config.engines
    check_backend_name("vision", engines.vision)
    check_backend_name("llm", engines.llm)
    backends = list(dict.fromkeys(name for name in (engines.vision, engines.llm) if name != "torch"))
    device = resolve_device(config.model.device) if backends else None  # Runtime.__init__'s, before the weights
    found = []
    for backend in backends:
        if backend == "onnxruntime":  # the load's own requirements (onnx_backend._sessions_for)
            from edgekv.engines.onnx_backend import checked_providers

            checked_providers(config, device)
        else:  # tensorrt_runtime.load's
            from edgekv.engines.tensorrt_runtime import check_device

            check_device(device)
        dep = deployment(config, backend, model_dir=Path(resolve_model_path(config.model.path)).expanduser())
        bundle, manifest = locate(dep.engine_dir, dep.model_dir, dep.key, dep.hint)
        found.append((backend, bundle, manifest, dep.key.unverified))
    return found
