"""Network cameras as they behave on a robot (video.stream_timeout_s, video.wait_for_stream): an IP camera that is
not up when the daemon starts (a PoE camera boots slower than the Jetson) is connected when it comes, the daemon
serving meanwhile and saying so; a camera that goes silent with its connection open is reconnected after
``stream_timeout_s``, not after OpenCV's own 30 s; its password (in the URL) is never shown. The camera is an
MJPEG-over-HTTP server on 127.0.0.1, what many IP cameras serve, read through OpenCV's FFmpeg backend as an
``rtsp://`` stream is."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest

cv2 = pytest.importorskip("cv2")

from edgekv.video.capture import Backoff, CaptureThread  # noqa: E402
from edgekv.video.sources import open_source  # noqa: E402
from helpers_cameras import MjpegCamera, camera_waited_for, wait_for  # noqa: E402


@pytest.fixture
def camera():
    cam = MjpegCamera()
    yield cam
    cam.close()



def test_a_stream_that_is_not_up_is_refused_or_waited_for(camera):
    with camera_waited_for(camera, stream_timeout_s=5.0) as (_, capture):
        assert capture.stats()["reconnects"] == 1


def test_a_camera_gone_silent_is_reconnected_after_stream_timeout_s(camera):
    """Its connection stays open and sends nothing: before, FFmpeg waited OpenCV's 30 s before the read failed (the
    daemon blind, /healthz still "running"); with stream_timeout_s 1 the capture reconnects after about a second
    (the bound below, 25 s, is still under those 30 s, so this fails without the timeout)."""
    camera.power_on()
    capture = CaptureThread(open_source(camera.url, stream_timeout_s=1.0),
                            backoff=Backoff(base_s=0.05, max_s=0.2)).start()
    try:
        assert wait_for(lambda: capture.stats()["frames_read"] >= 3, 60), capture.stats()
        camera.go_silent()
        silent_at = time.monotonic()
        assert wait_for(lambda: capture.stats()["reconnects"] >= 1, 25), capture.stats()
        assert time.monotonic() - silent_at < 25
        read = capture.stats()["frames_read"]
        assert wait_for(lambda: capture.stats()["frames_read"] >= read + 3, 60), capture.stats()
        assert camera.clients >= 2
    finally:
        capture.stop()


def _health(port: int) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_daemon_starts_before_its_camera_and_ingests_once_it_is_up(tiny_checkpoint, tmp_path, camera, caplog):
    """The daemon starts (the model loaded, the API served) with its IP camera not up yet: the start says so, and
    /healthz says "reconnecting" with the reason; when the camera comes the frames go into the memory. With
    video.wait_for_stream false it refuses to start, naming video.source."""
    from edgekv.apps.daemon.loop import Daemon
    from edgekv.apps.daemon.startup import StartupError
    from helpers_server import RunningDaemon, daemon_args, server_config

    url = camera.url.replace("://", "://admin:s3cret@")  # the camera's password: never in a log, status or error
    config = server_config(tiny_checkpoint).with_overrides(
        video={"source": url, "fps": 4.0, "reconnect_backoff_s": [0.05, 0.2], "stream_timeout_s": 5.0})
    refused = Daemon(config.with_overrides(video={"wait_for_stream": False}), daemon_args(),
                     out=open(tmp_path / "refused.txt", "w"))
    with pytest.raises(StartupError, match="video.source: .*could not open it") as refusal:
        refused.preflight()
    assert "s3cret" not in str(refusal.value) and "admin:***@" in str(refusal.value)

    with RunningDaemon(config, tmp_path / "out.txt", pairs=0) as run:
        daemon, port = run.daemon, run.port
        assert wait_for(lambda: daemon.stream_state == "reconnecting", 60), daemon.stream_state
        code, health = _health(port)
        assert code == 200 and health["status"] == "degraded" and health["stream_state"] == "reconnecting", health
        assert any("not reached yet" in problem for problem in health["problems"]), health
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/edgekv/status", timeout=60) as response:
            status = response.read().decode()
        assert "admin:***@127.0.0.1" in status and "s3cret" not in status
        assert daemon.session.counters.frame_pairs == 0
        camera.power_on()
        assert wait_for(lambda: daemon.session.counters.frame_pairs >= 2, 120), daemon.session.counters
        assert wait_for(lambda: _health(port)[1]["status"] == "ok", 60), _health(port)
    text = (tmp_path / "out.txt").read_text()
    assert "starting anyway, connecting when it answers" in text and "could not open it" in text
    assert "admin:***@" in text and "s3cret" not in text + caplog.text


@pytest.mark.parametrize("given, shown", [
    ("rtsp://admin:s3cret@10.0.0.5:554/Streaming/Channels/101", "rtsp://admin:***@10.0.0.5:554/Streaming/Channels/101"),
    ("rtsp://10.0.0.5/cam/realmonitor?channel=1&user=admin&password=s3cret&subtype=0",
     "rtsp://10.0.0.5/cam/realmonitor?channel=1&user=admin&password=***&subtype=0"),
    ("http://cam.local/snapshot.mjpg?PWD=s3cret", "http://cam.local/snapshot.mjpg?PWD=***"),
    ("gst:rtspsrc location=rtsp://op:s3cret@cam/live latency=0 ! decodebin ! appsink",
     "gst:rtspsrc location=rtsp://op:***@cam/live latency=0 ! decodebin ! appsink"),
    ("rtsp://admin:p@ss@10.0.0.5/live", "rtsp://admin:***@10.0.0.5/live"),  # an @ in it, not written as %40
    ("rtsp://cam.local:8554/live", "rtsp://cam.local:8554/live"),  # nothing to hide: kept as it is
    ("synthetic:events?size=112x112&seed=3", "synthetic:events?size=112x112&seed=3"),
])
def test_a_cameras_password_is_hidden_wherever_the_source_is_shown(given, shown):
    from edgekv.video.sources import redact

    assert redact(given) == shown


def test_an_at_sign_in_a_cameras_password_is_refused_with_the_fix():
    """``rtsp://admin:p@ss@cam``: FFmpeg would take ``ss@cam`` for the host and the camera would never answer."""
    from edgekv.video.sources import parse_spec

    with pytest.raises(ValueError, match="write each '@' in them as %40") as refused:
        parse_spec("rtsp://admin:p@ss@10.0.0.5/live")
    assert "p@ss" not in str(refused.value) and "ss@" not in str(refused.value)
    assert parse_spec("rtsp://admin:p%40ss@10.0.0.5/live").kind == "stream"
