"""A question about a stretch of time (``ask(..., window=(from, to))``, the chat API's ``window``): the question
reads only the frame pairs stamped in it — hidden from its attention, not removed — and, with recall, only the
archive's pairs of that stretch. Checked: what lies outside cannot change the answer (its K/V scrambled, the
answer is the same to the bit), the cache is as before, the shipped toy finds an event only in a window that
holds it, recall brings back pairs of the window only, and bad windows are refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import edgekv
from edgekv.cache import SlotKind

FPS = 2.0


def _session(model_dir, folder=None, pairs=12, **cache):
    archive = ({"dir": str(folder), "max_gib": 0.01, "segment_mib": 1.0, "top_k": 2, "when_full": "wait"}
               if folder is not None else None)
    rt = edgekv.Runtime.from_pretrained(model_dir, model={"dtype": "fp32", "device": "cpu"},
                                        video={"resolution": [56, 56], "fps": FPS},
                                        cache={"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64, **cache},
                                        generation={"max_new_tokens": 4}, **({"archive": archive} if archive else {}))
    session = rt.session()
    rng = np.random.default_rng(3)
    for i in range(2 * pairs):  # pairs stamped 0, 1, 2, ... s
        session.ingest(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8), t=i / FPS)
    return session


def _outside(session, window) -> torch.Tensor:
    n, cache = session.cache.length, session.cache
    inside = [pair for pair, t in session.pair_times.items() if window[0] <= t <= window[1]]
    return (cache.kind[:, :, :n] == int(SlotKind.VISION)) & ~torch.isin(
        cache.frame[:, :, :n], torch.tensor(inside, dtype=cache.frame.dtype))


@pytest.mark.parametrize("kv_dtype", [None, "int8", "fp8"])
def test_what_lies_outside_the_window_cannot_change_the_answer(tiny_checkpoint, kv_dtype):
    session = _session(tiny_checkpoint, **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    window, question = (3.0, 6.5), "What moved?"
    stats = session.stats()  # what a window can reach
    assert (stats["stream_t_last"], stats["pairs_held"], stats["held_t_first"], stats["held_t_last"]) == (
        11.5, 12, 0.0, 11.0)
    length = session.cache.length
    before = {name: getattr(session.cache, name)[:, :, :length].clone() for name in ("k", "v", "frame", "kind", "tpos")}
    windowed = session.ask(question, max_new_tokens=6, window=window)
    assert windowed.window_pairs == 4  # pairs stamped 3, 4, 5 and 6 s
    assert session.cache.length == length
    assert all(torch.equal(getattr(session.cache, name)[:, :, :length], before[name]) for name in before)
    whole = session.ask(question, max_new_tokens=6)
    assert session.ask(question, max_new_tokens=6, window=(-1.0, 100.0)).confidence == whole.confidence
    # scramble every key and value of the pairs outside the window: the windowed answer does not move
    outside = _outside(session, window)
    assert int(outside.sum()) > 0
    gen = torch.Generator().manual_seed(0)
    for name in ("k", "v"):  # 8-bit caches: their codes
        tensor = getattr(session.cache, name)[:, :, :length]
        noise = (torch.randn(tensor.shape, generator=gen) * (5 if tensor.is_floating_point() else 60)).to(tensor.dtype)
        tensor[outside] = noise[outside]
    again = session.ask(question, max_new_tokens=6, window=window)
    assert again.token_ids == windowed.token_ids and again.confidence == windowed.confidence
    assert session.ask(question, max_new_tokens=6).confidence != whole.confidence  # the scramble is read without


def test_a_window_of_nothing_held_and_bad_windows_are_refused_by_name(tiny_checkpoint):
    session = _session(tiny_checkpoint)
    with pytest.raises(ValueError, match=r"window 40-50 s: no frame pair of it is in the cache; the cache holds "
                                         r"stream seconds 0.0-11.0"):
        session.ask("What moved?", window=(40, 50))
    for bad, match in (((5, 1), r"window: from \(5\) is after to \(1\)"), ((float("nan"), 3), "window from: must be"),
                       ("soon", "window: expected"), ((1, True), "window to: must be")):
        with pytest.raises(ValueError, match=match):
            session.ask("What moved?", window=bad)
    assert session.stats()["questions"] == 0
    assert session.ask("What moved?", window=(np.float32(2.0), np.int64(3))).window_pairs == 2


def test_the_toy_finds_an_event_only_in_a_window_that_holds_it():
    """The shipped toy on its card's stream: the purple triangle of pair 60 (stream second 60) is named when the
    window holds it; a window that does not hold it reads another shape."""
    from edgekv.video.sources import open_source

    rt = edgekv.Runtime.from_pretrained("builtin:toy", cache={"policy": "infinipot_v", "max_tokens": 640},
                                        video={"resolution": [112, 112]}, model={"device": "cpu"})
    session = rt.session()
    for frame, t in open_source("synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"):
        session.ingest(frame, t=t)
    assert session.ask("Which shape was purple?", max_new_tokens=3).text == "triangle"
    around = session.ask("Which shape was purple?", max_new_tokens=3, window=(55, 65))
    assert around.text == "triangle" and around.window_pairs >= 1
    assert session.ask("Which shape was purple?", max_new_tokens=3, window=(0, 30)).text != "triangle"


def test_recall_with_a_window_brings_back_only_pairs_of_the_window(tiny_checkpoint, tmp_path):
    session = _session(tiny_checkpoint, tmp_path / "archive", pairs=30, policy="sliding_window", max_tokens=140)
    n, cache = session.cache.length, session.cache
    held = set(cache.frame[:, :, :n][cache.kind[:, :, :n] == int(SlotKind.VISION)].tolist())
    assert session.recall.archive.flush()
    assert session.stats()["archive_pairs"] >= 20 and held.isdisjoint({0, 1, 2, 3})  # the first pairs left it
    window = (0.0, 3.0)
    answer = session.ask("What moved?", max_new_tokens=2, recall=True, window=window)
    assert answer.recalled and all(0 <= pair <= 3 for pair in answer.recalled), answer.recalled
    assert answer.window_pairs == len(set(answer.recalled))  # none of them is in the cache any more
    with pytest.raises(ValueError, match="ask with recall"):
        session.ask("What moved?", window=window, recall=False)  # without recall nothing of it is held


def test_the_chat_window_field_is_parsed_and_checked():
    from edgekv.apps.server.openai_chat import ApiError, ChatLimits, parse_chat_request

    limits = ChatLimits(served_models=("edgekv",), max_new_tokens=16, default_new_tokens=4)
    ask = {"messages": [{"role": "user", "content": "What moved?"}]}
    assert parse_chat_request({**ask, "window": {"from": 1, "to": 2.5}}, limits).window == (1.0, 2.5)
    request = parse_chat_request({**ask, "window": {"last_s": 30}}, limits)
    assert request.window is None and request.window_last_s == 30
    for window, message in (({"from": 5}, "window: from and to are required"),
                            ({"from": 5, "to": 1}, "window: from (5.0) is after to (1.0)"),
                            ({"last_s": 0}, "window.last_s: input should be greater than 0"),
                            ({"last_s": 5, "to": 3}, "window: give either from and to, or last_s, not both"),
                            ({"from": "a", "to": "b"}, "window: from: 'a': not a wall time"),
                            ({"since": 3}, "window.since: unrecognized field"), ([1, 2], "window: expected an object")):
        with pytest.raises(ApiError) as refused:
            parse_chat_request(json.loads(json.dumps({**ask, "window": window})), limits)
        assert refused.value.message.startswith(message), refused.value.message
