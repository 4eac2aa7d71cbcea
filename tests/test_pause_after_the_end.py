"""A pause just as a recording's end is noticed keeps the frames read before it that have not gone in yet.

The end of a source is noticed while frames read before it may still wait in the backlog (a collector took the
last one as the main loop found the source exhausted); the stream ends once they have gone in. A pause then cleared
the backlog, and the resume of an ended stream opens nothing: those frames never went in, and the snapshot said the
recording was read to its end, so a restart read them no more either. Now the pause keeps them and they go in after
the resume.
"""

from __future__ import annotations

import io
import threading

from edgekv.config import EdgeKVConfig

SOURCE = "synthetic:events?size=112x112&fps=8&frames=16&rate=0.3&seed=3"  # 8 frames in at 4 fps


def test_frames_read_before_the_end_go_in_after_a_pause(tmp_path):
    from edgekv.apps.daemon.loop import Daemon, DaemonOptions

    config = EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": SOURCE, "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"enabled": False}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2},
        state={"dir": str(tmp_path / "state"), "every_s": 3600})
    out = io.StringIO()
    daemon = Daemon(config, DaemonOptions(no_stdin=True, quiet=True, no_server=True), out=out)
    went_in: list[float] = []
    paused = threading.Event()
    sample, end_stream, keep = daemon._sample, daemon._end_stream, daemon._went_in

    def collected(timeout):  # the last frame taken as by a collector, while the loop finds the source exhausted
        item = sample(timeout)
        if item is not None and item[1] == 1.75:
            daemon.backlog.push(*item, bounded=False)
            assert wait_for(lambda: sample(0.01) is None and daemon.sampler.exhausted)  # 1.875 passed over, then eof
            return None
        return item

    def ended(reason: str) -> None:  # the pause comes just as the end is noticed, the last frame not in yet
        end_stream(reason)
        if len(daemon.backlog) and not paused.is_set():
            assert daemon.pause("test")
            paused.set()

    def noted(t: float, stream_t: float) -> None:
        went_in.append(t)
        keep(t, stream_t)

    daemon._sample, daemon._end_stream, daemon._went_in = collected, ended, noted
    runner = threading.Thread(target=daemon.run, daemon=True)
    runner.start()
    try:
        assert paused.wait(120), out.getvalue()
        assert daemon.resume()
        assert daemon.stream_ended.wait(120), out.getvalue()
    finally:
        daemon.stop.event.set()
        daemon._wake.set()
        runner.join(120)
    assert not runner.is_alive()
    assert went_in == [0.25 * k for k in range(8)], out.getvalue()  # the last frame too, once
    assert "stream ended: the source ended after 8 frames" in out.getvalue()
    from edgekv.state import SOURCE_KEY

    point = daemon.session.counters.extra[SOURCE_KEY]  # what a snapshot keeps: read to its end, the last frame in
    assert point["ended"] and point["t"] == 1.75


def wait_for(condition, bound_s: float = 120.0) -> bool:
    done = threading.Event()
    for _ in range(int(bound_s * 100)):
        if condition():
            return True
        done.wait(0.01)
    return condition()
