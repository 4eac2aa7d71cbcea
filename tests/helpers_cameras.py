"""What the network-camera tests share (tests/test_network_camera.py: MJPEG over HTTP; tests/test_rtsp_camera.py: RTSP,
H.264): waiting on a condition with a generous bound, and the "not up when the daemon starts" check, the same for
any camera object with ``url`` and ``power_on()``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from edgekv.video.capture import Backoff, CaptureThread
from edgekv.video.sources import OpenCVSource, SourceUnavailable, open_source


def wait_for(condition: Callable[[], object], bound_s: float) -> bool:
    """Poll ``condition`` until it holds or ``bound_s`` passed (a bound for a busy CI, not a timing); its last value."""
    deadline = time.monotonic() + bound_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return bool(condition())


@contextmanager
def camera_waited_for(camera, stream_timeout_s: float) -> Iterator[tuple[OpenCVSource, CaptureThread]]:
    """A camera not up yet: refused without ``wait_for_stream``; with it, returned unopened and its capture counting
    refused reconnects; then the camera comes and frames flow. Yields (source, capture) for more checks; the capture
    is stopped after."""
    with pytest.raises(SourceUnavailable, match="could not open it"):
        open_source(camera.url, stream_timeout_s=stream_timeout_s)
    source = open_source(camera.url, stream_timeout_s=stream_timeout_s, wait_for_stream=True)
    assert not source.connected and "could not open it" in source.waiting
    capture = CaptureThread(source, backoff=Backoff(base_s=0.05, max_s=0.2)).start()
    try:
        assert wait_for(lambda: capture.stats()["reconnect_failures"] >= 2, 60), capture.stats()
        assert capture.stats()["frames_read"] == 0 and capture.reconnecting
        camera.power_on()
        assert wait_for(lambda: capture.stats()["frames_read"] >= 3, 60), capture.stats()
        assert source.connected and source.waiting is None
        yield source, capture
    finally:
        capture.stop()
