"""Issue 32, a prepared experiment: where a 3B frame pair's ingest time goes on a GPU — torch's profiler over a few
pairs of a StateKV session (448 x 448, M = 6,144, B = 1,024), once the cache is past its first compression.

Why: the H200 stream (2026-11-26, third call) took 32 ms a pair in prefill (256 tokens through 36 layers, ~1.5
TFLOP: ~2 ms of the chip's bf16 rate), and 61 ms on an int8 cache. Prints the kernel count a pair, device time by
kind and the top kernels, and the host time the session spent (device idle = host-bound); JSON to ``--json``.
``--small`` runs the tiny model on the CPU (a check of this script, not a figure).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="checkpoint dir (default with --small: a fresh tiny checkpoint)")
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--kv-dtype", default=None)
    parser.add_argument("--prefill-route", default=None, help="model.prefill_route (auto, eager, fused)")
    parser.add_argument("--pair-route", default=None, help="model.pair_route (auto, eager, graph)")
    parser.add_argument("--vision-mlp-width", default=None, help="model.vision_mlp_width (auto, as_loaded, padded)")
    parser.add_argument("--mass-split", type=int, default=None,
                        help="kernels/attention_mass.py MASS_SPLIT for this run (attention_mass_3b.py's knob)")
    parser.add_argument("--forward-block-m", type=int, default=None,
                        help="kernels/attention_mass.py FORWARD_BLOCK_M for this run")
    parser.add_argument("--pairs", type=int, default=4, help="profiled pairs")
    parser.add_argument("--warm", type=int, default=40, help="pairs ingested before (past the first compression)")
    parser.add_argument("--json", default="profile-pair.json")
    args = parser.parse_args()

    import edgekv
    from edgekv.apps.bench.decode_gpu import kernel_kind
    from edgekv.kernels import attention_mass as mass_module

    if args.mass_split is not None:  # read at each call: set before the session captures its graphs
        mass_module.MASS_SPLIT = args.mass_split
    if args.forward_block_m is not None:
        mass_module.FORWARD_BLOCK_M = args.forward_block_m
    from edgekv.video.sources import looped_frames

    cuda = not args.small
    device = "cuda" if cuda else "cpu"
    if args.model:
        model_dir = args.model
    else:
        import tempfile
        from pathlib import Path

        from edgekv.model.tiny import make_tiny_checkpoint

        model_dir = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", preset="tiny")
    size = 448 if cuda else 56
    cache = {"policy": "statekv", "sinks": 1024 if cuda else 64, "max_tokens": 6144 if cuda else 1024}
    if args.kv_dtype:
        cache["kv_dtype"] = args.kv_dtype
    model = {"dtype": "bf16" if cuda else "fp32", "device": device}
    if args.prefill_route:
        model["prefill_route"] = args.prefill_route
    if args.pair_route:
        model["pair_route"] = args.pair_route
    if args.vision_mlp_width:
        model["vision_mlp_width"] = args.vision_mlp_width
    runtime = edgekv.Runtime.from_pretrained(model_dir, model=model, video={"resolution": [size, size], "fps": 2},
                                             cache=cache)
    session = runtime.session()
    frames = looped_frames(f"synthetic:shapes?size={size}x{size}&fps=2", 2 * (args.warm + args.pairs) + 2, 2, None)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    for _ in range(2 * args.warm):
        frame, t = next(frames)
        session.ingest(frame, t=t)
    sync()
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]  # kernels only on CUDA (no aten double count)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(2 * args.pairs):
            frame, t = next(frames)
            session.ingest(frame, t=t)
        sync()
    wall_ms = (time.perf_counter() - started) * 1e3 / args.pairs
    kernels, kinds = [], {}
    for event in prof.key_averages():
        total = (getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0)) if cuda \
            else (event.self_cpu_time_total if event.key.startswith("aten::") else 0.0)
        if total:
            kernels.append({"name": event.key[:120], "calls_per_pair": event.count / args.pairs,
                            "us_per_pair": total / args.pairs, "kind": kernel_kind(event.key)})
    kernels.sort(key=lambda k: -k["us_per_pair"])
    for kernel in kernels:
        kinds[kernel["kind"]] = kinds.get(kernel["kind"], 0.0) + kernel["us_per_pair"]
    device_ms = sum(kinds.values()) / 1e3
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "kv_dtype": args.kv_dtype or "model",
              "prefill_route": runtime.prefill_route, "pair_route": runtime.pair_route,
              "mass_split": mass_module.MASS_SPLIT, "forward_block_m": mass_module.FORWARD_BLOCK_M,
              "pairs": args.pairs, "wall_ms_per_pair": wall_ms, "device_ms_per_pair": device_ms,
              "kernels_per_pair": sum(k["calls_per_pair"] for k in kernels), "by_kind_us_per_pair": kinds,
              "top": kernels[:25], "stats": {k: v for k, v in session.stats().items() if "ms" in k}}
    with open(args.json, "w") as out:
        json.dump(result, out, indent=1)
    print(f"kv {result['kv_dtype']}, prefill {runtime.prefill_route}, pairs {runtime.pair_route}: wall {wall_ms:.1f} ms a pair (profiled), device {device_ms:.1f} ms, "
          f"{result['kernels_per_pair']:.0f} kernels a pair")
    print("  by kind: " + ", ".join(f"{k} {v / 1e3:.1f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for kernel in kernels[:12]:
        print(f"  {kernel['us_per_pair']:9.1f} us x {kernel['calls_per_pair']:6.1f}  {kernel['name'][:90]}")


if __name__ == "__main__":
    main()
