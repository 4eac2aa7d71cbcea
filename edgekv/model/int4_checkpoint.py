"""Reading the 4-bit linears of an AWQ or GPTQ checkpoint (``edgekv/model/int4.py`` has the layouts).

``load_pretrained`` calls :func:`plan_quantized` once it knows every tensor name in the directory: each
``nn.Linear`` of the decoder layers whose ``<prefix>.qweight`` is stored — or whose ``<prefix>.weight`` is
missing and which ``modules_to_not_convert`` does not name — becomes an :class:`Int4Linear` (on the meta
device, before anything is read), and its expected tensors replace ``<prefix>.weight``::

    AWQ   qweight [K, N/8] int32   qzeros [K/g, N/8] int32   scales [K/g, N] float16
    GPTQ  qweight [K/8, N] int32   qzeros [K/g, N/8] int32   scales [K/g, N] float16   g_idx [K] int32

(``bias`` [N] stays as it is.) The parts of one linear are collected as they are read (they may sit in
different shards) and written into the module once all are there, GPTQ's converted to the AWQ layout.
Every refusal is a ``CheckpointError`` naming the tensor or the ``quantization_config`` field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from edgekv.model.int4 import PACK, Int4Linear, QuantConfig, gptq_to_awq

_INT_PARTS = ("qweight", "qzeros", "g_idx")


@dataclass
class QuantizedLinearPlan:
    """One linear to be read as 4-bit: where it lives and the shapes its tensors must have."""

    module: str  # this package's name, e.g. language.layers.0.mlp.down_proj
    checkpoint: str  # the released-checkpoint prefix, e.g. model.layers.0.mlp.down_proj
    in_features: int
    out_features: int
    group: int
    shapes: dict[str, tuple[int, ...]]  # part -> shape
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


def quantized_shapes(quant: QuantConfig, k: int, n: int) -> dict[str, tuple[int, ...]]:
    group = quant.group_for(k)
    if quant.method == "awq":
        return {"qweight": (k, n // PACK), "qzeros": (k // group, n // PACK), "scales": (k // group, n)}
    return {"qweight": (k // PACK, n), "qzeros": (k // group, n // PACK), "scales": (k // group, n), "g_idx": (k,)}


def plan_quantized(model: nn.Module, quant: QuantConfig, names: set[str], to_checkpoint, error) -> dict[str, QuantizedLinearPlan]:
    """Swap the decoder layers' quantized ``nn.Linear`` modules of ``model`` (meta) for ``Int4Linear``;
    returns checkpoint prefix -> plan. ``names``: every canonical tensor name stored; ``to_checkpoint``
    maps a module name to its checkpoint name; ``error(message, tensor)`` builds the exception to raise."""
    plans: dict[str, QuantizedLinearPlan] = {}
    for module_name, linear in list(model.named_modules()):
        if type(linear) is not nn.Linear or not module_name.startswith("language.layers."):
            continue
        prefix = to_checkpoint(module_name + ".weight")[: -len(".weight")]
        stored_q, stored_w = f"{prefix}.qweight" in names, f"{prefix}.weight" in names
        excluded = any(f".{entry}." in f".{prefix}." or f".{entry}." in f".{module_name}."
                       for entry in quant.modules_to_not_convert)
        if stored_q and stored_w:
            raise error(f"tensor {prefix}.weight and {prefix}.qweight are both stored: a linear is either "
                        f"4-bit or not", f"{prefix}.qweight")
        if not stored_q and (stored_w or excluded):
            continue
        k, n = linear.in_features, linear.out_features
        group = quant.group_for(k)
        if k % group:
            raise error(f"tensor {prefix}.qweight: in_features {k} is not a multiple of quantization_config."
                        f"group_size {quant.group_size}", f"{prefix}.qweight")
        if n % PACK or (quant.method == "gptq" and k % PACK):
            raise error(f"tensor {prefix}.qweight: a {n} x {k} weight does not pack into int32 words of {PACK} "
                        f"4-bit values", f"{prefix}.qweight")
        parent, _, leaf = module_name.rpartition(".")
        replacement = Int4Linear(k, n, group, linear.bias is not None, dtype=linear.weight.dtype,
                                 device=linear.weight.device)
        setattr(model.get_submodule(parent), leaf, replacement)
        plans[prefix] = QuantizedLinearPlan(module_name, prefix, k, n, group, quantized_shapes(quant, k, n))
    if not plans:
        raise error(f"config.json has a quantization_config ({quant.method}) but no decoder-layer linear is "
                    f"stored as 4-bit (no tensor ends in .qweight)", None)
    return plans


def expected_with_quantized(expected: dict[str, tuple[int, ...]], plans: dict[str, QuantizedLinearPlan]) -> dict:
    """The dense expected shapes with each quantized linear's ``.weight`` replaced by its parts."""
    out = dict(expected)
    for prefix, plan in plans.items():
        del out[f"{prefix}.weight"]
        for part, shape in plan.shapes.items():
            out[f"{prefix}.{part}"] = shape
    return out


def split_part(name: str, plans: dict[str, QuantizedLinearPlan]) -> tuple[QuantizedLinearPlan, str] | None:
    """(plan, part) when ``name`` (canonical) is a quantized tensor of a planned linear, else None."""
    prefix, _, part = name.rpartition(".")
    plan = plans.get(prefix)
    if plan is None or part not in plan.shapes:
        return None
    return plan, part


def check_part(tensor: torch.Tensor, name: str, part: str, path: Path, error) -> None:
    if part in _INT_PARTS and tensor.dtype != torch.int32:
        raise error(f"{path}: tensor {name}: expected int32 (packed 4-bit values), found "
                    f"{str(tensor.dtype).removeprefix('torch.')}", name)
    if part == "scales":
        if not tensor.is_floating_point():
            raise error(f"{path}: tensor {name}: expected float16 scales, found {tensor.dtype}", name)
        if tensor.dtype != torch.float16 and not torch.equal(tensor.to(torch.float16).to(tensor.dtype), tensor):
            raise error(f"{path}: tensor {name}: {str(tensor.dtype).removeprefix('torch.')} scales that float16 "
                        f"cannot hold exactly", name)
        # a flipped bit or a quantizer that overflowed: every weight of the group would be nan, and so the logits
        bad = ~torch.isfinite(tensor)
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            raise error(f"{path}: tensor {name}: {int(bad.sum())} scale(s) are inf or nan (first at {where}); the "
                        f"file is damaged or was written by a quantizer that overflowed", name)


def finish_linear(model: nn.Module, plan: QuantizedLinearPlan, quant: QuantConfig, device: torch.device,
                  error) -> bool:
    """Write the linear's buffers once every part is read; True when done."""
    if set(plan.parts) != set(plan.shapes):
        return False
    qweight, qzeros = plan.parts["qweight"], plan.parts["qzeros"]
    if quant.method == "gptq":
        try:
            qweight, qzeros = gptq_to_awq(qweight, qzeros, plan.parts["g_idx"], plan.group, quant.checkpoint_format)
        except ValueError as exc:
            part = str(exc).split(":", 1)[0]
            raise error(f"tensor {plan.checkpoint}.{part}: {str(exc).split(':', 1)[1].strip()}",
                        f"{plan.checkpoint}.{part}") from None
    module = model.get_submodule(plan.module)
    # the parts are the loader's own tensors (read without a memory map): no copy on the CPU
    module.qweight = qweight.to(device=device).contiguous()
    module.qzeros = qzeros.to(device=device).contiguous()
    module.scales = plan.parts["scales"].to(device=device, dtype=torch.float16).contiguous()
    plan.parts.clear()
    return True
