"""Still pictures in and out — a frame as JPEG or PNG, a JPEG or PNG as a frame — for the parts of edgekv that show
or take one without a camera behind them: the status page's latest frame, evidence frames on disk, alerts' and
escalations' keyframes, a chat request's image. Frames are OpenCV's layout whatever decodes them: HxWx3 uint8 BGR
(HxWx4 BGRA where an alpha channel is asked for, HxW for grey).

OpenCV is the optional ``video`` extra; Pillow is a core dependency. A deployment without the extra (a
``synthetic:`` source and the server) gets the same pictures from Pillow and numpy: the same JPEG bytes (both write
through libjpeg-turbo with the same quality tables, 4:2:0 chroma and no optimisation), the same pixels from a PNG
either way, the same pixels decoded (a CMYK JPEG within 1), thumbnails shrunk within 1. Where OpenCV is installed
it does the work: it encodes a frame ~1.4x as fast (the status page and the frame store encode every frame they
keep), shrinks a thumbnail ~18x as fast and decodes a JPEG ~2.5x as fast.
"""

from __future__ import annotations

import io

import numpy as np

try:
    import cv2
except ImportError:  # the `video` extra is not installed (or its native libraries are not)
    cv2 = None

# What a decode takes: the two formats the server accepts (WebP and GIF arrive re-encoded as PNG by
# apps/server/request_images.py), so Pillow never reaches for a decoder of a format nobody sends.
_DECODED_FORMATS = ("JPEG", "PNG")
# Pillow's modes whose pixels carry an alpha channel (PNG colour types 4 and 6); "P" and "RGB" with a tRNS chunk
# carry one too, in ``info["transparency"]``.
_ALPHA_MODES = ("RGBA", "LA")
# Pillow's modes of 16-bit (and 32-bit) grey: cut to their high byte, as OpenCV's 8-bit read does
_WIDE_GREY_MODES = ("I;16", "I;16B", "I;16L", "I")
# Rows of a picture made into the frame at a time without OpenCV: the decoded picture, the frame and one band are
# held at once. Converted whole (``np.asarray(image.convert("RGB"))``, then flipped to BGR) a 6000 x 6000 JPEG took
# 480 MiB beside its 103 MiB frame — Pillow's copy for the convert, the bytes numpy reads it through, the flipped
# copy — where OpenCV decodes straight into the frame; a ROS CompressedImage is decoded at up to 64 megapixels.
_BAND_ROWS = 256


def has_opencv() -> bool:
    """Whether OpenCV does the encoding and decoding here (else Pillow)."""
    return cv2 is not None


def encode_jpeg(frame: np.ndarray, quality: int) -> bytes:
    """``frame`` (HxWx3 uint8 BGR, or HxW grey) as a baseline JPEG of libjpeg ``quality`` (1-100)."""
    _check(frame, (3,))
    if cv2 is not None:
        ok, data = cv2.imencode(".jpg", frame, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
        if not ok:
            raise ValueError(f"a frame of shape {frame.shape} does not encode as JPEG")
        return data.tobytes()
    out = io.BytesIO()
    _pillow_image(frame).save(out, "JPEG", quality=int(quality))
    return out.getvalue()


def encode_png(frame: np.ndarray, compression: int = 1) -> bytes:
    """``frame`` (HxWx3 uint8 BGR, HxWx4 BGRA, or HxW grey) as a PNG; ``compression`` is zlib's level (0-9):
    1, the default, writes fast for a picture that is decoded once."""
    _check(frame, (3, 4))
    if cv2 is not None:
        ok, data = cv2.imencode(".png", frame, [cv2.IMWRITE_PNG_COMPRESSION, int(compression)])
        if not ok:
            raise ValueError(f"a frame of shape {frame.shape} does not encode as PNG")
        return data.tobytes()
    out = io.BytesIO()
    _pillow_image(frame).save(out, "PNG", compress_level=int(compression))
    return out.getvalue()


def shrink(frame: np.ndarray, width: int, height: int) -> np.ndarray:
    """``frame`` averaged down to ``width`` x ``height`` (never up), each pixel out the mean of the area it covers,
    partly covered pixels weighted by the part: OpenCV's ``INTER_AREA``. Without OpenCV, numpy computes the same
    (within 1 where a mean falls on a half); Pillow's ``BOX`` would not do: it weighs whole pixels, so a thumbnail
    at a scale that is not a whole number came out up to 28 levels off at edges. The same layout out as in."""
    _check(frame, (3,))
    height, width = int(height), int(width)
    if not (0 < height <= frame.shape[0] and 0 < width <= frame.shape[1]):
        raise ValueError(f"shrink: {width} x {height} is not within the frame's {frame.shape[1]} x {frame.shape[0]}")
    if cv2 is not None:
        return cv2.resize(frame, (width, height), interpolation=cv2.INTER_AREA)
    return np.rint(_area_mean(_area_mean(frame, height, 0), width, 1)).astype(np.uint8)


def _area_mean(a: np.ndarray, n: int, axis: int) -> np.ndarray:
    """``a`` averaged to ``n`` samples along ``axis``: the running sum, read at the fractional bounds of each output
    sample (between two whole pixels it grows linearly), differenced, divided by the span."""
    size = a.shape[axis]
    if n == size:
        return a
    # uint8 rows add up exactly in int32 (255 x 2**23 rows would be needed to overflow)
    running = np.cumsum(a, axis=axis, dtype=np.int32 if a.dtype == np.uint8 else np.float64)
    running = np.concatenate([np.zeros_like(np.take(running, [0], axis)), running], axis)  # [.., size + 1, ..]
    bounds = np.arange(n + 1) * (size / n)
    whole = np.minimum(bounds.astype(np.int64), size - 1)
    part = (bounds - whole).reshape([n + 1 if d == axis % a.ndim else 1 for d in range(a.ndim)])
    below, above = np.take(running, whole, axis), np.take(running, whole + 1, axis)
    return np.diff(below + part * (above - below), axis=axis) * (n / size)


def decode_bgr(data: bytes) -> np.ndarray | None:
    """A JPEG or PNG as an HxWx3 uint8 BGR frame, as OpenCV's ``IMREAD_COLOR`` gives it: turned upright by its EXIF
    orientation, grey made colour, alpha dropped (the colour under it kept), 16-bit samples cut to their high byte.
    None if it does not decode (not a JPEG or PNG, cut off, corrupt, empty)."""
    if not data:  # OpenCV asserts on an empty buffer instead of answering None
        return None
    if cv2 is not None:
        return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    from PIL import Image, ImageOps

    try:
        with Image.open(io.BytesIO(data), formats=_DECODED_FORMATS) as image:
            ImageOps.exif_transpose(image, in_place=True)  # (not in place: a copy of the picture, upright or not)
            return _in_bands(image, "RGB")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None


def decode_bgra(data: bytes) -> np.ndarray | None:
    """A PNG with an alpha channel or a tRNS chunk as an HxWx4 uint8 BGRA array, as it is stored (no EXIF
    orientation applied; 16-bit samples cut to their high byte). None for a picture without transparency, a grey
    one whose tRNS names a transparent grey level (OpenCV reads that one without alpha), or one that does not
    decode."""
    if not data:
        return None
    if cv2 is not None:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_UNCHANGED)
        if image is None or image.ndim != 3 or image.shape[2] != 4:
            return None
        return (image >> 8).astype(np.uint8) if image.dtype == np.uint16 else image
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=("PNG",)) as image:
            keyed = image.mode in ("P", "RGB") and "transparency" in image.info
            if image.mode not in _ALPHA_MODES and not keyed:
                return None
            if keyed and image.mode == "RGB" and data[24:25] == b"\x10":
                # 16 bits a sample: Pillow holds the high bytes and compared them with the 16-bit key, so no pixel
                # was transparent (OpenCV's were); the key's high bytes are compared instead (the low ones are gone)
                image.info["transparency"] = tuple(int(v) >> 8 for v in image.info["transparency"])
            return _in_bands(image, "RGBA")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError):
        return None


def _in_bands(image, mode: str) -> np.ndarray:
    """The pixels of Pillow's ``image`` as OpenCV lays them out — [rows, columns, 3] BGR for ``mode`` "RGB",
    [rows, columns, 4] BGRA for "RGBA" — converted ``_BAND_ROWS`` at a time into the one array returned (16-bit grey
    cut to its high byte: Pillow's own convert would clip it at 255)."""
    width, height = image.size
    order = [2, 1, 0, 3][:len(mode)]
    out = np.empty((height, width, len(mode)), np.uint8)  # out: [rows, columns, 3 or 4], BGR(A)
    for top in range(0, height, _BAND_ROWS):
        band = image.crop((0, top, width, min(top + _BAND_ROWS, height)))
        rows = slice(top, top + band.height)
        if band.mode in _WIDE_GREY_MODES:
            out[rows, :, :3] = (np.asarray(band).astype(np.uint32) >> 8).astype(np.uint8)[..., None]
            out[rows, :, 3:] = 255
            continue
        pixels = np.asarray(band if band.mode == mode else band.convert(mode))  # [band rows, columns, 3 or 4], RGB(A)
        out[rows] = pixels[..., order]
    return out


def _check(frame: object, channels: tuple[int, ...]) -> None:
    if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or not (
            frame.ndim == 2 or (frame.ndim == 3 and frame.shape[2] in channels)) or 0 in frame.shape:
        layouts = " or ".join(f"HxWx{c}" for c in channels)
        got = f"{frame.dtype} array of shape {frame.shape}" if isinstance(frame, np.ndarray) else type(frame).__name__
        raise ValueError(f"expected a non-empty {layouts} (or HxW grey) uint8 picture, got a {got}")


def _pillow_image(frame: np.ndarray):
    """A Pillow image of ``frame``'s pixels, BGR(A) read as RGB(A) while unpacking: one copy, no numpy flip."""
    from PIL import Image

    frame = np.ascontiguousarray(frame)
    size = (frame.shape[1], frame.shape[0])
    if frame.ndim == 2:
        return Image.frombuffer("L", size, frame, "raw", "L", 0, 1)
    if frame.shape[2] == 3:
        return Image.frombuffer("RGB", size, frame, "raw", "BGR", 0, 1)
    return Image.frombuffer("RGBA", size, np.ascontiguousarray(frame[..., [2, 1, 0, 3]]), "raw", "RGBA", 0, 1)
