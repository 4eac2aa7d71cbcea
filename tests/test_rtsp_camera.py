"""An RTSP camera, what most IP cameras a robot carries are: H.264 over RTP, interleaved in the RTSP connection (OpenCV
asks FFmpeg for ``rtsp_flags=prefer_tcp``), served by GStreamer's RTSP server (tests/rtsp_camera_server.py, run by
Debian's /usr/bin/python3 with python3-gi) on 127.0.0.1 and read through OpenCV's FFmpeg backend as ``video.source``.

The camera: frames come as HxWx3 uint8 BGR at the camera's size, stamped in order; one not up when the source is
opened is refused, or waited for (``wait_for_stream``) and connected when it comes; one that loses power (SIGKILL: the
kernel closes its connections) is reconnected when it is back; one that hangs with its connection open (SIGSTOP) is
lost after ``stream_timeout_s``, with no stale frame handed out meanwhile, and read again when it answers; the daemon
ingests it. Without python3-gi, GStreamer's RTSP server typelib or the plugins, these tests skip naming the Debian
packages (``.ci/run`` installs them on CI); the tests of the skip itself and of the timed-out read run everywhere.

Each camera gets a port of its own: the test binds it (SO_REUSEADDR, never listening) for as long as it runs, so no
other process (another xdist worker) is given it, a connection to it is refused while the camera is off, and the
server (GLib binds with SO_REUSEADDR too) takes it when powered on, again after a restart.
"""

from __future__ import annotations

import functools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from edgekv.video import sources  # noqa: E402
from edgekv.video.capture import Backoff, CaptureThread  # noqa: E402
from edgekv.video.sources import SourceLost, open_source  # noqa: E402
from helpers_cameras import camera_waited_for, wait_for  # noqa: E402

pytestmark = pytest.mark.slow

SERVER = Path(__file__).with_name("rtsp_camera_server.py")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's: python3-gi is built for it, not for the venv's Python
PACKAGES = ("python3-gi gir1.2-gst-rtsp-server-1.0 gstreamer1.0-plugins-base gstreamer1.0-plugins-good "
            "gstreamer1.0-plugins-ugly")
WIDTH, HEIGHT = 320, 240  # the server's size (rtsp_camera_server.py)


def rtsp_server_missing(python: str = SYSTEM_PYTHON, env: dict | None = None) -> str | None:
    """None when ``python`` can run the RTSP camera, else why not, naming the Debian packages."""
    if not os.access(python, os.X_OK):
        return f"no {python} to run GStreamer's RTSP server (tests/rtsp_camera_server.py): apt-get install {PACKAGES}"
    try:
        done = subprocess.run([python, str(SERVER), "--check"], capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        return f"{python} {SERVER.name} --check did not answer in 60 s"
    if done.returncode == 0:
        return None
    said = (done.stdout.strip() or done.stderr.strip() or f"exit status {done.returncode}").splitlines()[-1]
    if "apt-get install" not in said:
        said += f"; apt-get install {PACKAGES}"
    return f"{python} cannot run GStreamer's RTSP server: {said}"


@functools.cache
def _missing() -> str | None:
    return rtsp_server_missing()


def _need_rtsp_server() -> None:
    reason = _missing()
    if reason:
        pytest.skip(reason)


class RtspCamera:
    """tests/rtsp_camera_server.py as a subprocess, on a port bound (not listened on) for the camera's lifetime: off
    until ``power_on()``, a connection to it is refused as a camera still booting refuses it."""

    def __init__(self, log_dir: Path) -> None:
        self.reservation = socket.socket()
        self.reservation.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.reservation.bind(("127.0.0.1", 0))
        self.port = self.reservation.getsockname()[1]
        self.url = f"rtsp://127.0.0.1:{self.port}/cam"
        self.log_dir = log_dir
        self.process: subprocess.Popen | None = None
        self.powered_at: float | None = None
        self.starts = 0

    def power_on(self, bound_s: float = 60.0) -> None:
        assert self.process is None or self.process.poll() is not None, "already on"
        self.starts += 1
        log = open(self.log_dir / f"rtsp-server-{self.port}-{self.starts}.log", "w")
        with log:
            self.process = subprocess.Popen([SYSTEM_PYTHON, str(SERVER), str(self.port)], stdout=subprocess.PIPE,
                                            stderr=log, text=True)
        ready, _, _ = select.select([self.process.stdout], [], [], bound_s)
        line = self.process.stdout.readline().strip() if ready else "(nothing)"
        assert line == f"ready {self.port}", f"the RTSP server said {line!r} (log: {log.name})"
        self.powered_at = time.monotonic()

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)
        if signum == signal.SIGKILL:
            self.process.wait(30)

    def close(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()  # SIGKILL ends a stopped process too
            self.process.wait(30)
        if self.process is not None:
            self.process.stdout.close()
        self.reservation.close()


@pytest.fixture
def camera(tmp_path):
    _need_rtsp_server()
    cam = RtspCamera(tmp_path)
    yield cam
    cam.close()


@pytest.fixture(scope="module")
def running_camera(tmp_path_factory):
    """One camera on for the tests that only read it."""
    _need_rtsp_server()
    cam = RtspCamera(tmp_path_factory.mktemp("rtsp"))
    try:
        cam.power_on()
        yield cam
    finally:
        cam.close()


# ---------------------------------------------------------------------------------------------- everywhere
def test_without_pygobject_or_the_plugins_the_tests_skip_naming_the_apt_packages(tmp_path):
    """The skip path, as CI on a machine without the packages takes it: a Python that cannot import ``gi`` (here one
    whose ``gi`` is shadowed by a package that refuses to import), no such Python at all, and GStreamer without its
    plugins (an empty plugin path) each give a reason naming every package to install."""
    python = SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else sys.executable
    shadow = tmp_path / "shadow"
    (shadow / "gi").mkdir(parents=True)
    (shadow / "gi" / "__init__.py").write_text("raise ImportError('no gi here (the test hides it)')\n")
    no_gi = rtsp_server_missing(python, env={**os.environ, "PYTHONPATH": str(shadow)})
    assert no_gi is not None and "no gi here" in no_gi and f"apt-get install {PACKAGES}" in no_gi, no_gi

    no_python = rtsp_server_missing(str(tmp_path / "python3"))
    assert no_python is not None and f"apt-get install {PACKAGES}" in no_python, no_python

    plugins = tmp_path / "plugins"
    plugins.mkdir()
    no_plugins = rtsp_server_missing(python, env={**os.environ, "GST_PLUGIN_SYSTEM_PATH_1_0": str(plugins),
                                                  "GST_PLUGIN_PATH_1_0": str(plugins),
                                                  "GST_REGISTRY_1_0": str(tmp_path / "registry.bin")})
    assert no_plugins is not None and f"apt-get install {PACKAGES}" in no_plugins, no_plugins
    if _missing() is None:  # where gi is there, the check gets as far as the elements and names the missing ones
        assert "x264enc" in no_plugins and "rtph264pay" in no_plugins, no_plugins


class _HangingCapture:
    """A ``cv2.VideoCapture`` over a stream that goes silent after ``good`` frames, as OpenCV's FFmpeg backend reads
    an H.264 camera that hangs: each later read waits the read timeout, and FFmpeg, its demuxer given up, drains the
    decoder's threads, so the first reads still return a frame (from before the silence) and only then fail."""

    def __init__(self, target, api, params=None) -> None:  # no params: OpenCV's own timeout (see the test's patch)
        self.timeout_s = (dict(zip(params[::2], params[1::2]))[cv2.CAP_PROP_READ_TIMEOUT_MSEC] / 1000 if params
                          else sources.OpenCVSource.OPENCV_READ_TIMEOUT_S)
        self.good, self.stale, self.reads = 3, 2, 0

    def isOpened(self) -> bool:
        return True

    def get(self, prop) -> float:
        return 0.0

    def set(self, prop, value) -> bool:
        return True

    def release(self) -> None:
        pass

    def read(self):
        self.reads += 1
        frame = np.full((HEIGHT, WIDTH, 3), self.reads, np.uint8)
        if self.reads <= self.good:
            return True, frame
        time.sleep(self.timeout_s * 1.05)  # FFmpeg's interrupt fires once the timeout has passed
        return self.reads <= self.good + self.stale, frame


def test_a_read_that_waited_out_stream_timeout_s_is_the_stream_lost(monkeypatch):
    """A read that took ``stream_timeout_s`` (FFmpeg's read timeout fired) loses the stream at once, even when OpenCV
    hands back a frame drained from the decoder: before, that old frame was handed out as new, twice, and the stream
    was lost only at the third timed-out read, three times ``stream_timeout_s`` after the camera went silent
    (measured against the RTSP camera below: 6.0 s with stream_timeout_s 2)."""
    captures = []

    def capture(*args):
        captures.append(_HangingCapture(*args))
        return captures[-1]

    monkeypatch.setattr(sources.cv2, "VideoCapture", capture)
    source = open_source("rtsp://127.0.0.1:9/cam", stream_timeout_s=0.2)
    for number in (1, 2, 3):
        frame, _ = source.read()
        assert int(frame[0, 0, 0]) == number
    with pytest.raises(SourceLost, match=r"nothing came for video.stream_timeout_s \(0.2 s\)"):
        source.read()
    assert captures[0].reads == 4  # the one timed-out read, no retries that would each wait the timeout again
    # video.stream_timeout_s null: OpenCV's own read timeout (30 s; 0.2 here) is the limit, said as such
    monkeypatch.setattr(sources.OpenCVSource, "OPENCV_READ_TIMEOUT_S", 0.2)
    source = open_source("rtsp://127.0.0.1:9/cam", stream_timeout_s=None)
    for number in (1, 2, 3):
        assert int(source.read()[0][0, 0, 0]) == number
    with pytest.raises(SourceLost, match=r"OpenCV's read timeout \(0.2 s; video.stream_timeout_s is null\)"):
        source.read()
    assert captures[-1].reads == 4


# ---------------------------------------------------------------------------------------------- the RTSP camera
def test_an_rtsp_camera_gives_bgr_frames_of_its_size_in_order(running_camera):
    source = open_source(running_camera.url, stream_timeout_s=5.0)
    try:
        assert source.connected and source.live
        frames = [source.read() for _ in range(12)]
    finally:
        source.close()
    stamps = [t for _, t in frames]
    assert all(b > a for a, b in zip(stamps, stamps[1:])), stamps
    for frame, _ in frames:
        assert frame.shape == (HEIGHT, WIDTH, 3) and frame.dtype == np.uint8
    # SMPTE bars, 100 %: white, yellow, cyan, green, magenta, red, blue; BGR, as OpenCV (and session.ingest) has it
    frame = frames[-1][0].astype(int)
    bars = {0: (255, 255, 255), 1: (0, 255, 255), 2: (255, 255, 0), 5: (0, 0, 255), 6: (255, 0, 0)}
    for bar, bgr in bars.items():
        x = int(WIDTH * (bar + 0.5) / 7)
        assert np.abs(frame[20:100, x - 8:x + 8] - np.array(bgr)).max() <= 48, (bar, frame[60, x])

    capture = CaptureThread(open_source(running_camera.url, stream_timeout_s=5.0)).start()
    try:
        assert wait_for(lambda: capture.stats()["frames_read"] >= 5, 60), capture.stats()
        read = capture.stats()["frames_read"]
        latest = capture.latest(timeout=30)
        assert latest is not None and latest[0].shape == (HEIGHT, WIDTH, 3)
        assert wait_for(lambda: capture.stats()["frames_read"] >= read + 5, 60), capture.stats()
        assert capture.stats()["reconnect_attempts"] == 0 and not capture.reconnecting
    finally:
        capture.stop()


def test_an_rtsp_camera_not_up_is_refused_or_waited_for(camera):
    with camera_waited_for(camera, stream_timeout_s=2.0) as (_, capture):
        assert capture.stats()["reconnects"] == 1
        latest = capture.latest(timeout=30)
        assert latest is not None and latest[0].shape == (HEIGHT, WIDTH, 3)


def test_an_rtsp_camera_that_loses_power_is_reconnected_when_it_is_back(camera):
    """SIGKILL: the kernel closes the camera's connection, the read fails at once; while the camera is off each
    reconnect is refused; when a camera answers on the port again the frames flow again."""
    camera.power_on()
    capture = CaptureThread(open_source(camera.url, stream_timeout_s=2.0),
                            backoff=Backoff(base_s=0.05, max_s=0.2)).start()
    try:
        assert wait_for(lambda: capture.stats()["frames_read"] >= 3, 60), capture.stats()
        camera.signal(signal.SIGKILL)
        assert wait_for(lambda: capture.reconnecting or capture.stats()["reconnect_attempts"] >= 1, 25), capture.stats()
        assert wait_for(lambda: capture.stats()["reconnect_failures"] >= 2, 25), capture.stats()
        read = capture.stats()["frames_read"]
        assert capture.stats()["reconnects"] == 0
        camera.power_on()
        assert wait_for(lambda: capture.stats()["frames_read"] >= read + 3, 60), capture.stats()
        assert capture.stats()["reconnects"] >= 1 and not capture.stats()["ended"]
    finally:
        capture.stop()


def test_an_rtsp_camera_that_hangs_is_lost_after_stream_timeout_s_without_stale_frames(camera):
    """SIGSTOP: the camera hangs with its connection open (its encoder stuck, a link down without a reset), nothing
    closes. The capture must take the stream as lost after stream_timeout_s; every frame it hands out after the hang is
    one that was already on its way (read within stream_timeout_s of the hang), never a frame drained from the decoder
    by a read that waited the timeout out (before the fix: two of them, 3 s and 6 s after the hang, then the loss at
    9 s). SIGCONT: the camera answers the pending reconnect and the frames flow again."""
    timeout_s = 3.0
    camera.power_on()
    capture = CaptureThread(open_source(camera.url, stream_timeout_s=timeout_s),
                            backoff=Backoff(base_s=0.05, max_s=0.2)).start()
    try:
        assert wait_for(lambda: capture.stats()["frames_read"] >= 3, 60), capture.stats()
        camera.signal(signal.SIGSTOP)
        hung_at = time.monotonic()
        assert wait_for(lambda: capture.reconnecting, 25), capture.stats()
        lost = capture.stats()  # the reconnect's first try waits stream_timeout_s on the hung camera: this is the loss
        assert capture.reconnecting and lost["reconnect_failures"] == 0, lost
        read = lost["frames_read"]
        # when the newest frame was handed out, by the capture thread's own stamp (live sources stamp each frame with
        # the monotonic clock as its read returns), not by this thread's polling: a busy machine delays the latter
        _, t, _ = capture.latest(0, 30)
        last_read = capture.source._clock_origin + t
        assert last_read - hung_at < timeout_s, (f"a frame was handed out {last_read - hung_at:.1f} s after the hang, "
                                                 f"the loss came {time.monotonic() - hung_at:.1f} s after it")
        assert "nothing came for video.stream_timeout_s (3 s)" in lost["last_error"], lost
        assert capture.stats()["reconnects"] == 0
        camera.signal(signal.SIGCONT)
        assert wait_for(lambda: capture.stats()["frames_read"] >= read + 3, 60), capture.stats()
        assert capture.stats()["reconnects"] >= 1
    finally:
        capture.stop()


def test_the_daemon_ingests_an_rtsp_camera(tiny_checkpoint, tmp_path, running_camera):
    from helpers_server import RunningDaemon, server_config

    config = server_config(tiny_checkpoint).with_overrides(
        video={"source": running_camera.url, "fps": 4.0, "reconnect_backoff_s": [0.05, 0.2], "stream_timeout_s": 5.0})
    with RunningDaemon(config, tmp_path / "out.txt", pairs=0) as run:
        assert wait_for(lambda: run.daemon.session.counters.frame_pairs >= 2, 120), run.daemon.session.counters
        assert run.daemon.stream_state == "running", run.daemon.stream_state


PULL = """
import json, sys
import gi
gi.require_version("Gst", "1.0")
from gi.repository import Gst
Gst.init(None)
pipeline = Gst.parse_launch(sys.argv[1].replace("appsink ", "appsink name=sink ", 1))
sink = pipeline.get_by_name("sink")
pipeline.set_state(Gst.State.PLAYING)
got = []
for _ in range(5):
    sample = sink.emit("try-pull-sample", 30 * Gst.SECOND)
    if sample is None:
        break
    caps = sample.get_caps().get_structure(0)
    got.append([caps.get_value("width"), caps.get_value("height"), caps.get_value("format"),
                sample.get_buffer().get_size()])
pipeline.set_state(Gst.State.NULL)
print(json.dumps(got))
"""


def test_video_decoder_gstreamer_pipeline_reads_the_rtsp_camera(running_camera):
    """``video.decoder: gstreamer``'s pipeline (edgekv.video.sources.rtsp_pipeline), run as built by GStreamer itself
    (Debian's Python, PyGObject) against the RTSP camera: BGR frames of the camera's size come out of its appsink.
    OpenCV's pip wheel has no GStreamer, so edgekv reads it only where OpenCV does (JetPack's); ``jetson``'s
    pipeline differs by nvvidconv, NVIDIA's, which is not here."""
    from edgekv.video.sources import rtsp_pipeline

    probe = ("import gi; gi.require_version('Gst', '1.0'); from gi.repository import Gst; Gst.init(None); "
             "print(bool(Gst.ElementFactory.find('avdec_h264') or Gst.ElementFactory.find('openh264dec')))")
    check = subprocess.run([SYSTEM_PYTHON, "-c", probe], capture_output=True, text=True, timeout=120)
    if check.stdout.strip() != "True":
        pytest.skip("no GStreamer H.264 decoder: apt-get install gstreamer1.0-libav")
    pipeline = rtsp_pipeline(running_camera.url, "gstreamer", timeout_s=5.0)
    pulled = subprocess.run([SYSTEM_PYTHON, "-c", PULL, pipeline], capture_output=True, text=True, timeout=180)
    frames = json.loads(pulled.stdout.strip().splitlines()[-1]) if pulled.stdout.strip() else []
    assert frames == [[WIDTH, HEIGHT, "BGR", WIDTH * HEIGHT * 3]] * 5, (pulled.stdout, pulled.stderr[-2000:])
    jetson = rtsp_pipeline(running_camera.url, "jetson", timeout_s=5.0)
    assert jetson == pipeline.replace("decodebin ! videoconvert", "decodebin ! nvvidconv ! "
                                      "video/x-raw,format=BGRx ! videoconvert")


def test_video_decoder_needs_an_opencv_with_gstreamer(monkeypatch):
    monkeypatch.setattr(sources, "opencv_has_gstreamer", lambda: False)
    with pytest.raises(sources.SourceUnavailable, match="with video.decoder jetson needs OpenCV built with GStreamer"):
        open_source("rtsp://admin:s3cret@127.0.0.1:9/cam", decoder="jetson")
    with pytest.raises(ValueError, match="builds no pipeline"):
        sources.rtsp_pipeline("rtsp://cam/x", "ffmpeg")


def test_video_decoder_gstreamer_is_refused_on_a_jetson_naming_what_works_there(monkeypatch):
    """On a Jetson ``decodebin`` picks ``nvv4l2decoder`` (rank primary + 11), whose NVMM buffers ``videoconvert``
    cannot take: the ``gstreamer`` pipeline would fail to negotiate and reconnect forever. Refused at open."""
    monkeypatch.setattr(sources, "opencv_has_gstreamer", lambda: True)
    monkeypatch.setattr(sources, "_on_a_jetson", lambda: True)
    with pytest.raises(sources.SourceUnavailable, match="video.decoder gstreamer does not work on a Jetson.*"
                                                        "video.decoder: jetson .* or ffmpeg") as refused:
        open_source("rtsp://admin:s3cret@127.0.0.1:9/cam", decoder="gstreamer")
    assert "s3cret" not in str(refused.value)
