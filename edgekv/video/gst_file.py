"""Video files decoded by a Jetson's hardware decoder through GStreamer (``video.decoder: jetson``).

OpenCV reads a file with FFmpeg on the CPU: 1080p H.264 costs an Orin Nano a CPU core or more. Here the file goes
through NVIDIA's ``nvv4l2decoder`` (the NVDEC engine) instead::

    filesrc ! <demuxer> ! <parser> ! nvv4l2decoder ! nvvidconv ! video/x-raw,format=BGRx ! appsink

The demuxer is the one GStreamer's type finding picks from the file's content (``probe_file``: ``parsebin``, which
plugs demuxers and parsers but never a decoder, so on a Jetson it does not pick ``nvv4l2decoder`` into NVMM memory
as ``decodebin`` would: see ``rtsp_pipeline``): qtdemux (mp4, mov), matroskademux (mkv, webm), avidemux (avi) or
tsdemux (MPEG-TS). The probe also names the video codec, so one the hardware does not take is refused at open,
naming it, rather than failing at the first frame. ``nvvidconv`` copies the decoded NVMM frame to system memory as
BGRx; the pad byte is dropped here in numpy, and only for the frames retrieved (``grab`` does not convert).

What the hardware takes (``HARDWARE_CODECS``), from NVIDIA's Jetson Linux "Accelerated GStreamer" guide (r35.6.1,
docs.nvidia.com/jetson/archives/r35.6.1/DeveloperGuide/SD/Multimedia/AcceleratedGstreamer.html: nvv4l2decoder
decodes H.265, H.264, VP8, VP9, MPEG-4, MPEG-2, and AV1 on AGX Orin only) and DeepStream's Gst-nvvideo4linux2 page
(docs.nvidia.com/metropolis/deepstream/dev-guide/text/DS_plugin_gst-nvvideo4linux2.html: JPEG/MJPEG through
``jpegparse``; H.264 8-bit 4:2:0 only; 10/12-bit 4:4:4 H.265 on x86/dGPU only). MJPEG takes the decoder's ``mjpeg=1``
as Jetson users' pipelines pass it. The decoder's sink takes H.264/H.265 as byte-stream access units only, so the
parser is asked for that.

Read through GStreamer's own Python bindings (PyGObject), not OpenCV's GStreamer backend (which ``rtsp_pipeline``
uses for a live camera): a file needs the recording's own clock and a seek whose landing can be checked, and OpenCV's
backend (modules/videoio/src/cap_gstreamer.cpp) answers ``CAP_PROP_POS_MSEC`` with a position query on the appsink
that it flags itself as unreliable (opencv/opencv#19025), and stops the pipeline before a seek. Here each frame's
time is its buffer's timestamp in the stream's time, and a seek is checked against the first frame it gives.

Not run on a Jetson: the pipelines were run here with generic decoders in place of ``nvv4l2decoder`` and
``nvvidconv`` (tests/test_jetson_file_decode.py).
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    Frame,
    FrameSource,
    ResumedSource,
    SourceUnavailable,
)

__all__ = ["DecodeElements", "FileProbe", "GstFileSource", "HARDWARE_CODECS", "JETSON", "file_pipeline",
           "hardware_codec", "open_file", "probe_file"]

log = logging.getLogger("edgekv.video")

GI_PACKAGES = "python3-gi gir1.2-gstreamer-1.0"
PLUGIN_PACKAGES = "gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad"
DEMUXERS = {"qtdemux": "mp4/mov", "matroskademux": "mkv/webm", "avidemux": "avi", "tsdemux": "MPEG-TS"}


@dataclass(frozen=True)
class Codec:
    """One codec the decoder takes: what messages call it, its parser (with the caps the decoder needs; "" for
    none), the decoder element with its properties."""

    name: str
    parse: str
    decode: str


@dataclass(frozen=True)
class DecodeElements:
    """The elements that decode and copy the frames out: NVIDIA's on a Jetson (``JETSON``); tests put generic
    decoders in their place. ``to_system_memory`` ends in BGRx frames in system memory."""

    codecs: dict[str, Codec]
    to_system_memory: str
    required: tuple[str, ...]  # checked at open, named in the refusal when missing
    what: str

    def __post_init__(self) -> None:
        if not self.to_system_memory.rstrip().endswith("format=BGRx"):
            raise ValueError(f"to_system_memory must end in BGRx frames, got {self.to_system_memory!r}")


HARDWARE_CODECS = {
    "h264": Codec("H.264", "h264parse ! video/x-h264,stream-format=byte-stream,alignment=au", "nvv4l2decoder"),
    "h265": Codec("H.265", "h265parse ! video/x-h265,stream-format=byte-stream,alignment=au", "nvv4l2decoder"),
    "vp8": Codec("VP8", "", "nvv4l2decoder"),
    "vp9": Codec("VP9", "", "nvv4l2decoder"),
    "av1": Codec("AV1", "av1parse", "nvv4l2decoder"),
    "mpeg4": Codec("MPEG-4 Part 2", "mpeg4videoparse", "nvv4l2decoder"),
    "mpeg2": Codec("MPEG-2", "mpegvideoparse", "nvv4l2decoder"),
    "mjpeg": Codec("MJPEG", "jpegparse", "nvv4l2decoder mjpeg=1"),
}
JETSON = DecodeElements(HARDWARE_CODECS, "nvvidconv ! video/x-raw,format=BGRx", ("nvv4l2decoder", "nvvidconv"),
                        "the Jetson's hardware decoder (nvv4l2decoder, JetPack's nvidia-l4t-gstreamer)")
TAKEN = ", ".join(codec.name for codec in HARDWARE_CODECS.values())


# ---------------------------------------------------------------------------------------------- codecs
def hardware_codec(fields: dict[str, Any]) -> str:
    """The ``HARDWARE_CODECS`` key of a video stream given its caps' fields (``name``, and where the parser said
    them ``mpegversion``, ``chroma-format``, ``bit-depth-luma``, ``profile``); raises ``ValueError`` naming what
    the hardware does not take."""
    name = str(fields.get("name", ""))
    chroma, depth = fields.get("chroma-format"), int(fields.get("bit-depth-luma") or 8)
    if name == "video/x-h264":
        if (chroma not in (None, "4:2:0", "4:0:0")) or depth > 8:
            raise ValueError(f"H.264 {fields.get('profile', '')} {depth}-bit {chroma or ''}: the Jetson's decoder "
                             "takes 8-bit 4:2:0 H.264 only")
        return "h264"
    if name == "video/x-h265":
        if chroma == "4:4:4" and depth > 8:
            raise ValueError(f"H.265 {depth}-bit 4:4:4: decoded by NVIDIA's desktop GPUs, not a Jetson's")
        return "h265"
    simple = {"video/x-vp8": "vp8", "video/x-vp9": "vp9", "video/x-av1": "av1", "image/jpeg": "mjpeg"}
    if name in simple:
        return simple[name]
    if name == "video/mpeg" and fields.get("mpegversion") in (2, 4):
        return "mpeg2" if fields["mpegversion"] == 2 else "mpeg4"
    described = fields.get("description") or name or "no video stream"
    raise ValueError(f"{described} is not a codec the Jetson's hardware decoder takes ({TAKEN})")


def file_pipeline(path: str, demuxer: str, codec: str, elements: DecodeElements = JETSON) -> str:
    """The pipeline that decodes ``path`` (its container's ``demuxer``, its video ``codec``: a ``HARDWARE_CODECS``
    key) into BGRx frames at an appsink named ``frames``. The appsink neither drops nor waits on the clock: every
    frame, as fast as they are taken, two at most waiting (1080p BGRx: 8 MB each)."""
    if demuxer not in DEMUXERS:
        raise ValueError(f"no pipeline for demuxer {demuxer!r}; one of {', '.join(DEMUXERS)}")
    chosen = elements.codecs[codec]
    quoted = path.replace("\\", "\\\\").replace('"', '\\"')
    parts = [f'filesrc location="{quoted}"', demuxer, chosen.parse, chosen.decode, elements.to_system_memory,
             "appsink name=frames sync=false drop=false max-buffers=2 enable-last-sample=false"]
    return " ! ".join(part for part in parts if part)


# ---------------------------------------------------------------------------------------------- GStreamer
@functools.cache
def _gst() -> Any:
    """GStreamer's ``Gst`` module, initialised; raises ``ModuleNotFoundError`` / ``ValueError`` where it is not
    there."""
    import gi

    gi.require_version("Gst", "1.0")
    from gi.repository import Gst

    Gst.init(None)
    return Gst


def load_gst(spec: str) -> Any:
    """``Gst``, or ``SourceUnavailable`` naming the packages."""
    try:
        return _gst()
    except (ImportError, ValueError) as exc:
        raise SourceUnavailable(
            f"video source {spec!r} with video.decoder jetson is read through GStreamer's Python bindings, which this "
            f"Python cannot import ({type(exc).__name__}: {exc}): apt-get install {GI_PACKAGES}, in a venv made with "
            "--system-site-packages (as jetson/install.sh makes it); or set video.decoder: ffmpeg") from None


def _describe(Gst: Any, caps: Any) -> str:
    """A codec's name as GStreamer's pbutils says it ("Theora"), else the caps' name."""
    try:
        import gi

        gi.require_version("GstPbutils", "1.0")
        from gi.repository import GstPbutils

        return str(GstPbutils.pb_utils_get_codec_description(caps))
    except (ImportError, ValueError):
        return caps.get_structure(0).get_name()


def _fields(Gst: Any, caps: Any) -> dict[str, Any]:
    structure = caps.get_structure(0)
    fields: dict[str, Any] = {"name": structure.get_name(), "description": _describe(Gst, caps)}
    for key in ("mpegversion", "chroma-format", "bit-depth-luma", "profile", "width", "height"):
        if structure.has_field(key):
            fields[key] = structure.get_value(key)
    return fields


def _error_text(message: Any) -> str:
    error, debug = message.parse_error()
    source = message.src.get_name() if message.src is not None else "?"
    return f"{error.message} ({source}{': ' + debug.splitlines()[-1] if debug else ''})"


@dataclass(frozen=True)
class FileProbe:
    """What ``probe_file`` found: the demuxer type finding picked (None: not a container) and the video stream's
    caps fields (None: no video stream)."""

    demuxer: str | None
    video: dict[str, Any] | None


def probe_file(Gst: Any, path: str, timeout_s: float) -> FileProbe:
    """The container and video codec of ``path`` by its content: ``filesrc ! parsebin``, each stream it finds
    prerolled into a fakesink. ``ValueError`` when GStreamer cannot make it out (not a video file, a missing
    plugin)."""
    pipeline = Gst.Pipeline.new("edgekv-probe")
    source = Gst.ElementFactory.make("filesrc", None)
    parse = Gst.ElementFactory.make("parsebin", None)
    if source is None or parse is None:
        raise ValueError(f"GStreamer's filesrc or parsebin is not installed: apt-get install {PLUGIN_PACKAGES}")
    source.set_property("location", path)
    pipeline.add(source)
    pipeline.add(parse)
    source.link(parse)
    sinks: list[Any] = []
    lock = threading.Lock()

    def added(_element: Any, pad: Any) -> None:  # a streaming thread: the pipeline is not running any further yet
        sink = Gst.ElementFactory.make("fakesink", None)
        sink.set_property("sync", False)
        with lock:
            sinks.append(sink)
        pipeline.add(sink)
        sink.sync_state_with_parent()
        pad.link(sink.get_static_pad("sink"))

    parse.connect("pad-added", added)
    try:
        pipeline.set_state(Gst.State.PAUSED)
        message = pipeline.get_bus().timed_pop_filtered(int(timeout_s * Gst.SECOND),
                                                        Gst.MessageType.ASYNC_DONE | Gst.MessageType.ERROR)
        if message is None:
            raise ValueError(f"GStreamer did not make out the file in {timeout_s:g} s")
        if message.type == Gst.MessageType.ERROR:
            raise ValueError(f"GStreamer cannot read it: {_error_text(message)}")
        demuxer = _demuxer(Gst, parse)
        with lock:
            caps = [sink.get_static_pad("sink").get_current_caps() for sink in sinks]
        video = [c for c in caps if c is not None and c.get_structure(0).get_name().startswith(("video/", "image/"))]
        return FileProbe(demuxer, _fields(Gst, video[0]) if video else None)
    finally:
        pipeline.set_state(Gst.State.NULL)


def _demuxer(Gst: Any, parse: Any) -> str | None:
    iterator = parse.iterate_recurse()
    while True:
        result, element = iterator.next()
        if result != Gst.IteratorResult.OK:
            return None
        factory = element.get_factory()
        if factory is not None and "Demux" in (factory.get_metadata("klass") or ""):
            return factory.get_name()


# ---------------------------------------------------------------------------------------------- the source
class GstFileSource(FrameSource):
    """A video file decoded by ``elements`` (the Jetson's hardware decoder): a recorded source, on its own clock.

    Frames are stamped with their buffer's time in the stream, from the file's first frame at 0 (as FFmpeg counts
    from a stream's start; a new frame's time no earlier than the last one's plus a frame interval, as
    ``OpenCVSource`` stamps a file), so a replay, a pause and a restart see the recording's clock. ``seek`` moves
    to a time and checks where it landed (as ``OpenCVSource.seek``); the end of the file is
    ``EndOfStream("eof")``, and a pipeline error after open (a damaged file, the decoder failing) is
    ``EndOfStream("truncated")`` saying what GStreamer said. Looping is ``LoopingSource``'s (reopen: a new source).

    Opening probes the file, refuses a container or codec the pipeline does not take (naming it and
    ``video.decoder: ffmpeg``), builds ``file_pipeline`` and prerolls it, so that a decoder that fails on this file
    fails at open, not at its first read: each refusal is a ``SourceUnavailable`` saying why."""

    kind = "gstreamer-file"
    grab_saves_decoding = True  # grab leaves the frame in BGRx: retrieve converts it
    OPEN_TIMEOUT_S = 60.0       # probing and prerolling a file (a hardware decoder's first frame included)
    READ_TIMEOUT_S = 60.0       # no frame, no end and no error for this long: the pipeline is stuck
    POLL_S = 0.2                # how often a waiting read looks at the bus and at ``interrupt``
    SEEK_BACK_S = (0.0, 1.0, 4.0, 16.0)  # how far before t a seek lands, tried in turn (then: from the start)

    def __init__(self, spec: str, path: str, elements: DecodeElements = JETSON) -> None:
        super().__init__(spec, live=False)
        self.path = path
        self.elements = elements
        self.Gst = load_gst(self.spec)
        missing = [name for name in elements.required if self.Gst.ElementFactory.find(name) is None]
        if missing:
            raise SourceUnavailable(f"video source {self.spec!r}: video.decoder jetson decodes files with "
                                    f"{elements.what}, but GStreamer has no {', '.join(missing)} here (not a Jetson?); "
                                    "set video.decoder: ffmpeg")
        try:
            probe = probe_file(self.Gst, path, self.OPEN_TIMEOUT_S)
        except ValueError as exc:
            raise SourceUnavailable(f"video source {self.spec!r}: {exc}") from None
        self.demuxer, self.video = probe.demuxer, probe.video
        if probe.demuxer not in DEMUXERS:
            found = f"a {probe.demuxer} container" if probe.demuxer else "no container GStreamer splits"
            raise SourceUnavailable(f"video source {self.spec!r}: {found}; video.decoder jetson reads "
                             f"{', '.join(DEMUXERS.values())} files; set video.decoder: ffmpeg for this one")
        if probe.video is None:
            raise SourceUnavailable(f"video source {self.spec!r}: no video stream in the file")
        try:
            self.codec = hardware_codec(probe.video)
        except ValueError as exc:
            raise SourceUnavailable(f"video source {self.spec!r}: {exc}; set video.decoder: ffmpeg to decode it on "
                                    "the CPU") from None
        if self.codec not in elements.codecs:
            raise SourceUnavailable(f"video source {self.spec!r}: no decoder for {HARDWARE_CODECS[self.codec].name} in "
                             f"{elements.what}; set video.decoder: ffmpeg")
        self.pipeline_text = file_pipeline(path, probe.demuxer, self.codec, elements)
        self.fps = 0.0
        self.frames_read = 0
        self._pipeline: Any = None
        self._sink: Any = None
        self._sample: Any = None  # the sample the last grab took, for retrieve
        self._pending: tuple[Any, float] | None = None  # the sample seek stopped at, for the next grab
        self._ended: EndOfStream | None = None
        self._last_t: float | None = None
        self._sought: float | None = None
        self._interrupted = False
        self._warned: set[str] = set()
        self._origin: float | None = None  # the stream time of the file's first frame: t = 0
        self._open()

    # ------------------------------------------------------------------ pipeline
    def _open(self) -> None:
        Gst = self.Gst
        try:
            pipeline = Gst.parse_launch(self.pipeline_text)
        except Exception as exc:  # GLib.Error: no such element, a bad property
            raise SourceUnavailable(f"video source {self.spec!r}: GStreamer cannot build {self.pipeline_text!r}: "
                                    f"{exc} (apt-get install {PLUGIN_PACKAGES})") from None
        sink = pipeline.get_by_name("frames")
        pipeline.set_state(Gst.State.PAUSED)
        message = pipeline.get_bus().timed_pop_filtered(int(self.OPEN_TIMEOUT_S * Gst.SECOND),
                                                        Gst.MessageType.ASYNC_DONE | Gst.MessageType.ERROR)
        if message is None or message.type == Gst.MessageType.ERROR:
            pipeline.set_state(Gst.State.NULL)
            said = _error_text(message) if message is not None else f"no frame in {self.OPEN_TIMEOUT_S:g} s"
            raise SourceUnavailable(f"video source {self.spec!r}: {HARDWARE_CODECS[self.codec].name} in "
                                    f"{self.demuxer} did not decode with {self.elements.what}: {said}; pipeline "
                                    f"{self.pipeline_text!r}; set video.decoder: ffmpeg to decode it on the CPU")
        if self._origin is None:  # tsdemux starts the stream's time at the first PCR (0.325 s in a test file)
            first = sink.emit("pull-preroll")
            self._origin = (self._stream_time(first) if first is not None else None) or 0.0
        caps = sink.get_static_pad("sink").get_current_caps()
        if caps is not None:
            ok, num, den = caps.get_structure(0).get_fraction("framerate")
            self.fps = num / den if ok and den and num > 0 else 0.0
        pipeline.set_state(Gst.State.PLAYING)
        self._pipeline, self._sink = pipeline, sink
        self._ended, self._last_t = None, None

    def __del__(self) -> None:  # a pipeline dropped while playing is a GStreamer-CRITICAL: stop it first
        if getattr(self, "_pipeline", None) is not None:
            self.close()

    def close(self) -> None:
        self._sample = self._pending = None
        pipeline, self._pipeline, self._sink = self._pipeline, None, None
        if pipeline is not None:
            pipeline.set_state(self.Gst.State.NULL)

    def interrupt(self) -> None:
        self._interrupted = True

    def _check_bus(self) -> None:
        """An error on the bus ends the file ("truncated"); warnings (a frame that did not decode) are logged once
        each."""
        Gst = self.Gst
        bus = self._pipeline.get_bus()
        while True:
            message = bus.pop_filtered(Gst.MessageType.ERROR | Gst.MessageType.WARNING)
            if message is None:
                return
            if message.type == Gst.MessageType.ERROR:
                self._ended = EndOfStream("truncated", f"GStreamer: {_error_text(message)}")
                return
            warning, _ = message.parse_warning()
            if warning.message not in self._warned:
                self._warned.add(warning.message)
                log.warning("video source %r: GStreamer: %s", self.spec, warning.message)

    def _pull(self) -> Any:
        """The next sample; raises ``EndOfStream`` at the end, on an error, when stuck or interrupted."""
        if self._pipeline is None:
            raise EndOfStream("eof", "closed")
        Gst = self.Gst
        deadline = time.monotonic() + self.READ_TIMEOUT_S
        while True:
            if self._ended is not None:
                raise self._ended
            sample = self._sink.emit("try-pull-sample", int(self.POLL_S * Gst.SECOND))
            if sample is not None:
                self.frames_read += 1
                return sample
            self._check_bus()
            if self._ended is None and self._sink.get_property("eos"):
                self._ended = EndOfStream("eof")
            elif self._ended is None and self._interrupted:
                raise EndOfStream("stopped")
            elif self._ended is None and time.monotonic() > deadline:
                self._ended = EndOfStream("truncated", f"no frame, end or error from GStreamer in "
                                                       f"{self.READ_TIMEOUT_S:g} s")

    def _stream_time(self, sample: Any) -> float | None:
        Gst = self.Gst
        pts = sample.get_buffer().pts
        if pts == Gst.CLOCK_TIME_NONE:
            return None
        segment = sample.get_segment()
        stream = segment.to_stream_time(Gst.Format.TIME, pts) if segment is not None else pts
        return None if stream == Gst.CLOCK_TIME_NONE else stream / Gst.SECOND - (self._origin or 0.0)

    def _timestamp(self, sample: Any) -> float:
        """The frame's time in the stream while it increases; otherwise the previous frame's plus a frame interval
        (never back: the session would take that as a clock jump)."""
        raw = self._stream_time(sample)
        step = 1.0 / self.fps if self.fps > 0 else 1.0 / 30.0
        if self._last_t is None:
            t = raw if raw is not None and raw >= 0 else 0.0
        else:
            t = raw if raw is not None and raw > self._last_t else self._last_t + step
        self._last_t = t
        return t

    # ------------------------------------------------------------------ frames
    def grab(self) -> float:
        self._grabbed = None
        if self._pending is not None:
            (self._sample, t), self._pending = self._pending, None
            return t
        self._sample = None
        sample = self._pull()
        t = self._timestamp(sample)
        self._sample = sample
        return t

    def retrieve(self) -> np.ndarray:
        sample, self._sample = self._sample, None
        if sample is None:
            raise RuntimeError(f"video source {self.spec!r}: retrieve() without a grab() before it")
        structure = sample.get_caps().get_structure(0)
        width, height = structure.get_value("width"), structure.get_value("height")
        buffer = sample.get_buffer()
        size = buffer.get_size()
        stride = size // height if height else 0
        if not width or not height or size % height or stride < width * 4:
            raise CorruptFrame(f"video source {self.spec!r}: a {size}-byte buffer is no {width}x{height} BGRx frame")
        pixels = np.frombuffer(buffer.extract_dup(0, size), dtype=np.uint8).reshape(height, stride)
        # pixels: [height, stride] bytes -> [height, width, 4] BGRx -> BGR
        return np.ascontiguousarray(pixels[:, :width * 4].reshape(height, width, 4)[:, :, :3])

    def read(self) -> Frame:
        t = self.grab()
        return self.retrieve(), t

    # ------------------------------------------------------------------ seek
    def seek(self, t: float) -> None:
        """Move to the first frame stamped at or after ``t`` (the stream's clock), handed out by the next ``grab``
        / ``read``, without converting the frames before it. GStreamer seeks (flushing, accurate: decoded from the
        key frame before) to two frames before ``t``, and where it landed is checked: the first frame must be
        stamped before ``t`` (a demuxer that lands after it would lose frames), else it lands earlier
        (``SEEK_BACK_S``), and at last the file is played from its start. Frames are grabbed on from there to
        ``t``. A ``t`` past the end ends it (``EndOfStream`` at the next read)."""
        if not math.isfinite(t):
            raise ValueError(f"video source {self.spec!r}: cannot seek to t={t!r}")
        if self._pipeline is None:
            raise EndOfStream("eof", "closed")
        if self._sought == t and (self._pending is not None or self._last_t is None
                                  or self._last_t < t - ResumedSource.EPSILON):
            return  # already on the way to t (or there)
        self._sought = t
        self._sample = self._pending = None
        if not self._land(t):
            self.close()
            self._open()
        while self._last_t is None or self._last_t < t - ResumedSource.EPSILON:
            try:
                self.grab()
            except EndOfStream:
                return  # the next grab ends again
        self._pending, self._sample = (self._sample, self._last_t), None

    def _land(self, t: float) -> bool:
        """A frame stamped before ``t`` grabbed (``_last_t`` its time) after a seek; False where none was reached."""
        Gst = self.Gst
        step = 1.0 / self.fps if self.fps > 0 else 1.0 / 30.0
        for back in self.SEEK_BACK_S:
            target = t - 2 * step - back
            if target < step:
                return False
            if self._ended is not None and self._ended.reason != "eof":
                return False  # a pipeline in error does not seek
            flags = Gst.SeekFlags.FLUSH | Gst.SeekFlags.ACCURATE
            if not self._pipeline.seek_simple(Gst.Format.TIME, flags, int((target + self._origin) * Gst.SECOND)):
                return False
            self._ended, self._last_t = None, None
            try:
                sample = self._pull()
            except EndOfStream as exc:
                if exc.reason != "eof":
                    return False
                continue  # past the end: land earlier
            landed = self._stream_time(sample)
            if landed is not None and 0.0 <= landed < t - ResumedSource.EPSILON:
                self._sample, self._last_t = sample, landed
                return True
        return False


def open_file(spec: str, path: str) -> GstFileSource:
    """A video file with ``video.decoder: jetson`` (``edgekv.video.sources.open_source``)."""
    return GstFileSource(spec, path)
