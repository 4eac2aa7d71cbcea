"""Faults in the middle of a paced snapshot (``edgekv.state._Paced``: synced ``PACE_BYTES`` at a time, a watchdog
beat after each step): a full disk or an I/O error at a step's sync, a beat that raises, plain and sealed. The
previous snapshot stays as it was, no temporary file is left, and the error says what happened.

Before: a forget whose snapshot rewrite met a full disk answered "the snapshot after forgetting could not be written
in DIR" without the reason (the keeper had it: ``last_error``)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import edgekv.state
from edgekv.state import write_snapshot
from test_snapshot_pace import _sealer, _views


class _FailingSync:
    """``_sync_data`` failing with ``code`` at its ``at``-th call (and succeeding otherwise)."""

    def __init__(self, code: int, at: int = 3) -> None:
        self.code, self.at, self.calls = code, at, 0

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise OSError(self.code, os.strerror(self.code))


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("sealed", [False, True])
@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_a_sync_failing_mid_snapshot_leaves_the_previous_one_and_no_temp_file(tmp_path, monkeypatch, sealed, code):
    path = tmp_path / "s.snap"
    write_snapshot(path, {"format": 1, "generation": 1}, _views(), _sealer(sealed))
    before = path.read_bytes()
    monkeypatch.setattr(edgekv.state, "PACE_BYTES", 256 << 10)
    failing = _FailingSync(code)
    monkeypatch.setattr(edgekv.state, "_sync_data", failing)
    steps: list[int] = []
    with pytest.raises(OSError) as raised:
        write_snapshot(path, {"format": 1, "generation": 2}, _views(), _sealer(sealed),
                       progress=lambda: steps.append(failing.calls))
    assert raised.value.errno == code and steps == [1, 2]
    assert path.read_bytes() == before and _left(tmp_path) == ["s.snap"]


@pytest.mark.parametrize("sealed", [False, True])
def test_a_beat_that_raises_mid_snapshot_leaves_the_previous_one_and_no_temp_file(tmp_path, monkeypatch, sealed):
    path = tmp_path / "s.snap"
    write_snapshot(path, {"format": 1}, _views(), _sealer(sealed))
    before = path.read_bytes()
    monkeypatch.setattr(edgekv.state, "PACE_BYTES", 256 << 10)
    monkeypatch.setattr(edgekv.state, "_sync_data", lambda fd: None)

    def beat() -> None:
        raise RuntimeError("the watchdog's socket is gone")
    with pytest.raises(RuntimeError, match="socket is gone"):
        write_snapshot(path, {"format": 1, "generation": 2}, _views(), _sealer(sealed), progress=beat)
    assert path.read_bytes() == before and _left(tmp_path) == ["s.snap"]


def test_a_forget_whose_snapshot_meets_a_full_disk_says_so_and_keeps_the_older_one(tiny_checkpoint, tmp_path,
                                                                                   monkeypatch):
    pytest.importorskip("fastapi")
    from helpers_server import ended_daemon, kept_config

    with ended_daemon(kept_config(tiny_checkpoint, tmp_path, max_tokens=800), tmp_path / "out.txt") as daemon:
        with daemon.lock:
            first = daemon.state.snapshot(daemon.session)
        assert first is not None
        before = first.path.read_bytes()
        monkeypatch.setattr(edgekv.state, "PACE_BYTES", first.bytes // 8)
        monkeypatch.setattr(edgekv.state, "_sync_data", _FailingSync(errno.ENOSPC))
        times = dict(daemon.session.pair_times)
        with pytest.raises(OSError) as raised:
            daemon.forget(times[5], times[5])
        said = str(raised.value)
        assert "snapshot after forgetting could not be written" in said and os.strerror(errno.ENOSPC) in said, said
        assert first.path.read_bytes() == before
        assert [p.name for p in (tmp_path / "state").iterdir() if p.name.startswith(".")] == []
        assert os.strerror(errno.ENOSPC) in (tmp_path / "out.txt").read_text()
