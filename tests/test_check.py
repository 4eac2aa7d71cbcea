"""``edgekv-camera --check`` (apps/daemon/check.py): every start-up check run and said without loading the model —
all the mistakes of an edited config at once, not the first one a restart stops at; beside the running daemon its
own state.dir lock and port are notes naming it, not failures; a port another program holds, a camera that does not
deliver, a stream not up are told apart; nothing is written."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
from helpers_check import check_config, run_check

from edgekv.apps.daemon.camera import main


def _config(tmp_path: Path, model: Path, **sections) -> Path:
    return check_config(tmp_path, model, **sections)


def _check(path: Path, capsys) -> tuple[int, dict[str, tuple[str, str]]]:
    return run_check(path, capsys)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_good_config_passes_every_check_without_loading_the_model(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    import edgekv

    monkeypatch.setattr(edgekv.Runtime, "from_config", lambda *a, **k: pytest.fail("--check loaded the model"))
    path = _config(tmp_path, tiny_checkpoint, state={"dir": str(tmp_path / "state")},
                   logging={"file": str(tmp_path / "logs" / "edgekv.log")})
    (tmp_path / "logs").mkdir()
    code, results = _check(path, capsys)
    assert code == 0, results
    assert {k: s for k, (s, _) in results.items()} == {
        "logging.file": "ok", "model.path": "ok", "cache.calibration": "ok", "state.dir, archive.dir": "ok",
        "archive.dir records": "ok", "privacy keys": "ok", "state.dir lock": "ok", "server packages": "ok",
        "server.host:port": "ok", "server TLS": "ok",
        "client TLS (escalate:, alerts:)": "ok", "video.source": "ok", "cache budget": "ok", "state.max_mib": "ok",
        "state.dir memory": "ok", "device memory": "ok",
        "flash": "note", "engines": "note"}  # torch runs both: no engines (tests/test_check_engines.py)
    assert "config.json" in results["model.path"][1]
    assert "a 160x120 frame read" in results["video.source"][1]
    assert "plain HTTP" in results["server TLS"][1]
    assert not (tmp_path / "logs" / "edgekv.log").exists()  # nothing written: no log file, no snapshot
    assert {p.name for p in (tmp_path / "state").iterdir()} <= {"state.lock"}


def test_every_mistake_is_said_at_once(tiny_checkpoint, tmp_path, capsys):
    """Four mistakes in one edit: a restart would have stopped at the first, four restarts to find them all."""
    (tmp_path / "state-file").write_text("not a folder")
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    path = _config(tmp_path, tiny_checkpoint, cache={"calibration": str(tmp_path / "missing-cv.yaml")},
                   state={"dir": str(tmp_path / "state-file")},
                   server={"tls_cert_file": str(tmp_path / "cert.pem"), "tls_key_file": str(tmp_path / "key.pem")},
                   video={"source": str(tmp_path / "missing.mp4")})
    code, results = _check(path, capsys)
    assert code == 2
    failed = {k: d for k, (s, d) in results.items() if s == "FAIL"}
    assert set(failed) >= {"cache.calibration", "state.dir, archive.dir", "server TLS", "video.source"}, results
    assert "no such file" in failed["cache.calibration"] and "is not a folder" in failed["state.dir, archive.dir"]
    assert "tls_cert_file" in failed["server TLS"] and "missing.mp4" in failed["video.source"]
    assert results["model.path"][0] == "ok"


@pytest.mark.parametrize("token", [None, "s3cret"])
def test_beside_the_running_daemon_its_lock_and_port_are_notes(tiny_checkpoint, tmp_path, capsys, token):
    """With a token the daemon's /healthz says only its status word to who lacks it: the check sends the config's
    token (before, it took the daemon for another program's port: a FAIL)."""
    from edgekv.config import load_config
    from helpers_server import RunningDaemon

    port = _free_port()
    path = _config(tmp_path, tiny_checkpoint, state={"dir": str(tmp_path / "state")}, server={"port": port,
                                                                                               "token": token})
    with RunningDaemon(load_config(str(path)), tmp_path / "out.txt") as run:
        assert run.port == port
        code, results = _check(path, capsys)
        assert run.thread.is_alive() and run.daemon.stream_state == "running"  # the check took nothing from it
    assert code == 0, results
    status, detail = results["state.dir lock"]
    assert status == "note" and "a restart takes it over" in detail and "process" in detail
    status, detail = results["server.host:port"]
    assert status == "note" and "served now by an edgekv daemon (ok, running, " in detail, detail


def test_a_port_another_program_holds_fails(tiny_checkpoint, tmp_path, capsys):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(1)
        path = _config(tmp_path, tiny_checkpoint, server={"port": other.getsockname()[1]})
        code, results = _check(path, capsys)
    assert code == 2 and results["server.host:port"][0] == "FAIL" and "already in use" in results["server.host:port"][1]


def test_a_stream_not_up_is_a_note_or_a_failure_as_the_daemon_would_take_it(tiny_checkpoint, tmp_path, capsys):
    with socket.socket() as booting:  # bound, not listening: connections refused, as a camera still booting
        booting.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{booting.getsockname()[1]}/camera.mjpg"
        code, results = _check(_config(tmp_path, tiny_checkpoint, video={"source": url}), capsys)
        assert code == 0 and results["video.source"][0] == "note", results
        assert "the daemon would start and connect it" in results["video.source"][1]
        code, results = _check(_config(tmp_path, tiny_checkpoint, video={"source": url, "wait_for_stream": False}),
                               capsys)
        assert code == 2 and results["video.source"][0] == "FAIL" and "could not open it" in results["video.source"][1]


def test_each_camera_of_several_is_checked(tiny_checkpoint, tmp_path, capsys):
    path = _config(tmp_path, tiny_checkpoint, video={"sources": [
        {"name": "front", "source": "synthetic:shapes?size=160x120&fps=8&frames=100"},
        {"name": "back", "source": str(tmp_path / "missing.mp4")}]})
    assert main(["--config", str(path), "--check"]) == 2
    out = capsys.readouterr().out
    assert "[front] ok    video.source" in out and "[back] FAIL  video.source" in out and "missing.mp4" in out
    assert out.rstrip().endswith("1 problem(s): the daemon would not start")


def test_a_key_kept_as_a_systemd_credential_is_a_note_outside_the_service(tiny_checkpoint, tmp_path, capsys,
                                                                          monkeypatch):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    (tmp_path / "cert.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    path = _config(tmp_path, tiny_checkpoint, server={"tls_cert_file": str(tmp_path / "cert.pem"),
                                                      "tls_key_credential": "edgekv-tls.key"})
    code, results = _check(path, capsys)
    assert code == 0 and results["server TLS"][0] == "note", results
    assert "systemd credential" in results["server TLS"][1] and "edgekv-tls.key" in results["server TLS"][1]


def test_a_key_that_does_not_open_the_memory_fails_the_check(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    """A key rotated without the old one in previous_key_files, or a key file gone: "the daemon would start" was said,
    and the start stopped only once the model had loaded."""
    pytest.importorskip("cryptography")
    import os

    import edgekv
    from helpers_privacy import privacy_runtime, seen_session

    old, new = tmp_path / "old.key", tmp_path / "new.key"
    for key in (old, new):
        key.write_bytes(os.urandom(32))
        key.chmod(0o400)
    (tmp_path / "state").mkdir()
    seen_session(privacy_runtime(tiny_checkpoint, key_file=str(old)), frames=4).save(
        tmp_path / "state" / "snapshot-00000001.ekv")
    monkeypatch.setattr(edgekv.Runtime, "from_config", lambda *a, **k: pytest.fail("--check loaded the model"))
    for privacy, wanted in (({"key_file": str(new)}, "snapshot-00000001.ekv: sealed with key"),
                            ({"key_file": str(tmp_path / "gone.key")}, "gone.key: no such key file"),
                            ({}, "snapshot-00000001.ekv: the snapshot is encrypted")):
        code, results = _check(_config(tmp_path, tiny_checkpoint, state={"dir": str(tmp_path / "state")},
                                       privacy=privacy), capsys)
        assert code == 2 and results["privacy keys"][0] == "FAIL" and wanted in results["privacy keys"][1], results
    code, results = _check(_config(tmp_path, tiny_checkpoint, state={"dir": str(tmp_path / "state")},
                                   privacy={"key_file": str(new), "previous_key_files": [str(old)]}), capsys)
    assert code == 0 and results["privacy keys"][0] == "ok", results


def test_the_memorys_writes_to_flash_are_said(tiny_checkpoint, tmp_path, capsys):
    """With state.dir or archive.dir set, the last line before the verdict says what the memory writes to flash a day
    (edgekv plan's figure), each camera's summed: flash wears by it."""
    from edgekv.calibration.plan import flash_lines
    from edgekv.config import load_config

    path = _config(tmp_path, tiny_checkpoint, state={"dir": str(tmp_path / "state")},
                   archive={"dir": str(tmp_path / "archive")})
    code, results = _check(path, capsys)
    day = next(line for line in flash_lines(load_config(str(path)), tiny_checkpoint, 16)
               if line.startswith("writes to flash"))
    assert code == 0 and results["flash"][0] == "note", results
    assert f"about {day.rsplit('; ', 1)[-1].split(' GB')[0]} GB a day" in results["flash"][1]
    _, results = _check(_config(tmp_path, tiny_checkpoint), capsys)
    assert "flash" not in results  # nothing kept, nothing written


def _board(root: Path, total_kb: int, mode: int | None) -> Path:
    """A Jetson's files as the check reads them: MemTotal, nv_tegra_release, nvpmodel's status and modes (the AGX
    Orin's names; ids as /etc/nvpmodel.conf has them)."""
    (root / "proc").mkdir(parents=True)
    (root / "proc" / "meminfo").write_text(f"MemTotal: {total_kb} kB\nMemFree: 1000000 kB\nBuffers: 0 kB\n"
                                           "Cached: 0 kB\n")
    (root / "etc").mkdir()
    (root / "etc" / "nv_tegra_release").write_text("# R36 (release), REVISION: 4.3\n")
    (root / "etc" / "nvpmodel.conf").write_text("< POWER_MODEL ID=0 NAME=MAXN >\n< POWER_MODEL ID=1 NAME=15W >\n"
                                                "< POWER_MODEL ID=2 NAME=30W >\n")
    if mode is not None:
        (root / "var" / "lib" / "nvpmodel").mkdir(parents=True)
        (root / "var" / "lib" / "nvpmodel" / "status").write_text(f"pmode:{mode:04d} fmode:quiet\n")
    return root


def test_the_device_its_memory_and_power_mode(tiny_checkpoint, tmp_path):
    """The device the daemon would run on: the cap against its memory (edgekv plan's estimate: a note when it says
    it does not fit, not a refusal) and, on a Jetson, a power mode other than MAXN said (decode rates are quoted at
    MAXN: NanoLLM#38)."""
    from edgekv.apps.daemon.check import device_results
    from edgekv.config import EdgeKVConfig

    config = EdgeKVConfig().with_overrides(model={"path": str(tiny_checkpoint), "dtype": "fp32", "device": "cpu"},
                                           video={"resolution": [112, 112]},
                                           cache={"max_tokens": 400, "text_reserve_tokens": 96})
    memory, power = device_results(config, root=str(_board(tmp_path / "agx", 64 * 2**20, mode=2)))
    assert memory.status == "ok" and "64.0 GiB (this Jetson's unified memory)" in memory.detail
    assert "cache.max_tokens 400 fits" in memory.detail
    assert power.status == "note" and "30W (id 2), not MAXN" in power.detail
    _, power = device_results(config, root=str(_board(tmp_path / "maxn", 64 * 2**20, mode=0)))
    assert (power.status, power.detail) == ("ok", "MAXN (id 0)")
    _, power = device_results(config, root=str(_board(tmp_path / "unknown", 64 * 2**20, mode=None)))
    assert power.status == "note" and "not known" in power.detail
    small = _board(tmp_path / "tiny", 2 * 2**20, mode=0)  # 2 GiB: not even the 2 GB reserve and the weights
    memory, _ = device_results(config.with_overrides(cache={"max_tokens": 4000}), root=str(small))
    assert memory.status == "note" and "the plan's estimate" in memory.detail


def test_an_archive_for_another_model_fails_before_the_model_loads_and_another_kv_dtype_is_a_note(
        tiny_checkpoint, tmp_path, capsys):
    """An archive written for another model (or with another index_keys) was refused only once the model had loaded
    (the memory offline for the restart): the check, and the start's preflight, now say it first. One written with
    another archive.kv_dtype (int8, the config now int4) is read as it is: a note naming both."""
    import torch

    from edgekv.archive.store import FrameArchive
    from edgekv.calibration.plan import archive_shape
    from edgekv.config import EdgeKVConfig

    folder = tmp_path / "archive"
    written = EdgeKVConfig().with_overrides(model={"path": str(tiny_checkpoint), "dtype": "fp32"},
                                            archive={"dir": str(folder), "kv_dtype": "int8"})
    shape, _ = archive_shape(written, tiny_checkpoint)
    archive = FrameArchive(folder, shape, max_bytes=1 << 24, segment_bytes=1 << 20, stage_dtype=torch.float32)
    k = torch.randn(shape.layers, shape.kv_heads, 4, shape.head_dim)
    assert archive.submit(k, k, frame=0, t=0.0, tpos=0, t_offset=0, rows=2, cols=2, stream=b"s" * 16)
    archive.close()
    code, results = _check(_config(tmp_path, tiny_checkpoint, archive={"dir": str(folder), "kv_dtype": "int4"}),
                           capsys)
    assert code == 0 and results["archive.dir records"] == (
        "note", "another kv_dtype: its records are int8, read as they are until retention or a forget removes them; "
                "new ones are written as int4 (archive.kv_dtype)"), results
    code, results = _check(_config(tmp_path, tiny_checkpoint, archive={"dir": str(folder), "kv_dtype": "int8"}),
                           capsys)
    assert code == 0 and results["archive.dir records"] == ("ok", "records of int8, as this config writes them")
    code, results = _check(_config(tmp_path, tiny_checkpoint, archive={"dir": str(folder), "index_keys": 3,
                                                                        "kv_dtype": "int8"}), capsys)
    assert code == 2 and "was indexed with archive.index_keys=2, this config has 3" in results["archive.dir records"][1]


def test_a_pause_kept_from_the_last_stop_is_said(tiny_checkpoint, tmp_path, capsys):
    """The privacy switch on at the last stop (state.dir/paused.json): the start keeps the camera closed, and
    ``--check`` said nothing of it — a user restarting to get the camera back found it paused."""
    import json

    state = tmp_path / "state"
    path = _config(tmp_path, tiny_checkpoint, state={"dir": str(state)})
    code, results = _check(path, capsys)
    assert code == 0 and "privacy pause" not in results
    state.mkdir(exist_ok=True)
    (state / "paused.json").write_text(json.dumps({"reason": "privacy switch", "since_unix": 1.0}))
    code, results = _check(path, capsys)
    assert code == 0, results
    status, detail = results["privacy pause"]
    assert status == "note" and "paused (privacy switch) at the last stop" in detail and "resume" in detail
