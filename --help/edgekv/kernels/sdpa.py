"""Chunk attention by torch's ``scaled_dot_product_attention``: the path every device without Triton takes
(CPU), and the reference the attention kernels are checked against.

A chunk of ``P`` new tokens sees every committed slot ``[0, start)`` and itself causally. Grouped-query
attention is folded onto the query axis (``folded_attention``): one SDPA call per layer reads each KV head's
keys once, with no ``enable_gqa``; a single query needs no mask at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_causal_mask(start: int, num_new: int, device: torch.device) -> torch.Tensor:
    """[P, start + P] bool: all committed keys visible, causal inside the chunk."""
    mask = torch.ones(num_new, start + num_new, dtype=torch.bool, device=device)
    mask[:, start:] = torch.ones(num_new, num_new, dtype=torch.bool, device=device).tril_()
    return mask


def folded_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
    """Chunk attention over every committed slot with GQA folded onto the query axis.

    q: [Hq, P, D]; keys, values: [Hkv, start + P, D] (cast to q's dtype). Query head ``h * G + j``
    reads KV head ``h`` (HF ``repeat_kv``), so ``q.view(Hkv, G * P, D)`` puts each KV head's ``G``
    query heads one after another on the query axis; row ``j * P + i`` is token ``i`` of group member
    ``j``. P = 1 needs no mask (one query sees every key); P > 1 repeats the chunk-causal mask G times.
    Returns [Hq, P, D].
    """
    heads_q, num_new, dim = q.shape
    heads_kv = keys.shape[0]
    if heads_q % heads_kv:
        raise ValueError(f"query heads {heads_q} are not a multiple of KV heads {heads_kv}")
    if keys.shape[1] != start + num_new:
        raise ValueError(f"keys hold {keys.shape[1]} slots, expected start + P = {start + num_new}")
    group = heads_q // heads_kv
    compute = fast_path_dtype(q.dtype, q.device)
    folded = q.reshape(1, heads_kv, group * num_new, dim).to(compute)  # [1, Hkv, G * P, D]
    mask = None
    if num_new > 1:
        mask = chunk_causal_mask(start, num_new, q.device).repeat(group, 1)  # [G * P, N]
    # The batch axis matters: 3-D inputs take SDPA's math path on CPU, 4-D its fused (flash) kernel.
    out = F.scaled_dot_product_attention(folded, keys.unsqueeze(0).to(compute), values.unsqueeze(0).to(compute),
                                         attn_mask=mask)
    # reshape, not view: CUDA's memory-efficient SDPA returns [1, Hkv, G * P, D] with a transposed layout
    # (seen on an H200, fp32), which view refuses
    return out.reshape(heads_q, num_new, dim).to(q.dtype)


def fast_path_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the fast path attends in: the input's, except fp16 on CPU, where torch's fused CPU
    kernel has no fast fp16 route (3.7 ms vs 0.5 ms in fp32 at [2, 8, 2063, 128], issue-17 note) —
    there q, K and V are upcast once and accumulated in fp32, which is also closer to the reference."""
    if dtype == torch.float16 and device.type == "cpu":
        return torch.float32
    return dtype
