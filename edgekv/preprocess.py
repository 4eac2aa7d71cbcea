"""BGR uint8 camera frames -> the exact tensors transformers' Qwen2.5-VL image processor produces.

The vision tower is only exact against Hugging Face if its input is: HF is the test oracle
(DESIGN invariant 4), so every step below mirrors ``Qwen2VLImageProcessorPil`` numerically:

1. resize with Pillow's bicubic filter on the uint8 image (HF converts to a PIL image and back, so
   the rounding to uint8 after resizing is part of the contract; OpenCV's INTER_CUBIC uses a
   different kernel (a=-0.75) and no antialiasing when shrinking, so it cannot be used);
2. rescale ``uint8 * (1/255)`` in float64, cast to float32, then ``(x - mean) / std`` in float32.
   Step 2 maps 256 possible values per channel, so it is a 256-entry lookup table computed with
   exactly HF's arithmetic: the result is bit-identical and costs one gather per pixel;
3. patchify: ``[T, C, H, W]`` -> ``[grid_h * grid_w, C * T * 14 * 14]`` in merge-block order
   (rows of 2x2 merge blocks, then the 2x2 patches inside a block), each patch vector laid out
   channel-major, then time, then the 14x14 pixels. This is the layout of HF's video processor
   (``patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)``); a still image is the same with its frame
   repeated ``temporal_patch_size`` times.

``resize="fast"`` (``video.resize: fast``) trades step 1's exactness for speed: OpenCV's ``INTER_AREA``
when the frame shrinks in either direction (a box filter, close to Pillow's antialiased bicubic there)
and ``INTER_CUBIC`` when it grows in both. Measured against Pillow (``FAST_RESIZE_DIFFERENCE``): on a
textured 640x480 frame the mean absolute difference is 0.75-1.37 uint8 levels (max 4-9) at 112x112,
224x224, 448x448 and 896x672; on uniform noise, the worst case, 4.5-8.4 (max 26-47). 448x448 from
640x480 takes 2.3 ms instead of 5.4 ms (1 thread, busy 2-core machine). Needs opencv (the video extra).

The grid is fixed per stream (``video.resolution`` or ``smart_resize`` of the first frame), so the
staging buffer is allocated once. A ``FramePreprocessor`` is therefore not thread-safe: use one per
ingest thread.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from numbers import Integral

import numpy as np
import torch
from PIL import Image

__all__ = ["CLIP_MEAN", "CLIP_STD", "FAST_RESIZE_DIFFERENCE", "FramePreprocessor", "RESIZE_MODES", "smart_resize"]

RESIZE_MODES = ("exact", "fast")
# Bound on |fast - exact| per uint8 pixel on a textured 640x480 frame (mean, max), asserted by the tests.
FAST_RESIZE_DIFFERENCE = (1.5, 10)

CLIP_MEAN: tuple[float, float, float] = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD: tuple[float, float, float] = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
MAX_ASPECT_RATIO = 200


def smart_resize(height: int, width: int, factor: int = 28, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int]:
    """The (height, width) HF's Qwen2-VL processor resizes an image of this size to.

    Both sides become multiples of ``factor`` (patch 14 x merge 2), the area lands in
    ``[min_pixels, max_pixels]`` and the aspect ratio is kept as closely as that allows. Mirrors
    ``transformers.models.qwen2_vl.image_processing_qwen2_vl.smart_resize`` including its quirks:
    Python's ``round`` rounds halves to even (70 px -> 2.5 patches -> 56 px, not 84), and the
    ``min_pixels`` branch may exceed ``max_pixels`` for very thin images.
    """
    for name, value in (("height", height), ("width", width), ("factor", factor)):
        if not isinstance(value, Integral) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"smart_resize: {name} must be a positive integer, got {value!r}")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {ratio} "
                         f"(frame {height}x{width})")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _normalize_lut(mean: Sequence[float], std: Sequence[float], rescale_factor: float) -> np.ndarray:
    """``lut[c, v]``: the normalized value of uint8 ``v`` in RGB channel ``c``, with HF's exact arithmetic.

    HF rescales in float64 and casts to float32 (``image_transforms.rescale``), then normalizes in
    float32 with float32 mean/std (``image_transforms.normalize``); doing the same per value makes
    the table bit-identical to running HF on every pixel.
    """
    values = (np.arange(256, dtype=np.float64) * rescale_factor).astype(np.float32)
    mean32 = np.asarray(mean, dtype=np.float32)[:, None]
    std32 = np.asarray(std, dtype=np.float32)[:, None]
    return np.ascontiguousarray((values[None, :] - mean32) / std32, dtype=np.float32)  # [3, 256]


def _check_resolution(resolution: object, factor: int) -> tuple[int, int]:
    valid = (isinstance(resolution, (tuple, list)) and len(resolution) == 2
             and all(isinstance(v, Integral) and not isinstance(v, bool) and v > 0 and v % factor == 0
                     for v in resolution))
    if not valid:
        raise ValueError(
            f"resolution must be [height, width] with both positive multiples of {factor} (patch_size x "
            f"merge_size), got {resolution!r}; e.g. [448, 448] or [336, 448]"
        )
    return int(resolution[0]), int(resolution[1])


def _check_positive(name: str, value: object) -> int:
    if not isinstance(value, Integral) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def _fast_resize(frame: np.ndarray, height: int, width: int) -> np.ndarray:
    """OpenCV resize: area averaging when shrinking in either direction, bicubic when growing in both."""
    import cv2

    shrinking = height < frame.shape[0] or width < frame.shape[1]
    return cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA if shrinking else cv2.INTER_CUBIC)


class FramePreprocessor:
    """Turns BGR uint8 frames into Qwen2.5-VL ``pixel_values`` / ``grid_thw`` on a fixed grid.

    Give either ``resolution=(H, W)`` (multiples of ``patch_size * merge_size``) or
    ``source_size=(h, w)`` of the camera, in which case the grid is ``smart_resize(h, w)`` exactly as
    HF would choose it. Frames of any size are resized to the grid, so a camera that changes mode
    keeps the token count (and the cache budget computed from it) unchanged.
    """

    def __init__(self, resolution: Sequence[int] | None = None, *, source_size: Sequence[int] | None = None,
                 patch_size: int = 14, temporal_patch_size: int = 2, merge_size: int = 2,
                 image_mean: Sequence[float] = CLIP_MEAN, image_std: Sequence[float] = CLIP_STD,
                 rescale_factor: float = 1 / 255, min_pixels: int = DEFAULT_MIN_PIXELS,
                 max_pixels: int = DEFAULT_MAX_PIXELS, resize: str = "exact") -> None:
        if resize not in RESIZE_MODES:
            raise ValueError(f"resize must be one of {', '.join(RESIZE_MODES)}, got {resize!r}")
        self.resize = resize
        if resize == "fast":
            try:
                import cv2  # noqa: F401 - checked here so a missing package fails at start, not per frame
            except ImportError as exc:
                raise ImportError("video.resize: fast needs OpenCV (pip install 'edgekv[video]')") from exc
        self.patch_size = _check_positive("patch_size", patch_size)
        self.temporal_patch_size = _check_positive("temporal_patch_size", temporal_patch_size)
        self.merge_size = _check_positive("merge_size", merge_size)
        if len(image_mean) != 3 or len(image_std) != 3:
            raise ValueError(f"image_mean and image_std need 3 values (RGB), got {image_mean!r}, {image_std!r}")
        factor = self.patch_size * self.merge_size
        if (resolution is None) == (source_size is None):
            raise ValueError("FramePreprocessor needs exactly one of resolution=(H, W) or source_size=(h, w), "
                             f"got resolution={resolution!r}, source_size={source_size!r}")
        if resolution is None:
            if not (isinstance(source_size, (tuple, list)) and len(source_size) == 2):
                raise ValueError(f"source_size must be (height, width), got {source_size!r}")
            resolution = smart_resize(source_size[0], source_size[1], factor, min_pixels, max_pixels)
        self.height, self.width = _check_resolution(resolution, factor)
        self.grid_h, self.grid_w = self.height // self.patch_size, self.width // self.patch_size
        self.patch_dim = 3 * self.temporal_patch_size * self.patch_size * self.patch_size
        self._lut = _normalize_lut(image_mean, image_std, rescale_factor)  # [3 (RGB), 256]
        # stage: [T, 3, H, W] float32, the normalized RGB frames of the group being patchified
        self._stage_np = np.empty((self.temporal_patch_size, 3, self.height, self.width), dtype=np.float32)
        self._stage = torch.from_numpy(self._stage_np)

    # ------------------------------------------------------------------ shape facts
    @property
    def resolution(self) -> tuple[int, int]:
        """(height, width) in pixels that every frame is resized to."""
        return self.height, self.width

    @property
    def num_patches(self) -> int:
        """Rows of ``pixel_values`` per frame group: ``grid_h * grid_w`` 14x14 patches."""
        return self.grid_h * self.grid_w

    @property
    def tokens_per_pair(self) -> int:
        """LLM tokens one frame group becomes after the 2x2 merger: the unit of the cache budget."""
        return self.num_patches // (self.merge_size * self.merge_size)

    def grid_thw(self) -> torch.Tensor:
        """``[[1, grid_h, grid_w]]`` (int64), in patches before merging, as HF's ``*_grid_thw``."""
        return torch.tensor([[1, self.grid_h, self.grid_w]], dtype=torch.long)

    # ------------------------------------------------------------------ input checks
    @staticmethod
    def check_frame(frame: object) -> None:
        """Refuse anything but an HxWx3 uint8 (BGR) numpy array, saying what came instead.

        Run before any state changes so a bad frame is rejected without losing the ingested stream.
        Non-contiguous views (crops, ``frame[::2, ::2]``) are fine.
        """
        expected = "expected an HxWx3 uint8 numpy array in BGR order (OpenCV's layout)"
        if not isinstance(frame, np.ndarray):
            hint = " (pass frame.cpu().numpy())" if type(frame).__module__.split(".")[0] == "torch" else ""
            raise ValueError(f"{expected}, got {type(frame).__module__}.{type(frame).__name__}{hint}")
        if frame.ndim != 3:
            hint = " (grayscale? use cv2.cvtColor(frame, cv2.COLOR_GRAY2BGR))" if frame.ndim == 2 else ""
            raise ValueError(f"{expected}, got a {frame.ndim}-d array of shape {frame.shape}{hint}")
        if frame.shape[2] != 3:
            hints = {1: " (grayscale? use cv2.COLOR_GRAY2BGR)", 4: " (BGRA/BGRx? use cv2.COLOR_BGRA2BGR)"}
            hint = hints.get(frame.shape[2], " (channels first? use frame.transpose(1, 2, 0))"
                             if frame.shape[0] in (1, 3, 4) else "")
            raise ValueError(f"{expected}, got {frame.shape[2]} channels (shape {frame.shape}){hint}")
        if frame.dtype != np.uint8:
            raise ValueError(f"{expected}, got dtype {frame.dtype} (shape {frame.shape}); "
                             "pass the uint8 frame as decoded, before any scaling")
        if frame.shape[0] == 0 or frame.shape[1] == 0:
            raise ValueError(f"{expected}, got an empty frame of shape {frame.shape}")

    # ------------------------------------------------------------------ per-frame work
    def _resize_bgr(self, frame: np.ndarray) -> np.ndarray:
        """Pillow bicubic to the grid, on uint8, as HF does; channels are filtered independently,
        so resizing the BGR bytes is the same as resizing the RGB ones."""
        if frame.shape[0] == self.height and frame.shape[1] == self.width:
            return frame  # Pillow returns an identical copy for a same-size resize
        if self.resize == "fast":
            return _fast_resize(frame, self.height, self.width)
        image = Image.fromarray(np.ascontiguousarray(frame))  # HxWx3 uint8 -> mode "RGB"
        return np.asarray(image.resize((self.width, self.height), resample=Image.Resampling.BICUBIC))

    def _prepare_into(self, frame: np.ndarray, out: np.ndarray) -> None:
        """Resize + BGR->RGB + normalize ``frame`` into ``out`` ([3, H, W] float32) with no temporaries
        beyond the resized uint8 image."""
        self.check_frame(frame)
        resized = self._resize_bgr(frame)
        for rgb_channel in range(3):
            np.take(self._lut[rgb_channel], resized[:, :, 2 - rgb_channel], out=out[rgb_channel], mode="clip")

    def prepare(self, frame: np.ndarray) -> torch.Tensor:
        """One frame as the normalized RGB image HF feeds to patchify: ``[3, H, W]`` float32."""
        out = np.empty((3, self.height, self.width), dtype=np.float32)
        self._prepare_into(frame, out)
        return torch.from_numpy(out)

    def _patchify(self, stage: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # stage: [T, C, H, W] -> [T, C, gh/m, m, p, gw/m, m, p] -> [gh/m, gw/m, m, m, C, T, p, p]
        t, m, p = self.temporal_patch_size, self.merge_size, self.patch_size
        blocks = stage.view(t, 3, self.grid_h // m, m, p, self.grid_w // m, m, p).permute(2, 5, 3, 6, 1, 0, 4, 7)
        if out is None:
            out = torch.empty(self.num_patches, self.patch_dim, dtype=torch.float32)
        elif out.shape != (self.num_patches, self.patch_dim) or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous [{self.num_patches}, {self.patch_dim}] tensor, "
                             f"got {tuple(out.shape)}")
        out.view(self.grid_h // m, self.grid_w // m, m, m, 3, t, p, p).copy_(blocks)
        return out, self.grid_thw()

    def group(self, frames: Sequence[np.ndarray], out: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """``temporal_patch_size`` consecutive frames -> one temporal patch group (video layout).

        Returns ``pixel_values: [grid_h * grid_w, 3 * T * p * p]`` float32 (a new tensor, or ``out``)
        and ``grid_thw = [[1, grid_h, grid_w]]``.
        """
        if len(frames) != self.temporal_patch_size:
            raise ValueError(f"a temporal patch group needs {self.temporal_patch_size} frames, got {len(frames)}")
        for frame in frames:  # all checked first: a bad second frame must not half-fill the stage
            self.check_frame(frame)
        for index, frame in enumerate(frames):
            self._prepare_into(frame, self._stage_np[index])
        return self._patchify(self._stage, out)

    def pair(self, frame_a: np.ndarray, frame_b: np.ndarray, out: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two consecutive frames -> the ``pixel_values_videos`` / ``video_grid_thw`` of one frame pair."""
        return self.group((frame_a, frame_b), out)

    def images(self, frame: np.ndarray, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One still image -> ``pixel_values`` / ``image_grid_thw``; HF repeats the frame over time."""
        self._prepare_into(frame, self._stage_np[0])
        tiled = self._stage[:1].expand(self.temporal_patch_size, -1, -1, -1)
        return self._patchify(tiled, out)

    def __repr__(self) -> str:
        return (f"FramePreprocessor(resolution={self.resolution}, resize={self.resize}, "
                f"grid={self.grid_h}x{self.grid_w} patches, tokens_per_pair={self.tokens_per_pair})")
