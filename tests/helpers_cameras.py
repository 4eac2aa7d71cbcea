"""What the network-camera tests share (tests/test_network_camera.py: MJPEG over HTTP; tests/test_rtsp_camera.py: RTSP,
H.264; tests/test_status_page.py): an MJPEG camera on 127.0.0.1 that can be off, on and silent, waiting on a
condition with a generous bound, and the "not up when the daemon starts" check, the same for any camera object with
``url`` and ``power_on()``."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import cv2
import numpy as np
import pytest

from edgekv.video.capture import Backoff, CaptureThread
from edgekv.video.sources import OpenCVSource, SourceUnavailable, open_source


class MjpegCamera:
    """An MJPEG camera on 127.0.0.1. Its port is bound at once but not listened on until ``power_on()``: until then a
    connection is refused, as a camera still booting refuses it. ``go_silent()`` stops the frames on the connections
    open now (kept open, as a camera whose encoder hung keeps them); a later connection gets frames again."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}/camera.mjpg"
        self.clients = 0
        self._silent_up_to = 0  # connections numbered up to this one send nothing more
        self._closed = threading.Event()

    def power_on(self) -> None:
        self.sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def go_silent(self) -> None:
        self._silent_up_to = self.clients

    def close(self) -> None:
        self._closed.set()
        self.sock.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.clients += 1
            threading.Thread(target=self._serve, args=(conn, self.clients), daemon=True).start()

    def _serve(self, conn: socket.socket, number: int) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: multipart/x-mixed-replace; boundary=frame\r\n\r\n")
                index = 0
                while not self._closed.is_set():
                    if number <= self._silent_up_to:
                        self._closed.wait(0.05)
                        continue
                    image = np.zeros((120, 160, 3), np.uint8)
                    image[:, :] = (index * 13 % 256, 90, 200)
                    data = cv2.imencode(".jpg", image)[1].tobytes()
                    conn.sendall(b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(data)
                                 + data + b"\r\n")
                    index += 1
                    self._closed.wait(0.05)
            except OSError:
                return


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


@contextmanager
def running_cameras(config, tmp_path, **args):
    """``config``'s cameras (``video.sources``) running in a thread: the ``CameraSet`` once every camera has started
    (its lines in ``tmp_path/out.txt``); stopped on the way out."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet

    cameras = CameraSet(config, daemon_args(**args), out=open(tmp_path / "out.txt", "w"))
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    try:
        assert cameras.ready.wait(180)
        yield cameras
    finally:
        cameras.stop.event.set()
        thread.join(120)
