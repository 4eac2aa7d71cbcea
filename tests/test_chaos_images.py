"""Pictures decoded without OpenCV (edgekv/images.py, Pillow's path) at their edges: a large picture, a 16-bit PNG
with a transparent colour key.

Before: a large picture was converted whole — Pillow's converted copy, the bytes numpy read it through and the
copy flipped to BGR, each beside the other — about 4.5x the frame's own bytes on top of Pillow's picture (a 6000 x
6000 JPEG: 480 MiB for a 103 MiB frame; a ROS CompressedImage is taken up to 64 megapixels); and a 16-bit RGB PNG
with a tRNS key had no transparent pixel without OpenCV (Pillow compared the 16-bit key with 8-bit pixels)."""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image

from test_images_without_opencv import HAVE_OPENCV, installed_images
from test_images_without_opencv import without_opencv as without_opencv_fixture

without_opencv = without_opencv_fixture  # edgekv.images as on a machine without OpenCV, a fixture here too


def _saved(image: Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def _png16_rgb(rgb16: np.ndarray, key: tuple[int, int, int]) -> bytes:
    """A 16-bit RGB PNG of ``rgb16`` ([rows, columns, 3] uint16) with the tRNS colour ``key``, chunk by chunk
    (Pillow cannot write 16-bit RGB)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    height, width = rgb16.shape[:2]
    rows = b"".join(b"\0" + rgb16[row].astype(">u2").tobytes() for row in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0))
            + chunk(b"tRNS", struct.pack(">HHH", *key)) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


@pytest.mark.parametrize("kind", ["jpeg", "png grey", "png palette"])
def test_a_large_picture_is_decoded_beside_little_more_than_its_frame(without_opencv, kind):
    """What numpy allocates (traced) stays near the frame itself; Pillow's own picture is not traced."""
    rng = np.random.default_rng(4)
    rgb = Image.fromarray(rng.integers(0, 256, (4096, 1024, 3), dtype=np.uint8))
    data = {"jpeg": lambda: _saved(rgb, "JPEG", quality=90), "png grey": lambda: _saved(rgb.convert("L"), "PNG"),
            "png palette": lambda: _saved(rgb.convert("P"), "PNG")}[kind]()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        frame = without_opencv.decode_bgr(data)
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert frame.shape == (4096, 1024, 3) and frame.flags.writeable and frame.flags.c_contiguous
    assert peak < 1.3 * frame.nbytes, (peak / frame.nbytes, kind)  # was 2x and more: bytes, then a flipped copy
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[..., ::-1]
    assert np.array_equal(frame, expected)


def test_a_large_transparent_png_is_decoded_in_bands_to_the_same_pixels(without_opencv):
    rng = np.random.default_rng(5)
    rgba = rng.integers(0, 256, (700, 300, 4), dtype=np.uint8)  # more rows than a band, not a multiple of it
    bgra = without_opencv.decode_bgra(_saved(Image.fromarray(rgba, "RGBA"), "PNG"))
    assert bgra is not None and np.array_equal(bgra, rgba[..., [2, 1, 0, 3]])
    grey16 = (rng.integers(0, 65536, (700, 30))).astype(np.uint16)
    bgr = without_opencv.decode_bgr(_saved(Image.fromarray(grey16), "PNG"))
    assert np.array_equal(bgr, np.repeat((grey16 >> 8).astype(np.uint8)[..., None], 3, axis=2))


def test_a_16_bit_png_keyed_transparent_has_its_key_colour_transparent(without_opencv):
    rgb16 = np.random.default_rng(6).integers(0, 65536, (6, 5, 3), dtype=np.uint16)
    key = tuple(int(v) for v in rgb16[2, 3])
    bgra = without_opencv.decode_bgra(_png16_rgb(rgb16, key))
    assert bgra is not None and bgra[2, 3, 3] == 0  # was 255: no pixel matched the 16-bit key
    assert np.array_equal(bgra[..., :3], (rgb16 >> 8).astype(np.uint8)[..., ::-1])
    alpha = np.full((6, 5), 255, np.uint8)
    alpha[2, 3] = 0
    assert np.array_equal(bgra[..., 3], alpha)
    if HAVE_OPENCV:
        assert np.array_equal(installed_images.decode_bgra(_png16_rgb(rgb16, key)), bgra)
