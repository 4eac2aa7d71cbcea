"""Packed projections: each decoder layer's q|k|v and gate|up weights as row blocks of one tensor (issue 32).

The fused decode step (``edgekv.session.decode_graph``) and the fused chunk layers
(``edgekv.model.prefill_fused``) read a group with one product; the projections keep their own weights as views
of the packed tensor, so nothing is duplicated and every other path reads them as before.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgekv.model.language import Qwen2LM


def projection_kind(linear) -> str | None:
    """"dense" (``nn.Linear``), "int4" (``Int4Linear``: its own 4-bit product, kernels/int4_matmul.py) or None."""
    from torch import nn

    from edgekv.model.int4 import Int4Linear

    return "dense" if type(linear) is nn.Linear else "int4" if type(linear) is Int4Linear else None


def product(linear, x: torch.Tensor) -> torch.Tensor:
    """x [1, in] -> [1, out] through a projection of either kind (its bias added)."""
    return F.linear(x, linear.weight, linear.bias) if type(linear) is torch.nn.Linear else linear(x)


def pack_projections(language: Qwen2LM) -> int:
    """Each layer's q, k and v projections (weights and biases) as row blocks of one tensor, and its MLP's gate
    and up projections as another, so a fused step reads each group with one product (torch linears only: a
    4-bit projection keeps its own product); returns the layers where something was packed. Memory-neutral:
    the projections' weights become views of the packed tensors (row blocks of a row-major matrix:
    contiguous), and every other path reads them as before. On the H200 (issue 32) the 3B's
    k and v products (1 MB each) took ~5.4 us apiece, bound by latency, not bytes, q ~5.7 us; gate and up
    13.9 us each and the packed gate|up 24.6 us (3.67 TB/s against 3.24; tools/gpu/products_3b.py)."""
    from torch import nn

    def pack(projections, biased: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        with torch.no_grad():
            weight = torch.cat([p.weight for p in projections])
            bias = torch.cat([p.bias for p in projections]) if biased else None
            start = 0
            for projection in projections:
                rows = projection.weight.shape[0]
                projection.weight = nn.Parameter(weight[start:start + rows], requires_grad=False)
                if biased:
                    projection.bias = nn.Parameter(bias[start:start + rows], requires_grad=False)
                start += rows
        return weight, bias

    packed = 0
    for layer in language.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if packed_attention(attn) and packed_mlp(mlp):
            continue
        dense = {name: projection_kind(getattr(parent, name)) == "dense"
                 for parent, names in ((attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj")))
                 for name in names}
        changed = False
        if not packed_attention(attn) and dense["q_proj"] and dense["k_proj"] and dense["v_proj"]:
            attn.qkv_weight, attn.qkv_bias = pack((attn.q_proj, attn.k_proj, attn.v_proj), biased=True)
            changed = True
        if (not packed_mlp(mlp) and dense["gate_proj"] and dense["up_proj"] and mlp.gate_proj.bias is None
                and mlp.up_proj.bias is None):
            mlp.gate_up_weight, _ = pack((mlp.gate_proj, mlp.up_proj), biased=False)
            changed = True
        packed += changed
    return packed


def _backs(packed: torch.Tensor | None, first: torch.Tensor | None, last: torch.Tensor | None) -> bool:
    """Whether ``first`` starts and ``last`` ends the ``packed`` tensor's storage (a ``.to()`` makes new tensors;
    a 4-bit projection has no ``weight``)."""
    return (packed is not None and first is not None and last is not None and first.data_ptr() == packed.data_ptr()
            and last.data_ptr() + last.numel() * last.element_size()
            == packed.data_ptr() + packed.numel() * packed.element_size())


def packed_attention(attn) -> bool:
    """Whether the layer's q/k/v weights are still the views of its packed tensor."""
    return _backs(getattr(attn, "qkv_weight", None), getattr(attn.q_proj, "weight", None),
                  getattr(attn.v_proj, "weight", None))


def packed_mlp(mlp) -> bool:
    """Whether the MLP's gate/up weights are still the views of its packed tensor."""
    return _backs(getattr(mlp, "gate_up_weight", None), getattr(mlp.gate_proj, "weight", None),
                  getattr(mlp.up_proj, "weight", None))
