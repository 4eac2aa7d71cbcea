"""Time never stops the memory (DESIGN invariant 12): a timestamp that jumps (either way) becomes a bounded,
logged gap in stream time; one refused frame never blocks the next normal one; a snapshot saved by a clock
that later jumped (an RTC-less board that boots in 1970, saves, syncs NTP and restarts) resumes and
ingests; a stream that ingests nothing for long is "stalled", and /healthz says so (issue 26, item 1)."""

from __future__ import annotations

import io
import logging
import math
import threading
import time

import numpy as np
import pytest

import edgekv
from edgekv.config import EdgeKVConfig
from edgekv.session.clock import StreamClock

RES = (56, 84)
FPS = 2.0


def _frames(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(60, 80, 3), dtype=np.uint8) for _ in range(count)]


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint):
    return edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": list(RES), "fps": FPS},
        cache={"policy": "sliding_window", "max_tokens": 96, "text_reserve_tokens": 24})


def _tpos_of_pairs(session) -> list[int]:
    """Temporal position of each frame pair in the cache (layer 0, head 0), in pair order."""
    n, cache = session.cache.length, session.cache
    frames = cache.frame[0, 0, session.prefix_tokens:n].tolist()
    tpos = cache.tpos[0, 0, session.prefix_tokens:n].tolist()
    return [p for _, p in sorted(dict(zip(frames, tpos)).items())]


def test_one_huge_timestamp_does_not_block_the_normal_ones(runtime, caplog):
    """Through the API: one frame stamped t=1e9 (a client whose clock stepped) is taken as a bounded gap, and
    the normal timestamps after it go in too (before: every later frame was refused "back in time")."""
    session = runtime.session()
    frames = _frames(8)
    with caplog.at_level(logging.WARNING, logger="edgekv.session"):
        for frame, t in zip(frames, [0.0, 0.5, 1e9, 1e9 + 0.5, 1.0, 1.5, 2.0, 2.5]):
            session.ingest(frame, t=t)
    stats = session.stats()
    assert stats["frames"] == 8 and stats["frames_rejected"] == 0 and stats["frame_pairs"] == 4
    assert stats["clock_jumps"] == 2
    gap = session.config.video.max_gap_s
    tpos = _tpos_of_pairs(session)
    assert tpos == sorted(tpos)  # time in the cache still runs forward
    steps = [b - a for a, b in zip(tpos, tpos[1:])]
    assert max(steps) <= math.ceil((gap + 0.5) * session.tokens_per_second)  # the jump forward: at most max_gap_s
    assert steps[-1] == round(1.0 * session.tokens_per_second)  # after the jump back: the nominal spacing again
    jumps = [r.getMessage() for r in caplog.records if "jumped" in r.getMessage()]
    assert len(jumps) == 2 and "forward" in jumps[0] and "back" in jumps[1]


def test_a_jump_back_becomes_one_frame_interval(runtime):
    session = runtime.session()
    frames = _frames(4, seed=1)
    session.ingest(frames[0], t=100.0)
    session.ingest(frames[1], t=100.5)
    session.ingest(frames[2], t=3.0)  # the wall clock went back 97.5 s
    session.ingest(frames[3], t=3.5)
    assert session.stats()["frame_pairs"] == 2 and session.clock.last_t == pytest.approx(101.5)
    assert _tpos_of_pairs(session) == [session.video_start, session.video_start + 2]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e300, "soon"])
def test_a_refused_timestamp_never_blocks_the_next_frame(runtime, bad):
    session = runtime.session()
    frames = _frames(4, seed=2)
    session.ingest(frames[0], t=0.0)
    with pytest.raises(ValueError, match="t="):
        session.ingest(frames[1], t=bad)
    for frame, t in zip(frames[1:], (0.5, 1.0, 1.5)):
        session.ingest(frame, t=t)
    assert session.stats()["frames"] == 4 and session.stats()["frames_rejected"] == 1



def test_timestamps_read_from_numpy_arrays_go_in_and_bools_do_not(runtime):
    """A timestamp taken from an array (``ts[i]``: numpy's float32 / int64 are not Python floats) is a number of
    seconds like any other (before: float32 and int64 were refused as "not a finite number"); a bool is not."""
    session = runtime.session()
    frames = _frames(5, seed=3)
    for frame, t in zip(frames, np.array([0.0, 0.5, 1.0, 1.5], dtype=np.float32)):
        session.ingest(frame, t=t)
    session.ingest(frames[4], t=np.int64(2))
    assert session.stats()["frames"] == 5 and session.stats()["frames_rejected"] == 0
    assert session.clock.last_t == pytest.approx(2.0)
    for bad in (True, np.bool_(False)):
        with pytest.raises(ValueError, match="finite number of seconds"):
            session.ingest(frames[0], t=bad)
    assert session.stats()["frames_rejected"] == 2

def test_the_clock_maps_and_bounds_in_one_place():
    clock = StreamClock(fps=2.0, tokens_per_second=2.0, max_gap_s=60.0)
    stamps = []
    for t in (10.0, 10.5, 5000.0, 5000.5, 7.0):
        stamp = clock.check(t, len(stamps), None, 0, 2**31)
        clock.accept(stamp)
        stamps.append(stamp)
    assert [s.stream for s in stamps] == [10.0, 10.5, 70.5, 71.0, 71.5]
    assert [s.jump_s for s in stamps] == [None, None, 4989.5, None, -4993.5]
    assert clock.jumps == 2
    with pytest.raises(ValueError, match="max_gap_s"):
        StreamClock(fps=2.0, tokens_per_second=2.0, max_gap_s=0.0)


# ---------------------------------------------------------------------------------------------- the daemon
def _config(model_dir, engine_dir, state_dir, **video) -> EdgeKVConfig:
    return EdgeKVConfig().with_overrides(
        model={"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=80x60&fps=8&frames=24", "fps": 8.0, "resolution": list(RES),
               **video},
        cache={"policy": "sliding_window", "max_tokens": 96, "text_reserve_tokens": 24},
        engines={"engine_dir": str(engine_dir)}, server={"enabled": False},
        monitor={"interval_s": 0.5, "backend": "cpu"}, state={"dir": str(state_dir), "every_s": 3600.0},
    )


def test_a_snapshot_saved_in_1970_resumes_after_ntp_and_ingests(tiny_checkpoint, tmp_path, monkeypatch):
    """An RTC-less board boots in 1970, saves its memory, syncs NTP and restarts: the ~56 years the wall
    clock moved is one bounded gap, and every frame of the restarted source goes in (before: all refused,
    "temporal position exceeds", while the daemon looked healthy)."""
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions
    import edgekv.state

    config = _config(tiny_checkpoint, tmp_path / "engines", tmp_path / "state")
    session = edgekv.Runtime.from_config(config).session()
    for index, frame in enumerate(_frames(6, seed=3)):
        session.ingest(frame, t=index / 8.0)
    (tmp_path / "state").mkdir()
    with monkeypatch.context() as patch:
        patch.setattr(edgekv.state.time, "time", lambda: 100.0)  # 1970-01-01 00:01:40, before NTP
        session.save(tmp_path / "state" / "snapshot-00000001.ekv")
    last_t = session.clock.last_t

    out = io.StringIO()
    daemon = Daemon(config, DaemonOptions(exit_at_end=True, no_server=True, no_stdin=True, quiet=True), out=out)
    assert daemon.run() == 0, out.getvalue()
    text = out.getvalue()
    assert "resumed" in text, text
    stats = daemon.session.stats()
    assert stats["frames"] == 6 + 24 and stats["frames_rejected"] == 0, text
    gap = config.video.max_gap_s
    assert last_t < daemon.session.clock.last_t <= last_t + gap + 24 / 8.0
    assert "wall clock" in text  # the jump is said, not hidden


class _Refusing:
    """Stands in for a session's ingest that refuses every frame (the stuck memory of issue 26)."""

    def __init__(self, session) -> None:
        self.session, self.refuse = session, threading.Event()
        self.ingest = session.ingest

    def __call__(self, frame, t=None, **stamps):
        if self.refuse.is_set():
            self.session.counters.frames_rejected += 1
            raise ValueError(f"t={t}: refused")
        return self.ingest(frame, t=t, **stamps)


def _wait_for(predicate, seconds: float = 60.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_stream_that_ingests_nothing_is_stalled_and_unhealthy(tiny_checkpoint, tmp_path):
    from helpers_server import RunningDaemon, call, server_config

    config = server_config(tiny_checkpoint).with_overrides(video={"stall_s": 0.5})
    with RunningDaemon(config, tmp_path / "out.txt") as running:
        daemon = running.daemon
        status, _, body = call(running.port, "GET", "/healthz")
        assert status == 200 and b'"running"' in body
        refusing = _Refusing(daemon.session)
        daemon.session.ingest = refusing
        refusing.refuse.set()
        assert _wait_for(lambda: daemon.stream_state == "stalled"), daemon.stream_state
        status, _, body = call(running.port, "GET", "/healthz")
        assert status == 503 and b'"stalled"' in body, body
        status, _, body = call(running.port, "GET", "/metrics")
        assert b'edgekv_stream_state{state="stalled"} 1.0' in body
        refusing.refuse.clear()  # frames go in again: running and healthy again
        assert _wait_for(lambda: daemon.stream_state == "running"), daemon.stream_state
        status, _, _ = call(running.port, "GET", "/healthz")
        assert status == 200


def test_reset_keeps_the_configured_gap_cap(tiny_checkpoint):
    """``reset()`` rebuilt the clock without video.max_gap_s: after a reset a long pause was capped at the default."""
    import edgekv

    rt = edgekv.Runtime.from_pretrained(tiny_checkpoint, model={"device": "cpu", "dtype": "fp32"},
                                        video={"resolution": [56, 56], "max_gap_s": 7.5})
    session = rt.session()
    assert session.clock.max_gap_s == 7.5
    session.reset()
    assert session.clock.max_gap_s == 7.5
