"""The daemon's per-pair and per-turn work outside the model stays what one pair needs: counted with wrappers over a
whole run, never timed (how it was found: /work/runs/s98/hot_path.md's probe, cProfile call counts per pair at pair
150 and pair 1,100 of a 1,250-pair cpu-demo run)."""

from __future__ import annotations

import argparse
import re
import threading
from types import SimpleNamespace

import pytest

from edgekv.config import EdgeKVConfig


def _one_shot(model_dir, tmp_path, frames: int, **sections) -> EdgeKVConfig:
    base = {
        "model": {"path": str(model_dir), "dtype": "fp32", "device": "cpu"},
        "video": {"source": f"synthetic:shapes?size=160x120&fps=8&frames={frames}", "fps": 8.0,
                  "resolution": [56, 56]},
        "cache": {"policy": "sliding_window", "max_tokens": 400, "text_reserve_tokens": 64},
        "server": {"port": 0}, "monitor": {"backend": "cpu"}, "generation": {"max_new_tokens": 2},
    }
    base.update(sections)
    return EdgeKVConfig().with_overrides(**base)


def _run(config: EdgeKVConfig, out_path, quiet: bool):
    from edgekv.apps.daemon.loop import Daemon

    args = argparse.Namespace(ask=[], ask_every=0, max_frames=None, no_server=True, no_stdin=True, quiet=quiet,
                              realtime=False, exit_at_end=True)
    with open(out_path, "w") as out:
        daemon = Daemon(config, args, out=out)
        assert daemon.run() == 0
    return daemon


def test_a_pairs_line_does_not_build_the_sessions_whole_stats(tiny_checkpoint, tmp_path, monkeypatch):
    """Each pair's line printed four figures of ``session.stats()``, built whole for every pair (some sixty figures,
    the archive's and the policy's among them, and a sum over the cache's sink flags: a device read on CUDA). The
    line reads its four figures directly; they are the same as the stats'."""
    from edgekv.session.stream import StreamSession

    calls = []
    stats = StreamSession.stats

    def counted(self):
        calls.append(self.counters.frame_pairs)
        return stats(self)

    monkeypatch.setattr(StreamSession, "stats", counted)
    daemon = _run(_one_shot(tiny_checkpoint, tmp_path, frames=48), tmp_path / "out.txt", quiet=False)
    pairs = daemon.session.counters.frame_pairs
    assert pairs == 24
    lines = [line for line in (tmp_path / "out.txt").read_text().splitlines() if line.startswith("pair ")]
    assert len(lines) == pairs
    during = [seen for seen in calls if 0 < seen < pairs]  # while the stream went in: the start's and the end's aside
    assert during == [], f"session.stats() built {len(during)} times for {pairs} pairs"
    final = stats(daemon.session)
    match = re.search(r"cache (\d+)/(\d+) tokens, ([\d.]+) MiB  compressions (\d+)$", lines[-1])
    assert match, lines[-1]
    assert int(match[1]) == final["cache_tokens"] and int(match[2]) == final["cache_capacity_tokens"]
    assert match[3] == f"{final['cache_capacity_bytes'] / 2**20:.2f}" and int(match[4]) == final["compressions"]


def test_a_loop_turn_looks_at_the_loops_only_when_a_snapshot_is_written(tiny_checkpoint, tmp_path, monkeypatch):
    """Every turn of the loop (two or more a pair) worked out which loops a snapshot would hold up — the threads,
    the watchdog, each heartbeat's age — for ``maybe_snapshot``, which writes one every ``state.every_s``: now that
    is done by a snapshot's first step, once a snapshot."""
    from edgekv.apps.daemon.loop import Daemon

    looked = []
    held_up = Daemon._loops_held_up

    def counted(self):
        looked.append(1)
        return held_up(self)

    monkeypatch.setattr(Daemon, "_loops_held_up", counted)
    config = _one_shot(tiny_checkpoint, tmp_path, frames=48, state={"dir": str(tmp_path / "state"), "every_s": 3600})
    daemon = _run(config, tmp_path / "out.txt", quiet=True)
    assert daemon.session.counters.frame_pairs == 24 and daemon.heartbeat.beats >= 48  # a turn or more a frame
    assert daemon.state.written >= 1  # the snapshot at the end
    assert len(looked) <= daemon.state.written, f"{len(looked)} looks for {daemon.state.written} snapshot(s)"


def test_a_snapshots_beats_keep_the_loops_that_were_fresh_when_it_began():
    """Looked at by the snapshot's first step, the loops are those that were fresh when it began: one fresh then
    is beaten though its first step took longer than the watchdog's stall; one already stale is not."""
    from edgekv.apps.daemon.loop import Daemon
    from edgekv.apps.daemon.systemd import Heartbeat

    now = [1000.0]
    daemons = {name: Daemon(EdgeKVConfig()) for name in ("lead", "fresh", "stale")}
    lock = threading.RLock()
    for name, daemon in daemons.items():
        daemon.lock = lock
        daemon._loop_thread = threading.current_thread()  # alive: its loop is held up by the lead's snapshot
        daemon.heartbeat = Heartbeat(clock=lambda: now[0])
    lead = daemons["lead"]
    lead.cameras = daemons
    lead.watchdog = SimpleNamespace(stall_s=10.0)
    daemons["fresh"].heartbeat.last = now[0] - 5.0
    daemons["stale"].heartbeat.last = now[0] - 15.0
    beat = lead._snapshot_beats()
    now[0] += 20.0  # the snapshot's first step reached the disk 20 s later
    beat()
    beat()
    assert [daemons[name].heartbeat.beats for name in ("lead", "fresh", "stale")] == [2, 2, 0]


if __name__ == "__main__":
    pytest.main([__file__, "-n", "0"])
