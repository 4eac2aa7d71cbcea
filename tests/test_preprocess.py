"""FramePreprocessor against transformers' Qwen2-VL image processor, the oracle for the vision input.

The oracle is ``transformers.Qwen2VLImageProcessorPil`` (the PIL/NumPy path). HF's fast image
processor and its video processor need torchvision, whose wheels require a CUDA build of torch, so
they cannot be installed next to the CPU torch here. Consequences:

- images are compared with the PIL path directly, and must be bit-identical (max |diff| == 0):
  we resize with the same Pillow call and normalize with a lookup table built with HF's own float64
  -> float32 arithmetic, so any difference at all would be a real divergence;
- the PIL image processor cannot build a video group: given a list or a stacked (2, H, W, 3) array
  it returns two *images*, each repeated over time (checked below). The two-frame layout is checked
  (a) per frame against those HF images, and (b) against an independent view/permute written from
  the layout in ``video_processing_qwen2_vl.Qwen2VLVideoProcessor.patchify``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize

from edgekv.preprocess import FramePreprocessor, smart_resize
from edgekv.video.sources import open_source

PATCH, TEMPORAL, MERGE = 14, 2, 2


@pytest.fixture(scope="module")
def hf() -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil()


def _random_frame(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def _scene_frame(height: int, width: int, index: int = 3) -> np.ndarray:
    """Natural-ish content (gradients, edges), where a wrong resize kernel shows most."""
    source = open_source(f"synthetic:shapes?size={width}x{height}&seed=5")
    return source.render(index)


def _hf_pixels(processor: Qwen2VLImageProcessorPil, bgr_frames: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    rgb = [np.ascontiguousarray(f[..., ::-1]) for f in bgr_frames]
    out = processor(images=rgb, return_tensors="pt", input_data_format="channels_last")
    return out["pixel_values"], out["image_grid_thw"]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------- smart_resize
@settings(max_examples=300, deadline=None)
@given(height=st.integers(1, 4000), width=st.integers(1, 4000),
       min_pixels=st.sampled_from([56 * 56, 112 * 112, 256 * 28 * 28]),
       max_pixels=st.sampled_from([224 * 224, 448 * 448, 28 * 28 * 1280, 12845056]))
def test_smart_resize_matches_hf(height, width, min_pixels, max_pixels):
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ValueError, match="aspect ratio"):
            smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)
        return
    assert smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels) == \
        hf_smart_resize(height, width, min_pixels=min_pixels, max_pixels=max_pixels)


def test_smart_resize_quirks():
    # round() halves to even: 70 px = 2.5 patches of 28 -> 2 patches (56), 42 px = 1.5 -> 2 (56)
    assert smart_resize(70 * 2, 70 * 2, min_pixels=1) == hf_smart_resize(140, 140, min_pixels=1) == (140, 140)
    assert smart_resize(70, 1000, min_pixels=1) == (56, 1008)
    with pytest.raises(ValueError, match=r"aspect ratio must be smaller than 200, got 201"):
        smart_resize(10, 2010)
    with pytest.raises(ValueError, match="height must be a positive integer"):
        smart_resize(0, 100)


# ---------------------------------------------------------------------------------------------- single images vs HF
@pytest.mark.parametrize("height,width,content", [
    (224, 224, "random"),   # square, already on the grid (Pillow's same-size resize is a copy)
    (224, 336, "scene"),    # non-square, on the grid
    (240, 320, "scene"),    # needs an upscale to smart_resize's 252x308
    (333, 517, "random"),   # odd sizes, upscale on one side, downscale on the other
])
def test_images_match_hf_exactly(hf, height, width, content):
    frame = _random_frame(height, width) if content == "random" else _scene_frame(height, width)
    pre = FramePreprocessor(source_size=(height, width))
    assert pre.resolution == hf_smart_resize(height, width)
    ours, grid = pre.images(frame)
    ref, ref_grid = _hf_pixels(hf, [frame])
    assert grid.dtype == torch.long and grid.tolist() == ref_grid.tolist() == [[1, pre.grid_h, pre.grid_w]]
    assert ours.dtype == torch.float32
    assert _max_diff(ours, ref) == 0.0


def test_downscale_with_max_pixels_matches_hf():
    """A 768x576 camera frame shrunk into a 448x448 pixel budget (Pillow's bicubic antialiases)."""
    hf_small = Qwen2VLImageProcessorPil(max_pixels=448 * 448)
    frame = _scene_frame(576, 768)
    pre = FramePreprocessor(source_size=(576, 768), max_pixels=448 * 448)
    assert pre.resolution == (364, 504)
    ours, grid = pre.images(frame)
    ref, ref_grid = _hf_pixels(hf_small, [frame])
    assert grid.tolist() == ref_grid.tolist()
    assert _max_diff(ours, ref) == 0.0


def test_fixed_resolution_resizes_any_frame_like_hf(hf):
    """A configured resolution: a frame whose smart_resize lands on it is processed exactly like HF."""
    pre = FramePreprocessor(resolution=(252, 308))
    frame = _scene_frame(240, 320, index=9)
    assert _max_diff(pre.images(frame)[0], _hf_pixels(hf, [frame])[0]) == 0.0
    # and a frame of a different size still comes out on the fixed grid (a camera changing mode)
    values, grid = pre.images(_random_frame(480, 640))
    assert values.shape == (18 * 22, 3 * TEMPORAL * PATCH * PATCH) and grid.tolist() == [[1, 18, 22]]


def test_prepare_is_hf_normalized_rgb(hf):
    frame = _scene_frame(224, 336)
    image = FramePreprocessor(resolution=(224, 336)).prepare(frame)
    assert image.shape == (3, 224, 336) and image.dtype == torch.float32
    # HF's first patch row holds channel 0 (R) of the top-left 14x14 patch, time 0
    ref, _ = _hf_pixels(hf, [frame])
    first_patch = ref[0].view(3, TEMPORAL, PATCH, PATCH)[:, 0]
    assert torch.equal(image[:, :PATCH, :PATCH], first_patch)
    # BGR in, RGB out: the red channel of the image comes from frame[..., 2]
    pure_red = np.zeros((224, 336, 3), np.uint8)
    pure_red[..., 2] = 255
    red = FramePreprocessor(resolution=(224, 336)).prepare(pure_red)
    assert red[0].min() > 1.9 and red[1].max() < -1.7 and red[2].max() < -1.4


def test_non_contiguous_frames_are_fine():
    pre = FramePreprocessor(resolution=(224, 224))
    big = _random_frame(448, 600, seed=3)
    view = big[::2, 50:274]  # strided crop
    assert not view.flags["C_CONTIGUOUS"]
    assert torch.equal(pre.prepare(view), pre.prepare(np.ascontiguousarray(view)))


# ------------------------------------------------------------------------------------ frame pairs (video layout)
def _video_patchify_reference(frames_tchw: torch.Tensor) -> torch.Tensor:
    """Written from ``Qwen2VLVideoProcessor.patchify`` (batch 1, one temporal group): view as
    (b, t_groups, T, C, gh/m, m, p, gw/m, m, p), permute (0, 1, 4, 7, 5, 8, 3, 2, 6, 9), flatten."""
    t, c, h, w = frames_tchw.shape
    gh, gw = h // PATCH, w // PATCH
    patches = frames_tchw.reshape(1, t // TEMPORAL, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gh * gw, c * TEMPORAL * PATCH * PATCH)


@pytest.mark.parametrize("height,width", [(224, 224), (224, 336), (240, 320)])
def test_pair_matches_hf_video_layout(hf, height, width):
    pre = FramePreprocessor(source_size=(height, width))
    frame_a, frame_b = _scene_frame(height, width, 2), _scene_frame(height, width, 7)
    values, grid = pre.pair(frame_a, frame_b)
    gh, gw = pre.grid_h, pre.grid_w
    assert grid.dtype == torch.long and grid.tolist() == [[1, gh, gw]]
    assert values.shape == (gh * gw, 3 * TEMPORAL * PATCH * PATCH)
    assert pre.tokens_per_pair == gh * gw // 4

    # (b) the documented video layout applied to our (HF-exact) normalized frames
    stacked = torch.stack([pre.prepare(frame_a), pre.prepare(frame_b)])
    assert torch.equal(values, _video_patchify_reference(stacked))

    # (a) per frame against HF: time slot 0 of each HF image is that frame's patch, in the same order
    ref, ref_grid = _hf_pixels(hf, [frame_a, frame_b])
    assert ref_grid.tolist() == [[1, gh, gw], [1, gh, gw]]
    ref = ref.view(2, gh * gw, 3, TEMPORAL, PATCH, PATCH)
    expected = torch.stack([ref[0, :, :, 0], ref[1, :, :, 0]], dim=2).reshape(gh * gw, -1)
    assert _max_diff(values, expected) == 0.0


def test_hf_image_processor_does_not_build_video_groups(hf):
    """A stacked 2-frame array goes through HF's image path as two separate still images, each
    tiled over time, not as one temporal group: why the pair layout is checked as above."""
    frames = np.stack([_random_frame(224, 224, 1), _random_frame(224, 224, 2)])[..., ::-1].copy()
    out = hf(images=frames, return_tensors="pt", input_data_format="channels_last")
    assert out["image_grid_thw"].tolist() == [[1, 16, 16], [1, 16, 16]]
    halves = out["pixel_values"].view(2 * 256, 3, TEMPORAL, PATCH, PATCH)
    assert torch.equal(halves[:, :, 0], halves[:, :, 1])


def test_pair_order_and_image_tiling():
    pre = FramePreprocessor(resolution=(112, 168))
    frame_a, frame_b = _random_frame(112, 168, 1), _random_frame(112, 168, 2)
    ab = pre.pair(frame_a, frame_b)[0].view(-1, 3, TEMPORAL, PATCH, PATCH)
    ba = pre.pair(frame_b, frame_a)[0].view(-1, 3, TEMPORAL, PATCH, PATCH)
    assert torch.equal(ab[:, :, 0], ba[:, :, 1]) and not torch.equal(ab, ba)
    # a still image is the pair of the frame with itself
    assert torch.equal(pre.images(frame_a)[0], pre.pair(frame_a, frame_a)[0])


def test_results_are_fresh_tensors_or_the_given_out():
    pre = FramePreprocessor(resolution=(56, 56))
    first, _ = pre.pair(_random_frame(56, 56, 1), _random_frame(56, 56, 2))
    kept = first.clone()
    second, _ = pre.pair(_random_frame(56, 56, 3), _random_frame(56, 56, 4))
    assert torch.equal(first, kept) and not torch.equal(first, second)  # no aliasing of the staging buffer
    out = torch.empty(pre.num_patches, 3 * TEMPORAL * PATCH * PATCH)
    values, _ = pre.pair(_random_frame(56, 56, 3), _random_frame(56, 56, 4), out=out)
    assert values is out and torch.equal(out, second)
    with pytest.raises(ValueError, match=r"out must be a contiguous \[16, 1176\] tensor"):
        pre.pair(_random_frame(56, 56), _random_frame(56, 56), out=torch.empty(3, 3))


# ---------------------------------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize("resolution", [(500, 448), (448,), (0, 448), (448.0, 448), "448x448", (True, 28)])
def test_bad_resolution_is_refused_naming_it(resolution):
    with pytest.raises(ValueError, match="multiples of 28") as info:
        FramePreprocessor(resolution=resolution)
    assert repr(resolution) in str(info.value)


def test_resolution_or_source_size_exactly_one():
    with pytest.raises(ValueError, match="exactly one of"):
        FramePreprocessor()
    with pytest.raises(ValueError, match="exactly one of"):
        FramePreprocessor(resolution=(224, 224), source_size=(480, 640))
    pre = FramePreprocessor(source_size=(480, 640))
    assert pre.resolution == hf_smart_resize(480, 640) == (476, 644)
    assert pre.tokens_per_pair == (476 // 28) * (644 // 28)


# ---------------------------------------------------------------------------------------------- bad frames
@pytest.mark.parametrize("frame,expected", [
    (np.zeros((224, 224), np.uint8), r"2-d array of shape \(224, 224\).*grayscale"),
    (np.zeros((2, 224, 224, 3), np.uint8), r"4-d array of shape \(2, 224, 224, 3\)"),
    (np.zeros((224, 224, 4), np.uint8), r"4 channels \(shape \(224, 224, 4\)\).*BGRA"),
    (np.zeros((224, 224, 1), np.uint8), r"1 channels.*grayscale"),
    (np.zeros((224, 224, 3), np.float32), r"dtype float32 \(shape \(224, 224, 3\)\)"),
    (np.zeros((0, 224, 3), np.uint8), r"empty frame of shape \(0, 224, 3\)"),
    (torch.zeros(224, 224, 3, dtype=torch.uint8), r"got torch\.Tensor"),
    ([[0, 0, 0]], r"got builtins\.list"),
])
def test_bad_frames_are_refused_with_what_came(frame, expected):
    pre = FramePreprocessor(resolution=(224, 224))
    for call in (pre.check_frame, pre.prepare, pre.images, lambda f: pre.pair(_random_frame(224, 224), f)):
        with pytest.raises(ValueError, match="expected an HxWx3 uint8 numpy array in BGR") as info:
            call(frame)
        assert info.match(expected)


def test_group_needs_temporal_patch_size_frames():
    pre = FramePreprocessor(resolution=(56, 56))
    with pytest.raises(ValueError, match="needs 2 frames, got 3"):
        pre.group([_random_frame(56, 56)] * 3)
