"""The wheel with no extras: what needs no decoder (the synthetic: videos, the capture thread and sampler) runs
without OpenCV, and what needs it (files, cameras, streams) says which extra to install. OpenCV is hidden in this
process (``sys.modules["cv2"] = None``) and edgekv.video imported afresh; nothing is installed or removed."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

from edgekv.video import sources as installed_sources


@pytest.fixture
def without_opencv(monkeypatch):
    """``edgekv.video.sources`` imported as on a machine without OpenCV; the real modules back afterwards."""
    import edgekv

    before = {name for name in sys.modules if name == "edgekv.video" or name.startswith("edgekv.video.")}
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ModuleNotFoundError
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(edgekv, "video", sys.modules.get("edgekv.video", getattr(edgekv, "video", None)),
                        raising=False)
    try:
        yield importlib.import_module("edgekv.video.sources")
    finally:  # the fresh modules go; monkeypatch puts the real ones back
        for name in [n for n in sys.modules if n == "edgekv.video" or n.startswith("edgekv.video.")]:
            if name not in before:
                del sys.modules[name]


@pytest.mark.parametrize("spec", [
    "synthetic:shapes?size=64x48&frames=6",
    "synthetic:needle?size=64x64&frames=6&at=2",
    "synthetic:events?size=112x112&frames=6",
    "synthetic:world?size=112x112&frames=6&families=procedural",
])
def test_synthetic_videos_need_no_opencv(without_opencv, spec):
    sources = without_opencv
    assert not sources.has_opencv()
    frames = list(sources.iter_frames(spec))
    assert len(frames) == 6 and all(f.shape[2] == 3 and f.dtype == np.uint8 for f, _ in frames)
    with installed_sources.open_source(spec) as with_opencv:  # the same frames as with OpenCV installed
        assert all(np.array_equal(f, with_opencv.read()[0]) for f, _ in frames)


def test_the_capture_thread_and_sampler_run_without_opencv(without_opencv):
    capture = importlib.import_module("edgekv.video.capture")
    sampler = capture.Sampler.open("synthetic:events?size=112x112&fps=4&frames=8", 4.0, deterministic=True)
    try:
        taken = []
        while (frame_t := sampler.next_frame(timeout=60)) is not None:
            taken.append(frame_t[1])
        assert taken == [i / 4 for i in range(8)]
    finally:
        sampler.close()


@pytest.mark.parametrize("spec", ["clip", 0, "rtsp://camera.local/stream", "gst:videotestsrc ! appsink"])
def test_sources_read_by_opencv_name_the_extra(without_opencv, tmp_path, spec):
    sources = without_opencv
    if spec == "clip":
        spec = tmp_path / "clip.mp4"
        spec.write_bytes(b"\0" * 64)
    with pytest.raises(sources.SourceUnavailable, match=r"read with OpenCV, which is not installed here: "
                                                         r"pip install 'edgekv\[video\]'"):
        sources.open_source(spec)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'edgekv\[video\]'"):
        sources.cv2.VideoCapture  # noqa: B018 - what a module importing cv2 from here (ROS images) meets



def test_numpy_shapes_are_opencvs_pixel_for_pixel():
    """ShapesSource once drew with cv2; the numpy drawing must give the same frames (a benchmark on
    synthetic:shapes, a test's expected answer) for every centre inside the frame, as ShapesSource places them."""
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(0)
    for _ in range(3000):
        height, width, radius = int(rng.integers(5, 80)), int(rng.integers(5, 80)), int(rng.integers(1, 60))
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        for kind in ("circle", "square", "triangle"):
            ours, theirs = np.zeros((height, width, 3), np.uint8), np.zeros((height, width, 3), np.uint8)
            installed_sources._draw_shape(ours, kind, (x, y), radius, (10, 20, 30))
            if kind == "circle":
                cv2.circle(theirs, (x, y), radius, (10, 20, 30), thickness=-1)
            elif kind == "square":
                cv2.rectangle(theirs, (x - radius, y - radius), (x + radius, y + radius), (10, 20, 30), thickness=-1)
            else:
                corners = np.array([(x, y - radius), (x - radius, y + radius), (x + radius, y + radius)], np.int32)
                cv2.fillPoly(theirs, [corners], (10, 20, 30))
            assert np.array_equal(ours, theirs), (kind, height, width, radius, (x, y))


def test_the_daemons_start_quiets_native_stderr_without_opencv(monkeypatch):
    """The daemon's start wraps its first steps in ``quiet_native_stderr``, which imported OpenCV to lower its log
    level: without the extra, the daemon on a ``synthetic:`` video stopped there (ModuleNotFoundError)."""
    import os

    from edgekv.apps.daemon.startup import quiet_native_stderr

    monkeypatch.setitem(sys.modules, "cv2", None)
    with quiet_native_stderr():
        os.write(2, b"a native library's warning\n")  # into the temporary file, not the terminal
