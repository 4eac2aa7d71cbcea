"""What goes into the model at its edges: odd frames, odd timestamps, odd text. Each test is a probe that once
misbehaved (a refused input that changed the session, an error that named nothing useful); the shipped toy model
at small grids keeps each one well under a second."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import edgekv


def _runtime(resolution, max_tokens: int = 1024) -> edgekv.Runtime:
    return edgekv.Runtime.from_pretrained("builtin:toy", cache={"max_tokens": max_tokens, "text_reserve_tokens": 64},
                                          video={"resolution": resolution}, runtime={"threads": 1})


@pytest.fixture(scope="module")
def grid_from_first_frame() -> edgekv.Runtime:
    """``video.resolution: null``: the first frame accepted fixes the grid (smart_resize of its size)."""
    torch.set_num_threads(1)
    return _runtime(None)


def _frame(height: int, width: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


@pytest.mark.parametrize("first,t,unix,error", [
    ((1000, 1000), 0.0, None, "cannot hold the prefix"),  # its grid (1008x1008) does not fit the cap
    ((120, 160), float("nan"), None, "a timestamp must be a finite number"),
    ((120, 160), 0.0, float("nan"), "a wall time must be a finite number"),
    ((3, 900), 0.0, None, "aspect ratio"),
])
def test_a_refused_first_frame_fixes_no_grid(grid_from_first_frame, first, t, unix, error):
    """Once, the first frame's grid was fixed before the frame was checked: a frame refused for its size or its
    timestamp still chose the stream's grid, so every later frame was resized to it (one too big for the cap left a
    session that failed every pair with "policy left 15 slots; 1296 do not fit"), and the refusal went uncounted."""
    session = grid_from_first_frame.session()
    with pytest.raises(ValueError, match=error):
        session.ingest(_frame(*first), t=t, captured_unix=unix)
    assert session.preprocessor is None and session.stats()["frames_rejected"] == 1
    session.ingest(_frame(56, 56, 1), t=1.0)
    session.ingest(_frame(56, 56, 2), t=1.5)
    assert session.preprocessor.resolution == (56, 56)
    assert session.stats()["frame_pairs"] == 1 and session.cache.length == session.prefix_tokens + 4


def test_reset_lets_the_next_stream_choose_its_grid(grid_from_first_frame):
    """The grid is the stream's (smart_resize of its first frame). ``reset`` (the daemon's image session, before
    each question's images) kept the first stream's: with ``video.resolution: null`` every later image was squashed
    onto the first image's grid (a 1x1 image first: every 600x600 one after it read at 56x56)."""
    session = grid_from_first_frame.session()
    session.ingest(_frame(1, 1), t=0.0)
    session.finish_pair()
    assert session.preprocessor.resolution == (56, 56)
    session.reset()
    session.ingest(_frame(120, 160, 3), t=0.0)
    session.finish_pair()
    assert session.preprocessor.resolution == (112, 168)  # smart_resize(120, 160), as transformers' processor
    assert session.cache.length == session.prefix_tokens + 24


@pytest.fixture(scope="module")
def watching() -> "edgekv.StreamSession":
    """A toy session at a fixed 56x56 grid that has seen three frame pairs."""
    torch.set_num_threads(1)
    session = _runtime([56, 56], max_tokens=256).session()
    for index in range(6):
        session.ingest(_frame(56, 56, index), t=index * 0.5)
    return session


def _memory(session) -> tuple:
    stats = session.stats()
    return (session.cache.length, stats["frames"], stats["frame_pairs"], stats["questions"],
            session.question_logits("what is there?").sum().item())


@pytest.mark.parametrize("call,where", [
    (lambda s: s.ask("what\ud800?", max_new_tokens=2), r"question: .*\\ud800 at character 4"),
    (lambda s: s.probe("is it \udfff?"), r"question: .*\\udfff at character 6"),
    (lambda s: s.ask("what?", max_new_tokens=2, history=[("user", "hi"), ("assistant", "a\udc80")]),
     r"history\[1\]: .*\\udc80 at character 1"),
])
def test_a_lone_surrogate_in_text_is_refused_naming_where(watching, call, where):
    """A lone UTF-16 surrogate (a JSON "\\ud800" escape) reached the tokenizer: a bare ``UnicodeEncodeError`` from
    the utf-8 codec that named neither the question nor the turn it was in."""
    before = _memory(watching)
    with pytest.raises(ValueError, match="lone UTF-16 surrogate") as info:
        call(watching)
    assert info.match(where) and not isinstance(info.value, UnicodeError)
    assert _memory(watching) == before


@pytest.mark.parametrize("frame,hint", [
    (np.zeros((3, 56, 56), np.uint8), r"got 56 channels \(shape \(3, 56, 56\)\) \(channels first\? use "
                                      r"frame\.transpose\(1, 2, 0\)\)"),
    (torch.zeros(56, 56, 3, dtype=torch.uint8), r"got torch\.Tensor \(pass frame\.cpu\(\)\.numpy\(\)\)"),
])
def test_a_channels_first_array_or_a_tensor_is_refused_saying_what_to_do(watching, frame, hint):
    """A CHW array was refused as "56 channels" and a torch tensor by its type alone: the two usual slips of code
    that feeds a vision model, and the error pointed at neither."""
    before = _memory(watching)
    with pytest.raises(ValueError, match="expected an HxWx3 uint8 numpy array in BGR") as info:
        watching.ingest(frame, t=10.0)
    assert info.match(hint)
    assert _memory(watching) == before


BEYOND_FLOAT64 = 10**400  # a JSON integer literal: json.loads gives a Python int that float() cannot hold


@pytest.mark.parametrize("call,error", [
    (lambda s: s.ingest(_frame(56, 56), t=BEYOND_FLOAT64), r"t=1000.*timestamps must lie within"),
    (lambda s: s.ingest(_frame(56, 56), t=None, captured_unix=-BEYOND_FLOAT64),
     r"captured_unix=-1000.*a wall time must lie within"),
    (lambda s: s.ingest(_frame(56, 56), t=None, captured_unix=1e300), r"captured_unix=1e\+300: .*must lie within"),
    (lambda s: s.wall_window(1.7e9, BEYOND_FLOAT64), r"to=1000.*a wall time must lie within"),
    (lambda s: s.ask("what?", max_new_tokens=1, window=(-BEYOND_FLOAT64, 0.0)), None),
    (lambda s: s.forget(BEYOND_FLOAT64, BEYOND_FLOAT64), None),
])
def test_seconds_past_float64_are_numbers_too_large_not_an_overflow(watching, call, error):
    """An int past float64 (``10**400``) as a time raised ``OverflowError`` from ``float()`` — no ``ValueError``,
    so not the "bad input" a caller catches — and a wall time of 1e300 was kept, after which every question by
    the wall clock failed formatting it as a date. Now a time too large is refused by name before anything changes,
    and a window or a forget reaching past float64 is the window it says (from or to the end of time)."""
    before = _memory(watching)
    if error is None:
        call(watching)  # the question answers (every pair is before the end of time); the forget removes nothing
    else:
        with pytest.raises(ValueError, match=error):
            call(watching)
    assert _memory(watching)[:3] == before[:3]


def test_odd_sized_still_images_equal_transformers_own_processing(tiny_checkpoint):
    """Frames far from the grid (1x1, 13x7, a 10x1900 strip) with ``video.resolution: null``: one still image (a
    pair of itself) and a question give transformers' logits for the same image through its own processor
    (``Qwen2VLImageProcessorPil``) and model; 1e-4 as tests/test_session.py's streaming parity."""
    import json

    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

    limits = json.loads((tiny_checkpoint / "preprocessor_config.json").read_text())
    processor = Qwen2VLImageProcessorPil(min_pixels=limits["min_pixels"], max_pixels=limits["max_pixels"])
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    runtime = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"},
                                             video={"resolution": None}, runtime={"threads": 1},
                                             cache={"policy": "full", "max_tokens": 512, "text_reserve_tokens": 64})
    question = "What is in the picture?"
    for height, width in ((1, 1), (13, 7), (10, 1900)):
        frame = _frame(height, width, seed=height)
        session = runtime.session()
        session.ingest(frame, t=0.0)
        session.finish_pair()
        ours = session.question_logits(question)
        pixels = processor(images=[np.ascontiguousarray(frame[..., ::-1])], return_tensors="pt",
                           input_data_format="channels_last")
        grid = pixels["image_grid_thw"]
        assert grid[0, 1:].mul(14).tolist() == list(session.preprocessor.resolution)
        tokenizer, image = session.tokenizer, hf.config.image_token_id
        ids = torch.tensor([tokenizer.encode(session.layout.stream_prefix()) + [image] * (int(grid.prod()) // 4)
                            + tokenizer.encode(session.layout.question_suffix(question))])
        with torch.inference_mode():
            theirs = hf(input_ids=ids, pixel_values=pixels["pixel_values"], image_grid_thw=grid,
                        mm_token_type_ids=(ids == image).int()).logits[0, -ours.shape[0]:]
        assert (ours - theirs).abs().max().item() <= 1e-4, (height, width)
