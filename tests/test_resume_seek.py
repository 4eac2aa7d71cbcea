"""Resuming a recorded source far into it (edgekv/video/sources.py ``ResumedSource``, ``LoopingSource.seek``;
edgekv/video/rosbag.py ``RosbagSource.grab``). Issue: a paused bag or loop was re-decoded frame by frame up to the
resume point (about 3 minutes per hour of a 30 fps bag), and a frame that did not decode just before the point
was skipped without being counted."""

from __future__ import annotations

import numpy as np
import pytest

from edgekv.video.capture import CaptureThread
from edgekv.video.sources import (
    CorruptFrame,
    EndOfStream,
    FrameSource,
    LoopingSource,
    ResumedSource,
    ShapesSource,
    open_source,
)

LOOP = "synthetic:shapes?size=32x32&fps=4&frames=8&seed=3"  # a pass of 2 s


def _sequential(spec: str, count: int) -> list:
    """The first ``count`` (frame, t) of a loop of ``spec`` read frame by frame, with the pass of each."""
    loop = LoopingSource(open_source(spec), lambda: open_source(spec))
    return [(*loop.read(), loop.passes) for _ in range(count)]


class Counted:
    """Counts the frames a synthetic video renders (the cost a resume pays)."""

    def __init__(self, monkeypatch) -> None:
        self.rendered = 0
        render = ShapesSource.render

        def counted(source, index):
            self.rendered += 1
            return render(source, index)

        monkeypatch.setattr(ShapesSource, "render", counted)


def test_a_loop_seeks_whole_passes_and_lands_where_reading_through_does(monkeypatch):
    played = _sequential(LOOP, 8 * 4 + 6)  # into the fifth pass, across its start
    counted = Counted(monkeypatch)
    resumed = ResumedSource(LoopingSource(open_source(LOOP), lambda: open_source(LOOP)), played[34][1])
    got = [resumed.read() for _ in range(4)]
    assert counted.rendered == 4 and resumed.skipped == 0  # nothing before the point was rendered
    assert [t for _, t in got] == pytest.approx([t for _, t, _ in played[34:38]], abs=1e-9)
    assert all(np.array_equal(frame, expected) for (frame, _), (expected, _, _) in zip(got, played[34:38]))
    assert resumed.source.passes == played[37][2] == 5


def test_a_loop_resumed_at_the_end_of_a_pass_goes_on_into_the_next_on_time():
    played = _sequential(LOOP, 8 * 3 + 2)
    resumed = ResumedSource(LoopingSource(open_source(LOOP), lambda: open_source(LOOP)), played[23][1])
    got = [resumed.read()[1] for _ in range(3)]  # the last frame of pass 3, then pass 4 from its start
    assert got == pytest.approx([t for _, t, _ in played[23:26]], abs=1e-9)
    assert resumed.source.passes == 4


class Unseekable(FrameSource):
    """A recorded source without ``seek`` (a file, a bag) that counts its grabs; ``corrupt`` frame indices raise
    ``CorruptFrame`` when read."""

    def __init__(self, spec: str = LOOP, corrupt: tuple[int, ...] = ()) -> None:
        super().__init__(spec, live=False)
        self.inner, self.corrupt, self.index, self.grabs = open_source(spec), corrupt, 0, 0

    def read(self):
        self.grabs += 1
        index, self.index = self.index, self.index + 1
        frame, t = self.inner.read()
        if index in self.corrupt:
            raise CorruptFrame(f"frame {index} does not decode")
        return frame, t


def test_a_loop_of_a_source_without_seek_is_grabbed_through_one_pass_then_skips_whole_passes():
    played = _sequential(LOOP, 8 * 50 + 3)
    opened: list[Unseekable] = []

    def reopen() -> Unseekable:
        opened.append(Unseekable())
        return opened[-1]

    resumed = ResumedSource(LoopingSource(reopen(), reopen), played[8 * 50 + 1][1])
    assert resumed.read()[1] == pytest.approx(played[8 * 50 + 1][1], abs=1e-9)
    assert resumed.read()[1] == pytest.approx(played[8 * 50 + 2][1], abs=1e-9)
    assert resumed.source.passes == 51 and len(opened) == 3  # the first pass, then the 51st opened once
    assert sum(source.grabs for source in opened) <= 2 * 8 + 3  # not 403: the first pass learns the period


def test_corrupt_frames_just_before_the_resume_point_are_counted_by_the_capture():
    """Frames 4 and 5 do not decode; frame 3 (t 0.75) is before the point t 1.5 (frame 6), so 1 (read before it)
    was passed over before the pause and 4, 5 are reported once, as a capture counts any corrupt frame."""
    resumed = ResumedSource(Unseekable(corrupt=(1, 4, 5)), 1.5)
    capture = CaptureThread(resumed, lossless=True).start()
    try:
        taken = []
        while True:
            item = capture.get(timeout=120)
            if item is None:
                break
            taken.append(item[1])
    finally:
        capture.stop()
    assert taken == [1.5, 1.75] and capture.stats()["frames_corrupt"] == 2
    assert "2 frame(s) just before the resume point t=1.5 s" in capture.stats()["last_error"]


def test_corrupt_frames_before_an_end_are_reported_before_it():
    resumed = ResumedSource(Unseekable(corrupt=(6, 7)), 1.6)
    with pytest.raises(CorruptFrame) as corrupt:
        resumed.grab()
    assert corrupt.value.count == 2
    with pytest.raises(EndOfStream):
        resumed.grab()
