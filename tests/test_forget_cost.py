"""What a forget costs the device: the snapshots rewritten only when one of them can hold the window, forgets asked
at once done in one pass (one snapshot write) after the main loop's step, and a long forget's progress counted by
the systemd watchdog (apps/daemon/forget_passes.py, ``StateKeeper.rewrite_after_forget``).

Before: every forget wrote a whole snapshot (224 MiB at the 3B shape) under the session's lock, even "forget the
last 30 seconds" that no snapshot (written every ``state.every_s``) held; eight clients forgetting back to back held
the lock nearly all the time (about 15 of 24 frames went in); and a forget longer than ``WatchdogSec / 2`` stopped
the watchdog's pings (the main loop blocked on the lock), so systemd killed the daemon half way."""

from __future__ import annotations

import json
import threading

import pytest
import torch

import edgekv
from edgekv.cache.capped import SlotKind
from edgekv.config import EdgeKVConfig
from edgekv.state import StateKeeper

SOURCE = "synthetic:events?size=112x112&fps=2&frames=160&seed=2&rate=0.05&noise=3"  # frame i at t = i / 2


def _pair_bytes(session, pair: int) -> list[bytes]:
    """Runs of the cache's K bytes of ``pair`` (64 bytes of each slot's key), to look for in files."""
    cache, n = session.cache, session.cache.length
    where = torch.nonzero((cache.frame[:, :, :n] == pair) & (cache.kind[:, :, :n] == int(SlotKind.VISION)))
    return [cache.k[layer, head, slot].contiguous().numpy().tobytes()[:64] for layer, head, slot in where.tolist()[:32]]


def _files_under(folder) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The toy runtime, the source's frames, and where to make folders (shared by this module's keeper tests)."""
    from edgekv.video.sources import iter_frames

    rt = edgekv.Runtime.from_pretrained("builtin:toy", model={"dtype": "fp32", "device": "cpu"},
                                        cache={"policy": "infinipot_v", "max_tokens": 640, "text_reserve_tokens": 64},
                                        video={"resolution": [112, 112], "fps": 2.0})
    frames = list(iter_frames(SOURCE))
    return rt, frames, tmp_path_factory


def _keeper_with_snapshot(toy, name: str):
    """A session that saw t = 0 .. 79.5 s, the snapshot its keeper wrote at t = 49.5 s (pairs 0 .. 49), and the K
    bytes pair 20 had in that snapshot."""
    rt, frames, factory = toy
    folder = factory.mktemp(name)
    keeper = StateKeeper(EdgeKVConfig().with_overrides(state={"dir": str(folder / "state")}).state, say=lambda _: None)
    session = rt.session()
    for frame, t in frames[:100]:
        session.ingest(frame, t=t)
    assert 20 in session.pair_times
    secrets = _pair_bytes(session, 20)
    info = keeper.snapshot(session)
    assert info is not None and info.last_t == 49.5
    for frame, t in frames[100:]:
        session.ingest(frame, t=t)
    return keeper, session, info.path, secrets


def test_a_window_after_the_last_snapshot_rewrites_none(toy):
    keeper, session, path, _secrets = _keeper_with_snapshot(toy, "after")
    before, written = path.read_bytes(), keeper.written
    aside = keeper.dir / keeper.ASIDE
    aside.mkdir()
    (aside / "snapshot-00000009.ekv").write_bytes(b"another deployment's memory, on its own stream clock")
    assert session.forget(59.6, 60.5)["pairs"] == [60]
    result = keeper.rewrite_after_forget(session, [(59.6, 60.5)])
    assert result == {"snapshot": None, "removed": [f"{keeper.ASIDE}/snapshot-00000009.ekv"],
                      "note": "no snapshot held the window: none rewritten"}
    assert keeper.generations() == [path] and path.read_bytes() == before and keeper.written == written
    assert not aside.exists() or not list(aside.iterdir())  # the set-aside one is deleted, as before
    # a window reaching back into the snapshot by a hair is rewritten
    assert keeper.rewrite_after_forget(session, [(49.5, 60.5)])["snapshot"] is not None
    assert keeper.written == written + 1 and path not in keeper.generations()


def test_a_window_inside_a_snapshot_is_rewritten_and_none_of_its_bytes_stay_on_disk(toy):
    keeper, session, path, secrets = _keeper_with_snapshot(toy, "inside")
    assert secrets and all(run in path.read_bytes() for run in secrets)  # the scan below can fail
    session.forget(19.6, 20.5)  # the session may hold pair 20 or not (compressed away): the snapshot does
    result = keeper.rewrite_after_forget(session, [(19.6, 20.5)])
    assert result["snapshot"] is not None and result["removed"] == [path.name] and "note" not in result
    assert [p.name for p in keeper.generations()] == [result["snapshot"]]
    assert not [run for run in secrets if run in _files_under(keeper.dir)]
    # the same window again (a retry, "forget the last five minutes" said twice): the snapshot written without it
    # is known not to hold it, and is left as it is
    newest = keeper.generations()[-1]
    kept, written = newest.read_bytes(), keeper.written
    assert keeper.rewrite_after_forget(session, [(19.8, 20.2)])["snapshot"] is None
    assert keeper.written == written and newest.read_bytes() == kept
    # ... but a window reaching past what it was written without is rewritten
    assert keeper.rewrite_after_forget(session, [(19.8, 21.0)])["snapshot"] is not None


def test_a_snapshot_whose_span_is_unknown_is_rewritten(toy):
    keeper, session, path, _secrets = _keeper_with_snapshot(toy, "unknown")
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # the trailer's end marker: the manifest (and its times) no longer reads
    path.write_bytes(bytes(data))
    result = keeper.rewrite_after_forget(session, [(70.0, 71.0)])  # after its span, were it known
    assert result["snapshot"] is not None and path.name in result["removed"]


def test_a_keeper_with_no_snapshot_writes_none_for_a_forget(toy, tmp_path):
    rt, frames, _factory = toy
    keeper = StateKeeper(EdgeKVConfig().with_overrides(state={"dir": str(tmp_path / "state")}).state)
    session = rt.session()
    for frame, t in frames[:8]:
        session.ingest(frame, t=t)
    assert keeper.rewrite_after_forget(session, [(0.0, 1.0)])["snapshot"] is None
    assert keeper.generations() == []
    assert keeper.rewrite_after_forget(session)["snapshot"] is not None  # no window named: as before, written


# ---------------------------------------------------------------------------------------------- the daemon


def _config(tiny_checkpoint, root, **state):
    from helpers_server import kept_config

    return kept_config(tiny_checkpoint, root, max_tokens=800, state=state)


def test_the_daemon_says_when_no_snapshot_held_the_window(tiny_checkpoint, tmp_path):
    """Through the HTTP API: the answer and the log say that no snapshot was rewritten, and the file is as it was."""
    pytest.importorskip("fastapi")
    from helpers_server import call, ended_daemon

    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out.txt") as daemon:
        times = dict(daemon.session.pair_times)
        with daemon.lock:
            daemon.state.snapshot(daemon.session)
        (path,) = daemon.state.generations()
        before = path.read_bytes()
        last = daemon.session.clock.last_t  # the snapshot's last frame: a window after it is in no snapshot
        status, _, body = call(daemon.server.port, "POST", "/v1/memory/forget", {"from": last + 1.0, "to": last + 2.0})
        assert status == 200, body
        result = json.loads(body)
        assert result["snapshots"] == {"snapshot": None, "removed": [],
                                       "note": "no snapshot held the window: none rewritten"}
        assert daemon.state.generations() == [path] and path.read_bytes() == before
        status, _, body = call(daemon.server.port, "POST", "/v1/memory/forget", {"from": times[3], "to": times[3]})
        assert status == 200 and json.loads(body)["snapshots"]["snapshot"] and json.loads(body)["pairs"] == 1
    said = (tmp_path / "out.txt").read_text()
    assert "no snapshot held the window: none rewritten" in said, said


def test_forgets_asked_at_once_are_done_in_one_pass_with_one_snapshot(tiny_checkpoint, tmp_path):
    """Six forgets waiting for the lock at once: one pass, one snapshot written, each caller answered for its own
    pair (before: six passes, six snapshots, the lock taken six times)."""
    pytest.importorskip("fastapi")
    from helpers_mqtt import until
    from helpers_server import ended_daemon

    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out.txt") as daemon:
        times = dict(daemon.session.pair_times)
        with daemon.lock:
            daemon.state.snapshot(daemon.session)  # holds every window below
        written, rewrites = daemon.state.written, []
        rewrite = daemon.state.rewrite_after_forget
        daemon.state.rewrite_after_forget = lambda *a, **k: rewrites.append(a) or rewrite(*a, **k)
        pairs, answers = [2, 4, 6, 8, 10, 12], {}

        def ask(pair: int) -> None:
            answers[pair] = daemon.forget(times[pair], times[pair])

        threads = [threading.Thread(target=ask, args=(pair,)) for pair in pairs]
        with daemon.lock:  # they all come while the lock is held (an answer, another forget)
            for thread in threads:
                thread.start()
            forgets, _watch = daemon._forgets()
            assert until(lambda: forgets.waiting() == len(pairs), 120)
        for thread in threads:
            thread.join(120)
        assert sorted(answers) == pairs
        assert len(rewrites) == 1 and daemon.state.written == written + 1 and forgets.passes == 1
        snapshot = answers[2]["snapshots"]["snapshot"]
        for pair, answer in answers.items():
            assert answer["pairs"] == 1 and answer["done_with"] == len(pairs) - 1, answer
            assert answer["from"] == answer["to"] == times[pair] and answer["snapshots"]["snapshot"] == snapshot
            assert pair not in daemon.session.pair_times
        assert [p.name for p in daemon.state.generations()] == [snapshot]
    assert (tmp_path / "out.txt").read_text().count("(in one pass with 5 other forget(s))") == len(pairs)


class _GatedHeartbeat:
    """The main loop's heartbeat, whose ``beat`` from the loop's thread waits while ``gate`` is shut: a loop that makes
    no progress, as long as the test wants."""

    def __init__(self, heartbeat, loop: threading.Thread) -> None:
        self.inner, self.loop = heartbeat, loop
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()

    @property
    def beats(self) -> int:
        return self.inner.beats

    def age_s(self) -> float:
        return self.inner.age_s()

    def beat(self) -> None:
        if threading.current_thread() is self.loop and not self.gate.is_set():
            self.waiting.set()
            assert self.gate.wait(300)
        self.inner.beat()


def test_a_pass_waits_for_the_loops_step_and_does_not_vouch_for_a_loop_that_took_none(tiny_checkpoint, tmp_path):
    """Forgets back to back: the second pass waits until the main loop has taken its step since the first (the camera
    keeps going), and a pass of a loop that made no progress since the last pass beats no heartbeat for it (a loop
    hung elsewhere is not kept alive by a stream of forgets)."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out.txt") as daemon:
        times = dict(daemon.session.pair_times)
        gated = _GatedHeartbeat(daemon.heartbeat, daemon._loop_thread)
        daemon.heartbeat = gated
        _forgets, watch = daemon._forgets()
        steps_at_pass, pass_ = [], daemon._forget_pass

        def watched_pass(asks):
            steps_at_pass.append(watch.stepped(gated))
            return pass_(asks)

        daemon._forget_pass = watched_pass
        waiting_for_the_loop, let_step = threading.Event(), daemon._let_the_loop_step

        def watched_let_step():
            waiting_for_the_loop.set()
            return let_step()

        daemon._let_the_loop_step = watched_let_step
        daemon.forget(times[1], times[1])  # the loop is running: it steps, then the pass
        gated.gate.clear()
        try:
            assert gated.waiting.wait(60)  # the loop is stuck before its next beat
            watch.wait_s = 0.0  # no waiting for a loop that is stuck: the forgets go ahead at once
            daemon.forget(times[2], times[2])  # (the loop may have stepped after the first pass, before it stuck)
            beats = gated.beats
            daemon.forget(times[3], times[3])
            assert gated.beats == beats  # the pass beat nothing for a loop that took no step since the last pass
            watch.wait_s = 300.0
            waiting_for_the_loop.clear()
            done = threading.Event()
            worker = threading.Thread(target=lambda: (daemon.forget(times[4], times[4]), done.set()))
            worker.start()
            assert waiting_for_the_loop.wait(60)
            assert not done.is_set() and 4 in daemon.session.pair_times  # it waits for the loop's step
            gated.gate.set()  # the loop steps
            assert done.wait(120)
            worker.join(60)
            assert 4 not in daemon.session.pair_times
        finally:
            gated.gate.set()  # a failed check leaves no loop stuck for the stop
        assert steps_at_pass[0] and steps_at_pass[2:] == [False, True], steps_at_pass


def test_a_long_forget_that_makes_progress_keeps_the_watchdog_pinging_and_one_that_hangs_does_not(tiny_checkpoint,
                                                                                                 tmp_path):
    """WatchdogSec=30 (a ping withheld when the loop's heartbeat is older than 15 s): a forget of four parts of 10 s
    each (the cache, the archive, the evidence frames, the snapshot), 40 s in all, keeps every tick pinging; a part
    that takes 20 s (stuck) lets the tick in it be withheld."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    from edgekv.apps.daemon.systemd import Heartbeat, Watchdog

    now = [1000.0]
    sent: list[str] = []
    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out.txt") as daemon:
        times = dict(daemon.session.pair_times)
        with daemon.lock:
            daemon.state.snapshot(daemon.session)
        loop = daemon._loop_thread
        # the fake clock reads 1000 for the loop's own beats: they count its steps, never as progress at a later
        # time (whenever the loop happens to turn), so only the forget's beats can keep the heartbeat fresh
        daemon.heartbeat = Heartbeat(clock=lambda: 1000.0 if threading.current_thread() is loop else now[0])
        watchdog = Watchdog(daemon.heartbeat, 30.0, send=lambda state: sent.append(state) or True)
        ticks: list[bool] = []
        step = {"s": 10.0}

        def slow(part):
            def run(*args, **kwargs):
                now[0] += step["s"]
                ticks.append(watchdog.tick())
                return part(*args, **kwargs)
            return run

        daemon.session.forget = slow(daemon.session.forget)
        daemon.session.recall.archive.forget = slow(daemon.session.recall.archive.forget)
        daemon.frames.forget = slow(daemon.frames.forget)
        daemon.state.rewrite_after_forget = slow(daemon.state.rewrite_after_forget)
        result = daemon.forget(times[5], times[5])
        assert result["pairs"] == 1 and result["snapshots"]["snapshot"]
        assert ticks == [True, True, True, True] and sent == ["WATCHDOG=1"] * 4
        assert watchdog.withheld == 0
        ticks.clear()
        step["s"] = 20.0  # each part now as long as a hang
        daemon.forget(times[7], times[7])
        assert ticks and not any(ticks) and watchdog.withheld == len(ticks)


def test_a_window_no_forget_can_do_is_refused_before_it_is_noted_and_struck_off_at_the_start(tiny_checkpoint,
                                                                                              tmp_path):
    """``Daemon.forget(10, 5)`` (the Python API; the fleet and ROS 2 reach it too) was noted in the journal, then
    failed; every later start did it again and failed: "cannot start: forget: expected a window from <= to"."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    from edgekv.apps.daemon.forget_journal import ForgetJournal

    journal = ForgetJournal(tmp_path / "state")
    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out1.txt") as daemon:
        for window in [(10.0, 5.0), (float("nan"), 5.0), (1.0, float("inf"))]:
            with pytest.raises(ValueError, match="from <= to"):
                daemon.forget(*window)
        with pytest.raises(ValueError, match="from and to"):
            daemon.forget(3.0)
        assert journal.pending() == []
        t = daemon.session.pair_times[4]
    journal.add([(10.0, 5.0)], 0.125, None, None)  # what the edgekv before this one left
    journal.add([(t, t)], 0.125, None, None)
    with ended_daemon(_config(tiny_checkpoint, tmp_path), tmp_path / "out2.txt") as daemon:
        assert 4 not in daemon.session.pair_times and journal.pending() == []
    said = (tmp_path / "out2.txt").read_text()
    assert "a window no forget can do (t=10..5 s): struck off" in said, said


def test_edgekv_forget_says_when_no_snapshot_held_the_window():
    """The CLI's line said ", no snapshots" (as if persistence were off) when the daemon wrote none because none
    held the window."""
    from edgekv.apps.forget import _summary
    from edgekv.state import StateKeeper

    result = {"from": 10.0, "to": 12.0, "pairs": 4, "cache_slots": 64, "archive": None,
              "snapshots": {"snapshot": None, "removed": [], "note": StateKeeper.FORGET_NOT_HELD}}
    assert _summary(result).endswith(", no archive, no snapshot held the window: none rewritten")
    result["snapshots"] = {"snapshot": None, "removed": []}  # persistence off
    assert _summary(result).endswith(", no snapshots")


def test_edgekv_forget_finds_the_daemon_and_its_token_from_its_config(tiny_checkpoint, tmp_path, capsys):
    """``edgekv ask --config X.yaml`` found the daemon and its token in the config; ``edgekv forget --config X.yaml``
    refused ("--config: only with --fleet")."""
    pytest.importorskip("fastapi")
    import socket

    import yaml
    from helpers_server import ended_daemon

    from edgekv.apps.cli import main
    from edgekv.config import load_config

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        "video": {"source": "synthetic:shapes?size=160x120&fps=8&frames=16", "fps": 8.0, "resolution": [56, 56]},
        "cache": {"policy": "full", "max_tokens": 400, "text_reserve_tokens": 64},
        "server": {"port": port, "token": "s3cret"}, "monitor": {"backend": "cpu"}}))
    with ended_daemon(load_config(str(path)), tmp_path / "out.txt") as daemon:
        assert daemon.server.port == port
        capsys.readouterr()
        assert main(["forget", "--config", str(path), "--last", "1"]) == 0
        assert capsys.readouterr().out.startswith("forgot t=")
        assert main(["forget", "--url", f"http://127.0.0.1:{port}", "--last", "1"]) == 2  # no token: 401
