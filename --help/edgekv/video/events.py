"""Synthetic event streams with ground truth: the scenes the toy model is trained and judged on.

A scene is a background that stays still or drifts slowly (smooth low-saturation texture, fixed grain,
per-frame sensor noise, optional lighting change and grey distractor blobs) on which, at chosen frame
pairs, **events** happen: a filled shape of one colour at one place, present for one or a few frame
pairs. The vocabulary is fixed so that any tool can ask about it (``edgekv.toy.questions``):

    shapes  circle square triangle cross
    colours red green blue yellow white purple

Events are aligned to frame pairs (frames ``2k`` and ``2k + 1``), the model's unit
(``temporal_patch_size = 2``): an event never covers half a pair. Everything is a pure function of the
seed and the parameters (``EventScene.frame(i)`` renders frame ``i`` on demand, nothing is stored per
frame), and numpy-only, so training and the benchmarks need no OpenCV.

The ground truth (``EventScene.events``) says what, when (pair index and seconds) and where (centre and
radius in pixels); ``EventScene.cell_cover`` says which merged-grid cells (28 x 28 px: one LLM token)
an event covers, which the training sampler uses to know which tokens carry it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
COLORS: tuple[str, ...] = ("red", "green", "blue", "yellow", "white", "purple")
# BGR (OpenCV order, what ``session.ingest`` takes). Saturated, far from the low-saturation background.
COLOR_BGR: dict[str, tuple[int, int, int]] = {
    "red": (30, 30, 225), "green": (40, 200, 40), "blue": (225, 70, 20),
    "yellow": (30, 225, 235), "white": (250, 250, 250), "purple": (200, 40, 170),
}
BASE_SIZE = 112  # the radius range and distractor sizes are given at 112 x 112 and scale with the frame


@dataclass(frozen=True)
class Event:
    """One appearance: ``shape`` of ``color`` centred at ``center`` (x, y px) for ``pairs`` frame pairs
    starting at pair ``first_pair`` (frames ``2 * first_pair`` .. ``2 * (first_pair + pairs) - 1``)."""

    shape: str
    color: str
    first_pair: int
    pairs: int
    center: tuple[int, int]
    radius: int

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"event shape {self.shape!r} is not one of {', '.join(SHAPES)}")
        if self.color not in COLORS:
            raise ValueError(f"event color {self.color!r} is not one of {', '.join(COLORS)}")
        if self.first_pair < 0 or self.pairs < 1 or self.radius < 1:
            raise ValueError(f"event {self}: needs first_pair >= 0, pairs >= 1 and radius >= 1")

    @property
    def last_pair(self) -> int:
        return self.first_pair + self.pairs - 1

    def active(self, pair: int) -> bool:
        return self.first_pair <= pair <= self.last_pair

    def seconds(self, fps: float) -> tuple[float, float]:
        """(first frame time, last frame time) in seconds at ``fps``."""
        return 2 * self.first_pair / fps, (2 * (self.last_pair + 1) - 1) / fps

    def describe(self, fps: float | None = None) -> str:
        when = f"pairs {self.first_pair}-{self.last_pair}" if self.pairs > 1 else f"pair {self.first_pair}"
        if fps:
            start, end = self.seconds(fps)
            when += f" ({start:.1f}-{end:.1f} s)"
        return f"{self.color} {self.shape} at ({self.center[0]}, {self.center[1]}) r={self.radius}, {when}"


@dataclass(frozen=True)
class SceneStyle:
    """How the background behaves. Sizes in pixels at 112 x 112; they scale with the frame."""

    noise: float = 3.0          # per-frame Gaussian sensor noise, std in uint8 levels
    drift: float = 0.0          # background motion, px per frame pair (bounces inside a margin)
    light: float = 0.0          # lighting change: brightness gain amplitude (0.2 = +-20 %)
    light_period: float = 120.0  # frame pairs per lighting cycle
    distractors: int = 0        # grey blobs wandering over the background (never asked about)

    def __post_init__(self) -> None:
        for name in ("noise", "drift", "light", "distractors"):
            if getattr(self, name) < 0:
                raise ValueError(f"scene {name}: must be >= 0, got {getattr(self, name)}")
        if self.light >= 1.0:
            raise ValueError(f"scene light: must be below 1, got {self.light}")
        if self.light_period <= 0:
            raise ValueError(f"scene light_period: must be > 0, got {self.light_period}")


def _texture(height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A smooth low-saturation colour field (levels ~55-175) with fixed fine grain, float32 HxWx3."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    base = rng.uniform(90, 140)
    luminance = np.full((height, width), base, dtype=np.float32)
    for _ in range(3):
        period = rng.uniform(25, 90, size=2).astype(np.float32)
        phase = rng.uniform(0, 2 * np.pi, size=2).astype(np.float32)
        luminance += rng.uniform(6, 14) * np.sin(xs / period[0] + phase[0]) * np.cos(ys / period[1] + phase[1])
    tint = rng.uniform(-12, 12, size=3).astype(np.float32)
    grain = rng.normal(0, 5, size=(height, width, 3)).astype(np.float32)
    return np.clip(luminance[..., None] + tint + grain, 0, 255).astype(np.float32)


@functools.lru_cache(maxsize=8)
def _pixel_grid(height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.mgrid[0:height, 0:width]
    ys.flags.writeable = xs.flags.writeable = False
    return ys, xs


def shape_mask(shape: str, center: tuple[float, float], radius: float, height: int, width: int) -> np.ndarray:
    """HxW bool: the filled ``shape`` (circle, square, upward triangle, plus-sign cross)."""
    ys, xs = _pixel_grid(height, width)
    dx, dy = xs - center[0], ys - center[1]
    if shape == "circle":
        return dx * dx + dy * dy <= radius * radius
    if shape == "square":
        side = radius * 0.85  # same area order as the circle
        return (np.abs(dx) <= side) & (np.abs(dy) <= side)
    if shape == "triangle":
        # apex at (0, -r), base from (-r, r) to (r, r): inside when below the two edges and above the base
        return (dy <= radius) & (dy >= -radius + 2 * np.abs(dx))
    if shape == "cross":
        bar = max(1.0, radius / 2.8)
        return ((np.abs(dx) <= radius) & (np.abs(dy) <= bar)) | ((np.abs(dy) <= radius) & (np.abs(dx) <= bar))
    raise ValueError(f"shape {shape!r} is not one of {', '.join(SHAPES)}")


@dataclass
class EventScene:
    """Renders frames of one stream; ``events`` is its ground truth."""

    width: int = 112
    height: int = 112
    fps: float = 2.0
    seed: int = 0
    events: list[Event] = field(default_factory=list)
    style: SceneStyle = field(default_factory=SceneStyle)
    frames: int | None = None  # length in frames (None: unbounded)

    def __post_init__(self) -> None:
        if self.width < 28 or self.height < 28:
            raise ValueError(f"scene size {self.width}x{self.height}: both sides must be at least 28 px")
        if not self.fps > 0:
            raise ValueError(f"scene fps must be > 0, got {self.fps}")
        self.events = sorted(self.events, key=lambda e: (e.first_pair, e.shape, e.color))
        rng = np.random.default_rng((self.seed, 17))
        self.scale = min(self.width, self.height) / BASE_SIZE
        self.margin = int(math.ceil(self.style.drift * 8)) if self.style.drift else 0
        self._texture = _texture(self.height + 2 * self.margin, self.width + 2 * self.margin, rng)
        self._drift_dir = rng.uniform(0, 2 * np.pi)
        self._light_phase = rng.uniform(0, 2 * np.pi)
        self._distractors = [
            {"origin": rng.uniform(0, 1, size=2), "velocity": rng.uniform(0.004, 0.02, size=2) * rng.choice([-1, 1], 2),
             "radius": rng.uniform(5, 10) * self.scale, "level": rng.uniform(40, 200)}
            for _ in range(self.style.distractors)
        ]
        self._masks: dict[Event, np.ndarray] = {}

    # ------------------------------------------------------------------ rendering
    @property
    def pairs(self) -> int | None:
        return None if self.frames is None else self.frames // 2

    def background(self, pair: int) -> np.ndarray:
        """The noise-free background of frame pair ``pair`` (float32 HxWx3), drift and light applied."""
        image = self._texture
        if self.margin:
            travel = self.style.drift * pair
            ox = self.margin + _bounce(travel * math.cos(self._drift_dir), self.margin)
            oy = self.margin + _bounce(travel * math.sin(self._drift_dir), self.margin)
            image = image[int(oy):int(oy) + self.height, int(ox):int(ox) + self.width]
        if self.style.light:
            gain = 1.0 + self.style.light * math.sin(2 * math.pi * pair / self.style.light_period + self._light_phase)
            image = image * gain
        return image

    def mask(self, event: Event) -> np.ndarray:
        found = self._masks.get(event)
        if found is None:
            found = shape_mask(event.shape, event.center, event.radius, self.height, self.width)
            self._masks[event] = found
        return found

    def active(self, pair: int) -> list[Event]:
        return [event for event in self.events if event.active(pair)]

    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` as a new HxWx3 uint8 BGR array."""
        pair = index // 2
        image = self.background(pair).copy()
        for blob in self._distractors:
            u = _bounce(blob["origin"][0] + blob["velocity"][0] * index, 1.0)
            v = _bounce(blob["origin"][1] + blob["velocity"][1] * index, 1.0)
            inside = shape_mask("circle", (u * (self.width - 1), v * (self.height - 1)), blob["radius"],
                                self.height, self.width)
            image[inside] = blob["level"]
        for event in self.active(pair):
            image[self.mask(event)] = COLOR_BGR[event.color]
        if self.style.noise:
            noise = np.random.default_rng((self.seed, 23, index)).standard_normal(image.shape, dtype=np.float32)
            image = image + self.style.noise * noise
        return np.clip(image, 0, 255).astype(np.uint8)

    def pair_frames(self, pair: int) -> tuple[np.ndarray, np.ndarray]:
        return self.frame(2 * pair), self.frame(2 * pair + 1)

    def time(self, index: int) -> float:
        return index / self.fps

    # ------------------------------------------------------------------ ground truth per token
    def cell_cover(self, event: Event, cell: int = 28) -> np.ndarray:
        """[rows, cols] float: the share of each ``cell`` x ``cell`` merged-grid cell the event covers."""
        mask = self.mask(event)
        rows, cols = self.height // cell, self.width // cell
        cropped = mask[: rows * cell, : cols * cell].reshape(rows, cell, cols, cell)
        return cropped.mean(axis=(1, 3))


def _bounce(x: float, span: float) -> float:
    """Triangle wave in [0, span] (``span`` > 0): a position that reflects off the edges."""
    if span <= 0:
        return 0.0
    x = x % (2 * span)
    return 2 * span - x if x > span else x


# ---------------------------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class EventPlan:
    """How to draw a random schedule of events (``random_events``)."""

    rate: float = 0.05                  # expected new events per frame pair
    duration: tuple[int, int] = (1, 2)  # frame pairs an event lasts (inclusive range)
    radius: tuple[int, int] = (8, 18)   # px at 112 x 112 (scaled with the frame)
    max_per_shape: int = 3              # the count question's answers stop at three
    gap: int = 1                        # at least this many empty pairs between two events

    def __post_init__(self) -> None:
        if not 0 <= self.rate <= 1:
            raise ValueError(f"event rate must be in [0, 1] per frame pair, got {self.rate}")
        if not 1 <= self.duration[0] <= self.duration[1]:
            raise ValueError(f"event duration must be [min, max] frame pairs with 1 <= min <= max, got {self.duration}")
        if not 1 <= self.radius[0] <= self.radius[1]:
            raise ValueError(f"event radius must be [min, max] px with 1 <= min <= max, got {self.radius}")


def place_event(rng: np.random.Generator, shape: str, color: str, first_pair: int, pairs: int, width: int,
                height: int, radius_range: tuple[int, int] = (8, 18), avoid: list[Event] = (),
                scale_radius: bool = True) -> Event:
    """An event with a random radius and a centre inside the frame, away from the events in ``avoid``
    (so that two appearances of one shape are never at the same place). ``radius_range`` is in px at
    112 x 112 and scales with the frame, or in px as given when ``scale_radius`` is False."""
    scale = min(width, height) / BASE_SIZE if scale_radius else 1.0
    radius = int(round(rng.integers(radius_range[0], radius_range[1] + 1) * scale))
    best, best_distance = None, -math.inf
    for _ in range(16):
        center = (int(rng.integers(radius, width - radius)), int(rng.integers(radius, height - radius)))
        distance = min((math.dist(center, other.center) - other.radius - radius for other in avoid), default=1e9)
        if distance > best_distance:
            best, best_distance = center, distance
        if distance >= 0:
            break
    return Event(shape, color, first_pair, pairs, best, radius)


def random_events(rng: np.random.Generator, pairs: int, plan: EventPlan = EventPlan(), width: int = 112,
                  height: int = 112, start: int = 0) -> list[Event]:
    """Events at random pairs of ``[start, pairs)``: random shape and colour, one shape never more than
    ``plan.max_per_shape`` times, events never overlapping in time (one event on screen at a time)."""
    events: list[Event] = []
    counts = {shape: 0 for shape in SHAPES}
    pair = start
    while pair < pairs:
        if rng.random() >= plan.rate:
            pair += 1
            continue
        free = [shape for shape in SHAPES if counts[shape] < plan.max_per_shape]
        if not free:
            break
        shape = str(rng.choice(free))
        length = int(rng.integers(plan.duration[0], plan.duration[1] + 1))
        length = min(length, pairs - pair)
        event = place_event(rng, shape, str(rng.choice(COLORS)), pair, length, width, height, plan.radius,
                            avoid=[e for e in events if e.shape == shape])
        events.append(event)
        counts[shape] += 1
        pair += length + plan.gap
    return events


def scene_from_params(size: tuple[int, int] = (112, 112), fps: float = 2.0, frames: int | None = 400, seed: int = 0,
                      rate: float = 0.05, duration: tuple[int, int] = (1, 2), noise: float = 3.0, drift: float = 0.0,
                      light: float = 0.0, distractors: int = 0) -> EventScene:
    """A scene with a random event schedule, as the ``synthetic:events`` source spec describes it."""
    width, height = size
    plan = EventPlan(rate=rate, duration=duration)
    style = SceneStyle(noise=noise, drift=drift, light=light, distractors=distractors)
    pairs = (frames if frames is not None else 2000) // 2
    events = random_events(np.random.default_rng((seed, 5)), pairs, plan, width, height)
    return EventScene(width, height, fps, seed, events, style, frames)


def with_events(scene: EventScene, events: list[Event]) -> EventScene:
    """The same background and style with another schedule."""
    return replace(scene, events=list(events))
