"""How the language model's weights are read during decode (issue 17, "decode near the bound").

One decode token is a chain of matrix-vector products: every weight is read once, so on a CPU the step
is bound by memory bandwidth when the kernel keeps up with memory. ``prepare_decode(language, route)``
changes how the model's linear layers read their weights, in place. Routes measured on the 2-core x86
machine (1 thread, a 2048 -> 11008 projection; read bandwidth of a streaming fp32 sum 17.7 GB/s):

* ``eager`` — torch's kernels on the weights as loaded (the only route kept). fp32: MKL's sgemv streams
  at 15.9 GB/s (~90 % of the read bandwidth); a pre-transposed contiguous copy reached 17.3 GB/s
  (+8 %, at the price of a second weight layout). bf16 / fp16: torch converts as it goes, 8.6 / 10.0 GB/s.
* measured and not kept: a ``torch.compile``d multiply-and-reduce in the weight's dtype with fp32
  accumulation (bf16 9.6 GB/s, fp16 11.3, fp32 14.5 on the one projection, but inside the model every
  weight shape recompiled past dynamo's limit and decode got slower); a blocked bf16 -> fp32 upcast
  into a cache-sized buffer then sgemv (3.2-4.4 GB/s: the conversion itself runs at ~5 GB/s on AVX2);
  weight-only int8 through ``torch.ops.aten._weight_int8pack_mm`` (4.2 ms with bf16 activations vs
  5.2 ms for the bf16 product — 1.24x, but 5.3 GB/s of int8 weights is 30 % of the int8 bound, and it
  changes the numbers; 35 ms with fp32 or fp16 activations).
"""

from __future__ import annotations

from torch import nn

ROUTES = ("eager",)


def prepare_decode(language: nn.Module, route: str) -> dict:
    """Apply ``route`` to ``language`` (a ``Qwen2LM``) in place; returns what the bench records."""
    if route not in ROUTES:
        raise ValueError(f"decode route: unknown route {route!r} (known: {', '.join(ROUTES)})")
    return {"route": route}
