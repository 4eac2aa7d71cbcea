"""The randomized world (edgekv/video/world.py), the classic renderer kept bit for bit, and the
``synthetic:world`` source.

Photograph and video families need files found at run time (opencv-doc's examples/data, scikit-image's
data folder); their tests skip, saying which package to install, where they are absent.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from edgekv.video.events import COLOR_BGR, COLORS, SHAPES, Event, scene_from_params, shape_mask
from edgekv.video.world import (DEFAULT_HOLDOUT, DISTRACTOR_BGR, FAMILIES, ONE_CELL_RADIUS, PROCEDURAL, WorldPlan,
                                WorldScene, WorldStyle, available_families, drawable_families, family_problem,
                                jpeg_roundtrip, parse_families, world_events, world_radius_range, world_scene)

FIXTURES = Path(__file__).parent / "fixtures"


def _needs(family: str) -> None:
    problem = family_problem(family)
    if problem is not None:
        pytest.skip(problem)


def _event(shape="circle", color="red", first=2, pairs=1, center=(56, 56), radius=16) -> Event:
    return Event(shape, color, first, pairs, center, radius)


# ---------------------------------------------------------------------------------------------- classic
def test_the_classic_renderer_is_unchanged():
    """synthetic:events frames and schedules as rendered at commit 7a3e246 (before the world existed):
    the fixture holds them (tests/fixtures/classic_events_frames.npz, written by that commit's
    edgekv.video.events). Schedules exactly; pixels exactly but for float rounding across numpy builds
    (at most one level on at most 0.1 % of the values)."""
    fixture = np.load(FIXTURES / "classic_events_frames.npz")
    frames = []
    for seed in (0, 7):
        scene = scene_from_params(size=(112, 112), frames=60, seed=seed, rate=0.2, duration=(1, 3), noise=3.0,
                                  drift=0.3, light=0.1, distractors=2)
        frames += [scene.frame(i) for i in (0, 13, 41)]
        events = [(SHAPES.index(e.shape), COLORS.index(e.color), e.first_pair, e.pairs, *e.center, e.radius)
                  for e in scene.events]
        assert np.array_equal(np.array(events), fixture[f"events{seed}"])
    difference = np.abs(np.stack(frames).astype(np.int16) - fixture["frames"].astype(np.int16))
    assert difference.max() <= 1 and (difference > 0).mean() <= 1e-3


# ---------------------------------------------------------------------------------------------- families
@pytest.mark.parametrize("family", PROCEDURAL)
@pytest.mark.parametrize("size", [112, 224])
def test_procedural_families_are_deterministic_and_differ_by_seed(family, size):
    one = world_scene((size, size), frames=20, seed=4, families=(family,))
    again = world_scene((size, size), frames=20, seed=4, families=(family,))
    other = world_scene((size, size), frames=20, seed=5, families=(family,))
    assert one.family == family
    frame = one.frame(3)
    assert frame.shape == (size, size, 3) and frame.dtype == np.uint8
    assert np.array_equal(frame, again.frame(3))
    assert not np.array_equal(frame, other.frame(3))
    assert frame.std() > 3  # a textured background, not a flat field


@pytest.mark.parametrize("family", ["photo", "skimage", "vtest", "tree"])
def test_real_image_families_draw_their_files(family):
    _needs(family)
    scene = world_scene((112, 112), frames=40, seed=1, families=(family,), randomize=False, noise=0.0)
    first, later = scene.frame(0), scene.frame(30)
    assert first.shape == (112, 112, 3) and first.std() > 5
    moving = family in ("vtest", "tree")
    assert np.array_equal(first, later) != moving  # photographs stand still, videos play


def test_events_are_drawn_in_their_colour_on_every_background():
    style = WorldStyle(noise=0.0)
    for family in PROCEDURAL:
        event = _event("triangle", "blue", first=1, pairs=2, center=(40, 70), radius=20)
        scene = WorldScene(112, 112, 2.0, 3, [event], family, style, frames=10)
        mask = shape_mask("triangle", (40, 70), 20, 112, 112)
        for frame in (2, 3, 4, 5):
            assert np.array_equal(scene.frame(frame)[mask], np.broadcast_to(COLOR_BGR["blue"], (mask.sum(), 3)))
        assert not (scene.frame(0)[mask] == COLOR_BGR["blue"]).all(axis=1).any()  # before it appears: not there


def test_drift_and_shake_move_the_background_and_the_event_with_it():
    event = _event("square", "green", first=20, pairs=6, center=(56, 56), radius=14)
    scene = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, drift=0.5, shake=1.0), frames=80)
    assert not np.array_equal(scene.frame(0), scene.frame(60))  # the camera moved
    green = np.array(COLOR_BGR["green"])
    centres = []
    for frame in range(40, 52):
        ys, xs = np.nonzero((scene.frame(frame) == green).all(axis=2))
        centres.append((xs.mean(), ys.mean()))
    spread = np.ptp(np.array(centres), axis=0)
    assert 0 < spread.max() <= 8  # the square moves a little with the camera, never far


def test_occlusion_hides_part_of_an_event_and_the_ground_truth_follows():
    hidden = []
    for seed in range(40):
        event = _event("circle", "yellow", first=0, pairs=1, center=(56, 56), radius=24)
        scene = WorldScene(112, 112, 2.0, seed, [event], "gradient", WorldStyle(noise=0.0, occlusion=1.0), frames=4)
        full = shape_mask("circle", (56, 56), 24, 112, 112)
        shown = scene.mask(event)
        assert (shown <= full).all()
        frame = scene.frame(0)
        assert (frame[shown] == COLOR_BGR["yellow"]).all()
        hidden.append(1 - shown.sum() / full.sum())
        assert scene.cell_cover(event).sum() == pytest.approx(shown[:112, :112].reshape(4, 28, 4, 28).mean(axis=(1, 3)).sum())
    assert max(hidden) <= 0.4 and np.mean(hidden) > 0.1


def test_distractors_are_outside_the_vocabulary():
    scene = WorldScene(112, 112, 2.0, 2, [], "gradient", WorldStyle(noise=0.0, distractors=3, transients=0.5),
                       frames=200)
    assert len(scene.clutter) == 3
    assert all(c.shape not in SHAPES for c in scene.clutter)
    transient = [c for pair in range(100) for c in scene.transients(pair)]
    assert transient and all(c.shape not in SHAPES and c.color not in COLORS for c in transient)
    vocabulary = {tuple(v) for v in COLOR_BGR.values()}
    assert not vocabulary & {tuple(v) for v in DISTRACTOR_BGR.values()}
    frame = scene.frame(10)
    pixels = {tuple(p) for p in frame.reshape(-1, 3)}
    assert not pixels & vocabulary  # no vocabulary colour anywhere without an event


def test_lures_are_transients_in_vocabulary_colours_never_vocabulary_shapes():
    plain = WorldScene(112, 112, 2.0, 5, [], "gradient", WorldStyle(noise=0.0, transients=0.8), frames=400)
    lured = WorldScene(112, 112, 2.0, 5, [], "gradient", WorldStyle(noise=0.0, transients=0.8, lures=1.0), frames=400)
    half = WorldScene(112, 112, 2.0, 5, [], "gradient", WorldStyle(noise=0.0, transients=0.8, lures=0.5), frames=400)
    a, b, c = ([x for pair in range(200) for x in s.transients(pair)] for s in (plain, lured, half))
    # the same objects, places and times; only the colour is drawn from the vocabulary
    assert len(a) == len(b) == len(c) > 50
    assert [(x.shape, x.center, x.first_pair) for x in a] == [(x.shape, x.center, x.first_pair) for x in b]
    assert all(x.color in DISTRACTOR_BGR for x in a) and all(x.color in COLORS for x in b)
    assert all(x.shape not in SHAPES for x in b + c)
    share = np.mean([x.color in COLORS for x in c])
    assert 0.3 < share < 0.7
    pair = next(p for p in range(200) if lured.transients(p))
    item = lured.transients(pair)[0]
    pixels = {tuple(p) for p in lured.frame(2 * pair).reshape(-1, 3)}
    assert tuple(COLOR_BGR[item.color]) in pixels  # drawn in its vocabulary colour
    with pytest.raises(ValueError, match="lures"):
        WorldStyle(lures=1.5)


def test_lure_cells_are_the_cells_where_the_lures_are_drawn():
    """``WorldScene.lure_cells(pair)``: the merged-grid cells where a lure shows in either frame of the pair, camera
    drift and shake included: where the lured render differs from the same scene's render with the same transients
    in distractor colours, and nowhere else; no lures, no cells."""
    style = WorldStyle(noise=0.0, transients=0.8, drift=0.5, shake=1.0, light=0.0)
    plain = WorldScene(112, 112, 2.0, 7, [], "checks", style, frames=200)
    lured = WorldScene(112, 112, 2.0, 7, [], "checks", replace(style, lures=1.0), frames=200)
    marked = 0
    for pair in range(60):
        differs = np.zeros((112, 112), dtype=bool)
        for index in (2 * pair, 2 * pair + 1):
            differs |= (plain.frame(index) != lured.frame(index)).any(axis=2)
        cells = differs[:112, :112].reshape(4, 28, 4, 28).any(axis=(1, 3))
        assert np.array_equal(lured.lure_cells(pair), cells), pair
        assert not plain.lure_cells(pair).any()
        marked += int(cells.sum())
    assert marked > 20  # the stream shows lures


def test_lure_colors_and_shapes_choose_the_lures_looks_and_leave_places_and_times_alone():
    style = WorldStyle(noise=0.0, transients=0.8, lures=1.0)
    default = WorldScene(112, 112, 2.0, 5, [], "gradient", style, frames=400)
    named = WorldScene(112, 112, 2.0, 5, [], "gradient", replace(style, lure_colors=COLORS), frames=400)
    looks = WorldScene(112, 112, 2.0, 5, [], "gradient",
                       replace(style, lure_colors=("red", "blue"), lure_shapes=("ring", "ellipse")), frames=400)
    half = WorldScene(112, 112, 2.0, 5, [], "gradient",
                      replace(style, lures=0.5, lure_colors=("red",), lure_shapes=("ring",)), frames=400)
    a, b, c, d = ([x for pair in range(200) for x in s.transients(pair)] for s in (default, named, looks, half))
    assert a == b  # the whole vocabulary named: the lures drawn before lure_colors existed
    assert len(a) == len(c) == len(d) > 50
    assert [(x.center, x.first_pair, x.pairs) for x in a] == [(x.center, x.first_pair, x.pairs) for x in c]
    assert {x.color for x in c} == {"red", "blue"} and {x.shape for x in c} == {"ring", "ellipse"}
    assert {x.shape for x in a} - {"ring", "ellipse"}  # the default draws other look-alikes too
    lured = [x for x in d if x.color in COLORS]  # at a share, only the lures take the chosen looks
    assert 0.3 < len(lured) / len(d) < 0.7 and {(x.color, x.shape) for x in lured} == {("red", "ring")}
    assert {x.shape for x in d if x.color not in COLORS} - {"ring"}
    for field, value in (("lure_colors", ("orange",)), ("lure_shapes", ("circle",)), ("lure_shapes", "ring")):
        with pytest.raises(ValueError, match=f"world {field}: a tuple of"):
            WorldStyle(**{field: value})


def test_tone_regrades_the_background_only_and_tone_zero_draws_what_it_drew_before():
    from edgekv.video.world import apply_tone, background_tone

    event = _event(radius=18)
    plain = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0), frames=40)
    zero = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, tone=0.0), frames=40)
    toned = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, tone=1.0), frames=40)
    again = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, tone=1.0), frames=40)
    a, b, c = plain.frame(4), toned.frame(4), again.frame(4)
    assert np.array_equal(a, zero.frame(4)) and np.array_equal(b, c)  # tone 0: bit for bit; seeded: the same
    shown = zero.mask(event)
    assert np.array_equal(a[shown], b[shown])  # the needle keeps its colour exactly
    assert np.all(b[shown] == COLOR_BGR["red"])
    assert np.abs(a[~shown].astype(int) - b[~shown].astype(int)).mean() > 3  # the background is re-graded
    assert np.array_equal(toned.frame(0), toned.frame(2))  # a still background stays still
    # strength 0 is the identity, grey stays grey at any strength, and the tones differ from stream to stream
    canvas = np.random.default_rng(0).uniform(0, 255, (8, 8, 3)).astype(np.float32)
    identity = background_tone(np.random.default_rng(1), 0.0)
    assert np.allclose(apply_tone(canvas, identity), canvas, atol=1e-3)
    grey = np.full((2, 2, 3), 100.0, np.float32)
    for seed in range(5):
        out = apply_tone(grey, background_tone(np.random.default_rng(seed), 1.0))
        assert np.allclose(out, out[..., :1], atol=1e-3)
    gammas = {round(background_tone(np.random.default_rng(seed), 1.0).gamma, 3) for seed in range(6)}
    assert len(gammas) == 6
    with pytest.raises(ValueError, match="tone"):
        WorldStyle(tone=1.5)
    with pytest.raises(ValueError, match="tone"):
        WorldStyle(tone=-0.1)


def test_exposure_whitens_part_of_the_background_only_and_exposure_zero_draws_what_it_drew_before():
    from edgekv.video.world import MAX_EXPOSURE, exposure_map

    event = _event(color="white", radius=18)
    plain = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0), frames=40)
    zero = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, exposure=0.0), frames=40)
    exposed = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, exposure=2.0), frames=40)
    again = WorldScene(112, 112, 2.0, 9, [event], "checks", WorldStyle(noise=0.0, exposure=2.0), frames=40)
    a, b = plain.frame(4).astype(int), exposed.frame(4).astype(int)
    assert np.array_equal(a, zero.frame(4)) and np.array_equal(b, again.frame(4))  # 0: bit for bit; seeded
    shown = zero.mask(event)
    assert np.all(b[shown] == COLOR_BGR["white"])  # the event keeps its colour exactly
    background = ~shown
    unchanged = np.all(a == b, axis=2) & background
    whitened = np.all(b >= 250, axis=2) & ~np.all(a >= 250, axis=2) & background
    brighter = np.all(b >= a, axis=2) & background
    # part of the background is left as it was, part turned white, none of it darkened
    assert unchanged.mean() > 0.02 and whitened.mean() > 0.1 and brighter.sum() == background.sum()
    assert np.array_equal(exposed.frame(0), exposed.frame(2))  # a still background stays still
    # the map: 1 where nothing changes, 1 + exposure at most, a soft edge (no step over a quarter of the exposure
    # between neighbouring pixels)
    gains = exposure_map(np.random.default_rng(3), 120, 100, 1.5)
    assert gains.shape == (120, 100) and gains.min() == pytest.approx(1.0) and gains.max() == pytest.approx(2.5)
    assert np.abs(np.diff(gains, axis=0)).max() < 0.375 and np.abs(np.diff(gains, axis=1)).max() < 0.375
    maps = {exposure_map(np.random.default_rng(seed), 32, 32, 1.0).tobytes() for seed in range(4)}
    assert len(maps) == 4  # one map a stream
    with pytest.raises(ValueError, match="exposure must be at most 3"):
        WorldStyle(exposure=MAX_EXPOSURE + 0.5)
    with pytest.raises(ValueError, match="exposure"):
        WorldStyle(exposure=-0.1)


def test_transients_render_the_same_frames_going_back_in_a_long_stream():
    # a needle stream is encoded front to back, then its ceiling and replays ask for early pairs again: the
    # per-block transients forgotten on the way must be redrawn the same (a KeyError once lost block 0)
    style = WorldStyle(noise=0.0, transients=0.5)
    scene = WorldScene(112, 112, 2.0, 4, [], "gradient", style, frames=2 * 600)
    first = [scene.frame(2 * pair) for pair in (0, 33, 70)]
    for pair in range(0, 600, 7):
        scene.transients(pair)
    assert len(scene._blocks) <= 8
    again = [scene.frame(2 * pair) for pair in (0, 33, 70)]
    fresh = WorldScene(112, 112, 2.0, 4, [], "gradient", style, frames=2 * 600)
    for a, b, c in zip(first, again, [fresh.frame(2 * pair) for pair in (0, 33, 70)]):
        assert np.array_equal(a, b) and np.array_equal(a, c)
    assert any(scene.transients(pair) for pair in range(0, 96))


def test_light_noise_and_jpeg_change_frames_and_keep_them_valid():
    event = _event(radius=20)
    plain = WorldScene(112, 112, 2.0, 1, [event], "noise", WorldStyle(noise=0.0), frames=400)
    lit = WorldScene(112, 112, 2.0, 1, [event], "noise", WorldStyle(noise=0.0, light=0.3, switch=0.2,
                                                                      switch_period=10), frames=400)
    assert not np.array_equal(plain.frame(100), lit.frame(100))
    compressed = jpeg_roundtrip(plain.frame(4), 30)
    assert compressed.shape == (112, 112, 3) and compressed.dtype == np.uint8
    difference = np.abs(compressed.astype(int) - plain.frame(4).astype(int))
    assert 0 < difference.mean() < 12


def test_world_event_sizes_and_durations():
    rng = np.random.default_rng(0)
    low, high = world_radius_range(112, 112)
    assert low == ONE_CELL_RADIUS and high == 31 and world_radius_range(224, 224)[1] == 62
    events = [e for _ in range(40) for e in world_events(rng, 400, WorldPlan(rate=0.2, duration=(1, 8)))]
    radii = np.array([e.radius for e in events])
    assert radii.min() >= low and radii.max() <= high and (radii < 20).mean() > 0.3  # log-uniform: small ones common
    assert {e.pairs for e in events} >= {1, 8}
    recoloured = 0
    for _ in range(20):
        stream = world_events(rng, 400, WorldPlan(rate=0.3))
        for shape in SHAPES:
            colours = [e.color for e in stream if e.shape == shape]
            recoloured += any(a != b for a, b in zip(colours, colours[1:]))
    assert recoloured > 20  # shapes come back in another colour (binding, second)


# ---------------------------------------------------------------------------------------------- holding out
def test_families_parse_groups_and_refuse_unknown_names():
    assert parse_families("photos,classic") == ("photo", "skimage", "classic")
    assert parse_families("all") == FAMILIES
    with pytest.raises(ValueError, match="unknown background family 'marble'.*known: classic"):
        parse_families("noise,marble")


def test_held_out_families_are_never_drawn():
    holdout = ("cells", "noise")
    drawn = {world_scene((112, 112), frames=4, seed=s, families=PROCEDURAL, holdout=holdout).family
             for s in range(60)}
    assert drawn == set(PROCEDURAL) - set(holdout)
    assert set(drawable_families(None, DEFAULT_HOLDOUT)) == set(available_families()) - set(DEFAULT_HOLDOUT)
    with pytest.raises(ValueError, match="no background family left.*cells: held out"):
        drawable_families(("cells",), ("cells",))


# ---------------------------------------------------------------------------------------------- source
def test_world_source_spec_gives_frames_and_ground_truth():
    from edgekv.video.sources import iter_frames, open_source, parse_spec

    spec = "synthetic:world?size=112x112&frames=40&seed=3&rate=0.2&families=procedural&holdout=cells,stripes&jpeg=0"
    source = open_source(spec)
    frames = list(iter_frames(source))
    again = list(iter_frames(open_source(spec)))
    assert len(frames) == 40 and all(np.array_equal(a[0], b[0]) for a, b in zip(frames, again))
    assert source.scene.family in set(PROCEDURAL) - {"cells", "stripes"} and source.scene.style.jpeg == 0
    assert source.scene.events and all(e.last_pair < 20 for e in source.scene.events)
    assert parse_spec("synthetic:world?families=photo").params["families"] == ("photo",)
    with pytest.raises(ValueError, match="unknown background family 'wood'"):
        parse_spec("synthetic:world?families=wood")
    with pytest.raises(ValueError, match="no background family left"):
        open_source("synthetic:world?families=cells&holdout=cells")
    lured = open_source("synthetic:world?size=112x112&frames=40&seed=3&families=noise&transients=0.6&lures=1")
    assert (lured.scene.style.transients, lured.scene.style.lures) == (0.6, 1.0)
    assert all(c.color in COLORS for p in range(20) for c in lured.scene.transients(p))
    with pytest.raises(ValueError, match="synthetic:world\\?lures=2.*lures must be at most 1"):
        open_source("synthetic:world?lures=2")
    looks = open_source("synthetic:world?size=112x112&frames=40&seed=3&families=noise&transients=0.6&lures=1"
                        "&lure_colors=red,blue&lure_shapes=ring")
    passing = [c for p in range(20) for c in looks.scene.transients(p)]
    assert passing and {c.color for c in passing} <= {"red", "blue"} and {c.shape for c in passing} == {"ring"}
    with pytest.raises(ValueError, match="bad value 'ring,circle' for 'lure_shapes'.*unknown: circle"):
        parse_spec("synthetic:world?lures=1&lure_shapes=ring,circle")
    toned = open_source("synthetic:world?size=112x112&frames=40&seed=3&families=noise&tone=0.8")
    assert toned.scene.style.tone == 0.8
    with pytest.raises(ValueError, match="synthetic:world\\?tone=1.5.*tone must be at most 1"):
        open_source("synthetic:world?tone=1.5")
    exposed = open_source("synthetic:world?size=112x112&frames=40&seed=3&families=noise&exposure=1.2")
    assert exposed.scene.style.exposure == 1.2
    with pytest.raises(ValueError, match="synthetic:world\\?exposure=4.*exposure must be at most 3"):
        open_source("synthetic:world?exposure=4")
