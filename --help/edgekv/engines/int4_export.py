"""4-bit linears in the exported LLM graph: onnxruntime's ``com.microsoft.MatMulNBits`` (issue 29).

``MatMulNBits`` (onnxruntime ``docs/ContribOperators.md``) is what onnxruntime's CPU and CUDA providers run
for int4 weight-only products: ``Y = A @ ((B - zero_points) * scales)^T`` with

* ``B`` uint8 ``[N, K / block, block / 2]`` — for each output feature, the K values in blocks of ``block``
  (a power of two >= 16: the group size), two per byte, the lower index in the low nibble;
* ``scales`` ``[N, K / block]`` in ``A``'s dtype; ``zero_points`` uint8 ``[N, ceil(K / block / 2)]``, packed
  like ``B``; attributes ``K``, ``N``, ``bits = 4``, ``block_size``.

So an :class:`~edgekv.model.int4.Int4Linear` (AWQ words, ``[K, N]`` orientation) is re-laid out, the same
integers and scales, no rounding (a float16 scale is exact in fp32). The export swaps each 4-bit module of the
language model for :class:`MatMulNBitsLinear` for the duration of ``torch.onnx.export`` (and puts the originals
back, whatever happens), whose forward calls the custom op ``edgekv::matmul_nbits``; the exporter's
``custom_translation_table`` turns that op into the ``MatMulNBits`` node. Its torch implementation (what
``torch.export`` traces, and what the tests compare against) is dequantize-then-matmul.

TensorRT is not given these graphs: TensorRT 10 runs int4 weight-only layers as INT4 weights behind a blocked
``DequantizeLinear`` (what NVIDIA ModelOpt writes), a build no machine here could make or check, so
``edgekv build --backend tensorrt`` refuses a 4-bit checkpoint by name (``engines/build.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from edgekv.model.int4 import dequantize

BITS = 4


# ---------------------------------------------------------------------------------------------- the op
@torch.library.custom_op("edgekv::matmul_nbits", mutates_args=())
def matmul_nbits(a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, k: int, n: int,
                 block_size: int) -> torch.Tensor:
    """``MatMulNBits`` in torch: a [..., K] -> [..., N] in a's dtype (the weight dequantized exactly in fp32)."""
    q, zeros = unpack_matmul_nbits(b, zero_points, k, n, block_size)
    weight = dequantize(q.t(), zeros.t(), scales.t(), block_size)  # [K, N]
    return (a.to(torch.float32) @ weight).to(a.dtype)


@matmul_nbits.register_fake
def _(a, b, scales, zero_points, k, n, block_size):
    return a.new_empty(*a.shape[:-1], n)


def pack_matmul_nbits(q: torch.Tensor, zeros: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [K, N], zeros [K/block, N] (0..15) -> B uint8 [N, K/block, block/2], zero_points uint8 [N, ceil(K/block/2)]."""
    k, n = q.shape
    rows = q.t().to(torch.uint8)  # [N, K]
    b = (rows[:, 0::2] | (rows[:, 1::2] << 4)).reshape(n, k // block_size, block_size // 2).contiguous()
    z = zeros.t().to(torch.uint8)  # [N, blocks]
    if z.shape[1] % 2:
        z = torch.nn.functional.pad(z, (0, 1))
    return b, (z[:, 0::2] | (z[:, 1::2] << 4)).contiguous()


def unpack_matmul_nbits(b: torch.Tensor, zero_points: torch.Tensor, k: int, n: int,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of :func:`pack_matmul_nbits`: (q [N, K], zeros [N, K/block]) uint8."""
    q = torch.stack([b & 0xF, b >> 4], dim=-1).reshape(n, -1)[:, :k]
    zeros = torch.stack([zero_points & 0xF, zero_points >> 4], dim=-1).reshape(n, -1)[:, : k // block_size]
    return q, zeros


def _matmul_nbits_onnx(a, b, scales, zero_points, k: int, n: int, block_size: int):
    return _matmul_nbits_op()(a, b, scales, zero_points, K=k, N=n, bits=BITS, block_size=block_size)


def _matmul_nbits_op():
    """``com.microsoft::MatMulNBits`` as an onnxscript op. onnx itself has no schema for onnxruntime's
    contrib ops, so the schema (inputs A, B, scales, zero_points; attributes K, N, bits, block_size) is given
    here, for this op only — nothing is registered globally."""
    import onnxscript
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    schema = OpSchema(
        "MatMulNBits", "com.microsoft", 1, doc="onnxruntime contrib op (docs/ContribOperators.md)",
        inputs=[param("A", "T1"), param("B", "T2"), param("scales", "T1"), param("zero_points", "T3")],
        outputs=[param("Y", "T1")],
        type_constraints=[("T1", ["tensor(float)", "tensor(float16)"], ""), ("T2", ["tensor(uint8)"], ""),
                          ("T3", ["tensor(uint8)"], "")],
        attributes=[OpSchema.Attribute(name, OpSchema.AttrType.INT, "") for name in ("K", "N", "bits", "block_size")])
    return onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MatMulNBits", schema)


def translation_table() -> dict:
    """For ``torch.onnx.export(..., custom_translation_table=...)``."""
    return {torch.ops.edgekv.matmul_nbits.default: _matmul_nbits_onnx}


# ---------------------------------------------------------------------------------------------- the module
class MatMulNBitsLinear(nn.Module):
    """A 4-bit linear laid out for ``MatMulNBits``: buffers ``b``, ``scales`` (in ``dtype``), ``zero_points``."""

    def __init__(self, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        k, n = q.shape
        self.block_size = k // zeros.shape[0]
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ValueError(f"group size {self.block_size}: onnxruntime's MatMulNBits needs a power of two >= 16 "
                             f"(re-quantize with `edgekv quantize --group-size 16|32|64|128`)")
        b, zero_points = pack_matmul_nbits(q, zeros, self.block_size)
        self.in_features, self.out_features = k, n
        self.register_buffer("b", b.to(q.device))
        self.register_buffer("scales", scales.t().contiguous().to(dtype))
        self.register_buffer("zero_points", zero_points.to(q.device))
        self.bias = bias

    @classmethod
    def from_module(cls, module: nn.Module, dtype: torch.dtype) -> "MatMulNBitsLinear":
        """From an ``Int4Linear`` or the native route's ``NativeInt4Linear`` (anything with ``integers()``)."""
        q, zeros = module.integers()
        return cls(q, zeros, module.scales, module.bias, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = matmul_nbits(x, self.b, self.scales, self.zero_points, self.in_features, self.out_features,
                           self.block_size)
        return out if self.bias is None else out + self.bias


def _int4_children(module: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    found = []
    for parent in module.modules():
        for name, child in parent.named_children():
            if hasattr(child, "integers") and hasattr(child, "scales"):
                found.append((parent, name, child))
    return found


@contextlib.contextmanager
def matmul_nbits_modules(language: nn.Module, dtype: torch.dtype) -> Iterator[int]:
    """Swap the 4-bit linears of ``language`` for :class:`MatMulNBitsLinear` while the block runs (yields how
    many); the original modules are put back on exit, also on an error."""
    swapped = _int4_children(language)
    try:
        for parent, name, child in swapped:
            setattr(parent, name, MatMulNBitsLinear.from_module(child, dtype))
        yield len(swapped)
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)
