"""edgekv.model against transformers' Qwen2_5_VLForConditionalGeneration (the oracle), both loaded from
the same directory written by ``make_tiny_checkpoint``: logits within 1e-4 (fp32) and identical greedy
32-token generations; positions and rotary tables bit-equal."""

from __future__ import annotations

import pytest
import torch

from edgekv.model import load_pretrained
from edgekv.model.rope import (apply_rotary, get_rope_index, mrope_cos_sin, position_after_vision,
                               temporal_rotary_dims, text_position_ids, vision_block_position_ids)
from edgekv.model.tiny import make_tiny_checkpoint
from helpers_checkpoints import build_prompt

transformers = pytest.importorskip("transformers")

LOGIT_TOL = 1e-4
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """preset -> (ours, HF), built lazily so each preset is written and loaded once."""
    built: dict = {}

    def get(preset: str):
        if preset not in built:
            path = make_tiny_checkpoint(tmp_path_factory.mktemp(preset) / "ckpt", preset=preset, seed=1)
            ours = load_pretrained(path)
            hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager").eval()
            built[preset] = (ours, hf)
        return built[preset]

    return get


# (preset, prompt parts). Grids are in patches (T, H, W); merged grid is H/2 x W/2.
CASES = {
    # Real vocab, GQA 2:1; non-square 6x10 merged grid with 4x4 windows -> padded edge windows; 3 frame pairs,
    # 0.5 s per pair at 2 tokens/s -> temporal ids 0, 1, 2.
    "video-nonsquare-t3": ("tiny", [("text", 7), ("video", (3, 12, 20), 0.5), ("text", 9)]),
    # GQA 4:1, untied head, custom special ids; image then video (5 pairs, 1 s each -> ids 0, 2, 4, 6, 8).
    "image+video-gqa4": ("test-gqa4", [("text", 5), ("image", (1, 8, 12)), ("text", 3),
                                       ("video", (5, 20, 12), 1.0), ("text", 6)]),
    # head_dim 32, 4:1, 56 px windows (2x2 merged) on 5x7 and 3x3 merged grids: two images of different
    # sizes, so full-attention segments are padded too.
    "two-images-hd32": ("test-hd32", [("text", 4), ("image", (1, 10, 14)), ("image", (1, 6, 6)), ("text", 5)]),
    # tokens_per_second 4 with 1/3 s per pair: interval 1.333 -> truncated ids 0, 1, 2, 4, 5.
    "video-fractional-interval": ("test-hd32", [("text", 3), ("video", (5, 8, 8), 1.0 / 3.0), ("text", 4)]),
    "text-only": ("test-gqa4", [("text", 24)]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_generation_match_transformers(models, case):
    preset, parts = CASES[case]
    ours, hf = models(preset)
    prompt = build_prompt(ours.config, parts, seed=len(case))
    with torch.inference_mode():
        expected = hf(**prompt.hf_kwargs()).logits
        got = ours(**prompt.our_kwargs())
    assert got.shape == expected.shape
    diff = (got - expected).abs().max().item()
    assert diff <= LOGIT_TOL, f"{case}: max |logit diff| {diff:.3g}"

    with torch.inference_mode():
        hf_out = hf.generate(**prompt.hf_kwargs(), attention_mask=torch.ones_like(prompt.input_ids),
                             do_sample=False, max_new_tokens=NEW_TOKENS, repetition_penalty=1.0,
                             eos_token_id=list(ours.config.eos_token_ids), pad_token_id=ours.config.eos_token_ids[0])
    hf_tokens = hf_out[0, prompt.input_ids.shape[1]:].tolist()
    our_tokens = ours.generate(prompt.input_ids, NEW_TOKENS, **prompt.vision)
    assert our_tokens == hf_tokens
    assert len(our_tokens) >= 8, "the stop token came too early for the comparison to mean much"
    if preset != "tiny":  # tiny's 0.02-std tied weights just repeat a token; test presets must not
        assert len(set(our_tokens)) >= 8, f"degenerate generation {our_tokens}"


@pytest.mark.parametrize("grids", [
    [(2, 16, 16)],  # 8x8 merged, windows exactly 4x4: the no-padding, no-mask path
    [(3, 12, 20)],  # padded windows
    [(1, 4, 30), (2, 10, 6)],  # several inputs in one call, extreme aspect ratio
    [(1, 8, 8)] * 4 + [(3, 12, 20), (1, 8, 8), (3, 12, 20)],  # a training batch: repeated rows (their layout cached)
])
def test_vision_tower_matches_transformers(models, grids):
    ours, hf = models("tiny")
    generator = torch.Generator().manual_seed(3)
    grid_thw = torch.tensor(grids)
    pixels = torch.randn(int(grid_thw.prod(-1).sum()), ours.config.vision.patch_dim, generator=generator)
    with torch.inference_mode():
        expected = torch.cat(hf.model.get_video_features(pixels, grid_thw).pooler_output)
        got = ours.encode_video(pixels, grid_thw)
        again = ours.encode_video(pixels, grid_thw)
    assert got.shape == (grid_thw.prod(-1).sum() // 4, ours.config.vision.out_hidden_size)
    assert (got - expected).abs().max().item() <= 1e-5
    assert torch.equal(got, again)
    assert ours.visual.layout(grid_thw, got.device) is ours.visual.layout(grid_thw, got.device)  # cached



def test_a_grid_of_many_rows_is_laid_out_from_each_row_shapes_cached_layout(models):
    """A toy's training batch passes a grid row per distinct frame pair (hundreds): each row shape's layout is
    built once and the rows' pieces joined (they were built row by row, ~0.07 ms a row). Same layout as the rows
    laid out one call each, offset by the units before them."""
    from edgekv.model.vision import _grid_layout, build_layout

    config = models("tiny")[0].config.vision
    rows = [(1, 8, 8)] * 150 + [(2, 12, 20)] + [(1, 8, 8)] * 50
    _grid_layout.cache_clear()
    whole = build_layout(config, rows, torch.device("cpu"))
    assert _grid_layout.cache_info().misses == 2 and _grid_layout.cache_info().hits == 199
    one = build_layout(config, [(1, 8, 8)], torch.device("cpu"))
    size = one.token_order.numel()
    assert torch.equal(whole.token_order[:size], one.token_order)
    assert torch.equal(whole.token_order[size:2 * size], one.token_order + size)  # the next row's patches
    assert torch.equal(whole.cos[:2 * size], one.cos.repeat(2, 1))

def test_get_rope_index_matches_transformers_on_mixed_inputs(models):
    ours, hf = models("test-gqa4")
    config = ours.config
    parts = [("text", 3), ("video", (3, 8, 12), 2.0), ("text", 2), ("image", (1, 6, 10)),
             ("video", (4, 4, 4), 0.25), ("text", 1), ("image", (1, 12, 4)), ("text", 5)]
    prompt = build_prompt(config, parts)
    expected, _ = hf.model.get_rope_index(prompt.input_ids, prompt.mm_token_type_ids,
                                          image_grid_thw=prompt.vision["image_grid_thw"],
                                          video_grid_thw=prompt.vision["video_grid_thw"],
                                          second_per_grid_ts=prompt.vision["second_per_grid_ts"])
    got = get_rope_index(config, prompt.input_ids, image_grid_thw=prompt.vision["image_grid_thw"],
                         video_grid_thw=prompt.vision["video_grid_thw"],
                         second_per_grid_ts=prompt.vision["second_per_grid_ts"])
    assert torch.equal(got, expected)

    # Without second_per_grid_ts a video counts 1 s per pair, as in transformers.
    expected, _ = hf.model.get_rope_index(prompt.input_ids, prompt.mm_token_type_ids,
                                          image_grid_thw=prompt.vision["image_grid_thw"],
                                          video_grid_thw=prompt.vision["video_grid_thw"])
    got = get_rope_index(config, prompt.input_ids, image_grid_thw=prompt.vision["image_grid_thw"],
                         video_grid_thw=prompt.vision["video_grid_thw"])
    assert torch.equal(got, expected)

    text_only = build_prompt(config, [("text", 11)])
    assert torch.equal(get_rope_index(config, text_only.input_ids)[:, 0], text_position_ids(0, 11))


def test_streaming_position_helpers_reproduce_a_one_shot_video(models):
    """Frame pair k of a video placed with vision_block_position_ids(start, int(k*spg*tps), h, w), and the
    text after it at position_after_vision, equal transformers' positions for the whole video."""
    ours, hf = models("tiny")
    config = ours.config
    t, h, w, spg = 6, 8, 12, 0.5
    prompt = build_prompt(config, [("text", 4), ("video", (t, h, w), spg), ("text", 3)])
    expected, _ = hf.model.get_rope_index(prompt.input_ids, prompt.mm_token_type_ids,
                                          video_grid_thw=prompt.vision["video_grid_thw"],
                                          second_per_grid_ts=prompt.vision["second_per_grid_ts"])
    start = 5  # 4 text tokens + <|vision_start|>
    lh, lw = h // 2, w // 2
    pieces = [text_position_ids(0, start)]
    for k in range(t):
        t_pos = int(k * spg * config.vision.tokens_per_second)
        pieces.append(vision_block_position_ids(start, t_pos, lh, lw))
    pieces.append(text_position_ids(position_after_vision(start, lh, lw), 4))
    assert torch.equal(torch.cat(pieces, dim=1), expected[:, 0])


def test_mrope_cos_sin_matches_transformers_rotary(models):
    for preset in ("tiny", "test-hd32"):
        ours, hf = models(preset)
        prompt = build_prompt(ours.config, [("text", 3), ("video", (3, 8, 12), 0.5), ("image", (1, 6, 4)),
                                            ("text", 2)])
        positions = get_rope_index(ours.config, prompt.input_ids, image_grid_thw=prompt.vision["image_grid_thw"],
                                   video_grid_thw=prompt.vision["video_grid_thw"],
                                   second_per_grid_ts=prompt.vision["second_per_grid_ts"])  # [3, 1, S]
        dummy = torch.zeros(1, dtype=torch.float32)
        expected_cos, expected_sin = hf.model.language_model.rotary_emb(dummy, positions)
        cos, sin = mrope_cos_sin(ours.language.inv_freq, positions[:, 0], ours.config.text.mrope_section)
        assert torch.equal(cos, expected_cos[0]) and torch.equal(sin, expected_sin[0])


def test_temporal_rotary_dims_are_the_only_dims_that_move_with_time():
    section, head_dim = (16, 24, 24), 128
    dims = temporal_rotary_dims(section, head_dim)
    assert dims.tolist() == list(range(16)) + list(range(64, 80))
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    positions = vision_block_position_ids(7, 3, 4, 5)
    moved = positions.clone()
    moved[0] += 11
    x = torch.randn(2, positions.shape[1], head_dim, dtype=torch.float64)
    a = apply_rotary(x, *mrope_cos_sin(inv_freq, positions, section))
    b = apply_rotary(x, *mrope_cos_sin(inv_freq, moved, section))
    other = torch.ones(head_dim, dtype=torch.bool)
    other[dims] = False
    assert torch.equal(a[..., other], b[..., other])
    assert not torch.allclose(a[..., dims], b[..., dims])


def test_video_encoded_pair_by_pair_equals_one_shot(models):
    """The ViT never attends across temporal slices, so streaming one frame pair at a time (grid [1, H, W])
    gives the same tokens as encoding the whole video (grid [T, H, W]) — what StreamSession relies on."""
    ours, _ = models("tiny")
    t, h, w = 3, 12, 20
    pixels = torch.randn(t * h * w, ours.config.vision.patch_dim, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        whole = ours.encode_video(pixels, torch.tensor([[t, h, w]]))
        pairs = [ours.encode_video(chunk, torch.tensor([[1, h, w]])) for chunk in pixels.chunk(t)]
    assert torch.allclose(torch.cat(pairs), whole, atol=1e-6, rtol=0)
