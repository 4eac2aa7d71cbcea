"""The camera daemon's persistent memory: SIGTERM saves the session, the next start resumes it and the
stream goes on (the restarted source's clock is moved past the restored one)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgekv.config import EdgeKVConfig

pytest.importorskip("cv2")


def _run_until_pairs(config: Path, pairs: int) -> str:
    process = subprocess.Popen([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(config), "--no-stdin"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines, seen = [], 0
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and seen < pairs:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line)
        seen += line.startswith("pair ")
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=60)
    text = "".join(lines) + out
    assert process.returncode == 0, text
    return text


@pytest.mark.slow
def test_sigterm_saves_the_memory_and_the_next_start_resumes_it(tiny_checkpoint, tmp_path):
    state_dir = tmp_path / "state"
    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=100000", "fps": 4.0, "resolution": [56, 56]},
        cache={"policy": "infinipot_v", "max_tokens": 128, "text_reserve_tokens": 48},
        server={"enabled": False}, monitor={"interval_s": 0.5, "backend": "cpu"},
        state={"dir": str(state_dir), "every_s": 3600.0},
    )
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps(config.to_dict()))  # JSON is YAML
    first = _run_until_pairs(path, 3)
    assert f"no snapshot in {state_dir}: starting with an empty memory" in first
    saved = re.search(r"memory saved: .*, ([\d,]+) tokens in (\S+) ", first)
    assert saved, first
    tokens = int(saved.group(1).replace(",", ""))
    assert Path(saved.group(2)).is_file()
    frames_before, pairs_before = map(int, re.search(r"^frames (\d+) \((\d+) pairs\)", first, re.M).groups())

    second = _run_until_pairs(path, 3)
    resumed = re.search(r"resumed .* of memory, ([\d,]+) tokens \(([\d,]+) frames;", second)
    assert resumed, second
    assert int(resumed.group(1).replace(",", "")) == tokens and int(resumed.group(2)) == frames_before
    assert "back in time" not in second and "frame skipped" not in second
    # the memory grew by the three pairs this run printed (a frame held for its pair at SIGTERM is saved with the
    # snapshot and completes the first pair of the next run, so count pairs, not frames)
    frames_after, pairs_after = map(int, re.search(r"^frames (\d+) \((\d+) pairs\)", second, re.M).groups())
    assert pairs_after >= pairs_before + 3 and frames_after >= 2 * pairs_after
    assert len(list(state_dir.glob("snapshot-*.ekv"))) == 2


def test_a_second_daemon_on_the_same_state_dir_is_refused_before_the_model_loads(tiny_checkpoint, tmp_path):
    """Two daemons given one state.dir (a service and a hand-started copy) numbered their snapshots past each
    other's and deleted each other's generations; the next start resumed whichever wrote last. Now the second
    is refused at start, naming the holder; the holder's end lets go (no stale lock after a crash)."""
    from edgekv.config import StateSection
    from edgekv.state import StateKeeper

    state_dir = tmp_path / "state"
    first, second = (StateKeeper(StateSection(dir=str(state_dir)), say=lambda line: None) for _ in range(2))
    first.hold()
    first.hold()  # idempotent
    with pytest.raises(RuntimeError, match=r"state\.dir .*state is in use by another edgekv daemon \(this process: "):
        second.hold()
    first.release()
    second.hold()
    second.release()
    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=8", "fps": 4.0, "resolution": [56, 56]},
        cache={"policy": "infinipot_v", "max_tokens": 128, "text_reserve_tokens": 48},
        server={"enabled": False}, monitor={"backend": "cpu"}, state={"dir": str(state_dir), "every_s": 3600.0})
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps(config.to_dict()))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from edgekv.config import StateSection; from edgekv.state import "
         "StateKeeper; StateKeeper(StateSection(dir=sys.argv[1])).hold(); print('held', flush=True); sys.stdin.read()",
         str(state_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        refused = subprocess.run([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(path), "--no-stdin",
                                  "--exit-at-end"], capture_output=True, text=True, timeout=300)
    finally:
        holder.stdin.close()
        holder.wait(60)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert f"cannot start: state.dir {state_dir} is in use by another edgekv daemon (process {holder.pid}: another " \
           f"edgekv daemon with the same state.dir?)" in refused.stderr
    assert "model" not in refused.stdout  # refused before the model loaded
    ran = subprocess.run([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(path), "--no-stdin",
                          "--exit-at-end"], capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert "memory saved" in ran.stdout + ran.stderr


def test_the_memory_on_disk_is_on_metrics(tiny_checkpoint, tmp_path):
    """Snapshots written, failed and not needed (the memory unchanged) and the age of the memory on disk, for an
    alert that says the memory stopped being saved (a full disk, state.max_mib)."""
    parser = pytest.importorskip("prometheus_client.parser")
    import urllib.request

    from helpers_server import RunningDaemon, server_config

    config = server_config(tiny_checkpoint).with_overrides(state={"dir": str(tmp_path / "state"), "every_s": 0.2})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        deadline = time.monotonic() + 60
        while run.daemon.state.written < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        with urllib.request.urlopen(run.base + "/metrics", timeout=60) as response:
            families = {f.name: f for f in parser.text_string_to_metric_families(response.read().decode())}
        keeper = run.daemon.state
        written = families["edgekv_snapshots_written"].samples[0].value
        assert 1 <= written <= keeper.written
        assert families["edgekv_snapshots_failed"].samples[0].value == keeper.failures == 0
        assert "edgekv_snapshots_unchanged" in families
        assert 0 <= families["edgekv_snapshot_age_seconds"].samples[0].value < 120


def test_a_frame_limit_counts_the_frames_of_this_run_not_of_the_restored_memory(tiny_checkpoint, tmp_path):
    """``video.max_frames`` / ``--max-frames`` ingest N frames: restarted with 560 frames in its memory, a daemon with
    a limit of 500 stopped at once and ingested nothing."""
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon

    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=48", "fps": 8.0, "resolution": [56, 56],
               "max_frames": 12},
        cache={"policy": "sliding_window", "max_tokens": 400, "text_reserve_tokens": 64}, server={"port": 0},
        monitor={"backend": "cpu"}, generation={"max_new_tokens": 2}, state={"dir": str(tmp_path / "state")})
    for run, total in ((1, 12), (2, 24)):
        with ended_daemon(config, tmp_path / f"out{run}.txt") as daemon:
            assert daemon.session.counters.frames == total
        assert f"video.max_frames 12 reached after {total} frames" in (tmp_path / f"out{run}.txt").read_text()
