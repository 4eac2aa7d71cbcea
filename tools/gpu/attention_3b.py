"""Issue 32, one decode step's attention at the 3B shape (Hq 16, Hkv 2, D 128, N visible of M 6,144 slots) on a
lent GPU, every way the runtime can compute it:

  sdpa        folded_attention over a bf16 cache (SDPA; the eager decode path and the graph's ``graph-sdpa``)
  split-ieee  kernels/decode_attention.py with fp32 ``ieee`` products (what the first run of the graph used)
  split-tf32  the same kernel with tf32 products (its default for a 16-bit cache since this run)
  int8, fp8   kernels/quant_attention.py over an 8-bit cache (split over keys for a decode step)

Each timed pass runs the call over 36 different layers' buffers (as a token does: the 36 caches do not fit the
L2), captured in one CUDA graph and replayed, so launch overhead is not timed. Prints us a call and max |diff|
against an fp64 reference; writes JSON to ``--json``. ``--small`` runs a toy shape on the CPU in Triton's
interpreter (a check of this script, not a figure).
"""

from __future__ import annotations

import argparse

import torch

import replay  # tools/gpu/replay.py (the scripts run as python3 tools/gpu/<name>.py)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--visible", type=int, nargs="+", default=[1024, 4096, 6144])
    parser.add_argument("--json", default="attention-3b.json")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()

    from edgekv.cache.quant import quantize
    from edgekv.kernels.decode_attention import decode_attention_reference, decode_attention_triton
    from edgekv.kernels.quant_attention import quantized_attention_reference, quantized_attention_triton
    from edgekv.model.rope import rotary_inv_freq

    cuda = not args.small
    device = torch.device("cuda" if cuda else "cpu")
    heads_q, heads_kv, dim, slots, layers = (16, 2, 128, 6144, 36) if cuda else (4, 2, 16, 200, 2)
    visible = args.visible if cuda else [37, 200]
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(heads_q, 1, dim, generator=gen) * 1.5).to(device, torch.bfloat16)
    keys = [(torch.randn(heads_kv, slots, dim, generator=gen) * 2) for _ in range(layers)]
    values = [torch.randn(heads_kv, slots, dim, generator=gen) for _ in range(layers)]
    k16 = [k.to(device, torch.bfloat16) for k in keys]
    v16 = [v.to(device, torch.bfloat16) for v in values]
    inv_freq = rotary_inv_freq(dim, 1_000_000.0, torch.device("cpu")).to(device)
    tpos = torch.randint(0, 8000, (heads_kv, slots), generator=gen).to(device)
    coded = {}
    for codes, name in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
        sets = []
        for k, v in zip(keys, values):
            kc, ks = quantize(k, codes)
            vc, vs = quantize(v, codes)
            sets.append((kc.to(device), ks.to(device), vc.to(device), vs.to(device)))
        coded[name] = sets
    del keys, values
    section = 16 if cuda else 2
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu (interpreter)", "heads_q": heads_q,
              "heads_kv": heads_kv, "dim": dim, "slots": slots, "layers_rotated": layers, "rows": []}

    def timed(call) -> float:
        return replay.timed(call, layers, args.replays, cuda) * 1e6

    for n in visible:
        n_t = torch.tensor([n], device=device)
        want = decode_attention_reference(q.double(), k16[0].double(), v16[0].double(), n)
        calls = {
            "sdpa": lambda i: decode_attention_reference(q, k16[i], v16[i], n),
            "split-ieee": lambda i: decode_attention_triton(q, k16[i], v16[i], n_t, precision="ieee"),
            "split-tf32": lambda i: decode_attention_triton(q, k16[i], v16[i], n_t, precision="tf32"),
        }
        for name in ("int8", "fp8"):
            calls[name] = (lambda sets: lambda i: quantized_attention_triton(
                q, sets[i][0], sets[i][1], sets[i][2], sets[i][3], tpos, inv_freq, section, start=n - 1))(coded[name])
        for name, call in calls.items():
            def measure(name=name, call=call):
                us = timed(call)
                if name in coded:
                    kc, ks, vc, vs = coded[name][0]
                    ref = quantized_attention_reference(q, kc, ks, vc, vs, tpos, inv_freq, section, start=n - 1,
                                                        compute_dtype=torch.float64)
                else:
                    ref = want
                diff = float((call(0).double() - ref.double()).abs().max())
                return {"us": us, "max_abs_diff": diff}, f"{us:9.2f} us a call   max|diff| {diff:.2e}"

            replay.row(result, args.json, {"visible": n, "route": name}, f"N {n:5d}  {name:10s}", measure)

if __name__ == "__main__":
    main()
