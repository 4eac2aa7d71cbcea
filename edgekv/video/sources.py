"""Frame sources: everything a deployment can point ``video.source`` at, behind one small interface.

A source yields ``(frame, t)``: an HxWx3 uint8 BGR frame (OpenCV's layout, what ``session.ingest``
takes) and its time in seconds. Files and synthetic videos carry their own clock (so a replay is
reproducible); live sources (cameras, network streams, GStreamer pipelines) are stamped with a
monotonic clock at arrival, shared across reconnects so time never goes back.

Failures are typed, because the capture thread reacts differently to each:

- ``CorruptFrame``: this one frame is unusable, the stream goes on (skip and count it);
- ``EndOfStream``: a recorded source is over (``reason`` says "eof" or "truncated");
- ``SourceLost``: a live source stopped delivering (reopen it with backoff);
- ``SourceUnavailable``: a source cannot be opened (at start-up: a configuration problem).

Spec strings (``open_source``), all parsed by ``parse_spec`` without touching any device:

===============================  ============================================================
``"clip.mp4"`` / ``Path``         a video file (must exist)
``0`` / ``"0"``                   a camera index (V4L2 on Linux)
``"rtsp://…"``, ``"http(s)://…"`` a network stream (live)
``"gst:<pipeline>"``              a raw GStreamer pipeline ending in ``appsink`` (OpenCV with GStreamer)
``"csi:<sensor_id>[?…]"``         a Jetson CSI camera via ``nvarguscamerasrc`` (see ``csi_pipeline``)
``"synthetic:shapes[?…]"``        moving shapes on a textured background, generated in-process
``"synthetic:needle[?…]"``        a static scene where one object appears in exactly two frames
``"synthetic:events[?…]"``        shapes of known colours appearing at known times, with ground
                                 truth (``source.scene.events``; ``edgekv.video.events``)
``"synthetic:world[?…]"``         the same events in a randomized world: background families
                                 (``families=``, ``holdout=``), camera, light, JPEG, distractors,
                                 occlusion (``edgekv.video.world``)
``"ros2:/camera/image_raw[?…]"``  a ROS 2 camera topic over DDS, no ROS install (``edgekv.video.ros2``;
                                 the ``ros2`` extra; live)
``"rosbag:PATH[?topic=…]"``       a recorded ROS 2 bag, MCAP or sqlite3 (``edgekv.video.rosbag``;
                                 the ``ros2`` extra); a plain path to a bag directory or to a
                                 ``.mcap`` / ``.db3`` file reads the same way
===============================  ============================================================

``ros2:`` and ``rosbag:`` are the ``EXTRA_SCHEMES``: each a module with ``parse(spec, rest)`` (no extra
package needed) and ``open_parsed(parsed, ros2=...)`` (imports its extra), so an install without ``edgekv[ros2]``
parses and refuses them with the command that installs it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl

import numpy as np

OPENCV_EXTRA = "pip install 'edgekv[video]' (opencv-python-headless)"


class MissingOpenCV:
    """``cv2`` where OpenCV is not installed. What needs no decoder works without it (the ``synthetic:`` videos,
    drawn here with numpy; ``CaptureThread`` and ``Sampler``); whatever touches OpenCV (a file, a camera, a
    stream, a pipeline, a ROS image's colour conversion) fails at that point naming the extra to install."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # introspection (copy, pickle, inspect) asks for dunders: not OpenCV's
            raise AttributeError(name)
        raise ModuleNotFoundError(f"OpenCV is not installed (cv2.{name} was asked for): {OPENCV_EXTRA}", name="cv2")

    def __repr__(self) -> str:
        return "<cv2: not installed>"


try:
    import cv2
except ModuleNotFoundError:
    cv2 = MissingOpenCV()


def has_opencv() -> bool:
    """Whether OpenCV (the ``video`` extra) is installed: files, cameras, streams and pipelines need it."""
    return not isinstance(cv2, MissingOpenCV)

__all__ = [
    "CorruptFrame", "EndOfStream", "EventSource", "FrameSource", "LoopingSource", "NeedleSource", "OpenCVSource",
    "ResumedSource", "ShapesSource", "SourceError", "WorldSource",
    "SourceLost", "SourceSpec", "SourceUnavailable", "SyntheticSource", "TimestampSelector", "csi_pipeline",
    "iter_frames", "has_opencv", "opencv_has_gstreamer", "open_source", "parse_spec", "redact", "resume_after",
    "rtsp_pipeline",
]

log = logging.getLogger("edgekv.video")

Frame = tuple[np.ndarray, float]  # (HxWx3 uint8 BGR, seconds)
STREAM_SCHEMES = ("rtsp://", "rtsps://", "rtmp://", "http://", "https://")
_MALFORMED_URL = re.compile(r"(?i)(?:rtsps?|rtmp|https?):(?!//)")  # rtsp:/cam, http:cam: a slash short


# ---------------------------------------------------------------------------------------------- errors
class SourceError(RuntimeError):
    """Base of the failures a frame source reports."""


class SourceUnavailable(SourceError):
    """The source could not be opened (no such camera, unreachable stream, missing backend)."""


class SourceLost(SourceError):
    """A live source stopped delivering frames; it may come back after a reopen."""


class CorruptFrame(SourceError):
    """One frame (``count`` frames in a row) could not be decoded or is not HxWx3 uint8; the stream itself
    goes on."""

    def __init__(self, message: str, count: int = 1) -> None:
        super().__init__(message)
        self.count = count


class EndOfStream(Exception):
    """A recorded source has no more frames. ``reason``: "eof" (complete) or "truncated" (ended early)."""

    def __init__(self, reason: str = "eof", detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def frame_problem(frame: object) -> str | None:
    """Why ``frame`` is not an HxWx3 uint8 array, or None if it is (backends can hand back odd shapes)."""
    if not isinstance(frame, np.ndarray):
        return f"got {type(frame).__name__} instead of an array"
    if frame.ndim != 3 or frame.shape[2] != 3 or frame.shape[0] == 0 or frame.shape[1] == 0:
        return f"got shape {frame.shape}, expected HxWx3"
    if frame.dtype != np.uint8:
        return f"got dtype {frame.dtype}, expected uint8"
    return None


# rtsp://user:password@host (in a gst: pipeline's rtspsrc too); up to the authority's last @, should a password hold
# one. A password may hold spaces (typed as the camera's web page showed it, not as %20): only a gst: pipeline's " ! "
# ends it, or a line's end.
_USERINFO = re.compile(r"(://[^/@\s:]*):(?:[^/\s]|[ \t](?!!))*@")
# ?password=, and the names cloud cameras and NVRs give a secret, with a prefix (access_token, api_key, x-auth-token)
_SECRET_NAMES = "password|passwd|pwd|pass|token|auth|apikey|key|secret|signature|sig"
_SECRET_PARAM = re.compile(rf"([?&;](?:[\w.-]*[_.-])?(?:{_SECRET_NAMES})=)[^&;\s'\"]*", re.IGNORECASE)


def redact(spec: object) -> str:
    """``video.source`` as logs, errors, ``/v1/edgekv/status`` and ``--check`` may show it: a URL's password
    (``rtsp://admin:***@cam/stream``; the user kept, it tells which account) and query parameters that carry one
    (``?user=admin&password=***``, as some cameras take it) hidden. Everything else is kept to diagnose with."""
    text = str(spec)
    return _SECRET_PARAM.sub(r"\1***", _USERINFO.sub(r"\1:***@", text))


# ---------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class SourceSpec:
    """A parsed ``video.source``: what to open and with which parameters, before opening anything."""

    kind: str  # file | camera | stream | gstreamer | csi | synthetic | ros2 | rosbag
    target: str | int  # path, camera index, URL, pipeline string, or synthetic name
    params: dict[str, Any] = field(default_factory=dict)
    raw: str = ""

    @property
    def live(self) -> bool:
        """Live sources cannot be paused or replayed: they are reopened on loss and sampled latest-wins."""
        return self.kind in ("camera", "stream", "gstreamer", "csi", "ros2")


def _parse_query(spec: str, query: str, allowed: dict[str, Callable[[str], Any]]) -> dict[str, Any]:
    """``a=1&b=2`` -> typed dict; unknown keys and bad values are refused naming the spec."""
    params: dict[str, Any] = {}
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"video source {spec!r}: parameters must look like 'key=value&key=value'") from None
    for key, value in pairs:
        if key not in allowed:
            raise ValueError(f"video source {spec!r}: unknown parameter {key!r}; known: {', '.join(sorted(allowed))}")
        try:
            params[key] = allowed[key](value)
        except ValueError as exc:
            raise ValueError(f"video source {spec!r}: bad value {value!r} for {key!r}: {exc}") from None
    return params


MAX_SYNTHETIC_SIDE = 8192  # 8K (7680x4320) fits; a zero too many (64000x48000) was a MemoryError traceback, or swap


def _size(text: str) -> tuple[int, int]:
    """``"640x480"`` -> (width, height), each side at most ``MAX_SYNTHETIC_SIDE`` (the frames are made in memory)."""
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError("expected WIDTHxHEIGHT, e.g. 640x480")
    if max(int(p) for p in parts) > MAX_SYNTHETIC_SIDE:
        raise ValueError(f"each side at most {MAX_SYNTHETIC_SIDE} (8K is 7680x4320)")
    return int(parts[0]), int(parts[1])


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


def _int_range(text: str) -> tuple[int, int]:
    """``"2"`` -> (2, 2); ``"1-3"`` -> (1, 3)."""
    low, _, high = text.partition("-")
    values = (int(low), int(high or low))
    if values[0] < 1 or values[1] < values[0]:
        raise ValueError("expected N or MIN-MAX with 1 <= MIN <= MAX")
    return values


def _positive_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("must be a positive number")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError("must be a non-negative number")
    return value


def _families(text: str) -> tuple[str, ...]:
    from edgekv.video.world import parse_families

    return parse_families(text)


def _names(known_of: str) -> Callable[[str], tuple[str, ...]]:
    """A parser of a comma-separated list of the names ``edgekv.video.world`` holds as ``known_of``."""

    def parse(text: str) -> tuple[str, ...]:
        from edgekv.video import world

        known = getattr(world, known_of)
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in known]
        if not names or unknown:
            raise ValueError(f"expected a comma-separated list of {', '.join(known)}"
                             + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
        return names

    return parse


def _flag(text: str) -> bool:
    if text not in ("0", "1"):
        raise ValueError("expected 0 or 1")
    return text == "1"


_SYNTHETIC_PARAMS: dict[str, dict[str, Callable[[str], Any]]] = {
    "shapes": {"size": _size, "fps": _positive_float, "frames": _positive_int, "seed": _non_negative_int,
               "shapes": _positive_int},
    "needle": {"size": _size, "fps": _positive_float, "frames": _positive_int, "seed": _non_negative_int,
               "at": _non_negative_int, "noise": _non_negative_float},
    "events": {"size": _size, "fps": _positive_float, "frames": _positive_int, "seed": _non_negative_int,
               "rate": _non_negative_float, "duration": _int_range, "noise": _non_negative_float,
               "drift": _non_negative_float, "light": _non_negative_float, "distractors": _non_negative_int},
    "world": {"size": _size, "fps": _positive_float, "frames": _positive_int, "seed": _non_negative_int,
              "rate": _non_negative_float, "duration": _int_range, "families": _families, "holdout": _families,
              "randomize": _flag, "noise": _non_negative_float, "drift": _non_negative_float,
              "shake": _non_negative_float, "light": _non_negative_float, "jpeg": _non_negative_int,
              "distractors": _non_negative_int, "transients": _non_negative_float, "occlusion": _non_negative_float,
              "lures": _non_negative_float, "lure_colors": _names("COLORS"), "lure_shapes": _names("DISTRACTOR_SHAPES"),
              "tone": _non_negative_float, "exposure": _non_negative_float},
}
def _fourcc(text: str) -> str:
    if len(text) != 4 or not text.isascii() or not text.isprintable():
        raise ValueError("expected four characters, e.g. MJPG or YUYV")
    return text


# A camera index or device path (``0?width=1280&height=720&fps=30&fourcc=MJPG``): what the V4L2 driver is asked for
# after the open. A USB webcam's default mode may be a small or slow one, and 720p or 1080p at 30 fps over USB 2
# needs MJPG (uncompressed YUYV does not fit the bus): the mode a user of such a camera asks for first.
_CAMERA_PARAMS: dict[str, Callable[[str], Any]] = {
    "width": _positive_int, "height": _positive_int, "fps": _positive_float, "fourcc": _fourcc,
}
_CAMERA_PROPS = (("fourcc", "CAP_PROP_FOURCC"), ("width", "CAP_PROP_FRAME_WIDTH"),
                 ("height", "CAP_PROP_FRAME_HEIGHT"), ("fps", "CAP_PROP_FPS"))  # the order V4L2 wants them in
_CSI_PARAMS: dict[str, Callable[[str], Any]] = {
    "width": _positive_int, "height": _positive_int, "fps": _positive_int, "flip": _non_negative_int,
    "out_width": _positive_int, "out_height": _positive_int,
}


def parse_spec(spec: str | int | os.PathLike) -> SourceSpec:
    """Classify a ``video.source`` value; raises ``ValueError`` naming the spec (``redact``-ed) if it cannot be
    one."""
    try:
        return _parse_spec(spec)
    except ValueError as exc:
        raise ValueError(redact(exc)) from None


def _parse_spec(spec: str | int | os.PathLike) -> SourceSpec:
    if isinstance(spec, bool):
        raise ValueError(f"video source {spec!r}: expected a camera index, path, URL, 'gst:…', 'csi:…' "
                         "or 'synthetic:…'")
    if isinstance(spec, int):
        if spec < 0:
            raise ValueError(f"video source {spec!r}: a camera index must be >= 0")
        return SourceSpec("camera", spec, raw=str(spec))
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str):
        raise ValueError(f"video source {spec!r}: expected a string, path or camera index, got {type(spec).__name__}")
    text = spec.strip()
    if not text:
        raise ValueError("video source '': empty; give a camera index, file, URL, 'gst:…', 'csi:…' or 'synthetic:…'")
    head, _, query = text.partition("?")
    if head.isdigit():
        return SourceSpec("camera", int(head), _parse_query(spec, query, _CAMERA_PARAMS), raw=spec)
    if head.startswith("/dev/") or _is_char_device(head):  # /dev/video0, /dev/v4l/by-id/usb-...-video-index0
        return _parse_device(spec, head, query)
    lowered = text.lower()
    if lowered.startswith("gst:"):
        return _parse_gst(spec, text[4:].strip())
    if lowered.startswith("csi:"):
        return _parse_csi(spec, text[4:])
    if lowered.startswith("synthetic:"):
        return _parse_synthetic(spec, text[len("synthetic:"):])
    for scheme, module in EXTRA_SCHEMES.items():
        if lowered.startswith(scheme + ":"):
            return _extra_scheme(module).parse(spec, text[len(scheme) + 1:])
    if lowered.startswith(STREAM_SCHEMES):
        authority = re.split(r"[/?#]", text.split("://", 1)[1], maxsplit=1)[0]
        if authority.count("@") > 1:  # FFmpeg would split user:password@host at the wrong @ (and redact could not)
            raise ValueError(f"video source {redact(spec)!r}: the user or password holds '@': write each '@' in them "
                             "as %40 (and ':' as %3A, '/' as %2F), as a URL needs")
        if not authority.rpartition("@")[2].partition(":")[0].strip():
            # rtsp://${CAMERA_IP}/live with the variable unset: the daemon started and waited for it for ever
            raise ValueError(f"video source {spec!r}: no host in the URL (an empty variable where the camera's "
                             "address goes?)")
        return SourceSpec("stream", text, raw=spec)
    if _MALFORMED_URL.match(text) and not Path(text).is_file():
        raise ValueError(f"video source {spec!r}: not a well-formed URL; write {text.split(':', 1)[0]}://HOST/PATH")
    if lowered.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise ValueError(f"video source {spec!r}: unsupported URL scheme; use one of {', '.join(STREAM_SCHEMES)}")
    path = Path(text).expanduser()  # ~/clips/yard.mp4: the config keeps it as it is, and OpenCV does not expand it
    if _is_bag(path):  # a ROS 2 bag given as a plain path reads as rosbag:PATH
        return _extra_scheme(EXTRA_SCHEMES["rosbag"]).parse(spec, text)
    if path.is_dir():
        raise ValueError(f"video source {spec!r}: a folder, not a video file (nor a ROS 2 bag: no metadata.yaml in "
                         "it); give a video file, camera index, URL, 'gst:', 'csi:' or 'synthetic:' spec")
    if not path.is_file():
        raise ValueError(f"video source {spec!r}: no such video file (and not a camera index, URL, 'gst:', 'csi:' "
                         "or 'synthetic:' spec)")
    return SourceSpec("file", str(path), raw=spec)


def _is_char_device(path: str) -> bool:
    """A character device, or a link to one (a camera's udev name made elsewhere)."""
    import stat

    try:
        return stat.S_ISCHR(os.stat(os.path.expanduser(path)).st_mode)
    except (OSError, ValueError):
        return False


def _parse_device(spec: str, path: str, query: str) -> SourceSpec:
    """A V4L2 camera named by its device file. ``/dev/v4l/by-id/...`` (udev's links) names the same camera whatever
    order the USB bus enumerated them in this boot, which an index does not: on a robot with two cameras, the one
    to use. It must be a character device (a link to one) when the daemon starts."""
    if not os.path.exists(path):
        raise ValueError(f"video source {spec!r}: no such camera device ({path} is not there: unplugged, or another "
                         "name? `ls /dev/v4l/by-id/` lists the cameras connected)")
    if not _is_char_device(path):
        raise ValueError(f"video source {spec!r}: {path} is not a camera device (not a character device)")
    return SourceSpec("camera", path, _parse_query(spec, query, _CAMERA_PARAMS), raw=spec)


def _parse_gst(spec: str, pipeline: str) -> SourceSpec:
    if not pipeline:
        raise ValueError(f"video source {spec!r}: 'gst:' needs a pipeline ending in appsink")
    if "appsink" not in pipeline:
        raise ValueError(f"video source {spec!r}: the GStreamer pipeline must end in 'appsink' for OpenCV to read it")
    return SourceSpec("gstreamer", pipeline, raw=spec)


def _parse_csi(spec: str, rest: str) -> SourceSpec:
    sensor, _, query = rest.partition("?")
    if not sensor.strip().isdigit():
        raise ValueError(f"video source {spec!r}: expected 'csi:<sensor_id>' with an integer sensor id, e.g. 'csi:0'")
    params = _parse_query(spec, query, _CSI_PARAMS)
    return SourceSpec("csi", int(sensor), params, raw=spec)


def _parse_synthetic(spec: str, rest: str) -> SourceSpec:
    name, _, query = rest.partition("?")
    if name not in _SYNTHETIC_PARAMS:
        raise ValueError(f"video source {spec!r}: unknown synthetic video {name!r}; known: "
                         f"{', '.join('synthetic:' + n for n in sorted(_SYNTHETIC_PARAMS))}")
    return SourceSpec("synthetic", name, _parse_query(spec, query, _SYNTHETIC_PARAMS[name]), raw=spec)


def csi_pipeline(sensor_id: int = 0, width: int = 1920, height: int = 1080, fps: int = 30, flip: int = 0,
                 out_width: int | None = None, out_height: int | None = None) -> str:
    """The GStreamer pipeline for a Jetson CSI camera (Argus ISP) that OpenCV reads as BGR.

    The ISP delivers NV12 in NVMM (device) memory; ``nvvidconv`` converts and copies it to CPU memory
    as BGRx (it cannot emit 3-byte BGR), ``videoconvert`` drops the pad byte, and the appsink keeps
    only the newest buffer (``drop=true max-buffers=1``) so a slow reader gets fresh frames, not a
    backlog. ``out_width``/``out_height`` let nvvidconv downscale on the VIC instead of the CPU.
    """
    out_w, out_h = out_width or width, out_height or height
    return (
        f"nvarguscamerasrc sensor-id={sensor_id} ! "
        f"video/x-raw(memory:NVMM),width={width},height={height},framerate={fps}/1,format=NV12 ! "
        f"nvvidconv flip-method={flip} ! video/x-raw,width={out_w},height={out_h},format=BGRx ! "
        "videoconvert ! video/x-raw,format=BGR ! appsink drop=true max-buffers=1"
    )


RTSP_DECODERS = ("ffmpeg", "gstreamer", "jetson")


def rtsp_pipeline(url: str, decoder: str = "jetson", timeout_s: float | None = 10.0, latency_ms: int = 200) -> str:
    """The GStreamer pipeline that reads an RTSP camera for OpenCV as BGR (``video.decoder``: ``gstreamer`` or
    ``jetson``; ``ffmpeg``, the default, reads the URL through OpenCV's FFmpeg instead).

    ``rtspsrc`` over TCP (interleaved RTP: no UDP loss on a robot's Wi-Fi), ``latency`` ms of jitter buffer, and
    ``tcp-timeout`` = ``video.stream_timeout_s`` (its error ends the stream: the capture reconnects). ``decodebin``
    picks the decoder for whatever the camera sends (H.264 or H.265): on a Jetson NVIDIA's ``nvv4l2decoder``
    (the NVDEC engine: no CPU core spent decoding), which hands out NVMM (device) memory, so ``jetson`` adds
    ``nvvidconv`` to copy it out as BGRx (as ``csi_pipeline`` does) before ``videoconvert`` drops the pad byte;
    ``gstreamer`` decodes on the CPU (libav) and converts with ``videoconvert`` alone. The appsink keeps the newest
    frame only and does not wait on the clock. Checked here: the ``gstreamer`` pipeline against GStreamer's RTSP
    server (tests/test_rtsp_camera.py); ``jetson``'s NVIDIA elements were not run here (no Jetson).

    On a Jetson choose ``jetson`` (or ``ffmpeg`` for CPU decoding), not ``gstreamer``: JetPack registers
    ``nvv4l2decoder`` at rank primary + 11, above libav's decoders, so ``decodebin`` picks it there too and hands
    ``videoconvert`` NVMM buffers it cannot take (not-negotiated; gst-inspect output in svpcom/wfb-ng-osd#12, the
    failure in aler9/gst-darknet#1)."""
    if decoder not in RTSP_DECODERS[1:]:
        raise ValueError(f"video.decoder: {decoder!r} builds no pipeline; one of {', '.join(RTSP_DECODERS[1:])}")
    quoted = url.replace("\\", "\\\\").replace('"', '\\"')
    timeout = f" tcp-timeout={int(timeout_s * 1e6)}" if timeout_s is not None else ""
    convert = ("nvvidconv ! video/x-raw,format=BGRx ! videoconvert" if decoder == "jetson" else "videoconvert")
    return (f'rtspsrc location="{quoted}" protocols=tcp latency={int(latency_ms)}{timeout} ! decodebin ! '
            f"{convert} ! video/x-raw,format=BGR ! appsink drop=true max-buffers=1 sync=false")


def _on_a_jetson() -> bool:
    from edgekv.monitor.jetson import is_jetson

    return is_jetson()


@functools.cache
def opencv_has_gstreamer() -> bool:
    """Whether this OpenCV build can open GStreamer pipelines (pip wheels cannot; JetPack's can)."""
    for line in cv2.getBuildInformation().splitlines():
        name, _, value = line.strip().partition(":")
        if name.strip() == "GStreamer":
            return value.strip().upper().startswith("YES")
    return False


# ---------------------------------------------------------------------------------------------- base
class FrameSource(ABC):
    """Something that yields ``(frame, t)``. ``read`` returns a fresh array each call (consumers keep it)."""

    kind: str = "source"
    grab_saves_decoding: bool = False  # ``grab`` without ``retrieve`` costs less than ``read`` (see ``grab``)

    def __init__(self, spec: str, live: bool) -> None:
        self.spec = redact(spec)  # for messages, logs and stats only: a camera's password never goes there
        self.live = live
        self.frames_skipped = 0  # corrupt frames skipped while iterating
        self._grabbed: np.ndarray | None = None  # the frame ``grab`` read, for ``retrieve``

    @abstractmethod
    def read(self) -> Frame:
        """The next frame, or raise ``CorruptFrame`` / ``EndOfStream`` / ``SourceLost``."""

    def grab(self) -> float:
        """Move to the next frame and return its timestamp; its pixels only if ``retrieve`` is called before the next
        ``grab``. Raises as ``read`` does. Where ``grab_saves_decoding`` (a ``cv2.VideoCapture``), a frame that is
        grabbed and not retrieved is never converted to BGR (nor decoded, for a V4L2 camera's MJPEG), so a capture
        that keeps only the frames its sampler takes does not pay for the rest. Here: ``read``, the frame held."""
        self._grabbed, t = self.read()
        return t

    def retrieve(self) -> np.ndarray:
        """The pixels of the frame the last ``grab`` moved to (once); raises ``CorruptFrame`` where they do not
        decode. Here: the frame ``grab`` read."""
        frame, self._grabbed = self._grabbed, None
        if frame is None:
            raise RuntimeError(f"video source {self.spec!r}: retrieve() without a grab() before it")
        return frame

    def reopen(self) -> None:
        """Reconnect after ``SourceLost``; sources that cannot be reopened refuse."""
        raise SourceUnavailable(f"video source {self.spec!r} cannot be reopened")

    def close(self) -> None:
        """Release the device or file; safe to call twice."""

    def interrupt(self) -> None:
        """Wake a ``read`` or ``reopen`` that waits for data (a topic that went quiet): the capture thread is
        stopping. Sources whose reads return by themselves need nothing."""

    def __iter__(self) -> Iterator[Frame]:
        """Frames until the end, skipping (and counting) corrupt ones; ``SourceLost`` propagates."""
        while True:
            try:
                yield self.read()
            except CorruptFrame as exc:
                self.frames_skipped += exc.count
                log.warning("%s: skipped a frame: %s", self.spec, exc)
            except EndOfStream:
                return

    def __enter__(self) -> FrameSource:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r}, live={self.live})"


# ---------------------------------------------------------------------------------------------- OpenCV
class OpenCVSource(FrameSource):
    """A ``cv2.VideoCapture``: files (own timestamps), cameras, network streams and GStreamer pipelines.

    A read that fails is not yet the end of the stream: OpenCV's FFmpeg backend returns False for one
    undecodable frame (a garbage part of an MJPEG stream, a corrupt chunk of a file) and the next frame reads
    fine. So after a failed read the source reads on: when a frame comes within ``LIVE_RETRIES`` tries and
    ``LIVE_RETRY_S`` (a live source) or ``FILE_RETRIES`` tries (a file), the failures are one ``CorruptFrame``
    (skipped and counted, ``count`` frames) and the good frame is handed out by the next ``read``; only then
    is a live source lost (reconnect) or a file at its end.

    A network stream's read that takes ``timeout_s`` or longer (FFmpeg's read timeout fired: nothing came for that
    long) is the stream lost at once, even when it hands back a frame: the demuxer gave up, so OpenCV drains the
    decoder, and a frame-threaded decoder (H.264 from an RTSP camera; OpenCV gives FFmpeg's decoder several threads)
    still holds frames from before the silence. Measured with OpenCV 5.1's FFmpeg against GStreamer's RTSP server
    (tests/test_rtsp_camera.py): each of the first two such reads waited the whole timeout and returned one of those
    old frames, so the failure came only at the third, three times ``stream_timeout_s`` after the camera went
    silent, with two stale frames handed out stamped as new.
    """

    kind = "opencv"
    grab_saves_decoding = True
    LIVE_RETRIES = 3     # failed reads in a row a live stream may have and still be there
    LIVE_RETRY_S = 2.0   # ... within this long (a stream that is gone times out slowly: reconnect instead)
    FILE_RETRIES = 32    # corrupt frames in a row a file may have before its end is taken as the end

    OPENCV_READ_TIMEOUT_S = 30.0  # OpenCV's own FFmpeg read timeout (LIBAVFORMAT_INTERRUPT_READ_DEFAULT_TIMEOUT_MS)

    def __init__(self, spec: str, target: str | int, api: int, live: bool, *, timeout_s: float | None = None,
                 wait: bool = False, network: bool = False, camera_params: dict | None = None) -> None:
        super().__init__(spec, live)
        self.target = target
        self.api = api
        self.camera_params = dict(camera_params or {})  # width, height, fps, fourcc asked of a V4L2 camera
        self._mode_said = False  # a driver that gave another mode than asked: said once, not at every reopen
        self.timeout_s = timeout_s
        self.network = network  # a network stream read by FFmpeg: its reads time out (timeout_s, else OpenCV's)
        self.capture: cv2.VideoCapture | None = None
        self.fps = 0.0
        self.frame_count = 0
        self.connected = False  # opened at least once
        self.waiting: str | None = None  # why a stream waited for at start is not open yet
        self._clock_origin = time.monotonic()  # live timestamps: shared across reopens, never go back
        self._last_t: float | None = None
        self._ahead: tuple[np.ndarray, float] | None = None  # the good frame read after corrupt ones
        self._held: float | None = None  # the time of the frame ``seek`` grabbed (in the capture), not handed out
        self._held_error: CorruptFrame | None = None  # what ``seek``'s grabbing met, for the next read or grab
        self._sought: float | None = None  # the last ``seek``'s t
        try:
            self._open()
        except SourceUnavailable as exc:
            if not (wait and live):
                raise
            self.waiting = str(exc)  # read() says "lost": the capture thread connects with its backoff

    def _open(self) -> None:
        if self.timeout_s is not None:  # FFmpeg's own limits (OpenCV's default: 30 s for each)
            ms = max(1, round(self.timeout_s * 1000))
            capture = cv2.VideoCapture(self.target, self.api,
                                       [cv2.CAP_PROP_OPEN_TIMEOUT_MSEC, ms, cv2.CAP_PROP_READ_TIMEOUT_MSEC, ms])
        else:
            capture = cv2.VideoCapture(self.target, self.api)
        if not capture.isOpened():
            capture.release()
            why = "device or stream unreachable" if self.live else "unreadable or unsupported file"
            if self.timeout_s is not None:
                why += f", or silent for video.stream_timeout_s ({self.timeout_s:g} s)"
            raise SourceUnavailable(f"video source {self.spec!r}: OpenCV could not open it ({why})")
        self.connected, self.waiting = True, None
        if self.live:
            capture.set(cv2.CAP_PROP_BUFFERSIZE, 1)  # the newest frame, not a backlog (ignored where unsupported)
        self._ask_camera_mode(capture)
        self.capture = capture
        self.fps = float(capture.get(cv2.CAP_PROP_FPS) or 0.0)
        self.frame_count = int(max(0.0, capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0.0))

    def _ask_camera_mode(self, capture: Any) -> None:
        """``camera_params`` asked of the driver (again at every reopen), and what it gave where it gave another
        mode: a driver takes the nearest it has, which is said once, not refused (the camera still works)."""
        if not self.camera_params:
            return
        for key, prop in _CAMERA_PROPS:
            if key in self.camera_params:
                value = self.camera_params[key]
                capture.set(getattr(cv2, prop), cv2.VideoWriter_fourcc(*value) if key == "fourcc" else value)
        got = {"width": capture.get(cv2.CAP_PROP_FRAME_WIDTH), "height": capture.get(cv2.CAP_PROP_FRAME_HEIGHT),
               "fps": capture.get(cv2.CAP_PROP_FPS)}
        other = {k: v for k, v in got.items() if k in self.camera_params and v > 0
                 and abs(v - float(self.camera_params[k])) > 0.5}
        if other and not self._mode_said:
            self._mode_said = True
            log.warning("video source %r: asked for %s, the driver gave %s", self.spec,
                        ", ".join(f"{k} {self.camera_params[k]}" for k in other),
                        ", ".join(f"{k} {v:g}" for k, v in other.items()))

    def reopen(self) -> None:
        if not self.live:
            raise SourceUnavailable(f"video source {self.spec!r}: a file is not reopened")
        self.close()
        self._open()

    def close(self) -> None:
        self._ahead = self._grabbed = self._held = self._held_error = self._sought = None
        if self.capture is not None:
            self.capture.release()
            self.capture = None

    def read(self) -> Frame:
        if self._held_error is not None or self._held is not None:
            t = self.grab()
            return self.retrieve(), t
        if self._ahead is not None:
            frame_t, self._ahead = self._ahead, None
            return frame_t
        self._check_open()
        position = self.capture.get(cv2.CAP_PROP_POS_FRAMES)
        started = time.monotonic()
        ok, frame = self._timed(self.capture.read)
        if not ok:
            self._read_failed(position, started)
        problem = frame_problem(frame)
        if problem is not None:
            raise CorruptFrame(f"video source {self.spec!r}: {problem}")
        return frame, self._timestamp()

    def grab(self) -> float:
        """``cv2.VideoCapture.grab``: the frame is taken from the driver or demuxer (FFmpeg decodes it) but not
        converted to BGR; a V4L2 camera's MJPEG is not decoded until ``retrieve`` (OpenCV's cap_v4l.cpp converts in
        ``retrieveFrame``, and its ``grabFrame`` queues a buffer that was never retrieved back to the driver)."""
        self._grabbed = None
        if self._held_error is not None:
            error, self._held_error = self._held_error, None
            raise error
        if self._held is not None:  # the frame ``seek`` stopped at: in the capture, ``retrieve`` decodes it
            t, self._held = self._held, None
            return t
        if self._ahead is not None:  # the good frame read after corrupt ones
            (self._grabbed, t), self._ahead = self._ahead, None
            return t
        self._check_open()
        position = self.capture.get(cv2.CAP_PROP_POS_FRAMES)
        started = time.monotonic()
        if not self._timed(self.capture.grab):
            self._read_failed(position, started)  # reads on as ``read`` does: raises, a good frame in ``_ahead``
        return self._timestamp()

    def retrieve(self) -> np.ndarray:
        if self._grabbed is not None:
            frame, self._grabbed = self._grabbed, None
            return frame
        self._check_open()
        ok, frame = self.capture.retrieve()
        problem = "the grabbed frame could not be decoded" if not ok else frame_problem(frame)
        if problem is not None:
            raise CorruptFrame(f"video source {self.spec!r}: {problem}")
        return frame

    SEEK_BACK_S = (0.0, 1.0, 4.0, 16.0)  # how far before t a seek lands, tried in turn (then: from the start)

    def seek(self, t: float) -> None:
        """Move a recorded file to the first frame stamped at or after ``t`` (its own clock) without grabbing the
        frames before it: the next ``grab`` / ``read`` hands that frame out, stamped as a frame-by-frame read
        stamps it (``ResumedSource``: a paused file resumes without decoding everything before the point).

        OpenCV is asked for a position (``CAP_PROP_POS_MSEC``, else ``CAP_PROP_POS_FRAMES`` at the file's fps) two
        frames before ``t``, and what it reached is checked: it must be a frame stamped before ``t`` (a demuxer
        that seeks to keyframes only, or not at all, may land after it: frames would be lost), and the file is
        grabbed forward from there to ``t``. A landing after ``t`` lands earlier (``SEEK_BACK_S``), and at last
        the file is reopened and grabbed through from its start, as without a seek. Frames that do not decode on
        the way are reported by the next ``grab`` / ``read`` (``CorruptFrame``), which then goes on toward ``t``
        (a second ``seek(t)`` does not move back). A ``t`` past the file's end ends it (``EndOfStream``)."""
        if self.live:
            raise ValueError(f"video source {self.spec!r} is live: it cannot seek")
        if not math.isfinite(t):
            raise ValueError(f"video source {self.spec!r}: cannot seek to t={t!r}")
        self._check_open()
        if self._sought == t and (self._held is not None or self._held_error is not None or self._ahead is not None
                                  or self._last_t is None or self._last_t < t - ResumedSource.EPSILON):
            return  # already on the way to t (or there): grabbing on is what the caller does
        self._sought = t
        self._ahead = self._grabbed = self._held = self._held_error = None
        if not self._land(t):
            self.capture.release()  # back to the start: frame-by-frame, exactly as a plain read goes
            self.capture = None
            self._open()
            self._last_t = None
        while self._last_t is None or self._last_t < t - ResumedSource.EPSILON:
            try:
                self.grab()
            except CorruptFrame as exc:
                self._held_error = exc  # the caller counts it; the good frame after it waits in ``_ahead``
                return
            except EndOfStream:
                return  # the next grab ends again (the capture stays at its end)
        self._held = self._last_t

    def _land(self, t: float) -> bool:
        """Put the capture on a frame stamped before ``t`` (grabbed: ``_last_t`` its time), from which the file is
        read on as frame by frame; False where no landing was reached (``t`` near the start, or no seek)."""
        step = 1.0 / self.fps if self.fps > 0 else 1.0 / 30.0
        for back in self.SEEK_BACK_S:
            target = t - 2 * step - back
            if target < step:
                return False
            moved = self.capture.set(cv2.CAP_PROP_POS_MSEC, target * 1000.0)
            if not moved and self.fps > 0:
                moved = self.capture.set(cv2.CAP_PROP_POS_FRAMES, float(math.floor(target * self.fps)))
            if not moved:
                return False
            self._last_t = None
            if not self.capture.grab():
                continue  # past the end (a wrong declared length, or t beyond it): land earlier
            landed = self.capture.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
            if math.isfinite(landed) and 0.0 < landed < t - ResumedSource.EPSILON:
                self._last_t = landed
                return True
        return False

    def _check_open(self) -> None:
        if self.capture is None:
            if self.live and self.waiting is not None:
                raise SourceLost(f"{self.waiting}; not connected yet")
            raise SourceLost(f"video source {self.spec!r} is closed") if self.live else EndOfStream("eof", "closed")

    def _read_failed(self, position: float, started: float) -> None:
        """Raises: ``CorruptFrame`` when frames come again after the failure (the next one waits in
        ``_ahead``), else ``SourceLost`` (live) or ``EndOfStream`` (a file)."""
        if not self.live and self.capture.get(cv2.CAP_PROP_POS_FRAMES) > position:
            # the demuxer moved on but the frame did not decode: skip it, the file goes on
            raise CorruptFrame(f"video source {self.spec!r}: frame {int(position)} could not be decoded")
        failed = 1
        while failed <= (self.LIVE_RETRIES if self.live else self.FILE_RETRIES):
            if self.live and time.monotonic() - started > self.LIVE_RETRY_S:
                break
            ok, frame = self._timed(self.capture.read)
            if ok and frame_problem(frame) is None:
                self._ahead = (frame, self._timestamp())
                where = "" if self.live else f" from frame {int(position)}"
                raise CorruptFrame(f"video source {self.spec!r}: {failed} frame(s){where} could not be read or "
                                   f"decoded; skipped, the stream goes on", count=failed)
            failed += 1
        if self.live:
            raise SourceLost(f"video source {self.spec!r} stopped delivering frames")
        raise self._end_of_file(position)

    def _timed(self, call: Callable[[], Any]) -> Any:
        """``capture.read()`` or ``capture.grab()``; raises ``SourceLost`` when a network stream's read took its
        timeout or longer (see the class): ``timeout_s``, or OpenCV's own 30 s where ``video.stream_timeout_s`` is
        null."""
        started = time.monotonic()
        result = call()
        limit = self.timeout_s if self.timeout_s is not None else self.OPENCV_READ_TIMEOUT_S if self.network else None
        if self.live and limit is not None and time.monotonic() - started >= limit:
            named = (f"video.stream_timeout_s ({limit:g} s)" if self.timeout_s is not None
                     else f"OpenCV's read timeout ({limit:g} s; video.stream_timeout_s is null)")
            raise SourceLost(f"video source {self.spec!r}: nothing came for {named}")
        return result

    def _end_of_file(self, position: float) -> EndOfStream:
        """EOF or truncation. The header's frame count alone cannot tell: AVIs with dropped-frame
        entries (OpenCV's own tree.avi: 444 declared, 68 decodable) end early but complete, so the
        stream is "truncated" only when its last timestamp also falls short of the declared duration."""
        if self.fps > 0 and self.frame_count > 0 and self._last_t is not None:
            duration = self.frame_count / self.fps
            if position < self.frame_count - 1 and self._last_t < duration - 2.0 / self.fps:
                return EndOfStream("truncated", f"ended at {self._last_t:.2f}s of {duration:.2f}s "
                                                f"(frame {int(position)} of {self.frame_count} declared)")
        return EndOfStream("eof")

    def _timestamp(self) -> float:
        if self.live:
            t = time.monotonic() - self._clock_origin
        else:
            t = self._file_timestamp()
        self._last_t = t
        return t

    def _file_timestamp(self) -> float:
        """The container's time (CAP_PROP_POS_MSEC) while it increases; otherwise the previous frame's
        time plus 1/fps. Some demuxers report 0 for the last frame or nothing at all (then this is
        ``frame_index / fps``); timestamps never go back (the session would take that as a clock jump)."""
        raw = self.capture.get(cv2.CAP_PROP_POS_MSEC) / 1000.0
        step = 1.0 / self.fps if self.fps > 0 else 1.0 / 30.0
        if self._last_t is None:
            return raw if math.isfinite(raw) and raw >= 0 else 0.0
        if math.isfinite(raw) and raw > self._last_t:
            return raw
        return self._last_t + step


# ---------------------------------------------------------------------------------------------- synthetic
def _textured_background(width: int, height: int, rng: np.random.Generator) -> np.ndarray:
    """Smooth colour gradients plus fixed fine grain: patches differ from each other (so a vision
    tower sees structure) but the image is the same for the same seed."""
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    phases = rng.uniform(0, 2 * np.pi, size=(3, 2)).astype(np.float32)
    periods = rng.uniform(40, 160, size=(3, 2)).astype(np.float32)
    channels = [
        96 + 48 * np.sin(xs / periods[c, 0] + phases[c, 0]) + 48 * np.cos(ys / periods[c, 1] + phases[c, 1])
        for c in range(3)
    ]
    grain = rng.integers(-12, 13, size=(height, width, 3), dtype=np.int16)
    image = np.stack(channels, axis=-1).astype(np.int16) + grain
    return np.clip(image, 0, 255).astype(np.uint8)


class SyntheticSource(FrameSource):
    """In-process video with its own clock ``t = index / fps``: deterministic for a given spec."""

    kind = "synthetic"

    def __init__(self, spec: str, size: tuple[int, int], fps: float, frames: int | None, seed: int) -> None:
        super().__init__(spec, live=False)
        self.width, self.height = size
        self.fps = float(fps)
        self.frames = frames
        self.seed = seed
        self.index = 0
        self.background = _textured_background(self.width, self.height, np.random.default_rng(seed))

    @abstractmethod
    def render(self, index: int) -> np.ndarray:
        """Frame ``index`` as a new HxWx3 uint8 BGR array."""

    def read(self) -> Frame:
        if self.frames is not None and self.index >= self.frames:
            raise EndOfStream("eof")
        index = self.index
        self.index += 1
        return self.render(index), index / self.fps

    def seek(self, t: float) -> None:
        """Move to the first frame stamped at or after ``t`` (its own clock): nothing before it is rendered."""
        self.index = max(0, math.ceil(t * self.fps - 1e-6))


class ShapesSource(SyntheticSource):
    """Coloured shapes moving along bouncing paths over a textured background (the demo video)."""

    def __init__(self, spec: str, size: tuple[int, int] = (640, 480), fps: float = 10.0, frames: int | None = None,
                 seed: int = 0, shapes: int = 4) -> None:
        super().__init__(spec, size, fps, frames, seed)
        rng = np.random.default_rng(seed + 1)
        scale = min(self.width, self.height)
        self.shapes = [
            {
                "kind": ("circle", "square", "triangle")[i % 3],
                "color": tuple(int(c) for c in rng.integers(0, 256, size=3)),
                "radius": int(rng.integers(max(2, scale // 16), max(3, scale // 7))),
                "origin": rng.uniform(0, 1, size=2),
                "velocity": rng.uniform(0.01, 0.05, size=2) * rng.choice([-1, 1], size=2),
            }
            for i in range(shapes)
        ]

    def render(self, index: int) -> np.ndarray:
        frame = self.background.copy()
        for shape in self.shapes:
            u, v = (_bounce(shape["origin"][k] + shape["velocity"][k] * index) for k in range(2))
            center = (int(u * (self.width - 1)), int(v * (self.height - 1)))
            _draw_shape(frame, shape["kind"], center, shape["radius"], shape["color"])
        return frame


class NeedleSource(SyntheticSource):
    """A static scene where a distinct object (a red cross on white) appears only in frames ``at`` and
    ``at + 1``: the needle-in-a-haystack probe for compression policies. With an even ``at`` the two
    frames form one temporal patch group (one ingested pair). ``noise`` adds per-frame sensor grain
    (std in uint8 levels) so that the static frames are not bit-identical."""

    def __init__(self, spec: str, size: tuple[int, int] = (224, 224), fps: float = 1.0, frames: int = 1000,
                 at: int | None = None, seed: int = 0, noise: float = 0.0) -> None:
        super().__init__(spec, size, fps, frames, seed)
        self.at = (frames // 2) // 2 * 2 if at is None else at
        if self.at + 1 >= frames:
            raise ValueError(f"video source {spec!r}: the needle needs frames at={self.at} and {self.at + 1}, "
                             f"but the video has frames=0..{frames - 1}")
        self.noise = noise
        rng = np.random.default_rng(seed + 2)
        self.needle_size = max(8, min(self.width, self.height) // 4)
        half = self.needle_size // 2
        self.needle_center = (int(rng.integers(half, self.width - half + 1)),
                              int(rng.integers(half, self.height - half + 1)))

    @property
    def needle_frames(self) -> tuple[int, int]:
        return self.at, self.at + 1

    def render(self, index: int) -> np.ndarray:
        frame = self.background.copy()
        if self.noise > 0:
            grain = np.random.default_rng((self.seed, index)).normal(0, self.noise, size=frame.shape)
            frame = np.clip(frame + grain, 0, 255).astype(np.uint8)
        if index in self.needle_frames:
            _draw_needle(frame, self.needle_center, self.needle_size)
        return frame


class EventSource(SyntheticSource):
    """``synthetic:events``: the scene generator of ``edgekv.video.events`` as a frame source. Its ground
    truth is ``self.scene.events`` (what, which frame pairs, where); the frames are ``scene.frame(i)``."""

    def __init__(self, spec: str, size: tuple[int, int] = (112, 112), fps: float = 2.0, frames: int = 400,
                 seed: int = 0, rate: float = 0.05, duration: tuple[int, int] = (1, 2), noise: float = 3.0,
                 drift: float = 0.0, light: float = 0.0, distractors: int = 0) -> None:
        from edgekv.video.events import scene_from_params

        try:
            self.scene = scene_from_params(size, fps, frames, seed, rate, duration, noise, drift, light, distractors)
        except ValueError as exc:
            raise ValueError(f"video source {spec!r}: {exc}") from None
        super().__init__(spec, size, fps, frames, seed)

    def render(self, index: int) -> np.ndarray:
        return self.scene.frame(index)


class WorldSource(SyntheticSource):
    """``synthetic:world``: ``edgekv.video.world``'s randomized world as a frame source; ground truth in
    ``self.scene.events``, the background family drawn in ``self.scene.family``. Style fields given in the
    spec (noise, drift, shake, light, jpeg, distractors, transients, occlusion, lures, lure_colors, lure_shapes, tone,
    exposure) override the random draw."""

    def __init__(self, spec: str, size: tuple[int, int] = (112, 112), fps: float = 2.0, frames: int = 400,
                 seed: int = 0, rate: float = 0.05, duration: tuple[int, int] = (1, 8),
                 families: tuple[str, ...] = (), holdout: tuple[str, ...] = (), randomize: bool = True,
                 **style: Any) -> None:
        from edgekv.video.world import world_scene

        try:
            self.scene = world_scene(size, fps, frames, seed, rate, duration, families, holdout, randomize, **style)
        except ValueError as exc:
            raise ValueError(f"video source {spec!r}: {exc}") from None
        super().__init__(spec, size, fps, frames, seed)

    def render(self, index: int) -> np.ndarray:
        return self.scene.frame(index)


def _bounce(x: float) -> float:
    """Triangle wave in [0, 1]: a position that reflects off the frame edges."""
    x = x % 2.0
    return 2.0 - x if x > 1.0 else x


def _draw_shape(frame: np.ndarray, kind: str, center: tuple[int, int], radius: int, color: tuple[int, ...]) -> None:
    """A filled circle, square or triangle (apex up), pixel for pixel what ``cv2.circle`` / ``cv2.rectangle`` /
    ``cv2.fillPoly`` draw (8-connected, no anti-aliasing) for a ``center`` inside the frame, as ``ShapesSource``
    places them (checked against OpenCV in tests/test_sources_without_opencv.py): drawn with numpy, so the
    ``synthetic:`` videos need no OpenCV and are the same frames with it or without it."""
    x, y = center
    if kind == "circle":
        _fill_spans(frame, _circle_spans(center, radius), color)
    elif kind == "square":
        _fill_rect(frame, (x - radius, y - radius), (x + radius, y + radius), color)
    else:  # cv2.fillPoly of (x, y-r), (x-r, y+r), (x+r, y+r): its edges' fill, then each edge's line over it
        _fill_spans(frame, {y - radius + d: (x - d // 2, x + (d - 1) // 2) for d in range(2 * radius)}, color)
        apex, left, right = (x, y - radius), (x - radius, y + radius), (x + radius, y + radius)
        height, width = frame.shape[:2]
        for start, end in ((right, apex), (apex, left), (left, right)):  # drawing.cpp CollectPolyEdges' order
            for column, row in _line_pixels(start, end, width, height):
                frame[row, column] = color


def _line_pixels(start: tuple[int, int], end: tuple[int, int], width: int, height: int) -> list[tuple[int, int]]:
    """The pixels of OpenCV's 8-connected ``Line`` from ``start`` to ``end`` inside a ``width`` x ``height``
    image: the segment clipped first (``clipLine``, whose truncated intersections move the pixels of a line that
    leaves the image), then walked left to right (``LineIterator``'s Bresenham)."""
    clipped = _clip_line(start, end, width, height)
    if clipped is None:
        return []
    (x1, y1), (x2, y2) = clipped
    if x2 < x1:
        (x1, y1), (x2, y2) = (x2, y2), (x1, y1)
    dx, dy = x2 - x1, abs(y2 - y1)
    y_step = -1 if y2 < y1 else 1
    steep = dy > dx
    major, minor = (dy, dx) if steep else (dx, dy)
    err, pixels, x, y = major - 2 * minor, [], x1, y1
    for _ in range(major + 1):
        pixels.append((x, y))
        diagonal = err < 0
        err += -2 * minor + (2 * major if diagonal else 0)
        if steep:
            y, x = y + y_step, x + (1 if diagonal else 0)
        else:
            x, y = x + 1, y + (y_step if diagonal else 0)
    return pixels


def _clip_line(start: tuple[int, int], end: tuple[int, int], width: int,
               height: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """OpenCV's ``clipLine`` (Cohen-Sutherland with its truncation toward zero), or None when nothing is inside."""
    right, bottom = width - 1, height - 1
    (x1, y1), (x2, y2) = start, end

    def code(x: int, y: int, rows: bool = True) -> int:
        return (x < 0) + (x > right) * 2 + ((y < 0) * 4 + (y > bottom) * 8 if rows else 0)

    c1, c2 = code(x1, y1), code(x2, y2)
    if (c1 & c2) == 0 and (c1 | c2) != 0:
        if c1 & 12:
            edge = 0 if c1 < 8 else bottom
            x1 += int((edge - y1) * (x2 - x1) / (y2 - y1))
            y1, c1 = edge, code(x1, edge, rows=False)
        if c2 & 12:
            edge = 0 if c2 < 8 else bottom
            x2 += int((edge - y2) * (x2 - x1) / (y2 - y1))
            y2, c2 = edge, code(x2, edge, rows=False)
        if (c1 & c2) == 0 and (c1 | c2) != 0:
            if c1:
                edge = 0 if c1 == 1 else right
                y1 += int((edge - x1) * (y2 - y1) / (x2 - x1))
                x1, c1 = edge, 0
            if c2:
                edge = 0 if c2 == 1 else right
                y2 += int((edge - x2) * (y2 - y1) / (x2 - x1))
                x2, c2 = edge, 0
    return None if (c1 | c2) else ((x1, y1), (x2, y2))


def _circle_spans(center: tuple[int, int], radius: int) -> dict[int, tuple[int, int]]:
    """Row -> (first, last) column of OpenCV's filled circle (drawing.cpp ``Circle``: the midpoint walk of one
    octant, each step filling the four rows it mirrors to)."""
    cx, cy = center
    spans: dict[int, tuple[int, int]] = {}

    def widen(row: int, first: int, last: int) -> None:
        old = spans.get(row)
        spans[row] = (first, last) if old is None else (min(old[0], first), max(old[1], last))

    err, dx, dy, plus, minus = 0, radius, 0, 1, 2 * radius - 1
    while dx >= dy:
        widen(cy - dy, cx - dx, cx + dx)
        widen(cy + dy, cx - dx, cx + dx)
        widen(cy - dx, cx - dy, cx + dy)
        widen(cy + dx, cx - dy, cx + dy)
        dy += 1
        err += plus
        plus += 2
        if err > 0:  # drawing.cpp: mask = (err <= 0) - 1, applied to err, dx and minus
            err -= minus
            dx -= 1
            minus -= 2
    return spans


def _fill_spans(frame: np.ndarray, spans: dict[int, tuple[int, int]], color: tuple[int, ...]) -> None:
    """Fill each row's inclusive column span, clipped to the frame."""
    height, width = frame.shape[:2]
    for row, (first, last) in spans.items():
        if 0 <= row < height and last >= 0 and first < width:
            frame[row, max(first, 0):min(last, width - 1) + 1] = color


def _fill_rect(frame: np.ndarray, corner: tuple[int, int], opposite: tuple[int, int], color: tuple[int, ...]) -> None:
    """``cv2.rectangle(..., thickness=-1)``: both corners inclusive, clipped to the frame."""
    (x0, y0), (x1, y1) = corner, opposite
    frame[max(y0, 0):max(y1 + 1, 0), max(x0, 0):max(x1 + 1, 0)] = color


def _draw_needle(frame: np.ndarray, center: tuple[int, int], size: int) -> None:
    x, y = center
    half = size // 2
    _fill_rect(frame, (x - half, y - half), (x + half, y + half), (255, 255, 255))
    bar = max(2, size // 6)
    _fill_rect(frame, (x - half, y - bar), (x + half, y + bar), (0, 0, 255))
    _fill_rect(frame, (x - bar, y - half), (x + bar, y + half), (0, 0, 255))


class LoopingSource(FrameSource):
    """A recorded source played again from its start whenever it ends (``video.loop``), time running on.

    Each pass is reopened with ``reopen`` and shifted so its timestamps continue after the previous
    pass's last frame by one frame interval: the session (which would take time going back as a clock jump)
    sees one long stream, and a short clip can stand in for a camera for hours.

    ``seek`` skips whole passes once the loop's period (the time from one pass's start to the next's) is known: from
    the start for a ``synthetic:`` video of a given length, else at the end of the first pass played through.
    """

    kind = "loop"

    def __init__(self, source: FrameSource, reopen: Callable[[], FrameSource]) -> None:
        if source.live:
            raise ValueError(f"video source {source.spec!r} is live: only a recorded source can loop")
        super().__init__(source.spec, live=False)
        self.source = source
        self._reopen = reopen
        self.passes = 1
        self._offset = 0.0  # added to this pass's timestamps
        self._last_t: float | None = None  # the loop time of the last frame read (None: none since a seek)
        self._step = 1.0 / 30.0
        self._period: float | None = None  # from one pass's start to the next's, once known
        self._next_offset: float | None = None  # the next pass's offset, where a seek left ``_last_t`` unknown
        self._pass_frames = 0  # frames read in this pass
        self._stepped = False  # the last frame came later than the one before it (``_step`` is its interval)

    @property
    def grab_saves_decoding(self) -> bool:  # as the source it plays
        return self.source.grab_saves_decoding

    def read(self) -> Frame:
        frame, t = self._next(lambda source: source.read())
        return frame, t

    def grab(self) -> float:
        return self._next(lambda source: (None, source.grab()))[1]

    def retrieve(self) -> np.ndarray:
        return self.source.retrieve()

    def _next(self, take: Callable[[FrameSource], tuple[Any, float]]) -> tuple[Any, float]:
        try:
            frame, t = take(self.source)
        except EndOfStream:
            if self._last_t is None and self._next_offset is None:
                raise  # an empty video would loop forever without a frame
            self._start_pass(self._next_pass_offset())
            frame, t = take(self.source)
        t = self._offset + t
        self._stepped = self._last_t is not None and t > self._last_t
        if self._stepped:
            self._step = t - self._last_t
        self._last_t = t
        self._pass_frames += 1
        return frame, t

    def _next_pass_offset(self) -> float:
        if self._next_offset is not None:
            return self._next_offset
        offset = self._last_t + self._step
        if self._period is None and self._pass_frames >= 2 and self._stepped:  # the next passes repeat this one
            self._period = offset - self._offset
        return offset

    def _start_pass(self, offset: float, passes: int = 1) -> None:
        self.source.close()
        self.source = self._reopen()
        self.passes += passes
        self._offset, self._next_offset, self._pass_frames = offset, None, 0

    def seek(self, t: float) -> None:
        """Move toward the first frame stamped at or after ``t`` (the loop's clock) without reading the frames
        before it, never past it: whole passes are skipped (reopened once, the pass count and time offset moved on
        by as many periods) and, where the source played seeks, it moves within its pass. Before the period is
        known nothing moves: the caller grabs through (``ResumedSource`` asks again after each frame)."""
        if self._period is None:
            declared = _declared_pass(self.source)
            if declared is None:
                return
            self._period, self._step = declared
        period = self._period
        ahead = math.floor((t - self._offset) / period)
        if ahead >= 1:
            self._start_pass(self._offset + ahead * period, ahead)
            self._last_t, self._next_offset = None, self._offset + period
        seek = getattr(self.source, "seek", None)
        if seek is not None and t > self._offset:
            seek(t - self._offset)
            self._last_t, self._next_offset = None, self._offset + period

    def close(self) -> None:
        self.source.close()


def _declared_pass(source: FrameSource) -> tuple[float, float] | None:
    """(period, frame interval) of a loop of ``source`` known before it is played: a ``synthetic:`` video of two
    frames or more (``frames / fps``, as a pass played through gives it); None for any other."""
    if isinstance(source, SyntheticSource) and source.frames is not None and source.frames >= 2:
        return source.frames / source.fps, 1.0 / source.fps
    return None


class ResumedSource(FrameSource):
    """A recorded source that goes on from ``start_t`` (its own clock) instead of its start: a paused file,
    ``synthetic:`` video or ROS 2 bag resumes where it stopped, as a video player does, so the stream neither
    shows the model what it already saw nor moves the recording's time (a ``--quiz`` ground truth, evidence
    times) away from the session's. A live source has nothing to resume: it goes on live, and is refused here.

    The first ``read`` or ``grab`` moves there, in the capture thread: a source with ``seek`` moves as far as it
    can without reading (a synthetic video to the frame, a loop whole passes at a time), and the rest is grabbed
    through (pixels never retrieved; a bag's images never decoded) up to the first frame stamped at or after
    ``start_t``. Frames that do not decode just before it (none stamped before ``start_t`` read after them) are
    reported by that first ``read`` or ``grab`` as one ``CorruptFrame`` of their count, and counted as a capture
    counts any other; those before an earlier frame were passed over before the pause."""

    kind = "resumed"
    EPSILON = 1e-6  # container clocks are in ms: 0.5 s may read 0.49999999 (as TimestampSelector allows)

    def __init__(self, source: FrameSource, start_t: float) -> None:
        if source.live:
            raise ValueError(f"video source {source.spec!r} is live: it goes on live, there is nothing to resume")
        if not math.isfinite(start_t):
            raise ValueError(f"video source {source.spec!r}: cannot resume at t={start_t!r}")
        super().__init__(source.spec, live=False)
        self.source = source
        self.start_t = float(start_t)
        self.skipped = 0  # frames passed over to reach start_t
        self._arrived = False
        self._held_t: float | None = None  # the frame grabbed at start_t, not handed out yet
        self._corrupt: CorruptFrame | None = None  # the frames at start_t that did not decode, not reported yet
        self._ended: EndOfStream | None = None  # the source ended before start_t (after those)

    @property
    def grab_saves_decoding(self) -> bool:  # as the source it plays
        return self.source.grab_saves_decoding

    def _arrive(self) -> None:
        """Move on to ``start_t``: the frame there grabbed (its pixels not retrieved yet), the corrupt frames
        just before it and an end before it held for ``_take``."""
        self._arrived = True
        seek = getattr(self.source, "seek", None)
        corrupt: list[CorruptFrame] = []
        while True:
            if seek is not None:
                seek(self.start_t)
            try:
                t = self.source.grab()
            except CorruptFrame as exc:  # no timestamp: at start_t, unless a frame before it follows
                corrupt.append(exc)
                continue
            except EndOfStream as exc:
                self._ended = exc
                break
            if t >= self.start_t - self.EPSILON:
                self._held_t = t
                break
            self.skipped += 1
            corrupt.clear()
        if corrupt:
            count = sum(exc.count for exc in corrupt)
            self._corrupt = CorruptFrame(f"{count} frame(s) just before the resume point t={self.start_t:g} s "
                                         f"skipped; the last: {corrupt[-1]}", count)

    def _take(self, held: Callable[[float], Any], take: Callable[[], Any]) -> Any:
        if not self._arrived:
            self._arrive()
        if self._corrupt is not None:
            corrupt, self._corrupt = self._corrupt, None
            raise corrupt
        if self._ended is not None:
            raise self._ended
        if self._held_t is not None:
            t, self._held_t = self._held_t, None
            return held(t)
        return take()

    def read(self) -> Frame:
        return self._take(lambda t: (self.source.retrieve(), t), self.source.read)

    def grab(self) -> float:
        return self._take(lambda t: t, self.source.grab)

    def retrieve(self) -> np.ndarray:
        return self.source.retrieve()

    def close(self) -> None:
        self.source.close()


def resume_after(source: FrameSource, t: float | None) -> FrameSource:
    """``source`` as the stream goes on after a pause whose last frame in was stamped ``t`` (the source's clock;
    None: nothing went in): a recorded source from ``t`` on (``ResumedSource``), a live one as it is (it goes on
    live)."""
    if t is None or source.live:
        return source
    return ResumedSource(source, t)


# ---------------------------------------------------------------------------------------------- open
EXTRA_SCHEMES = {"ros2": "edgekv.video.ros2", "rosbag": "edgekv.video.rosbag"}  # scheme -> module (parse, open_parsed)
# video.decoder -> the module that decodes a file with it (open_file(spec, path)); imported by name, as the schemes are:
# it builds on this module's sources
FILE_DECODERS = {"jetson": "edgekv.video.gst_file"}


def _is_bag(path: Path) -> bool:
    """A rosbag2 directory (metadata.yaml beside its storage files) or a bare MCAP / sqlite3 bag file."""
    return (path.is_dir() and (path / "metadata.yaml").is_file()) or (path.is_file() and path.suffix in (".mcap", ".db3"))


def _extra_scheme(module: str) -> Any:
    import importlib

    return importlib.import_module(module)


def open_source(spec: str | int | os.PathLike | SourceSpec, *, ros2: Any = None, stream_timeout_s: float | None = None,
                wait_for_stream: bool = False, decoder: str = "ffmpeg") -> FrameSource:
    """Open a ``video.source``. Bad specs raise ``ValueError`` naming the spec; a well-formed source that
    cannot be opened raises ``SourceUnavailable`` saying why. ``ros2``: the config's ``ros2:`` section
    (domain, network, QoS) for a ``ros2:`` source; defaults (and ``$ROS_DOMAIN_ID``) without it.

    Network streams (``rtsp://`` ...): ``stream_timeout_s`` bounds FFmpeg's open and each read (OpenCV's
    ``CAP_PROP_OPEN_TIMEOUT_MSEC`` / ``CAP_PROP_READ_TIMEOUT_MSEC``; without it OpenCV's 30 s each: a camera
    that goes silent with its connection open is noticed only after that). ``wait_for_stream``: a stream not
    reachable now is returned unopened (``OpenCVSource.waiting`` says why) and its first read is a
    ``SourceLost``, so a ``CaptureThread`` connects it with its backoff (an IP camera that boots after the
    robot, a Wi-Fi link not up yet). ``decoder`` (``video.decoder``): an ``rtsp://`` camera through OpenCV's FFmpeg
    (``ffmpeg``), or through a GStreamer pipeline (``rtsp_pipeline``: ``gstreamer``, or ``jetson`` for the
    hardware decoder), which needs OpenCV built with GStreamer (JetPack's). A video file with ``jetson`` is decoded
    by the hardware decoder through GStreamer's Python bindings (``edgekv.video.gst_file.GstFileSource``; no OpenCV
    needed); with ``ffmpeg`` or ``gstreamer`` by OpenCV's FFmpeg."""
    parsed = spec if isinstance(spec, SourceSpec) else parse_spec(spec)
    if parsed.kind in EXTRA_SCHEMES:
        return _extra_scheme(EXTRA_SCHEMES[parsed.kind]).open_parsed(parsed, ros2=ros2)
    if parsed.kind == "synthetic":
        cls = {"shapes": ShapesSource, "needle": NeedleSource, "events": EventSource,
               "world": WorldSource}[parsed.target]
        return cls(parsed.raw, **parsed.params)
    if parsed.kind == "file" and decoder in FILE_DECODERS:
        return _extra_scheme(FILE_DECODERS[decoder]).open_file(parsed.raw, str(parsed.target))
    if not has_opencv():  # every other kind is read through a cv2.VideoCapture
        raise SourceUnavailable(f"video source {redact(parsed.raw)!r}: a {parsed.kind} source is read with OpenCV, "
                                f"which is not installed here: {OPENCV_EXTRA}; the synthetic: videos need no extra")
    if parsed.kind == "file":
        return OpenCVSource(parsed.raw, str(parsed.target), cv2.CAP_ANY, live=False)
    if parsed.kind == "camera":
        device = parsed.target if isinstance(parsed.target, int) else os.path.realpath(parsed.target)
        api = cv2.CAP_ANY if isinstance(device, int) else getattr(cv2, "CAP_V4L2", cv2.CAP_ANY)
        return OpenCVSource(parsed.raw, device, api, live=True, camera_params=parsed.params)
    if parsed.kind == "stream" and decoder != "ffmpeg" and str(parsed.target).lower().startswith("rtsp"):
        if decoder == "gstreamer" and _on_a_jetson():
            raise SourceUnavailable(f"video source {redact(parsed.raw)!r}: video.decoder gstreamer does not work on a "
                                    "Jetson (decodebin picks NVIDIA's nvv4l2decoder there, whose NVMM frames "
                                    "videoconvert cannot take: rtsp_pipeline); set video.decoder: jetson (the "
                                    "hardware decoder) or ffmpeg (CPU)")
        if not opencv_has_gstreamer():
            raise SourceUnavailable(_no_gstreamer(parsed.raw, f"video.decoder {decoder}"))
        return OpenCVSource(parsed.raw, rtsp_pipeline(str(parsed.target), decoder, stream_timeout_s), cv2.CAP_GSTREAMER,
                            live=True, wait=wait_for_stream)
    if parsed.kind == "stream":
        return OpenCVSource(parsed.raw, str(parsed.target), cv2.CAP_ANY, live=True, timeout_s=stream_timeout_s,
                            wait=wait_for_stream, network=True)
    pipeline = str(parsed.target) if parsed.kind == "gstreamer" else csi_pipeline(int(parsed.target), **parsed.params)
    if not opencv_has_gstreamer():
        raise SourceUnavailable(_no_gstreamer(parsed.raw))
    return OpenCVSource(parsed.raw, pipeline, cv2.CAP_GSTREAMER, live=True)


def _no_gstreamer(raw: str, what: str = "") -> str:
    return (f"video source {redact(raw)!r}{' with ' + what if what else ''} needs OpenCV built with GStreamer, but "
            f"this OpenCV ({cv2.__version__}) reports 'GStreamer: NO' in cv2.getBuildInformation(); the pip wheels "
            "lack it - on a Jetson use JetPack's python3-opencv (uninstall opencv-python from the environment)")


# ---------------------------------------------------------------------------------------------- sampling
class TimestampSelector:
    """Picks frames at a target fps by their own timestamps: the first frame at or after each tick
    ``t0 + k / fps``. Never duplicates a frame (a slower source just yields fewer), and the choice
    depends only on timestamps, so a replay picks the same frames."""

    EPSILON = 1e-6  # container clocks are in ms, floats are not exact: 0.5 s may read 0.49999999

    def __init__(self, fps: float) -> None:
        if not (isinstance(fps, (int, float)) and not isinstance(fps, bool) and math.isfinite(fps) and fps > 0):
            raise ValueError(f"fps must be a positive number, got {fps!r}")
        self.fps = float(fps)
        self._t0: float | None = None
        self._next_tick = 0  # index k of the next tick

    def set_fps(self, fps: float) -> None:
        """Change the rate from the next tick on: the tick schedule restarts at the next tick's time."""
        if self._t0 is not None:
            self._t0 += self._next_tick / self.fps
            self._next_tick = 0
        self.fps = float(fps)

    def accept(self, t: float) -> bool:
        if self._t0 is None:
            self._t0 = t
            self._next_tick = 1
            return True
        elapsed_ticks = (t - self._t0) * self.fps
        if elapsed_ticks + self.EPSILON * self.fps < self._next_tick:
            return False
        self._next_tick = math.floor(elapsed_ticks + self.EPSILON * self.fps) + 1
        return True


def iter_frames(source: str | int | os.PathLike | FrameSource, max_frames: int | None = None,
                fps: float | None = None) -> Iterator[Frame]:
    """Deterministic frames from a recorded source (file or synthetic), in the caller's thread.

    ``fps`` picks frames by timestamp (``TimestampSelector``); ``None`` yields every frame. Corrupt
    frames are skipped (counted in ``source.frames_skipped``). Benchmarks and tests use this; a live
    camera goes through ``CaptureThread`` + ``Sampler`` instead, since it cannot be replayed.
    """
    if max_frames is not None and (not isinstance(max_frames, int) or max_frames < 0):
        raise ValueError(f"max_frames must be a non-negative integer or None, got {max_frames!r}")
    owned = not isinstance(source, FrameSource)
    src = open_source(source) if owned else source
    try:
        if src.live:
            raise ValueError(f"video source {src.spec!r} is live: it cannot be replayed deterministically; "
                             "use CaptureThread and Sampler")
        selector = TimestampSelector(fps) if fps is not None else None
        emitted = 0
        if max_frames == 0:
            return
        for frame, t in src:
            if selector is None or selector.accept(t):
                yield frame, t
                emitted += 1
                if max_frames is not None and emitted >= max_frames:
                    return
    finally:
        if owned:
            src.close()


def looped_frames(source: str, count: int, fps: float, resize_to: tuple[int, int] | None = None) -> Iterator[Frame]:
    """``count`` frames sampled at ``fps``; a recorded file shorter than that is looped with time running
    on, so a short real clip (vtest.avi: 795 frames) can feed an hour-long stream. Frames are produced
    lazily (an hour of 768x576 frames would not fit in memory); ``resize_to`` (H, W) shrinks them first (OpenCV's
    area resize: the ``video`` extra).
    """
    emitted, offset = 0, 0.0
    while emitted < count:
        last_t, produced = 0.0, 0
        for frame, t in iter_frames(source, max_frames=count - emitted, fps=fps):
            if resize_to is not None:
                frame = cv2.resize(frame, (resize_to[1], resize_to[0]), interpolation=cv2.INTER_AREA)
            yield frame, offset + t
            last_t, produced = t, produced + 1
            emitted += 1
        if produced == 0:
            raise ValueError(f"source {source!r} gave no frames")
        offset += last_t + 1.0 / fps
