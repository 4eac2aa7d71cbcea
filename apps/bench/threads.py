"""``edgekv bench threads``: per-pair vision / prefill ms and a 3B-shape matrix-vector product per
(torch threads, OpenMP wait policy), each in a fresh process (libgomp reads its wait policy at load).

The measurement behind ``runtime.threads: auto`` (edgekv/threads.py, README "Speed on CPU"): run it on a
busy and on an idle machine; the figures carry the load average of each run. Prints and saves JSON + PNG.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

WAIT_POLICIES = ("PASSIVE", "ACTIVE")


def add_threads_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="checkpoint dir (default: a fresh tiny random checkpoint)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    parser.add_argument("--wait", default="PASSIVE,ACTIVE", help="comma-separated OMP_WAIT_POLICY values")
    parser.add_argument("--frames", type=int, default=40, help="frames ingested per run (pairs = frames / 2)")
    parser.add_argument("--resolution", type=int, default=224, help="square video.resolution (multiple of 28)")
    parser.add_argument("--json", default="bench-threads.json")
    parser.add_argument("--plot", default="bench-threads.png", help="PNG to write ('' to skip)")
    parser.set_defaults(run=run_threads)


def measure(model: str, frames: int, resolution: int) -> dict:
    """One run in this process: median vision / prefill ms per pair (after 3 warm-up pairs) and the ms of
    a 2048 -> 11008 fp32 matrix-vector product (the 3B MLP's up projection, one decode token's share)."""
    import statistics
    import time

    import numpy as np
    import torch

    import edgekv

    rt = edgekv.Runtime.from_pretrained(model, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [resolution, resolution], "fps": 2.0},
                                        cache={"policy": "full", "max_tokens": 8192, "text_reserve_tokens": 64})
    session = rt.session()
    rng = np.random.default_rng(0)
    vision, prefill = [], []
    for i in range(frames):
        result = session.ingest(rng.integers(0, 256, size=(resolution, resolution, 3), dtype=np.uint8), t=i / 2.0)
        if result.pair_index is not None:
            vision.append(result.vision_ms)
            prefill.append(result.prefill_ms)
    linear = torch.nn.Linear(2048, 11008, bias=False)
    x = torch.randn(1, 2048)
    with torch.inference_mode():
        linear(x)
        started = time.perf_counter()
        for _ in range(20):
            linear(x)
    gemv_ms = (time.perf_counter() - started) / 20 * 1e3
    return {"vision_ms": statistics.median(vision[3:] or vision), "prefill_ms": statistics.median(prefill[3:] or prefill),
            "gemv_3b_ms": gemv_ms, "torch_threads": torch.get_num_threads(), "load_average": list(os.getloadavg())}


def run_threads(args: argparse.Namespace) -> int:
    from edgekv.apps.bench.common import model_or_tiny, provenance, write_figures
    from edgekv.threads import parse_threads

    counts = [parse_threads(c.strip()) for c in args.threads.split(",") if c.strip()]
    waits = [w.strip().upper() for w in args.wait.split(",") if w.strip()]
    for wait in waits:
        if wait not in WAIT_POLICIES:
            raise ValueError(f"--wait: unknown OMP_WAIT_POLICY {wait!r} (known: {', '.join(WAIT_POLICIES)})")
    # checked here, not in each child: a child's failure came back as the tail of its traceback
    if args.frames < 2:
        raise ValueError(f"--frames: at least 2 (one frame pair), got {args.frames}")
    if args.resolution < 28 or args.resolution % 28:
        raise ValueError(f"--resolution: a positive multiple of 28, got {args.resolution}")
    counts, waits = list(dict.fromkeys(counts)), list(dict.fromkeys(waits))  # each setting measured once
    with tempfile.TemporaryDirectory(prefix="edgekv-bench-threads-") as tmp:
        model = model_or_tiny(args.model, tmp)
        rows = []
        for wait in waits:
            for count in counts:
                env = {**os.environ, "OMP_WAIT_POLICY": wait}
                env.pop("OMP_NUM_THREADS", None)
                code = ("import json, sys; from edgekv.threads import apply_threads; apply_threads(int(sys.argv[1])); "
                        "from edgekv.apps.bench.threads import measure; "
                        "print(json.dumps(measure(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))))")
                out = subprocess.run([sys.executable, "-c", code, str(count), model, str(args.frames),
                                      str(args.resolution)], capture_output=True, text=True, env=env, timeout=1800)
                if out.returncode != 0:
                    raise RuntimeError(f"threads={count} wait={wait} failed: {out.stderr.strip()[-500:]}")
                row = {"threads": count, "wait": wait, **json.loads(out.stdout.strip().splitlines()[-1])}
                rows.append(row)
                print(f"threads {count} {wait:8s} vision {row['vision_ms']:7.2f} ms  prefill {row['prefill_ms']:7.2f} ms  "
                      f"3B gemv {row['gemv_3b_ms']:6.2f} ms  load {row['load_average'][0]:.2f}", flush=True)
    result = {"bench": "threads", "resolution": args.resolution, "frames": args.frames, "rows": rows, **provenance()}
    write_figures(result, args.json, args.plot, plot)
    return 0


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['threads']}t {r['wait'].lower()}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.27
    for i, key in enumerate(("vision_ms", "prefill_ms", "gemv_3b_ms")):
        ax.bar([j + i * width for j in range(len(rows))], [r[key] for r in rows], width, label=key)
    ax.set_xticks([j + width for j in range(len(rows))], labels)
    ax.set_ylabel("ms (median)")
    ax.set_title(f"threads x wait policy, load {result['load_average'][0]:.2f} at the end")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
