"""Shared fixtures. Keep this file small: put module-specific helpers next to their tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A random-weight Qwen2.5-VL checkpoint directory (``tiny`` preset: real tokenizer and special ids)."""
    from edgekv.model.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", preset="tiny", seed=0)


@pytest.fixture(autouse=True)
def _root_logging_restored():
    """A daemon run in-process configures the root logger (``logging:`` section: its handlers replaced by a stream
    handler on the sys.stderr of that moment, which under ``capsys`` is the test's own capture, closed after it).
    Put the root logger back after each test, so that a later test's log records do not land on a closed stream
    (a "--- Logging error ---" printed into whatever that test captures)."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    for handler in handlers:
        if handler not in root.handlers:
            root.addHandler(handler)
    root.setLevel(level)


@pytest.fixture
def small_disk(tmp_path):
    """A 512 KiB tmpfs mounted for the test, a disk that fills (root only; CI runs as root), unmounted after."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("a full disk needs a small tmpfs, and mounting one needs root (CI runs as root)")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or done.returncode}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


@pytest.fixture
def zone(monkeypatch):
    """``zone("Europe/Berlin")`` makes that this process's local zone (the daemon's, in-process); the machine's is
    back after the test."""
    import time

    def use(name: str) -> None:
        monkeypatch.setenv("TZ", name)
        time.tzset()

    try:
        yield use
    finally:
        monkeypatch.undo()
        time.tzset()
