"""A daemon restarted with its persistent memory (``state.dir``) on a recording goes on where the memory stopped.

Before, a restarted file, ``synthetic:`` video or bag was read again from its start, its time moved on by the
wall-clock time the process was down (as a live camera's is): the model saw the same events twice, a ``--quiz``
ground truth no longer matched what the memory held, and evidence times drifted from the recording's. The same
for a paused daemon that restarted (the pause kept on disk) and was then resumed. Now the snapshot keeps which
source it read (``edgekv.state.source_record``) and its own time of the last frame in; a restart in the same
recording goes on from the next frame on the recording's own clock, a recording read to its end reads no more, a
different recording (or the same file changed) starts from its beginning, said, and a live source goes on live.
"""

from __future__ import annotations

import io
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from edgekv.config import EdgeKVConfig

# 48 frames at 8 fps sampled at 4 fps: 24 frames in, 5 events at frame pairs 0-1, 4, 8-9, 13-14 and 18-19
EVENTS = "synthetic:events?size=112x112&fps=8&frames=48&rate=0.3&seed=3"
STEP = 0.25  # s between the frames that go in (video.fps 4)


def _config(root: Path, source: str = EVENTS) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": source, "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"enabled": False}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2},
        state={"dir": str(root / "state"), "every_s": 3600})


def _daemon(config: EdgeKVConfig, out, **options):
    """A daemon whose frames in are noted as (the source's time, the session's time)."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True, no_server=True, **options), out=out)
    daemon.went_in = []
    went_in = daemon._went_in

    def noted(t: float, stream_t: float) -> None:
        daemon.went_in.append((t, stream_t))
        went_in(t, stream_t)

    daemon._went_in = noted
    return daemon


def _run(config: EdgeKVConfig, **options):
    """A one-shot daemon run to its end: (what it said, the daemon)."""
    out = io.StringIO()
    daemon = _daemon(config, out, **options)
    assert daemon.run() == 0, out.getvalue()
    return out.getvalue(), daemon


def _quiz_lines(text: str) -> list[str]:
    """The quiz's questions, answers and ground truths (not the timings, which differ run to run)."""
    return [line for line in text.splitlines() if line.startswith(("Q [quiz]", "A: ", "   model: ", "quiz: "))]


def _times(start: float, count: int) -> list[float]:
    return [start + STEP * k for k in range(count)]


def test_a_restart_goes_on_in_the_recording_and_the_quiz_grades_what_the_model_was_shown(tmp_path):
    first, before = _run(_config(tmp_path), max_frames=10, quiz=5)
    assert [t for t, _ in before.went_in] == _times(0.0, 10)
    second, after = _run(_config(tmp_path), max_frames=10, quiz=5)
    assert f"resuming {EVENTS} at 2.25 s where the saved memory stopped" in second
    # the recording's next frames, none seen twice, on its own clock: session time = the recording's time
    assert after.went_in == [(t, pytest.approx(t)) for t in _times(2.5, 10)]
    assert after.session.stats()["clock_jumps"] == 0
    assert sorted(after.quiz.seen) == [0, 1, 2, 3, 4]  # the 3 events before the restart, the 2 after it

    whole, once = _run(_config(tmp_path / "whole"), max_frames=20, quiz=5)
    assert [t for t, _ in once.went_in] == _times(0.0, 20)
    assert _quiz_lines(second) == _quiz_lines(whole)  # the same questions, ground truths and answers
    assert "quiz: 5/5 correct about 5 events seen (of 5 in the stream)" in second
    assert after.session.pair_times == once.session.pair_times


def test_a_recording_read_to_its_end_is_not_read_again_at_a_restart(tmp_path):
    _run(_config(tmp_path), max_frames=20)
    text, ended = _run(_config(tmp_path), exit_at_end=True)
    assert [t for t, _ in ended.went_in] == _times(5.0, 4)  # the rest of it, to its last sampled frame
    assert "stream ended: the source ended after 24 frames" in text
    again, idle = _run(_config(tmp_path), exit_at_end=True, quiz=5)
    assert idle.went_in == [] and idle.session.counters.frames == 24
    assert ("quiz: the saved memory kept no record of the events it was shown (its run had no --quiz): every event "
            "on screen from 0 s to 5.75 s of the recording counts as seen") in again
    assert f"{EVENTS} ended at 5.75 s in the saved memory: nothing more is read from it" in again
    assert "stream ended: the recording was read to its end before the restart after 24 frames" in again
    assert "quiz: 5/5 correct about 5 events seen (of 5 in the stream)" in again  # what the memory holds


def test_video_loop_plays_a_recording_read_to_its_end_again(tmp_path):
    _run(_config(tmp_path), exit_at_end=True)
    looping = _config(tmp_path).with_overrides(video={"loop": True})
    text, daemon = _run(looping, max_frames=4)
    assert f"resuming {EVENTS} at 5.75 s where the saved memory stopped" in text
    assert [t for t, _ in daemon.went_in] == _times(6.0, 4)  # the second pass, its time running on
    assert daemon.session.stats()["clock_jumps"] == 0


def test_a_pause_kept_across_a_restart_resumes_the_recording_where_the_memory_stopped(tmp_path):
    config = _config(tmp_path, EVENTS.replace("frames=48", "frames=100000"))

    def started(out):
        daemon = _daemon(config, out)
        thread = threading.Thread(target=daemon.run, daemon=True)
        thread.start()
        assert daemon.ready.wait(120), out.getvalue()
        return daemon, thread

    def until(condition) -> bool:
        deadline = time.monotonic() + 120
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.02)
        return condition()

    out = io.StringIO()
    daemon, thread = started(out)
    try:
        assert until(lambda: len(daemon.went_in) >= 6)
        assert daemon.pause("privacy switch")
        last, last_stream = daemon.went_in[-1]
    finally:
        daemon.stop.event.set()
        thread.join(60)
    assert not thread.is_alive()

    out = io.StringIO()
    daemon, thread = started(out)
    try:
        assert daemon.paused == "privacy switch, kept across the restart" and daemon.went_in == []
        assert daemon.resume()
        assert until(lambda: len(daemon.went_in) >= 6)
        assert [t for t, _ in daemon.went_in[:6]] == _times(last + STEP, 6)
        assert [s for _, s in daemon.went_in[:6]] == pytest.approx(_times(last_stream + STEP, 6))
        assert daemon.session.stats()["clock_jumps"] == 0
    finally:
        daemon.stop.event.set()
        thread.join(60)
    assert f"at {last:g} s where the saved memory stopped" in out.getvalue()


def _counting_video(path: Path, frames: int) -> Path:
    """An MJPEG AVI at 4 fps whose frame k is flat grey at level 4k: a frame read says which one it is."""
    cv2 = pytest.importorskip("cv2")
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"MJPG"), 4.0, (64, 48))
    assert writer.isOpened()
    for k in range(frames):
        writer.write(np.full((48, 64, 3), 4 * k, np.uint8))
    writer.release()
    return path


def test_a_file_goes_on_where_the_memory_stopped_and_another_file_under_its_name_starts_over(tmp_path):
    clip = _counting_video(tmp_path / "clip.avi", 20)
    config = _config(tmp_path, str(clip)).with_overrides(video={"resolution": [56, 56]})
    _run(config, max_frames=6)
    text, daemon = _run(config, max_frames=6)
    assert f"resuming {clip} at 1.25 s where the saved memory stopped" in text
    assert [t for t, _ in daemon.went_in] == pytest.approx(_times(1.5, 6))

    _counting_video(clip, 30)  # a new recording under the same name
    text, daemon = _run(config, max_frames=4)
    assert re.search(rf"{re.escape(str(clip))} is read from its start: it is not the recording the saved memory "
                     r"stopped in \(its size or modification time changed since: \d+ -> \d+ bytes\)", text), text
    assert [t for t, _ in daemon.went_in] == pytest.approx(_times(0.0, 4))  # from its start, after the memory


def test_another_recording_starts_from_its_beginning_and_a_live_source_goes_on_live(tmp_path):
    """The keeper's side: only the recording the memory stopped in goes on; a live source keeps the wall-clock gap
    (``_resume_offset``), and a URL's password never reaches the snapshot."""
    import edgekv
    from edgekv.config import StateSection
    from edgekv.state import SOURCE_KEY, StateKeeper, source_record
    from edgekv.video.sources import parse_spec

    runtime = edgekv.Runtime.from_config(_config(tmp_path))
    said: list[str] = []
    keeper = StateKeeper(StateSection(dir=str(tmp_path / "state")), say=said.append)
    session = keeper.restore(runtime)
    for index in range(4):
        session.ingest(np.random.default_rng(index).integers(0, 256, (60, 80, 3), dtype=np.uint8), t=100.0 + index)
    recorded = source_record(parse_spec(EVENTS))
    session.counters.extra[SOURCE_KEY] = {**recorded, "first_t": 0.0, "t": 3.0, "stream_t": 103.0}
    keeper.snapshot(session)
    session.close()

    def restart(source: str) -> StateKeeper:
        said.clear()
        keeper = StateKeeper(StateSection(dir=str(tmp_path / "state")), say=said.append)
        keeper.source = source_record(parse_spec(source))
        keeper.restore(runtime).close()
        return keeper

    same = restart(EVENTS)
    assert same.resumed_source_t == 3.0 and same.stream_time(3.25) == pytest.approx(103.25)
    other = restart(EVENTS.replace("seed=3", "seed=4"))
    assert other.resumed_source_t is None and other.stream_time(0.0) > 103.0  # after the memory's last frame
    assert said[0] == (f"{EVENTS.replace('seed=3', 'seed=4')} is read from its start: the saved memory last read "
                       f"another source, {EVENTS}")
    live = restart("rtsp://admin:secret@camera.local/stream")
    assert live.resumed_source_t is None and live.stream_time(0.0) > 103.0 and len(said) == 1
    record = source_record(parse_spec("rtsp://admin:secret@camera.local/stream"))
    assert record["live"] and "secret" not in str(record)
