"""``video.source`` values as users write them, probed at the daemon's door (``parse_spec``, ``open_source``,
``redact``, the capture thread): each mistake is one line naming the spec and what is wrong, and a camera's secret
never shows. Each test here failed before its fix (tests/test_video_sources.py holds the specs that always worked)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from edgekv.video.sources import open_source, parse_spec, redact  # noqa: E402


@pytest.mark.parametrize("given, secret", [
    ("rtsp://admin:my pass@10.0.0.5/live", "my pass"),  # a space in the password, written as the camera's UI shows it
    ("rtsp://admin:tab\tbed@10.0.0.5/live", "tab\tbed"),
    ("http://cam.local/video.mjpg?access_token=T0KEN5", "T0KEN5"),  # cloud and NVR streams: the name has a prefix
    ("http://cam.local/video.mjpg?channel=1&api_key=K3Y5&x=1", "K3Y5"),
    ("https://cam.local/live.mjpg?apikey=K3Y5", "K3Y5"),
    ("rtsp://10.0.0.5/live?x-auth-token=T0KEN5", "T0KEN5"),
])
def test_a_secret_in_the_source_is_hidden_whatever_its_spelling(given, secret):
    shown = redact(given)
    assert secret not in shown and "***" in shown, shown


@pytest.mark.parametrize("kept", [
    "rtsp://cam.local:8554/live stream",  # a path with a space, no user: nothing to hide
    "gst:rtspsrc location=rtsp://cam:554 ! decodebin ! appsink name=a@b",  # a pipeline's '!' is no password
    "http://cam.local/video.mjpg?monkey=1&keyframe=2",
])
def test_what_holds_no_secret_is_shown_as_it_is(kept):
    assert redact(kept) == kept


@pytest.mark.parametrize("typo", ["rtsp:/10.0.0.5/live", "http:/cam.local/video.mjpg", "RTSP:10.0.0.5/live"])
def test_a_url_with_a_slash_missing_is_named_a_malformed_url_not_a_missing_file(typo):
    """``rtsp:/host`` was refused as "no such video file", sending the user to look for a file."""
    with pytest.raises(ValueError, match="not a well-formed URL") as refused:
        parse_spec(typo)
    assert "no such video file" not in str(refused.value)


@pytest.mark.parametrize("empty", ["rtsp:///live", "rtsp://admin:s3cret@/live", "http://:8080/video.mjpg",
                                   "rtsp://?channel=1"])
def test_a_url_without_a_host_is_refused_at_start(empty):
    """``rtsp://${CAMERA_IP}/live`` with the variable unset: it parsed, and with ``video.wait_for_stream`` (the
    default) the daemon started and said "not reached yet" for ever instead of naming the mistake."""
    with pytest.raises(ValueError, match="no host in the URL") as refused:
        parse_spec(empty)
    assert "s3cret" not in str(refused.value)
    assert parse_spec("rtsp://[::1]:8554/live").kind == "stream"


def test_a_video_file_in_the_home_folder_is_found(tmp_path, monkeypatch):
    """``video.source: ~/clips/yard.avi``: the config keeps a ``~`` path as it is (it is absolute), and the file
    was then refused as "no such video file" (OpenCV does not expand ``~`` either)."""
    monkeypatch.setenv("HOME", str(tmp_path))
    clip = tmp_path / "yard.avi"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 10, (32, 24))
    for value in (0, 80, 160):
        writer.write(np.full((24, 32, 3), value, np.uint8))
    writer.release()
    spec = parse_spec("~/yard.avi")
    assert spec.kind == "file" and Path(spec.target) == clip and spec.raw == "~/yard.avi"
    with open_source("~/yard.avi") as source:
        assert [frame.shape for frame, _ in source] == [(24, 32, 3)] * 3


@pytest.mark.parametrize("size", ["100000x100000", "64000x48000", "1x9000000"])
def test_a_synthetic_video_too_large_to_make_is_refused_in_one_line(size):
    """``size=64000x48000`` (a zero too many): the background was computed before anything checked, a numpy
    MemoryError traceback and exit 1 (or minutes of swapping at 20000x20000) instead of a line naming the spec."""
    with pytest.raises(ValueError, match=rf"synthetic:shapes\?size={size}.*at most 8192"):
        open_source(f"synthetic:shapes?size={size}&frames=2")


def test_an_8k_synthetic_video_is_still_made():
    assert parse_spec("synthetic:shapes?size=7680x4320&frames=2").params["size"] == (7680, 4320)


def test_a_looped_file_gone_at_its_reopen_ends_the_stream_in_one_line(tmp_path, caplog):
    """``video.loop`` on a file deleted (or rotated away) while it played: the reopen's ``SourceUnavailable`` was
    logged with a traceback of thirty lines, as an unexpected crash of the backend would be."""
    from edgekv.video.capture import CaptureThread
    from edgekv.video.sources import LoopingSource

    clip = tmp_path / "loop.avi"
    writer = cv2.VideoWriter(str(clip), cv2.VideoWriter_fourcc(*"MJPG"), 10, (32, 24))
    for value in (0, 80, 160):
        writer.write(np.full((24, 32, 3), value, np.uint8))
    writer.release()
    spec = parse_spec(str(clip))
    first = open_source(spec)
    clip.unlink()  # the first pass is open already; the second cannot be
    capture = CaptureThread(LoopingSource(first, lambda: open_source(spec)), lossless=True).start()
    frames = []
    while (item := capture.get(timeout=30)) is not None:
        frames.append(item)
    stats = capture.stats()
    assert len(frames) == 3 and stats["ended"] == "error" and "could not open it" in stats["last_error"]
    said = [r for r in caplog.records if r.name == "edgekv.video" and "could not open it" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None
