"""The Qwen2 language model of Qwen2.5-VL, with attention delegated to the caller.

Architecture (transformers ``Qwen2_5_VLTextModel``): token embedding -> N x [RMSNorm -> GQA attention
(q/k/v projections WITH bias, o projection without) -> residual -> RMSNorm -> SwiGLU MLP (no bias) ->
residual] -> final RMSNorm -> ``lm_head`` (tied to the embedding in the 3B model). Rotary: M-RoPE
(``rope.py``), applied to q and k before they are handed out.

The layer does not own a KV cache: each layer calls ``attend(layer, q, k, v)`` with the chunk's rotated
queries and keys, and the callee decides what the chunk sees (a capped streaming cache, a dense cache, or
just the chunk itself). Batch size is 1; there is no batch dimension anywhere.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from edgekv.model.config import TextConfig
from edgekv.model.rope import apply_rotary, mrope_cos_sin, rotary_inv_freq


class AttendFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [Hq, P, hd], k, v: [Hkv, P, hd], q and k already rotated. Returns [Hq, P, hd]."""
        ...


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """transformers' ACT2FN entries used by Qwen configs."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu":
        return F.gelu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "relu":
        return F.relu
    raise ValueError(f"hidden_act: unsupported activation {name!r}")


class RMSNorm(nn.Module):
    """``weight * (x / rms(x))``; the normalisation runs in fp32, the scale in the input dtype (as HF)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class GatedMLP(nn.Module):
    """SwiGLU: ``down(act(gate(x)) * up(x))``. No bias in the LM; with bias in the ViT."""

    def __init__(self, dim: int, hidden: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[Hkv, P, hd] -> [Hkv * groups, P, hd]: query head ``i`` reads KV head ``i // groups`` (HF repeat_kv)."""
    if groups == 1:
        return x
    hkv, p, hd = x.shape
    return x[:, None].expand(hkv, groups, p, hd).reshape(hkv * groups, p, hd)


def dense_causal_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """AttendFn for a one-shot call: causal attention over exactly the given tokens (SDPA, GQA)."""
    groups = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q, expand_kv(k, groups), expand_kv(v, groups), is_causal=True)


class DenseKVCache:
    """A minimal preallocated dense cache (AttendFn) for one-shot greedy generation and parity tests.

    k, v: [layers, Hkv, capacity, hd]. A chunk of P tokens at offset ``length`` sees every earlier token and
    itself causally. The streaming runtime uses ``edgekv.cache`` instead; this is the exact reference.
    """

    def __init__(self, config: TextConfig, capacity: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        shape = (config.num_hidden_layers, config.num_key_value_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # k: [L, Hkv, M, hd]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # v: [L, Hkv, M, hd]
        self.capacity = capacity
        self.length = 0
        self._pending = 0

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = q.shape[1]
        start = self.length
        if start + p > self.capacity:
            raise RuntimeError(f"DenseKVCache: {start + p} tokens exceed capacity {self.capacity}")
        self.k[layer, :, start:start + p] = k
        self.v[layer, :, start:start + p] = v
        self._pending = p
        keys, values = self.k[layer, :, :start + p], self.v[layer, :, :start + p]  # [Hkv, start + P, hd]
        groups = q.shape[0] // k.shape[0]
        # Query i (absolute start + i) sees keys 0 .. start + i.
        mask = torch.ones(p, start + p, dtype=torch.bool, device=q.device).tril(diagonal=start)
        return F.scaled_dot_product_attention(q, expand_kv(keys, groups), expand_kv(values, groups), attn_mask=mask)

    def commit(self) -> None:
        """Advance past the chunk that every layer just wrote (call once per forward)."""
        self.length += self._pending
        self._pending = 0


class Attention(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                attend: AttendFn) -> torch.Tensor:
        """x [P, d] (inference) or [B, P, d] (training, ``edgekv.toy.train``); cos/sin broadcast against
        [..., H, P, hd]. The attend function gets and returns the same leading dims."""
        *lead, p, _ = x.shape
        q = self.q_proj(x).view(*lead, p, self.num_heads, self.head_dim).transpose(-3, -2)  # q: [..., Hq, P, hd]
        k = self.k_proj(x).view(*lead, p, self.num_kv_heads, self.head_dim).transpose(-3, -2)  # k: [..., Hkv, P, hd]
        v = self.v_proj(x).view(*lead, p, self.num_kv_heads, self.head_dim).transpose(-3, -2)  # v: [..., Hkv, P, hd]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attend(layer, q, k, v)  # [..., Hq, P, hd]
        return self.o_proj(out.transpose(-3, -2).reshape(*lead, p, self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    # Set by edgekv.model.decode_routes.prepare_decode (the native route of a 4-bit model): the whole layer in C
    # around its attention, called as fused(self, x, cos, sin, layer, attend); it returns None where it does not
    # apply (training, long chunks, other dtypes) and the layer runs as written below.
    fused = None

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: int,
                attend: AttendFn) -> torch.Tensor:
        if self.fused is not None:
            out = self.fused(self, x, cos, sin, layer, attend)
            if out is not None:
                return out
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2LM(nn.Module):
    """Qwen2 decoder over ``inputs_embeds [P, d]`` with 3-row M-RoPE ``position_ids [3, P]``."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        # A checkpoint is loaded into a model built on the meta device, where nn.Embedding's normal_ init runs
        # torch's Python reference, whose first call imports torch._dynamo: 1.4 s of every start-up, for nothing.
        weight = torch.empty(config.vocab_size, config.hidden_size)
        if not weight.is_meta:
            nn.init.normal_(weight)  # what nn.Embedding draws itself (the same values for the same seed)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # fp32 whatever the weight dtype (HF computes rotary angles in fp32); a plain attribute, not a
        # buffer, so .to(bfloat16) cannot round it. Moved to the positions' device on first use.
        self._inv_freq = rotary_inv_freq(config.head_dim, config.rope_theta, device="cpu")

    @property
    def inv_freq(self) -> torch.Tensor:
        return self._inv_freq

    def rotary(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [P, hd] fp32 for position_ids [3, P]."""
        if self._inv_freq.device != position_ids.device:
            self._inv_freq = self._inv_freq.to(position_ids.device)
        return mrope_cos_sin(self._inv_freq, position_ids, self.config.mrope_section)

    def forward(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """inputs_embeds [P, d], position_ids [3, P] -> final-normed hidden [P, d]."""
        if inputs_embeds.dim() != 2 or position_ids.shape != (3, inputs_embeds.shape[0]):
            raise ValueError(f"expected inputs_embeds [P, d] and position_ids [3, P], got "
                             f"{tuple(inputs_embeds.shape)} and {tuple(position_ids.shape)}")
        cos, sin = self.rotary(position_ids)
        cos, sin = cos.to(inputs_embeds.dtype), sin.to(inputs_embeds.dtype)  # HF casts once to the hidden dtype
        return self.run_layers(inputs_embeds, cos, sin, attend)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: AttendFn) -> torch.Tensor:
        """The decoder stack and the final norm over ``x [P, d]`` with ``cos, sin [P, hd]`` already in x's dtype
        (the part of ``forward`` a CUDA graph of a frame pair captures: edgekv/session/pair_graph.py)."""
        for index, layer in enumerate(self.layers):
            x = layer(x, cos, sin, index, attend)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., d] -> logits [..., V] in the weight dtype."""
        return self.lm_head(hidden)
