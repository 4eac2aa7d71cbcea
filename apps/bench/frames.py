"""``edgekv bench frames``: what the evidence frames on disk cost (``archive.frames_mib``, apps/daemon/frame_store.py):
bytes a frame (the JPEG's, and on the disk with the row's bookkeeping), the hours ``--frames-mib`` holds at one pair a
second (its files, as the store bounds them), and the writer thread's time a frame —
scaling and JPEG encoding, then the SQLite transaction — for each ``--px`` on each source.

The sources default to a synthesized world stream and, where Debian's ``opencv-doc`` is installed, its real videos
(``vtest.avi``, ``tree.avi``; read at run time, never shipped). Each frame goes through a ``FrameStore`` in a temporary
folder one at a time (submit, then flush: the writer's time, not the queue's), so the figure is the writer's own; on
a device the camera loop does not wait for it (the queue drops a frame when the writer falls behind, counted).
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

from edgekv.apps.bench.common import provenance, write_figures

OPENCV_VIDEOS = Path("/usr/share/doc/opencv-doc/examples/data")
DISK_ROWS = 256  # the bytes on disk a frame are measured over at least this many rows (a page holds several small ones)
SYNTHETIC = "synthetic:world?size=640x480&fps=2&frames=100000&seed=3"


def add_frames_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sources", default=None,
                        help="comma-separated video sources (default: a synthetic world stream, and opencv-doc's "
                             "vtest.avi and tree.avi where installed)")
    parser.add_argument("--px", default="160,320,640", help="comma-separated long sides to scale frames to")
    parser.add_argument("--frames", type=int, default=60, help="frames a source and size")
    parser.add_argument("--size", type=int, nargs=2, metavar=("W", "H"), default=None,
                        help="scale every source's frames to W x H first (a camera's resolution; default: as read)")
    parser.add_argument("--frames-mib", type=float, default=256.0, help="the budget the hours are given for")
    parser.add_argument("--json", default="bench-frames.json")
    parser.add_argument("--plot", default="bench-frames.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_frames)


def _sources(text: str | None) -> list[str]:
    if text:
        return [s.strip() for s in text.split(",") if s.strip()]
    found = [str(OPENCV_VIDEOS / name) for name in ("vtest.avi", "tree.avi") if (OPENCV_VIDEOS / name).is_file()]
    return [SYNTHETIC, *found]


def _read(source: str, count: int, size) -> list:
    from edgekv.video import open_source

    frames = []
    reader = open_source(source)
    try:
        for frame, _ in reader:
            frames.append(_scaled(frame, tuple(size)) if size else frame)
            if len(frames) == count:
                break
    finally:
        close = getattr(reader, "close", None)
        if callable(close):
            close()
    if not frames:
        raise ValueError(f"{source}: no frame read")
    return frames


def _scaled(frame, size: tuple[int, int]):
    """``frame`` at ``size`` (W, H), as a camera of that mode would give it: OpenCV's area resize, or without the
    ``video`` extra Pillow's box (shrinking) or bilinear (growing) filter, each channel alike so BGR stays BGR."""
    try:
        import cv2
    except ImportError:
        import numpy as np
        from PIL import Image

        growing = size[0] > frame.shape[1] or size[1] > frame.shape[0]
        return np.asarray(Image.fromarray(np.ascontiguousarray(frame)).resize(
            size, Image.Resampling.BILINEAR if growing else Image.Resampling.BOX))
    return cv2.resize(frame, size, interpolation=cv2.INTER_AREA)


def _label(source: str) -> str:
    return Path(source).name if "/" in source else source.split("?")[0]


def _spread(values: list[float]) -> dict:
    """Median and nearest-rank p90 (the old index, int(0.9 * (n - 1)), was the minimum for n = 2: under the median)."""
    ordered = sorted(values)
    p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
    return {"median": statistics.median(values), "p90": p90, "n": len(values)}


def measure(frames: list, px: int, budget_mib: float) -> dict:
    """One ``--px`` on one source: each frame's JPEG bytes and encoding time, then each written through a real
    ``FrameStore`` (the writer's time a frame) and the database's pages in use a frame — the bytes on the disk,
    rows, indexes and part-filled pages, which ``frames_mib`` bounds — from which the hours the budget holds."""
    from edgekv.apps.daemon.frame_store import FrameStore, budget_shares, encode_thumbnail

    encode_ms, sizes = [], []
    for frame in frames:
        started = time.perf_counter()
        sizes.append(len(encode_thumbnail(frame, px)))
        encode_ms.append((time.perf_counter() - started) * 1e3)
    write_ms = []
    with tempfile.TemporaryDirectory(prefix="edgekv-bench-frames-") as folder:
        with FrameStore(folder, max_bytes=1 << 40, px=px, wait_when_full=True) as store:
            with store._lock:
                empty = store._in_use()
            for pair, frame in enumerate(frames):
                started = time.perf_counter()
                store.submit("ab" * 16, pair, float(pair), None, frame)
                store.flush()
                write_ms.append((time.perf_counter() - started) * 1e3)
            errors = store.stats()["frames_write_errors"]
            for pair in range(len(frames), DISK_ROWS):  # the frames again, untimed: enough rows for pages to show
                store.submit("ab" * 16, pair, float(pair), None, frames[pair % len(frames)])
            store.flush()
            with store._lock:
                on_disk = (store._in_use() - empty) / store.stats()["frames_kept"]
    mean = statistics.fmean(sizes)
    database = budget_shares(int(budget_mib * 2**20))[1]
    return {"px": px, "kib_per_frame": mean / 1024, "kib_min": min(sizes) / 1024, "kib_max": max(sizes) / 1024,
            "disk_kib_per_frame": on_disk / 1024, "encode_ms": _spread(encode_ms), "writer_ms": _spread(write_ms),
            "write_errors": errors, "hours_at_one_pair_a_second": database / on_disk / 3600}


def run_frames(args: argparse.Namespace) -> int:
    try:
        sizes = [int(p) for p in args.px.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--px: expected comma-separated whole numbers of pixels, got {args.px!r}") from None
    if not sizes or any(not 16 <= p <= 4096 for p in sizes):
        raise ValueError(f"--px: each 16 to 4096 (archive.frames_px), got {args.px!r}")
    if args.frames < 1:
        raise ValueError(f"--frames: must be >= 1, got {args.frames}")
    if not (math.isfinite(args.frames_mib) and args.frames_mib > 0):  # -1 printed negative hours, exit 0
        raise ValueError(f"--frames-mib: a positive budget in MiB, got {args.frames_mib}")
    sizes = list(dict.fromkeys(sizes))  # a size given twice is one row, not two under the same label
    rows = []
    for source in _sources(args.sources):
        frames = _read(source, args.frames, args.size)
        shape = list(frames[0].shape)
        for px in sizes:
            row = {"source": source, "frame_shape": shape, **measure(frames, px, args.frames_mib)}
            rows.append(row)
            print(f"{_label(source):<16} {shape[1]}x{shape[0]} -> {px:>4} px: "
                  f"{row['kib_per_frame']:6.1f} KiB a frame ({row['kib_min']:.1f}-{row['kib_max']:.1f}; "
                  f"{row['disk_kib_per_frame']:.1f} on disk), "
                  f"{args.frames_mib:g} MiB hold {row['hours_at_one_pair_a_second']:5.1f} h; writer "
                  f"{row['writer_ms']['median']:.2f} ms a frame (p90 {row['writer_ms']['p90']:.2f}), of it encoding "
                  f"{row['encode_ms']['median']:.2f}")
    from edgekv.images import has_opencv

    result = {"rows": rows, "frames": args.frames, "frames_mib": args.frames_mib, "size": args.size,
              "encoder": "opencv" if has_opencv() else "pillow",  # which scales and encodes (edgekv/images.py)
              "provenance": provenance()}
    write_figures(result, args.json, args.plot, _plot)
    return 0


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    sources = list(dict.fromkeys(row["source"] for row in result["rows"]))
    for source in sources:
        rows = [row for row in result["rows"] if row["source"] == source]
        label = _label(source)
        line = axes[0].plot([r["px"] for r in rows], [r["kib_per_frame"] for r in rows], marker="o", label=label)[0]
        axes[0].plot([r["px"] for r in rows], [r["disk_kib_per_frame"] for r in rows], marker="x", linestyle="--",
                     color=line.get_color(), label=f"{label}, on disk")
        axes[1].plot([r["px"] for r in rows], [r["writer_ms"]["median"] for r in rows], marker="o", label=label)
    axes[0].set(xlabel="long side (px)", ylabel="KiB a frame (JPEG q80; dashed: on disk)", title="evidence frame size")
    axes[1].set(xlabel="long side (px)", ylabel="ms a frame (median)", title="writer thread: scale, encode, commit")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
