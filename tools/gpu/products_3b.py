"""Issue 32, a prepared experiment: the decode step's weight products at the Qwen2.5-VL-3B shape, one row (M = 1),
bf16, as the model makes them (q, k, v, o, gate, up, down: 7 products a layer) and merged (q|k|v into one
2,048 -> 2,560 product, gate|up into one 2,048 -> 22,016: 4 a layer), so the next session knows with figures
whether merging the projections moves decode toward its weight-bandwidth bound.

Why: the H200 decode graph (2026-11-26) spent 2,150 us of a 2,719 us token in cuBLAS products (~3.2 TB/s, copy
4.2 TB/s); 252 products a token, the small ones (k, v: 1 MiB each) far from the copy rate.

Each timed pass makes a layer's products over 36 layers' weights (5.5 GB: no L2 reuse), captured in one CUDA graph
and replayed (tools/gpu/replay.py). Prints us a layer and TB/s of weight read; JSON to ``--json``. ``--small`` runs
toy widths on the CPU (a check of this script, not a figure).
"""

from __future__ import annotations

import argparse

import torch

import replay  # tools/gpu/replay.py


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--json", default="products-3b.json")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()

    import torch.nn.functional as F

    cuda = not args.small
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16
    hidden, kv, inter = (2048, 256, 11008) if cuda else (64, 16, 128)
    layers = 36 if cuda else 2
    gen = torch.Generator().manual_seed(0)

    def weight(n: int, k: int) -> torch.Tensor:
        return (torch.randn(n, k, generator=gen) * 0.02).to(device, dtype)

    shapes = {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
              "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    separate = [{name: weight(*shape) for name, shape in shapes.items()} for _ in range(layers)]
    merged = [{"qkv": torch.cat([w["q"], w["k"], w["v"]]), "gate_up": torch.cat([w["gate"], w["up"]]),
               "o": w["o"], "down": w["down"]} for w in separate]
    x = (torch.randn(1, hidden, generator=gen)).to(device, dtype)
    xi = (torch.randn(1, inter, generator=gen)).to(device, dtype)

    def layer_separate(i: int) -> None:
        w = separate[i]
        for name in ("q", "k", "v", "o", "gate", "up"):
            F.linear(x, w[name])
        F.linear(xi, w["down"])

    def layer_merged(i: int) -> None:
        w = merged[i]
        for name in ("qkv", "o", "gate_up"):
            F.linear(x, w[name])
        F.linear(xi, w["down"])

    one = {name: (lambda i, name=name: F.linear(xi if name == "down" else x, separate[i][name])) for name in shapes}
    one.update({name: (lambda i, name=name: F.linear(x, merged[i][name])) for name in ("qkv", "gate_up")})
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "dtype": "bf16", "rows": []}
    layer_bytes = sum(t.numel() * t.element_size() for t in separate[0].values())
    for name, call in [("layer, 7 products", layer_separate), ("layer, 4 merged", layer_merged)]:
        def measure(call=call):
            us = replay.timed(call, layers, args.replays, cuda) * 1e6
            return {"us": us, "tb_s": layer_bytes / us / 1e6}, f"{us:8.1f} us a layer  {layer_bytes / us / 1e6:5.2f} TB/s"

        replay.row(result, args.json, {"product": name, "bytes": layer_bytes}, f"{name:18s}", measure)
    for name, call in one.items():
        w = merged[0][name] if name in merged[0] else separate[0][name]
        size = w.numel() * w.element_size()

        def measure(call=call, size=size):
            us = replay.timed(call, layers, args.replays, cuda) * 1e6
            return {"us": us, "tb_s": size / us / 1e6}, f"{us:8.2f} us  {size / us / 1e6:5.2f} TB/s"

        replay.row(result, args.json, {"product": name, "shape": list(w.shape), "bytes": size},
                   f"{name:8s} {str(tuple(w.shape)):14s}", measure)


if __name__ == "__main__":
    main()
