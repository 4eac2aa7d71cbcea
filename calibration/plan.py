"""``edgekv plan``: the largest cache budget M that fits a device's memory.

    free for the cache = device memory - OS/runtime reserve - weights - activation workspace
    M = free for the cache // bytes per token        (bytes per token from edgekv.cache.specs.CacheSpec)

Everything is an estimate from formulas, not a measurement on a Jetson:
- weights: parameter count x dtype bytes from config.json; with a ``quantization_config`` (a 4-bit AWQ /
  GPTQ checkpoint, issue 29) the decoder layers' linears count what the AWQ layout holds — half a byte per
  weight, a float16 scale and a 4-bit zero point per group of ``group_size`` — and everything else (vision
  tower, embedding / tied head, norms) the serving dtype;
- reserve: what JetPack, CUDA context and allocator slack take on a Jetson with the desktop off
  (``DEFAULT_RESERVE_GB``, overridable): unified memory is shared with the OS;
- activations: one frame pair through the vision tower (every block keeps ``patches x hidden`` plus its
  MLP and attention scores per window) and one prefill chunk through the language model (logits of the
  chunk, MLP, and scores against M keys), times a safety factor.

Loading is not a separate peak: the loader reads each tensor straight into its final dtype (no memory map,
a 32 MiB conversion buffer) and the CPU decode route repacks 4-bit weights one linear at a time, freeing
each one's AWQ words as it goes. Measured on the x86 VM for a 4-bit 3B checkpoint in bf16 (issue 29):
VmHWM 3.61 GiB through the Runtime's load and repack for 3.53 GiB resident after, and 3.90 GiB for a whole
session with a 6144-slot cache, two frame pairs and an answer — the steady state, which is what this plan
counts (before those changes the load alone peaked at 6.02 GiB).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from edgekv.cache.specs import CacheSpec, dtype_bytes
from edgekv.model.int4 import QuantConfig
from edgekv.model.loading import read_config_json

DEFAULT_RESERVE_GB = 2.0  # JetPack 6 with the desktop off (~1.2 GB) + CUDA context and allocator slack
SAFETY = 1.5
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Plan:
    device_memory_bytes: int
    reserve_bytes: int
    weight_bytes: int
    activation_bytes: int
    bytes_per_token: int
    max_tokens: int
    tokens_per_pair: int
    text_reserve_tokens: int
    capped_by_positions: bool = False
    weights_note: str = ""

    @property
    def frame_pairs_that_fit(self) -> int:
        return max(0, (self.max_tokens - self.text_reserve_tokens) // self.tokens_per_pair)

    def summary(self) -> str:
        gib = 2**30
        free = self.device_memory_bytes - self.reserve_bytes - self.weight_bytes - self.activation_bytes
        return "\n".join([
            f"device memory        {self.device_memory_bytes / gib:8.2f} GiB",
            f"  OS/runtime reserve {self.reserve_bytes / gib:8.2f} GiB",
            f"  weights            {self.weight_bytes / gib:8.2f} GiB{f' ({self.weights_note})' if self.weights_note else ''}",
            f"  activations        {self.activation_bytes / gib:8.2f} GiB (one frame pair, x{SAFETY} safety)",
            f"  left for the cache {free / gib:8.2f} GiB at {self.bytes_per_token} bytes per token",
            f"cache.max_tokens: {self.max_tokens}   "
            f"(~{self.frame_pairs_that_fit} frame pairs of {self.tokens_per_pair} tokens before the first "
            f"compression, {self.text_reserve_tokens} kept for a question)",
            *(["(capped at half the model's position range; more memory would fit more)"]
              if self.capped_by_positions else []),
            "estimates from formulas, not measured on a device",
        ])


_TEXT_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
              "num_key_value_heads")
_VISION_KEYS = ("hidden_size", "intermediate_size", "depth", "num_heads")


def _model_config(model_dir: Path) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ValueError(f"{path}: no config.json in the model directory")
    data = read_config_json(path)
    text = data.get("text_config") or data
    vision = data.get("vision_config") or {}
    # the sizes the estimate reads: one missing was a KeyError traceback from deep in the arithmetic
    absent = [key for key in _TEXT_KEYS if not isinstance(text.get(key), int)]
    absent += [f"vision_config.{key}" for key in _VISION_KEYS if vision and not isinstance(vision.get(key), int)]
    if absent:
        raise ValueError(f"{path}: {', '.join(absent)} missing or not an integer (not a Qwen2.5-VL config)")
    try:
        quant = QuantConfig.from_model_config(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc
    return {"text": text, "vision": vision, "quant": quant,
            "tie": data.get("tie_word_embeddings", text.get("tie_word_embeddings", True))}


def _parameter_count(cfg: dict) -> int:
    t, v = cfg["text"], cfg["vision"]
    d, inter, layers, vocab = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"], t["vocab_size"]
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or d // heads
    per_layer = d * heads * hd * 2 + d * kv * hd * 2 + 3 * d * inter + 2 * d
    lm = layers * per_layer + vocab * d * (1 if cfg["tie"] else 2) + d
    if v:
        vd, vi = v["hidden_size"], v["intermediate_size"]
        patch = v.get("in_channels", 3) * v.get("temporal_patch_size", 2) * v.get("patch_size", 14) ** 2
        merge = v.get("spatial_merge_size", 2) ** 2
        vision = v["depth"] * (4 * vd * vd + 3 * vd * vi) + patch * vd + merge * vd * merge * vd \
            + merge * vd * v.get("out_hidden_size", d)
    else:
        vision = 0
    return lm + vision


def _decoder_linears(cfg: dict) -> list[tuple[int, int]]:
    """(in_features, out_features) of every decoder-layer linear (q, k, v, o, gate, up, down per layer)."""
    t = cfg["text"]
    d, inter, heads, kv = t["hidden_size"], t["intermediate_size"], t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or d // heads
    per_layer = [(d, heads * hd), (d, kv * hd), (d, kv * hd), (heads * hd, d), (d, inter), (d, inter), (inter, d)]
    return per_layer * t["num_hidden_layers"]


def _weight_bytes(model_dir: Path, cfg: dict, dtype: torch.dtype, lm_head: str = "as_loaded") -> int:
    head = 0  # model.lm_head: int8 — the head (the tied embedding with it) as int8 + fp32 scales per 128 inputs
    if lm_head == "int8":
        from edgekv.model.decode_routes import int8_head_group

        t = cfg["text"]
        d, vocab = t["hidden_size"], t["vocab_size"]
        group = int8_head_group(d) or d
        head = vocab * d + vocab * (d // group) * 4 - vocab * d * dtype_bytes(dtype)
    quant = cfg.get("quant")
    if quant is None:
        return _parameter_count(cfg) * dtype_bytes(dtype) + head
    linears = _decoder_linears(cfg)
    dense = _parameter_count(cfg) - sum(k * n for k, n in linears)
    packed = 0
    for k, n in linears:
        groups = k // quant.group_for(k)
        packed += k * n // 2 + groups * n * 2 + groups * n // 2  # 4-bit weights, fp16 scales, 4-bit zeros
    return packed + dense * dtype_bytes(dtype) + head


def _weights_note(cfg: dict, weight_dtype: str, override: bool, lm_head: str = "as_loaded") -> str:
    if override:
        return "--weights-gb"
    quant = cfg.get("quant")
    head = "; int8 lm_head" if lm_head == "int8" else ""
    if quant is None:
        return f"{weight_dtype}{head}"
    embedding = "embedding (int8 head) and norms" if lm_head == "int8" and cfg["tie"] else "embedding and norms"
    return (f"4-bit {quant.method.upper()} decoder linears, group {quant.group_size}; {weight_dtype} vision tower, "
            f"{embedding}" + ("" if cfg["tie"] else head))


def _activation_bytes(cfg: dict, tokens_per_pair: int, max_tokens: int, dtype: torch.dtype) -> int:
    t, v = cfg["text"], cfg["vision"]
    b = dtype_bytes(dtype)
    patches = 4 * tokens_per_pair
    vision = 0
    if v:
        window = (v.get("window_size", 112) // v.get("patch_size", 14)) ** 2
        vision = patches * (4 * v["hidden_size"] + 2 * v["intermediate_size"]) * b \
            + v["num_heads"] * patches * max(window, patches) * 4
    # SDPA/flash attention never holds [heads, P, M] scores; the StateKV mass path reads keys in blocks
    lm = tokens_per_pair * (4 * t["hidden_size"] + 2 * t["intermediate_size"]) * b \
        + t["num_attention_heads"] * tokens_per_pair * 1024 * 4 \
        + tokens_per_pair * t["vocab_size"] * 4
    return int(SAFETY * (vision + lm))


def plan(device_memory_gb: float, model_dir: str | Path, resolution: tuple[int, int] = (448, 448),
         weight_dtype: str = "bf16", reserve_gb: float = DEFAULT_RESERVE_GB, text_reserve_tokens: int = 512,
         weights_gb: float | None = None, lm_head: str = "as_loaded") -> Plan:
    """``weights_gb`` overrides the weight estimate (quantized engines: e.g. W4A16 LM + FP16 ViT); ``lm_head``
    is ``model.lm_head`` (``int8``: the head, and the tied embedding, in int8)."""
    # written so that NaN fails too (every comparison with it is false) and infinity, which int() refused with
    # a traceback
    problems = [f"{name} must be {rule}, got {value}" for name, value, bad, rule in (
        ("the device memory", device_memory_gb, not 0 < device_memory_gb < math.inf, "positive (GB)"),
        ("the reserve", reserve_gb, not 0 <= reserve_gb < math.inf, "0 or more (GB)"),
        ("the weights' size", weights_gb, weights_gb is not None and not 0 < weights_gb < math.inf, "positive (GB)"))
        if bad]
    problems += [f"the resolution's {side} {value} is not a positive multiple of 28 (patch 14 x merge 2)"
                 for side, value in zip(("height", "width"), resolution) if value <= 0 or value % 28]
    if problems:
        raise ValueError("; ".join(problems))
    dtype = _DTYPES[weight_dtype]
    cfg = _model_config(Path(model_dir))
    t = cfg["text"]
    hd = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    spec = CacheSpec.uniform(t["num_hidden_layers"], t["num_key_value_heads"], hd, dtype)
    tokens_per_pair = (resolution[0] // 28) * (resolution[1] // 28)
    total = int(device_memory_gb * 2**30)
    reserve = int(reserve_gb * 2**30)
    weights = int(weights_gb * 2**30) if weights_gb is not None else _weight_bytes(Path(model_dir), cfg, dtype, lm_head)
    activations = _activation_bytes(cfg, tokens_per_pair, 0, dtype)
    free = total - reserve - weights - activations
    tokens = free // spec.bytes_per_token if free > 0 else 0
    # more slots than the model has positions buy nothing (re-basing keeps positions below this)
    position_cap = int(t.get("max_position_embeddings", 32768)) // 2
    capped = tokens > position_cap
    tokens = min(tokens, position_cap)
    minimum = text_reserve_tokens + 2 * tokens_per_pair + 64
    if tokens < minimum:
        short = (minimum - tokens) * spec.bytes_per_token + max(0, -(total - reserve - weights - activations))
        # a 4-bit checkpoint's weights were called bf16 and the advice was to quantize what already is
        what = _weights_note(cfg, weight_dtype, weights_gb is not None, lm_head) if cfg["quant"] else weight_dtype
        smaller = ("use a smaller resolution" if cfg["quant"] or weights_gb is not None else
                   "use 4-bit weights (an AWQ or GPTQ checkpoint, or `edgekv quantize`) or a smaller resolution")
        raise ValueError(
            f"{device_memory_gb} GB cannot hold the model ({weights / 2**30:.2f} GiB of {what} weights), "
            f"the reserve ({reserve_gb} GB), activations and a minimal cache ({minimum} tokens): short by "
            f"{short / 2**30:.2f} GiB; {smaller}")
    return Plan(total, reserve, weights, activations, spec.bytes_per_token, int(tokens), tokens_per_pair,
                text_reserve_tokens, capped, _weights_note(cfg, weight_dtype, weights_gb is not None, lm_head))


# Evidence frames on disk (archive.frames_mib), KiB a frame with its row's bookkeeping: the largest of the three
# sources `edgekv bench frames --frames 30 --size 1280 720` measured on 2026-12-05 (vtest.avi, tree.avi, a
# synthesized world stream; JPEG quality 80) at each long side; other sizes interpolated in log-log.
FRAME_KIB_MEASURED = {160: 6.1, 320: 16.1, 640: 45.4}


def _frame_kib(px: int) -> float:
    import math

    sizes = sorted(FRAME_KIB_MEASURED)
    lo = max([s for s in sizes if s <= px], default=sizes[0])
    hi = min([s for s in sizes if s >= px], default=sizes[-1])
    if lo == hi:
        lo, hi = (sizes[0], sizes[1]) if px < sizes[0] else (sizes[-2], sizes[-1]) if px > sizes[-1] else (lo, hi)
    if lo == hi:
        return FRAME_KIB_MEASURED[lo]
    slope = math.log(FRAME_KIB_MEASURED[hi] / FRAME_KIB_MEASURED[lo]) / math.log(hi / lo)
    return FRAME_KIB_MEASURED[lo] * (px / lo) ** slope


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.0f} min"


def archive_shape(config, model: str | Path | dict):
    """The ``KVShape`` this deployment's archive records have (``model``: the checkpoint folder, or its
    ``_model_config``), and the setting that chose their dtype, in words: ``archive.kv_dtype``, else an 8-bit cache's
    own (``cache.kv_dtype``), else the model's dtype — what ``edgekv.archive.recall.Recall`` opens the archive
    with."""
    from edgekv.archive.store import ARCHIVE_KV_DTYPES, KVShape

    t = (model if isinstance(model, dict) else _model_config(Path(model)))["text"]
    section = config.archive
    eight = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # archive.kv_dtype, else an 8-bit cache's own
    stored = ARCHIVE_KV_DTYPES.get(section.kv_dtype, eight.get(config.cache.kv_dtype, _DTYPES[config.model.dtype]))
    named = (f"{section.kv_dtype} (archive.kv_dtype)" if section.kv_dtype != "auto" else
             f"{config.cache.kv_dtype} (cache.kv_dtype)" if config.cache.kv_dtype in eight else config.model.dtype)
    shape = KVShape.of(t["num_hidden_layers"], t["num_key_value_heads"],
                       t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"], stored, section.index_keys)
    return shape, named


def flash_lines(config, model_dir: str | Path, tokens_per_pair: int, flash_tbw: float | None = None) -> list[str]:
    """What the memory on flash holds for a deployment: a frame pair's archive record (its K/V at the model's dtype,
    its index keys and checksums: ``KVShape.record_bytes``, what the writer appends), how far back ``archive.max_gib``
    reaches at the cameras' pair rate (``fps / 2`` each), the index it keeps in RAM for that many pairs, and the
    evidence frames' hours (``archive.frames_mib``, from ``FRAME_KIB_MEASURED``); then what all that writes to the
    flash a day (``write_lines``). Formulas, not a measurement."""
    from edgekv.archive.store import default_index_bytes

    cfg = _model_config(Path(model_dir))
    section = config.archive
    shape, named = archive_shape(config, cfg)
    record = shape.record_bytes(tokens_per_pair)
    cameras = config.video.sources
    rate = sum((c.fps or config.video.fps) for c in cameras) / 2 if cameras else config.video.fps / 2
    budget = section.max_gib * 2**30
    pairs = int(budget // record)
    # the index's bound in RAM (FrameArchive.index_bound): past it the oldest segments go, as past max_gib
    bound = section.max_index_mib * 2**20 if section.max_index_mib is not None else default_index_bytes()
    kept = pairs if bound is None else min(pairs, int(bound // shape.index_entry_bytes()))
    index = kept * shape.index_entry_bytes()
    what = "archive.max_index_mib" if section.max_index_mib is not None else "an eighth of this machine's RAM"
    where = f"archive.dir {section.dir}" if section.dir else "archive.dir not set: no archive; were it set"
    lines = [f"archive ({where}): a frame pair of {tokens_per_pair} tokens is {record / 2**20:.2f} MiB on flash "
             f"({named} K/V of {shape.layers} layers, {shape.index_keys} index key(s), checksums)",
             f"  archive.max_gib {section.max_gib:g} GiB hold {pairs:,} pairs: {_hours(pairs / rate)} of video at "
             f"{rate:g} pair(s) a second{' (all cameras)' if cameras else ''}"
             + (f"; its index {index / 2**20:.1f} MiB of RAM" if kept == pairs else
                f"; the index's bound in RAM ({what}, {(bound or 0) / 2**20:.0f} MiB) keeps the newest {kept:,}: "
                f"{_hours(kept / rate)}, {kept * record / 2**30:.1f} GiB of the disk")
             + " (up to a quarter more while it grows)"]
    if section.frames_mib:
        kib = _frame_kib(section.frames_px)
        from edgekv.apps.daemon.frame_store import budget_shares

        frames = budget_shares(int(section.frames_mib * 2**20))[1] / (kib * 1024)
        lines.append(f"  evidence frames: archive.frames_mib {section.frames_mib:g} MiB at {section.frames_px} px "
                     f"(about {kib:.1f} KiB a frame on disk, edgekv bench frames) hold about {_hours(frames / rate)}")
    return lines + write_lines(config, cfg, record, rate, flash_tbw)


GB = 1e9  # flash is rated in decimal units (TBW: terabytes written)
PAGE = 4096  # SQLite's page (the frame store's default)


def _frame_write_bytes(px: int) -> float:
    """Bytes one evidence frame writes: its JPEG in whole pages plus about two b-tree pages, each page written
    twice (to the write-ahead log, then by the checkpoint into the file). Measured against it on the dev VM
    (2026-12-05): the toy daemon at 112 px, a pair a second, wrote 24.7 MB in 238 s of which about 6.9 MB not the
    archive's or the snapshots' (29 KB a frame; this formula 24.6 KB)."""
    import math

    return 2 * (math.ceil(_frame_kib(px) * 1024 / PAGE) + 2) * PAGE


def write_lines(config, cfg: dict, record: int, rate: float, flash_tbw: float | None = None) -> list[str]:
    """What the memory writes to the flash a day, by part: the archive appends every pair's record (``record``
    bytes at ``rate`` pairs a second), each snapshot rewrites the cache whole while frames come (a memory that did
    not change is not written again; its capacity at ``cache.kv_dtype``,
    every ``state.every_s``; the caps of several cameras are one budget: an upper bound, a snapshot holds the slots
    in use), the evidence frames a JPEG a pair (``_frame_write_bytes``). Flash wears by what is written to it:
    a Jetson's eMMC or a microSD card is rated for far fewer terabytes written (TBW) than an NVMe SSD, and at the 3B
    shape the archive writes hundreds of GB a day. With ``flash_tbw``, the years until that rating is written
    (the flash controller's own write amplification not counted: it only shortens them)."""
    day = 86400.0
    eight = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
    spec, cap = _cap(config, cfg, eight.get(config.cache.kv_dtype, _DTYPES[config.model.dtype]))
    snapshot = cap * spec.bytes_per_token
    archive = config.archive
    parts = [("archive", archive.dir is not None, record * rate * day,
              f"{record / 2**20:.2f} MiB a pair"),
             ("snapshots", config.state.dir is not None, snapshot * day / config.state.every_s,
              f"{snapshot / 2**20:.1f} MiB every {config.state.every_s:g} s, state.every_s"),
             ("evidence frames", archive.dir is not None and archive.frames_mib > 0,
              _frame_write_bytes(archive.frames_px) * rate * day, "a JPEG a pair in whole pages, written twice")]
    on = [(name, size, why) for name, enabled, size, why in parts if enabled]
    shown = on or [(name, size, why) for name, _, size, why in parts]
    total = sum(size for _, size, _ in shown)
    said = ", ".join(f"{name} {size / GB:,.1f} GB ({why})" for name, size, why in shown)
    head = ("writes to flash a day" if on else
            "writes to flash a day (state.dir and archive.dir not set: nothing is written; were they set)")
    lines = [f"{head}, at {rate:g} pair(s) a second: {said}; {total / GB:,.1f} GB a day, "
             f"{total * 365 / 1e12:,.1f} TB a year"]
    if flash_tbw is not None:
        years = flash_tbw * 1e12 / (total * 365) if total > 0 else float("inf")
        lines.append(f"  a flash rated {flash_tbw:g} TBW (--flash-tbw) has that written in {years:,.1f} years "
                     "(its controller's write amplification not counted: fewer in truth)")
    elif total * 365 > 50e12:
        lines.append("  check the flash's rating (TBW; --flash-tbw TB gives the years): eMMC and microSD cards are "
                     "rated far lower than NVMe SSDs. Fewer writes: archive.kv_dtype int8 or int4 (half or a "
                     "quarter of the archive), "
                     "video.skip_static, a longer state.every_s, archive.dir on an NVMe drive")
    return lines


def memory_here(device: str = "auto", root: str | Path = "/") -> tuple[float, str]:
    """This machine's memory for a plan, in GiB (the unit ``plan`` counts "GB" in), and where it was read —
    what ``edgekv plan`` takes without ``--device-memory``. A Jetson: its unified memory (``/proc/meminfo``
    MemTotal, what the kernel manages after the carve-outs; the CPU and the GPU share it — JETSON.md), whatever
    ``device`` says. Elsewhere, ``device`` (``model.device``) cuda / cuda:N, or auto with a CUDA GPU: that
    GPU's memory; cpu, or auto without one: the machine's RAM. ``root`` is for tests."""
    from edgekv.monitor.jetson import is_jetson, read_meminfo

    meminfo = Path(root) / "proc" / "meminfo"
    if is_jetson(root):
        total = read_meminfo(meminfo)["ram_total_mb"] / 1024
        return total, "this Jetson's unified memory (/proc/meminfo MemTotal; the CPU and the GPU share it)"
    if device != "cpu" and torch.cuda.is_available():
        index = int(device[5:]) if device.startswith("cuda:") else 0
        props = torch.cuda.get_device_properties(index)
        return props.total_memory / 2**30, f"the memory of GPU {index} ({props.name}; model.device {device})"
    if device.startswith("cuda"):
        raise ValueError(f"model.device is {device} but torch sees no CUDA GPU here: give --device-memory GB")
    try:
        total = read_meminfo(meminfo)["ram_total_mb"] / 1024
        where = "/proc/meminfo MemTotal"
    except (OSError, KeyError):
        import psutil

        total, where = psutil.virtual_memory().total / 2**30, "psutil"
    return total, f"this machine's RAM ({where}; model.device {device}, no GPU in use)"

def _cap(config, cfg: dict, dtype: torch.dtype) -> tuple[CacheSpec, int]:
    """The cache's spec at the model's shape and ``dtype``, and the config's cap in tokens (``cache.max_mib`` or
    ``cache.max_tokens``)."""
    t = cfg["text"]
    spec = CacheSpec.uniform(t["num_hidden_layers"], t["num_key_value_heads"],
                             t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"], dtype)
    if config.cache.max_mib is not None:
        return spec, spec.tokens_for_mib(config.cache.max_mib)
    return spec, int(config.cache.max_tokens)


def check_config(config_path, device_memory_gb: float, model_dir: str | Path | None = None,
                 reserve_gb: float = DEFAULT_RESERVE_GB, weights_gb: float | None = None) -> tuple[Plan, str]:
    """Plan for a deployment config (its model, ``model.dtype``, ``video.resolution``,
    ``cache.text_reserve_tokens``) and check its cap: (plan, verdict line); ValueError when the config's
    ``cache.max_tokens`` (or ``max_mib``) is more than the device holds. ``config_path``: a YAML file, or an
    ``EdgeKVConfig`` already loaded (``edgekv-camera --check``: the file with its flags and ``--set``)."""
    from edgekv.config import EdgeKVConfig, load_config

    config = config_path if isinstance(config_path, EdgeKVConfig) else load_config(config_path)
    if isinstance(config_path, EdgeKVConfig):
        config_path = "the config"
    path = model_dir if model_dir is not None else config.model.path
    if path is None:
        raise ValueError(f"{config_path}: model.path is not set (or pass --model DIR)")
    from edgekv.model.builtin import resolve_model_path

    path = resolve_model_path(str(path))  # builtin:toy and the like, as the daemon loads them
    resolution = config.video.resolution or (448, 448)
    result = plan(device_memory_gb, path, resolution=(int(resolution[0]), int(resolution[1])),
                  weight_dtype=config.model.dtype, reserve_gb=reserve_gb,
                  text_reserve_tokens=int(config.cache.text_reserve_tokens), weights_gb=weights_gb,
                  lm_head=config.model.lm_head)
    model = _model_config(Path(path))
    _, cap = _cap(config, model, _DTYPES[config.model.dtype])
    free = result.device_memory_bytes - result.reserve_bytes - result.weight_bytes - result.activation_bytes
    spare = free - cap * result.bytes_per_token
    if spare < 0:
        raise ValueError(f"{config_path}: cache.max_tokens {cap} does not fit {device_memory_gb:.2f} GB (the plan "
                         f"allows {result.max_tokens}; weights {result.weight_bytes / 2**30:.2f} GiB, "
                         f"{result.weights_note})")
    over = ""
    if cap > result.max_tokens:  # memory holds it: the plan's ceiling there is the positions', not a refusal
        over = (f"; more than the plan's {result.max_tokens}, half the model's position range "
                f"(max_position_embeddings {model['text'].get('max_position_embeddings', 32768)}), past which slots "
                f"buy little: positions are re-based there")
    return result, (f"{config_path}: cache.max_tokens {cap} fits ({cap * result.bytes_per_token / 2**20:.0f} MiB; "
                    + (f"the plan allows {result.max_tokens}, " if not over else "") + f"{spare / 2**30:.2f} GiB to "
                    f"spare{over})")
