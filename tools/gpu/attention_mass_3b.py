"""Issue 32, a prepared experiment for the next device call: the StateKV prefill's attention + mass
(kernels/attention_mass.py) at the 3B shape as the pair graph calls it, with its two occupancy knobs.

Why: the 3B pair's profile on an H200 (2026-12-04, profile_pair.py, ViT MLP padded) put the mass pass first among
the pair's kernels (``_key_mass_kernel``, 1.26 ms over 36 layers, 35 us a call) and the forward pass third (0.90
ms, 25 us): StateKV gathers the visible slots before attending (edgekv/attention.py ``_attend_visible``), so N is
~1,300 keys (1,024 sinks, the prefix, a 256-token pair) and the passes run 42 and 64 programs on 132
multiprocessors. ``mass_split`` shares a KV head's 8 query heads among 1-8 programs (parts summed after, in a fixed
order); ``forward_block_m`` is pass 1's query block (64 shipped; 32 and 16 give 2x and 4x the programs).

Each timed pass runs the call over 36 layers' inputs, captured in one CUDA graph and replayed (replay.py). Prints
us a call (both passes) and max |diff| of out and mass against the fp64 reference; the eager torch reference
(bf16) beside it. JSON to ``--json``. ``--small`` runs a toy shape on the CPU in Triton's interpreter (a check of
this script, not a figure). The winner goes into ``MASS_SPLIT`` / ``FORWARD_BLOCK_M``, with its figure.
"""

from __future__ import annotations

import argparse

import torch

import replay  # tools/gpu/replay.py (the scripts run as python3 tools/gpu/<name>.py)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--visible", type=int, default=1044, help="committed keys attended (sinks + prefix)")
    parser.add_argument("--splits", default="1,2,4,8")
    parser.add_argument("--blocks", default="64,32,16", help="forward_block_m values")
    parser.add_argument("--json", default="attention-mass-3b.json")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()

    from edgekv.kernels.attention_mass import attention_mass_reference, attention_mass_triton

    cuda = not args.small
    device = torch.device("cuda" if cuda else "cpu")
    heads_q, heads_kv, dim, pair, layers = (16, 2, 128, 256, 36) if cuda else (8, 1, 16, 20, 2)
    start = args.visible if cuda else 30
    splits = [int(s) for s in args.splits.split(",")]
    blocks = [int(b) for b in args.blocks.split(",")] if cuda else [16, 32]
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    inputs = [(torch.randn(heads_q, pair, dim, generator=gen) * 1.5,
               torch.randn(heads_kv, start + pair, dim, generator=gen),
               torch.randn(heads_kv, start + pair, dim, generator=gen)) for _ in range(layers)]
    inputs = [tuple(t.to(device, dtype) for t in layer) for layer in inputs]
    q, k, v = inputs[0]
    ref_out, ref_mass = attention_mass_reference(q, k, v, start=start, compute_dtype=torch.float64)
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": str(dtype),
              "shape": {"heads_q": heads_q, "heads_kv": heads_kv, "dim": dim, "pair": pair, "visible": start},
              "rows": []}

    def measure(call, check):
        def run():
            us = replay.timed(lambda i: call(*inputs[i]), layers, args.replays, cuda) * 1e6
            out, mass = check(q, k, v)
            diff_out = (out.double() - ref_out).abs().max().item()
            diff_mass = (mass.double() - ref_mass).abs().max().item()
            return ({"us": us, "max_diff_out": diff_out, "max_diff_mass": diff_mass},
                    f"{us:8.2f} us a call   max|diff| out {diff_out:.2e} mass {diff_mass:.2e}")
        return run

    def eager(q, k, v):
        return attention_mass_reference(q, k, v, start=start, compute_dtype=q.dtype)

    replay.row(result, args.json, {"variant": "eager torch"}, f"{'eager torch':24s}", measure(eager, eager))
    for block in blocks:
        for split in splits:
            def call(q, k, v, block=block, split=split):
                return attention_mass_triton(q, k, v, start=start, mass_split=split, forward_block_m=block)

            name = f"block_m {block} split {split}"
            replay.row(result, args.json, {"variant": "triton", "forward_block_m": block, "mass_split": split},
                       f"{name:24s}", measure(call, call))


if __name__ == "__main__":
    main()
