"""The Qwen2.5-VL vision tower (transformers ``Qwen2_5_VisionTransformerPretrainedModel``).

What matters, in the order tokens flow (Qwen2.5-VL tech report, sec. 2.1 "Visual Encoder"):

* **Input.** The processor cuts each (frame pair | image) into 14x14 patches over ``temporal_patch_size=2``
  frames (an image is its frame written twice) and flattens each patch as ``(C, 2, 14, 14)``. Patches come
  grouped by 2x2 merge unit: order ``(t, h_block, w_block, dh, dw)``, so 4 consecutive rows are one future
  LLM token. ``grid_thw`` rows give ``(T, H, W)`` in patches per image/video.
* **Patch embedding.** A Conv3d whose kernel equals its stride is a Linear over the flattened patch
  (no bias); the checkpoint's 5D kernel is reshaped to ``[hidden, C*2*14*14]`` at load time.
* **2D rotary.** Each head's ``head_dim`` is split in two halves rotated by the patch row and column
  (frequencies ``10000 ** (-2i / (head_dim/2))``), written twice for ``rotate_half``. Math in fp32.
* **Window attention.** Tokens are reordered so every window of ``window_size/14 = 8x8`` patches
  (``4x4`` merge units) is contiguous (windows row-major inside each temporal slice, units row-major inside
  a window). Blocks in ``fullatt_block_indexes`` attend over a whole temporal slice instead; there is never
  attention across slices, images or videos. Edge windows of a grid that is not a multiple of the window
  are smaller.
* **Blocks.** Pre-norm RMSNorm (eps 1e-6), attention with fused ``qkv`` (bias) and ``proj`` (bias), SwiGLU
  MLP with bias (``hidden_act``, silu in the released models).
* **Merger.** RMSNorm per patch, the 4 patches of a merge unit concatenated (``4*hidden``), then
  ``Linear -> GELU -> Linear`` to ``out_hidden_size``; outputs are put back in the processor's order.

Static shapes: per grid, the attention segments (windows or temporal slices) are padded to one length and
run as ONE batched SDPA call with a key-padding mask, instead of a Python loop over variable-length
windows. The layout (permutation, gather index, mask, rotary angles) is computed once per ``grid_thw`` and
cached, so a stream of frames with a fixed grid pays nothing for it. Grids that are a multiple of 112 px
(224, 448, ...) have equal windows, and then there is no gather, no padding and no mask at all.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgekv.model.config import VisionConfig
from edgekv.model.language import GatedMLP, RMSNorm
from edgekv.model.rope import rotate_half

VISION_ROPE_THETA = 10_000.0
_LAYOUT_CACHE_SIZE = 8


@dataclass(frozen=True)
class Segments:
    """Contiguous attention segments of a token sequence, padded to one length ``L``.

    gather: [S, L] long token index per padded slot (0 in padding), or None when every segment has length
    L (then the sequence is simply viewed as [S, L]); key_mask: [S, 1, 1, L] bool, True = real token, or
    None; valid: [N] long flat indices of real slots in [S * L] order (None when uniform).
    """

    count: int
    length: int
    gather: torch.Tensor | None
    key_mask: torch.Tensor | None
    valid: torch.Tensor | None

    @staticmethod
    def build(lengths: list[int], device: torch.device) -> "Segments":
        longest = max(lengths)
        if all(n == longest for n in lengths):
            return Segments(len(lengths), longest, None, None, None)
        starts = torch.tensor([0, *lengths[:-1]], device=device).cumsum(0)  # [S]
        sizes = torch.tensor(lengths, device=device)  # [S]
        slot = torch.arange(longest, device=device)  # [L]
        real = slot[None, :] < sizes[:, None]  # [S, L]
        gather = torch.where(real, starts[:, None] + slot[None, :], torch.zeros((), dtype=torch.long, device=device))
        return Segments(len(lengths), longest, gather, real[:, None, None, :], torch.nonzero(real.flatten()).flatten())


@dataclass(frozen=True)
class VisionLayout:
    """Everything about a ``grid_thw`` that does not depend on pixel values."""

    token_order: torch.Tensor  # [N] patch index in window order (HF window_index expanded to patches)
    unit_restore: torch.Tensor  # [N/4] merged outputs in window order -> processor order
    cos: torch.Tensor  # [N, head_dim] fp32, in window order
    sin: torch.Tensor  # [N, head_dim] fp32
    windows: Segments
    slices: Segments


@functools.lru_cache(maxsize=64)
def _grid_layout(merge: int, merger_window: int, t: int, h: int, w: int) -> tuple:
    """One ``grid_thw`` row's layout, its merge units numbered from 0: (units in HF window order [t*lh*lw], window
    lengths, slice lengths, patch rows, patch columns [t*h*w] in processor order). Cached: a toy's training batch
    holds a grid row per distinct frame pair, up to hundreds of one shape (a lured batch of 8 streams: 128 rows,
    whose layout took 9.7 ms built row by row, 1.7-2.5 ms from this cache, on the 2-core dev VM)."""
    if h % merge or w % merge:
        raise ValueError(f"grid_thw {(t, h, w)}: height and width must be multiples of spatial_merge_size {merge}")
    unit, mw = merge * merge, merger_window
    lh, lw = h // merge, w // merge
    ids = torch.arange(t * lh * lw).view(t, lh, lw)  # merge units in processor order
    # HF window order: temporal slice, then window row, window column, then units row-major inside.
    order, window_lengths = [], []
    for k in range(t):
        for r0 in range(0, lh, mw):
            for c0 in range(0, lw, mw):
                window = ids[k, r0:r0 + mw, c0:c0 + mw].flatten()
                order.append(window)
                window_lengths.append(window.numel() * unit)
    # Patch (row, col) in processor order (t, hb, wb, dh, dw).
    rows = (torch.arange(lh)[:, None, None, None] * merge + torch.arange(merge)[None, None, :, None]).expand(
        lh, lw, merge, merge)
    cols = (torch.arange(lw)[None, :, None, None] * merge + torch.arange(merge)[None, None, None, :]).expand(
        lh, lw, merge, merge)
    return (torch.cat(order), tuple(window_lengths), (lh * lw * unit,) * t, rows.flatten().repeat(t),
            cols.flatten().repeat(t))


def build_layout(config: VisionConfig, grid_thw: list[tuple[int, int, int]], device: torch.device) -> VisionLayout:
    m = config.spatial_merge_size
    unit = m * m
    pieces = [_grid_layout(m, config.merger_window, int(t), int(h), int(w)) for t, h, w in grid_thw]
    window_lengths = [n for piece in pieces for n in piece[1]]
    slice_lengths = [n for piece in pieces for n in piece[2]]
    sizes = torch.tensor([len(piece[0]) for piece in pieces])
    offsets = torch.cumsum(sizes, 0) - sizes  # each row's merge units follow the rows before it
    # [N/4] HF window_index
    units = torch.cat([piece[0] for piece in pieces]) + torch.repeat_interleave(offsets, sizes)
    token_order = (units[:, None] * unit + torch.arange(unit)[None, :]).flatten()  # [N]
    half = config.head_dim // 2
    inv_freq = 1.0 / (VISION_ROPE_THETA ** (torch.arange(0, half, 2, dtype=torch.float32) / half))  # [hd/4]
    angle_h = torch.cat([piece[3] for piece in pieces])[token_order].float()[:, None] * inv_freq  # [N, hd/4]
    angle_w = torch.cat([piece[4] for piece in pieces])[token_order].float()[:, None] * inv_freq
    angle = torch.cat((angle_h, angle_w, angle_h, angle_w), dim=-1)  # [N, hd]
    return VisionLayout(
        token_order=token_order.to(device),
        unit_restore=torch.argsort(units).to(device),
        cos=angle.cos().to(device),
        sin=angle.sin().to(device),
        windows=Segments.build(window_lengths, device),
        slices=Segments.build(slice_lengths, device),
    )


class PatchEmbed(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(config.patch_dim, config.hidden_size, bias=False)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))  # [N, hidden]


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        n, d = x.shape
        qkv = self.qkv(x).view(n, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [N, H, hd]
        q, k = _rotate_fp32(q, cos, sin), _rotate_fp32(k, cos, sin)
        s, length = segments.count, segments.length
        if segments.gather is None:
            q, k, v = (t.reshape(s, length, self.num_heads, self.head_dim) for t in (q, k, v))
        else:
            q, k, v = (t[segments.gather] for t in (q, k, v))  # [S, L, H, hd]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [S, H, L, hd]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=segments.key_mask)  # [S, H, L, hd]
        out = out.transpose(1, 2).reshape(s * length, d)
        if segments.valid is not None:
            out = out[segments.valid]  # padded query rows are dropped; they never fed a real token
        return self.proj(out)


def _rotate_fp32(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, hd] rotated with cos/sin [N, hd] in fp32, back to x.dtype (HF apply_rotary_pos_emb_vision)."""
    x32 = x.float()
    out = x32 * cos[:, None, :] + rotate_half(x32) * sin[:, None, :]
    return out.to(x.dtype)


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = RMSNorm(config.hidden_size, 1e-6)
        self.norm2 = RMSNorm(config.hidden_size, 1e-6)
        self.attn = VisionAttention(config)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.unit_dim = config.hidden_size * config.spatial_merge_size ** 2
        self.ln_q = RMSNorm(config.hidden_size, 1e-6)
        # nn.Sequential keeps the checkpoint names merger.mlp.0 / merger.mlp.2.
        self.mlp = nn.Sequential(nn.Linear(self.unit_dim, self.unit_dim), nn.GELU(),
                                 nn.Linear(self.unit_dim, config.out_hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.unit_dim))  # [N/4, out_hidden]


def pad_mlp_width(mlp: GatedMLP, multiple: int) -> int:
    """Zero-pad a SwiGLU MLP's hidden width up to a multiple of ``multiple``; returns the new width.

    Rows of zeros appended to ``gate_proj`` and ``up_proj`` (and their biases) and columns of zeros to
    ``down_proj`` compute the same MLP: each new unit is ``act(0) * 0 = 0`` (any activation with a finite value
    at 0), and a zero column adds nothing to ``down``. Only the products' summation order may change. Why:
    the 3B's ViT width 3,420 is not a multiple of 8, so a bf16 row is not 16-byte aligned and cuBLAS falls back
    to an Ampere-generation ``align2`` kernel on Hopper; measured on the H200 (issue 32, 2026-12-04,
    ``tools/gpu/vit_mlp_3b.py``, 1,024 patches of a 448x448 pair): the block's MLP 155.6 us at 3,420, 58.3 us at
    3,424, 57.6 us at 3,456 — ~3 ms of a pair's device work over 32 blocks. Costs 0.1 % more MLP weight."""
    if multiple < 1:
        raise ValueError(f"multiple must be at least 1, got {multiple}")
    width = mlp.gate_proj.out_features
    target = -(-width // multiple) * multiple
    if target == width:
        return width
    extra = target - width
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            old = getattr(mlp, name)
            new = nn.Linear(old.in_features, target, bias=old.bias is not None, device=old.weight.device,
                            dtype=old.weight.dtype)
            new.weight.copy_(F.pad(old.weight, (0, 0, 0, extra)))
            if old.bias is not None:
                new.bias.copy_(F.pad(old.bias, (0, extra)))
            new.requires_grad_(old.weight.requires_grad)
            setattr(mlp, name, new)
        old = mlp.down_proj
        new = nn.Linear(target, old.out_features, bias=old.bias is not None, device=old.weight.device,
                        dtype=old.weight.dtype)
        new.weight.copy_(F.pad(old.weight, (0, extra)))
        if old.bias is not None:
            new.bias.copy_(old.bias)
        new.requires_grad_(old.weight.requires_grad)
        mlp.down_proj = new
    return target


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config)
        self._full_attention = frozenset(config.fullatt_block_indexes)
        self._layouts: OrderedDict[tuple, VisionLayout] = OrderedDict()

    def pad_mlps(self, multiple: int = 8) -> int:
        """Every block's MLP zero-padded to a width that is a multiple of ``multiple`` (``pad_mlp_width``: the
        same tower, faster products on a GPU); returns the width. The config keeps the checkpoint's width."""
        widths = {pad_mlp_width(block.mlp, multiple) for block in self.blocks}
        return widths.pop() if len(widths) == 1 else self.config.intermediate_size

    def layout(self, grid_thw: torch.Tensor, device: torch.device) -> VisionLayout:
        """The cached layout of ``grid_thw`` [n, 3] on ``device`` (small LRU keyed by grid and device)."""
        grid = tuple(tuple(int(v) for v in row) for row in grid_thw.tolist())
        key = (grid, str(device))
        found = self._layouts.get(key)
        if found is not None:
            self._layouts.move_to_end(key)
            return found
        layout = build_layout(self.config, list(grid), device)
        self._layouts[key] = layout
        if len(self._layouts) > _LAYOUT_CACHE_SIZE:
            self._layouts.popitem(last=False)
        return layout

    def check_inputs(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> None:
        """ValueError naming what does not fit: grid_thw [n, 3], pixel_values [sum of t*h*w, patch_dim]."""
        if grid_thw.dim() != 2 or grid_thw.shape[1] != 3:
            raise ValueError(f"grid_thw must be [n, 3], got {tuple(grid_thw.shape)}")
        expected = int(grid_thw.prod(-1).sum())
        if pixel_values.dim() != 2 or pixel_values.shape != (expected, self.config.patch_dim):
            raise ValueError(f"pixel_values must be [{expected}, {self.config.patch_dim}] for grid_thw "
                             f"{grid_thw.tolist()}, got {tuple(pixel_values.shape)}")

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [N, C*tps*ps*ps], grid_thw [n, 3] -> merged tokens [N/4, out_hidden] in HF order."""
        self.check_inputs(pixel_values, grid_thw)
        device = self.patch_embed.proj.weight.device
        return self.forward_layout(pixel_values.to(device), self.layout(grid_thw, device))

    def forward_layout(self, pixel_values: torch.Tensor, layout: VisionLayout) -> torch.Tensor:
        """The tower for a precomputed layout: no shape-dependent Python, so an exporter bakes the window
        permutation, padding gathers, masks and rotary angles of one grid as constants (``edgekv.engines``)."""
        x = self.patch_embed(pixel_values)[layout.token_order]  # [N, hidden], window order
        for index, block in enumerate(self.blocks):
            segments = layout.slices if index in self._full_attention else layout.windows
            x = block(x, layout.cos, layout.sin, segments)
        return self.merger(x)[layout.unit_restore]
