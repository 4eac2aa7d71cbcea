"""What the camera saw stays the daemon user's alone on disk, whatever the umask of the shell that started it: the
snapshots and the evidence frames were created 0644 under umask 022 (the unit's UMask=0077 covered the service
alone), readable by every local account."""

from __future__ import annotations

import os
import stat

import pytest


@pytest.fixture
def shell_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_snapshots_and_evidence_frames_are_the_owners_only(tiny_checkpoint, tmp_path, shell_umask):
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon, kept_config

    config = kept_config(tiny_checkpoint, tmp_path, frames=16)
    with ended_daemon(config, tmp_path / "out.txt") as daemon:
        assert daemon.frames.flush()
        with daemon.lock:
            daemon.state.snapshot(daemon.session)
    frames = tmp_path / "archive" / "frames.sqlite"
    kept = [*sorted((tmp_path / "state").glob("snapshot-*.ekv")), frames]
    assert len(kept) >= 2 and frames.stat().st_size > 0
    for path in kept:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, (path.name, oct(path.stat().st_mode))


def test_an_older_world_readable_evidence_file_is_narrowed(tmp_path, shell_umask):
    from edgekv.apps.daemon.frame_store import FrameStore

    store = FrameStore(tmp_path, max_bytes=1 << 20)
    store.close()
    os.chmod(store.path, 0o644)
    FrameStore(tmp_path, max_bytes=1 << 20).close()
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
