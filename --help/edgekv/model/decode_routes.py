"""How the language model's weights are read during decode (issue 17, "decode near the bound").

One decode token is a chain of matrix-vector products: every weight is read once, so on a CPU the step
is bound by memory bandwidth when the kernel keeps up with memory. ``prepare_decode(language, route)``
changes how the model's linear layers read their weights, in place (``model.decode_route`` in the
config; ``resolve_route`` picks for ``auto``). Routes measured on the 2-core x86 machine (1 thread, a
2048 -> 11008 projection; read bandwidth of a streaming fp32 sum 17.7 GB/s):

* ``eager`` — torch's kernels on the weights as loaded. fp32: MKL's sgemv streams at 15.9 GB/s (~90 % of
  the read bandwidth); a pre-transposed contiguous copy reached 17.3 GB/s (+8 %, at the price of a second
  weight layout). bf16 / fp16: torch converts as it goes, 8.6 / 10.0 GB/s.
* ``native`` (bf16 only; ``auto`` picks it for bf16 on CPU when a C compiler is there) — one-row bf16
  products go to ``edgekv.kernels.cpu_gemv``, a C kernel built at first use that widens eight bf16
  weights per AVX2 instruction (a 16-bit shift), multiplies and sums in fp32 and rounds once; the same
  weights in place, no second layout. Every other product (ingest, question prefill, fp32 / fp16) stays
  on torch. Its figures are in the README's "Speed on CPU" and the issue-17 note.
* ``native`` with 4-bit weights (issue 29; ``auto`` picks it for a 4-bit model on CPU, any activation dtype) —
  every ``Int4Linear`` becomes a ``NativeInt4Linear``: its weights repacked once into the C kernel's tiles
  (``edgekv.kernels.cpu_gemv``: same bytes, the AWQ words dropped); decode steps and chunks of up to
  ``ROW_KERNEL_ROWS`` rows (bf16: 128 — a frame pair at 112² or 224², a question) through the integer
  kernel, each row exactly what it gets alone (fp32 out, rounded once to the activations' dtype), every
  weight block read once for all the rows; longer chunks through the C dequantizer into a kept fp32 buffer
  then torch's fp32 GEMM, rounded once to the activations' dtype (a 3B 64-token chunk in bf16 on one
  thread: 44 s with the weight dequantized to bf16 and torch's bf16 GEMM, 9.8 s so; 5.4 s through the
  kernel). The bf16 ``lm_head`` of a bf16 model takes the bf16 kernel as above. Figures: README "4-bit weights", "CPU decode speed".
* ``native`` with 4-bit weights and bf16 activations, the layers fused (issue 29) — a decoder layer whose seven
  products are ``NativeInt4Linear``s runs as two C calls around its attention (``FusedInt4Layer``: norm, q/k/v
  products and rotary; then the o product, residual, norm, SwiGLU MLP and residual), for up to
  ``ROW_KERNEL_ROWS`` rows with autograd off. The same products and roundings as the layer run module by module
  (up to rounding ties: the norms' means summed in double, SiLU's exp libm's); what it removes is ~900 small
  torch operations and 252 product calls a 3B token made from Python (~25 ms of ~165 on one core). Figures:
  README "CPU decode speed".
* ``model.lm_head: int8`` (issue 29; opt-in, any route, applied before it: ``quantize_lm_head``) — the head as
  int8 with an fp32 scale per row and 128 inputs, the tied embedding reading the same table (``Int8Head``,
  ``Int8Embedding``); its C kernel (``edgekv_gemm_q8``) reads the activations as 15-bit fixed point per group:
  the 3B head in 19.5-21 ms on one thread against 37 ms in bf16. Figures and what it changes: README "4-bit
  weights".
* measured and not kept: a ``torch.compile``d multiply-and-reduce in the weight's dtype with fp32
  accumulation (bf16 9.6 GB/s, fp16 11.3, fp32 14.5 on the one projection, but inside the model every
  weight shape recompiled past dynamo's limit and decode got slower); a blocked bf16 -> fp32 upcast
  into a cache-sized buffer then sgemv (3.2-4.4 GB/s: the conversion itself runs at ~5 GB/s on AVX2);
  weight-only int8 through ``torch.ops.aten._weight_int8pack_mm`` (4.2 ms with bf16 activations vs
  5.2 ms for the bf16 product — 1.24x, but 5.3 GB/s of int8 weights is 30 % of the int8 bound, and it
  changes the numbers; 35 ms with fp32 or fp16 activations).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from edgekv.hostmem import trim, weight_empty
from edgekv.model.int4 import Int4Linear, apply_keeping_scales, is_quantized, unpack_awq

ROUTES = ("eager", "native")
_REPACK_ROWS = 256  # rows of a 4-bit weight unpacked at a time by the repack (a multiple of the tiles' 4)
# Chunks of up to this many rows go through the 4-bit kernel, longer ones dequantize the weight for torch's fp32
# GEMM; by activation dtype, as the kernel's cost per row grows with the activation digits (bf16 2, fp16 3, fp32
# 4). One thread on the 2-core x86 VM, six 2048 -> 11008 weights read from memory in turn, the multi-row kernel
# (``Int4Product``) against ``dequant_int4`` into a kept buffer + ``F.linear`` in fp32, best of 3, ms per weight:
# bf16 16 rows 9.4 vs 42.1, 64 rows 36.9 vs 66.6, 128 rows 83.3 vs 101.7, 256 rows 150.8 vs 160.0; fp16 32 rows
# 37.5 vs 52.4, 64 rows 73.4 vs 68.7; fp32 32 rows 48.7 vs 55.1, 64 rows 94.1 vs 76.3. The kernel's time grows
# with the rows; the GEMM path's is mostly the dequantization, which does not.
ROW_KERNEL_ROWS = {torch.bfloat16: 128, torch.float16: 48, torch.float32: 32}


class NativeDecodeLinear(nn.Module):
    """A ``nn.Linear``'s weight and bias (the same parameters, so ties and loading are unchanged) whose
    one-row bf16 CPU products without autograd go to the C kernel; every other call to ``F.linear``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (x.numel() == self.in_features and x.dtype is torch.bfloat16 and weight.dtype is torch.bfloat16
                and x.device.type == "cpu" and weight.is_contiguous()
                and not (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))):
            from edgekv.kernels.cpu_gemv import gemv_bf16

            bias = None if self.bias is None else self.bias.detach()
            out = gemv_bf16(weight.detach(), x.detach(), bias, threads=torch.get_num_threads())
            return out.view(*x.shape[:-1], self.out_features)
        return F.linear(x, weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NativeInt4Linear(nn.Module):
    """An ``Int4Linear`` repacked for the CPU kernel (the same bias parameter; the weights as tiles).

    ``tiles`` uint8 [N/16, K/4, 32], ``zeros`` uint8 [K/g, N], ``scales`` float16 [K/g, N] (the module's own)."""

    def __init__(self, linear: Int4Linear) -> None:
        super().__init__()
        from edgekv.kernels.cpu_gemv import TILE_COLUMNS, TILE_ROWS, int4_tiles

        k, n = linear.in_features, linear.out_features
        tiles = weight_empty((n // TILE_COLUMNS, k // TILE_ROWS, 32), torch.uint8)
        # a block of rows at a time: unpacking a whole 3B MLP weight at once held ~180 MB of int32 temporaries
        for row in range(0, k, _REPACK_ROWS):
            q = unpack_awq(linear.qweight[row:row + _REPACK_ROWS])
            tiles[:, row // TILE_ROWS:(row + q.shape[0]) // TILE_ROWS] = int4_tiles(q)
        self.register_buffer("tiles", tiles)
        self.register_buffer("zeros", unpack_awq(linear.qzeros).contiguous())
        self.register_buffer("scales", linear.scales)
        self.bias = linear.bias
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, linear.group_size
        self._product = None  # kernels.cpu_gemv.Int4Product, made at the first one-row product

    def _apply(self, fn, recurse=True):  # .to() / .half() may move or replace the buffers: check them again
        self._product = None
        return apply_keeping_scales(self, super()._apply, fn, recurse)

    def integers(self) -> tuple[torch.Tensor, torch.Tensor]:
        from edgekv.kernels.cpu_gemv import int4_untile

        return int4_untile(self.tiles), self.zeros

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        from edgekv.kernels.cpu_gemv import dequant_int4

        return dequant_int4(self.tiles, self.scales, self.zeros, dtype)

    def product(self):
        """The ``Int4Product`` over this module's buffers (made at first use, again after ``.to()``)."""
        if self._product is None:
            from edgekv.kernels.cpu_gemv import Int4Product

            self._product = Int4Product(self.tiles, self.scales, self.zeros, self.bias)
        return self._product

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from edgekv.kernels.cpu_gemv import dequant_int4

        if x.numel() <= ROW_KERNEL_ROWS.get(x.dtype, 1) * self.in_features \
                and not (torch.is_grad_enabled() and x.requires_grad):
            try:
                out = self.product()(x.detach(), torch.get_num_threads())
            except ValueError:  # an inf / nan activation: torch's product below propagates it as torch does
                pass
            else:
                return out.view(*x.shape[:-1], self.out_features)
        # a long chunk: dequantize-then-matmul, in fp32 whatever the activations' dtype, rounded once at the end
        weight = dequant_int4(self.tiles, self.scales, self.zeros, torch.float32, threads=torch.get_num_threads(),
                              out=_chunk_weight(self.out_features, self.in_features))
        bias = None if self.bias is None else self.bias.detach().to(torch.float32)
        return F.linear(x.to(torch.float32), weight, bias).to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits=4, "
                f"group_size={self.group_size}, bias={self.bias is not None}")


class FusedInt4Layer:
    """A decoder layer whose seven products are ``NativeInt4Linear``s, run as two C calls around its attention
    (``edgekv.kernels.cpu_gemv.Int4Layer``) for bf16 activations of up to ``ROW_KERNEL_ROWS`` rows with autograd
    off — a decode token, a frame pair, a question; anything else (training, fp32 / fp16 activations, long chunks)
    gets None and runs the layer as written. The numbers are the unfused native route's up to rounding ties: the
    norms' means are summed in double in C (torch: fp32 partial sums) and SiLU's exp is libm's, last-bit differences
    in fp32 that move a bf16 value only on a tie — after which the layers that follow carry the change (a 16-row
    chunk of the random 3B model: one tie in layer 19 of 36, the final states then differ; 16-token decodes gave
    the same tokens). An inf / nan activation runs the layer unfused (before the attention) or the rest of it in
    torch (after), so it propagates as torch propagates it. The kernel is rebuilt when a product or a norm weight
    was replaced (``.to()``)."""

    def __init__(self) -> None:
        self._kernel = None
        self._key = None

    def _kernel_for(self, layer: nn.Module):
        from edgekv.kernels.cpu_gemv import Int4Layer

        attn, mlp = layer.self_attn, layer.mlp
        products = tuple(m.product() for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj,
                                                mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        key = (products, *(w.data_ptr() for w in norms), *(w.dtype for w in norms))
        if key != self._key:
            self._kernel = None
            if all(w.dtype is torch.bfloat16 for w in norms):
                self._kernel = Int4Layer(dict(zip(("q", "k", "v", "o", "gate", "up", "down"), products)), *norms,
                                         layer.input_layernorm.eps, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            self._key = key
        return self._kernel

    def __call__(self, layer: nn.Module, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, index: int,
                 attend) -> torch.Tensor | None:
        if (x.dtype is not torch.bfloat16 or x.dim() != 2 or x.shape[0] > ROW_KERNEL_ROWS[torch.bfloat16]
                or cos.dtype is not torch.bfloat16 or (torch.is_grad_enabled() and x.requires_grad)):
            return None
        kernel = self._kernel_for(layer)
        if kernel is None:
            return None
        threads = torch.get_num_threads()
        x = x.contiguous()
        rows = x.shape[0]
        try:
            q, k, v = kernel.pre(x, cos.contiguous(), sin.contiguous(), threads)
        except ValueError:  # an inf / nan activation: the layer as written propagates it
            return None
        attn = layer.self_attn
        out = attend(index, q.view(rows, attn.num_heads, attn.head_dim).transpose(0, 1),
                     k.view(rows, attn.num_kv_heads, attn.head_dim).transpose(0, 1),
                     v.view(rows, attn.num_kv_heads, attn.head_dim).transpose(0, 1))  # [Hq, P, hd]
        a = out.transpose(0, 1).reshape(rows, attn.num_heads * attn.head_dim).contiguous()
        try:
            return kernel.post(x, a, threads)
        except ValueError:  # the attention's output holds an inf / nan: the rest of the layer in torch
            x = x + attn.o_proj(a)
            return x + layer.mlp(layer.post_attention_layernorm(x))


_scratch = threading.local()


def _chunk_weight(n: int, k: int) -> torch.Tensor:
    """An fp32 [n, k] buffer for a chunk's dequantized weight, one per thread, grown to the largest linear and
    kept: a fresh 90 MB tensor for every 2048 -> 11008 product of a 3B prefill cost ~70 ms of first-touch page
    faults, more than the product itself (the allocator hands buffers this large back to the OS at once)."""
    buffer = getattr(_scratch, "weight", None)
    if buffer is None or buffer.numel() < n * k:
        _scratch.weight = buffer = torch.empty(n * k, dtype=torch.float32)
    return buffer[: n * k].view(n, k)


class Int8Head(nn.Module):
    """The ``lm_head`` with int8 weights (``model.lm_head: int8``; issue 29): per row and group of 128 inputs (or
    the largest of 64, 32, 16 that divides a smaller model's width) an
    fp32 scale (``kernels.cpu_gemv.q8_quantize``: symmetric, largest |w| / 127). On CPU the products go to the
    int8 C kernel (activations as 15-bit fixed point per group, fp32 out, rounded once to the activations'
    dtype); elsewhere, or for an inf / nan activation, the weight is dequantized 16384 rows at a time for
    torch's product in fp32 (no whole fp32 copy). Opt-in: it changes the logits (README "4-bit weights").

    At 3B the head is the tied embedding, 151936 x 2048: 622 MB in bf16, a third of what a 4-bit decode token
    reads, 311 MB (+ 9.7 MB of scales) in int8."""

    _BLOCK_ROWS = 16384

    def __init__(self, weight: torch.Tensor, group: int | None = None) -> None:
        super().__init__()
        from edgekv.kernels.cpu_gemv import Q8_GROUP, q8_quantize

        group = Q8_GROUP if group is None else group
        tiles, scales = q8_quantize(weight, group)
        self.register_buffer("tiles", tiles.to(weight.device))
        self.register_buffer("scales", scales.to(weight.device))
        self.out_features, self.in_features = weight.shape
        self.group_size = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from edgekv.kernels.cpu_gemv import gemm_q8, q8_dequant

        rows = x.reshape(-1, self.in_features)
        if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
            try:
                out = gemm_q8(self.tiles, self.scales, rows, torch.get_num_threads())
            except ValueError:  # an inf / nan activation: torch's product below propagates it as torch does
                pass
            else:
                return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32, device=x.device)
        rows32, step = rows.to(torch.float32), self._BLOCK_ROWS
        for row in range(0, self.out_features, step):
            weight = q8_dequant(self.tiles[row // 8:(row + step) // 8], self.scales[:, row:row + step])
            out[:, row:row + step] = rows32 @ weight.T
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=8, group_size={self.group_size}"


class Int8Embedding(nn.Module):
    """The tied embedding read from an ``Int8Head``'s int8 rows (the same tensors: the table is held once), in
    ``dtype``: a lookup is w8 * scale per group, rounded once to ``dtype``."""

    def __init__(self, head: Int8Head, dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("tiles", head.tiles)
        self.register_buffer("scales", head.scales)
        self.num_embeddings, self.embedding_dim, self.group_size = head.out_features, head.in_features, head.group_size
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from edgekv.kernels.cpu_gemv import q8_rows

        if ids.numel():  # a negative id would index from the end: refused, as nn.Embedding refuses it
            low, high = (int(v) for v in ids.aminmax())
            if low < 0 or high >= self.num_embeddings:
                raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {low}..{high}")
        groups = self.embedding_dim // self.group_size
        values = q8_rows(self.tiles, ids).to(torch.float32).view(*ids.shape, groups, self.group_size)
        values = values * self.scales.T[ids][..., None]
        return values.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits=8, group_size={self.group_size}"


LM_HEADS = ("as_loaded", "int8")


def int8_head_group(in_features: int) -> int | None:
    """The int8 head's group size for ``in_features`` inputs: 128 (the 3B), else the largest of 64, 32, 16 that
    divides it (the toy's 64 inputs: 64); None when none does. ``edgekv plan`` counts the scales with it."""
    return next((g for g in (128, 64, 32, 16) if in_features % g == 0), None)


def quantize_lm_head(language: nn.Module, head: str) -> dict:
    """``model.lm_head`` (issue 29): ``int8`` replaces ``language.lm_head`` (a ``Qwen2LM``'s) with an
    ``Int8Head`` and, when the embedding is tied to it, the embedding with an ``Int8Embedding`` on the same
    int8 table, so the float table is freed (at 3B in bf16: 622 MB -> 321 MB). ``as_loaded`` changes nothing.
    Returns what the runtime and the bench record; ValueError naming what cannot be served."""
    if head not in LM_HEADS:
        raise ValueError(f"model.lm_head: unknown value {head!r} (known: {', '.join(LM_HEADS)})")
    if head == "as_loaded":
        return {"lm_head": head}
    current = language.lm_head
    if isinstance(current, Int8Head):
        return {"lm_head": head, "tied": isinstance(language.embed_tokens, Int8Embedding)}
    weight = current.weight
    from edgekv.kernels.cpu_gemv import Q8_TILE_ROWS

    n, k = weight.shape
    group = int8_head_group(k)
    if n % Q8_TILE_ROWS or group is None:
        raise ValueError(f"model.lm_head: int8: a [{n}, {k}] head needs out_features % {Q8_TILE_ROWS} == 0 and "
                         f"in_features % 16 == 0")
    if weight.device.type == "cpu":
        from edgekv.kernels.cpu_gemv import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise ValueError(f"model.lm_head: int8: the int8 CPU kernel is unavailable ({reason})")
    tied = language.embed_tokens.weight is weight
    dtype = weight.dtype
    language.lm_head = quantized = Int8Head(weight, group)
    if tied:
        language.embed_tokens = Int8Embedding(quantized, dtype)
    del current, weight
    trim()
    return {"lm_head": head, "tied": tied}


def native_unavailable(dtype: torch.dtype, device: torch.device | str, quantized: bool = False) -> str | None:
    """Why the ``native`` route cannot serve this model, or None when it can (``quantized``: 4-bit weights,
    which the route serves with any activation dtype)."""
    if quantized:
        if torch.device(device).type != "cpu":
            return f"the native decode route is for CPU weights (device {device})"
        from edgekv.kernels.cpu_gemv import unavailable_reason

        return unavailable_reason()
    if dtype is not torch.bfloat16:
        return f"the native decode route is bf16 only (model dtype {str(dtype).removeprefix('torch.')})"
    if torch.device(device).type != "cpu":
        return f"the native decode route is for CPU weights (device {device})"
    from edgekv.kernels.cpu_gemv import unavailable_reason

    return unavailable_reason()


def resolve_route(route: str, dtype: torch.dtype, device: torch.device | str,
                  quantized: bool = False) -> tuple[str, str | None]:
    """(route to apply, why ``auto`` did not pick ``native`` or None). ``native`` that cannot serve this
    model raises ValueError with the reason."""
    if route not in (*ROUTES, "auto", "graph"):
        raise ValueError(f"model.decode_route: unknown route {route!r} (known: auto, {', '.join(ROUTES)}, graph)")
    if route == "eager":
        return "eager", None
    # "graph" (the session's CUDA graph of a decode step, edgekv/session/decode_graph.py) leaves the weights as
    # loaded: prepare_decode applies it as "eager"
    cuda = torch.device(device).type == "cuda"
    if route == "graph" and not cuda:
        raise ValueError(f"model.decode_route: graph: a CUDA graph needs a CUDA device (device {device})")
    if route == "graph" or (route == "auto" and cuda and not quantized):
        return "graph", None
    reason = native_unavailable(dtype, device, quantized)
    if route == "native" and reason:
        raise ValueError(f"model.decode_route: native: {reason}")
    return ("eager", reason) if reason else ("native", None)


def prepare_decode(language: nn.Module, route: str) -> dict:
    """Apply ``route`` to ``language`` (a ``Qwen2LM``) in place; returns what the bench records."""
    if route not in ROUTES:
        raise ValueError(f"decode route: unknown route {route!r} (known: {', '.join(ROUTES)})")
    if route == "eager":
        return {"route": route}
    from edgekv.kernels.cpu_gemv import int4_kernel_fits, int4_simd, simd

    weight = language.norm.weight  # the model's dtype and device (the embedding may be int8: quantize_lm_head)
    quantized = is_quantized(language)
    reason = native_unavailable(weight.dtype, weight.device, quantized)
    if reason:
        raise ValueError(f"decode route native: {reason}")
    replaced = packed = 0
    # (parent, name) pairs, not the children: a list holding the 4-bit modules would keep every one's AWQ words
    # alive until the last was repacked — the whole model's 4-bit weights twice (+1.4 GiB at 3B; issue 29)
    slots = [(module, name) for module in language.modules() for name, child in module.named_children()
             if type(child) in (nn.Linear, Int4Linear)]
    for module, name in slots:
        child = getattr(module, name)
        if type(child) is nn.Linear and weight.dtype is torch.bfloat16:
            setattr(module, name, NativeDecodeLinear(child))
            replaced += 1
        elif type(child) is Int4Linear and child.qweight.device.type == "cpu" \
                and int4_kernel_fits(child.in_features, child.out_features, child.group_size) is None:
            setattr(module, name, NativeInt4Linear(child))
            packed += 1
            del child  # the last reference to the AWQ words: freed here, and their pages handed back
            trim()
    fused = 0
    for layer in getattr(language, "layers", ()):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        linears = () if attn is None or mlp is None else (
            attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if linears and all(type(m) is NativeInt4Linear for m in linears) and mlp.act is F.silu:
            layer.fused = FusedInt4Layer()
            fused += 1
    info = {"route": route, "linears": replaced, "simd": simd()}
    if quantized:
        info.update(int4_linears=packed, int4_simd=int4_simd(), fused_layers=fused)
    return info
