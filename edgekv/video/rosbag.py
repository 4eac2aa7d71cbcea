"""Recorded ROS 2 bags: the ``rosbag:`` frame source, and ``edgekv bag`` to write one from any video source.

``rosbag:PATH[?topic=/camera/image_raw&max_step=S]`` reads a rosbag2 bag with ``rosbags`` (pure Python, the
``ros2`` extra): a bag directory (metadata.yaml beside MCAP or sqlite3 files) or a bare ``.mcap`` / ``.db3``
file. The topic must carry ``sensor_msgs/msg/Image`` or ``sensor_msgs/msg/CompressedImage`` (decoded as in
``edgekv.video.ros_images``); without ``topic=`` the bag's only image topic is read. A recorded source: the
daemon reads every frame in order as fast as it ingests (or at the recorded speed with ``--realtime``),
``edgekv bench stream --source rosbag:…`` and everything that takes a ``video.source`` read it the same way.

Time is ``header.stamp`` (``StampClock``: seconds since the first frame, exact to the nanosecond; a stamp that
jumps becomes a bounded gap measured on the bag's recording clock). A message that does not decode is
skipped and counted (``CorruptFrame``); a bag cut off mid-file ends the stream as "truncated" after the last
message that could be read.

Ground truth travels with the frames: ``edgekv bag`` writes a ``synthetic:events`` source's spec on
``/edgekv/ground_truth`` (``std_msgs/msg/String``), and the reader rebuilds the scene from it
(``source.scene``), so ``edgekv-camera --quiz N`` grades a bag exactly as it grades the stream it came from.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from edgekv.video.ros_images import (
    COMPRESSED,
    IMAGE,
    IMAGE_TYPES,
    INSTALL_HINT,
    STRING,
    StampClock,
    decode_cdr,
    frame_from_message,
    stamp_ns,
    typestore,
)
from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    Frame,
    FrameSource,
    SourceSpec,
    SourceUnavailable,
    _parse_query,
    _positive_float,
    cv2,
)

__all__ = ["GROUND_TRUTH_TOPIC", "RosbagSource", "encode_message", "open_parsed", "parse", "write_bag"]

GROUND_TRUTH_TOPIC = "/edgekv/ground_truth"
STORAGES = ("mcap", "sqlite3")
WRITE_ENCODINGS = ("bgr8", "rgb8", "mono8", "yuv422", "yuv422_yuy2", "nv12", "bayer_rggb8", "jpeg", "png")
DEFAULT_STAMP_BASE_S = 1_700_000_000  # a wall-clock epoch, as a robot's driver would stamp (2023-11-14)


def _topic_param(text: str) -> str:
    from edgekv.video.ros2 import resolve_name

    return resolve_name(text, "/")


_SPEC_PARAMS = {"topic": _topic_param, "max_step": _positive_float}


# ---------------------------------------------------------------------------------------------- reading
class RosbagSource(FrameSource):
    """One image topic of a rosbag2 bag, in recording order."""

    kind = "rosbag"
    grab_saves_decoding = True  # ``grab`` reads a message's header; only ``retrieve`` decodes its image

    def __init__(self, spec: str, path: str | Path, topic: str | None = None, max_step_s: float = 10.0) -> None:
        super().__init__(spec, live=False)
        self.path = Path(path).expanduser()
        self.clock = StampClock(f"video source {spec!r}", max_step_s)
        self.counts = {"messages": 0, "frames": 0, "corrupt": 0}
        self.scene = None
        self.ground_truth: str | None = None  # the synthetic:events spec the bag was written from, if any
        self._held: tuple[Any, str, int] | None = None  # (message, type, its number) grabbed, not yet retrieved
        self._reader = _open_reader(spec, self.path)
        try:
            self.topic, self.msgtype = self._choose_topic(topic)
            connections = [c for c in self._reader.connections if c.topic == self.topic]
            self.frame_count = sum(c.msgcount for c in connections)
            self.scene = self._ground_truth()
            self._messages: Iterator | None = self._reader.messages(connections=connections)
        except BaseException:
            self.close()
            raise

    def _choose_topic(self, topic: str | None) -> tuple[str, str]:
        topics = self._reader.topics
        images = sorted(name for name, info in topics.items() if info.msgtype in IMAGE_TYPES)
        listing = f"image topics: {', '.join(images)}" if images else "it has no Image or CompressedImage topic"
        if topic is None:
            if len(images) != 1:
                raise SourceUnavailable(f"video source {self.spec!r}: name a topic with ?topic=/… ({listing})")
            topic = images[0]
        if topic not in topics:
            raise SourceUnavailable(f"video source {self.spec!r}: the bag has no topic {topic} ({listing})")
        msgtype = topics[topic].msgtype
        if msgtype not in IMAGE_TYPES:
            found = msgtype or "several message types"
            raise SourceUnavailable(f"video source {self.spec!r}: {topic} carries {found}, not {IMAGE} or "
                                    f"{COMPRESSED} ({listing})")
        return topic, msgtype

    def _ground_truth(self) -> Any:
        """The scene of a ``synthetic:events`` source the bag was written from (``edgekv bag``), else None."""
        from edgekv.video.sources import open_source, parse_spec

        connections = [c for c in self._reader.connections if c.topic == GROUND_TRUTH_TOPIC and c.msgtype == STRING]
        for _, _, raw in self._reader.messages(connections=connections):
            try:
                text = decode_cdr(raw, STRING).data
                parsed = parse_spec(text)
            except (CorruptFrame, ValueError):
                return None
            if parsed.kind == "synthetic" and parsed.target == "events":
                self.ground_truth = text
                with open_source(parsed) as source:
                    return source.scene
            return None
        return None

    def read(self) -> Frame:
        t = self.grab()
        return self.retrieve(), t

    def grab(self) -> float:
        """The next message's time from its header alone: the message is deserialized (its pixels stay the bytes
        they were) and its image decoded only by ``retrieve``, so a resume that passes over an hour of a bag pays
        for reading it, not for decoding it. Every message that deserializes moves the clock, retrieved or not,
        so a bag read through ``grab`` is timed exactly as one read frame by frame."""
        self._held = None
        if self._messages is None:
            raise EndOfStream("eof", "closed")
        try:
            connection, recorded_ns, raw = next(self._messages)
        except StopIteration:
            self._messages = None
            raise EndOfStream("eof") from None
        except Exception as exc:  # rosbags' reader on a damaged or cut-off file
            self._messages = None
            raise EndOfStream("truncated", f"the bag could not be read past message {self.counts['messages']} of "
                                           f"{self.frame_count} ({type(exc).__name__}: {exc})") from None
        self.counts["messages"] += 1
        try:
            msg = decode_cdr(raw, connection.msgtype)
        except CorruptFrame as exc:
            raise self._corrupt(exc) from None
        self._held = (msg, connection.msgtype, self.counts["messages"])
        return self.clock(stamp_ns(msg.header), int(recorded_ns))

    def retrieve(self) -> np.ndarray:
        """The image of the message the last ``grab`` read (once); ``CorruptFrame`` when it does not decode."""
        held, self._held = self._held, None
        if held is None:
            raise RuntimeError(f"video source {self.spec!r}: retrieve() without a grab() before it")
        msg, msgtype, number = held
        try:
            frame = frame_from_message(msg, msgtype)
        except CorruptFrame as exc:
            raise self._corrupt(exc, number) from None
        self.counts["frames"] += 1
        return frame

    def _corrupt(self, exc: CorruptFrame, number: int | None = None) -> CorruptFrame:
        self.counts["corrupt"] += 1
        return CorruptFrame(f"video source {self.spec!r}: message {number or self.counts['messages']}: {exc}")

    def reopen(self) -> None:
        raise SourceUnavailable(f"video source {self.spec!r}: a bag is not reopened")

    def close(self) -> None:
        self._messages = self._held = None
        reader, self._reader = getattr(self, "_reader", None), None
        if reader is not None:
            reader.close()

    def stats(self) -> dict[str, Any]:
        return {**self.counts, "stamp_jumps": self.clock.jumps, "unstamped": self.clock.unstamped,
                "topic": self.topic, "type": self.msgtype}


def _open_reader(spec: str, path: Path) -> Any:
    try:
        from rosbags.rosbag2 import Reader
    except ImportError:
        raise SourceUnavailable(f"video source {spec!r}: reading bags needs the rosbags package: {INSTALL_HINT}") from None
    if not path.exists():
        raise SourceUnavailable(f"video source {spec!r}: no such bag {path}")
    try:
        reader = Reader(path)
        reader.open()
    except Exception as exc:  # ReaderError, FileNotFoundError (no metadata.yaml), a damaged index
        hint = ("; the MCAP file is cut off (a recording that stopped mid-write): `mcap recover` (the mcap CLI) "
                "rewrites what is readable" if "end magic" in str(exc) else "")
        raise SourceUnavailable(f"video source {spec!r}: not a readable ROS 2 bag ({type(exc).__name__}: {exc}"
                                f"{hint})") from None
    return reader


def parse(spec: str, rest: str) -> SourceSpec:
    """``rosbag:PATH[?topic=…&max_step=S]``; the path must exist."""
    path, _, query = rest.partition("?")
    params = _parse_query(spec, query, _SPEC_PARAMS)
    if not path.strip():
        raise ValueError(f"video source {spec!r}: 'rosbag:' needs a bag path, e.g. rosbag:run1?topic=/camera/image_raw")
    if not Path(path).expanduser().exists():
        raise ValueError(f"video source {spec!r}: no such bag {path}")
    return SourceSpec("rosbag", path, params, raw=spec)


def open_parsed(parsed: SourceSpec, ros2: Any | None = None) -> RosbagSource:
    return RosbagSource(parsed.raw, str(parsed.target), parsed.params.get("topic"), parsed.params.get("max_step", 10.0))


# ---------------------------------------------------------------------------------------------- writing
def bgr_to_yuv422(frame: np.ndarray, order: str) -> np.ndarray:
    """HxWx3 BGR (even W) -> HxWx2 packed 4:2:2, ``yuyv`` (Y0 U Y1 V) or ``uyvy`` (U Y0 V Y1): ITU-R BT.601
    limited range (Y in 16-235, chroma 16-240), what OpenCV's COLOR_YUV2BGR_YUYV / _UYVY and V4L2 cameras
    assume; the chroma of each pixel pair is averaged."""
    ycrcb = cv2.cvtColor(frame, cv2.COLOR_BGR2YCrCb).astype(np.float32)  # BT.601 full range
    y = 16.0 + ycrcb[:, :, 0] * (219.0 / 255.0)
    cr = 128.0 + (ycrcb[:, :, 1] - 128.0) * (224.0 / 255.0)
    cb = 128.0 + (ycrcb[:, :, 2] - 128.0) * (224.0 / 255.0)
    u = (cb[:, 0::2] + cb[:, 1::2]) / 2.0
    v = (cr[:, 0::2] + cr[:, 1::2]) / 2.0
    out = np.empty((frame.shape[0], frame.shape[1], 2), dtype=np.uint8)
    luma, chroma = (0, 1) if order == "yuyv" else (1, 0)
    out[:, :, luma] = np.clip(np.rint(y), 0, 255)
    out[:, 0::2, chroma] = np.clip(np.rint(u), 0, 255)
    out[:, 1::2, chroma] = np.clip(np.rint(v), 0, 255)
    return out


def encode_message(frame: np.ndarray, encoding: str, stamp: int, frame_id: str = "camera") -> tuple[str, Any]:
    """``(message type, rosbags message)`` of a BGR frame: an Image in ``encoding`` (bgr8, rgb8, mono8, yuv422 =
    UYVY, yuv422_yuy2 = YUYV, nv12 = the Y plane then interleaved U,V at half resolution, bayer_rggb8 = the raw
    mosaic of a sensor whose top-left 2x2 block is R G / G B) or a CompressedImage (jpeg, png), stamped ``stamp``
    ns."""
    store = typestore()
    Time, Header = store.types["builtin_interfaces/msg/Time"], store.types["std_msgs/msg/Header"]
    header = Header(stamp=Time(sec=stamp // 1_000_000_000, nanosec=stamp % 1_000_000_000), frame_id=frame_id)
    if encoding in ("jpeg", "png"):
        ok, data = cv2.imencode("." + ("jpg" if encoding == "jpeg" else "png"), frame)
        if not ok:
            raise ValueError(f"OpenCV could not encode a {frame.shape} frame as {encoding}")
        return COMPRESSED, store.types[COMPRESSED](header=header, format=encoding, data=data.reshape(-1))
    if encoding == "bgr8":
        pixels = frame
    elif encoding == "rgb8":
        pixels = frame[:, :, ::-1]
    elif encoding == "mono8":
        pixels = cv2.cvtColor(frame, cv2.COLOR_BGR2GRAY)
    elif encoding in ("yuv422", "yuv422_yuy2"):
        if frame.shape[1] % 2:
            raise ValueError(f"{encoding} pairs pixels: the frame width {frame.shape[1]} must be even")
        pixels = bgr_to_yuv422(frame, "uyvy" if encoding == "yuv422" else "yuyv")
    elif encoding == "nv12":
        height, width = frame.shape[:2]
        if height % 2 or width % 2:
            raise ValueError(f"nv12 shares chroma among 2x2 pixels: the frame ({width}x{height}) must be even")
        planar = cv2.cvtColor(frame, cv2.COLOR_BGR2YUV_I420).reshape(-1)  # Y, then U and V each a quarter
        luma, quarter = height * width, height * width // 4
        chroma = np.stack([planar[luma:luma + quarter], planar[luma + quarter:]], axis=1).reshape(height // 2, width)
        pixels = np.concatenate([planar[:luma].reshape(height, width), chroma])
        return IMAGE, store.types[IMAGE](header=header, height=height, width=width, encoding=encoding,
                                         is_bigendian=0, step=width, data=pixels.reshape(-1))
    elif encoding == "bayer_rggb8":
        pixels = np.empty(frame.shape[:2], np.uint8)
        for (dy, dx), channel in (((0, 0), 2), ((0, 1), 1), ((1, 0), 1), ((1, 1), 0)):  # R G / G B, BGR indices
            pixels[dy::2, dx::2] = frame[dy::2, dx::2, channel]
    else:
        raise ValueError(f"encoding {encoding!r}: expected one of {', '.join(WRITE_ENCODINGS)}")
    pixels = np.ascontiguousarray(pixels, dtype=np.uint8)
    height, width = pixels.shape[:2]
    return IMAGE, store.types[IMAGE](header=header, height=height, width=width, encoding=encoding, is_bigendian=0,
                                     step=pixels.strides[0], data=pixels.reshape(-1))


def write_bag(frames: Iterable[Frame], path: str | Path, topic: str = "/camera/image_raw", storage: str = "mcap",
              encoding: str = "bgr8", stamp_base_s: int = DEFAULT_STAMP_BASE_S, ground_truth: str | None = None) -> int:
    """Write ``(frame, t)`` as a rosbag2 bag at ``path`` (a new directory), each frame stamped and recorded
    at ``stamp_base_s + t``; ``ground_truth`` (a ``synthetic:events`` spec) goes on ``/edgekv/ground_truth``.
    Returns the number of frames written. rosbags writes rosbag2 format version 8 (metadata of Iron and
    later ROS 2 releases)."""
    try:
        from rosbags.rosbag2 import StoragePlugin, Writer
    except ImportError:
        raise SourceUnavailable(f"writing bags needs the rosbags package: {INSTALL_HINT}") from None
    if storage not in STORAGES:
        raise ValueError(f"storage {storage!r}: expected one of {', '.join(STORAGES)}")
    if encoding not in WRITE_ENCODINGS:
        raise ValueError(f"encoding {encoding!r}: expected one of {', '.join(WRITE_ENCODINGS)}")
    out = Path(path).expanduser()
    if out.exists():
        raise FileExistsError(f"{out} already exists (a bag is written into a new directory)")
    store = typestore()
    msgtype = COMPRESSED if encoding in ("jpeg", "png") else IMAGE
    plugin = StoragePlugin.MCAP if storage == "mcap" else StoragePlugin.SQLITE3
    written, stopped = 0, None
    with Writer(out, version=8, storage_plugin=plugin) as writer:
        images = writer.add_connection(topic, msgtype, typestore=store)
        truth = writer.add_connection(GROUND_TRUTH_TOPIC, STRING, typestore=store) if ground_truth else None
        source = iter(frames)
        while True:
            try:
                frame, t = next(source)
            except StopIteration:
                break
            except (KeyboardInterrupt, Exception) as exc:  # Ctrl-C, or the source failing: the frames before it are
                stopped = exc  # closed into a whole bag (metadata.yaml written; an exception inside the writer would
                break  # abort it, and rosbag2 cannot open a bag without its metadata)
            stamp = stamp_base_s * 1_000_000_000 + round(t * 1e9)
            if truth is not None and written == 0:
                writer.write(truth, stamp, bytes(store.serialize_cdr(store.types[STRING](data=ground_truth), STRING)))
            kind, message = encode_message(frame, encoding, stamp)
            writer.write(images, stamp, bytes(store.serialize_cdr(message, kind)))
            written += 1
    if isinstance(stopped, KeyboardInterrupt):
        raise BagInterrupted(written, out) from None
    if stopped is not None:
        raise stopped
    return written


class BagInterrupted(KeyboardInterrupt):
    """Ctrl-C while ``write_bag`` was recording: the bag at ``path`` was closed whole with the ``written`` frames
    before it (recording a camera until Ctrl-C is the usual way to stop)."""

    def __init__(self, written: int, path: Path) -> None:
        super().__init__(f"{written} frames written to {path}")
        self.written, self.path = written, path


# ---------------------------------------------------------------------------------------------- edgekv bag
def add_bag_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="a video source: file, camera index, synthetic:events?…, another bag …")
    parser.add_argument("out", help="the bag directory to write (must not exist)")
    parser.add_argument("--topic", default="/camera/image_raw", help="the image topic")
    parser.add_argument("--storage", choices=STORAGES, default="mcap")
    parser.add_argument("--encoding", choices=WRITE_ENCODINGS, default="bgr8",
                        help="Image encoding, or jpeg/png for a CompressedImage topic")
    parser.add_argument("--frames", type=int, default=None, help="at most this many frames (default: the whole source; a camera records until Ctrl-C, which closes the bag whole)")
    parser.add_argument("--fps", type=float, default=None, help="sample the source at this rate (default: every frame)")
    parser.add_argument("--stamp-base", type=int, default=DEFAULT_STAMP_BASE_S,
                        help="seconds added to the source's time in header.stamp and the recording time")
    parser.epilog = ("example: edgekv bag 'synthetic:events?size=112x112&fps=2&frames=160&seed=2' out/demo-bag "
                     "--storage sqlite3; then video.source: rosbag:out/demo-bag")
    parser.set_defaults(func=bag_main)


def bag_main(args: argparse.Namespace) -> int:
    from edgekv.config import ros_name_problem
    from edgekv.video.sources import open_source, parse_spec

    if args.frames is not None and args.frames < 1:
        raise ValueError(f"--frames must be positive, got {args.frames}")
    # checked before the bag's directory is made: a bad value found while sampling left an empty bag behind, and the
    # corrected command then refused it as already there
    if args.fps is not None and not 0 < args.fps < float("inf"):
        raise ValueError(f"--fps must be a positive number of frames a second, got {args.fps}")
    problem = ros_name_problem(args.topic) or (None if args.topic.startswith("/") else "not absolute")
    if problem or args.topic == "/":
        raise ValueError(f"--topic {args.topic!r} is not a ROS 2 topic name ({problem or 'the root is no topic'})")
    parsed = parse_spec(args.source)
    interrupted = False
    with open_source(parsed) as source:
        truth = parsed.raw if parsed.kind == "synthetic" and parsed.target == "events" else None
        truth = truth or getattr(source, "ground_truth", None)
        try:
            count = write_bag(_frames(source, args.frames, args.fps), args.out, args.topic, args.storage,
                              args.encoding, args.stamp_base, truth)
        except BagInterrupted as stop:  # Ctrl-C: the bag holds the frames recorded before it, closed whole
            count, interrupted = stop.written, True
    kind = COMPRESSED if args.encoding in ("jpeg", "png") else IMAGE
    print(f"wrote {count} frames to {args.out} ({args.storage}; {args.topic}: {kind}, {args.encoding})"
          + (f"; ground truth {truth}" if truth else "") + ("; stopped by Ctrl-C" if interrupted else ""))
    return 130 if interrupted else 0


def _frames(source: FrameSource, count: int | None, fps: float | None) -> Iterator[Frame]:
    """A recorded source frame by frame (``fps``: by timestamp); a live one through the capture thread and the
    latest-frame sampler, ``count`` frames (default: until Ctrl-C) at ``fps`` (default 10)."""
    import itertools

    from edgekv.video.capture import CaptureThread, Sampler
    from edgekv.video.sources import iter_frames

    if not source.live:
        yield from iter_frames(source, max_frames=count, fps=fps)
        return
    if count is None:
        print(f"edgekv bag: recording {source.spec!r} until Ctrl-C (or give --frames)", file=sys.stderr)
    sampler = Sampler(CaptureThread(source).start(), fps or 10.0)
    try:
        yield from itertools.islice(iter(sampler), count)
    finally:
        sampler.close()
