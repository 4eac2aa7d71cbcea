"""Qwen2.5-VL rotary positions: M-RoPE for the language model and the position ids it consumes.

M-RoPE (Qwen2-VL paper, sec. 2.1; transformers ``Qwen2_5_VLRotaryEmbedding``) gives every token three
position ids ``(t, h, w)``. Text tokens use the same value in all three rows, so on text M-RoPE is exactly
1D RoPE. The ``head_dim / 2`` rotary frequencies ``inv_freq[j] = theta ** (-2j / head_dim)`` are cut into
consecutive sections ``mrope_section = [s_t, s_h, s_w]`` (``[16, 24, 24]`` for the released models):
frequency ``j`` rotates by the temporal id when ``j < s_t``, by the height id when
``s_t <= j < s_t + s_h`` and by the width id otherwise. The rotation pairs dim ``j`` with dim
``j + head_dim / 2`` (``rotate_half`` layout), so cos/sin are the ``head_dim / 2`` angles written twice.

Consequence used by the streaming cache (DESIGN invariant 5): only dims ``[0, s_t)`` and
``[head_dim/2, head_dim/2 + s_t)`` of a rotated key depend on the temporal id
(:func:`temporal_rotary_dims`); moving a cached key by ``delta`` in time is one extra rotation of those
dims by ``delta * inv_freq[:s_t]``, exact and with no recomputation of the layer.

Positions of a prompt (:func:`get_rope_index`, equal to transformers 5.23's for the same inputs):

* text runs count up by one from the running position ``current``;
* an image / video run with grid ``(T, H, W)`` (in patches; ``h = H // merge``, ``w = W // merge`` merged
  tokens, row-major per temporal slice) gets ``t = current + int(k * interval)`` for slice ``k``,
  ``h = current + row``, ``w = current + col``. ``interval = tokens_per_second * second_per_grid_ts[i]``
  for videos (``second_per_grid_ts = temporal_patch_size / fps``: seconds covered by one frame pair;
  ``1`` when not given) and ``1`` for images. The product is truncated toward zero after the multiply
  (``(arange(T) * interval).long()``), so frame pair ``k`` sits at
  ``floor(k * second_per_grid * tokens_per_second)``: with 2 fps sampling and ``tokens_per_second = 2``
  one pair covers 1 s and pairs are 2 positions apart;
* after a vision run, ``current += max(h, w)``. transformers 5.23 ignores the temporal extent here, so
  text after a long video may take positions *below* the video's last temporal ids (transformers 4.x and
  the Qwen reference code used ``max over all three rows + 1``). :func:`position_after_vision` is the 5.23
  rule; generation continues from the last prompt position + 1 (not from ``rope_deltas``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

if TYPE_CHECKING:
    from edgekv.model.config import ModelConfig


def rotary_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """``[head_dim / 2]`` fp32 inverse frequencies ``theta ** (-2j / head_dim)`` (HF's default rope init)."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))


def mrope_dim_rows(mrope_section: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``[sum(mrope_section)]`` long: which position row (0 = t, 1 = h, 2 = w) drives each frequency."""
    rows = [i % 3 for i, size in enumerate(mrope_section) for _ in range(size)]
    return torch.tensor(rows, dtype=torch.long, device=device)


def mrope_cos_sin(inv_freq: torch.Tensor, position_ids: torch.Tensor,
                  mrope_section: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[P, head_dim]`` fp32 for 3-row position ids ``[3, P]``.

    ``angle[p, j] = position_ids[row(j), p] * inv_freq[j]`` for ``j < head_dim / 2``, then the angles are
    written twice (rotate_half pairing). Bit-identical to transformers' fp32 computation: the same fp32
    products, only the section selection is done by indexing instead of split + concatenate.
    """
    rows = mrope_dim_rows(mrope_section, device=position_ids.device)  # [hd/2]
    if rows.numel() != inv_freq.numel():
        raise ValueError(f"mrope_section {list(mrope_section)} sums to {rows.numel()}, "
                         f"but inv_freq has {inv_freq.numel()} frequencies")
    positions = position_ids.float()[rows]  # [hd/2, P]
    angle = positions.T * inv_freq.to(device=position_ids.device, dtype=torch.float32)  # [P, hd/2]
    angle = torch.cat((angle, angle), dim=-1)  # [P, hd]
    return angle.cos(), angle.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., P, hd]`` by cos/sin ``[P, hd]``. Math in ``x.dtype`` after casting cos/sin, as the
    transformers language model does (the ViT rotates in fp32; see ``vision.py``)."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + rotate_half(x) * sin


def temporal_rotary_dims(mrope_section: Sequence[int], head_dim: int) -> torch.Tensor:
    """Indices of the dims of a rotated q/k that depend on the temporal position id.

    ``[0, s_t) ∪ [head_dim/2, head_dim/2 + s_t)`` — e.g. 0..15 and 64..79 for the 3B model
    (``mrope_section = [16, 24, 24]``, ``head_dim = 128``).
    """
    if sum(mrope_section) != head_dim // 2:
        raise ValueError(f"mrope_section {list(mrope_section)} does not sum to head_dim // 2 = {head_dim // 2}")
    s_t = int(mrope_section[0])
    first = torch.arange(s_t)
    return torch.cat((first, first + head_dim // 2))


# ---------------------------------------------------------------------------------------------- position ids
def text_position_ids(start: int, n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[3, n]`` long: ``start .. start + n - 1`` in all three rows (text is 1D RoPE)."""
    return torch.arange(start, start + n, dtype=torch.long, device=device).expand(3, n).contiguous()


def vision_block_position_ids(start: int, t_pos: int, llm_grid_h: int, llm_grid_w: int,
                              device: torch.device | str | None = None) -> torch.Tensor:
    """``[3, h * w]`` long positions of ONE merged temporal slice (a frame pair or an image), row-major.

    t = ``start + t_pos``, h = ``start + row``, w = ``start + col``. ``start`` is the running position
    where the vision run begins (the position after ``<|vision_start|>``), ``t_pos`` the slice's temporal
    offset: ``int(k * second_per_grid * tokens_per_second)`` for slice ``k`` in transformers (see
    :func:`video_temporal_offsets`), i.e. ``floor(seconds_since_first_pair * tokens_per_second)``.
    """
    rows = torch.arange(llm_grid_h, dtype=torch.long, device=device).repeat_interleave(llm_grid_w)
    cols = torch.arange(llm_grid_w, dtype=torch.long, device=device).repeat(llm_grid_h)
    t = torch.full_like(rows, t_pos)
    return torch.stack((t, rows, cols)) + start


def video_temporal_offsets(num_slices: int, tokens_per_second: int | float,
                           second_per_grid: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``[T]`` long: temporal offsets of a video's slices, ``(arange(T) * tokens_per_second * spg).long()``.

    The multiply happens in the dtype transformers uses (fp32 for a python float or fp32 tensor), then
    truncates; pass ``second_per_grid`` exactly as given to transformers to get its ids.
    """
    interval = tokens_per_second * second_per_grid
    return (torch.arange(num_slices) * interval).long()


def position_after_vision(start: int, llm_grid_h: int, llm_grid_w: int) -> int:
    """Where text after a vision run starts in transformers 5.23: ``start + max(h, w)`` (time ignored)."""
    return start + max(llm_grid_h, llm_grid_w)


def _modality_runs(token_type: torch.Tensor) -> list[tuple[int, int, int]]:
    """Contiguous runs of equal values: [(value, begin, end)] for a 1D long tensor."""
    n = token_type.numel()
    if n == 0:
        return []
    change = torch.nonzero(token_type[1:] != token_type[:-1]).flatten() + 1
    bounds = [0, *change.tolist(), n]
    values = token_type[bounds[:-1]].tolist()
    return [(values[i], bounds[i], bounds[i + 1]) for i in range(len(values))]


def get_rope_index(config: "ModelConfig", input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None = None,
                   video_grid_thw: torch.Tensor | None = None,
                   second_per_grid_ts: torch.Tensor | Sequence[float] | None = None) -> torch.Tensor:
    """``[3, 1, S]`` long M-RoPE position ids of a prompt ``input_ids [1, S]`` (see the module docstring).

    Each maximal run of ``<|image_pad|>`` (``<|video_pad|>``) tokens consumes the next row of
    ``image_grid_thw`` (``video_grid_thw``), as transformers 5.23 groups its ``mm_token_type_ids``; a run
    whose length does not match its grid is refused (transformers would silently misplace it).

    transformers 5.23 finds these runs from ``mm_token_type_ids`` (0 text, 1 image, 2 video, built by its
    processor), not from the token ids; called without them, its ``forward`` silently falls back to plain
    1D positions for a vision prompt. Tests pass ``mm_token_type_ids = (ids == pad_id) * type``.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must be [1, S] (batch size 1), got {tuple(input_ids.shape)}")
    ids = input_ids[0]
    device = ids.device
    merge = config.vision.spatial_merge_size
    token_type = torch.zeros_like(ids)
    token_type[ids == config.image_token_id] = 1
    token_type[ids == config.video_token_id] = 2
    grids = {1: image_grid_thw, 2: video_grid_thw}
    used = {1: 0, 2: 0}
    names = {1: "image", 2: "video"}

    pieces: list[torch.Tensor] = []
    current = 0
    for kind, begin, end in _modality_runs(token_type):
        length = end - begin
        if kind == 0:
            pieces.append(text_position_ids(current, length, device=device))
            current += length
            continue
        grid_rows = grids[kind]
        index = used[kind]
        if grid_rows is None or index >= len(grid_rows):
            raise ValueError(f"{names[kind]} tokens at {begin}..{end - 1} but only {index} {names[kind]}_grid_thw rows")
        t, h, w = (int(v) for v in grid_rows[index])
        used[kind] += 1
        llm_h, llm_w = h // merge, w // merge
        if t * llm_h * llm_w != length:
            raise ValueError(f"{names[kind]} {index}: grid {(t, h, w)} gives {t * llm_h * llm_w} tokens, "
                             f"but the run at {begin}..{end - 1} has {length}")
        if kind == 2:
            spg = 1 if second_per_grid_ts is None else second_per_grid_ts[index]
            offsets = video_temporal_offsets(t, config.vision.tokens_per_second, spg)
        else:
            offsets = torch.arange(t)
        block = vision_block_position_ids(0, 0, llm_h, llm_w, device=device)  # [3, h*w]
        block = block.repeat(1, t)
        block[0] = offsets.to(device).repeat_interleave(llm_h * llm_w)
        pieces.append(block + current)
        current = position_after_vision(current, llm_h, llm_w)
    for kind in (1, 2):
        total = 0 if grids[kind] is None else len(grids[kind])
        if used[kind] != total:
            raise ValueError(f"{names[kind]}_grid_thw has {total} rows but the prompt has {used[kind]} "
                             f"{names[kind]} runs")
    if not pieces:
        return torch.zeros(3, 1, 0, dtype=torch.long, device=device)
    return torch.cat(pieces, dim=1).unsqueeze(1)
