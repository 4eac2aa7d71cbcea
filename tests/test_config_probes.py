"""The configuration, command line and log as an operator meets them when something is off: a key written twice,
an infinite number, a config file that does not read, a log file that is a folder or on a full disk, ``--version``
after any command. Each mistake is one line naming the key or the file, never a traceback or a silent choice."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest

from edgekv import __version__
from edgekv.apps.cli import COMMANDS
from edgekv.apps.cli import main as cli_main
from edgekv.apps.daemon.camera import main as camera_main
from edgekv.config import ConfigError, EdgeKVConfig, config_from_dict, load_config


@pytest.mark.parametrize("text, message", [
    ("model:\n  dtype: fp16\n  dtype: fp32\n", r"line 3: 'dtype' is given twice \(first on line 2\)"),
    ("model:\n  path: a\nvideo: {}\nmodel:\n  dtype: fp32\n", r"line 4: 'model' is given twice \(first on line 1\)"),
    ("cache: {max_tokens: 2048, max_tokens: 4096}\n", "'max_tokens' is given twice"),
])
def test_a_key_given_twice_in_the_file_is_refused_not_the_last_taken(tmp_path, text, message):
    # yaml.safe_load keeps the last: a second `model:` section silently dropped the first one's path
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text("model:\n  <<: {dtype: fp16, device: cpu}\n  dtype: fp32\n")
    config = load_config(path)
    assert (config.model.dtype, config.model.device) == ("fp32", "cpu")


@pytest.mark.parametrize("assignment, key", [
    ("logging.max_mib=.inf", "logging.max_mib"),   # OverflowError at the log file's start
    ("cache.max_mib=.inf", "cache.max_mib"),       # OverflowError in --check's plan
    ("video.fps=.inf", "video.fps"),
    ("server.keep_alive_s=.nan", "server.keep_alive_s"),  # no range check of its own: NaN went through
    ("power.hot_c=.nan", "power.hot_c"),
])
def test_infinite_and_nan_numbers_are_refused_naming_the_key(assignment, key):
    with pytest.raises(ConfigError, match=rf"{key}: expected a finite number"):
        EdgeKVConfig().with_assignments([assignment])


def test_an_infinite_log_bound_is_one_line_at_the_camera_not_a_traceback(tmp_path, capsys):
    path = tmp_path / "deploy.yaml"
    path.write_text(f"model: {{path: builtin:toy}}\nlogging: {{file: {tmp_path / 'd.log'}, max_mib: .inf}}\n")
    assert camera_main(["--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "logging.max_mib: expected a finite number" in err


def test_a_config_that_is_not_utf8_names_the_file(tmp_path, capsys):
    path = tmp_path / "deploy.yaml"
    path.write_bytes(b"model:\n  path: builtin:toy\n# caf\xe9\n")
    with pytest.raises(ConfigError, match=r"deploy.yaml: not UTF-8 text \(byte 0xe9 at offset 32\)"):
        load_config(path)


def test_an_unreadable_config_is_one_line_at_the_camera(tmp_path, capsys, monkeypatch):
    path = tmp_path / "deploy.yaml"
    path.write_text("model: {path: builtin:toy}\n")
    read_text = Path.read_text

    def denied(self: Path, *args, **kwargs) -> str:  # root reads through chmod 000: fail at the boundary instead
        if self == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", denied)
    assert camera_main(["--config", str(path), "--check"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "deploy.yaml: cannot read the config file (Permission denied)" in err


def test_a_config_path_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(tmp_path)


def test_a_log_file_that_is_a_folder_fails_the_check_naming_the_key(tmp_path):
    from edgekv.apps.daemon.startup import StartupError, check_logging_file

    config = config_from_dict({"logging": {"file": str(tmp_path)}})
    with pytest.raises(StartupError, match=r"logging.file: .*: a folder, not a file"):
        check_logging_file(config)


class _FullDisk:
    """A log file's stream on a full disk: every write fails with ENOSPC until ``room`` is set."""

    def __init__(self) -> None:
        self.room = False
        self.text: list[str] = []

    def write(self, text: str) -> int:
        if not self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def seek(self, offset: int, whence: int = 0) -> int:  # RotatingFileHandler asks where the file ends
        return 0

    def tell(self) -> int:
        return 0

    def close(self) -> None:
        pass


def test_a_full_disk_under_the_log_is_one_line_not_a_traceback_per_record(tmp_path, capsys):
    from edgekv.logs import setup_logging

    root = logging.getLogger()
    saved = list(root.handlers), root.level
    disk = _FullDisk()
    try:
        setup_logging(config_from_dict({"logging": {"file": str(tmp_path / "d.log")}}).logging)
        (handler,) = root.handlers
        handler.stream.close()
        handler.stream = disk
        for index in range(5):
            logging.getLogger("edgekv.test").info("pair %d", index)
        disk.room = True
        logging.getLogger("edgekv.test").info("pair 5")
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert "logging.file" in lines[0] and "No space left on device" in lines[0]
    assert "5 record(s) lost" in lines[1]
    assert "pair 5" in "".join(disk.text)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_takes_version(command, capsys):
    with pytest.raises(SystemExit) as exit:
        cli_main([command, "--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"edgekv {__version__}"


def test_numpy_numbers_are_taken_and_a_400_digit_number_is_refused_by_name():
    """A config dict built from arrays (numpy's int64 / float32) was refused ("expected an integer, got 4000 (int64)");
    a 400-digit integer for a float key was an OverflowError traceback."""
    import numpy as np

    config = config_from_dict({"cache": {"max_tokens": np.int64(4000)}, "video": {"fps": np.float32(2.0)}})
    assert config.cache.max_tokens == 4000 and type(config.cache.max_tokens) is int
    assert config.video.fps == 2.0 and type(config.video.fps) is float
    with pytest.raises(ConfigError, match=r"video\.fps: expected a finite number"):
        config_from_dict({"video": {"fps": 10**400}})
    with pytest.raises(ConfigError, match=r"cache\.max_tokens: expected an integer"):
        config_from_dict({"cache": {"max_tokens": np.float64(4000)}})


def test_a_hash_in_a_set_value_is_text_not_a_yaml_comment():
    """``--set model.system_prompt=You are #1 here`` set "You are": YAML took " #1 here" for a comment, silently."""
    from edgekv.config import parse_assignment

    assert parse_assignment("model.system_prompt=You are #1 here") == ("model.system_prompt", "You are #1 here")
    assert parse_assignment("video.source=rtsp://cam/live #2") == ("video.source", "rtsp://cam/live #2")
    assert parse_assignment('model.system_prompt="quoted # kept"') == ("model.system_prompt", "quoted # kept")
    assert parse_assignment("model.system_prompt=channel#7") == ("model.system_prompt", "channel#7")
    with pytest.raises(ConfigError, match=r"cache\.max_tokens: expected an integer, got '2048 # the cap'"):
        EdgeKVConfig().with_assignments(["cache.max_tokens=2048 # the cap"])
    assert EdgeKVConfig().with_assignments(["model.system_prompt=Be #1"]).model.system_prompt == "Be #1"


@pytest.mark.parametrize("section, key", [("server", "token"), ("fleet", "password")])
def test_a_secret_of_the_wrong_type_is_not_echoed_in_the_error(section, key):
    """An unquoted numeric token (``server.token: 987654321123``) stopped the start with "expected a string, got
    987654321123 (int)": under systemd that line is in the journal, readable by more than the daemon's user."""
    for value in (987654321123, ["987654321123"]):
        with pytest.raises(ConfigError) as caught:
            config_from_dict({section: {key: value}})
        assert "987654321123" not in str(caught.value) and f"{section}.{key}: expected str or null" in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        EdgeKVConfig().with_assignments(["server.token=987654321123"])
    assert "987654321123" not in str(caught.value)
