"""Issue 27, a prepared experiment for the next device call: where a toy training step's time goes on a GPU.

Why: the first GPU rounds (issue 32's lease of 2026-12-04) trained ~10 question steps a second at batch 8 with the
drawing workers' cores half idle, so the step itself bounded them — but a 256-wide LM over a few thousand tokens is
~10 GFLOP a step, a few ms of an H200: the rest is the host (kernel launches from Python, device syncs, the batch's
copy) or something else. This times ``train-toy``'s own step (``forward_logits``, ``loss_of``, backward, clipping,
AdamW: edgekv/toy/train.py) on batches drawn here beforehand (no workers: the step alone), at each batch size and
curriculum progress asked, and profiles a few steps: wall ms a step, device ms a step, kernels and device syncs a
step, the batch's host-to-device copy, and the top kernels. If device time is far under wall time, a larger batch
(lease_toy's ``BATCH``) buys streams at almost no cost; if the syncs are many, they are the next thing to remove.
JSON to ``--json``. ``--small`` runs a tiny toy on the CPU (a check of this script, not a figure).

First run on an H200 (2026-12-04, lease_toy.sh): batch 8 wall 82.0 ms a step against 11.6 ms of device time; batch
32 117.5 / 28.2 ms early in the curriculum and 100.5 / 53.0 ms late; 25-49 device syncs a step, 3-11 ms of copies
from pageable memory, the products in fp32 FFMA kernels. Since then the step reads no device value on the host
(tests/test_toy_step_sync.py), the batch is pinned and its copy queued, AdamW is fused and the products TF32
(``--products tf32,fp32`` times both); the copy is timed apart from the steps.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true", help="a tiny toy on the CPU: checks the script")
    parser.add_argument("--batches", default="8,32", help="streams a step, comma-separated")
    parser.add_argument("--progress", default="0.3,0.9", help="curriculum progress of the drawn batches (its stages)")
    parser.add_argument("--curriculum", default="world-scratch")
    parser.add_argument("--steps", type=int, default=2, help="batches drawn; stepped once to warm up, then profiled")
    parser.add_argument("--products", default="tf32,fp32",
                        help="the matrix products on the GPU: tf32 (train-toy's default since 2026-12-04), fp32")
    parser.add_argument("--json", default="toy-step-profile.json")
    args = parser.parse_args()

    from torch.profiler import ProfilerActivity, profile

    from edgekv.toy.model import init_model, toy_config
    from edgekv.toy.train import Encoder, forward_logits, loss_of, qa_batch, tf32_products
    from edgekv.video.world import available_families

    cuda = not args.small
    device = torch.device("cuda" if cuda else "cpu")
    sizes = (dict(width=256, layers=4, vision_width=128, vision_depth=6) if cuda   # lease_toy.sh's SIZES
             else dict(width=64, layers=2, vision_width=32, vision_depth=2))
    families = tuple(f for f in available_families() if f not in ("cells", "skimage", "tree"))  # lease_toy's holdout
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "sizes": sizes, "curriculum": args.curriculum,
              "families": list(families), "rows": []}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = [(products, int(b), float(p)) for products in args.products.split(",") for b in args.batches.split(",")
            for p in args.progress.split(",")]
    if {products for products, _, _ in rows} - {"tf32", "fp32"}:
        parser.error(f"--products: tf32 and/or fp32, got {args.products!r}")
    draws: dict[tuple[int, float], list] = {}
    for products, batch_size, progress in rows:
        with tf32_products(device, products == "tf32"):
            torch.manual_seed(0)
            model = init_model(toy_config(**sizes), 0).to(device).train()
            model.visual.requires_grad_(False)  # the first round's question steps: the warmed tower frozen
            params = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(params, lr=1e-3, fused=cuda)  # as train-toy on a GPU
            encoder = Encoder(aux=True, seed=0, size=112, aux_where=True)
            steps = 1000
            if (batch_size, progress) not in draws:  # drawn once, stepped with each kind of products
                rng = np.random.default_rng(int(progress * 1000) + batch_size)
                draws[batch_size, progress] = [qa_batch(rng, int(progress * steps), steps, batch_size, encoder,
                                                        args.curriculum, families) for _ in range(args.steps)]
            drawn = draws[batch_size, progress]
            copy_ms: list[float] = []

            def step(batch) -> None:  # as train-toy's loop: the copy queued, no wait for the GPU in the step
                batch = batch.to(device)
                logits = forward_logits(model, batch)
                loss = loss_of(logits, batch, 0.5, encoder.no, 0.0)[0]
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()

            for batch in drawn:  # warm-up: the allocator, cuBLAS's handles, the layouts
                step(batch)
            sync()
            for batch in drawn:  # the batch's copy alone, waited for (in a step it overlaps the step before)
                started = time.perf_counter()
                batch.to(device)
                sync()
                copy_ms.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            with profile(activities=activities) as prof:
                for batch in drawn:
                    step(batch)
                sync()
            wall_ms = (time.perf_counter() - started) * 1e3 / args.steps
            kernels, device_us, launches, syncs, aten = [], 0.0, 0, 0, 0
            for event in prof.key_averages():
                total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0.0) or 0.0
                if cuda and total and not event.key.startswith(("aten::", "autograd", "Optimizer", "cuda")):
                    kernels.append({"name": event.key[:110], "calls_per_step": event.count / args.steps,
                                    "us_per_step": total / args.steps})
                    device_us += total
                if event.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"):
                    launches += event.count
                if event.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy"):
                    syncs += event.count
                if event.key.startswith("aten::"):
                    aten += event.count
            kernels.sort(key=lambda k: -k["us_per_step"])
            first = drawn[0]
            row = {"products": products, "batch": batch_size, "progress": progress, "samples": int(first.ids.shape[0]),
                   "tokens": int(first.ids.shape[1]), "pixel_rows": int(first.pixel_values.shape[0]),
                   "wall_ms_per_step": wall_ms, "device_ms_per_step": device_us / 1e3 / args.steps,
                   "kernel_launches_per_step": launches / args.steps, "syncs_per_step": syncs / args.steps,
                   "aten_ops_per_step": aten / args.steps, "copy_ms_per_step": sum(copy_ms) / len(copy_ms),
                   "top": kernels[:12]}
            result["rows"].append(row)
            print(f"{products} batch {batch_size:3d} progress {progress:.1f}: {row['samples']} samples x {row['tokens']} tokens"
                  f" ({row['pixel_rows']} patch rows): wall {wall_ms:7.1f} ms a step, device "
                  f"{row['device_ms_per_step']:6.1f} ms, {row['kernel_launches_per_step']:5.0f} launches, "
                  f"{row['syncs_per_step']:3.0f} syncs, {row['aten_ops_per_step']:5.0f} aten ops, copy "
                  f"{row['copy_ms_per_step']:.1f} ms", flush=True)
            for kernel in kernels[:6]:
                print(f"    {kernel['us_per_step']:9.1f} us x {kernel['calls_per_step']:5.1f}  {kernel['name'][:80]}")
            with open(args.json, "w") as out:
                json.dump(result, out, indent=1)


if __name__ == "__main__":
    main()
