"""Video files decoded by a Jetson's hardware decoder (``video.decoder: jetson``; edgekv/video/gst_file.py).

No Jetson here: the pipelines for each container and codec are checked as strings, and run end to end through
``GstFileSource`` with generic GStreamer decoders in place of NVIDIA's ``nvv4l2decoder`` and ``nvvidconv``
(``STAND_IN``), on small files made at test time by GStreamer's encoders (Debian's gst-launch-1.0). The Python
bindings are Debian's python3-gi, made importable here through a folder holding only ``gi``. Where GStreamer, its
bindings or an encoder is missing, those tests skip naming the Debian packages; the string and codec tests run
everywhere."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edgekv.video import gst_file
from edgekv.video.gst_file import JETSON, Codec, DecodeElements, GstFileSource, file_pipeline, hardware_codec
from edgekv.video.sources import (
    EndOfStream,
    LoopingSource,
    ResumedSource,
    SourceUnavailable,
    has_opencv,
    iter_frames,
    open_source,
)

SYSTEM_GI = Path("/usr/lib/python3/dist-packages/gi")  # Debian's python3-gi, built for Python 3.11
PACKAGES = ("python3-gi gir1.2-gstreamer-1.0 gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good "
            "gstreamer1.0-plugins-bad gstreamer1.0-plugins-ugly gstreamer1.0-libav")
_DECODERS = {"h264": "avdec_h264", "h265": "avdec_h265", "vp8": "vp8dec", "vp9": "vp9dec", "av1": "av1dec",
             "mpeg4": "avdec_mpeg4", "mpeg2": "avdec_mpeg2video", "mjpeg": "jpegdec"}
# the Jetson's pipeline with CPU decoders and videoconvert for nvv4l2decoder and nvvidconv; the parsers (and the
# byte-stream caps nvv4l2decoder needs) stay as they are
STAND_IN = DecodeElements({key: Codec(codec.name, codec.parse, _DECODERS[key]) for key, codec in JETSON.codecs.items()},
                          "videoconvert ! video/x-raw,format=BGRx", ("videoconvert",), "generic decoders (a test)")
FPS, FRAMES = 10, 30
RAW = f"videotestsrc num-buffers={FRAMES} pattern=ball ! video/x-raw,width=160,height=120,framerate={FPS}/1,format=I420"
FILES = {  # name: (encoder ! muxer, the demuxer and codec GStreamer finds in it)
    "h264.mp4": ("x264enc ! h264parse ! mp4mux", "qtdemux", "h264"),
    "h264.mkv": ("x264enc ! h264parse ! matroskamux", "matroskademux", "h264"),
    "h264.avi": ("x264enc ! h264parse ! avimux", "avidemux", "h264"),
    "h264.ts": ("x264enc ! h264parse ! mpegtsmux", "tsdemux", "h264"),
    "h265.mp4": ("x265enc ! h265parse ! mp4mux", "qtdemux", "h265"),
    "vp8.webm": ("vp8enc ! webmmux", "matroskademux", "vp8"),
    "vp9.webm": ("vp9enc ! webmmux", "matroskademux", "vp9"),
    "mjpeg.avi": ("jpegenc ! avimux", "avidemux", "mjpeg"),
    "mkv-named.mp4": ("x264enc ! h264parse ! matroskamux", "matroskademux", "h264"),  # the content decides
}


# ---------------------------------------------------------------------------------------------- everywhere
TAIL = "nvvidconv ! video/x-raw,format=BGRx ! appsink name=frames sync=false drop=false max-buffers=2 " \
       "enable-last-sample=false"


@pytest.mark.parametrize("demuxer, codec, middle", [
    ("qtdemux", "h264", "qtdemux ! h264parse ! video/x-h264,stream-format=byte-stream,alignment=au ! nvv4l2decoder"),
    ("matroskademux", "h265", "matroskademux ! h265parse ! video/x-h265,stream-format=byte-stream,alignment=au ! "
                              "nvv4l2decoder"),
    ("avidemux", "mjpeg", "avidemux ! jpegparse ! nvv4l2decoder mjpeg=1"),
    ("matroskademux", "vp8", "matroskademux ! nvv4l2decoder"),
    ("matroskademux", "vp9", "matroskademux ! nvv4l2decoder"),
    ("matroskademux", "av1", "matroskademux ! av1parse ! nvv4l2decoder"),
    ("qtdemux", "mpeg4", "qtdemux ! mpeg4videoparse ! nvv4l2decoder"),
    ("tsdemux", "mpeg2", "tsdemux ! mpegvideoparse ! nvv4l2decoder"),
])
def test_the_jetson_pipeline_for_each_container_and_codec(demuxer, codec, middle):
    assert file_pipeline("/clips/yard.mp4", demuxer, codec) == f'filesrc location="/clips/yard.mp4" ! {middle} ! {TAIL}'


def test_a_pipeline_quotes_the_path_and_takes_only_the_known_demuxers():
    assert file_pipeline('/clips/a "b" \\ c.mp4', "qtdemux", "h264").startswith(
        'filesrc location="/clips/a \\"b\\" \\\\ c.mp4" ! qtdemux ! ')
    with pytest.raises(ValueError, match="no pipeline for demuxer 'flvdemux'"):
        file_pipeline("/clips/a.flv", "flvdemux", "h264")


@pytest.mark.parametrize("fields, key", [
    ({"name": "video/x-h264", "chroma-format": "4:2:0", "bit-depth-luma": 8}, "h264"),
    ({"name": "video/x-h264"}, "h264"),
    ({"name": "video/x-h265", "chroma-format": "4:2:0", "bit-depth-luma": 10}, "h265"),
    ({"name": "video/x-vp8"}, "vp8"), ({"name": "video/x-vp9"}, "vp9"), ({"name": "video/x-av1"}, "av1"),
    ({"name": "video/mpeg", "mpegversion": 4}, "mpeg4"), ({"name": "video/mpeg", "mpegversion": 2}, "mpeg2"),
    ({"name": "image/jpeg"}, "mjpeg"),
])
def test_the_codecs_the_hardware_takes(fields, key):
    assert hardware_codec(fields) == key


@pytest.mark.parametrize("fields, said", [
    ({"name": "video/x-h264", "profile": "high-4:4:4", "chroma-format": "4:4:4", "bit-depth-luma": 10},
     r"H.264 high-4:4:4 10-bit 4:4:4: the Jetson's decoder takes 8-bit 4:2:0 H.264 only"),
    ({"name": "video/x-h265", "chroma-format": "4:4:4", "bit-depth-luma": 12}, r"H.265 12-bit 4:4:4: .* not a Jetson"),
    ({"name": "video/x-theora", "description": "Theora"}, r"Theora is not a codec .* \(H.264, H.265, VP8, VP9, AV1, "
                                                           r"MPEG-4 Part 2, MPEG-2, MJPEG\)"),
    ({"name": "video/mpeg", "mpegversion": 1, "description": "MPEG-1 Video"}, r"MPEG-1 Video is not a codec"),
])
def test_a_codec_the_hardware_does_not_take_is_named(fields, said):
    with pytest.raises(ValueError, match=said):
        hardware_codec(fields)


def test_video_decoder_jetson_sends_a_file_to_gstreamer_and_says_what_is_missing(tmp_path, monkeypatch):
    """Before, a file with ``video.decoder: jetson`` was read by OpenCV's FFmpeg on the CPU, silently. Now it goes to
    ``GstFileSource``: without GStreamer's Python bindings it is refused naming the packages (and ffmpeg)."""
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\0" * 64)
    monkeypatch.setitem(sys.modules, "gi", None)  # import gi: ImportError
    gst_file._gst.cache_clear()
    try:
        with pytest.raises(SourceUnavailable, match=r"GStreamer's Python bindings.*apt-get install python3-gi "
                                                    r"gir1.2-gstreamer-1.0.*--system-site-packages.*video.decoder: "
                                                    r"ffmpeg"):
            open_source(str(clip), decoder="jetson")
    finally:
        gst_file._gst.cache_clear()


# ---------------------------------------------------------------------------------------------- with GStreamer
@pytest.fixture(scope="module")
def gst(tmp_path_factory):
    """``Gst`` through Debian's python3-gi (a folder holding only ``gi`` on the path), or a skip naming packages."""
    shim = tmp_path_factory.mktemp("gi")
    if importlib.util.find_spec("gi") is None:  # a Python that has it needs nothing added
        if not SYSTEM_GI.is_dir():
            pytest.skip(f"no GStreamer Python bindings: apt-get install {PACKAGES}")
        (shim / "gi").symlink_to(SYSTEM_GI)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(shim))
    gst_file._gst.cache_clear()
    try:
        Gst = gst_file._gst()
    except (ImportError, ValueError) as exc:
        mp.undo()
        pytest.skip(f"GStreamer's bindings do not load ({exc}): apt-get install {PACKAGES}")
    missing = [name for name in ("parsebin", "videoconvert", "appsink", "h264parse", "avdec_h264", "x264enc")
               if Gst.ElementFactory.find(name) is None]
    if missing or shutil.which("gst-launch-1.0") is None:
        mp.undo()
        what = ", ".join(missing) or "gst-launch-1.0"
        pytest.skip(f"GStreamer elements missing ({what}): apt-get install {PACKAGES}")
    yield Gst
    mp.undo()
    gst_file._gst.cache_clear()


@pytest.fixture(scope="module")
def clips(gst, tmp_path_factory) -> dict[str, Path]:
    """The ``FILES`` whose encoder and muxer this GStreamer has, made once."""
    folder = tmp_path_factory.mktemp("clips")
    made = {}
    for name, (encode, _, codec) in FILES.items():
        elements = [part.strip().split()[0] for part in encode.split("!")] + [_DECODERS[codec]]
        if any(gst.ElementFactory.find(element) is None for element in elements):
            continue
        path = folder / name
        done = subprocess.run(["gst-launch-1.0", "-q", *f"{RAW} ! {encode} ! filesink location={path}".split()],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        made[name] = path
    return made


def _need(clips: dict[str, Path], name: str) -> Path:
    if name not in clips:
        pytest.skip(f"this GStreamer cannot make {name} ({FILES[name][0]}): apt-get install {PACKAGES}")
    return clips[name]


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_container_and_codec_plays_through_the_stand_in_pipeline(clips, name):
    """Probed by content (a Matroska file named .mp4 goes to matroskademux), every frame at the recording's clock
    (the file's frame times, from 0), BGR at the file's size, then the end; the pixels as OpenCV's FFmpeg decodes
    them (within two levels: another YUV->BGR conversion)."""
    path = _need(clips, name)
    source = GstFileSource(name, str(path), STAND_IN)
    try:
        assert (source.demuxer, source.codec) == FILES[name][1:]
        assert STAND_IN.codecs[source.codec].decode in source.pipeline_text and source.fps == FPS
        frames = [source.read() for _ in range(FRAMES)]
        with pytest.raises(EndOfStream) as ended:
            source.read()
        assert ended.value.reason == "eof"
    finally:
        source.close()
    assert [t for _, t in frames] == pytest.approx([i / FPS for i in range(FRAMES)], abs=1e-6)
    assert all(frame.shape == (120, 160, 3) and frame.dtype == np.uint8 and frame.flags.c_contiguous
               for frame, _ in frames)
    if has_opencv():
        reference = [frame for frame, _ in iter_frames(str(path))]
        assert len(reference) == FRAMES
        differences = [float(np.abs(a.astype(int) - b.astype(int)).mean()) for (a, _), b in zip(frames, reference)]
        assert max(differences) < 2.0, differences


def test_a_codec_or_file_the_hardware_does_not_take_is_refused_at_open(gst, tmp_path):
    """H.264 High 4:4:4 10-bit (x264enc's choice for videotestsrc's default format) and a text file: refused at open,
    naming what is wrong and the decoder that reads it."""
    high = tmp_path / "high444.mkv"
    raw = RAW.replace("format=I420", "format=Y444_10LE")
    done = subprocess.run(["gst-launch-1.0", "-q", *f"{raw} ! x264enc ! h264parse ! matroskamux ! filesink "
                                                    f"location={high}".split()], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    with pytest.raises(SourceUnavailable, match=r"H.264 high-4:4:4 10-bit 4:4:4: the Jetson's decoder takes 8-bit "
                                                r"4:2:0 H.264 only; set video.decoder: ffmpeg"):
        GstFileSource(str(high), str(high), STAND_IN)
    text = tmp_path / "notes.mp4"
    text.write_text("not a video\n" * 40)
    with pytest.raises(SourceUnavailable, match=r"notes.mp4.*GStreamer cannot read it"):
        GstFileSource(str(text), str(text), STAND_IN)


def test_off_a_jetson_video_decoder_jetson_names_the_missing_nvidia_elements(clips, gst):
    """The real path, here where NVIDIA's elements are not: refused at open, naming them and ffmpeg."""
    if gst.ElementFactory.find("nvv4l2decoder") is not None:
        pytest.skip("nvv4l2decoder is installed: a Jetson")
    path = _need(clips, "h264.mp4")
    with pytest.raises(SourceUnavailable, match=r"has no nvv4l2decoder, nvvidconv here \(not a Jetson\?\); set "
                                                r"video.decoder: ffmpeg"):
        open_source(str(path), decoder="jetson")


def test_a_resume_seeks_and_lands_on_the_frames_reading_through_gives(clips):
    """``ResumedSource`` (a pause, a restart) at t = 1.5 s: the same frames and times as reading through, without
    pulling the frames before the landing (two frames before t)."""
    path = str(_need(clips, "h264.mp4"))
    through = GstFileSource(path, path, STAND_IN)
    played = [through.read() for _ in range(FRAMES)]
    through.close()
    source = GstFileSource(path, path, STAND_IN)
    resumed = ResumedSource(source, 1.5)
    try:
        got = [resumed.read() for _ in range(FRAMES - 15)]
        with pytest.raises(EndOfStream):
            resumed.read()
    finally:
        resumed.close()
    assert [t for _, t in got] == pytest.approx([t for _, t in played[15:]], abs=1e-6)
    assert all(np.array_equal(frame, expected) for (frame, _), (expected, _) in zip(got, played[15:]))
    assert resumed.skipped == 0 and source.frames_read <= FRAMES - 15 + 3, source.frames_read


class LandingLate:
    """A pipeline whose seeks land ``late_s`` after where they were asked to (a demuxer that seeks to the key frame
    after the time), or nowhere (``late_s`` None: a demuxer that cannot seek)."""

    def __init__(self, pipeline, late_s: float | None) -> None:
        self.pipeline, self.late_s, self.seeks = pipeline, late_s, 0

    def __getattr__(self, name):
        return getattr(self.pipeline, name)

    def seek_simple(self, fmt, flags, position: int) -> bool:
        self.seeks += 1
        if self.late_s is None:
            return False
        return self.pipeline.seek_simple(fmt, flags, position + int(self.late_s * 1e9))


@pytest.mark.parametrize("late_s, seeks", [(0.5, 2), (None, 1)])
def test_a_seek_that_lands_late_or_nowhere_lands_earlier_or_plays_from_the_start(clips, late_s, seeks):
    """The landing is checked: one after t (frames would be lost) is tried again earlier; a pipeline that does not
    seek is played from its start. Either way the same frames as reading through."""
    path = str(_need(clips, "h264.mp4"))
    through = GstFileSource(path, path, STAND_IN)
    played = [through.read() for _ in range(FRAMES)]
    through.close()
    source = GstFileSource(path, path, STAND_IN)
    source._pipeline = late = LandingLate(source._pipeline, late_s)
    try:
        source.seek(1.5)
        got = [source.read() for _ in range(5)]
    finally:
        source.close()  # the pipeline in use (a landing that failed closed the first one and opened another)
    assert late.seeks == seeks
    assert [t for _, t in got] == pytest.approx([t for _, t in played[15:20]], abs=1e-6)
    assert all(np.array_equal(frame, expected) for (frame, _), (expected, _) in zip(got, played[15:20]))


def test_a_seek_past_the_end_ends_the_file(clips):
    path = str(_need(clips, "h264.mkv"))
    source = GstFileSource(path, path, STAND_IN)
    try:
        source.seek(FRAMES / FPS + 5.0)
        with pytest.raises(EndOfStream):
            source.read()
    finally:
        source.close()


def test_a_loop_plays_the_file_again_with_time_running_on(clips):
    """``video.loop``: each pass a new source (``LoopingSource``'s reopen), the times going on from one pass to the
    next by a frame interval."""
    path = str(_need(clips, "vp8.webm" if "vp8.webm" in clips else "h264.mp4"))
    loop = LoopingSource(GstFileSource(path, path, STAND_IN), lambda: GstFileSource(path, path, STAND_IN))
    try:
        times = [loop.read()[1] for _ in range(2 * FRAMES + 5)]
    finally:
        loop.close()
    assert times == pytest.approx([i / FPS for i in range(2 * FRAMES + 5)], abs=1e-6)
    assert loop.passes == 3


def test_video_fps_samples_the_file_by_its_own_timestamps_through_a_capture(clips):
    """``video.fps`` 2 over a 10 fps file, through the capture thread as the daemon reads a recording (lossless,
    by timestamp): every fifth frame, then the end said as "eof"."""
    from edgekv.video.capture import Sampler

    path = str(_need(clips, "h264.ts"))
    sampler = Sampler.open(GstFileSource(path, path, STAND_IN), 2.0, deterministic=True)
    try:
        times = []
        while (item := sampler.next_frame(timeout=120)) is not None:
            times.append(item[1])
        assert sampler.exhausted
        stats = sampler.capture.stats()
    finally:
        sampler.close()
    assert times == pytest.approx([i / 2 for i in range(FRAMES // 5)], abs=1e-6)
    assert stats["ended"] == "eof" and stats["frames_read"] == FRAMES, stats


def test_a_file_cut_short_plays_what_it_has_and_ends(clips, tmp_path):
    """A recording copied only in part (a Matroska file cut in half): the frames there, then the end, never a
    hang."""
    cut = tmp_path / "cut.mkv"
    data = _need(clips, "h264.mkv").read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    source = GstFileSource(str(cut), str(cut), STAND_IN)
    times = []
    try:
        with pytest.raises(EndOfStream) as ended:
            while True:
                times.append(source.read()[1])
    finally:
        source.close()
    assert 0 < len(times) < FRAMES and times[0] == 0.0 and all(b > a for a, b in zip(times, times[1:]))
    assert all(abs(t * FPS - round(t * FPS)) < 1e-6 for t in times), times  # the file's times, not invented ones
    assert ended.value.reason in ("eof", "truncated")  # matroskademux ends a cut file as its end (seen here)



def test_a_looping_file_is_opened_again_through_the_configured_decoder(monkeypatch, tmp_path):
    """``video.loop`` with ``video.decoder: jetson``: each later pass opens the file with the same decoder (the reopen
    had dropped it, so the second pass of a file decoded on the CPU)."""
    from edgekv.apps.daemon.startup import open_video_source
    from edgekv.config import EdgeKVConfig
    import edgekv.video.sources as sources

    clip = tmp_path / "clip.mp4"
    clip.write_bytes(b"\0" * 64)  # never decoded: the opener is replaced
    opened: list[str] = []
    real = sources.open_source

    def opener(spec, **kwargs):
        opened.append(kwargs.get("decoder", "ffmpeg"))
        return real("synthetic:shapes?frames=2&size=32x32")

    monkeypatch.setattr(sources, "open_source", opener)
    config = EdgeKVConfig().with_overrides(video={"source": str(clip), "loop": True, "decoder": "jetson"})
    _, source = open_video_source(config)
    try:
        source.source.close()
        source.source = source._reopen()
    finally:
        source.close()
    assert opened == ["jetson", "jetson"]
