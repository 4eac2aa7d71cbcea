"""A chunk through a decoder layer with its small work fused (``model.prefill_route: fused``; issue 32).

Why: on an H200 a 3B frame pair's ingest was 20 ms of device work and ~47 ms of wall time, 3,221 kernels a pair
(``tools/gpu/profile_pair.py``, 2026-11-26): the host's launches bound it, and a Jetson's CPU launches slower
still. Counted on the CPU (aten operators a pair, the tiny model), a decoder layer's own forward is ~86
operators — RMSNorm's eight twice, the rotary's five a tensor plus casts, three projections, SiLU and its
product, two residual adds — around its attention. Here the same layer is:

    add_rms_norm (input norm)  ->  one q|k|v product  ->  rope_rows (q and k rotated, v laid out)  ->  attend
    ->  o product  ->  add_rms_norm (residual + post norm)  ->  one gate|up product  ->  silu_mul_rows
    ->  down product  ->  residual add

ten launches and the attention's own. The roundings are the layer's (the kernels in
``edgekv.kernels.decode_fused`` replay torch's per-op roundings); the mean of squares in RMSNorm is one fp32
tree sum, so a value can differ by one ulp where it lands near a rounding tie, as in the fused decode step.

Installed as ``DecoderLayer.fused`` (the hook the CPU's native 4-bit route uses), on CUDA only: it serves 2-D
inference chunks of plain Qwen2 layers (torch or 4-bit linears, SiLU, 16/32-bit) where Triton runs, and returns
None otherwise (training batches, autograd, host tensors), and the layer runs as written. The packed q|k|v and
gate|up weights are the decode step's (``edgekv.model.packing.pack_projections``: memory-neutral views).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgekv.kernels._triton import use_triton
from edgekv.kernels.decode_fused import add_rms_norm, rope_rows, silu_mul_rows
from edgekv.model.packing import pack_projections, packed_attention, packed_mlp, product, projection_kind

# "auto" picks "fused" on CUDA once the route has run on a GPU (issue 32); until then it is opt-in, as the decode
# graph and the vision graph were until a lent GPU ran them
AUTO_FUSED_PREFILL = False


class FusedChunkLayer:
    """``DecoderLayer.fused``: ``(layer, x [P, d], cos, sin [P, D], index, attend) -> x`` or None."""

    def __call__(self, layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int, attend):
        if x.dim() != 2 or (torch.is_grad_enabled() and x.requires_grad) or not use_triton(x):
            return None  # a training batch, autograd, a host tensor without the interpreter: the layer's own forward
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x, h = add_rms_norm(x.contiguous(), None, norm.weight, norm.eps)
        if packed_attention(attn):  # one product for q, k and v
            qkv = F.linear(h, attn.qkv_weight, attn.qkv_bias)  # [P, (Hq + 2 Hkv) D]
        else:  # 4-bit projections (Int4Linear): their own products, side by side for rope_rows
            qkv = torch.cat([product(attn.q_proj, h), product(attn.k_proj, h), product(attn.v_proj, h)], dim=-1)
        q, k, v = rope_rows(qkv, attn.num_heads, attn.num_kv_heads, cos, sin)
        out = attend(index, q, k, v)  # [Hq, P, D]
        out = product(attn.o_proj, out.transpose(0, 1).reshape(x.shape[0], -1))
        norm = layer.post_attention_layernorm
        x, h = add_rms_norm(x, out, norm.weight, norm.eps)
        if packed_mlp(mlp):  # one product for gate and up
            gate_up = F.linear(h, mlp.gate_up_weight)  # [P, 2 I]
            size = mlp.gate_proj.weight.shape[0]
            gate, up = gate_up[:, :size], gate_up[:, size:]
        else:
            gate, up = product(mlp.gate_proj, h), product(mlp.up_proj, h)
        return x + product(mlp.down_proj, silu_mul_rows(gate, up))


def resolve_prefill_route(route: str, device: torch.device | str) -> str:
    """``model.prefill_route`` -> "fused" or "eager": "fused" asks for it (a ValueError with the reason off CUDA);
    "auto" is "fused" on CUDA once ``AUTO_FUSED_PREFILL`` is set, "eager" elsewhere."""
    from edgekv.model.routes import cuda_route

    return cuda_route("prefill_route", route, device, "fused", AUTO_FUSED_PREFILL,
                      "its Triton kernels need a CUDA device")


def prepare_prefill(language, route: str) -> int:
    """Install the fused chunk layer on every layer that can take it (``route == "fused"``); returns their count.
    Its projections may be torch linears (q|k|v and gate|up then packed: one product each) or 4-bit ones
    (``Int4Linear``: their own products). A layer that cannot (another projection, another activation, a hook
    already set: the CPU's native 4-bit route) keeps its own forward; the 16/32-bit float dtype and
    power-of-two head_dim are the decode step's rules."""
    if route != "fused":
        return 0
    dtype = language.norm.weight.dtype
    head_dim = language.config.head_dim
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or head_dim & (head_dim - 1):
        return 0
    pack_projections(language)
    installed = 0
    for layer in language.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if (layer.fused is None and all(projection_kind(linear) is not None for linear in linears)
                and mlp.act is F.silu):
            layer.fused = FusedChunkLayer()
            installed += 1
    return installed
