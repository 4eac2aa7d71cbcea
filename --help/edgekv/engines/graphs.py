"""The exportable graphs: what an engine computes, written as plain torch modules with fixed-shape I/O.

Every backend other than ``torch`` runs one of these graphs, exported to ONNX (``export.py``) and then run
by onnxruntime or compiled by TensorRT. The cache logic is NOT in them: the capped cache enters as
fixed-shape inputs and the new K/V leave as outputs, so slots, metadata, policies and StateKV sinks stay
in ``edgekv.cache`` / ``edgekv.session`` and are shared by every backend (DESIGN.md, Engines).

``vision`` — one frame pair at the deployment's fixed grid::

    pixel_values [N, C*2*14*14]  ->  tokens [N/4, d]

The window permutation, padding gathers, key masks and 2D rotary angles of that grid are computed in
Python before export and enter the graph as constants: no ``cu_seqlens``/window-index inputs, no shape
profile over them (the ONNX->TensorRT accuracy loss of TensorRT-LLM#3223 came from profiling those).

``llm`` — one chunk of P tokens (a frame pair, a question, or one decode step: P = 1)::

    embeds        [P, d]            model dtype
    position_ids  [3, P]            int64, M-RoPE rows (t, h, w)
    k_cache       [L, Hkv, M, D]    model dtype — the capped cache's buffer, bound as is
    v_cache       [L, Hkv, M, D]
    visible       [L, Hkv, M]       bool — which cache slots each (layer, KV head) may attend to
  ->
    hidden        [P, d]            after the final RMSNorm (logits are the tied lm_head, applied outside)
    new_k, new_v  [L, Hkv, P, D]    the chunk's rotated keys and values, for the caller to write
    mass          [L, Hkv, M + P]   per-key attention mass: softmax probabilities summed over the chunk's
                                    queries, averaged over the query heads of each KV head (StateKV eq. 6);
                                    slots not visible get exactly 0

Prefill and decode are ONE graph with two shape regimes, not two graphs: P in [1, max_chunk_tokens] for
prefill chunks and P = 1 for decode (a second TensorRT optimization profile of the same engine, sharing its
weights). Two exported graphs would hold two copies of the weights in every runtime — measured with the 3B
shape in fp16 through onnxruntime CPU: 10.7 GiB resident with one LLM session, 20.9 GiB with two.

With an 8-bit cache (``cache.kv_dtype: int8``) the graph takes the cache's own buffers as they are stored
(``edgekv/cache/quant.py``) instead of ``k_cache`` / ``v_cache``::

    k_codes, v_codes  [L, Hkv, M, D]  int8 — keys time-neutral (their temporal rotation undone)
    k_scale, v_scale  [L, Hkv, M]     bf16 — one absmax scale per slot
    tpos              [L, Hkv, M]     int32 — each slot's temporal position

and dequantizes and rotates inside with the cache's own functions (``dequantize``, then
``edgekv.positions.rotate_temporal`` by ``tpos``, fp32). The chunk attends to its own K/V as the cache will
hold them (quantized and dequantized in the graph, as the torch path writes before it reads); ``new_k`` /
``new_v`` leave unquantized in the model dtype and the runner quantizes them as the torch path does
(``CappedKVCache.write_layer``). fp8 caches have no graph: ONNX's
float8 types need opset 19 and onnxruntime's CPU provider casts them only in a few builds.

Each query sees the visible cache slots and the chunk causally. Scores, softmax and the weighted sum run in
fp32 whatever the graph dtype (same as ``edgekv.kernels.attention_mass``), so a fp16 engine does not lose
the small probabilities that StateKV's mass and a long cache depend on.
"""

from __future__ import annotations

import torch
from torch import nn

from edgekv.cache.quant import dequantize, quantize
from edgekv.model.language import Qwen2LM
from edgekv.model.vision import VisionTower, build_layout
from edgekv.positions import rotate_temporal

LLM_INPUTS = ("embeds", "position_ids", "k_cache", "v_cache", "visible")
LLM_INPUTS_8BIT = ("embeds", "position_ids", "k_codes", "k_scale", "v_codes", "v_scale", "tpos", "visible")
LLM_OUTPUTS = ("hidden", "new_k", "new_v", "mass")
VISION_INPUTS = ("pixel_values",)
VISION_OUTPUTS = ("tokens",)


class VisionGraph(nn.Module):
    """The vision tower with the layout of one ``grid_thw`` baked in."""

    def __init__(self, tower: VisionTower, grid_thw: tuple[int, int, int]) -> None:
        super().__init__()
        self.tower = tower
        self.grid_thw = tuple(int(v) for v in grid_thw)
        device = tower.patch_embed.proj.weight.device
        self.layout = build_layout(tower.config, [self.grid_thw], device)
        t, h, w = self.grid_thw
        self.num_patches = t * h * w
        self.num_tokens = self.num_patches // tower.config.spatial_merge_size ** 2

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.tower.forward_layout(pixel_values, self.layout)


class _GraphAttend:
    """AttendFn over ``[k_cache[layer] (masked by visible) ; chunk (causal)]`` that keeps the chunk's K/V."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, visible: torch.Tensor) -> None:
        self.k_cache, self.v_cache, self.visible = k_cache, v_cache, visible
        self.new_k: list[torch.Tensor] = []
        self.new_v: list[torch.Tensor] = []
        self.mass: list[torch.Tensor] = []

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's cached K and V, [Hkv, M, D] fp32."""
        return self.k_cache[layer].float(), self.v_cache[layer].float()

    def chunk(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The chunk's K and V as the chunk attends to them (as written to the cache), fp32."""
        return k.float(), v.float()

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        heads_q, num, dim = q.shape  # q: [Hq, P, D]; k, v: [Hkv, P, D]
        heads_kv = k.shape[0]
        group = heads_q // heads_kv
        self.new_k.append(k)
        self.new_v.append(v)
        cached_k, cached_v = self.cached(layer)
        chunk_k, chunk_v = self.chunk(k, v)
        keys = torch.cat([cached_k, chunk_k], dim=1)  # [Hkv, M + P, D]
        values = torch.cat([cached_v, chunk_v], dim=1)
        index = torch.arange(num, device=q.device)
        causal = index[None, :] <= index[:, None]  # [P, P]: query i sees chunk keys 0..i
        cached = self.visible[layer][:, None, :].expand(heads_kv, num, self.visible.shape[-1])  # [Hkv, P, M]
        mask = torch.cat([cached, causal[None].expand(heads_kv, num, num)], dim=2)[:, None]  # [Hkv, 1, P, M+P]
        qg = q.float().reshape(heads_kv, group, num, dim)
        scores = torch.matmul(qg, keys[:, None].transpose(-1, -2)) * dim ** -0.5  # [Hkv, G, P, M+P]
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        self.mass.append(probs.sum(dim=2).mean(dim=1))  # [Hkv, M+P]
        out = torch.matmul(probs, values[:, None])  # [Hkv, G, P, D]
        return out.reshape(heads_q, num, dim).to(q.dtype)


class _QuantizedGraphAttend(_GraphAttend):
    """``_GraphAttend`` over an 8-bit cache's codes, scales and temporal positions (see the module docstring)."""

    def __init__(self, k_codes, k_scale, v_codes, v_scale, tpos, visible, inv_freq: torch.Tensor,
                 temporal_section: int, chunk_tpos: torch.Tensor) -> None:
        super().__init__(k_codes, v_codes, visible)
        self.k_scale, self.v_scale, self.tpos = k_scale, v_scale, tpos
        self.inv_freq, self.temporal_section = inv_freq, temporal_section
        self.chunk_tpos = chunk_tpos  # [P]: the temporal position ids, which the session stores as the slots' tpos

    def chunk(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch path writes the chunk into the 8-bit cache before attending, so the chunk attends to its
        own K/V as stored: keys made time-neutral, quantized and rotated back, values quantized."""
        rope = (self.inv_freq, self.temporal_section)
        delta = self.chunk_tpos.unsqueeze(0).expand(k.shape[0], -1)
        keys = rotate_temporal(_fake_int8(rotate_temporal(k.float(), -delta, *rope)), delta, *rope)
        return keys, _fake_int8(v.float())

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.k_cache[layer].float() * self.k_scale[layer].float().unsqueeze(-1)
        values = self.v_cache[layer].float() * self.v_scale[layer].float().unsqueeze(-1)
        return rotate_temporal(keys, self.tpos[layer], self.inv_freq, self.temporal_section), values


def _fake_int8(x: torch.Tensor) -> torch.Tensor:
    """x as an int8 cache slot holds it: the cache's own ``quantize`` then ``dequantize`` (fp32 in and out)."""
    return dequantize(*quantize(x, torch.int8), torch.float32)


class LLMChunkGraph(nn.Module):
    """The decoder stack over one chunk against a fixed-shape cache (see the module docstring)."""

    def __init__(self, language: Qwen2LM) -> None:
        super().__init__()
        self.language = language

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attend = _GraphAttend(k_cache, v_cache, visible)
        hidden = self.language(embeds, position_ids, attend)
        return hidden, torch.stack(attend.new_k), torch.stack(attend.new_v), torch.stack(attend.mass)


class QuantizedLLMChunkGraph(nn.Module):
    """``LLMChunkGraph`` over an int8 cache: inputs ``LLM_INPUTS_8BIT`` (see the module docstring)."""

    def __init__(self, language: Qwen2LM, inv_freq: torch.Tensor, temporal_section: int) -> None:
        super().__init__()
        self.language = language
        self.register_buffer("inv_freq", inv_freq.to(torch.float32).clone(), persistent=False)
        self.temporal_section = int(temporal_section)

    def forward(self, embeds: torch.Tensor, position_ids: torch.Tensor, k_codes: torch.Tensor, k_scale: torch.Tensor,
                v_codes: torch.Tensor, v_scale: torch.Tensor, tpos: torch.Tensor,
                visible: torch.Tensor) -> tuple[torch.Tensor, ...]:
        attend = _QuantizedGraphAttend(k_codes, k_scale, v_codes, v_scale, tpos, visible, self.inv_freq,
                                       self.temporal_section, position_ids[0])
        hidden = self.language(embeds, position_ids, attend)
        return hidden, torch.stack(attend.new_k), torch.stack(attend.new_v), torch.stack(attend.mass)
