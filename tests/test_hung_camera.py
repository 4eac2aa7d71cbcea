"""A camera whose driver call never returns (video.exit_when_hung_s): a CSI camera's Argus pipeline or a gst: pipeline
that hung inside GStreamer blocks OpenCV's read with no timeout, no frame and no error; the daemon, blind, used to
go on for ever (its loop turned, so the systemd watchdog was fed). Now it saves its memory and exits with status 3,
for the service manager to restart it. The hung driver is a source whose read blocks until it is closed."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edgekv.video.capture import CaptureThread
from edgekv.video.sources import FrameSource, SourceSpec
from helpers_cameras import wait_for


class HangingCamera(FrameSource):
    """A live source: ``frames`` frames (and, with ``until``, more until that holds: the consumer took what it
    needed), then a read that blocks until ``close()`` (as a hung driver call)."""

    kind = "fake"

    def __init__(self, frames: int, until=None) -> None:
        super().__init__("gst:hanging ! appsink", live=True)
        self.left = frames
        self.until = until
        self.released = threading.Event()
        self.blocked = threading.Event()

    def read(self):
        if self.left > 0 or (self.until is not None and not self.until()):
            self.left -= 1
            if self.left < 0:
                self.released.wait(0.02)  # a camera's pace while the consumer is not there yet
            return np.full((120, 160, 3), 60 + 10 * (self.left % 10), np.uint8), time.monotonic()
        self.blocked.set()
        self.released.wait()
        raise RuntimeError("released")

    def interrupt(self) -> None:  # the capture stopping (a real hung driver call would not wake: see the module)
        self.released.set()

    def close(self) -> None:
        self.released.set()


def test_the_capture_says_how_long_its_source_has_returned_nothing():
    source = HangingCamera(frames=3)
    capture = CaptureThread(source).start()
    try:
        assert wait_for(source.blocked.is_set, 60)
        first = capture.silent_s()
        assert wait_for(lambda: capture.silent_s() > first + 0.2, 60)
        assert capture.stats()["frames_read"] == 3
    finally:
        capture.stop()
    assert capture.silent_s() is None  # woken and finished: nothing is stuck any more


def test_the_daemon_exits_with_status_3_and_its_memory_saved(tiny_checkpoint, tmp_path, monkeypatch):
    import edgekv.apps.daemon.loop as loop
    from helpers_server import daemon_args, server_config

    daemon = None
    # frames come until the daemon has ingested some (however slow a busy machine makes its start), then none
    source = HangingCamera(frames=0, until=lambda: daemon is not None and daemon.session is not None
                           and daemon.session.counters.frames >= 2)
    monkeypatch.setattr(loop, "open_video_source",
                        lambda config: (SourceSpec("gstreamer", "hanging ! appsink", raw="gst:hanging ! appsink"),
                                        source))
    config = server_config(tiny_checkpoint).with_overrides(
        video={"source": "gst:hanging ! appsink", "exit_when_hung_s": 1.0}, state={"dir": str(tmp_path / "state")})
    out = open(tmp_path / "out.txt", "w")
    daemon = loop.Daemon(config, daemon_args(), out=out)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(daemon.run()), daemon=True)
    thread.start()
    thread.join(180)
    out.close()
    assert not thread.is_alive() and result == [3]
    text = (tmp_path / "out.txt").read_text()
    assert "has returned nothing, no frame and no error, for" in text and "exiting with status 3" in text
    assert daemon.session.counters.frames >= 2 and source.blocked.is_set()
    assert list((tmp_path / "state").glob("snapshot-*.ekv"))  # the memory saved on the way out


@pytest.mark.parametrize("kind, limit, hung", [("gstreamer", 1.0, True), ("csi", 1.0, True), ("camera", 1.0, True),
                                               ("stream", 1.0, False), ("ros2", 1.0, False),
                                               ("gstreamer", None, False)])
def test_only_sources_without_a_timeout_of_their_own_count_as_hung(kind, limit, hung):
    """A network stream times out by itself (video.stream_timeout_s); a ROS 2 topic may be quiet for hours; null
    turns it off."""
    from types import SimpleNamespace

    from edgekv.apps.daemon.loop import Daemon
    from edgekv.config import EdgeKVConfig

    daemon = Daemon(EdgeKVConfig().with_overrides(video={"exit_when_hung_s": limit}), out=open("/dev/null", "w"))
    daemon._spec = SimpleNamespace(kind=kind)
    daemon.sampler = SimpleNamespace(capture=SimpleNamespace(silent_s=lambda: 5.0))
    daemon._check_hung()
    assert (daemon.exit_code == 3) == hung and bool(daemon.stop) == hung


def test_a_camera_that_delivers_nothing_is_no_late_tick():
    """``late_ticks`` counts frames the consumer took more than a period after their tick; polls that found no frame
    (a camera reconnecting) counted each, 6,742 of them in a 10-minute probe of a flapping RTSP camera."""
    from types import SimpleNamespace

    from edgekv.video.capture import Sampler

    frames = [(np.zeros((4, 4, 3), np.uint8), 0.0, 1)]
    capture = SimpleNamespace(lossless=False, wait_stopped=lambda s: time.sleep(s) or False,
                              latest=lambda after, timeout: frames.pop(0) if frames else None,
                              want_from=lambda tick: None)
    sampler = Sampler(capture, fps=1000.0)
    assert sampler.next_frame(timeout=0) is not None
    for _ in range(10):
        time.sleep(0.005)  # past the next tick and its period
        assert sampler.next_frame(timeout=0) is None
    assert sampler._counts["late_ticks"] == 0
    frames.append((np.zeros((4, 4, 3), np.uint8), 1.0, 2))
    assert sampler.next_frame(timeout=0) is not None
    assert sampler._counts["late_ticks"] == 1
