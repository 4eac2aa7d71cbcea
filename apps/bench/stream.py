"""``edgekv bench stream``: per-frame ingest time, cache size and process memory over a long stream.

Runs edgekv's session and, side by side in the same process, transformers'
``Qwen2_5_VLForConditionalGeneration`` fed the same frame pairs one at a time with its own growing
cache (``DynamicCache``) and the same M-RoPE positions. Prints the speed ratio and saves JSON + PNG.
By default an evicting policy (``infinipot_v``) under a cap that fills after ~24 frame pairs, so the
figures show the cap at work (the plot draws it). Figures only: nothing here asserts a speed.

``--device cuda --dtype bf16`` runs edgekv on a GPU (the transformers side stays on CPU: pass
``--no-hf``). Each policy then also reports GPU memory per pair (allocated, and the peak since the
previous pair) and, through NVML's total energy counter, J per frame and J per token. The weights load
once; each (policy, B) run gets its own session and its own capped cache, freed before the next.

What each per-pair time means. ``ingest_wall_ms``: the bench's wall clock around ``session.ingest``
with the device synchronized before and after, so on a GPU it holds all of the pair's device work.
``ingest_ms`` / ``vision_ms`` / ``prefill_ms`` / ``compression_ms``: the session's own host clocks
(edgekv/session/ingest.py). The bench turns on the session's ``sync_phases``: on CUDA the device is
synchronized at each phase boundary, so each phase's figure holds its own device work (a service runs without
it: a sync a phase would stall the stream). ``wall_compression_estimate`` also gives compression's cost from
the synchronized per-pair wall times, a cross-check. On CPU every op runs in the caller.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import psutil

from edgekv.apps.bench.common import device_argument, provenance
from edgekv.apps.bench.common import sync_device as _sync
from edgekv.threads import threads_argument
from edgekv.video.sources import looped_frames

DEFAULT_PAIRS_BEFORE_CAP = 24  # the default cap holds this many frame pairs (+ prefix + question room)
DTYPES = ("fp32", "bf16", "fp16")  # model.dtype
GPU_PEAK_WINDOW = 100  # pairs compared early vs late for "peak GPU memory is flat"
CAPPED_FULL_TWIN = "infinipot_v"  # statekv is infinipot_v + sinks: at B = 0 it is this, prefill over the cache

STREAM_EPILOG = """\
sinks and policies: --sinks lists StateKV sink budgets B and applies to --policy statekv only, one run per B.
statekv at B=0 is not a cache configuration (it needs sinks): the bench runs its capped-full twin instead,
infinipot_v with sinks 0 (the same capped cache and the same eviction; each pair's prefill attends to the
whole capped cache) and labels that run infinipot_v. Every other policy prefills over the whole capped cache.
A (policy, B) that comes up twice runs once.

issue 32 (3B shape, 448x448 = 256 tokens per pair, M = 6144, StateKV B = 1024 vs capped-full, on a GPU):
  edgekv make-tiny-checkpoint ckpt-3b --preset 3b
  edgekv bench stream --model ckpt-3b --device cuda --dtype bf16 --resolution 448 448 \\
      --source 'synthetic:shapes?size=448x448&fps=2' --fps 2 --frames 2000 --max-tokens 6144 \\
      --policy statekv --sinks 1024,0 --no-hf
"""


def add_stream_arguments(stream: argparse.ArgumentParser) -> None:
    from edgekv.config import POLICIES

    stream.add_argument("--model", help="checkpoint dir or builtin:toy (default: a fresh tiny random checkpoint)")
    stream.add_argument("--frames", type=int, default=600, help="video frames to ingest (pairs = frames / 2)")
    stream.add_argument("--policy", default="infinipot_v",
                        help=f"comma-separated cache policies to run, from: {', '.join(POLICIES)}")
    stream.add_argument("--source", default="synthetic:shapes", help="video source (file path or synthetic:...)")
    stream.add_argument("--resolution", type=int, nargs=2, default=[224, 224], metavar=("H", "W"),
                        help="video.resolution (multiples of 28)")
    stream.add_argument("--source-size", type=int, nargs=2, default=None, metavar=("H", "W"),
                        help="resize source frames to this size before ingest (keeps memory low for big files)")
    stream.add_argument("--fps", type=float, default=2.0, help="frames per second sampled from the source")
    stream.add_argument("--max-tokens", type=int, default=None,
                        help=f"cache cap M (default: {DEFAULT_PAIRS_BEFORE_CAP} frame pairs + prefix + question room "
                             "for evicting policies, the whole stream for full)")
    stream.add_argument("--sinks", type=sinks_argument, default=None, metavar="B[,B...]",
                        help="comma-separated StateKV sink budgets B, one statekv run per B (required with --policy "
                             "statekv); B=0 runs statekv's capped-full twin, infinipot_v (see below)")
    stream.add_argument("--device", type=device_argument, default="cpu",
                        help="where edgekv's model runs: cpu, cuda, cuda:N, or auto (cuda when one is visible)")
    stream.add_argument("--dtype", choices=DTYPES, default="fp32",
                        help="model.dtype of edgekv (and of the transformers side, which runs on cpu only)")
    stream.add_argument("--kv-dtype", choices=["fp32", "fp16", "bf16", "int8", "fp8"], default=None,
                        help="cache.kv_dtype of edgekv's cache (default: the model's dtype); int8 / fp8 read the "
                             "8-bit cache in the kernels on a GPU")
    stream.add_argument("--vision-route", choices=["auto", "eager", "graph"], default=None,
                        help="model.vision_route: graph = a CUDA graph of the tower per frame-pair grid (CUDA only); "
                             "eager; auto (default) = graph on CUDA")
    stream.add_argument("--prefill-route", choices=["auto", "eager", "fused"], default=None,
                        help="model.prefill_route: fused = each LM layer's small work in Triton kernels (CUDA only); "
                             "eager; auto (default) = eager until the fused route has run on a GPU")
    stream.add_argument("--pair-route", choices=["auto", "eager", "graph"], default=None,
                        help="model.pair_route: graph = a frame pair's LM prefill as one CUDA graph, one per cache "
                             "length (CUDA only); eager; auto (default) = graph on CUDA")
    stream.add_argument("--vision-mlp-width", choices=["auto", "as_loaded", "padded"], default=None,
                        help="model.vision_mlp_width: padded = the vision MLPs zero-padded to a multiple of 8 (the same "
                             "tower, aligned products); as_loaded; auto (default) = padded on CUDA")
    stream.add_argument("--no-hf", action="store_true", help="skip the transformers side (required off cpu)")
    stream.add_argument("--threads", type=threads_argument, default=None, help="torch CPU threads")
    stream.add_argument("--json", default="bench-stream.json", help="figures (JSON) written here")
    stream.add_argument("--plot", default="bench-stream.png", help="plot (PNG) written here ('' to skip)")
    stream.epilog = STREAM_EPILOG
    stream.set_defaults(run=run_stream)


def sinks_argument(text: str) -> list[int]:
    """argparse ``type`` for ``--sinks``: ``"1024,0"`` -> [1024, 0], each a whole number >= 0."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers >= 0 (e.g. 1024,0), got {text!r}")
        values.append(int(part))
    return values


def resolve_bench_device(name: str):
    """``--device`` as a ``torch.device``; ``ValueError`` naming the flag when it asks for a GPU that is not here."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: no CUDA device is available to this torch "
                             f"({torch.__version__}); use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: this machine shows {torch.cuda.device_count()} CUDA device(s)")
    return device


def stream_variants(policies: list[str], sinks: list[int] | None) -> tuple[list[tuple[str, int]], list[str]]:
    """The (policy, B) runs in order, and notes on what was mapped or dropped. ``statekv`` runs once per B
    in ``sinks``; its B = 0 is ``CAPPED_FULL_TWIN`` at B = 0 (statekv is that policy plus sinks). Every other
    policy runs once at B = 0. A run that comes up twice runs once."""
    if "statekv" in policies and not sinks:
        raise ValueError("--policy statekv needs --sinks B (StateKV's sink budget, e.g. --sinks 1024; "
                         "--sinks 1024,0 adds the capped-full run)")
    runs, notes = [], []
    for policy in policies:
        for budget in sinks if policy == "statekv" else [0]:
            run = (policy, budget)
            if run == ("statekv", 0):
                run = (CAPPED_FULL_TWIN, 0)
                notes.append(f"statekv B=0 runs as {CAPPED_FULL_TWIN} (sinks 0): the same eviction, each pair's "
                             "prefill over the whole capped cache (capped-full)")
            if run in runs:
                notes.append(f"{_label(*run)} comes up twice: run once")
                continue
            runs.append(run)
    if sinks and "statekv" not in policies and any(sinks):
        notes.append("--sinks applies to --policy statekv only: ignored")
    return runs, notes


def _label(policy: str, sinks: int) -> str:
    return f"{policy} B={sinks}" if sinks else policy


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


# ---------------------------------------------------------------------------------------------- device
def _gpu_memory(device) -> dict:
    """CUDA allocator figures for ``device`` in MiB: ``gpu_allocated_mb`` held by tensors now,
    ``gpu_reserved_mb`` held by the caching allocator now (what the driver sees), ``gpu_peak_mb`` the most
    allocated since the last ``reset_peak_memory_stats`` (the previous pair). Empty on CPU."""
    if device.type != "cuda":
        return {}
    import torch

    return {"gpu_allocated_mb": torch.cuda.memory_allocated(device) / 2**20,
            "gpu_reserved_mb": torch.cuda.memory_reserved(device) / 2**20,
            "gpu_peak_mb": torch.cuda.max_memory_allocated(device) / 2**20}


def _reset_gpu_peak(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats(device)


def energy_meter(device):
    """``(NvmlEnergy, None)`` for a CUDA device whose total energy counter NVML can read, else
    ``(None, why not)``. The GPU is matched by its UUID (CUDA and NVML may number GPUs differently); by
    NVML index only when ``CUDA_VISIBLE_DEVICES`` is unset and the UUID lookup failed."""
    if device.type != "cuda":
        return None, f"--device {device}: NVML's energy counter measures a GPU; nothing is read on cpu"
    import torch

    from edgekv.monitor.nvml import NvmlEnergy
    from edgekv.monitor.tegrastats import ReaderError

    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    tries = []
    if uuid is not None:
        text = str(uuid)
        tries.append({"uuid": text if text.startswith(("GPU-", "MIG-")) else f"GPU-{text}"})
    if uuid is None or "CUDA_VISIBLE_DEVICES" not in os.environ:
        tries.append({"index": index})
    errors = []
    for where in tries:
        try:
            return NvmlEnergy(**where), None
        except ReaderError as exc:
            errors.append(str(exc))
    return None, "; ".join(errors)


class EnergyWindow:
    """Joules since ``start()`` on the GPU's energy counter (``NvmlEnergy``), or None with ``why_not``.
    A reading that fails mid-run ends the window (the figures become None, the reason is kept) rather
    than the bench: a long GPU run keeps its other figures."""

    def __init__(self, meter, why_not: str | None) -> None:
        self.meter, self.why_not = meter, why_not
        self.where = meter.where if meter is not None else None
        self.start_mj: int | None = None

    def start(self) -> None:
        self.start_mj = self._read()

    def joules(self) -> float | None:
        now = self._read()
        return None if now is None or self.start_mj is None else (now - self.start_mj) / 1e3

    def _read(self) -> int | None:
        from edgekv.monitor.tegrastats import ReaderError

        if self.meter is None:
            return None
        try:
            return self.meter.read_mj()
        except ReaderError as exc:
            self.why_not = f"an NVML reading failed during the run, so no energy is reported: {exc}"
            self.close()
            return None

    def close(self) -> None:
        if self.meter is not None:
            self.meter.close()
            self.meter = None


def energy_figures(energy_j: float | None, window_s: float, pairs: int, tokens: int) -> dict:
    """What the energy of one policy's stream comes to. ``energy_j``: the GPU's total energy counter
    (NVML, whole board, idle included) from just before the session was built to just after its last
    pair (the device synchronized at both ends), so it holds the prefix's prefill and the bench's own
    per-pair bookkeeping too. ``j_per_frame``: per video frame ingested (2 per pair). ``j_per_token``: per
    token ingest wrote into the cache (the system prefix + every pair's tokens), before any eviction."""
    frames = 2 * pairs
    return {"energy_j": energy_j, "energy_window_s": window_s, "energy_frames": frames, "energy_tokens": tokens,
            "mean_power_w": energy_j / window_s if energy_j is not None and window_s > 0 else None,
            "j_per_frame": energy_j / frames if energy_j is not None and frames else None,
            "j_per_token": energy_j / tokens if energy_j is not None and tokens else None}


# ---------------------------------------------------------------------------------------------- edgekv
def _run_edgekv(runtime, frames, args: argparse.Namespace, policy: str, sinks: int) -> dict:
    """One (policy, B) stream on ``runtime`` (this run's cache section, the shared weights): a row per
    frame pair, the session's stats, the steady-state summary, GPU memory and energy figures."""
    from edgekv.cache import CacheFullError

    device = runtime.device
    gc.collect()  # the previous run's session and cache: gone before this one is measured
    if device.type == "cuda":
        import torch

        torch.cuda.empty_cache()
    energy = EnergyWindow(*energy_meter(device))
    try:
        _sync(device)
        _reset_gpu_peak(device)
        window_started = time.perf_counter()
        energy.start()
        session = runtime.session()
        session.sync_phases = True  # the session synchronizes a CUDA device at each phase boundary (its bench switch)
        _sync(device)
        setup = _gpu_memory(device)  # the session's cache and the prefix's prefill, on top of the weights
        _reset_gpu_peak(device)
        text = runtime.model.config.text
        tokens_written = session.prefix_tokens
        rows = []
        stopped = None
        for frame, t in frames:
            try:
                _sync(device)  # nothing of the last pair left running: this pair's wall time is its own
                wall_started = time.perf_counter()
                cpu_started = time.process_time()
                result = session.ingest(frame, t=t)
                cpu_ms = (time.process_time() - cpu_started) * 1e3
                _sync(device)
                wall_ms = (time.perf_counter() - wall_started) * 1e3
            except CacheFullError:
                stopped = (f"stopped at frame pair {session.counters.frame_pairs}: the cache is full "
                           "(policy never evicts)")
                print(f"[{policy}] {stopped}")
                break
            if result.pair_index is None:
                continue
            tokens_written += result.tokens_added
            stats = session.stats()
            visible = _visible_keys(session, sinks)
            row = {
                "pair": result.pair_index, "ingest_ms": result.ms, "ingest_wall_ms": wall_ms, "ingest_cpu_ms": cpu_ms,
                "vision_ms": result.vision_ms, "prefill_ms": result.prefill_ms, "compression_ms": result.compression_ms,
                "compressions": stats["compressions"], "tokens_added": result.tokens_added,
                "cache_tokens": stats["cache_tokens"], "cache_bytes": stats["cache_capacity_bytes"],
                "rss_mb": _rss_mb(), "lm_gflops": lm_prefill_flops(text, result.tokens_added, visible) / 1e9,
                **_gpu_memory(device),
            }
            _reset_gpu_peak(device)
            joules = energy.joules()  # since just before the session was built
            if joules is not None:
                row["energy_j"] = joules
            rows.append(row)
        _sync(device)
        energy_j = energy.joules()
        window_s = time.perf_counter() - window_started
    finally:
        energy.close()
    stats = session.stats()
    summary = steady_state_summary(rows)
    summary.update(wall_compression_estimate(rows))
    summary.update(gpu_memory_summary(rows))
    summary.update(energy_after_first_compression(rows))
    return {"policy": policy, "sinks": sinks, "label": _label(policy, sinks),
            "prefill_attends": (f"the prefix, {sinks} sinks and the pair" if sinks else "the whole capped cache"),
            "device": str(device), "dtype": args.dtype, "phase_split_synchronized": True,
            "rows": rows, "stats": stats, "stopped": stopped,
            "gpu_at_session_start": setup or None,  # weights + this session's cache + the prefix's prefill (peak)
            **energy_figures(energy_j, window_s, len(rows), tokens_written),
            "energy_source": f"NVML total energy counter, {energy.where}" if energy_j is not None else None,
            "energy_unavailable": energy.why_not if energy_j is None else None, "summary": summary}


def _visible_keys(session, sinks: int) -> int:
    """Keys a frame pair's queries saw: prefix + sinks + the pair (StateKV) or the whole cache."""
    if sinks:
        return session.prefix_tokens + min(sinks, session.cache.length) + session.tokens_per_pair
    return session.cache.length


def lm_prefill_flops(text, tokens: int, keys: int) -> float:
    """Analytic FLOPs of one chunk through the language model (2 per multiply-add): projections, MLP,
    and attention scores + weighted sum over ``keys`` visible keys. The vision tower is the same for
    every policy and is left out."""
    d, hd = text.hidden_size, text.head_dim
    q, kv = text.num_attention_heads * hd, text.num_key_value_heads * hd
    projections = 2 * tokens * d * (q + 2 * kv + q)
    mlp = 2 * tokens * 3 * d * text.intermediate_size
    attention = 2 * 2 * tokens * keys * q
    return float(text.num_hidden_layers * (projections + mlp + attention))


def steady_state_summary(rows: list[dict]) -> dict:
    """Issue targets after the first compression: RSS growth, late vs early median ingest, compression share."""
    first = next((i for i, r in enumerate(rows) if r.get("compression_ms", 0) > 0), None)
    total_ms = sum(r["ingest_ms"] for r in rows)
    summary = {"pairs": len(rows), "compressions": sum(1 for r in rows if r.get("compression_ms", 0) > 0),
               "compression_ms_total": sum(r.get("compression_ms", 0.0) for r in rows), "ingest_ms_total": total_ms}
    summary["compression_share"] = summary["compression_ms_total"] / total_ms if total_ms else None
    durations = [r["compression_ms"] for r in rows if r.get("compression_ms", 0) > 0]
    if durations:
        summary["compression_ms_median"] = statistics.median(durations)
        summary["compression_ms_max"] = max(durations)
    if first is not None:
        after = rows[first:]
        after_ms = sum(r["ingest_ms"] for r in after)
        summary["compression_share_after_first_compression"] = (
            sum(r.get("compression_ms", 0.0) for r in after) / after_ms if after_ms else None)
        summary["rss_growth_after_first_compression"] = after[-1]["rss_mb"] / after[0]["rss_mb"] - 1.0
    if first is not None and len(rows) - first >= 400:
        summary["late_over_early_median_ingest"] = (statistics.median(r["ingest_ms"] for r in after[-200:])
                                                    / statistics.median(r["ingest_ms"] for r in after[:200]))
        if all("ingest_cpu_ms" in r for r in after):
            # the same ratio on process CPU time: free of the wall-clock jitter a shared machine adds
            summary["late_over_early_median_ingest_cpu"] = (
                statistics.median(r["ingest_cpu_ms"] for r in after[-200:])
                / statistics.median(r["ingest_cpu_ms"] for r in after[:200]))
    return summary


def _first_compression(rows: list[dict]) -> int | None:
    """Index of the first row whose pair ran a compression, None when none did."""
    return next((i for i, compressed in enumerate(_compressed(rows)) if compressed), None)


def _compressed(rows: list[dict]) -> list[bool]:
    """Per row: did that pair run a compression (the ``compressions`` count went up, else ``compression_ms`` > 0)."""
    out, before = [], 0
    for r in rows:
        if "compressions" in r:
            out.append(r["compressions"] > before)
            before = r["compressions"]
        else:
            out.append(r.get("compression_ms", 0) > 0)
    return out


def wall_compression_estimate(rows: list[dict]) -> dict:
    """Compression's cost estimated from synchronized wall times (``ingest_wall_ms``), on any device: for
    each pair k that compressed and whose next pair did not, ``wall(k) - wall(k + 1)``. The two pairs run
    the same vision tower and prefill over nearly the same cache (k + 1 sees one pair more, so with
    prefill over the whole cache the estimate is a little low). ``compression_ms_wall_median``: the median
    difference; ``compression_share_wall``: their sum over the total wall time of all pairs (compressions
    with no such next pair left out); ``compression_wall_pairs``: how many differences there are."""
    if not rows or not all("ingest_wall_ms" in r for r in rows):
        return {}
    compressed = _compressed(rows)
    differences = [rows[k]["ingest_wall_ms"] - rows[k + 1]["ingest_wall_ms"]
                   for k in range(len(rows) - 1) if compressed[k] and not compressed[k + 1]]
    total = sum(r["ingest_wall_ms"] for r in rows)
    return {"ingest_wall_ms_total": total,
            "ingest_wall_ms_median": statistics.median(r["ingest_wall_ms"] for r in rows),
            "compression_wall_pairs": len(differences),
            "compression_ms_wall_median": statistics.median(differences) if differences else None,
            "compression_share_wall": sum(differences) / total if differences and total > 0 else None}


def gpu_memory_summary(rows: list[dict], window: int = GPU_PEAK_WINDOW) -> dict:
    """Is peak GPU memory flat? The most any pair's ``gpu_peak_mb`` reached over the first ``window`` pairs
    from the first compression on (from the first pair when none ran), against the last ``window`` pairs;
    halves of those pairs when there are fewer than ``2 * window``. ``gpu_peak_late_over_early`` = 1.0
    means flat; above it, memory grew while the cache was capped. Empty without GPU rows."""
    if not rows or not all("gpu_peak_mb" in r for r in rows):
        return {}
    first = _first_compression(rows)
    after = rows[first:] if first is not None else rows
    n = min(window, len(after) // 2)
    out = {"gpu_peak_mb_max": max(r["gpu_peak_mb"] for r in rows),
           "gpu_allocated_mb_last": rows[-1]["gpu_allocated_mb"],
           "gpu_peak_from": "the first compression" if first is not None else "the first pair (no compression ran)",
           "gpu_peak_window_pairs": n}
    if n:
        early, late = max(r["gpu_peak_mb"] for r in after[:n]), max(r["gpu_peak_mb"] for r in after[-n:])
        out.update({"gpu_peak_mb_early": early, "gpu_peak_mb_late": late,
                    "gpu_peak_late_over_early": late / early if early > 0 else None})
    return out


def energy_after_first_compression(rows: list[dict]) -> dict:
    """Steady-state energy, from the rows' cumulative ``energy_j``: the energy of the pairs from the first
    compression on (counter at the last pair less the counter at the pair before the first compression),
    per frame (2 per pair) and per token those pairs wrote. Empty without energy rows or when the first
    pair already compressed (no reading before it)."""
    if not rows or not all("energy_j" in r for r in rows):
        return {}
    first = _first_compression(rows)
    if not first:  # None (never compressed) or 0 (no reading before it)
        return {}
    after = rows[first:]
    energy = rows[-1]["energy_j"] - rows[first - 1]["energy_j"]
    tokens = sum(r.get("tokens_added", 0) for r in after)
    return {"energy_j_after_first_compression": energy, "pairs_after_first_compression": len(after),
            "j_per_frame_after_first_compression": energy / (2 * len(after)),
            "j_per_token_after_first_compression": energy / tokens if tokens else None}


def _cache_section(policy: str, args: argparse.Namespace, pairs: int, sinks: int) -> dict:
    section = {"policy": policy, "sinks": sinks}
    if getattr(args, "kv_dtype", None):
        section["kv_dtype"] = args.kv_dtype
    if args.max_tokens:
        section["max_tokens"] = args.max_tokens
    else:
        section["max_tokens"] = default_cap(policy, tuple(args.resolution), pairs)
    return section


def default_cap(policy: str, resolution: tuple[int, int], pairs: int) -> int:
    """The cap when none is given: ``full`` holds the whole stream (it cannot evict); every other policy
    gets room for ``DEFAULT_PAIRS_BEFORE_CAP`` pairs, so a default run compresses and shows the cap."""
    tokens_per_pair = (resolution[0] // 28) * (resolution[1] // 28)
    held = pairs + 1 if policy == "full" else min(pairs + 1, DEFAULT_PAIRS_BEFORE_CAP)
    return 64 + 512 + held * tokens_per_pair


# ---------------------------------------------------------------------------------------------- transformers
def _run_hf(model_dir: Path, frames, args: argparse.Namespace) -> dict:
    """transformers' model in ``--dtype`` on CPU (``run_stream`` refuses any other device: its cache grows
    with the stream), fed the same pairs with the same positions; per-pair wall time and RSS."""
    import torch
    from transformers import DynamicCache, Qwen2_5_VLForConditionalGeneration

    from edgekv.model.config import ModelConfig
    from edgekv.model.rope import text_position_ids, vision_block_position_ids
    from edgekv.preprocess import FramePreprocessor
    from edgekv.tokenizer import ChatLayout, QwenTokenizer

    config = ModelConfig.from_dir(model_dir)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=dtype).eval()
    tokenizer = QwenTokenizer.from_dir(model_dir)
    pre = FramePreprocessor(resolution=tuple(args.resolution))
    prefix = tokenizer.encode(ChatLayout().stream_prefix())
    cache = DynamicCache(config=model.config)
    merge = config.vision.spatial_merge_size
    rows = []
    with torch.inference_mode():
        ids = torch.tensor([prefix])
        model(input_ids=ids, position_ids=text_position_ids(0, len(prefix))[:, None], past_key_values=cache,
              use_cache=True)
        t0 = None
        iterator = iter(frames)
        for pair in range(args.frames // 2):
            try:
                (first, t_first), (second, _) = next(iterator), next(iterator)
            except StopIteration:
                break
            t0 = t_first if t0 is None else t0
            started = time.perf_counter()
            pixel_values, grid = pre.pair(first, second)
            gh, gw = int(grid[0, 1]) // merge, int(grid[0, 2]) // merge
            t_pos = int((t_first - t0) * config.vision.tokens_per_second + 1e-9)
            positions = vision_block_position_ids(len(prefix), t_pos, gh, gw)[:, None]
            ids = torch.full((1, gh * gw), config.video_token_id)
            model(input_ids=ids, pixel_values_videos=pixel_values, video_grid_thw=grid, position_ids=positions,
                  past_key_values=cache, use_cache=True, mm_token_type_ids=torch.full_like(ids, 2))
            rows.append({"pair": pair, "ingest_ms": (time.perf_counter() - started) * 1e3, "rss_mb": _rss_mb()})
    return {"policy": "transformers", "label": "transformers", "device": "cpu", "dtype": args.dtype, "rows": rows}


# ---------------------------------------------------------------------------------------------- report
def _median_at(rows: list[dict], pair: int, window: int = 10) -> float | None:
    values = [r["ingest_ms"] for r in rows if abs(r["pair"] - pair) <= window]
    return statistics.median(values) if values else None


def _plot(results: list[dict], path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("ingest_ms", "ingest ms / frame pair"), ("cache_tokens", "cache tokens"),
              ("rss_mb", "process RSS (MiB)"), ("compression_ms", "compression ms (when one ran)"),
              ("lm_gflops", "LM GFLOPs / frame pair (analytic)")]
    if any("gpu_peak_mb" in r for result in results for r in result["rows"]):
        panels.append(("gpu_peak_mb", "GPU peak MiB since the last pair"))
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.6 * len(panels)), sharex=True)
    for result in results:
        label = result["policy"] + (f" B={result['sinks']}" if result.get("sinks") else "")
        rows = result["rows"]
        for ax, (key, _) in zip(axes, panels):
            points = [(r["pair"], r[key]) for r in rows if key in r and (key != "compression_ms" or r[key] > 0)]
            if not points:
                continue
            xs, ys = zip(*points)
            if key == "compression_ms":
                ax.scatter(xs, ys, s=6, label=label)
            else:
                ax.plot(xs, ys, label=label, lw=0.8)
    cache_axis = axes[[key for key, _ in panels].index("cache_tokens")]
    for result in results:  # the hard cap M, less the room kept for a question: where video stops
        stats = result.get("stats") or {}
        if stats.get("cache_capacity_tokens"):
            limit = stats["cache_capacity_tokens"] - stats.get("text_reserve_tokens", 0)
            cache_axis.axhline(limit, ls="--", lw=0.8, color="grey")
            cache_axis.annotate(f"{result['policy']}: cap M={stats['cache_capacity_tokens']} less question room",
                                (0.01, limit), fontsize=7, va="bottom", color="grey",
                                xycoords=("axes fraction", "data"))
    for ax, (_, ylabel) in zip(axes, panels):
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("frame pair")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _describe(summary: dict) -> str:
    parts = [f"{summary['compressions']} compressions"]
    if summary.get("compression_share") is not None:
        parts.append(f"compression {100 * summary['compression_share']:.3f} % of ingest time")
    if "compression_ms_median" in summary:
        parts.append(f"median compression {summary['compression_ms_median']:.1f} ms")
    if summary.get("compression_share_after_first_compression") is not None:
        parts.append(f"{100 * summary['compression_share_after_first_compression']:.3f} % from the first compression on")
    if "rss_growth_after_first_compression" in summary:
        parts.append(f"RSS growth after first compression {100 * summary['rss_growth_after_first_compression']:+.2f} %")
    if "late_over_early_median_ingest" in summary:
        parts.append(f"late/early median ingest {summary['late_over_early_median_ingest']:.3f}")
    if "late_over_early_median_ingest_cpu" in summary:
        parts.append(f"(CPU time {summary['late_over_early_median_ingest_cpu']:.3f})")
    return ", ".join(parts)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _describe_device(result: dict) -> list[str]:
    """The printed lines for wall time, GPU memory and energy of one run (what the JSON holds, in words)."""
    summary, lines = result["summary"], []
    if summary.get("ingest_wall_ms_median") is not None:
        line = f"wall (device synchronized per pair): median {summary['ingest_wall_ms_median']:.1f} ms per pair"
        if not result["phase_split_synchronized"] and summary.get("compression_ms_wall_median") is not None:
            share = summary["compression_share_wall"]
            line += (f"; compression about {summary['compression_ms_wall_median']:.1f} ms (median over "
                     f"{summary['compression_wall_pairs']} compressing pairs against the next pair), "
                     f"{_fmt(None if share is None else 100 * share, '.3f')} % of wall time")
        lines.append(line)
    if "gpu_peak_mb_max" in summary:
        line = f"GPU memory: peak {summary['gpu_peak_mb_max']:.1f} MiB"
        if summary.get("gpu_peak_mb_early") is not None:
            n = summary["gpu_peak_window_pairs"]
            line += (f"; from {summary['gpu_peak_from']}: first {n} pairs {summary['gpu_peak_mb_early']:.1f} MiB, "
                     f"last {n} pairs {summary['gpu_peak_mb_late']:.1f} MiB (late/early "
                     f"{_fmt(summary['gpu_peak_late_over_early'], '.4f')})")
        lines.append(line)
    if result.get("energy_j") is not None:
        line = (f"energy: {result['energy_j']:.1f} J over {result['energy_window_s']:.1f} s "
                f"({_fmt(result['mean_power_w'], '.1f')} W mean, {result['energy_source']}): "
                f"{_fmt(result['j_per_frame'], '.4f')} J/frame, {_fmt(result['j_per_token'], '.6f')} J/token")
        if summary.get("j_per_frame_after_first_compression") is not None:
            line += (f"; from the first compression on {summary['j_per_frame_after_first_compression']:.4f} J/frame, "
                     f"{_fmt(summary['j_per_token_after_first_compression'], '.6f')} J/token")
        lines.append(line)
    else:
        lines.append(f"energy: not measured ({result.get('energy_unavailable')})")
    return lines


def run_stream(args: argparse.Namespace) -> int:
    import torch

    import edgekv
    from edgekv.apps.bench.common import comma_choices
    from edgekv.config import POLICIES
    from edgekv.video.sources import parse_spec

    parse_spec(args.source)  # a source that cannot be is the user's mistake, not one policy's refusal
    if args.frames < 2:
        raise ValueError(f"--frames {args.frames}: a frame pair needs at least 2 frames")
    device = resolve_bench_device(args.device)  # before any weights load: a GPU that is not here fails now
    if device.type != "cpu" and not args.no_hf:
        raise ValueError(f"--device {args.device}: the transformers side runs on cpu only (its DynamicCache grows "
                         "with the stream, without bound); add --no-hf to run edgekv alone on the GPU")
    runs, notes = stream_variants(comma_choices(args.policy, POLICIES, "--policy", "policy"), args.sinks)

    if args.threads:
        from edgekv.threads import apply_threads

        apply_threads(args.threads)
    if args.model:  # builtin:toy too: the transformers side reads the folder itself
        from edgekv.model.builtin import resolve_model_path

        model_dir = Path(resolve_model_path(args.model))
    else:
        from edgekv.model.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="edgekv-bench-")) / "tiny", preset="tiny")
    resize = tuple(args.source_size) if args.source_size else None

    def frames():
        return looped_frames(args.source, args.frames, args.fps, resize)

    synchronized = True
    phase_note = ("cpu: every op runs in the caller, so the session's vision / prefill / compression times are the "
                  "work itself" if device.type == "cpu" else
                  f"{device}: the session synchronizes the device at each phase boundary (session.sync_phases), so "
                  "vision / prefill / compression hold their own device work; compression_ms_wall_median / "
                  "compression_share_wall estimate compression from the synchronized per-pair wall times as a check")
    print(f"stream: {args.frames} frames ({args.frames // 2} pairs) from {args.source} at {args.resolution}, "
          f"edgekv on {device} in {args.dtype}")
    print(f"phase split {'synchronized' if synchronized else 'NOT synchronized'}: {phase_note}")
    for note in notes:
        print(f"note: {note}")
    # The weights load once; each run is a runtime sharing them with its own cache section (Runtime.sharing).
    model = {"dtype": args.dtype, "device": str(device)}
    if getattr(args, "vision_route", None):
        model["vision_route"] = args.vision_route
    if getattr(args, "prefill_route", None):
        model["prefill_route"] = args.prefill_route
    if getattr(args, "pair_route", None):
        model["pair_route"] = args.pair_route
    if getattr(args, "vision_mlp_width", None):
        model["vision_mlp_width"] = args.vision_mlp_width
    base = edgekv.Runtime.from_pretrained(model_dir, model=model,
                                          video={"resolution": list(args.resolution), "fps": args.fps})
    base_vision_route, base_prefill_route, base_pair_route = base.vision_route, base.prefill_route, base.pair_route
    base_mlp_width = base.vision_mlp_width
    print(f"vision tower: {base_vision_route} (MLP width {base_mlp_width}), LM prefill: {base.prefill_route}, "
          f"pairs: {base.pair_route}")
    results = []
    for policy, sinks in runs:
        label = f"[edgekv {_label(policy, sinks)}]"
        try:
            config = base.config.with_overrides(cache=_cache_section(policy, args, args.frames // 2, sinks),
                                                label=f"bench stream {_label(policy, sinks)}")
            result = _run_edgekv(base.sharing(config), frames(), args, policy, sinks)
        except ValueError as exc:  # a budget this configuration cannot work in: record why
            print(f"{label} refused: {exc}")
            results.append({"policy": policy, "sinks": sinks, "label": _label(policy, sinks), "rows": [],
                            "refused": str(exc)})
            continue
        except RuntimeError as exc:  # e.g. out of GPU memory: keep the other runs' figures, exit non-zero at the end
            print(f"{label} failed: {exc}")
            results.append({"policy": policy, "sinks": sinks, "label": _label(policy, sinks), "rows": [],
                            "failed": f"{type(exc).__name__}: {exc}"})
            continue
        results.append(result)
        rows, stats = result["rows"], result["stats"]
        median = f"{statistics.median(r['ingest_ms'] for r in rows):.1f} ms" if rows else "n/a"
        print(f"{label} {len(rows)} pairs, median ingest {median}, compressions {stats['compressions']}, "
              f"cache {stats['cache_tokens']}/{stats['cache_capacity_tokens']} tokens, "
              f"{stats['cache_capacity_bytes'] / 2**20:.1f} MiB")
        print(f"    {_describe(result['summary'])}{'' if synchronized else ' (phase times not synchronized)'}")
        for line in _describe_device(result):
            print(f"    {line}")
    del base
    summary = {"frames": args.frames, "resolution": list(args.resolution), "source": args.source,
               "kv_dtype": args.kv_dtype or "the model's dtype", "vision_route": base_vision_route,
               "prefill_route": base_prefill_route,
               "pair_route": base_pair_route, "vision_mlp_width": base_mlp_width,
               "policies": args.policy, "sinks": args.sinks, "runs": [_label(p, b) for p, b in runs],
               "notes": notes, "max_tokens": args.max_tokens, "device": str(device), "dtype": args.dtype,
               "phase_split_synchronized": synchronized, "phase_split_note": phase_note,
               "torch_threads": torch.get_num_threads(), **provenance()}
    if device.type == "cuda":
        summary["gpu_name"] = torch.cuda.get_device_name(device)
    if not args.no_hf:
        hf = _run_hf(model_dir, frames(), args)
        results.append(hf)
        probe = min(300, len(hf["rows"]) - 1)
        ours = next((r for r in results if r["policy"] != "transformers" and r["rows"]), None)
        mine = _median_at(ours["rows"], probe) if ours is not None else None
        theirs = _median_at(hf["rows"], probe)
        if mine and theirs:
            summary.update({"probe_pair": probe, "edgekv_ms": mine, "transformers_ms": theirs, "ratio": mine / theirs})
            print(f"at frame pair {probe}: edgekv {mine:.1f} ms vs transformers {theirs:.1f} ms per pair "
                  f"-> ratio {mine / theirs:.2f} (edgekv / transformers)")
    Path(args.json).write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    if args.plot:  # --plot "": figures only
        _plot(results, Path(args.plot), f"{args.source} @ {args.resolution[0]}x{args.resolution[1]}, {args.frames} "
                                        f"frames, {device} {args.dtype}")
    print(f"wrote {args.json}" + (f" and {args.plot}" if args.plot else ""))
    failed = [r["label"] for r in results if r.get("failed")]
    if failed:
        print(f"failed runs: {', '.join(failed)} (their errors are in {args.json})")
    return 1 if failed else 0
