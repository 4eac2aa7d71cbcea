"""4-bit weight-only checkpoints: the two layouts people download, and the module that holds them.

A weight ``W [N, K]`` (a ``nn.Linear``'s ``out x in``) is stored as 4-bit integers ``q`` in ``0..15`` with,
per group of ``g`` consecutive input features and per output feature, a scale ``s`` and an integer zero
point ``z``::

    W[n, k] = (q[k, n] - z[k // g, n]) * s[k // g, n]

Both layouts below keep ``scales [K/g, N]`` (float16) and pack eight 4-bit values per int32, the value
``i`` of a word in bits ``4i .. 4i+3``; they differ in which eight values share a word.

* **AutoAWQ GEMM** (``quantization_config``: ``quant_method: awq``, ``version: gemm``, ``zero_point: true``;
  Qwen's ``Qwen2.5-VL-3B-Instruct-AWQ``): ``qweight [K, N/8]`` and ``qzeros [K/g, N/8]`` are packed along
  the *output* dimension, and word ``j`` of a row holds the columns ``8j + AWQ_ORDER[i]`` for
  ``i = 0..7`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (AutoAWQ ``WQLinear_GEMM.from_linear``; the
  order suits the CUDA kernel's dequantization). Zeros are stored as they are.
* **GPTQ** (``quant_method: gptq``; AutoGPTQ / GPTQModel): ``qweight [K/8, N]`` is packed along the
  *input* dimension in plain order (word ``r`` of a column holds rows ``8r .. 8r+7``), ``qzeros [K/g,
  N/8]`` along the output dimension in plain order, and ``g_idx [K]`` names each input row's group. The
  original format (``checkpoint_format: gptq``, "v1") stores ``z - 1`` (AutoGPTQ subtracts one before
  packing and its kernels add it back); ``gptq_v2`` stores ``z``. With ``desc_act`` (act-order) the groups
  of a row follow the quantization order, not the row order; only ``g_idx == k // g`` is read here.

This package keeps every quantized linear in the AWQ layout (GPTQ tensors are converted when they are
read: the integers move, nothing is rounded), so one module, :class:`Int4Linear`, one set of kernels and
one export path serve both. The vision tower and the tied embedding / ``lm_head`` stay in floating point,
as the published checkpoints ship them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from edgekv.kernels.int4_format import (  # noqa: F401 - the format lives beside the kernels that read it
    BITS,
    PACK,
    AWQ_ORDER,
    pack_awq,
    unpack_awq,
    pack_gptq_rows,
    unpack_gptq_rows,
    pack_gptq_cols,
    unpack_gptq_cols,
    dequantize,
)
from edgekv.model.config import ConfigError

AWQ_VERSIONS = ("gemm",)
GPTQ_FORMATS = ("gptq", "gptq_v2")
QUANT_METHODS = ("awq", "gptq")


class QuantConfigError(ConfigError):
    """A ``quantization_config`` this package cannot read; the message names the field."""


@dataclass(frozen=True)
class QuantConfig:
    """The ``quantization_config`` of a checkpoint's ``config.json``, validated.

    ``group_size == -1`` means one group over the whole input dimension (per output channel).
    """

    method: str
    bits: int = BITS
    group_size: int = 128
    zero_point: bool = True  # AWQ
    version: str = "gemm"  # AWQ
    sym: bool = False  # GPTQ
    desc_act: bool = False  # GPTQ
    static_groups: bool = False  # GPTQ
    checkpoint_format: str = "gptq"  # GPTQ
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_model_config(cls, raw: Mapping[str, Any]) -> "QuantConfig | None":
        """The checkpoint's quantization (None for a floating-point checkpoint) from a parsed config.json."""
        section = raw.get("quantization_config")
        if section is None and isinstance(raw.get("text_config"), Mapping):
            section = raw["text_config"].get("quantization_config")
        if section is None:
            return None
        if not isinstance(section, Mapping):
            raise QuantConfigError(f"quantization_config: expected an object, got {section!r}")
        return cls.from_dict(section)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "QuantConfig":
        method = d.get("quant_method")
        if not isinstance(method, str) or method.lower() not in QUANT_METHODS:
            raise QuantConfigError(f"quantization_config.quant_method: {method!r} is not supported "
                                   f"(edgekv reads {' and '.join(QUANT_METHODS)} 4-bit checkpoints)")
        method = method.lower()
        bits = d.get("bits", d.get("w_bit"))
        if bits != BITS or isinstance(bits, bool):
            raise QuantConfigError(f"quantization_config.bits: {bits!r} is not supported (edgekv reads 4-bit weights)")
        group = d.get("group_size", d.get("q_group_size", 128))
        if isinstance(group, bool) or not isinstance(group, int) or not (group > 0 or group == -1):
            raise QuantConfigError(f"quantization_config.group_size: {group!r} is not a positive integer or -1")
        skip = d.get("modules_to_not_convert") or ()
        if not isinstance(skip, (list, tuple)) or not all(isinstance(s, str) for s in skip):
            raise QuantConfigError(f"quantization_config.modules_to_not_convert: expected a list of names, got {skip!r}")
        if method == "awq":
            version = str(d.get("version", "gemm")).lower()
            if version not in AWQ_VERSIONS:
                raise QuantConfigError(f"quantization_config.version: {d.get('version')!r} is not supported (edgekv "
                                       f"reads the AutoAWQ GEMM layout, version 'gemm')")
            zero_point = d.get("zero_point", True)
            if zero_point is not True:
                raise QuantConfigError(f"quantization_config.zero_point: {zero_point!r} is not supported (the "
                                       f"AutoAWQ GEMM layout has zero points)")
            return cls("awq", bits, group, zero_point=True, version=version, modules_to_not_convert=tuple(skip))
        fmt = str(d.get("checkpoint_format", "gptq")).lower()
        if fmt not in GPTQ_FORMATS:
            raise QuantConfigError(f"quantization_config.checkpoint_format: {d.get('checkpoint_format')!r} is not "
                                   f"supported (edgekv reads {' and '.join(GPTQ_FORMATS)})")
        desc_act, static = d.get("desc_act", False), d.get("static_groups", False)
        for name, value in (("desc_act", desc_act), ("static_groups", static), ("sym", d.get("sym", True))):
            if not isinstance(value, bool):
                raise QuantConfigError(f"quantization_config.{name}: expected true/false, got {value!r}")
        if desc_act and not static:
            raise QuantConfigError("quantization_config.desc_act: act-order GPTQ (desc_act true without "
                                   "static_groups) keeps groups out of row order; edgekv reads GPTQ with "
                                   "desc_act false or static_groups true")
        return cls("gptq", bits, group, sym=bool(d.get("sym", True)), desc_act=desc_act, static_groups=static,
                   checkpoint_format=fmt, modules_to_not_convert=tuple(skip))

    def group_for(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def to_dict(self) -> dict[str, Any]:
        """What ``edgekv quantize`` writes (AutoAWQ's keys) or the GPTQ keys of a GPTQ config."""
        if self.method == "awq":
            return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": True,
                    "version": "gemm", "modules_to_not_convert": list(self.modules_to_not_convert) or None}
        return {"quant_method": "gptq", "bits": self.bits, "group_size": self.group_size, "sym": self.sym,
                "desc_act": self.desc_act, "static_groups": self.static_groups,
                "checkpoint_format": self.checkpoint_format}


def gptq_to_awq(qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None, group: int,
                checkpoint_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ ``qweight [K/8, N]``, ``qzeros [K/g, N/8]`` (and ``g_idx [K]``) -> AWQ ``qweight [K, N/8]``,
    ``qzeros [K/g, N/8]``; raises ValueError naming the tensor ('g_idx', 'qzeros') that cannot be converted."""
    q = unpack_gptq_rows(qweight)
    k = q.shape[0]
    if g_idx is not None:
        want = torch.arange(k, dtype=torch.int64, device=g_idx.device) // group
        if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), want):
            raise ValueError("g_idx: the groups are not in row order (act-order / desc_act GPTQ); edgekv reads "
                             "g_idx == row // group_size only")
    zeros = unpack_gptq_cols(qzeros).to(torch.int16)
    if checkpoint_format == "gptq":  # v1 stores z - 1
        zeros = zeros + 1
        if int(zeros.max()) > 15:
            raise ValueError("qzeros: a stored zero point of 15 means 16 in the GPTQ v1 format (AutoGPTQ's "
                             "'zero - 1' packing overflowed), which a 4-bit zero point cannot hold")
    return pack_awq(q), pack_awq(zeros.to(torch.uint8))


# ---------------------------------------------------------------------------------------------- module
def apply_keeping_scales(module: nn.Module, apply, fn, recurse: bool):
    """``module._apply(fn)`` for a 4-bit module whose ``scales`` buffer is float16 by format (AutoAWQ writes
    them so; the kernels read float16): a cast of the whole model (``model.to(torch.bfloat16)``) would round
    them to the new dtype, so they are moved to where ``fn`` sent the rest and keep their dtype and bits."""
    scales = module._buffers.get("scales")
    out = apply(fn, recurse)
    moved = module._buffers.get("scales")
    if scales is not None and moved is not None and moved.dtype != scales.dtype:
        module._buffers["scales"] = scales.to(moved.device)
    return out


class Int4Linear(nn.Module):
    """A linear layer with 4-bit weights in the AutoAWQ GEMM layout (see the module docstring).

    Buffers ``qweight`` int32 [K, N/8], ``qzeros`` int32 [K/g, N/8], ``scales`` float16 [K/g, N]; ``bias``
    [N] is a parameter in the model dtype (or None). ``forward`` sends the product to
    ``edgekv.kernels.int4_matmul`` (Triton on CUDA, dequantize-then-matmul otherwise); the ``native`` decode
    route (``edgekv/model/decode_routes.py``) hands one-row CPU products to the C kernel instead.
    """

    def __init__(self, in_features: int, out_features: int, group_size: int, bias: bool,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        if group_size <= 0 or in_features % group_size:
            raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
        if out_features % PACK:
            raise ValueError(f"out_features {out_features} is not a multiple of {PACK}")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.register_buffer("qweight", torch.zeros(in_features, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("qzeros", torch.zeros(groups, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) \
            if bias else None

    def _apply(self, fn, recurse=True):
        return apply_keeping_scales(self, super()._apply, fn, recurse)

    @classmethod
    def from_integers(cls, q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      bias: torch.Tensor | None = None) -> "Int4Linear":
        """q [K, N], zeros [K/g, N] (0..15), scales [K/g, N] (float16) -> the packed module."""
        k, n = q.shape
        group = k // zeros.shape[0]
        module = cls(k, n, group, bias is not None, dtype=None if bias is None else bias.dtype)
        module.qweight = pack_awq(q)
        module.qzeros = pack_awq(zeros)
        module.scales = scales.to(torch.float16).contiguous()
        if bias is not None:
            module.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
        return module

    @property
    def groups(self) -> int:
        return self.in_features // self.group_size

    def integers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q uint8 [K, N], zeros uint8 [K/g, N])."""
        return unpack_awq(self.qweight), unpack_awq(self.qzeros)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as a ``nn.Linear`` holds it, [N, K]: exact in fp32, then rounded once to ``dtype``."""
        q, zeros = self.integers()
        return dequantize(q, zeros, self.scales, self.group_size).t().contiguous().to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from edgekv.kernels.int4_matmul import int4_matmul

        out = int4_matmul(x.reshape(-1, self.in_features), self.qweight, self.qzeros, self.scales, self.group_size)
        out = out.view(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits=4, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


def int4_modules(module: nn.Module) -> list[tuple[str, Int4Linear]]:
    return [(name, m) for name, m in module.named_modules() if isinstance(m, Int4Linear)]


def is_quantized(module: nn.Module) -> bool:
    return any(isinstance(m, Int4Linear) for m in module.modules())


def dense_linear(module: Int4Linear, dtype: torch.dtype = torch.float32) -> nn.Linear:
    """The dequantized twin: a ``nn.Linear`` with the exact fp32 weight (rounded once to ``dtype``)."""
    linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(module.dequantized_weight(dtype))
        if module.bias is not None:
            linear.bias.copy_(module.bias.to(dtype))
    return linear.requires_grad_(False)


__all__ = [
    "AWQ_ORDER",
    "Int4Linear",
    "QuantConfig",
    "QuantConfigError",
    "dense_linear",
    "dequantize",
    "gptq_to_awq",
    "is_quantized",
    "pack_awq",
    "pack_gptq_cols",
    "pack_gptq_rows",
    "unpack_awq",
    "unpack_gptq_cols",
    "unpack_gptq_rows",
]
