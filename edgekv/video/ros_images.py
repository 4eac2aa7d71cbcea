"""ROS 2 camera messages -> frames: what the ``ros2:`` (live topic) and ``rosbag:`` (recorded bag) sources share.

Messages arrive as CDR bytes (the DDS wire and rosbag2 store the same serialization) and are decoded with
``rosbags``' typestore (pure Python; the ``ros2`` extra), then turned into an HxWx3 uint8 BGR frame:

- ``sensor_msgs/msg/Image`` (sensor_msgs/msg/Image.msg: ``header``, ``height``, ``width``, ``encoding``,
  ``is_bigendian``, ``step`` = bytes per row, ``data`` = ``step * height`` bytes). Encodings, as
  sensor_msgs/image_encodings.hpp names them: ``rgb8``, ``bgr8``, ``rgba8``, ``bgra8``, ``mono8``,
  ``8UC1``/``8UC3``/``8UC4`` (read as mono8/bgr8/bgra8); the 16-bit ``mono16``, ``rgb16``, ``bgr16``,
  ``rgba16``, ``bgra16`` (``is_bigendian`` says the byte order; the high byte is kept, as cv_bridge's
  conversion to 8 bits does); the raw Bayer mosaics of machine-vision and CSI sensors ``bayer_rggb8``,
  ``bayer_bggr8``, ``bayer_gbrg8``, ``bayer_grbg8`` and their 16-bit twins (the pattern names the top-left 2x2
  block read row by row; demosaiced bilinearly by OpenCV); the 4:2:2 YUV pair ``yuv422`` (UYVY byte order,
  https://www.fourcc.org/pixel-format/yuv-uyvy) and ``yuv422_yuy2`` (YUYV,
  https://www.fourcc.org/pixel-format/yuv-yuy2; also accepted as ``uyvy`` / ``yuyv``, the names newer ROS 2
  releases and some V4L2 drivers write); and the two-plane YUV of hardware encoders and ISPs, ``nv12`` /
  ``nv21`` (4:2:0: the Y plane, then half as many rows of interleaved U,V / V,U) and ``nv24`` (4:4:4: the Y
  plane, then as many rows of interleaved U,V, each twice ``step``), as the kernel's V4L2 pixel-format pages
  lay them out (userspace-api/media/v4l/pixfmt-yuv-planar), BT.601 limited range as OpenCV converts NV12.
  Rows may be padded (``step`` larger than the pixels need; a chroma row of a two-plane image is ``step``
  bytes, ``2 * step`` in ``nv24``).
- ``sensor_msgs/msg/CompressedImage`` (``format``, ``data``): JPEG or PNG, decoded with OpenCV. ``format``
  is either ``jpeg``/``png`` or image_transport's ``"<raw encoding>; <jpeg|png> compressed <target>"``; a
  ``target`` of ``rgb8`` means the compressed pixels are in RGB order and are swapped back.

Anything else is a ``CorruptFrame`` naming what was wrong (encoding, sizes, truncation), which the
capture thread skips and counts: one bad message never costs the stream.

Time comes from ``header.stamp`` (``StampClock``): seconds since the first frame, exact to the nanosecond
within a run of trusted steps, and never going back (a stamp that jumps becomes a bounded, logged gap:
DESIGN invariant 12).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np

from edgekv.video.image_header import image_size
from edgekv.images import decode_bgr
from edgekv.video.sources import OPENCV_EXTRA, CorruptFrame, SourceUnavailable, cv2, has_opencv

__all__ = ["COMPRESSED", "IMAGE", "STRING", "IMAGE_TYPES", "StampClock", "decode_cdr", "frame_from_message",
           "stamp_ns", "typestore"]

log = logging.getLogger("edgekv.video")

IMAGE = "sensor_msgs/msg/Image"
COMPRESSED = "sensor_msgs/msg/CompressedImage"
STRING = "std_msgs/msg/String"
IMAGE_TYPES = (IMAGE, COMPRESSED)
INSTALL_HINT = "pip install 'edgekv[ros2]'"
MAX_COMPRESSED_PIXELS = 8192 * 8192  # a CompressedImage, decoded (8K video is 33 Mpx)

# encoding -> (bytes per pixel, the conversion to BGR by OpenCV's name, COLOR_<name>, or None for a plain copy); 16-bit
# ones are read as their high bytes first (_SIXTEEN), Bayer mosaics demosaiced (OpenCV names a pattern by the second
# row's second and third pixels: ROS's rggb, whose top-left block is R G / G B, is OpenCV's BayerBG, as cv_bridge maps
# it). The channel picks (_BY_NUMPY) need no OpenCV; Bayer and YUV do (the `video` extra).
_ENCODINGS: dict[str, tuple[int, str | None]] = {
    "bgr8": (3, None), "8uc3": (3, None),
    "rgb8": (3, "RGB2BGR"),
    "bgra8": (4, "BGRA2BGR"), "8uc4": (4, "BGRA2BGR"), "rgba8": (4, "RGBA2BGR"),
    "mono8": (1, "GRAY2BGR"), "8uc1": (1, "GRAY2BGR"),
    "mono16": (2, "GRAY2BGR"),
    "bgr16": (6, None), "rgb16": (6, "RGB2BGR"),
    "bgra16": (8, "BGRA2BGR"), "rgba16": (8, "RGBA2BGR"),
    "bayer_rggb8": (1, "BayerBG2BGR"), "bayer_bggr8": (1, "BayerRG2BGR"),
    "bayer_gbrg8": (1, "BayerGR2BGR"), "bayer_grbg8": (1, "BayerGB2BGR"),
    "bayer_rggb16": (2, "BayerBG2BGR"), "bayer_bggr16": (2, "BayerRG2BGR"),
    "bayer_gbrg16": (2, "BayerGR2BGR"), "bayer_grbg16": (2, "BayerGB2BGR"),
    "yuv422": (2, "YUV2BGR_UYVY"), "uyvy": (2, "YUV2BGR_UYVY"),
    "yuv422_yuy2": (2, "YUV2BGR_YUYV"), "yuyv": (2, "YUV2BGR_YUYV"),
    "nv12": (1, "YUV2BGR_NV12"), "nv21": (1, "YUV2BGR_NV21"), "nv24": (1, None),
}
# the conversions that only pick, reorder or repeat channels: the same pixels as cvtColor's, with numpy
_BY_NUMPY = {
    "RGB2BGR": lambda p: p[..., ::-1],
    "BGRA2BGR": lambda p: p[..., :3],
    "RGBA2BGR": lambda p: p[..., 2::-1],
    "GRAY2BGR": lambda p: np.repeat(p[..., None], 3, axis=2),
}
_SIXTEEN = frozenset(name for name in _ENCODINGS if name.endswith("16"))
_PACKED_YUV = frozenset({"yuv422", "uyvy", "yuv422_yuy2", "yuyv"})  # a pixel pair shares its chroma
_TWO_PLANE = {"nv12": 2, "nv21": 2, "nv24": 1}  # the chroma plane's rows: 1 for 2 luma rows (4:2:0), or for 1
ENCODINGS = tuple(sorted(_ENCODINGS))
_JPEG_MAGIC, _PNG_MAGIC = b"\xff\xd8", b"\x89PNG\r\n\x1a\n"


@functools.cache
def typestore() -> Any:
    """rosbags' message definitions of ROS 2 Humble (the distribution JetPack 6's Ubuntu 22.04 carries);
    Image, CompressedImage, Header and String are the same in every ROS 2 release since Foxy."""
    try:
        from rosbags.typesys import Stores, get_typestore
    except ImportError:
        raise SourceUnavailable(f"ROS 2 messages need the rosbags package: {INSTALL_HINT}") from None
    return get_typestore(Stores.ROS2_HUMBLE)


def decode_cdr(raw: bytes | memoryview, msgtype: str) -> Any:
    """A message from its serialized bytes (4-byte encapsulation header + CDR), or ``CorruptFrame``.

    Plain CDR (encapsulation 0x0000 big-, 0x0001 little-endian: what every ROS 2 RMW writes) is decoded as
    it is. XCDR2's PLAIN_CDR2 (0x0006/0x0007) lays these messages out identically (no member wider than
    4 bytes, so XCDR2's 4-byte maximum alignment changes nothing; XTypes 1.3 section 7.4.3.5) and is read
    the same way; delimited or parameter-list encodings are refused."""
    raw = bytes(raw)
    if len(raw) < 4:
        raise CorruptFrame(f"{msgtype}: a message of {len(raw)} bytes is shorter than its CDR header")
    kind = raw[1] if raw[0] == 0 else -1
    if kind in (6, 7):
        raw = bytes((0, kind - 6)) + raw[2:]
    elif kind not in (0, 1):
        raise CorruptFrame(f"{msgtype}: CDR encapsulation 0x{raw[:2].hex()} is not plain CDR")
    try:
        return typestore().deserialize_cdr(raw, msgtype)
    except Exception as exc:  # rosbags raises SerdeError, struct.error or ValueError on malformed bytes
        raise CorruptFrame(f"{msgtype}: a malformed or truncated message ({len(raw)} bytes): {exc}") from None


def stamp_ns(header: Any) -> int | None:
    """``header.stamp`` in integer nanoseconds, or None when it is unset (0 s: drivers that never fill it)."""
    stamp = header.stamp
    value = int(stamp.sec) * 1_000_000_000 + int(stamp.nanosec)
    return value if value != 0 else None


def frame_from_message(msg: Any, msgtype: str) -> np.ndarray:
    """An HxWx3 uint8 BGR frame (a new array) from an Image or CompressedImage message; ``CorruptFrame``
    saying why when it cannot be one."""
    if msgtype == IMAGE:
        return _from_image(msg)
    if msgtype == COMPRESSED:
        return _from_compressed(msg)
    raise CorruptFrame(f"{msgtype} is not a camera image (expected {IMAGE} or {COMPRESSED})")


def _from_image(msg: Any) -> np.ndarray:
    encoding = str(msg.encoding)
    name = encoding.lower()
    entry = _ENCODINGS.get(name)
    if entry is None:
        raise CorruptFrame(f"{IMAGE}: encoding {encoding!r} is not supported (supported: {', '.join(ENCODINGS)})")
    bpp, conversion = entry
    height, width, step = int(msg.height), int(msg.width), int(msg.step)
    if height == 0 or width == 0:
        raise CorruptFrame(f"{IMAGE}: an empty image ({width}x{height})")
    if step < width * bpp:
        raise CorruptFrame(f"{IMAGE}: step {step} is less than width {width} x {bpp} bytes of {encoding}")
    if name in _PACKED_YUV and width % 2:
        raise CorruptFrame(f"{IMAGE}: {encoding} pairs pixels, but the width {width} is odd")
    if name in ("nv12", "nv21") and (width % 2 or height % 2):
        raise CorruptFrame(f"{IMAGE}: {encoding} shares a chroma sample among 2x2 pixels, but the image is "
                           f"{width}x{height} (odd)")
    # the bytes the rows take: a two-plane image's chroma rows come after its luma rows
    needed = step * height + (step * height // 2 if name in ("nv12", "nv21") else 2 * step * height if name == "nv24"
                              else 0)
    data = np.asarray(msg.data, dtype=np.uint8).reshape(-1)
    if data.size < needed:
        raise CorruptFrame(f"{IMAGE}: {data.size} bytes of data for a {width}x{height} {encoding} image of step "
                           f"{step} (needs {needed}): truncated")
    if name in _TWO_PLANE:
        return _from_two_planes(data, name, height, width, step)
    rows = data[:step * height].reshape(height, step)[:, :width * bpp]
    if name in _SIXTEEN:
        order = ">u2" if msg.is_bigendian else "<u2"
        rows = (np.ascontiguousarray(rows).view(order) >> 8).astype(np.uint8)  # (height, width * channels)
        bpp //= 2
    if bpp == 2:
        pixels = np.ascontiguousarray(rows).reshape(height, width, 2)
    elif bpp == 1:
        pixels = np.ascontiguousarray(rows)
    else:
        pixels = rows.reshape(height, width, bpp)
    if conversion is None:
        return np.array(pixels, dtype=np.uint8, copy=True, order="C")
    return _convert(np.ascontiguousarray(pixels), conversion, encoding)


def _convert(pixels: np.ndarray, conversion: str, encoding: str) -> np.ndarray:
    """``pixels`` as BGR by OpenCV's ``COLOR_<conversion>``; without OpenCV the channel picks by numpy (the same
    pixels), and a Bayer or YUV image refused naming the extra: the camera needs a setting or the extra, and no frame
    of it can be read until then (``SourceUnavailable``, not a frame skipped as corrupt)."""
    if has_opencv():
        return cv2.cvtColor(pixels, getattr(cv2, f"COLOR_{conversion}"))
    by_numpy = _BY_NUMPY.get(conversion)
    if by_numpy is None:
        raise SourceUnavailable(f"{IMAGE}: {encoding} images are converted to colour by OpenCV, which is not "
                                f"installed here: {OPENCV_EXTRA} (or have the camera publish bgr8, rgb8 or mono8)")
    return np.ascontiguousarray(by_numpy(pixels))


def _from_two_planes(data: np.ndarray, name: str, height: int, width: int, step: int) -> np.ndarray:
    """NV12 / NV21 / NV24: the Y plane (``height`` rows of ``step`` bytes), then the interleaved chroma plane."""
    luma = data[:step * height].reshape(height, step)[:, :width]
    if name == "nv24":  # 4:4:4: OpenCV has no two-plane conversion; BT.601 limited range, as its NV12 one is
        chroma = data[step * height:3 * step * height].reshape(height, 2 * step)[:, :2 * width]
        y = (luma.astype(np.float32) - 16.0) * 1.164
        u = chroma[:, 0::2].astype(np.float32) - 128.0
        v = chroma[:, 1::2].astype(np.float32) - 128.0
        bgr = np.stack([y + 2.018 * u, y - 0.813 * v - 0.391 * u, y + 1.596 * v], axis=2)
        return np.clip(np.rint(bgr), 0, 255).astype(np.uint8)
    chroma = data[step * height:step * height + step * height // 2].reshape(height // 2, step)[:, :width]
    planes = np.concatenate([luma, chroma], axis=0)  # OpenCV's NV12 / NV21 input: (height * 3 / 2) x width
    return _convert(np.ascontiguousarray(planes), _ENCODINGS[name][1], name)


def _compressed_kind(fmt: str, data: np.ndarray) -> tuple[str, bool]:
    """(``jpeg`` | ``png``, whether the pixels are RGB) from ``format`` and the data's magic bytes."""
    text = fmt.strip().lower()
    if "compresseddepth" in text:
        raise CorruptFrame(f"{COMPRESSED}: format {fmt!r} is a depth image, not a camera image")
    head = bytes(data[:8])
    sniffed = "jpeg" if head.startswith(_JPEG_MAGIC) else "png" if head.startswith(_PNG_MAGIC) else None
    declared = "jpeg" if ("jpeg" in text or "jpg" in text) else "png" if "png" in text else None
    if text and declared is None:
        raise CorruptFrame(f"{COMPRESSED}: format {fmt!r} is not jpeg or png")
    if sniffed is None:
        raise CorruptFrame(f"{COMPRESSED}: the data ({data.size} bytes) is not a JPEG or PNG image")
    if declared is not None and declared != sniffed:
        raise CorruptFrame(f"{COMPRESSED}: format {fmt!r} says {declared}, but the data is a {sniffed}")
    target = text.rsplit("compressed", 1)[1].strip() if "compressed" in text else ""
    return sniffed, target.startswith("rgb")


def _complete(kind: str, data: np.ndarray) -> bool:
    """JPEG ends with the EOI marker FF D9 (ITU T.81 B.2.1), PNG with its IEND chunk (PNG spec 11.2.5);
    OpenCV decodes a cut-off JPEG into a half-grey frame without complaint, so look first."""
    tail = bytes(data[-16:]).rstrip(b"\x00")
    return tail.endswith(b"\xff\xd9") if kind == "jpeg" else b"IEND" in tail[-12:]


def _from_compressed(msg: Any) -> np.ndarray:
    data = np.asarray(msg.data, dtype=np.uint8).reshape(-1)
    if data.size == 0:
        raise CorruptFrame(f"{COMPRESSED}: no data")
    kind, rgb = _compressed_kind(str(msg.format), data)
    if not _complete(kind, data):
        raise CorruptFrame(f"{COMPRESSED}: the {kind} data ({data.size} bytes) is cut off (no end marker)")
    size = image_size(data.tobytes())  # the header, before anything is decoded
    if size is None:
        raise CorruptFrame(f"{COMPRESSED}: the {kind} header does not read (no image size before the data)")
    if size[0] * size[1] > MAX_COMPRESSED_PIXELS:
        raise CorruptFrame(f"{COMPRESSED}: the {kind} declares {size[0]} x {size[1]}, over the "
                           f"{MAX_COMPRESSED_PIXELS / 1e6:.0f} megapixels a frame is decoded at")
    frame = decode_bgr(data.tobytes())  # OpenCV's IMREAD_COLOR, or the same pixels from Pillow without the extra
    if frame is None:
        raise CorruptFrame(f"{COMPRESSED}: the {kind} data ({data.size} bytes) does not decode")
    return np.ascontiguousarray(frame[:, :, ::-1]) if rgb else frame


class StampClock:
    """``header.stamp`` -> the source's time: seconds since its first frame, never going back.

    Within a run of trusted steps (``0 <= stamp - previous stamp <= max_step_s``) the time is the stamp minus
    a fixed base, in integer nanoseconds, so a recording and a replay of it get bit-identical times. A
    step outside that range is a jump of the clock that stamps the frames (a simulator or a bag that
    restarted, sim time reset, a robot clock stepped by NTP or PTP after boot): the time then moves on by
    what passed between the two messages' arrivals (``arrival_ns``: a monotonic clock for a live topic,
    the recording time in a bag), at most ``max_step_s``, the base is moved so that later stamps continue
    from there, and the jump is logged and counted (DESIGN invariant 12: a bounded, logged gap). A frame
    with an unset stamp is timed by its arrival.
    """

    def __init__(self, name: str, max_step_s: float = 10.0) -> None:
        if not max_step_s > 0:
            raise ValueError(f"max_step_s must be > 0, got {max_step_s}")
        self.name = name
        self.max_step_ns = int(max_step_s * 1e9)
        self.base_ns: int | None = None
        self.last_stamp_ns: int | None = None
        self.last_arrival_ns: int | None = None
        self.last_t_ns = 0
        self.jumps = 0
        self.unstamped = 0

    def __call__(self, stamp: int | None, arrival_ns: int) -> float:
        if stamp is None:
            self.unstamped += 1
            if self.unstamped == 1:
                log.warning("%s: a frame without header.stamp; timing such frames by their arrival", self.name)
            stamp = arrival_ns
        if self.base_ns is None:
            self.base_ns = stamp
        else:
            step = stamp - self.last_stamp_ns
            if step < 0 or step > self.max_step_ns:
                waited = min(max(0, arrival_ns - self.last_arrival_ns), self.max_step_ns)
                self.base_ns = stamp - (self.last_t_ns + waited)
                self.jumps += 1
                log.warning("%s: header.stamp jumped by %+.3f s; the stream goes on %.3f s later (as much as "
                            "passed between the two frames, at most %.0f s)", self.name, step / 1e9, waited / 1e9,
                            self.max_step_ns / 1e9)
        self.last_stamp_ns, self.last_arrival_ns = stamp, arrival_ns
        self.last_t_ns = stamp - self.base_ns
        return self.last_t_ns / 1e9
