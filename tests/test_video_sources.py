"""Frame sources, the capture thread and the sampler.

Real-file tests use the sample videos of Debian's ``opencv-doc`` package (``apt-get install
opencv-doc``); they are skipped, saying so, where it is not installed. Reconnects, drops and corrupt
frames are driven by fake sources whose every frame is controlled by the test.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgekv.video import sources as sources_module
from edgekv.video.capture import Backoff, CaptureThread, Sampler
from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    FrameSource,
    NeedleSource,
    SourceLost,
    SourceUnavailable,
    TimestampSelector,
    csi_pipeline,
    frame_problem,
    iter_frames,
    open_source,
    opencv_has_gstreamer,
    parse_spec,
)

OPENCV_DATA = Path("/usr/share/doc/opencv-doc/examples/data")


def _sample_video(name: str) -> Path:
    path = OPENCV_DATA / name
    if not path.is_file():
        pytest.skip(f"{path} is missing: install Debian's opencv-doc package (apt-get install -y opencv-doc)")
    return path


def _wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.001)


# ---------------------------------------------------------------------------------------------- fakes
def _numbered(index: int) -> np.ndarray:
    """A frame that says which one it is."""
    return np.full((4, 6, 3), index % 256, dtype=np.uint8)


class ScriptedLiveSource(FrameSource):
    """A live camera that delivers ``fail_after`` frames, is then lost, refuses ``failed_reopens``
    reopen attempts, and delivers frames again after that (the numbering continues)."""

    def __init__(self, fail_after: int, failed_reopens: int, total: int | None = None) -> None:
        super().__init__("fake:camera", live=True)
        self.fail_after, self.failed_reopens, self.total = fail_after, failed_reopens, total
        self.index = 0
        self.lost = False
        self.reopen_calls = 0
        self.closed = 0

    def read(self):
        if self.lost:
            raise SourceLost("closed")
        if self.total is not None and self.index >= self.total:
            raise EndOfStream("eof")
        if self.index == self.fail_after and self.reopen_calls == 0:
            self.lost = True
            raise SourceLost("cable pulled")
        self.index += 1
        return _numbered(self.index), float(self.index)

    def reopen(self) -> None:
        self.reopen_calls += 1
        if self.reopen_calls <= self.failed_reopens:
            raise SourceUnavailable("still gone")
        self.lost = False

    def close(self) -> None:
        self.closed += 1


class GatedSource(FrameSource):
    """Delivers frame k only after the test released it: the test decides what the capture has read."""

    def __init__(self, live: bool = True) -> None:
        super().__init__("fake:gated", live=live)
        self.gate = threading.Semaphore(0)
        self.index = 0
        self.finish = threading.Event()

    def read(self):
        while not self.gate.acquire(timeout=0.005):
            if self.finish.is_set():
                raise EndOfStream("eof")
        self.index += 1
        return _numbered(self.index), self.index / 100.0


class FlakySource(FrameSource):
    """A recorded source where every third frame is corrupt, one has the wrong shape, then it ends."""

    def __init__(self, total: int = 12) -> None:
        super().__init__("fake:flaky", live=False)
        self.total, self.index = total, 0

    def read(self):
        if self.index >= self.total:
            raise EndOfStream("eof")
        self.index += 1
        if self.index % 3 == 0:
            raise CorruptFrame(f"frame {self.index} undecodable")
        if self.index == 5:
            raise CorruptFrame(frame_problem(np.zeros((4, 6), np.uint8)))
        return _numbered(self.index), self.index / 10.0


class ExplodingSource(FrameSource):
    def __init__(self) -> None:
        super().__init__("fake:exploding", live=False)
        self.index = 0

    def read(self):
        self.index += 1
        if self.index > 2:
            raise OSError("disk went away")
        return _numbered(self.index), self.index / 10.0


# ---------------------------------------------------------------------------------------------- specs
@pytest.mark.parametrize("spec,kind,target,live", [
    (0, "camera", 0, True),
    ("0", "camera", 0, True),
    (" 2 ", "camera", 2, True),
    ("rtsp://10.0.0.5:8554/cam", "stream", "rtsp://10.0.0.5:8554/cam", True),
    ("http://host/video.mjpg", "stream", "http://host/video.mjpg", True),
    ("gst:videotestsrc ! videoconvert ! appsink", "gstreamer", "videotestsrc ! videoconvert ! appsink", True),
    ("csi:1", "csi", 1, True),
    ("synthetic:shapes", "synthetic", "shapes", False),
    ("synthetic:needle?frames=1000&at=300&size=224x224", "synthetic", "needle", False),
])
def test_parse_spec_kinds(spec, kind, target, live):
    parsed = parse_spec(spec)
    assert (parsed.kind, parsed.target, parsed.live) == (kind, target, live)


def test_parse_spec_file(tmp_path):
    video = tmp_path / "clip.avi"
    video.write_bytes(b"x")
    for spec in (str(video), video, f"file://{video}"):
        parsed = parse_spec(spec)
        assert parsed.kind == "file" and parsed.target == str(video) and not parsed.live


def test_parse_spec_params():
    needle = parse_spec("synthetic:needle?frames=1000&at=300&size=224x160&noise=1.5")
    assert needle.params == {"frames": 1000, "at": 300, "size": (224, 160), "noise": 1.5}
    csi = parse_spec("csi:0?width=1280&height=720&fps=60&flip=2")
    assert csi.params == {"width": 1280, "height": 720, "fps": 60, "flip": 2}


@pytest.mark.parametrize("spec,message", [
    ("", "empty"),
    ("   ", "empty"),
    ("/no/such/clip.mp4", "no such video file"),
    ("/tmp", "a folder, not a video file"),
    ("ftp://host/clip.mp4", "unsupported URL scheme"),
    ("gst:", "needs a pipeline"),
    ("gst:videotestsrc ! autovideosink", "must end in 'appsink'"),
    ("csi:", "integer sensor id"),
    ("csi:left", "integer sensor id"),
    ("csi:0?iso=100", "unknown parameter 'iso'"),
    ("synthetic:", "unknown synthetic video ''"),
    ("synthetic:noise", "unknown synthetic video 'noise'"),
    ("synthetic:needle?bogus=1", "unknown parameter 'bogus'"),
    ("synthetic:needle?size=224", "bad value '224' for 'size'"),
    ("synthetic:needle?frames=-3", "bad value '-3' for 'frames'"),
    ("synthetic:shapes?fps=0", "bad value '0' for 'fps'"),
    ("synthetic:shapes?fps=", "bad value '' for 'fps'"),
    ("synthetic:shapes?fps", "key=value"),
    ("synthetic:shapes?fps=2&&", "key=value"),
    (-1, "camera index must be >= 0"),
    (True, "expected a camera index"),
    (2.5, "expected a string"),
    (None, "expected a string"),
])
def test_bad_specs_name_the_spec(spec, message):
    with pytest.raises(ValueError, match="video source") as info:
        open_source(spec)
    assert info.match(message)
    assert repr(spec) in str(info.value) or (isinstance(spec, str) and repr(spec.strip()) in str(info.value))


def test_needle_out_of_range_is_refused():
    with pytest.raises(ValueError, match="needs frames at=10 and 11"):
        open_source("synthetic:needle?frames=11&at=10")


# ---------------------------------------------------------------------------------------------- GStreamer / CSI
def test_csi_pipeline_string():
    assert csi_pipeline(0) == (
        "nvarguscamerasrc sensor-id=0 ! "
        "video/x-raw(memory:NVMM),width=1920,height=1080,framerate=30/1,format=NV12 ! "
        "nvvidconv flip-method=0 ! video/x-raw,width=1920,height=1080,format=BGRx ! "
        "videoconvert ! video/x-raw,format=BGR ! appsink drop=true max-buffers=1"
    )
    scaled = csi_pipeline(1, width=1280, height=720, fps=60, flip=2, out_width=640, out_height=360)
    assert scaled.startswith("nvarguscamerasrc sensor-id=1 ! ")
    assert "width=1280,height=720,framerate=60/1" in scaled
    assert "nvvidconv flip-method=2 ! video/x-raw,width=640,height=360,format=BGRx" in scaled
    assert scaled.endswith("! appsink drop=true max-buffers=1")


def test_gstreamer_build_detection(monkeypatch):
    detect = opencv_has_gstreamer.__wrapped__
    with_gst = "  Video I/O:\n    GStreamer:   YES (1.22.0)\n"
    monkeypatch.setattr(sources_module.cv2, "getBuildInformation", lambda: with_gst)
    assert detect() is True
    monkeypatch.setattr(sources_module.cv2, "getBuildInformation", lambda: "  Video I/O:\n    GStreamer:   NO\n")
    assert detect() is False


@pytest.mark.parametrize("spec", ["gst:videotestsrc ! videoconvert ! appsink", "csi:0"])
def test_gstreamer_sources_need_gstreamer_opencv(spec):
    if opencv_has_gstreamer():
        pytest.skip("this OpenCV has GStreamer; the refusal path cannot be exercised")
    with pytest.raises(SourceUnavailable, match=r"needs OpenCV built with GStreamer.*GStreamer: NO"):
        open_source(spec)


# ---------------------------------------------------------------------------------------------- synthetic
def test_synthetic_shapes_deterministic_and_moving():
    spec = "synthetic:shapes?size=160x120&fps=5&frames=6&seed=3"
    first, second = list(open_source(spec)), list(open_source(spec))
    assert [t for _, t in first] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(first, second))
    frame = first[0][0]
    assert frame.shape == (120, 160, 3) and frame.dtype == np.uint8
    assert not np.array_equal(first[0][0], first[1][0])  # the shapes move
    other_seed = next(iter(open_source("synthetic:shapes?size=160x120&seed=4")))[0]
    assert not np.array_equal(frame, other_seed)


def test_synthetic_needle_only_in_its_pair():
    source = open_source("synthetic:needle?frames=20&at=6&size=64x48")
    assert isinstance(source, NeedleSource) and source.needle_frames == (6, 7)
    frames = [frame for frame, _ in source]
    assert len(frames) == 20 and frames[0].shape == (48, 64, 3)
    changed = [i for i, frame in enumerate(frames) if not np.array_equal(frame, frames[0])]
    assert changed == [6, 7]
    assert np.array_equal(frames[6], frames[7])
    # the needle is a distinct object: pure red pixels that the textured background never has
    red = (frames[6][..., 2] == 255) & (frames[6][..., :2] == 0).all(axis=-1)
    assert red.sum() > 20 and not ((frames[0][..., 2] == 255) & (frames[0][..., :2] == 0).all(axis=-1)).any()


def test_synthetic_needle_noise_is_deterministic():
    spec = "synthetic:needle?frames=4&at=2&size=32x32&noise=3"
    a, b = [f for f, _ in open_source(spec)], [f for f, _ in open_source(spec)]
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], a[1])  # sensor grain differs frame to frame


# ---------------------------------------------------------------------------------------------- timestamp sampling
def test_timestamp_selector_picks_first_frame_at_each_tick():
    selector = TimestampSelector(2.0)
    times = [i * 0.04 for i in range(60)]  # 25 fps; 0.04 * 25 is not exactly 1.0 in floating point
    picked = [t for t in times if selector.accept(t)]
    assert picked == pytest.approx([0.0, 0.52, 1.0, 1.52, 2.0])
    slow = TimestampSelector(10.0)  # source slower than the target: every frame, none twice
    assert [slow.accept(t) for t in (0.0, 0.5, 1.0, 1.05, 1.1)] == [True, True, True, False, True]
    with pytest.raises(ValueError, match="fps must be a positive number"):
        TimestampSelector(0)


def test_iter_frames_max_frames_and_fps():
    frames = list(iter_frames("synthetic:shapes?fps=10&size=64x48", max_frames=4, fps=2.5))
    assert [t for _, t in frames] == pytest.approx([0.0, 0.4, 0.8, 1.2])
    assert list(iter_frames("synthetic:shapes?size=64x48", max_frames=0)) == []
    with pytest.raises(ValueError, match="is live"):
        list(iter_frames(ScriptedLiveSource(5, 0)))


# ---------------------------------------------------------------------------------------------- real files
def test_file_source_uses_container_timestamps():
    video = _sample_video("vtest.avi")
    source = open_source(str(video))
    assert not source.live and source.fps == pytest.approx(10.0)
    frames = [next(iter(source)) for _ in range(4)]
    source.close()
    assert [t for _, t in frames] == pytest.approx([0.0, 0.1, 0.2, 0.3])
    assert frames[0][0].shape == (576, 768, 3) and frames[0][0].dtype == np.uint8
    sampled = [t for _, t in iter_frames(str(video), max_frames=5, fps=2)]
    assert sampled == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])


def test_file_with_dropped_frame_entries_ends_as_eof():
    """tree.avi declares 444 frames but stores 68 (the rest are AVI drop entries): timestamps jump,
    never go back, and the end is "eof", not "truncated"."""
    capture = CaptureThread(str(_sample_video("tree.avi")), lossless=True).start()
    times = []
    while (item := capture.get(timeout=5)) is not None:
        times.append(item[1])
    stats = capture.stats()
    assert stats["ended"] == "eof" and stats["frames_read"] == len(times) == 68
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times[1] - times[0] > 0.5  # a real gap, taken from the container, not index / fps


def test_truncated_file_ends_cleanly_with_counts(tmp_path):
    """The first quarter of vtest.avi: the header still promises 795 frames; reading stops early,
    the thread ends by itself with "truncated" and the counts, and nothing is raised."""
    data = _sample_video("vtest.avi").read_bytes()
    truncated = tmp_path / "vtest_truncated.avi"
    truncated.write_bytes(data[: len(data) // 4])

    capture = CaptureThread(str(truncated), lossless=True).start()
    got = 0
    while capture.get(timeout=5) is not None:
        got += 1
    stats = capture.stats()
    assert stats["ended"] == "truncated" and not stats["running"]
    assert 0 < got == stats["frames_read"] < 795
    assert "of 795 declared" in stats["last_error"]

    latest = CaptureThread(str(truncated), pace=False).start()  # latest-frame mode ends the same way
    _wait_until(lambda: latest.finished)
    assert latest.stats()["ended"] == "truncated" and latest.stats()["frames_read"] == got


def test_unopenable_file_is_refused(tmp_path):
    broken = tmp_path / "header_only.avi"
    broken.write_bytes(_sample_video("vtest.avi").read_bytes()[:2000])
    with pytest.raises(SourceUnavailable, match="header_only.avi.*could not open"):
        open_source(str(broken))


# ---------------------------------------------------------------------------------------------- capture thread
def test_backoff_delays():
    backoff = Backoff(base_s=1.0, max_s=8.0, jitter=0.0)
    rng = random.Random(0)
    assert [backoff.delay(k, rng) for k in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    jittered = Backoff(base_s=1.0, max_s=8.0, jitter=0.5)
    delays = [jittered.delay(2, random.Random(seed)) for seed in range(50)]
    assert all(2.0 <= d <= 4.0 for d in delays) and len(set(delays)) > 40
    assert jittered.delay(1000, random.Random(0)) <= 8.0
    for kwargs in ({"base_s": 0}, {"base_s": 2, "max_s": 1}, {"jitter": 1.5}, {"max_attempts": 0}):
        with pytest.raises(ValueError, match="backoff"):
            Backoff(**kwargs)


def test_lost_camera_reconnects_with_backoff():
    source = ScriptedLiveSource(fail_after=3, failed_reopens=2, total=8)
    backoff = Backoff(base_s=0.002, max_s=0.004, jitter=0.5)
    capture = CaptureThread(source, backoff=backoff, seed=7).start()
    _wait_until(lambda: capture.finished)
    stats = capture.stats()
    assert stats["frames_read"] == 8 and stats["ended"] == "eof"
    assert stats["reconnects"] == 1
    assert stats["reconnect_attempts"] == 3 and stats["reconnect_failures"] == 2
    # three waits of 2, 4, 4 ms nominal, each shortened by at most half
    assert 0.005 <= stats["backoff_s_total"] <= 0.010
    assert "still gone" in stats["last_error"]
    assert source.reopen_calls == 3
    frame, t, number = capture.latest(timeout=1)  # frames after the reconnect arrived
    assert number == 8 and frame[0, 0, 0] == 8 and t == 8.0


def test_reconnect_gives_up_after_max_attempts():
    source = ScriptedLiveSource(fail_after=1, failed_reopens=10**9)
    capture = CaptureThread(source, backoff=Backoff(base_s=0.001, max_s=0.001, max_attempts=4)).start()
    _wait_until(lambda: capture.finished)
    stats = capture.stats()
    assert stats["ended"] == "gave_up" and stats["reconnect_attempts"] == 4 and stats["reconnects"] == 0
    assert capture.latest(after=1, timeout=0.01) is None


def test_stop_is_prompt_even_during_backoff():
    source = ScriptedLiveSource(fail_after=0, failed_reopens=10**9)
    capture = CaptureThread(source, backoff=Backoff(base_s=30.0, max_s=60.0)).start()
    _wait_until(lambda: capture.stats()["backoff_s_total"] > 0)
    started = time.monotonic()
    assert capture.stop(timeout=2.0) is True
    assert time.monotonic() - started < 0.5
    assert capture.stats()["ended"] == "stopped" and source.closed >= 1


def test_latest_frame_wins_and_counts_drops():
    source = GatedSource()
    capture = CaptureThread(source).start()
    for _ in range(5):
        source.gate.release()
    _wait_until(lambda: capture.stats()["frames_read"] == 5)
    frame, t, number = capture.latest(timeout=1)
    assert number == 5 and frame[0, 0, 0] == 5 and t == pytest.approx(0.05)
    assert capture.stats()["frames_dropped"] == 4  # frames 1-4 were overwritten unseen
    assert capture.latest(after=number, timeout=0.02) is None  # nothing newer yet: no repeat
    source.gate.release()
    assert capture.latest(after=number, timeout=1)[2] == 6
    source.finish.set()
    assert capture.stop() is True
    stats = capture.stats()
    assert (stats["frames_read"], stats["frames_consumed"], stats["frames_dropped"]) == (6, 2, 4)


def test_slow_consumer_never_blocks_capture():
    capture = CaptureThread("synthetic:shapes?size=64x48", pace=False).start()
    sampler = Sampler(capture, fps=1000.0)
    times = []
    for _ in range(4):
        frame, t = sampler.next_frame(timeout=2)
        times.append(t)
        time.sleep(0.03)  # a model far slower than the camera
    read = capture.stats()["frames_read"]
    capture.stop()
    stats = sampler.stats()
    assert stats["frames_sampled"] == 4 and stats["frames_dropped"] > 0
    assert read > 4 * 10  # the capture kept reading while the consumer slept
    assert all(b - a > 0.1 for a, b in zip(times, times[1:]))  # each sample is many frames later


def test_sampler_keeps_the_target_rate():
    sampler = Sampler.open("synthetic:shapes?size=64x48", fps=50.0, pace=False)
    started = time.monotonic()
    got = [sampler.next_frame(timeout=2) for _ in range(6)]
    elapsed = time.monotonic() - started
    sampler.close()
    assert all(item is not None for item in got)
    assert elapsed >= 5 * 0.02 - 0.005  # five periods between six samples
    assert len({t for _, t in got}) == 6


def test_sampler_timeout_and_end():
    source = GatedSource(live=True)
    sampler = Sampler(CaptureThread(source).start(), fps=100.0)
    assert sampler.next_frame(timeout=0.02) is None and not sampler.exhausted
    source.gate.release()
    assert sampler.next_frame(timeout=1) is not None
    source.finish.set()
    _wait_until(lambda: sampler.capture.finished)
    assert sampler.next_frame(timeout=0.05) is None and sampler.exhausted
    assert sampler.stats()["ended"] == "eof"


def test_paced_playback_follows_the_source_clock():
    capture = CaptureThread("synthetic:shapes?size=32x32&fps=100&frames=11").start()
    assert capture.pace  # a recorded source standing in for a camera plays at its own speed
    started = time.monotonic()
    _wait_until(lambda: capture.finished)
    assert time.monotonic() - started >= 0.1 - 0.01


@pytest.mark.parametrize("lossless", [True, False])
def test_corrupt_frames_are_skipped_and_counted(lossless):
    capture = CaptureThread(FlakySource(total=12), lossless=lossless, pace=False).start()
    if lossless:
        indices = []
        while (item := capture.get(timeout=2)) is not None:
            indices.append(int(item[0][0, 0, 0]))
        assert indices == [1, 2, 4, 7, 8, 10, 11]
    else:
        _wait_until(lambda: capture.finished)
    stats = capture.stats()
    assert stats["frames_corrupt"] == 5 and stats["frames_read"] == 7 and stats["ended"] == "eof"
    assert "frame 12 undecodable" in stats["last_error"]


def test_a_raising_backend_ends_the_thread_not_the_process():
    capture = CaptureThread(ExplodingSource(), lossless=True).start()
    assert capture.get(timeout=2) is not None and capture.get(timeout=2) is not None
    assert capture.get(timeout=2) is None
    stats = capture.stats()
    assert stats["ended"] == "error" and "OSError: disk went away" in stats["last_error"]


def test_frame_problem_names_shape_and_dtype():
    assert frame_problem(np.zeros((4, 6, 3), np.uint8)) is None
    assert "shape (4, 6, 4)" in frame_problem(np.zeros((4, 6, 4), np.uint8))
    assert "dtype uint16" in frame_problem(np.zeros((4, 6, 3), np.uint16))
    assert "NoneType" in frame_problem(None)


# ---------------------------------------------------------------------------------------------- deterministic mode
def test_deterministic_sampling_is_reproducible():
    spec = "synthetic:shapes?size=64x48&fps=10&frames=40"
    runs = []
    for _ in range(2):
        sampler = Sampler.open(spec, fps=3.0, deterministic=True, queue_size=2)
        assert sampler.deterministic
        runs.append(list(sampler))
        assert sampler.exhausted and sampler.stats()["frames_dropped"] == 0
    reference = list(iter_frames(spec, fps=3.0))
    for run in runs:
        assert [t for _, t in run] == [t for _, t in reference] == pytest.approx([0.0, 0.4, 0.7, 1.0, 1.4, 1.7, 2.0,
                                                                                  2.4, 2.7, 3.0, 3.4, 3.7])
        assert all(np.array_equal(a, b) for (a, _), (b, _) in zip(run, reference))


def test_deterministic_mode_refuses_live_sources():
    with pytest.raises(ValueError, match="is live: it cannot be read losslessly"):
        CaptureThread(ScriptedLiveSource(3, 0), lossless=True)


# ---------------------------------------------------------------------------------------------- loop, reconnect state
def test_looping_source_plays_again_with_time_running_on():
    from edgekv.video.sources import LoopingSource

    spec = "synthetic:shapes?size=32x24&fps=4&frames=3"
    source = LoopingSource(open_source(spec), lambda: open_source(spec))
    frames = [source.read() for _ in range(8)]
    times = [t for _, t in frames]
    assert times == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75])  # one step between passes
    assert np.array_equal(frames[0][0], frames[3][0]) and np.array_equal(frames[2][0], frames[5][0])
    assert source.passes == 3 and not source.live


def test_looping_refuses_live_and_empty_sources():
    from edgekv.video.sources import LoopingSource

    with pytest.raises(ValueError, match="only a recorded source can loop"):
        LoopingSource(ScriptedLiveSource(fail_after=10, failed_reopens=0), lambda: None)
    empty = FlakySource(total=0)
    with pytest.raises(EndOfStream):
        LoopingSource(empty, lambda: FlakySource(total=0)).read()


def test_capture_says_when_it_is_reconnecting():
    source = ScriptedLiveSource(fail_after=2, failed_reopens=10**9)
    capture = CaptureThread(source, backoff=Backoff(base_s=0.01, max_s=0.02)).start()
    try:
        _wait_until(lambda: capture.reconnecting)
        assert capture.stats()["reconnecting"] is True and not capture.finished
        source.failed_reopens = 0  # the camera is back
        _wait_until(lambda: not capture.reconnecting)
        assert capture.stats()["reconnects"] == 1
    finally:
        capture.stop()


def test_a_camera_by_device_path_and_the_mode_asked_of_it(tmp_path, monkeypatch, caplog):
    """A V4L2 camera named by its device file (a udev by-id link keeps naming the same USB camera whatever order the
    bus enumerated them in; an index does not), and the mode asked of the driver: a USB webcam's 720p or 1080p at 30
    fps needs MJPG. Before, ``/dev/video0`` was refused as "no such video file" (a device is not a regular file)."""
    import logging

    from edgekv.video import sources

    link = tmp_path / "usb-Example_Cam-video-index0"
    link.symlink_to("/dev/null")  # a character device every machine has, standing in for /dev/video0
    parsed = parse_spec(f"{link}?width=1280&height=720&fps=30&fourcc=MJPG")
    assert parsed.kind == "camera" and parsed.target == str(link) and parsed.live
    assert parsed.params == {"width": 1280, "height": 720, "fps": 30.0, "fourcc": "MJPG"}
    assert parse_spec("2?fourcc=YUYV").params == {"fourcc": "YUYV"} and parse_spec("2?fourcc=YUYV").target == 2
    with pytest.raises(ValueError, match="no such camera device .*ls /dev/v4l/by-id/"):
        parse_spec("/dev/v4l/by-id/usb-not-plugged-video-index0")
    with pytest.raises(ValueError, match="'fourcc': expected four characters"):
        parse_spec("0?fourcc=MJ")
    with pytest.raises(ValueError, match="unknown parameter 'zoom'"):
        parse_spec("0?zoom=2")

    calls = []

    class Driver:  # a cv2.VideoCapture whose camera has 1280x720 but tops out at 15 fps
        def __init__(self, target, api):
            calls.append(("open", target, api))
            self.props = {sources.cv2.CAP_PROP_FRAME_WIDTH: 640.0, sources.cv2.CAP_PROP_FRAME_HEIGHT: 480.0,
                          sources.cv2.CAP_PROP_FPS: 30.0}

        def isOpened(self):
            return True

        def set(self, prop, value):
            calls.append(("set", prop, value))
            self.props[prop] = min(value, 15.0) if prop == sources.cv2.CAP_PROP_FPS else value
            return True

        def get(self, prop):
            return self.props.get(prop, 0.0)

        def release(self):
            pass

    monkeypatch.setattr(sources.cv2, "VideoCapture", Driver)
    with caplog.at_level(logging.WARNING, logger="edgekv.video"):
        source = open_source(f"{link}?width=1280&height=720&fps=30&fourcc=MJPG")
        source.reopen()
    cv2 = sources.cv2
    assert calls[0] == ("open", "/dev/null", cv2.CAP_V4L2)  # the link followed, the V4L2 backend asked for
    asked = [(prop, value) for kind, prop, value in calls[:6] if kind == "set"]
    assert asked == [(cv2.CAP_PROP_BUFFERSIZE, 1), (cv2.CAP_PROP_FOURCC, cv2.VideoWriter_fourcc(*"MJPG")),
                     (cv2.CAP_PROP_FRAME_WIDTH, 1280), (cv2.CAP_PROP_FRAME_HEIGHT, 720), (cv2.CAP_PROP_FPS, 30.0)]
    assert sum(kind == "open" for kind, *_ in calls) == 2 and len([c for c in calls if c[0] == "set"]) == 10
    said = [r.getMessage() for r in caplog.records if "the driver gave" in r.getMessage()]
    assert said == [f"video source '{link}?width=1280&height=720&fps=30&fourcc=MJPG': asked for fps 30.0, the driver "
                    "gave fps 15"]  # once, not at every reopen


def test_a_device_that_is_no_camera_is_refused_at_open():
    with pytest.raises(SourceUnavailable, match="could not open it"):
        open_source("/dev/null")


# ---------------------------------------------------------------------------------------------- decode what is taken
class GrabbedCamera(FrameSource):
    """A live camera whose frames the test releases one at a time, frame k coming at k/30 s on the test's clock;
    ``grab`` costs nothing, ``retrieve`` is the decoding, and which frames were decoded is kept."""

    grab_saves_decoding = True

    def __init__(self) -> None:
        super().__init__("fake:grabbed", live=True)
        self.gate = threading.Semaphore(0)
        self.now = 0.0
        self.index = -1
        self.grabs_started = 0
        self.decoded: list[int] = []
        self.finish = threading.Event()

    def read(self):
        t = self.grab()
        return self.retrieve(), t

    def grab(self) -> float:
        self.grabs_started += 1
        while not self.gate.acquire(timeout=0.005):
            if self.finish.is_set():
                raise EndOfStream("eof")
        self.index += 1
        self.now = self.index / 30.0
        return self.now

    def retrieve(self) -> np.ndarray:
        self.decoded.append(self.index)
        return _numbered(self.index)

    def release(self, frames: int = 1) -> None:
        """Let ``frames`` frames through and wait until the capture came back for the next (they were handled)."""
        target = self.grabs_started + frames
        for _ in range(frames):
            self.gate.release()
        _wait_until(lambda: self.grabs_started >= target, timeout=60)


def test_a_grabbed_frame_is_decoded_only_near_the_consumers_tick():
    """30 frames a second, the consumer's next tick at 5.01 s: frame 0 is decoded (the frame rate is not known yet),
    then only frames from two frame intervals before the tick (149/30 = 4.967 >= 5.01 - 2/30; 148 is not)."""
    camera = GrabbedCamera()
    capture = CaptureThread(camera, clock=lambda: camera.now)
    assert capture.two_phase
    capture.want_from(5.01)
    capture.start()
    camera.release(180)
    stats = capture.stats()
    assert camera.decoded == [0, *range(149, 180)]
    assert (stats["frames_read"], stats["frames_decoded"], stats["decodes"]) == (180, 32, "wanted")
    assert stats["frames_dropped"] == 180 - 1  # every frame but the newest was never handed out
    item = capture.latest(after=0, timeout=0)
    assert item is not None and item[0][0, 0, 0] == 179 and item[1] == pytest.approx(179 / 30)
    camera.finish.set()
    capture.stop()


def test_a_waiting_consumer_gets_the_next_frame_decoded():
    """Before its tick a consumer that asks waits, and the frame that comes next is decoded for it (a late camera,
    a tick the rate estimate missed): it never waits for a frame the capture chose not to decode."""
    camera = GrabbedCamera()
    capture = CaptureThread(camera, clock=lambda: camera.now)
    capture.want_from(100.0)
    capture.start()
    camera.release(10)
    assert camera.decoded == [0]
    got: list = []
    consumer = threading.Thread(target=lambda: got.append(capture.latest(after=1, timeout=30)))
    consumer.start()
    _wait_until(lambda: capture._waiting == 1, timeout=60)
    camera.release()
    consumer.join(30)
    assert camera.decoded == [0, 10]
    assert got[0][0][0, 0, 0] == 10 and got[0][2] == 2  # the second frame published
    camera.finish.set()
    capture.stop()


def test_every_frame_is_decoded_when_asked_or_when_grabbing_saves_nothing():
    camera = GrabbedCamera()
    capture = CaptureThread(camera, clock=lambda: camera.now, decode_all=True).start()
    capture.want_from(100.0)
    camera.release(5)
    assert camera.decoded == [0, 1, 2, 3, 4] and capture.stats()["decodes"] == "every"
    camera.finish.set()
    capture.stop()
    plain = CaptureThread(GatedSource())  # read() only: nothing to save
    assert not plain.two_phase and plain.stats()["decodes"] == "every"


def test_the_sampler_tells_the_capture_its_next_tick():
    camera = GrabbedCamera()
    sampler = Sampler(CaptureThread(camera).start(), fps=0.5)
    camera.release()
    before = time.monotonic()
    assert sampler.next_frame(timeout=30) is not None
    assert sampler.capture._want_from == sampler._next_tick >= before + 2.0  # a period after the frame was taken
    camera.finish.set()
    sampler.close()


def _counting_video(path: Path, frames: int, fps: float) -> Path:
    """An MJPEG AVI whose frame k is flat grey at level 4k: a decoded frame says which one it is."""
    import cv2

    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), fps, (64, 48))
    assert writer.isOpened()
    for k in range(frames):
        writer.write(np.full((48, 64, 3), 4 * k, np.uint8))
    writer.release()
    return path


def test_opencv_grab_and_retrieve_are_the_frames_read_gives(tmp_path):
    path = _counting_video(tmp_path / "count.avi", 20, 10.0)
    source = open_source(str(path))
    assert source.grab_saves_decoding
    times = [source.grab() for _ in range(5)]  # four never decoded
    frame = source.retrieve()
    assert times == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    assert abs(float(frame.mean()) - 16) < 3 and frame.shape == (48, 64, 3)
    with pytest.raises(RuntimeError, match="without a grab"):
        FrameSource.retrieve(source)  # the base class's own: nothing held
    frame_t = source.read()  # read after grab goes on from there
    assert frame_t[1] == pytest.approx(0.5) and abs(float(frame_t[0].mean()) - 20) < 3
    source.close()


def test_a_looping_file_grabs_across_its_end(tmp_path):
    from edgekv.video.sources import LoopingSource

    path = str(_counting_video(tmp_path / "count.avi", 3, 4.0))
    source = LoopingSource(open_source(path), lambda: open_source(path))
    assert source.grab_saves_decoding
    times = [source.grab() for _ in range(5)]
    assert times == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0]) and source.passes == 2
    assert abs(float(source.retrieve().mean()) - 4) < 3  # the second pass's frame 1
    source.close()


def test_a_paced_file_sampled_by_wanted_frames_hands_out_the_right_pictures(tmp_path):
    """A file standing in for a camera (paced at 50 fps), sampled at 5 fps: each frame handed out is the file's
    frame at its timestamp, though most frames were never decoded."""
    path = _counting_video(tmp_path / "count.avi", 60, 50.0)
    sampler = Sampler.open(str(path), fps=5.0)
    assert sampler.capture.two_phase and not sampler.deterministic
    got = list(sampler)
    assert got  # about six at these rates; how many depends on this thread's timing, which is not what is tested
    for frame, t in got:
        assert abs(float(frame.mean()) - 4 * round(t * 50)) < 3, t
    stats = sampler.stats()
    assert stats["ended"] == "eof" and stats["frames_read"] == 60 and stats["frames_decoded"] >= len(got)


def test_a_frame_that_does_not_decode_when_retrieved_is_counted_and_the_next_is_handed_out():
    """A grabbed frame whose pixels do not decode (a garbage JPEG from a V4L2 camera: the decode happens in
    ``retrieve``) is skipped and counted as corrupt, as a failed read is; a consumer waiting gets the next one."""

    class Garbled(GrabbedCamera):
        def retrieve(self):
            if self.index == 3:
                raise CorruptFrame("fake:grabbed: frame 3 is not a JPEG")
            return super().retrieve()

    camera = Garbled()
    capture = CaptureThread(camera, clock=lambda: camera.now)
    capture.start()
    camera.release(3)  # frames 0-2 decoded (no tick said yet)
    got: list = []
    consumer = threading.Thread(target=lambda: got.append(capture.latest(after=3, timeout=30)))
    consumer.start()
    _wait_until(lambda: capture._waiting == 1, timeout=60)
    camera.release(2)  # frame 3 fails to decode, frame 4 is handed out
    consumer.join(30)
    stats = capture.stats()
    assert got[0][0][0, 0, 0] == 4 and stats["frames_corrupt"] == 1 and "frame 3 is not a JPEG" in stats["last_error"]
    assert camera.decoded == [0, 1, 2, 4] and stats["frames_decoded"] == 4
    camera.finish.set()
    capture.stop()
