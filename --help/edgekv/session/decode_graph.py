"""One decode step of the language model over the capped cache at static shapes: on CUDA, one graph replay.

Why this works here and not in a growing cache: the capped cache is allocated once and never moves
(DESIGN invariant 1), so every address a decode step touches — the weights, ``cache.k`` / ``cache.v`` and
the small input buffers below — is fixed for the life of a session. A step captured once as a CUDA graph
replays for every later answer token of every later question; the host launches one graph instead of the
~1,500 kernels of a 36-layer step (issue 32).

What changes from step to step lives in device buffers the graph reads, never in Python values:

    token     [1] int64   the token fed in (the embedding row it looks up)
    position  [1] int64   its text position (M-RoPE rows t = h = w for text: one 1-D rotary angle)
    slot      [1] int64   the cache slot its K/V go to (= cache.length before the step)

The step writes the new key and value of every layer at ``slot`` (``index_copy_``) and attends over the
slots ``[0, slot]`` — the keys the eager path (``edgekv.attention.CacheAttention``, one query) attends to —
at a fixed launch shape: where Triton runs, with ``edgekv.kernels.decode_attention`` (split over the keys,
the visible count read from the device; it reads only the visible slots); elsewhere with SDPA over all ``M``
slots and an additive mask row, 0 for slots ``<= slot`` and -inf beyond (it reads all ``M``: 226 MB a token at
M = 6144 for the 3B model, nothing extra in the steady state of a stream, where a question meets a full cache).
On the first H200 run the masked SDPA took half of a 3B token (issue 32); the split kernel is why. Where Triton
runs, the layers' small work is fused too (``edgekv.kernels.decode_fused``, q/k/v packed into one product and
gate/up into another: 10 launches a layer); a 4-bit model's projections (``Int4Linear``) keep their own products
(the Triton 4-bit GEMV, two launches each) inside the same fused step. The graph then picks the greedy next
token (``argmax``) and advances its own inputs — token, position and slot — so a greedy chain needs no host
write between replays; a sampled token is written back with :meth:`DecodeGraph.feed`.

Metadata (``cache.kind`` / ``tpos`` ...) is not written for the decoded slots: they are an answer's, read by
no policy, and the answerer truncates them when the answer ends (``CappedKVCache.truncate`` clears their
metadata). An 8-bit cache has no graph here (its writes quantize per slot and read ``tpos``).

Rotary: a text token's three M-RoPE rows are equal, so ``cos/sin = f(position * inv_freq)`` exactly as
``edgekv.model.rope.mrope_cos_sin`` computes them for equal rows (the same fp32 products). On the CPU (or
``capture=False``) the same static step runs eagerly: that is what the CPU tests check against the eager
path, and the CUDA tests check the replay against it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from edgekv.cache.capped import CappedKVCache
from edgekv.kernels._triton import use_triton
from edgekv.kernels.decode_attention import decode_attention_triton
from edgekv.kernels.decode_fused import add_rms_norm, rope_write, silu_mul
from edgekv.model.language import Qwen2LM
from edgekv.model.packing import pack_projections, packed_attention, packed_mlp, product, projection_kind
from edgekv.model.prefill_fused import FusedChunkLayer
from edgekv.session.pair_graph import graph_capture


def fusable(language: Qwen2LM, cache: CappedKVCache) -> str | None:
    """Why the fused decode step cannot run this model, or None when it can: the plain Qwen2 layers (torch
    linears or 4-bit ``Int4Linear`` projections, SiLU, no replaced or fused forward), a 16/32-bit dtype and a
    power-of-two head_dim."""
    dtype = next(language.parameters()).dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.float16) or cache.dtype != dtype:
        return f"the model ({dtype}) and the cache ({cache.dtype}) must share a 16/32-bit float dtype"
    head_dim = language.config.head_dim
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} is not a power of two"
    for index, layer in enumerate(language.layers):
        linears = (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
                   layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)
        if any(projection_kind(linear) is None for linear in linears):
            return f"layer {index} has a replaced projection (neither a torch linear nor a 4-bit one)"
        if layer.mlp.act is not F.silu or not (layer.fused is None or isinstance(layer.fused, FusedChunkLayer)):
            return f"layer {index} is not the plain SiLU layer"
    return None


class DecodeGraph:
    """Decode steps over ``cache`` at static shapes; captured as a CUDA graph when ``capture`` (default: on CUDA).

    ``compile``: run the step through ``torch.compile`` before capturing it (fuses the pointwise work between
    the matrix products; costs a compilation at construction). ``split_attention``: the Triton decode-attention
    kernel (default where Triton runs) or SDPA over all slots with a mask row (``False``). ``fused``: the layers'
    small work in three Triton kernels (default where the split attention runs and :func:`fusable` allows).
    """

    def __init__(self, language: Qwen2LM, cache: CappedKVCache, capture: bool | None = None, compile: bool = False,
                 warmup: int = 2, split_attention: bool | None = None, fused: bool | None = None) -> None:
        if cache.quantized:
            raise ValueError(f"DecodeGraph needs a 16/32-bit cache; this one stores {cache.dtype} codes")
        if cache.length >= cache.capacity:
            raise ValueError(f"DecodeGraph: the cache is full ({cache.length} of {cache.capacity} slots); a decode "
                             "step needs one free slot")
        self.language = language
        self.cache = cache
        self.device = cache.device
        self.capture = graph_capture(language, cache, capture)
        text = language.config
        self.groups = text.num_attention_heads // text.num_key_value_heads
        # token, position, slot: one buffer, so that feeding a step is one host-to-device copy
        self._inputs = torch.zeros(3, dtype=torch.long, device=self.device)
        self.token, self.position, self.slot = self._inputs[0:1], self._inputs[1:2], self._inputs[2:3]
        self._host = torch.zeros(3, dtype=torch.long, pin_memory=self.capture)
        self._slots = torch.arange(cache.capacity, device=self.device)
        self._inv_freq = language.inv_freq.to(device=self.device, dtype=torch.float32)
        # Attention: the split Triton kernel where Triton runs (CUDA, or its interpreter), else SDPA over all M
        # slots with a mask row (edgekv/kernels/decode_attention.py says why the split matters on a GPU)
        self.split_attention = use_triton(self._slots, cache.k) if split_attention is None else split_attention
        # The layers' small work in three Triton kernels (edgekv/kernels/decode_fused.py), where Triton runs and the
        # layers are the plain Qwen2 ones (torch linears, SiLU); else each layer's own forward
        eligible = fusable(language, cache)
        if fused and not (self.split_attention and eligible is None):
            raise ValueError(f"fused decode step: {eligible or 'needs the split attention kernel (Triton)'}")
        # (a compiled step fuses the layers' own ops: by default it keeps them)
        self.fused = (not compile and self.split_attention and eligible is None) if fused is None else fused
        if self.fused:
            pack_projections(language)
        self._step = torch.compile(self._forward, dynamic=False) if compile else self._forward
        self.logits: torch.Tensor | None = None  # [V] the last step's logits (a static buffer when captured)
        self.next_token: torch.Tensor | None = None  # [1] its argmax
        self.graph = None
        if self.capture:
            self._capture(warmup)

    # ------------------------------------------------------------------------------------------------ the step
    def _attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """q [Hq, 1, D], k, v [Hkv, 1, D] -> [Hq, 1, D]: write at ``slot``, attend over slots [0, slot]."""
        cache = self.cache
        cache.k[layer].index_copy_(1, self.slot, k.to(cache.dtype))
        cache.v[layer].index_copy_(1, self.slot, v.to(cache.dtype))
        heads_q, _, dim = q.shape
        keys, values = cache.k[layer], cache.v[layer]  # [Hkv, M, D]
        if self.split_attention:  # Triton, split over the keys; reads only the visible slots
            return decode_attention_triton(q, keys, values, visible)
        folded = q.reshape(1, keys.shape[0], self.groups, dim)  # the G query heads of each KV head as G queries
        out = F.scaled_dot_product_attention(folded, keys.unsqueeze(0).to(q.dtype), values.unsqueeze(0).to(q.dtype),
                                             attn_mask=bias)
        return out.reshape(heads_q, 1, dim)

    def _forward(self) -> tuple[torch.Tensor, torch.Tensor]:
        language = self.language
        x = language.embed_tokens(self.token)  # [1, d]
        angle = self.position.float()[:, None] * self._inv_freq[None]  # [1, D/2] fp32, as mrope_cos_sin
        angle = torch.cat((angle, angle), dim=-1)
        cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
        visible = self.slot + 1  # [1] slots [0, slot] are seen
        bias = None
        if not self.split_attention:
            bias = torch.zeros(self.cache.capacity, dtype=x.dtype, device=self.device)
            bias = bias.masked_fill(self._slots > self.slot, float("-inf")).view(1, 1, 1, -1)  # [1, 1, 1, M]

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return self._attend(layer, q, k, v, bias, visible)

        if self.fused:
            hidden = self._fused_layers(x, cos[0], sin[0], visible)
        else:
            for index, layer in enumerate(language.layers):
                x = layer(x, cos, sin, index, attend)
            hidden = language.norm(x)
        logits = language.logits(hidden)[0]  # [V]
        return logits, logits.argmax().view(1)

    def _fused_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      visible: torch.Tensor) -> torch.Tensor:
        """The decoder stack with its small work fused: 11 launches a layer (edgekv/kernels/decode_fused.py).
        x [1, d] -> the final-normed hidden [1, d]; the same roundings as the layers' own forward."""
        language, cache = self.language, self.cache
        layers = language.layers
        first = layers[0].input_layernorm
        x, h = add_rms_norm(x.contiguous(), None, first.weight, first.eps)
        for index, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            if packed_attention(attn):  # one product for q, k and v (pack_projections)
                sizes = [attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0], attn.v_proj.weight.shape[0]]
                q, k, v = F.linear(h, attn.qkv_weight, attn.qkv_bias).split(sizes, dim=-1)
            else:  # torch linears or 4-bit ones (Int4Linear: the Triton 4-bit GEMV)
                q, k, v = product(attn.q_proj, h), product(attn.k_proj, h), product(attn.v_proj, h)
            q = rope_write(q, k, v, cos, sin, cache.k[index], cache.v[index], self.slot)  # [Hq, 1, D]
            out = decode_attention_triton(q, cache.k[index], cache.v[index], visible)
            out = product(attn.o_proj, out.reshape(1, -1))
            norm = layer.post_attention_layernorm
            x, h = add_rms_norm(x, out, norm.weight, norm.eps)
            if packed_mlp(mlp):  # one product for gate and up (pack_projections)
                gate, up = F.linear(h, mlp.gate_up_weight).split(mlp.gate_proj.weight.shape[0], dim=-1)
            else:
                gate, up = product(mlp.gate_proj, h), product(mlp.up_proj, h)
            gated = silu_mul(gate, up)
            norm = layers[index + 1].input_layernorm if index + 1 < len(layers) else language.norm
            x, h = add_rms_norm(x, product(mlp.down_proj, gated), norm.weight, norm.eps)
        return h

    def _advance(self, next_token: torch.Tensor) -> None:
        """In the graph: the greedy token becomes the next input; position and slot move on by one."""
        self.token.copy_(next_token)
        self.position.add_(1)
        self.slot.add_(1)

    def _capture(self, warmup: int) -> None:
        # Warm-up and capture write a key and value at the free slot cache.length; the first real step overwrites it.
        self._host.copy_(torch.tensor([0, 0, self.cache.length]))
        self._inputs.copy_(self._host)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), torch.inference_mode():
            for _ in range(max(1, warmup)):  # lazy initialisations (cuBLAS handles, compilation) happen here
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.logits, self.next_token = self._step()
            self._advance(self.next_token)

    # ------------------------------------------------------------------------------------------------ use
    def feed(self, token: int, position: int) -> None:
        """Set the next step's input token and text position; its slot is the cache's next free one."""
        self._host[0], self._host[1], self._host[2] = token, position, self.cache.length
        self._inputs.copy_(self._host)

    def step(self) -> torch.Tensor:
        """Run one step on the fed (or, after a step, the greedy) inputs; commit its slot; return its logits [V].

        After ``step`` the inputs hold the greedy continuation (the argmax token, position + 1, slot + 1):
        call ``step`` again to continue greedily, or ``feed`` another token first."""
        if self.cache.length >= self.cache.capacity:
            raise ValueError(f"the cache is full ({self.cache.length} of {self.cache.capacity} slots)")
        with torch.inference_mode():
            if self.graph is not None:
                self.graph.replay()
            else:
                self.logits, self.next_token = self._step()
                self._advance(self.next_token)
        self.cache.commit(1)
        return self.logits
