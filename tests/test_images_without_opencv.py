"""Pictures in and out without the ``video`` extra (edgekv/images.py): the status page's latest frame, evidence
frames on disk, alerts' keyframes and a chat request's image are encoded and decoded by Pillow where OpenCV is not
installed, in the same colour order and — where OpenCV is installed to compare with — to the same bytes (JPEG),
the same pixels (PNG, decoding) or within one level (area shrinking). OpenCV is hidden in this process
(``sys.modules["cv2"] = None``) and edgekv.images imported afresh; nothing is installed or removed."""

from __future__ import annotations

import importlib
import io
import sys

import numpy as np
import pytest
from PIL import Image

import edgekv
from edgekv import images as installed_images

HAVE_OPENCV = installed_images.has_opencv()
needs_opencv = pytest.mark.skipif(not HAVE_OPENCV, reason="compares with OpenCV, which is not installed")

# A known picture, in RGB: red, green, blue, white, black and one odd colour, in 8 x 8 blocks
_RGB_BLOCKS = [(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 255), (0, 0, 0), (200, 120, 40)]


def _known_rgb() -> np.ndarray:
    rgb = np.zeros((8, 8 * len(_RGB_BLOCKS), 3), np.uint8)  # rgb: [8, 48, 3]
    for index, colour in enumerate(_RGB_BLOCKS):
        rgb[:, 8 * index:8 * index + 8] = colour
    return rgb


def _saved(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _exif(orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return exif.tobytes()


def _camera_like(height: int = 48, width: int = 64, seed: int = 0) -> np.ndarray:
    """BGR gradients under noise: smooth areas and edges, as a camera's frame has."""
    rows, columns = np.mgrid[0:height, 0:width]
    smooth = np.stack([columns * 255 // width, rows * 255 // height, (rows + columns) % 256], axis=-1)
    grain = np.random.default_rng(seed).integers(-20, 21, smooth.shape)
    return np.clip(smooth + grain, 0, 255).astype(np.uint8)


@pytest.fixture
def without_opencv(monkeypatch):
    """edgekv.images as imported on a machine without OpenCV; what imports from it inside a function (the frame
    store, the keyframe ring, a request's image) gets this one until the test ends."""
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ModuleNotFoundError
    monkeypatch.delitem(sys.modules, "edgekv.images")
    monkeypatch.setattr(edgekv, "images", installed_images)  # put back on the package by monkeypatch afterwards
    fresh = importlib.import_module("edgekv.images")
    assert not fresh.has_opencv()
    return fresh


@pytest.fixture(params=["pillow", "opencv"])
def images(request):
    """Each way edgekv.images works: Pillow's (always), OpenCV's (where installed)."""
    if request.param == "opencv":
        if not HAVE_OPENCV:
            pytest.skip("OpenCV is not installed")
        return installed_images
    return request.getfixturevalue("without_opencv")


# ------------------------------------------------------------------ colour order on a known picture
def test_a_jpeg_keeps_the_colours_of_a_bgr_frame(images):
    rgb = _known_rgb()
    jpeg = images.encode_jpeg(np.ascontiguousarray(rgb[..., ::-1]), 95)  # the frame is BGR, as sources give it
    seen = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB")).astype(int)  # seen: [8, 48, 3], RGB
    for index, colour in enumerate(_RGB_BLOCKS):
        centre = seen[4, 8 * index + 4]
        assert np.abs(centre - colour).max() <= 8, (colour, centre)


def test_a_png_holds_a_bgr_frame_pixel_for_pixel(images):
    rgb = _known_rgb()
    for frame, mode in ((np.ascontiguousarray(rgb[..., ::-1]), "RGB"),
                        (np.dstack([rgb[..., ::-1], np.arange(48, dtype=np.uint8)[None, :].repeat(8, 0)]), "RGBA"),
                        (rgb[..., 0].copy(), "L")):
        png = images.encode_png(frame)
        with Image.open(io.BytesIO(png)) as image:
            assert image.mode == mode
            back = np.asarray(image)
        expected = frame if mode == "L" else frame[..., [2, 1, 0, 3][:frame.shape[2]]]
        assert np.array_equal(back, expected), mode


def test_decoding_gives_bgr_in_the_pictures_own_colours(images):
    rgb = _known_rgb()
    png = _saved(Image.fromarray(rgb), "PNG")
    assert np.array_equal(images.decode_bgr(png), rgb[..., ::-1])
    jpeg = images.decode_bgr(_saved(Image.fromarray(rgb), "JPEG", quality=95))
    assert jpeg.shape == (8, 48, 3) and jpeg.dtype == np.uint8
    for index, colour in enumerate(_RGB_BLOCKS):
        assert np.abs(jpeg[4, 8 * index + 4].astype(int) - colour[::-1]).max() <= 8, colour
    alpha = np.full((8, 48, 1), 128, np.uint8)
    bgra = images.decode_bgra(_saved(Image.fromarray(np.dstack([rgb, alpha])), "PNG"))
    assert np.array_equal(bgra, np.dstack([rgb[..., ::-1], alpha]))


def test_decoding_turns_a_photo_upright_and_makes_grey_colour(images):
    rgb = _known_rgb()
    turned = images.decode_bgr(_saved(Image.fromarray(rgb), "PNG", exif=_exif(6)))  # 6: rotate 90 degrees clockwise
    assert np.array_equal(turned, np.rot90(rgb[..., ::-1], k=-1))
    grey = images.decode_bgr(_saved(Image.fromarray(rgb[..., 1]), "PNG"))
    assert np.array_equal(grey, np.repeat(rgb[..., 1:2], 3, axis=2))
    deep = Image.fromarray((rgb[..., 1].astype(np.uint16) * 257))  # 16-bit grey: the high byte, not clipped
    assert np.array_equal(images.decode_bgr(_saved(deep, "PNG")), np.repeat(rgb[..., 1:2], 3, axis=2))


@pytest.mark.parametrize("data", [b"", b"not a picture", b"\xff\xd8\xff\xe0\x00\x10JFIF", b"\x89PNG\r\n\x1a\n\x00"])
def test_what_does_not_decode_is_none(images, data):
    assert images.decode_bgr(data) is None
    assert images.decode_bgra(data) is None


def test_a_picture_without_transparency_has_no_bgra(images):
    rgb = _known_rgb()
    assert images.decode_bgra(_saved(Image.fromarray(rgb), "PNG")) is None
    # a grey PNG whose tRNS names a transparent level: OpenCV reads it without alpha, and so does Pillow's path
    assert images.decode_bgra(_saved(Image.fromarray(rgb[..., 0]), "PNG", transparency=255)) is None


@pytest.mark.parametrize("bad", [np.zeros((0, 4, 3), np.uint8), np.zeros((4, 4, 3), np.float32),
                                 np.zeros((4, 4, 2), np.uint8), "frame"])
def test_encoding_something_that_is_no_picture_names_what_came(images, bad):
    with pytest.raises(ValueError, match="uint8 picture, got"):
        images.encode_jpeg(bad, 80)


def test_shrink_averages_the_area_each_pixel_covers(images):
    frame = np.zeros((4, 6, 3), np.uint8)
    frame[:, 3:] = 200  # the right half bright: shrunk to 4 columns, the middle two straddle the edge
    shrunk = images.shrink(frame, 4, 2)
    # columns cover 1.5 source columns each: [0, 1.5), [1.5, 3), [3, 4.5), [4.5, 6)
    assert shrunk[:, :, 0].tolist() == [[0, 0, 200, 200]] * 2
    frame[:, 2] = 90  # a column split between two outputs: half of it in each
    assert images.shrink(frame, 4, 2)[0, :, 0].tolist() == [0, 60, 200, 200]  # (0.5 * 0 + 1 * 90) / 1.5
    with pytest.raises(ValueError, match="not within"):
        images.shrink(frame, 7, 2)


# ------------------------------------------------------------------ the same output as OpenCV's
def _decoded_variants() -> dict[str, bytes]:
    frame = _camera_like()
    rgb = Image.fromarray(np.ascontiguousarray(frame[..., ::-1]))
    variants = {
        "jpeg 4:2:0": _saved(rgb, "JPEG", quality=85), "jpeg 4:4:4": _saved(rgb, "JPEG", quality=90, subsampling=0),
        "jpeg progressive": _saved(rgb, "JPEG", progressive=True), "jpeg grey": _saved(rgb.convert("L"), "JPEG"),
        "png": _saved(rgb, "PNG"), "png grey": _saved(rgb.convert("L"), "PNG"),
        "png 1-bit": _saved(rgb.convert("1"), "PNG"),
        "png palette": _saved(rgb.convert("P"), "PNG"), "png rgba": _saved(rgb.convert("RGBA"), "PNG"),
        "png grey+alpha": _saved(rgb.convert("LA"), "PNG"),
        "png palette+tRNS": _saved(rgb.convert("P"), "PNG", transparency=3),
        "png rgb+tRNS": _saved(rgb, "PNG", transparency=tuple(int(v) for v in frame[0, 0, ::-1])),
        "png 16-bit grey": _saved(Image.fromarray(frame[..., 0].astype(np.uint16) * 251), "PNG"),
    }
    for orientation in (3, 5, 6, 8):
        variants[f"jpeg exif {orientation}"] = _saved(rgb, "JPEG", exif=_exif(orientation))
        variants[f"png exif {orientation}"] = _saved(rgb, "PNG", exif=_exif(orientation))
    return variants


@needs_opencv
def test_pillows_jpeg_is_opencvs_byte_for_byte(without_opencv):
    frame = _camera_like(96, 128)
    for picture in (frame, frame[..., 1].copy(), frame[::2, 1::3]):  # colour, grey, a non-contiguous view
        for quality in (80, 85, 30, 100):  # the status page's and frame store's, the keyframes', the extremes
            assert without_opencv.encode_jpeg(picture, quality) == installed_images.encode_jpeg(picture, quality)


@needs_opencv
@pytest.mark.parametrize("name", sorted(_decoded_variants()))
def test_pillow_decodes_the_pixels_opencv_decodes(without_opencv, name):
    data = _decoded_variants()[name]
    for decode in ("decode_bgr", "decode_bgra"):
        theirs, ours = getattr(installed_images, decode)(data), getattr(without_opencv, decode)(data)
        assert (theirs is None) == (ours is None), decode
        if theirs is not None:
            assert ours.dtype == theirs.dtype and np.array_equal(ours, theirs), decode


@needs_opencv
def test_pillows_png_decodes_to_opencvs_pixels(without_opencv):
    cv2 = installed_images.cv2  # the real module: the fixture hid it from `import`
    frame = _camera_like()
    for picture in (frame, np.dstack([frame, frame[..., :1]]), frame[..., 2].copy()):
        ours = cv2.imdecode(np.frombuffer(without_opencv.encode_png(picture), np.uint8), cv2.IMREAD_UNCHANGED)
        assert np.array_equal(ours, picture)


@needs_opencv
def test_numpys_area_shrink_is_opencvs_within_one_level(without_opencv):
    rng = np.random.default_rng(0)
    frame = _camera_like(120, 160)
    for picture in (frame, frame[..., 0].copy(), frame[::3, ::2]):
        for _ in range(25):
            height, width = int(rng.integers(1, picture.shape[0] + 1)), int(rng.integers(1, picture.shape[1] + 1))
            theirs = installed_images.shrink(picture, width, height)
            ours = without_opencv.shrink(picture, width, height)
            assert ours.shape == theirs.shape and ours.dtype == np.uint8
            assert np.abs(ours.astype(int) - theirs).max() <= 1, (picture.shape, width, height)


# ------------------------------------------------------------------ what a deployment without the extra runs
def test_the_frame_store_writes_thumbnails_without_opencv(without_opencv, tmp_path):
    from edgekv.apps.daemon.frame_store import JPEG_QUALITY, FrameStore, encode_thumbnail

    frame = _camera_like(240, 320)
    jpeg = encode_thumbnail(frame, 80)
    with Image.open(io.BytesIO(jpeg)) as image:
        assert image.format == "JPEG" and image.size == (80, 60)
    small = encode_thumbnail(frame[:60, :80], 320)  # never scaled up
    assert small == without_opencv.encode_jpeg(np.ascontiguousarray(frame[:60, :80]), JPEG_QUALITY)
    with FrameStore(tmp_path, max_bytes=1 << 22, px=80) as store:
        store.submit("ab" * 16, 0, 0.0, None, frame)
        store.flush()
        assert store.stats()["frames_kept"] == 1 and store.stats()["frames_write_errors"] == 0


@needs_opencv
def test_a_thumbnail_without_opencv_looks_as_with_it(monkeypatch):
    from edgekv.apps.daemon.frame_store import encode_thumbnail

    frame = _camera_like(240, 320)
    theirs = {px: encode_thumbnail(frame, px) for px in (80, 96, 200)}  # a quarter; 0.3 and 0.625: not whole
    monkeypatch.setitem(sys.modules, "cv2", None)
    monkeypatch.delitem(sys.modules, "edgekv.images")
    monkeypatch.setattr(edgekv, "images", installed_images)
    for px, jpeg in theirs.items():
        ours = encode_thumbnail(frame, px)
        assert sys.modules["edgekv.images"] is not installed_images
        decoded = [np.asarray(Image.open(io.BytesIO(data))).astype(int) for data in (jpeg, ours)]
        assert decoded[0].shape == decoded[1].shape
        assert np.abs(decoded[0] - decoded[1]).mean() < 0.5, px  # JPEG of frames within one level of each other


def test_alert_keyframes_encode_without_opencv(without_opencv):
    from edgekv.apps.outputs.alerts import KeyframeRing

    ring = KeyframeRing(pairs=2)
    frame = np.ascontiguousarray(_known_rgb()[..., ::-1])
    ring.add(0, frame, 0.0)
    jpeg, note = ring.jpeg(0)
    assert jpeg == without_opencv.encode_jpeg(frame, 85) and "frame pair 0" in note
    assert ring.jpeg_of(0) == jpeg
    ring.add(1, np.zeros((0, 0, 3), np.uint8), 1.0)  # no picture: no keyframe, not an exception in the outputs
    assert ring.jpeg_of(1) is None


def test_a_transparent_request_image_is_flattened_without_opencv(without_opencv):
    from edgekv.apps.server.request_images import opaque

    rgb = _known_rgb()
    alpha = np.zeros((8, 48, 1), np.uint8)
    alpha[:, :24] = 255  # the left half opaque, the right half transparent (white once flattened)
    flat = opaque(_saved(Image.fromarray(np.dstack([rgb, alpha])), "PNG", exif=_exif(3)))  # 3: upside down
    with Image.open(io.BytesIO(flat)) as image:
        assert image.format == "PNG" and image.mode == "RGB"
        seen = np.asarray(image)
    expected = rgb.copy()
    expected[:, 24:] = 255
    assert np.array_equal(seen, np.rot90(expected, 2))
    gif = _saved(Image.fromarray(rgb).convert("P"), "GIF")
    with Image.open(io.BytesIO(opaque(gif))) as image:
        assert image.format == "PNG" and image.size == (48, 8)


@needs_opencv
def test_a_request_image_is_flattened_to_the_same_pixels_either_way(without_opencv, monkeypatch):
    from edgekv.apps.server import request_images

    frame = _camera_like()
    alpha = np.random.default_rng(1).integers(0, 256, frame.shape[:2] + (1,), dtype=np.uint8)
    data = _saved(Image.fromarray(np.dstack([frame[..., ::-1], alpha])), "PNG", exif=_exif(6))
    ours = request_images.opaque(data)
    monkeypatch.setitem(sys.modules, "edgekv.images", installed_images)  # OpenCV's again
    theirs = request_images.opaque(data)
    assert np.array_equal(installed_images.decode_bgr(ours), installed_images.decode_bgr(theirs))


def test_bench_frames_runs_without_opencv(without_opencv, tmp_path):
    """``edgekv bench frames`` measures the writer as a deployment without the extra runs it (Pillow's encoder,
    numpy's shrink), a camera's ``--size`` included, and says which encoder it measured."""
    import json

    from edgekv.apps.cli import main

    out_json = tmp_path / "frames.json"
    code = main(["bench", "frames", "--sources", "synthetic:world?size=96x64&fps=2&frames=20&seed=3", "--px", "32",
                 "--frames", "2", "--size", "120", "80", "--frames-mib", "1", "--json", str(out_json), "--plot", ""])
    assert code == 0
    result = json.loads(out_json.read_text())
    assert result["encoder"] == "pillow"
    assert result["rows"][0]["frame_shape"] == [80, 120, 3] and result["rows"][0]["write_errors"] == 0
