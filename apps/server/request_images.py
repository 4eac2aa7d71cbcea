"""A chat request's image made ready for the daemon's decoder (``server.image_requests``): a PNG with transparency
is composited onto white, as transformers' Qwen2.5-VL processor (``convert_to_rgb``), vLLM and a browser showing it
on a page do. OpenCV's colour decode, which the daemon uses, drops the alpha channel and keeps the colour under it:
a logo, a diagram or a screenshot whose transparent background hides black pixels reached the model as black
strokes on black. Everything else — JPEG (no alpha), PNG without transparency — goes on as it came.

The composite is exact integer arithmetic (the processor's rounding, no float image), in bands of rows: a 4096 x 4096
RGBA image costs ~25 MiB beside its decoded self. A PNG's EXIF orientation (``eXIf``), which OpenCV applies only
when it drops the alpha, is applied here, as ``PIL.ImageOps.exif_transpose`` does before the processor.

WebP and GIF — the other two formats OpenAI's chat API takes — are read with Pillow (sized from their header by
``pillow_image_size`` before anything is decoded, as a JPEG or PNG is) and handed on as an opaque PNG: transparency
(a WebP's alpha, a GIF's transparent colour) composited onto white the same way, EXIF orientation applied. An
animated one is refused, as OpenAI refuses it: which of its frames the question is about is not ours to guess.
"""

from __future__ import annotations

import io
import struct
import threading

import numpy as np

_PNG = b"\x89PNG\r\n\x1a\n"
_BAND_ROWS = 256
# One picture decoded at a time, whatever the requests in flight: a 16-bit 4096 x 4096 RGBA PNG is 128 MiB decoded
# (from ~100 KiB sent), and the executor runs several requests at once.
_DECODING = threading.Lock()


def is_webp_or_gif(data: bytes) -> bool:
    return (data[:4] == b"RIFF" and data[8:12] == b"WEBP") or data[:6] in (b"GIF87a", b"GIF89a")


def pillow_image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) of a WebP or GIF from its header (Pillow opens it lazily: no pixel is decoded); None for
    anything else. ``ValueError`` for one Pillow cannot read or one with several frames (animated)."""
    if not is_webp_or_gif(data):
        return None
    from PIL import Image

    kind = "GIF" if data[:3] == b"GIF" else "WebP"
    try:
        with Image.open(io.BytesIO(data), formats=("WEBP", "GIF")) as image:
            size, frames = image.size, getattr(image, "n_frames", 1)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"a {kind} image Pillow cannot read ({exc})") from None
    if frames > 1:
        raise ValueError(f"an animated {kind} ({frames} frames); send a still image (a single frame, as OpenAI's API "
                         "takes only non-animated GIFs)")
    return size


def opaque(data: bytes) -> bytes:
    """``data`` as the model should see it: a PNG with an alpha channel or a tRNS chunk re-encoded without it,
    composited onto white and turned upright; a WebP or GIF likewise, as a PNG (``ValueError`` if Pillow cannot
    decode it); any other image (or one OpenCV cannot read: the daemon says so) as it is."""
    if is_webp_or_gif(data):
        with _DECODING:
            return _from_pillow(data)
    if data[:8] != _PNG or len(data) < 26:
        return data
    color_type, chunks = data[25], _png_chunks(data)
    if color_type not in (4, 6) and b"tRNS" not in chunks:
        return data
    with _DECODING:
        return _composited(data, chunks)


def _composited(data: bytes, chunks: dict[bytes, bytes]) -> bytes:
    from edgekv.images import decode_bgra, encode_png

    image = decode_bgra(data)  # BGRA, 16-bit samples cut to the high byte as PIL does; orientation not applied
    if image is None:  # unreadable, or grey with a tRNS key: as it was
        return data
    return encode_png(upright(_on_white(image), exif_orientation(chunks.get(b"eXIf", b""))))


def _on_white(image: np.ndarray) -> np.ndarray:
    """image: [rows, columns, 4] uint8 (colour, alpha) -> [rows, columns, 3], composited onto white."""
    flat = np.empty(image.shape[:2] + (3,), np.uint8)
    for top in range(0, image.shape[0], _BAND_ROWS):
        band = image[top:top + _BAND_ROWS].astype(np.uint32)
        alpha = band[..., 3:]
        # round(c * a/255 + 255 * (1 - a/255)) = 255 - round(a * (255 - c) / 255); never a half (255 is odd)
        flat[top:top + _BAND_ROWS] = 255 - (2 * alpha * (255 - band[..., :3]) + 255) // 510
    return flat


def _from_pillow(data: bytes) -> bytes:
    """A WebP or GIF (one frame) as an opaque, upright PNG."""
    from PIL import Image, ImageOps

    from edgekv.images import encode_png

    kind = "GIF" if data[:3] == b"GIF" else "WebP"
    try:
        with Image.open(io.BytesIO(data), formats=("WEBP", "GIF")) as image:
            rgba = np.asarray(ImageOps.exif_transpose(image).convert("RGBA"))  # rgba: [rows, columns, 4], RGBA
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ValueError(f"a {kind} image Pillow cannot decode ({exc})") from None
    flat = _on_white(np.ascontiguousarray(rgba[..., [2, 1, 0, 3]]))  # BGRA, as OpenCV writes
    return encode_png(flat)


def _png_chunks(data: bytes) -> dict[bytes, bytes]:
    """The first chunk of each type, by type, walking the chunk headers (the image data is skipped, not read)."""
    chunks, at = {}, 8
    while at + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        chunks.setdefault(kind, data[at + 8:at + 8 + length])
        if kind == b"IEND":
            break
        at += 12 + length
    return chunks


def exif_orientation(tiff: bytes) -> int:
    """The orientation tag (0x0112) of EXIF data's first IFD (a TIFF header and directory), 1 when absent."""
    order = {b"II*\x00": "<", b"MM\x00*": ">"}.get(tiff[:4])
    if order is None or len(tiff) < 8:
        return 1
    ifd = struct.unpack(order + "I", tiff[4:8])[0]
    if ifd + 2 > len(tiff):
        return 1
    for entry in range(struct.unpack(order + "H", tiff[ifd:ifd + 2])[0]):
        at = ifd + 2 + 12 * entry
        if at + 12 > len(tiff):
            break
        tag, kind = struct.unpack(order + "HH", tiff[at:at + 4])
        if tag == 0x0112 and kind == 3:  # SHORT
            value = struct.unpack(order + "H", tiff[at + 8:at + 10])[0]
            return value if 1 <= value <= 8 else 1
    return 1


def upright(image: np.ndarray, orientation: int) -> np.ndarray:
    """``image`` (rows, columns, ...) as EXIF ``orientation`` says it is to be shown (the eight of TIFF 6.0)."""
    if orientation in (5, 6, 7, 8):
        image = image.swapaxes(0, 1)  # 5: transposed; 6, 7, 8: from the transpose by one flip
        image = {5: image, 6: image[:, ::-1], 7: image[::-1, ::-1], 8: image[::-1]}[orientation]
    else:
        image = {1: image, 2: image[:, ::-1], 3: image[::-1, ::-1], 4: image[::-1]}.get(orientation, image)
    return np.ascontiguousarray(image)
