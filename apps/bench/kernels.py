"""``edgekv bench kernels``: each fused kernel against its eager torch reference.

Shapes are Qwen2.5-VL-3B's (36 layers, 16 query / 2 KV heads, head_dim 128, a 448x448 frame pair =
256 merged tokens on a 16x16 grid, cache up to 6144 slots) or toy ones with ``--small``. Reports the
median of ``--repeats`` timed runs after ``--warmup``, the largest |kernel - reference| difference as a
sanity check, and saves JSON + a PNG bar chart of the speedups. On CPU the Triton side runs in the
interpreter (numpy, one program at a time): those numbers say nothing about kernel speed, and the
output says so. Figures only: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--small", action="store_true", help="toy shapes (for CPU, where Triton is interpreted)")
    parser.add_argument("--device", default=None, help="cuda | cpu (default: cuda when available)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="K/V and query dtype")
    parser.add_argument("--keys", type=int, nargs="+", default=None,
                        help="attention key counts N = start + P (default: 1024 4096 6144; --small: 64 160)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--json", default="bench-kernels.json")
    parser.add_argument("--plot", default="bench-kernels.png")
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

    @property
    def pair(self) -> int:
        return self.grid[0] * self.grid[1]


SHAPES_3B = Shapes(layers=36, heads_q=16, heads_kv=2, head_dim=128, grid=(16, 16), keys=(1024, 4096, 6144), capacity=6144)
SHAPES_SMALL = Shapes(layers=2, heads_q=4, heads_kv=2, head_dim=32, grid=(4, 4), keys=(64, 160), capacity=160)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Row:
    kernel: str
    shape: str
    torch_ms: float
    triton_ms: float | None
    max_abs_diff: float | None
    tag: str = ""  # short label for the plot

    @property
    def speedup(self) -> float | None:
        return self.torch_ms / self.triton_ms if self.triton_ms else None


# ---------------------------------------------------------------------------------------------- timing
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
                inv_freq, shapes.head_dim // 8, True)
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


def _row(kernel: str, shape: str, reference, fused, timer, triton_on: bool, check: bool = True) -> Row:
    torch_ms = timer(reference)
    if not triton_on:
        return Row(kernel, shape, torch_ms, None, None)
    diff = _diff(reference(), fused()) if check else None
    return Row(kernel, shape, torch_ms, timer(fused), diff)


# ---------------------------------------------------------------------------------------------- report
def _table(rows: list[Row]) -> str:
    lines = [f"{'kernel':<15} {'shape':<40} {'torch ms':>10} {'triton ms':>10} {'speedup':>8} {'max|diff|':>10}"]
    for r in rows:
        triton = f"{r.triton_ms:10.3f}" if r.triton_ms is not None else f"{'-':>10}"
        speed = f"{r.speedup:7.2f}x" if r.speedup is not None else f"{'-':>8}"
        diff = f"{r.max_abs_diff:10.2e}" if r.max_abs_diff is not None else f"{'-':>10}"
        lines.append(f"{r.kernel:<15} {r.shape:<40} {r.torch_ms:10.3f} {triton} {speed} {diff}")
    return "\n".join(lines)


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
    ax.bar(range(len(timed)), [r.speedup for r in timed], color="tab:green")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_yscale("log")  # interpreter runs are 1e-3x, GPU kernels 1-100x
    ax.set_xticks(range(len(timed)), labels, fontsize=8)
    ax.set_ylabel("speedup over eager torch (x)")
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
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"edgekv bench kernels on {name} ({args.dtype}, {'small' if args.small else '3B'} shapes): {note}")
    rows = attention_rows(shapes, dtype, device, timer, triton_on)
    rows += policy_rows(shapes, dtype, device, timer, triton_on)
    rows.append(compaction_row(shapes, dtype, device, timer, triton_on))
    print(_table(rows))
    print(f"median of {args.repeats} runs after {args.warmup} warm-up; {note}")
    record = {
        "device": name, "backend": note, "dtype": args.dtype, "shapes": asdict(shapes),
        "torch": torch.__version__, "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "warmup": args.warmup, "repeats": args.repeats,
        "rows": [{**asdict(r), "speedup": r.speedup} for r in rows],
    }
    Path(args.json).write_text(json.dumps(record, indent=2))
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
