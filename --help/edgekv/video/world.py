"""A randomized world for synthetic event streams: named background families, a moving camera, changing
light, sensor noise, JPEG artifacts, distractor objects and occlusion (``synthetic:world``).

``edgekv.video.events`` draws every stream on one kind of background (its ``classic`` family here, kept
bit for bit there). A model trained and judged on that one renderer learns the renderer: the toy shipped
before this module lost 11 to 39 points on another background (issue 27). This module draws the same
events — the fixed vocabulary of shapes and colours, with their ground truth — on many backgrounds, each
family named so that a family can be held out of training entirely and measured as unseen.

Background families (``FAMILIES``):

============  ========================================================================================
``classic``   the ``synthetic:events`` texture (smooth low-saturation sinusoids, fixed grain)
``noise``     fractal value noise coloured by a random palette of two or three colours
``cells``     Voronoi cells of random colours, some with dark borders
``gradient``  linear or radial gradients between two or three colours
``stripes``   straight stripes at any angle and period, hard or soft edged
``checks``    checkerboards at any angle and cell size
``photo``     photographs that Debian's ``opencv-doc`` ships (``examples/data``)
``skimage``   scikit-image's sample photographs (the ``scikit-image`` wheel's ``skimage/data``)
``vtest``     frames of ``opencv-doc``'s ``vtest.avi`` (people walking in a hall; the background moves)
``tree``      frames of ``opencv-doc``'s ``tree.avi``
============  ========================================================================================

Procedural colours stay below 0.55 HSV saturation (the vocabulary's colours are saturated); photographs
and videos are what they are. Real images are found at run time (``asset_dirs``), never shipped:
``available_families()`` says which are present and ``family_problem`` why one is not.

On every family (``WorldStyle``): camera drift (a slow pan bouncing inside a margin) and shake (a
per-frame jitter), lighting that changes slowly (gain and white balance) and in steps (lights switched
every few dozen pairs), Gaussian sensor noise, JPEG compression at a random quality, distractor objects
whose shapes (star, ring, hexagon, ellipse) and colours (orange, cyan, brown, grey, black, olive) are all
outside the vocabulary — some always there, some appearing for a few pairs like events — and partial
occlusion of events by a bar passing in front (at most about 40 % of the shape). Event sizes run from one
merged-grid cell (radius 14 px: a 28 x 28 px cell is one LLM token) to a quarter of the frame
(``world_radius_range``), log-uniform; events last one to many pairs.

Events are objects in the world: the camera's motion moves them in the frame with the background (their
``center`` is where the frame shows them at their first pair, before shake). Lighting, noise and JPEG
apply to the whole frame. Everything is a pure function of the seed and the parameters.
"""

from __future__ import annotations

import colorsys
import functools
import importlib.util
import io
import math
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from edgekv.video.events import (COLOR_BGR, COLORS, SHAPES, Event, EventPlan, _bounce, _texture, place_event,
                                 shape_mask)

PROCEDURAL: tuple[str, ...] = ("classic", "noise", "cells", "gradient", "stripes", "checks")
PHOTOS: tuple[str, ...] = ("photo", "skimage")
VIDEOS: tuple[str, ...] = ("vtest", "tree")
FAMILIES: tuple[str, ...] = PROCEDURAL + PHOTOS + VIDEOS
GROUPS: dict[str, tuple[str, ...]] = {"procedural": PROCEDURAL, "photos": PHOTOS, "videos": VIDEOS, "all": FAMILIES}
# Held out of the toy's training by default: one procedural family, one of photographs, one of video.
DEFAULT_HOLDOUT: tuple[str, ...] = ("cells", "skimage", "tree")

# Out-of-vocabulary distractors: shapes that are none of SHAPES, colours (BGR) far from COLORS.
DISTRACTOR_SHAPES: tuple[str, ...] = ("star", "ring", "hexagon", "ellipse")
DISTRACTOR_BGR: dict[str, tuple[int, int, int]] = {
    "orange": (0, 140, 255), "cyan": (220, 210, 0), "brown": (30, 75, 140), "grey": (128, 128, 128),
    "black": (25, 25, 25), "olive": (30, 128, 128),
}
MAX_EXPOSURE = 3.0  # WorldStyle.exposure: a background gain of 4 at most (everything above 64 clips to white)
ONE_CELL_RADIUS = 14  # px: a shape about one merged-grid cell (28 x 28 px) across, at any resolution

# Photographs in opencv-doc's examples/data (Debian package opencv-doc): colour and grey photographs,
# not drawings, charts or calibration boards.
OPENCV_PHOTOS: tuple[str, ...] = (
    "aero1.jpg", "aero3.jpg", "aloeL.jpg", "apple.jpg", "baboon.jpg", "basketball1.png", "board.jpg",
    "box_in_scene.png", "building.jpg", "butterfly.jpg", "ela_original.jpg", "fruits.jpg", "graf1.png",
    "HappyFish.jpg", "home.jpg", "left.jpg", "leuvenA.jpg", "licenseplate_motion.jpg", "messi5.jpg", "orange.jpg",
    "pca_test1.jpg", "rubberwhale1.png", "smarties.png", "squirrel_cls.jpg", "stuff.jpg",
)
# scikit-image's sample photographs (skimage/data in its wheel).
SKIMAGE_PHOTOS: tuple[str, ...] = (
    "astronaut.png", "brick.png", "camera.png", "cell.png", "chelsea.png", "clock_motion.png", "coffee.png",
    "coins.png", "grass.png", "gravel.png", "hubble_deep_field.jpg", "ihc.png", "moon.png", "motorcycle_left.png",
    "page.png", "retina.jpg", "rocket.jpg", "text.png",
)
VIDEO_FILES: dict[str, str] = {"vtest": "vtest.avi", "tree": "tree.avi"}
_ASSET_SIDE = 256  # photographs and video frames are kept in memory with this shorter side
_VIDEO_KEEP_EVERY = 2  # video frames kept in memory: every second one


# ---------------------------------------------------------------------------------------------- assets
def opencv_data_dirs() -> list[Path]:
    """Where opencv-doc's sample data may be (``EDGEKV_OPENCV_DATA`` first)."""
    dirs = [Path(os.environ["EDGEKV_OPENCV_DATA"])] if os.environ.get("EDGEKV_OPENCV_DATA") else []
    dirs += [Path("/usr/share/doc/opencv-doc/examples/data"), Path("/usr/share/opencv4/samples/data"),
             Path("/usr/local/share/opencv4/samples/data")]
    return [d for d in dirs if d.is_dir()]


def skimage_data_dirs() -> list[Path]:
    """scikit-image's data folder, found without importing it (``EDGEKV_SKIMAGE_DATA`` first)."""
    dirs = [Path(os.environ["EDGEKV_SKIMAGE_DATA"])] if os.environ.get("EDGEKV_SKIMAGE_DATA") else []
    try:
        spec = importlib.util.find_spec("skimage")
    except (ImportError, ValueError):
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        dirs.append(Path(location) / "data")
    dirs.append(Path("/usr/lib/python3/dist-packages/skimage/data"))
    return [d for d in dirs if d.is_dir()]


def asset_paths(family: str) -> list[Path]:
    """The image or video files family ``family`` draws from on this machine (empty: none found)."""
    if family == "photo":
        names, dirs = OPENCV_PHOTOS, opencv_data_dirs()
    elif family == "skimage":
        names, dirs = SKIMAGE_PHOTOS, skimage_data_dirs()
    elif family in VIDEO_FILES:
        names, dirs = (VIDEO_FILES[family],), opencv_data_dirs()
    else:
        return []
    found: list[Path] = []
    for name in names:
        for folder in dirs:
            if (folder / name).is_file():
                found.append(folder / name)
                break
    return found


def family_problem(family: str) -> str | None:
    """Why background family ``family`` cannot be drawn here, or None when it can."""
    if family not in FAMILIES:
        return f"unknown background family {family!r}; known: {', '.join(FAMILIES)} (groups: {', '.join(GROUPS)})"
    if family in PROCEDURAL or asset_paths(family):
        return None
    if family == "skimage":
        return ("background family 'skimage' needs scikit-image's sample images: pip install scikit-image "
                "(or set EDGEKV_SKIMAGE_DATA to a folder holding them)")
    if family in VIDEOS and family_problem_video() is not None:
        return family_problem_video()
    return (f"background family {family!r} needs opencv-doc's sample data: apt-get install opencv-doc "
            "(or set EDGEKV_OPENCV_DATA to its examples/data folder)")


def family_problem_video() -> str | None:
    if importlib.util.find_spec("cv2") is None:
        return "the video background families need OpenCV to decode: pip install 'edgekv[video]'"
    return None


def available_families() -> tuple[str, ...]:
    return tuple(f for f in FAMILIES if family_problem(f) is None)


def parse_families(text: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """``"photo,procedural"`` -> ("photo", "classic", ...); names and groups, order kept, no repeats.
    Unknown names are refused naming the known ones."""
    if text is None:
        return ()
    items = text.split(",") if isinstance(text, str) else list(text)
    out: list[str] = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        names = GROUPS.get(item, (item,))
        for name in names:
            if name not in FAMILIES:
                raise ValueError(f"unknown background family {name!r}; known: {', '.join(FAMILIES)} "
                                 f"(groups: {', '.join(GROUPS)})")
            if name not in out:
                out.append(name)
    return tuple(out)


def drawable_families(families: tuple[str, ...] | None = None, holdout: tuple[str, ...] = ()) -> tuple[str, ...]:
    """``families`` (default: all) less ``holdout`` and less those not available here; refuses an empty
    result, saying why each asked family is out."""
    asked = families or FAMILIES
    out = tuple(f for f in asked if f not in holdout and family_problem(f) is None)
    if not out:
        reasons = [f"{f}: held out" if f in holdout else f"{f}: {family_problem(f)}" for f in asked]
        raise ValueError("no background family left to draw from (" + "; ".join(reasons) + ")")
    return out


@functools.lru_cache(maxsize=64)
def _photo(path: str) -> np.ndarray:
    """A photograph as float32 HxWx3 BGR, shorter side ``_ASSET_SIDE`` (grey and RGBA made BGR)."""
    from PIL import Image

    with Image.open(path) as image:
        image = image.convert("RGB")
        scale = _ASSET_SIDE / min(image.size)
        if scale < 1:
            image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                                 Image.BILINEAR)
        array = np.asarray(image, dtype=np.float32)[..., ::-1]
    out = np.ascontiguousarray(array)
    out.flags.writeable = False
    return out


@functools.lru_cache(maxsize=4)
def _video(path: str) -> np.ndarray:
    """Every ``_VIDEO_KEEP_EVERY``-th frame of a video, [T, H, W, 3] uint8 BGR, shorter side ``_ASSET_SIDE``."""
    import cv2

    capture = cv2.VideoCapture(path)
    frames = []
    index = 0
    try:
        while True:
            ok, frame = capture.read()
            if not ok:
                break
            if index % _VIDEO_KEEP_EVERY == 0:
                scale = _ASSET_SIDE / min(frame.shape[:2])
                if scale < 1:
                    frame = cv2.resize(frame, (round(frame.shape[1] * scale), round(frame.shape[0] * scale)),
                                       interpolation=cv2.INTER_AREA)
                frames.append(frame)
            index += 1
    finally:
        capture.release()
    if not frames:
        raise ValueError(f"{path}: no frame could be decoded")
    out = np.stack(frames)
    out.flags.writeable = False
    return out


# ---------------------------------------------------------------------------------------------- backgrounds
def _palette(rng: np.random.Generator, count: int, max_saturation: float = 0.55) -> np.ndarray:
    """``count`` random colours (BGR float32) of moderate saturation and mid brightness."""
    out = []
    for _ in range(count):
        h, s, v = rng.random(), rng.uniform(0.0, max_saturation), rng.uniform(0.25, 0.85)
        r, g, b = colorsys.hsv_to_rgb(h, s, v)
        out.append((b * 255, g * 255, r * 255))
    return np.array(out, dtype=np.float32)


def _grain(rng: np.random.Generator, height: int, width: int, image: np.ndarray) -> np.ndarray:
    grain = rng.normal(0, rng.uniform(0, 6), size=(height, width, 3)).astype(np.float32)
    return np.clip(image + grain, 0, 255).astype(np.float32)


def _blend(t: np.ndarray, colors: np.ndarray) -> np.ndarray:
    """Colour ramp through ``colors`` for t in [0, 1] ([H, W] -> [H, W, 3])."""
    stops = np.linspace(0, 1, len(colors))
    return np.stack([np.interp(t, stops, colors[:, c]) for c in range(3)], axis=-1).astype(np.float32)


def _resize(array: np.ndarray, width: int, height: int) -> np.ndarray:
    from PIL import Image

    if array.ndim == 2:
        return np.asarray(Image.fromarray(array.astype(np.float32), mode="F").resize((width, height), Image.BICUBIC))
    channels = [np.asarray(Image.fromarray(np.ascontiguousarray(array[..., c], dtype=np.float32), mode="F")
                           .resize((width, height), Image.BILINEAR)) for c in range(array.shape[2])]
    return np.stack(channels, axis=-1)


def _noise_field(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Fractal value noise in [0, 1] (3-5 octaves of bicubically enlarged random grids)."""
    out = np.zeros((height, width), dtype=np.float32)
    amplitude, total = 1.0, 0.0
    cells = int(rng.integers(2, 5))
    for _ in range(int(rng.integers(3, 6))):
        grid = rng.random((cells + 1, cells + 1)).astype(np.float32)
        out += amplitude * _resize(grid, width, height)
        total += amplitude
        amplitude *= float(rng.uniform(0.4, 0.65))
        cells *= 2
    out /= total
    low, high = np.percentile(out, (2, 98))
    return np.clip((out - low) / max(high - low, 1e-6), 0, 1)


def _angle_coords(rng: np.random.Generator, height: int, width: int, angle: float | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    theta = float(rng.uniform(0, np.pi)) if angle is None else angle
    return xs * math.cos(theta) + ys * math.sin(theta), -xs * math.sin(theta) + ys * math.cos(theta)


def procedural_background(family: str, height: int, width: int, rng: np.random.Generator) -> np.ndarray:
    """A still background of procedural ``family``, float32 HxWx3 BGR in [0, 255]."""
    if family == "classic":
        return _texture(height, width, rng)
    if family == "noise":
        colors = _palette(rng, int(rng.integers(2, 4)))
        return _grain(rng, height, width, _blend(_noise_field(rng, height, width), colors))
    if family == "cells":
        count = int(rng.integers(6, 41))
        seeds = rng.uniform(0, 1, size=(count, 2)).astype(np.float32) * np.array([width, height], np.float32)
        ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
        distance = (xs[..., None] - seeds[:, 0]) ** 2 + (ys[..., None] - seeds[:, 1]) ** 2  # [H, W, count]
        order = np.argsort(distance, axis=-1)[..., :2]
        image = _palette(rng, count)[order[..., 0]]
        if rng.random() < 0.5:  # dark borders where the two nearest seeds are almost as near
            nearest = np.take_along_axis(distance, order, axis=-1)
            border = np.sqrt(nearest[..., 1]) - np.sqrt(nearest[..., 0]) < rng.uniform(0.8, 2.0)
            image[border] *= rng.uniform(0.3, 0.7)
        return _grain(rng, height, width, image)
    if family == "gradient":
        colors = _palette(rng, int(rng.integers(2, 4)))
        if rng.random() < 0.5:
            along, _ = _angle_coords(rng, height, width)
            t = (along - along.min()) / max(float(np.ptp(along)), 1e-6)
        else:
            ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
            cx, cy = rng.uniform(-0.2, 1.2) * width, rng.uniform(-0.2, 1.2) * height
            radius = np.sqrt((xs - cx) ** 2 + (ys - cy) ** 2)
            t = radius / max(float(radius.max()), 1e-6)
        return _grain(rng, height, width, _blend(t, colors))
    if family == "stripes":
        colors = _palette(rng, int(rng.integers(2, 4)))
        along, _ = _angle_coords(rng, height, width)
        period = float(rng.uniform(4, 40)) * max(1.0, min(height, width) / 160)
        phase = (along / period + rng.random()) % 1.0
        if rng.random() < 0.5:  # hard-edged bands, one colour each
            image = colors[(phase * len(colors)).astype(np.int64) % len(colors)]
        else:  # soft: a sinusoid between the first two colours
            t = 0.5 + 0.5 * np.sin(2 * np.pi * phase)
            image = _blend(t, colors[:2])
        return _grain(rng, height, width, image)
    if family == "checks":
        colors = _palette(rng, 2)
        angle = 0.0 if rng.random() < 0.5 else float(rng.uniform(0, np.pi / 2))
        along, across = _angle_coords(rng, height, width, angle)
        size = float(rng.uniform(4, 40)) * max(1.0, min(height, width) / 160)
        parity = (np.floor(along / size) + np.floor(across / size)).astype(np.int64) % 2
        return _grain(rng, height, width, colors[parity])
    raise ValueError(f"{family!r} is not a procedural background family ({', '.join(PROCEDURAL)})")


def _crop_box(rng: np.random.Generator, source_h: int, source_w: int, height: int, width: int,
              zoom: tuple[float, float] = (0.35, 1.0)) -> tuple[int, int, int, int]:
    """A random window (y, x, h, w) of a source image with the aspect of the canvas."""
    aspect = width / height
    side = float(rng.uniform(*zoom))
    h = int(min(source_h, source_w / aspect) * side)
    w = int(h * aspect)
    h, w = max(8, min(h, source_h)), max(8, min(w, source_w))
    y = int(rng.integers(0, source_h - h + 1))
    x = int(rng.integers(0, source_w - w + 1))
    return y, x, h, w


class Background:
    """A family's background for one stream: ``at(frame)`` is the canvas (float32 HxWx3 BGR) at that
    frame — the same array for still families, the matching video frame for video families."""

    def __init__(self, family: str, height: int, width: int, rng: np.random.Generator) -> None:
        problem = family_problem(family)
        if problem is not None:
            raise ValueError(problem)
        self.family, self.height, self.width = family, height, width
        self.video: np.ndarray | None = None
        if family in PROCEDURAL:
            self.still = procedural_background(family, height, width, rng)
        elif family in PHOTOS:
            paths = asset_paths(family)
            photo = _photo(str(paths[int(rng.integers(len(paths)))]))
            y, x, h, w = _crop_box(rng, photo.shape[0], photo.shape[1], height, width)
            image = _resize(photo[y:y + h, x:x + w], width, height)
            if rng.random() < 0.5:
                image = image[:, ::-1]
            self.still = np.clip(image * rng.uniform(0.8, 1.15), 0, 255).astype(np.float32)
        else:
            self.video = _video(str(asset_paths(family)[0]))
            self.box = _crop_box(rng, self.video.shape[1], self.video.shape[2], height, width, zoom=(0.5, 1.0))
            self.flip = bool(rng.random() < 0.5)
            self.start = int(rng.integers(len(self.video)))
            # kept video frames per stream frame: a real-time 2 fps stream of a 10-15 fps video skips 5-7 frames
            self.step = float(rng.uniform(0.5, 4.0))
            self.still = None
            self._last: tuple[int, np.ndarray] | None = None

    def at(self, frame: int) -> np.ndarray:
        if self.video is None:
            return self.still
        count = len(self.video)
        position = int(self.start + frame * self.step) % (2 * count - 2 if count > 1 else 1)
        index = position if position < count else 2 * count - 2 - position  # ping-pong: no jump at the end
        if self._last is not None and self._last[0] == index:
            return self._last[1]
        y, x, h, w = self.box
        image = _resize(self.video[index, y:y + h, x:x + w].astype(np.float32), self.width, self.height)
        if self.flip:
            image = image[:, ::-1]
        image = np.ascontiguousarray(image, dtype=np.float32)
        self._last = (index, image)
        return image


# ---------------------------------------------------------------------------------------------- style
@dataclass(frozen=True)
class WorldStyle:
    """Camera, light, sensor and clutter of a world scene. Pixel sizes are at 112 x 112 and scale with the
    frame."""

    noise: float = 3.0          # Gaussian sensor noise, std in uint8 levels
    drift: float = 0.0          # camera pan, px per frame pair (bounces inside a margin)
    shake: float = 0.0          # camera shake, px std per frame
    light: float = 0.0          # slow lighting change: gain amplitude (0.2 = +-20 %)
    light_period: float = 120.0  # frame pairs per lighting cycle
    cast: float = 0.0           # white-balance change: per-channel gain amplitude, same cycle
    switch: float = 0.0         # lights switched: gain steps of up to +-switch ...
    switch_period: int = 40     # ... every this many frame pairs
    jpeg: int = 0               # JPEG quality of every frame (0: no compression)
    distractors: int = 0        # out-of-vocabulary objects always in the scene (some wander)
    transients: float = 0.0     # out-of-vocabulary objects appearing, expected per frame pair
    occlusion: float = 0.0      # probability that an event is partly hidden by a bar in front of it
    lures: float = 0.0          # share of the transients drawn in a vocabulary colour (still never a SHAPES shape)
    lure_colors: tuple[str, ...] = ()  # the colours lures take (default: any of COLORS), e.g. those no event wears
    lure_shapes: tuple[str, ...] = ()  # the shapes lures take (default: the object's own, any of DISTRACTOR_SHAPES)
    color_jitter: float = 0.0   # +- uint8 levels on each event's colour
    tone: float = 0.0           # strength in [0, 1] of a random re-grading of the background only (gamma, contrast,
                                # saturation, hue: a bright, green or washed-out scene), drawn per stream
    exposure: float = 0.0       # over-exposure of part of the background only: its gain less one where the stream's
                                # exposure map (smooth, random) is 1 (1.0: values above 127 clip to white there, as a
                                # sky or a lit wall does), no gain where it is 0; events keep their colour

    def __post_init__(self) -> None:
        for name in ("noise", "drift", "shake", "light", "cast", "switch", "distractors", "transients",
                     "occlusion", "color_jitter", "lures", "tone", "exposure"):
            if getattr(self, name) < 0:
                raise ValueError(f"world {name}: must be >= 0, got {getattr(self, name)}")
        if self.light + self.switch >= 1.0 or self.cast >= 0.5:
            raise ValueError(f"world light + switch must be below 1 and cast below 0.5, got {self.light}, "
                             f"{self.switch}, {self.cast}")
        if not 0 <= self.jpeg <= 95:
            raise ValueError(f"world jpeg: a quality in 1..95 or 0 (off), got {self.jpeg}")
        for name in ("occlusion", "transients", "lures", "tone"):
            if getattr(self, name) > 1:
                raise ValueError(f"world {name} must be at most 1, got {getattr(self, name)}")
        if self.exposure > MAX_EXPOSURE:
            raise ValueError(f"world exposure must be at most {MAX_EXPOSURE} (a gain of {1 + MAX_EXPOSURE:g}), "
                             f"got {self.exposure}")
        if self.light_period <= 0 or self.switch_period < 1:
            raise ValueError("world light_period and switch_period must be positive")
        for name, known in (("lure_colors", COLORS), ("lure_shapes", DISTRACTOR_SHAPES)):
            values = getattr(self, name)
            if not isinstance(values, tuple) or any(v not in known for v in values):
                raise ValueError(f"world {name}: a tuple of {', '.join(known)}; got {values!r}")


@dataclass(frozen=True)
class Tone:
    """One stream's background grading (``WorldStyle.tone``): values in [0, 1] are raised to ``gamma``, then
    ``matrix`` (saturation and a hue rotation about the grey axis, BGR) and ``contrast`` about mid-grey."""

    gamma: float
    contrast: float
    matrix: np.ndarray


def background_tone(rng: np.random.Generator, strength: float) -> Tone:
    """A random grading of ``strength`` in [0, 1]: gamma and contrast within a factor e^(±0.6 s) and e^(±0.4 s),
    saturation within e^(±0.9 s), hue turned by up to ±180° x s: washed-out, over-exposed or saturated scenes. Meant to
    bring the held-out `tree` (over-exposed green foliage) within the training draws; a round trained with it did not
    answer `tree` better (``edgekv.toy.data.WORLD_MILD_TONE``)."""
    gamma = math.exp(float(rng.uniform(-0.6, 0.6)) * strength)
    contrast = math.exp(float(rng.uniform(-0.4, 0.4)) * strength)
    saturation = math.exp(float(rng.uniform(-0.9, 0.9)) * strength)
    angle = float(rng.uniform(-math.pi, math.pi)) * strength
    grey = np.full((3, 3), 1.0 / 3.0)
    # rotation by ``angle`` about the (1, 1, 1) axis (Rodrigues): keeps grey grey, turns the hues
    k = np.array([[0.0, -1.0, 1.0], [1.0, 0.0, -1.0], [-1.0, 1.0, 0.0]]) / math.sqrt(3.0)
    rotation = np.eye(3) + math.sin(angle) * k + (1.0 - math.cos(angle)) * (k @ k)
    matrix = grey + saturation * rotation @ (np.eye(3) - grey)
    return Tone(gamma, contrast, matrix.astype(np.float32))


def apply_tone(canvas: np.ndarray, tone: Tone) -> np.ndarray:
    """``canvas`` (HxWx3 float BGR in 0-255) graded by ``tone``, float32, clipped to 0-255."""
    x = np.power(np.clip(canvas, 0, 255) / 255.0, tone.gamma, dtype=np.float32)
    x = x @ tone.matrix.T
    x = 0.5 + tone.contrast * (x - 0.5)
    return np.clip(x * 255.0, 0, 255).astype(np.float32)


def exposure_map(rng: np.random.Generator, height: int, width: int, exposure: float) -> np.ndarray:
    """A stream's background gain (HxW float32, ``WorldStyle.exposure``): 1 + ``exposure`` x a smooth random map in
    [0, 1] that is 0 over part of the frame and 1 over another (a 5 x 5 Gaussian random field interpolated bilinearly
    to the frame, thresholded at a random level with a soft edge): a sky or a lit wall, irregular, beside parts left
    as they were. Numpy only (no OpenCV: the world's procedural families need none)."""
    coarse = rng.standard_normal((5, 5))
    ys, xs = np.linspace(0, 4, height), np.linspace(0, 4, width)
    rows = np.stack([np.interp(ys, np.arange(5), coarse[:, j]) for j in range(5)], axis=1)  # H x 5
    field = np.stack([np.interp(xs, np.arange(5), rows[i]) for i in range(height)])  # H x W
    field = (field - field.min()) / max(float(field.max() - field.min()), 1e-6)
    level = float(rng.uniform(0.3, 0.7))
    weight = np.clip((field - level) / 0.15 + 0.5, 0.0, 1.0)
    return (1.0 + exposure * weight).astype(np.float32)


def mild_style(style) -> WorldStyle:
    """The classic renderer's camera (a ``SceneStyle``'s noise, drift and lighting) and nothing else: the card's
    streams on a world background (``eval toy --families F``, ``--style mild``; ``Stage.mild`` in training)."""
    return WorldStyle(noise=style.noise, drift=style.drift, light=style.light, light_period=style.light_period)


def random_style(rng: np.random.Generator) -> WorldStyle:
    """A random style: each kind of nuisance present in a share of streams, at a random strength."""
    light = float(rng.uniform(0.05, 0.3)) if rng.random() < 0.4 else 0.0
    return WorldStyle(
        noise=float(rng.uniform(1.0, 8.0)),
        drift=float(rng.uniform(0.05, 0.6)) if rng.random() < 0.4 else 0.0,
        shake=float(rng.uniform(0.3, 2.0)) if rng.random() < 0.3 else 0.0,
        light=light, light_period=float(rng.uniform(20, 300)),
        cast=float(rng.uniform(0.02, 0.1)) if rng.random() < 0.3 else 0.0,
        switch=min(float(rng.uniform(0.05, 0.3)), 0.95 - light) if rng.random() < 0.2 else 0.0,
        switch_period=int(rng.integers(10, 200)),
        jpeg=int(rng.integers(25, 91)) if rng.random() < 0.5 else 0,
        distractors=int(rng.choice([0, 0, 1, 2, 3])),
        transients=float(rng.uniform(0.02, 0.15)) if rng.random() < 0.5 else 0.0,
        occlusion=float(rng.uniform(0.2, 0.6)) if rng.random() < 0.3 else 0.0,
        color_jitter=float(rng.uniform(0, 20)),
    )


def world_radius_range(width: int, height: int) -> tuple[int, int]:
    """Event radii from about one merged-grid cell across to about a quarter of the frame's area."""
    return ONE_CELL_RADIUS, max(ONE_CELL_RADIUS, int(0.28 * min(width, height)))


def draw_radius(rng: np.random.Generator, radius_range: tuple[int, int]) -> int:
    """Log-uniform in the range (small objects as often as large ones per octave)."""
    low, high = radius_range
    return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1))))) if high > low else low


def distractor_mask(shape: str, center: tuple[float, float], radius: float, height: int, width: int,
                    angle: float = 0.0, thickness: float | None = None) -> np.ndarray:
    """HxW bool: an out-of-vocabulary shape (star, ring, hexagon, ellipse, bar: ``radius`` long each way
    from the centre, ``thickness`` (default 0.22 radius) each way across)."""
    from edgekv.video.events import _pixel_grid

    ys, xs = _pixel_grid(height, width)
    dx, dy = xs - center[0], ys - center[1]
    if shape == "ring":
        d2 = dx * dx + dy * dy
        return (d2 <= radius * radius) & (d2 >= (0.6 * radius) ** 2)
    if shape == "hexagon":
        ax, ay = np.abs(dx), np.abs(dy)
        return (ay <= 0.866 * radius) & (0.866 * ax + 0.5 * ay <= 0.866 * radius)
    c, s = math.cos(angle), math.sin(angle)
    u, v = dx * c + dy * s, -dx * s + dy * c
    if shape == "ellipse":
        return (u / radius) ** 2 + (v / (0.4 * radius)) ** 2 <= 1
    if shape == "bar":
        return (np.abs(u) <= radius) & (np.abs(v) <= (0.22 * radius if thickness is None else thickness))
    if shape == "star":
        r = np.sqrt(dx * dx + dy * dy)
        theta = np.arctan2(dy, dx) - angle
        # radius of a 5-point star's outline at each angle: between 0.45 r (notches) and r (points)
        wave = np.abs(((theta * 5 / (2 * np.pi)) % 1.0) - 0.5) * 2  # 1 at points, 0 at notches
        return r <= radius * (0.45 + 0.55 * wave)
    raise ValueError(f"distractor shape {shape!r} is not one of {', '.join(DISTRACTOR_SHAPES)}, bar")


@dataclass(frozen=True)
class Clutter:
    """A distractor object (never asked about): out-of-vocabulary shape and colour, where and when."""

    shape: str
    color: str
    center: tuple[float, float]
    radius: float
    angle: float
    first_pair: int = 0
    pairs: int = -1                       # -1: always there
    velocity: tuple[float, float] = (0.0, 0.0)  # px per frame (wanderers)

    def active(self, pair: int) -> bool:
        return self.pairs < 0 or self.first_pair <= pair < self.first_pair + self.pairs


# ---------------------------------------------------------------------------------------------- scene
_TRANSIENT_BLOCK = 32  # transient distractors are drawn per block of this many pairs (streams may be unbounded)


@dataclass
class WorldScene:
    """Renders frames of one stream of the randomized world; ``events`` is its ground truth.

    The same interface as ``edgekv.video.events.EventScene`` (``frame``, ``pair_frames``, ``time``,
    ``mask``, ``cell_cover``, ``events`` assignable, ``pairs``), so everything that takes one takes the other.
    """

    width: int = 112
    height: int = 112
    fps: float = 2.0
    seed: int = 0
    events: list[Event] = field(default_factory=list)
    family: str = "classic"
    style: WorldStyle = field(default_factory=WorldStyle)
    frames: int | None = None

    def __post_init__(self) -> None:
        if self.width < 28 or self.height < 28:
            raise ValueError(f"scene size {self.width}x{self.height}: both sides must be at least 28 px")
        if not self.fps > 0:
            raise ValueError(f"scene fps must be > 0, got {self.fps}")
        self.events = sorted(self.events, key=lambda e: (e.first_pair, e.shape, e.color))
        self.scale = min(self.width, self.height) / 112
        rng = np.random.default_rng((self.seed, 61))
        self.drift_margin = int(math.ceil(0.08 * min(self.width, self.height))) if self.style.drift else 0
        self.margin = self.drift_margin + int(math.ceil(3 * self.style.shake * self.scale))
        self.background = Background(self.family, self.height + 2 * self.margin, self.width + 2 * self.margin, rng)
        self._drift_dir = float(rng.uniform(0, 2 * np.pi))
        self._light_phase = float(rng.uniform(0, 2 * np.pi))
        self._cast_phase = rng.uniform(0, 2 * np.pi, size=3)
        radius_range = world_radius_range(self.width, self.height)
        self.clutter = [self._clutter(rng, radius_range, wander=bool(rng.random() < 0.5))
                        for _ in range(self.style.distractors)]
        self._masks: dict[tuple, np.ndarray] = {}
        self._blocks: dict[int, list[Clutter]] = {}
        self._tone = background_tone(np.random.default_rng((self.seed, 89)), self.style.tone) if self.style.tone \
            else None
        self._toned: tuple[np.ndarray, np.ndarray] | None = None  # (canvas, its re-graded / exposed copy)
        self._exposure = exposure_map(np.random.default_rng((self.seed, 97)), self.height + 2 * self.margin,
                                      self.width + 2 * self.margin, self.style.exposure) if self.style.exposure \
            else None

    # ------------------------------------------------------------------ parts
    def _clutter(self, rng: np.random.Generator, radius_range: tuple[int, int], wander: bool = False,
                 first_pair: int = 0, pairs: int = -1) -> Clutter:
        radius = draw_radius(rng, (radius_range[0], max(radius_range[0], radius_range[1] * 2 // 3)))
        center = (float(rng.uniform(0, self.width)), float(rng.uniform(0, self.height)))
        speed = rng.uniform(0.1, 0.6, size=2) * rng.choice([-1, 1], 2) * self.scale if wander else (0.0, 0.0)
        return Clutter(str(rng.choice(DISTRACTOR_SHAPES)), str(rng.choice(list(DISTRACTOR_BGR))), center,
                       float(radius), float(rng.uniform(0, np.pi)), first_pair, pairs,
                       (float(speed[0]), float(speed[1])))

    def _lure(self, block: int, items: list[Clutter]) -> list[Clutter]:
        """Each of a block's transients in a vocabulary colour (of ``style.lure_colors`` where given) with
        probability ``style.lures``, drawn apart from the objects themselves: the same places and times at any
        share of lures, and the same shapes unless ``style.lure_shapes`` gives the lures theirs (drawn for every
        transient, so the same at any share too)."""
        if not self.style.lures:
            return items
        rng = np.random.default_rng((self.seed, 71, block))
        palette = self.style.lure_colors or COLORS
        draws = [(rng.random(), str(rng.choice(palette))) for _ in items]
        shapes = [item.shape for item in items]
        if self.style.lure_shapes:
            shape_rng = np.random.default_rng((self.seed, 73, block))
            shapes = [str(shape_rng.choice(self.style.lure_shapes)) for _ in items]
        return [replace(item, color=color, shape=shape) if u < self.style.lures else item
                for item, (u, color), shape in zip(items, draws, shapes)]

    def transients(self, pair: int) -> list[Clutter]:
        """Transient distractors on screen at ``pair`` (drawn per block, so unbounded streams work)."""
        if not self.style.transients:
            return []
        out = []
        block = pair // _TRANSIENT_BLOCK
        for b in (block - 1, block):
            if b < 0:
                continue
            if b not in self._blocks:
                rng = np.random.default_rng((self.seed, 67, b))
                count = int(rng.poisson(self.style.transients * _TRANSIENT_BLOCK))
                radius_range = world_radius_range(self.width, self.height)
                start = b * _TRANSIENT_BLOCK
                self._blocks[b] = self._lure(b, [self._clutter(rng, radius_range, False,
                                                               start + int(rng.integers(_TRANSIENT_BLOCK)),
                                                               int(rng.integers(1, 7))) for _ in range(count)])
                if len(self._blocks) > 8:  # forget the block farthest from this pair (never one it needs)
                    self._blocks.pop(max((k for k in self._blocks if k not in (block - 1, block)),
                                         key=lambda k: abs(k - block)))
            out.extend(c for c in self._blocks[b] if c.active(pair))
        return out

    def offset(self, index: int) -> tuple[float, float]:
        """Camera position (x, y) in the canvas at frame ``index``: drift (per pair) + shake (per frame)."""
        ox = oy = float(self.margin)
        if self.style.drift:
            travel = self.style.drift * self.scale * (index // 2)
            ox += _bounce(travel * math.cos(self._drift_dir), 2 * self.drift_margin) - self.drift_margin
            oy += _bounce(travel * math.sin(self._drift_dir), 2 * self.drift_margin) - self.drift_margin
        if self.style.shake:
            jitter = np.random.default_rng((self.seed, 71, index)).standard_normal(2)
            bound = 3 * self.style.shake * self.scale
            ox += float(np.clip(jitter[0] * self.style.shake * self.scale, -bound, bound))
            oy += float(np.clip(jitter[1] * self.style.shake * self.scale, -bound, bound))
        return ox, oy

    def _drift_only(self, pair: int) -> tuple[float, float]:
        if not self.style.drift:
            return float(self.margin), float(self.margin)
        travel = self.style.drift * self.scale * pair
        return (self.margin + _bounce(travel * math.cos(self._drift_dir), 2 * self.drift_margin) - self.drift_margin,
                self.margin + _bounce(travel * math.sin(self._drift_dir), 2 * self.drift_margin) - self.drift_margin)

    def event_rng(self, event: Event, salt: int) -> np.random.Generator:
        """Randomness of one event's looks (colour jitter, occluder): the same for every pair it lasts and
        for a copy of it at another pair (the toy's training renders multi-pair events slot by slot)."""
        return np.random.default_rng((self.seed, salt, SHAPES.index(event.shape), COLORS.index(event.color),
                                      event.center[0], event.center[1], event.radius))

    def occluder(self, event: Event) -> tuple[str, np.ndarray] | None:
        """(colour name, HxW bool in the event's frame at its first pair) of the bar hiding part of ``event``."""
        if not self.style.occlusion:
            return None
        rng = self.event_rng(event, 73)
        if rng.random() >= self.style.occlusion:
            return None
        angle = float(rng.uniform(0, np.pi))
        shift = rng.uniform(-0.6, 0.6, size=2) * event.radius
        center = (event.center[0] + float(shift[0]), event.center[1] + float(shift[1]))
        # a bar 0.4 r thick across the shape: it hides at most about 40 % of it
        bar = distractor_mask("bar", center, 2.5 * event.radius, self.height, self.width, angle,
                              thickness=0.2 * event.radius)
        return str(rng.choice(list(DISTRACTOR_BGR))), bar

    def mask(self, event: Event) -> np.ndarray:
        """HxW bool: what of ``event`` the frame shows at its first pair (the shape less its occluder)."""
        key = ("event", event)
        found = self._masks.get(key)
        if found is None:
            found = shape_mask(event.shape, event.center, event.radius, self.height, self.width)
            hidden = self.occluder(event)
            if hidden is not None:
                found = found & ~hidden[1]
            self._masks[key] = found
        return found

    def active(self, pair: int) -> list[Event]:
        return [event for event in self.events if event.active(pair)]

    @property
    def pairs(self) -> int | None:
        return None if self.frames is None else self.frames // 2

    def time(self, index: int) -> float:
        return index / self.fps

    def gain(self, pair: int) -> np.ndarray:
        """Per-channel light gain at ``pair`` (slow cycle, white balance, switched steps)."""
        g = np.ones(3, dtype=np.float32)
        if self.style.light:
            g *= 1.0 + self.style.light * math.sin(2 * math.pi * pair / self.style.light_period + self._light_phase)
        if self.style.cast:
            g *= 1.0 + self.style.cast * np.sin(2 * np.pi * pair / self.style.light_period + self._cast_phase)
        if self.style.switch:
            step = np.random.default_rng((self.seed, 79, pair // self.style.switch_period)).uniform(-1, 1)
            g *= 1.0 + self.style.switch * float(step)
        return g.astype(np.float32)

    # ------------------------------------------------------------------ rendering
    def frame(self, index: int) -> np.ndarray:
        """Frame ``index`` as a new HxWx3 uint8 BGR array."""
        pair = index // 2
        ox, oy = self.offset(index)
        canvas = self._graded(self.background.at(index))
        x0, y0 = int(round(ox)), int(round(oy))
        image = canvas[y0:y0 + self.height, x0:x0 + self.width].copy()
        for item in self.clutter + self.transients(pair):
            image[self._item_mask(item, index, x0, y0)] = \
                DISTRACTOR_BGR[item.color] if item.color in DISTRACTOR_BGR else COLOR_BGR[item.color]
        for event in self.active(pair):
            # the event is fixed in the world: it moves in the frame as the camera moved since its first pair
            bx, by = self._drift_only(event.first_pair)
            dx, dy = int(round(bx)) - x0, int(round(by)) - y0
            jitter = self.event_rng(event, 83).uniform(-1, 1, size=3) * self.style.color_jitter
            color = np.clip(np.array(COLOR_BGR[event.color], np.float32) + jitter, 0, 255)
            shown = _shifted(self.mask(event), dx, dy)
            image[shown] = color
            hidden = self.occluder(event)
            if hidden is not None:
                image[_shifted(hidden[1], dx, dy) & _shifted(self._box(event), dx, dy)] = DISTRACTOR_BGR[hidden[0]]
        gain = self.gain(pair)
        if not np.all(gain == 1.0):
            image *= gain
        if self.style.noise:
            noise = np.random.default_rng((self.seed, 23, index)).standard_normal(image.shape, dtype=np.float32)
            image += self.style.noise * noise
        out = np.clip(image, 0, 255).astype(np.uint8)
        if self.style.jpeg:
            out = jpeg_roundtrip(out, self.style.jpeg)
        return out

    def _item_mask(self, item: Clutter, index: int, x0: int, y0: int) -> np.ndarray:
        """HxW bool: where distractor ``item`` lies in frame ``index``, whose crop of the canvas starts at (x0, y0)."""
        cx = item.center[0] + item.velocity[0] * index
        cy = item.center[1] + item.velocity[1] * index
        if item.velocity != (0.0, 0.0):
            cx, cy = _bounce(cx, self.width), _bounce(cy, self.height)
        center = (cx - (x0 - self.margin), cy - (y0 - self.margin))
        return distractor_mask(item.shape, center, item.radius, self.height, self.width, item.angle)

    def lure_cells(self, pair: int, cell: int = 28) -> np.ndarray:
        """[rows, cols] bool: the merged-grid cells a lure (a transient in a vocabulary colour) covers in either
        frame of ``pair``, as drawn (the toy's training steers its questions' attention off them, issue 27)."""
        rows, cols = self.height // cell, self.width // cell
        out = np.zeros((rows, cols), dtype=bool)
        lures = [item for item in self.transients(pair) if item.color in COLORS]
        for index in (2 * pair, 2 * pair + 1):
            if not lures:
                break
            ox, oy = self.offset(index)
            x0, y0 = int(round(ox)), int(round(oy))
            for item in lures:
                mask = self._item_mask(item, index, x0, y0)[: rows * cell, : cols * cell]
                out |= mask.reshape(rows, cell, cols, cell).any(axis=(1, 3))
        return out

    def _graded(self, canvas: np.ndarray) -> np.ndarray:
        """``canvas`` re-graded by the stream's background tone, then over-exposed by its ``exposure`` (the same
        canvas object: the cached copy)."""
        if self._tone is None and not self.style.exposure:
            return canvas
        if self._toned is None or self._toned[0] is not canvas:
            graded = apply_tone(canvas, self._tone) if self._tone is not None else canvas
            if self._exposure is not None:
                graded = np.minimum(graded * self._exposure[..., None], np.float32(255.0))
            self._toned = (canvas, graded)
        return self._toned[1]

    def _box(self, event: Event) -> np.ndarray:
        """The bar is drawn only near its event: within 1.6 radii of its centre."""
        key = ("box", event)
        found = self._masks.get(key)
        if found is None:
            found = shape_mask("circle", event.center, 1.6 * event.radius, self.height, self.width)
            self._masks[key] = found
        return found

    def pair_frames(self, pair: int) -> tuple[np.ndarray, np.ndarray]:
        return self.frame(2 * pair), self.frame(2 * pair + 1)

    def cell_cover(self, event: Event, cell: int = 28) -> np.ndarray:
        """[rows, cols] float: the share of each merged-grid cell the event shows (occluder removed)."""
        mask = self.mask(event)
        rows, cols = self.height // cell, self.width // cell
        cropped = mask[: rows * cell, : cols * cell].reshape(rows, cell, cols, cell)
        return cropped.mean(axis=(1, 3))


def _shifted(mask: np.ndarray, dx: int, dy: int) -> np.ndarray:
    """``mask`` moved by (dx, dy) px (what leaves the frame is dropped)."""
    if dx == 0 and dy == 0:
        return mask
    out = np.zeros_like(mask)
    h, w = mask.shape
    ys, yd = (slice(0, h - dy), slice(dy, h)) if dy >= 0 else (slice(-dy, h), slice(0, h + dy))
    xs, xd = (slice(0, w - dx), slice(dx, w)) if dx >= 0 else (slice(-dx, w), slice(0, w + dx))
    out[yd, xd] = mask[ys, xs]
    return out


def jpeg_roundtrip(frame: np.ndarray, quality: int) -> np.ndarray:
    """``frame`` (BGR uint8) after JPEG compression at ``quality`` (4:2:0, as cameras and encoders do)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(frame[..., ::-1])).save(buffer, format="JPEG", quality=int(quality))
    buffer.seek(0)
    with Image.open(buffer) as image:
        return np.ascontiguousarray(np.asarray(image.convert("RGB"))[..., ::-1])


# ---------------------------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class WorldPlan:
    """How to draw a random schedule of world events (``world_events``)."""

    rate: float = 0.05                  # expected new events per frame pair
    duration: tuple[int, int] = (1, 8)  # frame pairs an event lasts (inclusive range)
    max_per_shape: int = 3
    gap: int = 1
    recolor: float = 0.7                # probability that a shape seen before comes back in another colour

    def __post_init__(self) -> None:
        EventPlan(rate=self.rate, duration=self.duration)  # the same checks
        if not 0 <= self.recolor <= 1:
            raise ValueError(f"world recolor must be in [0, 1], got {self.recolor}")


def world_event(rng: np.random.Generator, shape: str, color: str, first_pair: int, pairs: int, width: int,
                height: int, avoid: list[Event] = ()) -> Event:
    """An event of the world's size range (log-uniform radius), placed away from ``avoid``."""
    radius = draw_radius(rng, world_radius_range(width, height))
    return place_event(rng, shape, color, first_pair, pairs, width, height, (radius, radius), avoid,
                       scale_radius=False)


def world_events(rng: np.random.Generator, pairs: int, plan: WorldPlan = WorldPlan(), width: int = 112,
                 height: int = 112, start: int = 0) -> list[Event]:
    """Events at random pairs of ``[start, pairs)``, one on screen at a time, a shape at most
    ``plan.max_per_shape`` times; a shape that comes back takes another colour with ``plan.recolor``."""
    events: list[Event] = []
    counts = {shape: 0 for shape in SHAPES}
    last: dict[str, str] = {}
    pair = start
    while pair < pairs:
        if rng.random() >= plan.rate:
            pair += 1
            continue
        free = [shape for shape in SHAPES if counts[shape] < plan.max_per_shape]
        if not free:
            break
        shape = str(rng.choice(free))
        color = str(rng.choice(COLORS))
        if shape in last and rng.random() < plan.recolor:
            color = str(rng.choice([c for c in COLORS if c != last[shape]]))
        length = min(int(rng.integers(plan.duration[0], plan.duration[1] + 1)), pairs - pair)
        events.append(world_event(rng, shape, color, pair, length, width, height,
                                  avoid=[e for e in events if e.shape == shape]))
        counts[shape] += 1
        last[shape] = color
        pair += length + plan.gap
    return events


def pick_family(rng: np.random.Generator, families: tuple[str, ...]) -> str:
    return families[int(rng.integers(len(families)))]


def world_scene(size: tuple[int, int] = (112, 112), fps: float = 2.0, frames: int | None = 400, seed: int = 0,
                rate: float = 0.05, duration: tuple[int, int] = (1, 8), families: tuple[str, ...] = (),
                holdout: tuple[str, ...] = (), randomize: bool = True, **overrides) -> WorldScene:
    """A world scene with a random schedule, as the ``synthetic:world`` source spec describes it: the
    family drawn from ``families`` less ``holdout`` (default all available), the style drawn at random
    (``randomize``) or plain, with any ``WorldStyle`` field given in ``overrides`` set as given."""
    width, height = size
    rng = np.random.default_rng((seed, 53))
    family = pick_family(rng, drawable_families(families or None, holdout))
    style = random_style(rng) if randomize else WorldStyle()
    if overrides:
        style = replace(style, **overrides)
    pairs = (frames if frames is not None else 2000) // 2
    events = world_events(np.random.default_rng((seed, 5)), pairs, WorldPlan(rate=rate, duration=duration),
                          width, height)
    return WorldScene(width, height, fps, seed, events, family, style, frames)
