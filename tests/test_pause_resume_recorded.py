"""A paused recording goes on where it stopped (issue: pause then resume replayed a file or synthetic: video from
its start while the stream clock ran on, so the model saw it twice and a --quiz ground truth no longer matched).
A live source goes on live; a recorded one from its next frame, on its own clock."""

from __future__ import annotations


import numpy as np
import pytest
from helpers_wait import until

from edgekv.video.sources import FrameSource, LoopingSource, ResumedSource, open_source, resume_after

EVENTS = "synthetic:events?size=112x112&fps=8&frames=100000&seed=2"


def test_a_synthetic_video_resumes_at_its_next_frame():
    resumed = resume_after(open_source(EVENTS), 3.625 + 0.25)
    frame, t = resumed.read()
    fresh = open_source(EVENTS)
    fresh.index = 31
    assert t == 3.875 and np.array_equal(frame, fresh.read()[0])
    assert resumed.read()[1] == 4.0 and resumed.skipped == 0  # seeked: nothing rendered before it


class Unseekable(FrameSource):
    """A recorded source without ``seek`` (as a file or a bag): the synthetic video it plays, frame by frame."""

    def __init__(self, spec: str) -> None:
        super().__init__(spec, live=False)
        self.inner = open_source(spec)

    def read(self):
        return self.inner.read()


def test_a_source_without_seek_is_grabbed_through_to_the_resume_point():
    """A file or bag has no cheap seek here: it is grabbed (pixels never retrieved) up to the point."""
    looping = LoopingSource(Unseekable("synthetic:shapes?size=32x32&fps=4&frames=8"),
                            lambda: Unseekable("synthetic:shapes?size=32x32&fps=4&frames=8"))
    resumed = ResumedSource(looping, 2.5)  # the second pass: the loop's time runs on
    assert resumed.grab() == 2.5 and resumed.skipped == 10
    assert np.array_equal(resumed.retrieve(), open_source("synthetic:shapes?size=32x32&fps=4").render(2))
    assert [resumed.read()[1] for _ in range(2)] == [2.75, 3.0]


def test_live_sources_go_on_live_and_nothing_in_resumes_from_the_start():
    source = open_source(EVENTS)
    assert resume_after(source, None) is source
    source.live = True  # a camera: there is nothing to resume
    assert resume_after(source, 3.0) is source
    with pytest.raises(ValueError, match="is live"):
        ResumedSource(source, 3.0)


def _config(tmp_path):
    from edgekv.config import EdgeKVConfig

    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": EVENTS, "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"port": 0}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2})


@pytest.mark.parametrize("realtime", [False, True], ids=["lossless", "realtime"])
def test_the_daemon_resumes_a_paused_recording_where_it_stopped(tmp_path, realtime):
    """Through the daemon: the frames after the resume are the recording's next ones (none seen twice), stamped
    on its own clock (the pause is no time in a recording), so the quiz's events seen are the ones shown.

    Read losslessly (the default for a recording), the sampler picks frames by their timestamps: the next six are
    exactly the next six ticks. With ``--realtime`` the recording stands in for a camera: played at its own pace,
    sampled by the wall clock, the newest frame at each tick; a frame published late (a loaded machine) leaves
    the tick the one before it (3.125 for 3.25, seen in a loaded full-suite run), so only what holds at any pace is
    asserted there: on after the last frame in, never back, on the recording's clock."""
    pytest.importorskip("fastapi")
    from dataclasses import replace

    from helpers_server import RunningDaemon

    run = RunningDaemon(_config(tmp_path), tmp_path / "out.txt")
    run.daemon.options = replace(run.daemon.options, realtime=realtime)  # the helper's daemon runs --realtime
    with run:
        daemon = run.daemon
        assert daemon.sampler.deterministic is not realtime
        seen: list[tuple[float, float]] = []  # (the source's time, the session's) of each frame in
        source_t: list[float] = []
        ingest, stream_time = daemon.session.ingest, daemon._stream_time

        def recorded(frame, t=None, **kwargs):
            seen.append((source_t[-1], t))
            return ingest(frame, t=t, **kwargs)

        def noted(t):
            source_t.append(t)
            return stream_time(t)

        with daemon.lock:  # between two frames: each frame's stream time and its ingest are taken under the lock
            daemon._stream_time, daemon.session.ingest = noted, recorded
        assert until(lambda: len(seen) >= 6)
        assert daemon.pause("test")
        before = len(seen)
        last_source, last_stream = seen[-1]
        assert daemon.resume()
        assert until(lambda: len(seen) >= before + 6)
        after = seen[before:before + 6]
        sources = [s for s, _ in after]
        if realtime:  # from the resume point on, each frame once and in order, whichever the ticks caught
            assert sources[0] >= last_source + 0.25 and sources == sorted(set(sources))
            assert all((s * 8).is_integer() for s in sources)  # the recording's own frames (8 fps), none made up
        else:
            assert sources == [last_source + 0.25 * (k + 1) for k in range(6)]  # the next frames, once
        assert [t - s for s, t in after] == pytest.approx([last_stream - last_source] * 6)  # the pause took no time
        assert daemon.session.stats()["clock_jumps"] == 0


@pytest.mark.parametrize("gives_up", [True, False], ids=["pause-gives-up", "resume-meanwhile"])
def test_a_pause_during_a_step_in_flight_loses_no_frame_and_reads_none_twice(tmp_path, monkeypatch, gives_up):
    """A pause waits (``STOP_BUDGET_S``) for the loop's step in flight: here a frame held inside its ingest. Whether
    the pause gives up waiting and a resume follows before the frame is in (it went in again from the reopened
    recording: the frame in flight was read again from the last frame *in*), or a resume comes while the pause still
    waits (the pause then closed the resume's new capture: the stream ended, not paused), the recording goes on
    after the frame in flight, every frame once."""
    pytest.importorskip("fastapi")
    from dataclasses import replace

    import threading

    from helpers_server import RunningDaemon

    import edgekv.apps.daemon.loop as loop

    if gives_up:
        monkeypatch.setattr(loop, "STOP_BUDGET_S", 0.0)  # as a step longer than the budget: no wait at all
    run = RunningDaemon(_config(tmp_path), tmp_path / "out.txt")
    run.daemon.options = replace(run.daemon.options, realtime=False)  # every frame by timestamp: each one known
    with run:
        daemon = run.daemon
        went: list[float] = []  # the source's time of each frame in
        held, release = threading.Event(), threading.Event()
        ingest, went_in = daemon.session.ingest, daemon._went_in

        def holding(frame, t=None, **kwargs):
            if len(went) >= 4 and not held.is_set():  # the fifth frame stays in flight until released
                held.set()
                assert release.wait(120)
            return ingest(frame, t=t, **kwargs)

        def noted(t, stream_t):
            went.append(t)
            return went_in(t, stream_t)

        with daemon.lock:
            daemon.session.ingest, daemon._went_in = holding, noted
        assert held.wait(120)
        paused: list[bool] = []
        pausing = threading.Thread(target=lambda: paused.append(daemon.pause("test")))
        pausing.start()
        if gives_up:
            pausing.join(120)
        else:
            assert until(lambda: daemon.paused is not None)
        assert daemon.resume()  # the pause still waits for the frame in flight, or gave up on it
        release.set()
        pausing.join(120)
        assert paused == [True] and daemon.paused is None
        # it goes on past what a closed capture still had queued (8 frames read, half of them sampled): not ended
        n = len(went) + 12
        assert until(lambda: len(went) >= n or daemon.stream_ended.is_set(), 120)
        assert not daemon.stream_ended.is_set(), daemon.stream_state
        seen = went[:n]
        assert seen == [seen[0] + 0.25 * k for k in range(n)]  # the frame in flight once, then the next ones
