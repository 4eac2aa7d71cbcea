"""Deployment config: every refusal names the key path and the reason; shipped profiles load."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from edgekv.config import ConfigError, EdgeKVConfig, config_from_dict, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("name", ["cpu-demo.yaml", "tiny-random.yaml", "orin-agx-64gb.yaml", "orin-nano-8gb.yaml",
                                  "cpu-two-cameras.yaml"])
def test_shipped_profiles_load(name):
    config = load_config(CONFIGS / name)
    assert config.cache.max_tokens and config.cache.text_reserve_tokens < config.cache.max_tokens


@pytest.mark.parametrize("data, message", [
    ({"cache": {"bogus": 1}}, "cache.bogus: unknown key"),
    ({"bogus": {}}, "bogus: unknown section"),
    ({"video": {"sources": [{"name": "all", "source": 0}]}}, "video.sources[0].name: 'all' means every camera"),
    ({"video": {"sources": [{"name": "a", "weight": 0}]}}, "video.sources[0].weight: must be > 0"),
    ({"cache": {"max_tokens": "lots"}}, "cache.max_tokens: expected an integer, got 'lots'"),
    ({"cache": {"max_tokens": True}}, "cache.max_tokens: expected an integer"),
    ({"video": {"fps": "fast"}}, "video.fps: expected a number"),
    ({"video": {"resolution": [450, 448]}}, "video.resolution: 450 is not a positive multiple of 28"),
    ({"cache": {"policy": "lru"}}, "cache.policy: unknown policy 'lru'"),
    ({"cache": {"max_tokens": 100, "max_mib": 5.0}}, "set exactly one of max_tokens and max_mib"),
    ({"cache": {"max_tokens": 1000, "target_tokens": 1000}}, "cache.target_tokens: 1000 must be below max_tokens"),
    ({"cache": {"recent_ratio": 1.5}}, "cache.recent_ratio: must be in (0, 1)"),
    ({"cache": {"tar_ratio": -0.1}}, "cache.tar_ratio: must be in [0, 1]"),
    ({"cache": {"adaptive_min_slots": -1}}, "cache.adaptive_min_slots: must be >= 0"),
    ({"cache": {"policy": "statekv"}}, "statekv needs a sink budget"),
    ({"model": {"dtype": "int3"}}, "model.dtype: expected one of fp32, fp16, bf16"),
    ({"model": {"device": "gpu0"}}, "model.device"),
    ({"server": {"port": 70000}}, "server.port: must be in 0..65535"),
    ({"engines": {"llm": "tflite"}}, "engines.llm: expected one of torch, onnxruntime, tensorrt"),
    ({"voice": {"vad_threshold": 1.5}}, "voice.vad_threshold: a speech probability in (0, 1)"),
    ({"voice": {"asr_model": " "}}, "voice.asr_model: empty"),
    ({"video": {"answer_backlog_s": -1}}, "video.answer_backlog_s: must be >= 0"),
    ({"video": {"answer_backlog_mib": -1}}, "video.answer_backlog_mib: must be >= 0"),
    ({"video": {"min_ingest_share": 0}}, "video.min_ingest_share: must be in (0, 1]"),
    ({"video": {"reconnect_backoff_s": [5, 1]}}, "video.reconnect_backoff_s: expected [base, max]"),
    ({"monitor": {"interval_s": 0}}, "monitor.interval_s: must be > 0"),
    ({"cache": "big"}, "cache: expected a mapping"),
])
def test_refusals_name_the_key_and_the_reason(data, message):
    with pytest.raises(ConfigError) as err:
        config_from_dict(data, source="deploy.yaml")
    assert message in str(err.value) and "deploy.yaml" in str(err.value)


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("cache: {max_tokens: [1, 2]}\n")
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)
    path.write_text("cache: {max_tokens: 12\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_round_trip_and_relative_paths(tmp_path):
    config = EdgeKVConfig().with_overrides(cache={"policy": "full", "max_tokens": 2048}, video={"resolution": [224, 224]})
    assert config.cache.policy == "full" and config.video.resolution == [224, 224] and config.cache.tar_ratio == 0.5
    with pytest.raises(ConfigError, match="nope: unknown section"):
        config.with_overrides(nope={})
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({**config.to_dict(), "model": {"path": "weights/qwen"}}))
    loaded = load_config(path)
    assert loaded.model.path == str((tmp_path / "weights" / "qwen").resolve())
    assert loaded.cache == config.cache
    # every file a config names is the YAML's neighbour when relative (the log file was the cwd's: under systemd,
    # whose cwd is /, a read-only place)
    path.write_text(yaml.safe_dump({"logging": {"file": "logs/edgekv.log"}, "server": {
        "tls_cert_file": "tls/robot.pem", "tls_key_file": "tls/robot.key", "tls_client_ca_file": "tls/ca.pem"},
        "escalate": {"url": "https://big:8000/v1", "model": "m", "ca_file": "tls/ca.pem"},
        "alerts": {"webhooks": ["https://hooks.local/x"], "webhook_ca_file": "tls/ca.pem"}}))
    loaded = load_config(path)
    assert loaded.logging.file == str((tmp_path / "logs" / "edgekv.log").resolve())
    assert loaded.server.tls_cert_file == str((tmp_path / "tls" / "robot.pem").resolve())
    assert loaded.server.tls_client_ca_file == loaded.escalate.ca_file == loaded.alerts.webhook_ca_file
    # the INT8 calibration video: a file beside the YAML, but a synthetic: source as it is (it was joined onto the
    # YAML's folder, and the build failed with "no such video file")
    for given, wanted in (("calib/clip.mp4", str((tmp_path / "calib" / "clip.mp4").resolve())),
                          ("synthetic:events?frames=8", "synthetic:events?frames=8")):
        path.write_text(yaml.safe_dump({"engines": {"int8_calibration": given}}))
        assert load_config(path).engines.int8_calibration == wanted


def test_assignments_round_trip_a_config_built_in_python():
    """``--set section.key=value`` (YAML values) and its inverse, which engine hints print."""
    config = EdgeKVConfig().with_overrides(cache={"max_tokens": 2048, "text_reserve_tokens": 128},
                                           video={"resolution": [224, 224], "source": "synthetic:shapes?fps=4"})
    assert config.assignments() == ["video.source=synthetic:shapes?fps=4", "video.resolution=[224, 224]",
                                    "cache.max_tokens=2048", "cache.text_reserve_tokens=128"]
    assert EdgeKVConfig().with_assignments(config.assignments()) == config
    with pytest.raises(ConfigError, match=r"--set 'cache': expected section.key=value"):
        EdgeKVConfig().with_assignments(["cache"])
    with pytest.raises(ConfigError, match=r"\+ --set: cache.max_tokens: expected an integer"):
        EdgeKVConfig().with_assignments(["cache.max_tokens=lots"])


def test_set_reaches_a_nested_sections_key_and_keeps_its_others():
    """``--set voice.speak.enabled=true`` (it was refused: only section.key) changes that key alone; the file's
    other ``voice.speak`` keys stay, and a key that is not a section, or one it does not have, is named."""
    config = config_from_dict({"voice": {"speak": {"engine": "espeak-ng", "words_per_minute": 120}},
                               "video": {"skip_static": {"enabled": True}}})
    changed = config.with_assignments(["voice.speak.enabled=true", "video.skip_static.threshold=9",
                                       "voice.speak.espeak_voice=en-gb"])
    assert changed.voice.speak.enabled and changed.voice.speak.espeak_voice == "en-gb"
    assert changed.voice.speak.engine == "espeak-ng" and changed.voice.speak.words_per_minute == 120
    assert changed.video.skip_static.enabled and changed.video.skip_static.threshold == 9.0
    assert changed.cache == config.cache
    with pytest.raises(ConfigError, match=r"voice.speak.nope: unknown key"):
        config.with_assignments(["voice.speak.nope=1"])
    with pytest.raises(ConfigError, match=r"cache.max_tokens: not a section \(it takes a value\), so it has no key x"):
        config.with_assignments(["cache.max_tokens.x=1"])
    with pytest.raises(ConfigError, match=r"voice.speak was set to a value earlier"):
        config.with_assignments(["voice.speak=null", "voice.speak.enabled=true"])
    with pytest.raises(ConfigError, match=r"expected section.key=value"):
        config.with_assignments(["voice..enabled=true"])


def test_voice_enabled_needs_no_model_in_the_config():
    """The daemon falls back to the bundled tiny.en; only the start-up check can tell whether it is installed."""
    assert config_from_dict({"voice": {"enabled": True}}).voice.asr_model is None


def test_the_log_file_is_bounded(tmp_path):
    """logging.file grew for the life of the device, on the flash its memory lives on; it now rolls over at
    logging.max_mib keeping logging.backups old files."""
    import logging

    from edgekv.logs import setup_logging

    path = tmp_path / "edgekv.log"
    section = config_from_dict({"logging": {"file": str(path), "max_mib": 0.01, "backups": 2}}).logging
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        setup_logging(section)
        for index in range(2000):
            logging.getLogger("edgekv.test").info("line %d %s", index, "x" * 40)
        for handler in root.handlers:
            handler.flush()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["edgekv.log", "edgekv.log.1", "edgekv.log.2"]
    assert all(p.stat().st_size <= 0.01 * 2**20 + 200 for p in tmp_path.iterdir())
    assert "line 1999" in path.read_text()
    with pytest.raises(ConfigError, match="logging.max_mib: must be > 0"):
        config_from_dict({"logging": {"max_mib": 0}})
    with pytest.raises(ConfigError, match="logging.backups: must be >= 1"):
        config_from_dict({"logging": {"backups": 0}})


def test_evidence_frames_budget_is_off_or_a_mebibyte_at_least():
    # the files' own pages and write-ahead log take up to 96 KiB of archive.frames_mib (apps/daemon/frame_store.py)
    assert config_from_dict({"archive": {"frames_mib": 0}}).archive.frames_mib == 0
    assert config_from_dict({"archive": {"frames_mib": 1}}).archive.frames_mib == 1
    for bad in (0.5, -1):
        with pytest.raises(ConfigError, match=r"archive.frames_mib: must be 0 .* or at least 1"):
            config_from_dict({"archive": {"frames_mib": bad}})
    with pytest.raises(ConfigError, match=r"archive.frames_mib: expected a finite number"):  # every float key
        config_from_dict({"archive": {"frames_mib": float("nan")}})


def test_archive_keep_free_is_a_floor_of_zero_or_more():
    assert config_from_dict({}).archive.keep_free_gib == 1.0  # a disk shared with a bag recorder never fills
    assert config_from_dict({"archive": {"keep_free_gib": 0}}).archive.keep_free_gib == 0
    with pytest.raises(ConfigError, match="archive.keep_free_gib: must be >= 0"):
        config_from_dict({"archive": {"keep_free_gib": -1}})
