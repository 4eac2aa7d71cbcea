"""A JPEG's or PNG's size from its header, read before anything is decoded: a small file can declare a huge image
(a 2.6 MB PNG of zeros decodes to 30,000 x 30,000, 2.7 GB), so a decoder fed from outside — an HTTP request's
image (apps/server/openai_chat.py), a ROS 2 CompressedImage (edgekv/video/ros_images.py) — is sized first.
PNG: the IHDR chunk that must come first (PNG spec 11.2.2); JPEG: the first SOFn frame header's lines and samples
per line (ITU T.81 B.2.2), walking the marker segments before it."""

from __future__ import annotations

_JPEG_FRAMES = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}  # SOF0-15 but DHT, JPG, DAC


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR or a JPEG's frame header; None for anything else (or a header cut off)."""
    if data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR" and len(data) >= 24:
        return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    if data[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill byte
            at += 1
            continue
        if marker in (0x01, *range(0xD0, 0xD8)):  # no length
            at += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image, start of scan: no frame header before the data
            return None
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if marker in _JPEG_FRAMES:
            if at + 9 > len(data):
                return None
            return int.from_bytes(data[at + 7:at + 9], "big"), int.from_bytes(data[at + 5:at + 7], "big")
        if length < 2:
            return None
        at += 2 + length
    return None
