"""video.skip_static: near-duplicate frame pairs skip the vision tower and prefill, time stays true."""

from __future__ import annotations

import numpy as np
import pytest

import edgekv
from edgekv.config import ConfigError, EdgeKVConfig
from edgekv.video.events import Event, EventScene, SceneStyle
from edgekv.frameskip import StaticPairSkipper, pair_distance, thumbnail


def _scene(noise: float, events: list[Event], pairs: int = 40) -> EventScene:
    return EventScene(112, 112, 2.0, 7, events, SceneStyle(noise=noise), frames=2 * pairs)


def test_thumbnail_is_the_block_mean():
    frame = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    thumb = thumbnail(frame, 4)
    assert thumb.shape == (2, 2, 3)
    assert thumb[1, 0, 2] == pytest.approx(frame[4:8, 0:4, 2].astype(np.float64).mean())
    with pytest.raises(ValueError, match="smaller than one 16x16 cell"):
        thumbnail(frame, 16)


@pytest.mark.parametrize("noise", [3.0, 6.0])
def test_static_pairs_skip_up_to_the_gap_and_events_never(noise):
    event = Event("square", "red", 17, 1, (40, 60), 9)
    scene = _scene(noise, [event])
    skipper = StaticPairSkipper(max_gap_pairs=5)
    skipped = [skipper.should_skip(*scene.pair_frames(p)) for p in range(40)]
    assert not skipped[0]                  # nothing to compare with
    assert not skipped[17] and not skipped[18]  # the event appears, then disappears: both are changes
    ingested = [p for p, s in enumerate(skipped) if not s]
    gaps = np.diff(ingested) - 1
    assert gaps.max() == 5                 # never more than max_gap_pairs in a row
    assert sum(skipped) >= 40 - 2 - 40 // 6 - 3  # static pairs are skipped, except where the gap forces one


def test_pair_distance_sees_a_small_object():
    still = np.full((112, 112, 3), 120, np.uint8)
    dot = still.copy()
    dot[50:58, 50:58] = (40, 40, 220)  # 8x8 px: 0.5 % of the frame
    a, b = thumbnail(still, 4), thumbnail(dot, 4)
    assert pair_distance(a, b, a) == pytest.approx(100.0)
    assert pair_distance(a, a, a) == 0.0


def test_config_refuses_bad_skip_values():
    with pytest.raises(ConfigError, match="video.skip_static.max_gap_pairs: must be >= 1"):
        EdgeKVConfig().with_overrides(video={"skip_static": {"enabled": True, "max_gap_pairs": 0}})
    with pytest.raises(ConfigError, match="video.skip_static.gap: unknown key"):
        EdgeKVConfig().with_overrides(video={"skip_static": {"gap": 3}})
    config = EdgeKVConfig().with_overrides(video={"skip_static": {"enabled": True}})
    assert config.video.skip_static.enabled and config.video.skip_static.threshold == 16.0
    assert "video.skip_static={enabled: true, max_gap_pairs: 8, threshold: 16.0}" in config.assignments()


def test_session_skips_and_keeps_positions_true_to_time(tiny_checkpoint):
    runtime = edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={
            "resolution": [56, 56], "fps": 2.0, "skip_static": {"enabled": True, "max_gap_pairs": 3}},
        cache={"policy": "full", "max_tokens": 512, "text_reserve_tokens": 32})
    scene = _scene(3.0, [Event("circle", "blue", 5, 1, (56, 56), 20)], pairs=9)
    session = runtime.session()
    results = []
    for pair in range(9):
        for index in (2 * pair, 2 * pair + 1):
            results.append(session.ingest(scene.frame(index), t=scene.time(index)))
    skipped = [r.skipped for r in results[1::2]]
    assert skipped == [False, True, True, True, False, False, False, True, True]
    stats = session.stats()
    assert stats["frames"] == 18 and stats["frame_pairs"] == 4 and stats["pairs_skipped"] == 5
    tokens = session.tokens_per_pair
    tpos = session.cache.tpos[0, 0, session.prefix_tokens::tokens][:4].tolist()
    tps = session.tokens_per_second
    # ingested pairs 0, 4, 5, 6 start at t = 0, 4, 5, 6 s: their temporal positions follow the clock
    assert [p - session.video_start for p in tpos] == [int(t * tps) for t in (0.0, 4.0, 5.0, 6.0)]
