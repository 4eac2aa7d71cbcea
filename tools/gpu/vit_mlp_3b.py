"""Issue 32, the 3B vision tower's MLP products at their own width and padded (a lead from 2026-11-27's profile).

The profile of a 3B pair under the pair graph (`profile_pair.py --pair-route graph --prefill-route fused`, H200)
put 4.61 ms of its 17.2 ms of device work in 96 calls a pair of one cuBLAS kernel, an Ampere-generation
`cutlass_80_tensorop_bf16_s16816gemm_bf16_256x128_64x3_tn_align2` — the ViT's gate, up and down products
(32 blocks x 3): its intermediate width 3,420 is not a multiple of 8, so rows are not 16-byte aligned and the
Hopper kernels (TMA needs 16-byte strides) are out. Zero rows in gate/up (and their biases) and zero columns in
down give the same MLP output up to the products' summation order (silu(0) * 0 = 0). This times, for the 1,024
patches of a 448x448 pair, each product at 3,420 and padded to 3,424 / 3,456 / 3,584, over 32 blocks' weights
(captured in one CUDA graph, replayed), and the whole MLP (gate, up, SiLU x up, down) both ways, with its
max |diff|. ``--small`` checks the script on the CPU at a toy width.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import replay  # tools/gpu/replay.py


def padded(weight: torch.Tensor, bias: torch.Tensor | None, width: int, dim: int):
    """Zero rows (dim 0) or columns (dim 1) appended up to ``width``."""
    extra = width - weight.shape[dim]
    pad = (0, 0, 0, extra) if dim == 0 else (0, extra)
    return F.pad(weight, pad), (None if bias is None else F.pad(bias, (0, extra)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--json", default="vit-mlp-3b.json")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    cuda = not args.small
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    tokens, dim, width, blocks = (1024, 1280, 3420, 32) if cuda else (64, 48, 84, 2)
    widths = (3424, 3456, 3584) if cuda else (88, 96)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(tokens, dim, generator=gen)).to(device, dtype)
    mlps = []
    for _ in range(blocks):
        gate, up = (torch.randn(width, dim, generator=gen) * dim ** -0.5 for _ in range(2))
        down = torch.randn(dim, width, generator=gen) * width ** -0.5
        gb, ub, db = (torch.randn(n, generator=gen) * 0.1 for n in (width, width, dim))
        mlps.append(tuple(t.to(device, dtype) for t in (gate, gb, up, ub, down, db)))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "tokens": tokens, "dim": dim,
              "width": width, "blocks": blocks, "rows": []}

    def mlp(params, h):
        gate, gb, up, ub, down, db = params
        return F.linear(F.silu(F.linear(h, gate, gb)) * F.linear(h, up, ub), down, db)

    def measure_products(sets, w):
        h = torch.randn(tokens, w, generator=gen).to(device, dtype)
        up_us = replay.timed(lambda i: F.linear(x, sets[i][2], sets[i][3]), blocks, args.replays, cuda) * 1e6
        down_us = replay.timed(lambda i: F.linear(h, sets[i][4], sets[i][5]), blocks, args.replays, cuda) * 1e6
        whole_us = replay.timed(lambda i: mlp(sets[i], x), blocks, args.replays, cuda) * 1e6
        return up_us, down_us, whole_us

    reference = mlp(mlps[0], x).double()
    for w in (width, *widths):
        sets = mlps if w == width else [
            (*padded(g, gb, w, 0), *padded(u, ub, w, 0), padded(d, None, w, 1)[0], db)
            for g, gb, u, ub, d, db in mlps]

        def measure(sets=sets, w=w):
            up_us, down_us, whole_us = measure_products(sets, w)
            diff = float((mlp(sets[0], x).double() - reference).abs().max())
            flops = 2 * tokens * dim * width * 3  # the useful work, whatever the padding
            return ({"up_us": up_us, "down_us": down_us, "mlp_us": whole_us, "max_abs_diff": diff,
                     "tflop_s": flops / (whole_us * 1e-6) / 1e12},
                    f"up {up_us:8.2f} us  down {down_us:8.2f} us  MLP {whole_us:8.2f} us "
                    f"({flops / (whole_us * 1e-6) / 1e12:6.1f} TFLOP/s useful)  max|diff| {diff:.2e}")

        replay.row(result, args.json, {"width": w}, f"width {w:5d}", measure)


if __name__ == "__main__":
    main()
