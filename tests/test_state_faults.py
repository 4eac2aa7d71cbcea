"""Persistent memory under faults (issue 26, item 8): a snapshot whose checksums hold but whose manifest lacks
a field is set aside like any unreadable snapshot (before: every start exited 1, a crash loop under systemd);
SIGHUP saves the memory and the daemon goes on (before: SIGHUP killed it without saving)."""

from __future__ import annotations

import hashlib
import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import edgekv
from edgekv.config import EdgeKVConfig, StateSection
from edgekv.state import StateKeeper

RES = (56, 84)
_TRAILER = struct.Struct("<QQ32s16s")


@pytest.fixture(scope="module")
def runtime(tiny_checkpoint, tmp_path_factory):
    return edgekv.Runtime.from_pretrained(
        tiny_checkpoint, model={"dtype": "fp32", "device": "cpu"}, video={"resolution": list(RES), "fps": 2.0},
        cache={"policy": "sliding_window", "max_tokens": 96, "text_reserve_tokens": 24},
        engines={"engine_dir": str(tmp_path_factory.mktemp("engines"))})


def _rewrite_manifest(path: Path, edit) -> None:
    """Change the manifest of a snapshot and write valid checksums for it (the tensors are left as they are)."""
    data = path.read_bytes()
    offset, length, _, end = _TRAILER.unpack(data[-_TRAILER.size:])
    manifest = json.loads(data[offset:offset + length])
    edit(manifest)
    body = json.dumps(manifest, sort_keys=True).encode()
    path.write_bytes(data[:offset] + body + _TRAILER.pack(offset, len(body), hashlib.sha256(body).digest(), end))


@pytest.mark.parametrize("missing", ["key", "session", "tensors", "tensor offset", "cache_length"])
def test_a_snapshot_missing_a_field_is_set_aside(runtime, tmp_path, missing):
    session = runtime.session()
    rng = np.random.default_rng(0)
    for i in range(6):
        session.ingest(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8), t=i / 2.0)
    state = tmp_path / "state"
    state.mkdir()
    path = state / "snapshot-00000001.ekv"
    session.save(path)

    def drop(manifest: dict) -> None:
        if missing == "tensor offset":
            del manifest["tensors"]["k"]["offset"]
        elif missing == "cache_length":
            del manifest["session"]["cache_length"]
        else:
            del manifest[missing]

    _rewrite_manifest(path, drop)
    said: list[str] = []
    keeper = StateKeeper(StateSection(dir=str(state)), say=said.append)
    fresh = keeper.restore(runtime)
    assert fresh.counters.frames == 0 and fresh.restored_from is None
    assert (state / "set-aside" / path.name).is_file() and not path.exists()
    assert len(said) == 1 and "starting with an empty memory" in said[0] and path.name in said[0], said


@pytest.mark.slow
def test_sighup_saves_the_memory_and_the_daemon_goes_on(tiny_checkpoint, tmp_path):
    state = tmp_path / "state"
    config = EdgeKVConfig().with_overrides(
        model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=80x60&fps=8&frames=100000", "fps": 4.0, "resolution": list(RES)},
        cache={"policy": "sliding_window", "max_tokens": 96, "text_reserve_tokens": 24},
        server={"enabled": False}, monitor={"interval_s": 0.5, "backend": "cpu"},
        state={"dir": str(state), "every_s": 3600.0})
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps(config.to_dict()))
    process = subprocess.Popen([sys.executable, "-m", "edgekv.apps.daemon.camera", "--config", str(path), "--no-stdin"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sum(line.startswith("pair ") for line in lines) < 2:
            lines.append(process.stdout.readline())
        process.send_signal(signal.SIGHUP)
        while time.monotonic() < deadline and not any("SIGHUP" in line for line in lines):
            line = process.stdout.readline()
            if not line:
                break
            lines.append(line)
        saved = [line for line in lines if "SIGHUP" in line]
        assert saved and "memory saved" in saved[0], "".join(lines)
        assert process.poll() is None, "".join(lines)  # still running
        pairs = sum(line.startswith("pair ") for line in lines)
        while time.monotonic() < deadline and sum(line.startswith("pair ") for line in lines) < pairs + 1:
            lines.append(process.stdout.readline())  # and still ingesting
        assert list(state.glob("snapshot-*.ekv"))
    finally:
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)
    assert process.returncode == 0, "".join(lines) + out


def test_a_stop_whose_snapshot_cannot_be_written_says_what_the_next_start_resumes(runtime, tmp_path, monkeypatch):
    """Probed with state.dir on a full 2 MiB tmpfs: the stop logged a warning that named no folder and printed its
    usual summary; nothing said that the memory since the last snapshot would be gone at the next start."""
    from helpers_disk import full_disk_at_rename

    later = [0.0]
    said: list[str] = []
    keeper = StateKeeper(StateSection(dir=str(tmp_path / "state")), say=said.append,
                         wall=lambda: time.time() + later[0])
    session = keeper.restore(runtime)
    rng = np.random.default_rng(0)
    for i in range(4):
        session.ingest(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8), t=i / 2.0)
    assert keeper.snapshot(session) is not None
    session.ingest(rng.integers(0, 256, (60, 80, 3), dtype=np.uint8), t=2.0)
    later[0] = 90.0  # the stop, a minute and a half after that snapshot
    full_disk_at_rename(monkeypatch, ".ekv")
    said.clear()
    assert keeper.final_snapshot(session) is None
    assert said == [f"memory NOT saved at the stop: no snapshot could be written in state.dir {tmp_path / 'state'} "
                    f"(No space left on device); the next start resumes snapshot-00000001.ekv, written 1 min before "
                    f"the stop"]
