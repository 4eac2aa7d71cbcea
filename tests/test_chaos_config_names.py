"""``--config NAME`` (edgekv/config_names.py) at its edges: a link named like a shipped config whose target is not
there, a folder this user may not enter, an empty value, an edited copy named like the shipped config it came
from.

Before: a dangling ``orin-nano-8gb.yaml`` link (its volume not mounted yet) ran the shipped demo config of that name
without a word; a path under a folder the user may not enter raised PermissionError out of the argument parser (a
traceback) and out of ``load_config``; ``--config ""`` (``--config "$CONFIG"``, the variable unset) ran the
defaults; and ``--config cpu-demo`` beside an edited ``cpu-demo.yaml`` read the shipped one unsaid."""

from __future__ import annotations

import argparse
import errno
import os

import pytest

from edgekv.config import ConfigError, load_config
from edgekv.config_names import UnknownConfigName, config_file, resolve_config, shipped_configs


@pytest.fixture
def shipped() -> dict:
    configs = shipped_configs()
    if "cpu-demo" not in configs:
        pytest.skip("no shipped configs in this install")
    return configs


def test_a_dangling_link_named_like_a_shipped_config_is_not_the_shipped_one(tmp_path, monkeypatch, shipped):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-demo.yaml").symlink_to(tmp_path / "not-mounted" / "cpu-demo.yaml")
    assert config_file("cpu-demo.yaml") == "cpu-demo.yaml"  # was the shipped file
    with pytest.raises(ConfigError, match="cpu-demo.yaml: config file not found"):
        load_config(config_file("cpu-demo.yaml"))


def test_a_config_behind_a_folder_this_user_may_not_enter_is_a_one_line_error(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    real = os.stat

    def stat(path, *args, **kwargs):  # root enters any folder: the refusal is made here
        if str(path).startswith(str(locked)):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "lstat", stat)
    target = str(locked / "deploy.yaml")
    assert resolve_config(target) == target  # raised PermissionError: the parser's traceback
    with pytest.raises(ConfigError, match="deploy.yaml: cannot read the config file .Permission denied"):
        load_config(target)


def test_an_empty_config_is_refused_not_the_defaults(shipped):
    with pytest.raises(UnknownConfigName, match="the config is empty.*cpu-demo"):
        config_file("")
    parser = argparse.ArgumentParser(prog="edgekv-camera")
    parser.add_argument("--config", type=resolve_config)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--config", ""])
    assert exited.value.code == 2


def test_an_edited_copy_named_like_the_shipped_config_is_named_when_the_shipped_one_is_read(tmp_path, monkeypatch,
                                                                                             shipped):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cpu-demo.yaml").write_text("cache: {max_tokens: 999}\n")
    said: list[str] = []
    assert config_file("cpu-demo", say=said.append) == str(shipped["cpu-demo"])
    assert len(said) == 1 and "not cpu-demo.yaml" in said[0] and "--config cpu-demo.yaml" in said[0], said
    said.clear()
    monkeypatch.chdir(shipped["cpu-demo"].parent)  # the shipped folder itself: the same file, nothing to say
    assert config_file("cpu-demo", say=said.append) == str(shipped["cpu-demo"]) and said == []
