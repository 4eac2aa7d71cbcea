"""Every place that takes a deployment config takes the name of one shipped with edgekv (``cpu-demo``) the same
way, through the one resolver (``edgekv.config_names``): each ``--config`` of every command, and the library's
``Runtime.from_config``. A name that is neither a file nor shipped gets the same error, listing the shipped names.
Also: ``edgekv forget``'s line says what it freed as a user counts it, not slots over every layer and KV head."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from edgekv.config import ConfigError
from edgekv.config_names import resolve_config, shipped_configs

SHIPPED = "cpu-demo, cpu-two-cameras, orin-agx-64gb, orin-nano-8gb, tiny-random"
# each command with a --config, and the options it needs besides to parse
COMMANDS = {
    ("rekey",): [],
    ("bench", "soak"): ["--daemon"],
    ("bench", "daemon"): [],
    ("eval", "videoqa"): ["--model", "m", "--dataset", "mlvu", "--data", "d"],
    ("ask",): ["--fleet", "Was there a red circle?"],
    ("forget",): ["--last", "10"],
    ("plan",): [],
    ("serve",): [],
}


def _parse(command: tuple[str, ...], config: str) -> argparse.Namespace:
    from edgekv.apps.cli import build_parser

    argv = [*command, *COMMANDS[command], "--config", config]
    return build_parser(argv).parse_args(argv)


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_every_config_option_takes_a_shipped_name(command, tmp_path, monkeypatch):
    """``edgekv rekey``, ``bench soak|daemon``, ``eval videoqa``, ``ask`` and ``forget`` took paths only:
    "cpu-demo: config file not found" from a folder without that file."""
    monkeypatch.chdir(tmp_path)
    assert Path(_parse(command, "cpu-demo").config) == shipped_configs()["cpu-demo"]
    mine = tmp_path / "cpu-demo"  # a file here still wins over the shipped config of its name
    mine.write_text("cache:\n  max_tokens: 704\n")
    assert _parse(command, "cpu-demo").config == "cpu-demo"


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_every_config_option_lists_the_shipped_names_for_an_unknown_one(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        _parse(command, "cpu-dmeo")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --config: 'cpu-dmeo' is neither a file here nor the name of a config shipped with edgekv " \
           f"(shipped: {SHIPPED})" in err


def _config_options(parser: argparse.ArgumentParser, where: str):
    for action in parser._actions:
        if "--config" in action.option_strings:
            yield where, action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _config_options(sub, f"{where} {name}")


def test_no_config_option_is_left_taking_paths_only():
    """Any --config a command has (one added later included) goes through the one resolver."""
    from edgekv.apps.cli import COMMANDS as CLI_COMMANDS, build_parser
    from edgekv.apps.daemon.camera import build_parser as camera_parser

    found = list(_config_options(camera_parser(), "edgekv-camera"))
    for name in CLI_COMMANDS:
        if name == "bench":  # each bench's options only when it is named: every one of them
            from edgekv.apps.bench import add_arguments

            parser = argparse.ArgumentParser()
            add_arguments(parser)
            found += _config_options(parser, "edgekv bench")
        else:
            found += _config_options(build_parser([name]), "edgekv")
    assert {where for where, _ in found} >= {"edgekv rekey", "edgekv ask", "edgekv forget", "edgekv bench soak",
                                              "edgekv bench daemon", "edgekv eval videoqa", "edgekv-camera"}
    assert [where for where, action in found if action.type is not resolve_config] == []
    assert all("cpu-demo" in action.help for _, action in found)  # the help names them


def test_runtime_from_config_takes_a_shipped_name(tmp_path, monkeypatch, caplog):
    """``Runtime.from_config("cpu-demo")``: "cpu-demo: config file not found", though ``--config cpu-demo`` ran."""
    import edgekv

    monkeypatch.chdir(tmp_path)
    runtime = edgekv.Runtime.from_config("cpu-demo")
    assert Path(runtime.config.source) == shipped_configs()["cpu-demo"]
    assert runtime.config.cache.max_tokens == 640
    with caplog.at_level(logging.WARNING, logger="edgekv.runtime"):
        monkeypatch.setattr(edgekv.Runtime, "__init__", lambda self, config: setattr(self, "config", config))
        again = edgekv.Runtime.from_config("configs/cpu-demo.yaml")  # the README's path, no configs/ here
    assert again.config == runtime.config
    assert f"using the one shipped with edgekv, {shipped_configs()['cpu-demo']}" in caplog.text


def test_runtime_from_config_names_the_shipped_configs_for_an_unknown_name(tmp_path, monkeypatch):
    import edgekv

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as refused:
        edgekv.Runtime.from_config("cpu-dmeo")
    assert str(refused.value) == ("'cpu-dmeo' is neither a file here nor the name of a config shipped with edgekv "
                                  f"(shipped: {SHIPPED})")
    with pytest.raises(ConfigError, match="deploy.yaml: config file not found"):  # a file name: the loader's error
        edgekv.Runtime.from_config("deploy.yaml")


def test_the_apps_name_for_the_resolver_is_the_librarys():
    from edgekv.apps import config_names

    assert config_names.resolve_config is resolve_config and config_names.shipped_configs is shipped_configs


def test_edgekv_forget_says_the_tokens_the_cache_holds_not_slots_over_layers_and_heads(tiny_checkpoint, tmp_path):
    """The line said "(768 slots)" for 6 pairs (96 tokens) of a cache that held 335: ``cache_slots`` counts a token
    once in every layer and KV head. It says the pairs, the tokens freed and those the cache holds now; the daemon's
    own line says the tokens freed too."""
    from helpers_server import ended_daemon, kept_config

    from edgekv.apps.forget import _summary

    out = tmp_path / "out.txt"
    with ended_daemon(kept_config(tiny_checkpoint, tmp_path, archive=False), out) as daemon:
        before = daemon.session.cache.length
        result = daemon.forget(0.0, 1.0)
        after = daemon.session.cache.length
    assert result["pairs"] > 0 and result["cache_slots"] > before - after  # the figure that misled
    line = _summary(result)
    assert result["cache_tokens_freed"] == before - after > 0
    assert (f"{result['pairs']} frame pair(s) from the cache ({before - after} tokens freed, {after} held now)"
            in line), line
    assert "slots" not in line, line
    said = [text for text in out.read_text().splitlines() if text.startswith("forgot t=")]
    assert said and f"{result['pairs']} frame pairs, {before - after} cache tokens freed" in said[-1], said
