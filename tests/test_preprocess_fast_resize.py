"""video.resize: fast (OpenCV) against exact (Pillow bicubic, transformers' pixels): the stated bound."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from edgekv.config import ConfigError, EdgeKVConfig
from edgekv.preprocess import FAST_RESIZE_DIFFERENCE, FramePreprocessor

pytest.importorskip("cv2")


def _textured_frame(height: int = 480, width: int = 640, seed: int = 0) -> np.ndarray:
    """A camera-like frame: smooth colour gradients with sensor noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    smooth = np.stack([127 + 100 * np.sin(xx / 37.0 + c) * np.cos(yy / 23.0) for c in range(3)], -1)
    return np.clip(smooth + rng.normal(0, 12, smooth.shape), 0, 255).astype(np.uint8)


@pytest.mark.parametrize("resolution", [(112, 112), (224, 224), (448, 448), (672, 896), (224, 336)])
def test_fast_resize_is_within_the_stated_difference_of_pillow(resolution):
    frame = _textured_frame()
    fast = FramePreprocessor(resolution=resolution, resize="fast")._resize_bgr(frame).astype(int)
    height, width = resolution
    exact = np.asarray(Image.fromarray(frame).resize((width, height), resample=Image.Resampling.BICUBIC)).astype(int)
    assert fast.shape == exact.shape == (height, width, 3)
    difference = np.abs(fast - exact)
    mean_bound, max_bound = FAST_RESIZE_DIFFERENCE
    assert difference.mean() <= mean_bound and difference.max() <= max_bound
    assert difference.max() > 0  # not the exact path in disguise


def test_exact_is_the_default_and_fast_changes_only_the_resize():
    frame = _textured_frame(seed=1)
    exact, fast = FramePreprocessor(resolution=(224, 224)), FramePreprocessor(resolution=(224, 224), resize="fast")
    assert exact.resize == "exact" and EdgeKVConfig().video.resize == "exact"
    same_size = _textured_frame(224, 224, seed=2)  # no resize needed: both give the same pixels
    np.testing.assert_array_equal(exact.prepare(same_size).numpy(), fast.prepare(same_size).numpy())
    assert not np.array_equal(exact.prepare(frame).numpy(), fast.prepare(frame).numpy())


def test_bad_resize_mode_is_refused():
    with pytest.raises(ValueError, match="resize must be one of exact, fast"):
        FramePreprocessor(resolution=(224, 224), resize="nearest")
    with pytest.raises(ConfigError, match=r"video\.resize: expected one of exact, fast"):
        EdgeKVConfig().with_overrides(video={"resize": "nearest"})
