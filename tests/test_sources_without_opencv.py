"""The wheel with no extras: what needs no decoder (the synthetic: videos, the capture thread and sampler) runs
without OpenCV, and what needs it (files, cameras, streams) says which extra to install. OpenCV is hidden in this
process (``sys.modules["cv2"] = None``) and edgekv.video imported afresh; nothing is installed or removed."""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

from edgekv.video import ros_images as installed_ros_images
from edgekv.video import sources as installed_sources


@pytest.fixture
def without_opencv(monkeypatch):
    """``edgekv.video.sources`` imported as on a machine without OpenCV; the real modules back afterwards."""
    import edgekv

    before = {name for name in sys.modules
              if name in ("edgekv.video", "edgekv.images") or name.startswith("edgekv.video.")}
    monkeypatch.setitem(sys.modules, "cv2", None)  # `import cv2` raises ModuleNotFoundError
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(edgekv, "video", sys.modules.get("edgekv.video", getattr(edgekv, "video", None)),
                        raising=False)
    try:
        yield importlib.import_module("edgekv.video.sources")
    finally:  # the fresh modules go; monkeypatch puts the real ones back
        for name in [n for n in sys.modules
                     if n in ("edgekv.video", "edgekv.images") or n.startswith("edgekv.video.")]:
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


def test_ros2_images_need_no_opencv_but_for_bayer_and_yuv(without_opencv):
    """A ROS 2 camera's frames without the ``video`` extra: bgr8 / rgb8 / alpha / mono (8 and 16 bit) and a
    CompressedImage JPEG or PNG come out as the pixels they do with OpenCV; a Bayer or YUV image, which needs
    OpenCV's conversion, is refused naming the extra (no frame of such a camera can be read)."""
    pytest.importorskip("rosbags", reason="rosbags is not installed (pip install 'edgekv[ros2]')")
    cv2, with_opencv = installed_sources.cv2, installed_ros_images  # imported before the fixture hid OpenCV

    ros_images = importlib.import_module("edgekv.video.ros_images")
    assert ros_images is not with_opencv and not without_opencv.has_opencv()
    frame, _ = next(iter(without_opencv.iter_frames("synthetic:events?size=112x112&fps=2&frames=2&seed=2")))
    store = ros_images.typestore()
    header = store.types["std_msgs/msg/Header"](stamp=store.types["builtin_interfaces/msg/Time"](sec=1, nanosec=0),
                                                frame_id="cam")

    def image(data: np.ndarray, encoding: str):
        data = np.ascontiguousarray(data)
        return store.types[ros_images.IMAGE](header=header, height=data.shape[0], width=data.shape[1],
                                             encoding=encoding, is_bigendian=0, step=data.strides[0],
                                             data=data.reshape(-1).view(np.uint8))

    alpha = np.full(frame.shape[:2] + (1,), 9, np.uint8)
    grey = frame[:, :, 1]
    cases = {"bgr8": frame, "rgb8": frame[:, :, ::-1], "bgra8": np.concatenate([frame, alpha], 2),
             "rgba8": np.concatenate([frame[:, :, ::-1], alpha], 2), "mono8": grey,
             "mono16": (grey.astype(np.uint16) << 8) | 0x55}
    for encoding, data in cases.items():
        got = ros_images.frame_from_message(image(data, encoding), ros_images.IMAGE)
        want = with_opencv.frame_from_message(image(data, encoding), with_opencv.IMAGE)
        assert got.shape == (112, 112, 3) and np.array_equal(got, want), encoding
    for fmt, ext in (("jpeg", ".jpg"), ("png", ".png")):
        data = np.frombuffer(cv2.imencode(ext, frame)[1].tobytes(), np.uint8)
        message = store.types[ros_images.COMPRESSED](header=header, format=fmt, data=data)
        got = ros_images.frame_from_message(message, ros_images.COMPRESSED)
        assert np.array_equal(got, with_opencv.frame_from_message(message, with_opencv.COMPRESSED)), fmt
    with pytest.raises(without_opencv.SourceUnavailable, match=r"bayer_rggb8 images are converted to colour by "
                                                               r"OpenCV.*pip install 'edgekv\[video\]'"):
        ros_images.frame_from_message(image(grey, "bayer_rggb8"), ros_images.IMAGE)
