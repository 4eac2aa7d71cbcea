"""Encryption at rest (issue 31 §2): sealed snapshots hold none of the plaintext K/V bytes; restoring with the
key is bit-identical; a wrong or missing key is a one-line error naming the file, which is left untouched; key
rotation through previous_key_files; keys from a file, an environment variable and a systemd credential."""

from __future__ import annotations

import base64
import hashlib
import os

import numpy as np
import pytest
import torch
from helpers_privacy import privacy_runtime, seen_session

from edgekv.config import ConfigError, StateSection, config_from_dict
from edgekv.state import StateKeeper, read_manifest

pytest.importorskip("cryptography", reason="cryptography not installed (pip install 'edgekv[privacy]')")
from edgekv.privacy import KeyRing, SealError  # noqa: E402







def _key(path) -> str:
    path.write_bytes(os.urandom(32))
    return str(path)


def _runs(session) -> list[bytes]:
    n = session.cache.length
    k = session.cache.k[:, :, :n].contiguous().numpy().tobytes()
    v = session.cache.v[:, :, :n].contiguous().numpy().tobytes()
    return [k[i:i + 32] for i in range(0, len(k), len(k) // 40)] + [v[i:i + 32] for i in range(0, len(v), len(v) // 40)]


def test_a_sealed_snapshot_hides_the_kv_and_restores_bit_identically(tiny_checkpoint, tmp_path):
    key = _key(tmp_path / "memory.key")
    rt = privacy_runtime(tiny_checkpoint, key_file=key)
    session = seen_session(rt)
    path = tmp_path / "sealed.ekv"
    session.save(path)
    data = path.read_bytes()
    assert data.startswith(b"EDGEKV-SNAPSEAL") and not any(run in data for run in _runs(session))
    plain = tmp_path / "plain.ekv"
    seen_session(privacy_runtime(tiny_checkpoint)).save(plain)
    assert sum(run in plain.read_bytes() for run in _runs(session)) > 40  # the same runs are there in the clear
    restored = rt.restore(path)
    n = session.cache.length
    for name in ("k", "v", "kind", "frame", "tpos", "sink"):
        assert torch.equal(getattr(restored.cache, name)[:, :, :n], getattr(session.cache, name)[:, :, :n]), name
    assert torch.equal(restored.question_logits("What happened?"), session.question_logits("What happened?"))
    assert torch.equal(torch.from_numpy(restored.ingestor.pending[0]), torch.from_numpy(session.ingestor.pending[0]))


def test_a_wrong_or_missing_key_names_the_file_and_leaves_it_untouched(tiny_checkpoint, tmp_path):
    rt = privacy_runtime(tiny_checkpoint, key_file=_key(tmp_path / "a.key"))
    folder = tmp_path / "state"
    keeper = StateKeeper(StateSection(dir=str(folder), every_s=1.0, max_mib=64), say=lambda line: None)
    session = keeper.restore(rt)
    for index in range(4):
        session.ingest(np.random.default_rng(index).integers(0, 256, size=(60, 80, 3), dtype=np.uint8), t=index / 2.0)
    info = keeper.snapshot(session)
    before = hashlib.sha256(info.path.read_bytes()).hexdigest()
    for other in (privacy_runtime(tiny_checkpoint, key_file=_key(tmp_path / "b.key")), privacy_runtime(tiny_checkpoint)):
        with pytest.raises(SealError) as err:
            StateKeeper(StateSection(dir=str(folder), every_s=1.0, max_mib=64), say=lambda line: None).restore(other)
        message = str(err.value)
        assert str(info.path) in message and "\n" not in message and "left as it is" in message
    assert hashlib.sha256(info.path.read_bytes()).hexdigest() == before
    assert [p.name for p in folder.glob("snapshot-*.ekv")] == [info.path.name] and not (folder / "set-aside").exists()


@pytest.mark.parametrize("where", ["tensor", "salt"])
def test_a_damaged_sealed_snapshot_is_set_aside_and_the_older_generation_resumed(tiny_checkpoint, tmp_path, where):
    """One flipped byte in a sealed snapshot, under the deployment's own key, is damage as in a snapshot in the
    clear: the older generation is resumed. It was a SealError, the wrong key's error: every start stopped on it."""
    rt = privacy_runtime(tiny_checkpoint, key_file=_key(tmp_path / "a.key"))
    section = StateSection(dir=str(tmp_path / "state"), every_s=1.0, max_mib=64)
    keeper = StateKeeper(section, say=lambda line: None)
    session = keeper.restore(rt)
    frames = [np.random.default_rng(index).integers(0, 256, size=(60, 80, 3), dtype=np.uint8) for index in range(8)]
    for index, frame in enumerate(frames[:4]):
        session.ingest(frame, t=index / 2.0)
    older = keeper.snapshot(session)
    for index, frame in enumerate(frames[4:], start=4):
        session.ingest(frame, t=index / 2.0)
    newer = keeper.snapshot(session)
    session.close()
    data = bytearray(newer.path.read_bytes())
    at = read_manifest(newer.path, rt.keys)["tensors"]["k"]["offset"] + 10 if where == "tensor" else 16 + 8 + 3
    data[at] ^= 0x01
    newer.path.write_bytes(bytes(data))
    said = []
    restored = StateKeeper(section, say=said.append).restore(rt)
    assert restored.cache.length == older.cache_tokens and restored.counters.frames == older.frames, said
    assert "resumed" in said[0] and newer.path.name in said[1] and "does not authenticate" in said[1], said
    assert (tmp_path / "state" / "set-aside" / newer.path.name).read_bytes() == bytes(data)


def test_key_rotation_reads_the_old_key_and_writes_the_new(tiny_checkpoint, tmp_path):
    old, new = _key(tmp_path / "old.key"), _key(tmp_path / "new.key")
    session = seen_session(privacy_runtime(tiny_checkpoint, key_file=old))
    first = tmp_path / "old.ekv"
    session.save(first)
    rotated = privacy_runtime(tiny_checkpoint, key_file=new, previous_key_files=[old])
    restored = rotated.restore(first)
    second = tmp_path / "new.ekv"
    restored.save(second)
    new_id = hashlib.sha256(open(new, "rb").read()).digest()[:8]
    assert second.read_bytes()[16:24] == new_id  # sealed with the new key
    assert read_manifest(second, KeyRing.from_section(config_from_dict({"privacy": {"key_file": new}}).privacy))
    with pytest.raises(SealError, match="does not have"):
        privacy_runtime(tiny_checkpoint, key_file=new).restore(first)  # without the old key, the old file does not open


def test_keys_from_a_file_an_environment_variable_and_a_credential(tmp_path, monkeypatch):
    material = os.urandom(32)
    (tmp_path / "raw.key").write_bytes(material)
    (tmp_path / "hex.key").write_text(material.hex() + "\n")
    monkeypatch.setenv("EDGEKV_MEMORY_KEY", base64.b64encode(material).decode())
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "edgekv-memory").write_bytes(material)
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    rings = [KeyRing.from_section(config_from_dict({"privacy": section}).privacy) for section in (
        {"key_file": str(tmp_path / "raw.key")}, {"key_file": str(tmp_path / "hex.key")},
        {"key_env": "EDGEKV_MEMORY_KEY"}, {"key_credential": "edgekv-memory"})]
    assert len({ring.current.id for ring in rings}) == 1
    (tmp_path / "short.key").write_bytes(b"too short")
    with pytest.raises(SealError, match=r"short.key: not a 256-bit key"):
        KeyRing.from_section(config_from_dict({"privacy": {"key_file": str(tmp_path / "short.key")}}).privacy)
    with pytest.raises(SealError, match="no such key file"):
        KeyRing.from_section(config_from_dict({"privacy": {"key_file": str(tmp_path / "none.key")}}).privacy)
    with pytest.raises(SealError, match=rf"privacy.key_file {tmp_path}: cannot read the key file \(Is a directory\)"):
        KeyRing.from_section(config_from_dict({"privacy": {"key_file": str(tmp_path)}}).privacy)  # was [Errno 21]
    with pytest.raises(ConfigError, match="set one of key_file, key_env and key_credential"):
        config_from_dict({"privacy": {"key_file": "a", "key_env": "B"}})


def test_a_key_file_other_users_can_read_is_warned_of(tmp_path, caplog):
    """The key is read either way (a deployment keeps running), but the log says what it exposes and how to fix it."""
    path = tmp_path / "memory.key"
    path.write_bytes(os.urandom(32))
    section = config_from_dict({"privacy": {"key_file": str(path)}}).privacy
    for mode, warned in ((0o644, True), (0o640, True), (0o600, False), (0o400, False)):
        path.chmod(mode)
        caplog.clear()
        with caplog.at_level("WARNING", logger="edgekv.privacy"):
            assert KeyRing.from_section(section).current is not None
        messages = [r.getMessage() for r in caplog.records]
        assert bool(messages) == warned, (oct(mode), messages)
        if warned:
            assert f"{path}: the key file is readable by other users (mode {mode:o})" in messages[0]
            assert "chmod 400" in messages[0]


def test_a_key_without_cryptography_stops_the_start_not_the_first_snapshot(tiny_checkpoint, tmp_path, monkeypatch):
    """``pip install edgekv`` without ``[privacy]`` and a key configured: the runtime refuses at once, naming the
    extra (a daemon used to run until its first snapshot and lose it to a traceback)."""
    import sys

    for name in [name for name in sys.modules if name == "cryptography" or name.startswith("cryptography.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "cryptography", None)
    with pytest.raises(ImportError, match=r"privacy: encryption at rest needs cryptography \(pip install "
                                          r"'edgekv\[privacy\]'\)"):
        privacy_runtime(tiny_checkpoint, key_file=_key(tmp_path / "memory.key"))
    assert privacy_runtime(tiny_checkpoint).keys is None  # without a key nothing needs it


def test_the_log_holds_no_question_or_answer_text_when_a_key_seals_the_memory(tmp_path):
    """The daemon printed every question and answer, whatever channel they came by, to stdout — journald, on flash:
    a record of what was seen, in the clear, that forget cannot reach. With a key (privacy.log_text unset) the
    log shows lengths for HTTP, voice, ROS 2 and fleet questions; stdin and --ask ones are answered on the console,
    so they are shown; log_text: true brings the text back."""
    from edgekv.apps.daemon.console import format_answer
    from edgekv.apps.questions import Question
    from edgekv.session.results import Answer

    fields = {f.name: None for f in __import__("dataclasses").fields(Answer)}
    answer = Answer(**{**fields, "text": "a red circle", "token_ids": [1, 2], "ttft_s": 0.01, "decode_tok_s": 5.0,
                       "video_tokens": 40})
    private = config_from_dict({"privacy": {"key_file": "k"}}).privacy
    assert not private.logs_text() and config_from_dict({}).privacy.logs_text()
    assert config_from_dict({"privacy": {"key_file": "k", "log_text": True}}).privacy.logs_text()
    for source in ("http", "voice", "ros2", "fleet"):
        line = format_answer(Question("What did you see at the door?", source=source, answer=answer),
                             private.logs_text())
        assert "door" not in line and "red circle" not in line, line
        assert f"Q [{source}]: (29 characters; privacy.log_text)" in line and "A: (12 characters;" in line
    for source in ("stdin", "cli"):
        line = format_answer(Question("What did you see at the door?", source=source, answer=answer), False)
        assert "door" in line and "A: a red circle" in line


def test_a_daemon_with_a_key_logs_no_text_of_an_http_question(tiny_checkpoint, tmp_path):
    pytest.importorskip("fastapi")
    from helpers_server import RunningDaemon, call, server_config

    config = server_config(tiny_checkpoint).with_overrides(privacy={"key_file": _key(tmp_path / "memory.key")})
    with RunningDaemon(config, tmp_path / "out.txt") as run:
        status, _, raw = call(run.port, "POST", "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": "Who walked past the window?"}],
                               "max_tokens": 3})
        assert status == 200, raw
    log = (tmp_path / "out.txt").read_text()
    assert "Q [http]: (27 characters; privacy.log_text)" in log and "window" not in log
