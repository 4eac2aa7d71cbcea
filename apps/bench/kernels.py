"""``edgekv bench kernels``: each fused kernel against its eager torch reference.

Shapes are Qwen2.5-VL-3B's (36 layers, 16 query / 2 KV heads, head_dim 128, a 448x448 frame pair =
256 merged tokens on a 16x16 grid, cache up to 6144 slots) or toy ones with ``--small``. Reports the
median of ``--repeats`` timed runs after ``--warmup``, the largest |kernel - reference| difference as a
sanity check, and saves JSON + a PNG bar chart of the speedups. On CPU the Triton side runs in the
interpreter (numpy, one program at a time): those numbers say nothing about kernel speed, and the
output says so. Figures only: nothing here asserts a speed.

Row families (``--only``): ``attention`` (attention_mass), ``policy`` (TaR and VaN), ``compaction``,
``quant_attention`` (chunk / decode attention read from an 8-bit cache, int8 and fp8) and ``int4`` (4-bit
AWQ weights, GEMV for a decode row, GEMM for a frame pair). The last two also time the same shape in bf16 —
a bf16 cache (``folded_attention``), a bf16 weight (``F.linear``) — and report ``bf16_ratio`` = bf16 ms /
Triton ms, issue 32's targets: >= 1.5x for 8-bit attention at equal slots, >= 2.5x for the 4-bit GEMV.

Those two families measure reads of memory, so on CUDA they are timed so that the L2 (60 MB on an H200)
cannot serve them: each timed pass cycles through identical copies of a call's 8-bit / 4-bit / bf16
inputs, at least ``ROTATE_BYTES`` of them (about 4x the L2), and reports the pass time over the number of
calls (``sets`` says how many copies the quantized side had). The Triton and bf16 passes are replayed from a
CUDA graph, as the decode step is (``edgekv/session/decode_graph.py``): without it a 2048-wide GEMV, a few
microseconds of memory traffic, would time Python and kernel-launch overhead (``--no-graph`` to see that).
The eager references are timed eagerly, as their name says (the 4-bit one also indexes with host lists,
which a graph cannot capture), over at most ``REFERENCE_SETS`` of the copies. On CPU there is one copy and no
graph: per-call medians, as the other rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from edgekv.apps.bench.common import sync_device as _sync


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true", help="toy shapes (for CPU, where Triton is interpreted)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="K/V and query dtype")
    parser.add_argument("--keys", type=int, nargs="+", default=None,
                        help="attention key counts N = start + P (default: 1024 4096 6144; --small: 64 160)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--only", type=row_families, default=FAMILIES, metavar="FAMILY[,FAMILY...]",
                        help=f"row families to run, comma-separated (default: all): {', '.join(FAMILIES)}")
    parser.add_argument("--graph", action=argparse.BooleanOptionalAction, default=True,
                        help="on CUDA, replay the quant_attention / int4 Triton and bf16 passes from a CUDA graph")
    parser.add_argument("--json", default="bench-kernels.json")
    parser.add_argument("--plot", default="bench-kernels.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_kernels)


@dataclass(frozen=True)
class Shapes:
    layers: int
    heads_q: int
    heads_kv: int
    head_dim: int
    grid: tuple[int, int]
    keys: tuple[int, ...]
    capacity: int
    linear: tuple[tuple[int, int], ...]  # [K x N] of the 4-bit weights: q/o, k/v, gate/up, down projections
    group: int  # 4-bit quantization group along K

    @property
    def pair(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def temporal_section(self) -> int:
        """Rotary pairs of M-RoPE's time part: Qwen2.5-VL's mrope_section (16, 24, 24) is 1/4 of the D/2 pairs."""
        return self.head_dim // 8


SHAPES_3B = Shapes(layers=36, heads_q=16, heads_kv=2, head_dim=128, grid=(16, 16), keys=(1024, 4096, 6144), capacity=6144,
                   linear=((2048, 2048), (2048, 256), (2048, 11008), (11008, 2048)), group=128)
SHAPES_SMALL = Shapes(layers=2, heads_q=4, heads_kv=2, head_dim=32, grid=(4, 4), keys=(64, 160), capacity=160,
                      linear=((128, 128), (128, 32), (128, 256), (256, 128)), group=32)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
FAMILIES = ("attention", "policy", "compaction", "quant_attention", "int4")
ROTATE_BYTES = 256 << 20  # read per timed pass of the quant_attention / int4 rows on CUDA: ~4x an H200's 60 MB L2
MAX_SETS = 1024  # copies of one call's inputs, at most
# The eager references rotate among at most this many copies: each call is several launches from Python (about a
# millisecond), so 1,024 of them a pass, x (warm-up + repeats), took minutes a row on the H200 (the first run of
# these rows printed nothing in 300 s); their inputs are the same size as the kernel's, so L2 still helps them less
# than it would help one repeated set.
REFERENCE_SETS = 8


def row_families(text: str) -> tuple[str, ...]:
    """``--only``: comma-separated names from ``FAMILIES``, kept in ``FAMILIES``' order."""
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(FAMILIES))
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown row family {', '.join(map(repr, unknown)) or repr(text)}: "
                                         f"choose from {', '.join(FAMILIES)}")
    return tuple(name for name in FAMILIES if name in names)


@dataclass
class Row:
    kernel: str
    shape: str
    torch_ms: float
    triton_ms: float | None
    max_abs_diff: float | None
    tag: str = ""  # short label for the plot
    bf16_ms: float | None = None  # the same shape on a bf16 cache / with a bf16 weight (quant_attention, int4)
    sets: int | None = None  # copies of the quantized inputs cycled per timed pass (see the module docstring)
    timing: str = ""  # how the Triton side was timed: "graph" or "eager" (rotating rows only)

    @property
    def speedup(self) -> float | None:
        return self.torch_ms / self.triton_ms if self.triton_ms else None

    @property
    def bf16_ratio(self) -> float | None:
        """bf16 ms / Triton ms: issue 32's figure (>= 1.5x 8-bit attention, >= 2.5x 4-bit GEMV)."""
        return self.bf16_ms / self.triton_ms if self.bf16_ms is not None and self.triton_ms else None


# ---------------------------------------------------------------------------------------------- timing
def median_ms(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


InputSet = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PassTimer:
    """Times a call over copies of its inputs (the quant_attention and int4 rows): one timed pass calls it
    once on every copy, between two synchronizations, and the pass's median is divided by the copies.

    ``rotate_bytes``: how many bytes of copies ``copies`` makes (0: the one set, as on CPU); ``graph``:
    replay the pass from a CUDA graph (on CUDA, for the calls that allow it)."""

    device: torch.device
    warmup: int
    repeats: int
    rotate_bytes: int
    graph: bool

    def copies(self, inputs: InputSet) -> list[InputSet]:
        """``inputs`` and identical clones, enough that one pass reads ``rotate_bytes``: when a copy comes
        round again, the L2 holds none of it (identical contents; the cache keys on addresses)."""
        size = sum(t.numel() * t.element_size() for t in inputs)
        count = min(MAX_SETS, max(1, math.ceil(self.rotate_bytes / max(size, 1))))
        return [inputs] + [tuple(t.clone() for t in inputs) for _ in range(count - 1)]

    def __call__(self, call: Callable[..., object], sets: list[InputSet], graph: bool = True) -> tuple[float, str]:
        """(ms per call, "graph" | "eager"): the median pass over ``sets`` divided by their number."""

        def one_pass() -> None:
            for inputs in sets:
                call(*inputs)

        run, how = one_pass, "eager"
        if graph and self.graph and self.device.type == "cuda":
            try:
                run, how = _graphed(one_pass, self.device), "graph"
            except RuntimeError as exc:  # a call that cannot be captured: timed eagerly, and the row says so
                torch.cuda.synchronize(self.device)
                how = f"eager (CUDA graph capture failed: {str(exc).splitlines()[0][:120]})"
        return median_ms(run, self.device, self.warmup, self.repeats) / len(sets), how


def _graphed(run: Callable[[], None], device: torch.device) -> Callable[[], None]:
    """``run`` captured in a CUDA graph, warmed up first on a side stream (Triton compiles, cuBLAS makes its
    handles there); the returned function replays it."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return graph.replay


def _diff(a: torch.Tensor | tuple, b: torch.Tensor | tuple) -> float:
    pairs = zip(a, b) if isinstance(a, tuple) else [(a, b)]
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs)


# ---------------------------------------------------------------------------------------------- cases
def _slots(shapes: Shapes, n: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Metadata of a cache of n slots: 64 prefix slots, then frame pairs in raster order, the last 2 recent."""
    from edgekv.kernels.tar import VISION_KIND

    prefix = min(64, n // 8)
    index = torch.arange(n - prefix)
    frame = torch.cat([torch.full((prefix,), -1), index // shapes.pair])
    cell = torch.cat([torch.full((prefix,), -1), index % shapes.pair])
    kind = torch.cat([torch.ones(prefix, dtype=torch.int8), torch.full((n - prefix,), VISION_KIND, dtype=torch.int8)])
    meta = {
        "kind": kind, "frame": frame.to(torch.int32),
        "row": torch.where(cell < 0, -1, cell // shapes.grid[1]).to(torch.int16),
        "col": torch.where(cell < 0, -1, cell % shapes.grid[1]).to(torch.int16),
        "tpos": torch.where(frame < 0, torch.arange(n), 4096 + 2 * frame).to(torch.int32),
    }
    meta = {name: t.expand(shapes.layers, shapes.heads_kv, n).contiguous().to(device) for name, t in meta.items()}
    vision = meta["kind"] == VISION_KIND
    meta["vision"] = vision
    meta["recent"] = vision & (meta["frame"] > int(frame.max()) - 2)
    return meta


def attention_rows(shapes: Shapes, dtype: torch.dtype, device: torch.device, timer, triton_on: bool) -> list[Row]:
    from edgekv.kernels.attention_mass import attention_mass_reference, attention_mass_triton

    rows = []
    gen = torch.Generator().manual_seed(0)
    for keys in shapes.keys:
        start = keys - shapes.pair
        q = torch.randn(shapes.heads_q, shapes.pair, shapes.head_dim, generator=gen).to(device, dtype)
        k = torch.randn(shapes.heads_kv, shapes.capacity, shapes.head_dim, generator=gen).to(device, dtype)
        v = torch.randn_like(k)
        visible = (torch.rand(shapes.heads_kv, start, generator=gen) < 0.5).to(device)
        reference = lambda: attention_mass_reference(q, k, v, start=start, visible=visible)  # noqa: E731
        fused = lambda: attention_mass_triton(q, k, v, start=start, visible=visible)  # noqa: E731
        label = f"Hq{shapes.heads_q} Hkv{shapes.heads_kv} P{shapes.pair} N{keys} D{shapes.head_dim}"
        rows.append(_row("attention_mass", label, reference, fused, timer, triton_on))
        rows[-1].tag = f"attention_mass\nN={keys}"
    return rows


def policy_rows(shapes: Shapes, dtype: torch.dtype, device: torch.device, timer, triton_on: bool) -> list[Row]:
    from edgekv.kernels import tar, van
    from edgekv.model.rope import rotary_inv_freq

    n = shapes.capacity
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(shapes.layers, shapes.heads_kv, n, shapes.head_dim, generator=gen).to(device, dtype)
    v = torch.randn_like(k)
    meta = _slots(shapes, n, device)
    inv_freq = rotary_inv_freq(shapes.head_dim, 1_000_000.0, device)
    tar_args = (meta["tpos"], meta["frame"], meta["row"], meta["col"], meta["kind"], meta["recent"], shapes.grid,
                inv_freq, shapes.temporal_section, True)
    norms = van.value_norms_reference(v)
    sizes = [(7, 5, 3, 1)[layer % 4] for layer in range(shapes.layers)]
    pool_args = (meta["frame"], meta["row"], meta["col"], meta["vision"], shapes.grid, sizes)
    label = f"L{shapes.layers} H{shapes.heads_kv} n{n} D{shapes.head_dim}"
    return [
        _row("tar_scores", label, lambda: tar.tar_scores_reference(k, *tar_args),
             lambda: tar.tar_scores_triton(k, *tar_args), timer, triton_on),
        _row("value_norms", label, lambda: van.value_norms_reference(v), lambda: van.value_norms_triton(v), timer, triton_on),
        _row("layer_cv", label, lambda: van.layer_cv_reference(norms, meta["vision"]),
             lambda: van.layer_cv_triton(norms, meta["vision"]), timer, triton_on),
        _row("pooled_van", label + " k=7/5/3/1", lambda: van.pooled_van_reference(norms, *pool_args),
             lambda: van.pooled_van_triton(norms, *pool_args), timer, triton_on),
    ]


def compaction_row(shapes: Shapes, dtype: torch.dtype, device: torch.device, timer, triton_on: bool) -> Row:
    from edgekv.kernels.compaction import METADATA_FIELDS, compact_reference_, compact_triton_

    capacity, length = shapes.capacity, shapes.capacity - shapes.pair
    kept = (3 * capacity) // 4
    gen = torch.Generator().manual_seed(2)

    def buffers() -> dict[str, torch.Tensor]:
        shape = (shapes.layers, shapes.heads_kv, capacity)
        out = {"k": torch.randn(*shape, shapes.head_dim, generator=gen).to(device, dtype)}
        out["v"] = torch.randn_like(out["k"])
        for name, kind in zip(METADATA_FIELDS, (torch.int8, torch.bool, torch.int32, torch.int16, torch.int16, torch.int32)):
            out[name] = torch.randint(0, 100, shape, generator=gen).to(device, kind)
        return out

    keep = torch.stack([torch.randperm(length, generator=gen)[:kept].sort().values
                        for _ in range(shapes.layers * shapes.heads_kv)]).view(shapes.layers, shapes.heads_kv, kept).to(device)
    ref = buffers()
    mine = {name: t.clone() for name, t in ref.items()}
    scratch_kv = torch.empty(capacity * shapes.head_dim, dtype=dtype, device=device)
    scratch_meta = {name: torch.empty(shapes.heads_kv * capacity, dtype=ref[name].dtype, device=device)
                    for name in METADATA_FIELDS}
    # in place: the timed repeats compact already-compacted buffers (same indices, same traffic)
    reference = lambda: compact_reference_(**ref, keep=keep, scratch_kv=scratch_kv, scratch_meta=scratch_meta)  # noqa: E731
    fused = lambda: compact_triton_(**mine, keep=keep)  # noqa: E731
    label = f"L{shapes.layers} H{shapes.heads_kv} M{capacity} C{kept} D{shapes.head_dim}"
    row = _row("compact_", label, reference, fused, timer, triton_on, check=False)
    if triton_on:
        row.max_abs_diff = max(_diff(ref[name].to(torch.float64), mine[name].to(torch.float64)) for name in ref)
    return row


def quant_attention_rows(shapes: Shapes, dtype: torch.dtype, device: torch.device, timer: PassTimer,
                         triton_on: bool) -> Iterator[Row]:
    """8-bit cache attention (``quantized_attention``) at N slots, for a decode step (P = 1) and a frame pair
    (P = pair), int8 and fp8 codes. Reference: the eager path of an 8-bit cache without the kernel
    (``CacheAttention`` -> ``cache.keys/values``: dequantize + rotate in fp32, then ``folded_attention`` in
    q's dtype, the model's). bf16: ``folded_attention`` over a bf16 cache's N slots, as a bf16 cache reads."""
    from edgekv.cache.quant import quantize
    from edgekv.kernels.quant_attention import quantized_attention_reference, quantized_attention_triton
    from edgekv.kernels.sdpa import folded_attention
    from edgekv.model.rope import rotary_inv_freq

    rope = (rotary_inv_freq(shapes.head_dim, 1_000_000.0, device), shapes.temporal_section)
    gen = torch.Generator().manual_seed(3)
    for keys in shapes.keys:
        # one layer's N slots: k, v [Hkv, N, D]; tpos [Hkv, N] int32 as the cache stores them
        k = torch.randn(shapes.heads_kv, keys, shapes.head_dim, generator=gen) * 2
        v = torch.randn(shapes.heads_kv, keys, shapes.head_dim, generator=gen)
        tpos = torch.randint(0, 8000, (shapes.heads_kv, keys), generator=gen, dtype=torch.int32).to(device)
        dense = timer.copies((k.to(device, torch.bfloat16), v.to(device, torch.bfloat16)))
        coded = {}
        for codes in (torch.int8, torch.float8_e4m3fn):
            (k_codes, k_scale), (v_codes, v_scale) = quantize(k, codes), quantize(v, codes)
            coded[codes] = timer.copies((k_codes.to(device), k_scale.to(device), v_codes.to(device),
                                         v_scale.to(device), tpos))
        for num_new in (1, shapes.pair):
            if num_new > keys:
                continue
            start = keys - num_new
            q = (torch.randn(shapes.heads_q, num_new, shapes.head_dim, generator=gen) * 1.5).to(device, dtype)
            q16 = q.to(torch.bfloat16)
            bf16_ms, _ = timer(lambda k16, v16: folded_attention(q16, k16, v16, start), dense)
            for codes, sets in coded.items():
                name = "int8" if codes == torch.int8 else "fp8"
                reference = lambda *c: quantized_attention_reference(q, *c, *rope, start=start)  # noqa: E731
                fused = lambda *c: quantized_attention_triton(q, *c, *rope, start=start)  # noqa: E731
                label = f"{name} Hq{shapes.heads_q} Hkv{shapes.heads_kv} P{num_new} N{keys} D{shapes.head_dim}"
                row = _rotating_row("quant_attention", label, reference, fused, sets, bf16_ms, timer, triton_on)
                row.tag = f"{name} P={num_new}\nN={keys}"
                yield row


def int4_rows(shapes: Shapes, dtype: torch.dtype, device: torch.device, timer: PassTimer,
              triton_on: bool) -> Iterator[Row]:
    """4-bit AWQ weights (``int4_matmul_triton``) at each [K x N] of ``shapes.linear``, for one row (GEMV, a
    decode step) and a frame pair's rows (GEMM). Reference: dequantize-then-matmul (``int4_matmul_reference``).
    bf16: ``F.linear`` with a bf16 [N, K] weight, as a bf16 checkpoint runs."""
    import torch.nn.functional as F

    from edgekv.kernels.int4_matmul import int4_matmul_reference, int4_matmul_triton
    from edgekv.model.int4 import pack_awq

    gen = torch.Generator().manual_seed(4)
    for width_k, width_n in shapes.linear:
        groups = width_k // shapes.group
        q = torch.randint(0, 16, (width_k, width_n), generator=gen, dtype=torch.uint8)
        zeros = torch.randint(0, 16, (groups, width_n), generator=gen, dtype=torch.uint8)
        scales = (torch.rand(groups, width_n, generator=gen) * 0.02 + 0.001).half()
        # qweight [K, N/8] int32, qzeros [K/g, N/8] int32, scales [K/g, N] fp16 (AutoAWQ GEMM layout)
        sets = timer.copies((pack_awq(q).to(device), pack_awq(zeros).to(device), scales.to(device)))
        weight = torch.randn(width_n, width_k, generator=gen) * 0.05
        dense = timer.copies((weight.to(device, torch.bfloat16),))
        for m in (1, shapes.pair):
            x = torch.randn(m, width_k, generator=gen).to(device, dtype)
            x16 = x.to(torch.bfloat16)
            bf16_ms, _ = timer(lambda w: F.linear(x16, w), dense)
            reference = lambda *w: int4_matmul_reference(x, *w, shapes.group)  # noqa: E731
            fused = lambda *w: int4_matmul_triton(x, *w, shapes.group)  # noqa: E731
            kernel = "int4_gemv" if m == 1 else "int4_gemm"
            row = _rotating_row(kernel, f"m{m} K{width_k} N{width_n} g{shapes.group}", reference, fused, sets,
                                bf16_ms, timer, triton_on)
            row.tag = f"{kernel[5:]} m={m}\n{width_k}x{width_n}"
            yield row


def _rotating_row(kernel: str, shape: str, reference, fused, sets: list[InputSet], bf16_ms: float,
                  timer: PassTimer, triton_on: bool) -> Row:
    torch_ms, _ = timer(reference, sets[:REFERENCE_SETS], graph=False)
    row = Row(kernel, shape, torch_ms, None, None, bf16_ms=bf16_ms, sets=len(sets))
    if triton_on:
        row.max_abs_diff = _diff(reference(*sets[0]), fused(*sets[0]))
        row.triton_ms, row.timing = timer(fused, sets)
    return row


def _row(kernel: str, shape: str, reference, fused, timer, triton_on: bool, check: bool = True) -> Row:
    torch_ms = timer(reference)
    if not triton_on:
        return Row(kernel, shape, torch_ms, None, None)
    diff = _diff(reference(), fused()) if check else None
    return Row(kernel, shape, torch_ms, timer(fused), diff)


# ---------------------------------------------------------------------------------------------- report
def _header() -> str:
    return (f"{'kernel':<15} {'shape':<40} {'torch ms':>10} {'triton ms':>10} {'speedup':>8} {'max|diff|':>10} "
            f"{'bf16 ms':>10} {'vs bf16':>8}")


def _line(r: Row) -> str:
    triton = f"{r.triton_ms:10.3f}" if r.triton_ms is not None else f"{'-':>10}"
    speed = f"{r.speedup:7.2f}x" if r.speedup is not None else f"{'-':>8}"
    diff = f"{r.max_abs_diff:10.2e}" if r.max_abs_diff is not None else f"{'-':>10}"
    bf16 = f"{r.bf16_ms:10.3f}" if r.bf16_ms is not None else f"{'-':>10}"
    ratio = f"{r.bf16_ratio:7.2f}x" if r.bf16_ratio is not None else f"{'-':>8}"
    return f"{r.kernel:<15} {r.shape:<40} {r.torch_ms:10.3f} {triton} {speed} {diff} {bf16} {ratio}"


def _plot(rows: list[Row], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timed = [r for r in rows if r.speedup is not None]
    if not timed:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(timed)), 4))
    labels = [r.tag or r.kernel for r in timed]
    paired = [r.bf16_ratio is not None for r in timed]
    ax.bar([i - 0.2 if two else i for i, two in enumerate(paired)], [r.speedup for r in timed],
           width=[0.4 if two else 0.8 for two in paired], color="tab:green", label="over eager torch")
    if any(paired):
        ax.bar([i + 0.2 for i, two in enumerate(paired) if two], [r.bf16_ratio for r in timed if r.bf16_ratio],
               width=0.4, color="tab:blue", label="over bf16 (issue 32: 1.5x attention, 2.5x GEMV)")
        ax.legend(fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # interpreter runs are 1e-3x, GPU kernels 1-100x
    ax.set_xticks(range(len(timed)), labels, fontsize=8)
    ax.set_ylabel("speedup (x)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _backend(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton side runs, and a sentence saying how."""
    if device.type == "cpu" and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # a CLI process: choose the interpreter before Triton loads
    from edgekv.kernels._triton import interpreting, triton_available

    if not triton_available():
        return False, "Triton is not installed: torch reference only"
    if device.type == "cuda":
        if interpreting():
            return True, "TRITON_INTERPRET=1 on a CUDA device: interpreted, these are NOT kernel speeds"
        return True, "compiled Triton kernels on CUDA"
    if interpreting():
        return True, "CPU: Triton ran in its interpreter (numpy, one program at a time) - NOT kernel speed"
    return False, "CPU without TRITON_INTERPRET=1 before Triton was imported: torch reference only"


def run_kernels(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shapes = SHAPES_SMALL if args.small else SHAPES_3B
    if args.keys:
        shapes = Shapes(**{**asdict(shapes), "keys": tuple(args.keys), "capacity": max(max(args.keys), shapes.capacity)})
    dtype = DTYPES[args.dtype]
    triton_on, note = _backend(device)
    if triton_on and device.type == "cpu" and not args.small:
        triton_on, note = False, "CPU: the interpreter at the 3B shapes would take hours (use --small): torch reference only"
    timer = lambda fn: median_ms(fn, device, args.warmup, args.repeats)  # noqa: E731
    passes = PassTimer(device, args.warmup, args.repeats, ROTATE_BYTES if device.type == "cuda" else 0, args.graph)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"edgekv bench kernels on {name} ({args.dtype}, {'small' if args.small else '3B'} shapes): {note}")
    families = {
        "attention": lambda: attention_rows(shapes, dtype, device, timer, triton_on),
        "policy": lambda: policy_rows(shapes, dtype, device, timer, triton_on),
        "compaction": lambda: [compaction_row(shapes, dtype, device, timer, triton_on)],
        "quant_attention": lambda: quant_attention_rows(shapes, dtype, device, passes, triton_on),
        "int4": lambda: int4_rows(shapes, dtype, device, passes, triton_on),
    }
    print(_header())
    rows = []
    for family in args.only:
        for row in families[family]():  # printed as measured: a run cut short still shows its rows
            rows.append(row)
            print(_line(row), flush=True)
    print(f"median of {args.repeats} runs after {args.warmup} warm-up; {note}")
    if {"quant_attention", "int4"} & set(args.only):
        rotation = (f"each timed pass cycles through >= {ROTATE_BYTES >> 20} MiB of input copies "
                    f"({'Triton and bf16 replayed from a CUDA graph' if args.graph else 'no CUDA graph'})"
                    if passes.rotate_bytes else "one input set, per-call times")
        print(f"bf16 ms: the same shape on a bf16 cache / with a bf16 weight; vs bf16 = bf16 ms / triton ms "
              f"(issue 32: >= 1.5x 8-bit attention, >= 2.5x 4-bit GEMV); {rotation}")
    record = {
        "device": name, "backend": note, "dtype": args.dtype, "shapes": asdict(shapes),
        "torch": torch.__version__, "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "warmup": args.warmup, "repeats": args.repeats, "families": list(args.only),
        "rotate_bytes": passes.rotate_bytes, "graph": args.graph and device.type == "cuda",
        "rows": [{**asdict(r), "speedup": r.speedup, "bf16_ratio": r.bf16_ratio} for r in rows],
    }
    Path(args.json).write_text(json.dumps(record, indent=2))
    if not args.plot:  # --plot "": figures only
        print(f"wrote {args.json}")
        return 0
    saved = _plot(rows, Path(args.plot), f"{name}, {args.dtype}: {note}")
    print(f"wrote {args.json}" + (f" and {args.plot}" if saved else " (no plot: matplotlib missing or nothing timed)"))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_kernel_arguments(parser)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    raise SystemExit(main())
