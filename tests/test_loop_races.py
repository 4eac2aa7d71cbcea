"""Races between the daemon's loop and its controls (apps/daemon/loop.py), each ordered by events, no sleeps.

A pause that gives up waiting for the loop's step (``STOP_BUDGET_S``) closes the sampler while the loop may still be
inside it: the loop then found the stopped capture exhausted and ended the stream during the pause ("the source
ended"), so the resume opened nothing and the daemon watched nothing from then on."""

from __future__ import annotations

import threading

import pytest
from helpers_wait import until

import edgekv.apps.daemon.loop as loop

EVENTS = "synthetic:events?size=112x112&fps=8&frames=100000&seed=2"


def _config():
    from edgekv.config import EdgeKVConfig

    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"source": EVENTS, "fps": 4.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
        server={"port": 0}, monitor={"backend": "cpu"}, generation={"max_new_tokens": 2})


def test_a_pause_that_gives_up_on_the_loop_inside_the_sampler_does_not_end_the_stream(tmp_path, monkeypatch):
    """The loop is held inside the sampler's ``next_frame`` (in the capture's ``latest``, past the tick's wait) until
    the pause has given up waiting for it and closed the capture; then it reads on from the closed capture. The
    stream goes on after the resume: frames go in, and it is not ended."""
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon

    run = RunningDaemon(_config(), tmp_path / "out.txt")  # realtime: the newest frame at each tick
    with run:
        daemon = run.daemon
        assert not daemon.sampler.deterministic
        capture = daemon.sampler.capture
        held, release = threading.Event(), threading.Event()
        latest = capture.latest

        def holding(after=0, timeout=None):
            if threading.current_thread() is daemon._loop_thread and not held.is_set():
                held.set()
                assert release.wait(120)
            return latest(after, timeout)

        monkeypatch.setattr(capture, "latest", holding)
        assert held.wait(120)
        with monkeypatch.context() as patch:
            patch.setattr(loop, "STOP_BUDGET_S", 0.0)  # as a step longer than the budget: the pause does not wait
            assert daemon.pause("test")
        assert daemon.sampler.closed and not daemon._pause_seen.is_set()  # the loop is still inside the sampler
        release.set()
        assert daemon._pause_seen.wait(120)  # the loop came round, paused: its read of the closed capture is over
        assert daemon._stream_end is None, daemon._stream_end
        frames = daemon.session.counters.frames
        assert daemon.resume()
        assert until(lambda: daemon.session.counters.frames >= frames + 4 or daemon.stream_ended.is_set(), 120)
        assert not daemon.stream_ended.is_set(), daemon.stream_state
        assert daemon.stream_state != "ended"


def _cameras_config():
    from edgekv.config import EdgeKVConfig

    sources = [{"name": name, "source": f"synthetic:events?size=112x112&fps=2&frames=600&seed={seed}&rate=0.08"}
               for seed, name in enumerate(("front", "side", "back"), 1)]
    return EdgeKVConfig().with_overrides(
        model={"path": "builtin:toy", "dtype": "fp32", "device": "cpu"},
        video={"sources": sources, "fps": 2.0, "resolution": [112, 112]},
        cache={"policy": "infinipot_v", "max_tokens": 1920, "text_reserve_tokens": 64},
        monitor={"backend": "cpu"}, server={"port": 0}, generation={"max_new_tokens": 2, "temperature": 0.0})


def test_cameras_whose_loops_are_stuck_are_waited_for_once_within_the_stops_budget(tmp_path, monkeypatch):
    """Two of three cameras' loops stuck in a step (they never see the stop): the stop waits for the loops within one
    ``STOP_BUDGET_S`` on the stop's clock, all of them together, then stops every camera. Before, it waited for the
    loops as long as any ran, then 60 s for each in turn: it never began while a loop was stuck, and systemd killed
    every camera (TimeoutStopSec 20 s) before its final snapshot. The stop's clock is fake: a wait for a stuck loop
    moves it on by the time waited; the loop that ends is joined for real."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet

    now = [0.0]
    monkeypatch.setattr(loop.Daemon, "stop_clock", staticmethod(lambda: now[0]))
    cameras = CameraSet(_cameras_config(), daemon_args(), out=open(tmp_path / "out.txt", "w"))
    release = threading.Event()
    stuck = {"side", "back"}
    for name in stuck:  # a step that never ends (until the test lets it go): a driver call, a disk
        cameras.daemons[name].serve = lambda: release.wait(300)
    waited: list[tuple[str, float]] = []

    def join_loop(thread: threading.Thread, timeout: float) -> None:
        name = thread.name.removeprefix("edgekv-camera-")
        waited.append((name, timeout))
        if name in stuck:
            now[0] += timeout  # waited for to the end of the time it was given
        else:
            thread.join(120)

    cameras.join_loop = join_loop
    stop_began: list[float] = []
    shutdown = cameras._shutdown
    cameras._shutdown = lambda: (stop_began.append(now[0]), shutdown())[1]
    thread = threading.Thread(target=cameras.run, daemon=True)
    thread.start()
    try:
        assert cameras.ready.wait(180)
        cameras.stop.event.set()
        thread.join(120)
        assert not thread.is_alive(), "the stop waited for the stuck loops"
    finally:
        release.set()
        thread.join(120)
    said = (tmp_path / "out.txt").read_text()
    assert stop_began == [loop.STOP_BUDGET_S], (stop_began, waited)  # one budget for all the loops, not one each
    # front's loop ended at once (no time spent), side's was given what was left of the one budget, back's none
    assert waited == [("front", loop.STOP_BUDGET_S), ("side", loop.STOP_BUDGET_S)], waited
    assert "shutdown: the loop of side, back did not finish its step within the stop's" in said, said
    for name in ("front", "side", "back"):
        assert said.count(f"[{name}] frames ") == 1, said  # every camera stopped (its summary said once)


ONNX = {"vision": "onnxruntime", "llm": "onnxruntime", "onnx_providers": ["CPUExecutionProvider"]}
SHAPES = "synthetic:shapes?size=160x120&fps=8&frames=1000"


@pytest.mark.parametrize("cameras", [1, 2], ids=["one-camera", "two-cameras"])
def test_a_start_without_its_engines_fails_before_the_weights_load(tiny_checkpoint, tmp_path, monkeypatch, capsys,
                                                                   cameras):
    """``engines: onnxruntime`` and no bundle built: the start stops with the same line ``--check`` gives (the
    load's own "no onnxruntime engines built ... edgekv build ..."), and the weights are never loaded. Before, they
    were loaded first (minutes for the 3B on a Jetson), then the engines were looked for."""
    pytest.importorskip("onnxruntime")
    from helpers_check import check_config

    import edgekv.runtime as runtime
    from edgekv.apps.daemon.camera import main as camera_main
    from edgekv.apps.daemon.cameras import engines_config
    from edgekv.apps.daemon.startup import one_line
    from edgekv.config import load_config

    video = {} if cameras == 1 else {"sources": [{"name": name, "source": SHAPES} for name in ("front", "back")]}
    path = check_config(tmp_path, tiny_checkpoint, engines={**ONNX, "engine_dir": str(tmp_path / "engines")},
                        video=video)
    with pytest.raises(ValueError) as found:  # what --check's engines row says (one_line of it), the weights unread
        runtime.find_engines(engines_config(load_config(path)))
    loads: list[str] = []
    load_pretrained = runtime.load_pretrained

    def counted(model_dir, *args, **kwargs):
        loads.append(str(model_dir))
        return load_pretrained(model_dir, *args, **kwargs)

    monkeypatch.setattr(runtime, "load_pretrained", counted)
    code = camera_main(["--config", str(path), "--no-server", "--no-stdin", "--max-frames", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"cannot start: {one_line(found.value)}\n" in err, err
    assert "no onnxruntime engines built" in err and "edgekv build" in err, err
    assert loads == [], loads
