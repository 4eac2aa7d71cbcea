"""``OpenCVSource.seek``: a paused or restarted recorded file resumes at its point without grabbing through every
frame before it, and hands out exactly the frames (pixels and timestamps) a frame-by-frame read gives from there."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pytest

from edgekv.video.sources import EndOfStream, OpenCVSource, ResumedSource, open_source

OPENCV_DATA = Path("/usr/share/doc/opencv-doc/examples/data")


def _clip(path: Path, fourcc: str, frames: int = 120, fps: float = 10.0) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*fourcc), fps, (96, 64))
    assert writer.isOpened(), f"OpenCV cannot write {fourcc} here"
    for index in range(frames):
        frame = np.full((64, 96, 3), (index * 2) % 256, np.uint8)
        cv2.putText(frame, str(index), (5, 40), cv2.FONT_HERSHEY_SIMPLEX, 1, (255, 255, 255), 2)
        writer.write(frame)
    writer.release()
    return path


def _frame_by_frame(path: Path) -> list[tuple[float, np.ndarray]]:
    source = open_source(str(path))
    frames = []
    try:
        while True:
            t = source.grab()
            frames.append((t, source.retrieve()))
    except EndOfStream:
        pass
    finally:
        source.close()
    return frames


def _video(request, tmp_path) -> Path:
    name = request.param
    if name.endswith(".avi") and name.startswith("opencv-doc:"):
        path = OPENCV_DATA / name.removeprefix("opencv-doc:")
        if not path.is_file():
            pytest.skip(f"{path} is missing: install Debian's opencv-doc package (apt-get install -y opencv-doc)")
        return path
    fourcc, ext = name.split(".")
    return _clip(tmp_path / f"clip.{ext}", fourcc)


@pytest.fixture(params=["MJPG.avi", "mp4v.mp4", "opencv-doc:vtest.avi", "opencv-doc:tree.avi"])
def video(request, tmp_path) -> Path:
    """Clips written here (MJPG: every frame a keyframe; MPEG-4 part 2 in MP4: a keyframe every 12 frames) and
    OpenCV's samples (tree.avi: AVI drop entries, timestamps with gaps)."""
    return _video(request, tmp_path)


class _Grabs:
    """Counts the frames the source grabs (through ``OpenCVSource.grab``)."""

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        original = OpenCVSource.grab

        def counted(source):
            self.count += 1
            return original(source)

        monkeypatch.setattr(OpenCVSource, "grab", counted)


def _resumed(path: Path, t: float, frames: int = 3) -> list:
    source = ResumedSource(open_source(str(path)), t)
    got: list = []
    try:
        for _ in range(frames):
            got.append(source.read()[::-1])
    except EndOfStream:
        got.append("end")
    finally:
        source.close()
    return got


def _expected(reference: list, t: float, frames: int = 3) -> list:
    start = next((i for i, (stamp, _) in enumerate(reference) if stamp >= t - ResumedSource.EPSILON), len(reference))
    want = reference[start:start + frames]
    return want + (["end"] if len(want) < frames else [])


def _same(got: list, want: list) -> bool:
    return len(got) == len(want) and all(
        g == w if isinstance(w, str) else not isinstance(g, str) and g[0] == w[0] and np.array_equal(g[1], w[1])
        for g, w in zip(got, want))


def test_resuming_a_file_seeks_and_gives_the_frames_a_frame_by_frame_read_gives(video, monkeypatch):
    reference = _frame_by_frame(video)
    stamps = [t for t, _ in reference]
    points = [0.0, 0.05, 0.1, 0.35, 1.25, 3.33, stamps[len(stamps) // 2], stamps[-3] + 0.01, stamps[-1],
              stamps[-1] + 0.01, stamps[-1] + 60.0]
    grabs = _Grabs(monkeypatch)
    for t in points:
        grabs.count = 0
        got = _resumed(video, t)
        assert _same(got, _expected(reference, t)), f"{video.name} resumed at t={t}"
        if t == stamps[-1]:  # the last frame reached without grabbing through the file
            assert grabs.count < 16 < len(stamps), f"{video.name}: {grabs.count} grabs to reach its end"


class _Overshooting:
    """A capture whose demuxer lands ``late_s`` after the time asked (a keyframe past it), or cannot seek."""

    def __init__(self, capture, late_s: float | None) -> None:
        self.capture, self.late_s = capture, late_s

    def set(self, prop, value):
        if prop in (cv2.CAP_PROP_POS_MSEC, cv2.CAP_PROP_POS_FRAMES):
            if self.late_s is None:
                return False
            if prop == cv2.CAP_PROP_POS_MSEC:
                value += self.late_s * 1000.0
        return self.capture.set(prop, value)

    def __getattr__(self, name):
        return getattr(self.capture, name)


@pytest.mark.parametrize("late_s", [0.5, 3.0, 100.0, None], ids=["late", "later", "past-the-end", "no-seek"])
def test_a_seek_that_lands_after_the_point_or_not_at_all_loses_no_frame(tmp_path, late_s):
    path = _clip(tmp_path / "clip.mp4", "mp4v", frames=300)
    reference = _frame_by_frame(path)
    for t in (2.0, 12.35, 25.0, 29.9):
        source = open_source(str(path))
        source.capture = _Overshooting(source.capture, late_s)
        resumed = ResumedSource(source, t)
        got = [resumed.read()[::-1] for _ in range(min(3, 300 - round(t * 10)))]
        resumed.close()
        assert _same(got, _expected(reference, t, len(got))), f"resumed at t={t}, the demuxer {late_s} s late"


def test_seek_moves_back_and_forth_and_is_refused_for_a_live_source(tmp_path):
    path = _clip(tmp_path / "clip.avi", "MJPG")
    reference = _frame_by_frame(path)
    source = open_source(str(path))
    try:
        for t in (8.0, 2.0, 2.0, 11.9):
            source.seek(t)
            frame, stamp = source.read()
            want = _expected(reference, t, 1)[0]
            assert stamp == want[0] and np.array_equal(frame, want[1])
        source.seek(12.5)  # past the end: the file ends
        with pytest.raises(EndOfStream):
            source.read()
        with pytest.raises(ValueError, match="cannot seek to t=nan"):
            source.seek(float("nan"))
    finally:
        source.close()
    live = OpenCVSource.__new__(OpenCVSource)
    live.spec, live.live = "/dev/video0", True
    with pytest.raises(ValueError, match="'/dev/video0' is live: it cannot seek"):
        live.seek(1.0)
