"""The deployment configs that ship with edgekv (configs/*.yaml, installed as ``edgekv/configs``) reached by name
from any folder, ``--config cpu-demo``, while every path still means that file. The wheel side (a venv holding only
the wheel) is in test_packaging.py."""

from __future__ import annotations

import argparse

from pathlib import Path

import pytest

from edgekv.apps.cli import main
from edgekv.apps.config_names import resolve_config, shipped_configs

ROOT = Path(__file__).resolve().parents[1]


def _plan(argv: list[str], capsys) -> tuple[int, str, str]:
    code = main(["plan", "--device-memory", "8", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_config_of_the_tree_is_shipped_by_its_name():
    assert {name: path.resolve() for name, path in shipped_configs().items()} == \
        {path.stem: path.resolve() for path in sorted((ROOT / "configs").glob("*.yaml"))}


@pytest.mark.parametrize("given", ["cpu-demo", "cpu-demo.yaml", "configs/cpu-demo.yaml"])
def test_a_shipped_config_is_found_by_name_from_a_folder_without_configs(tmp_path, monkeypatch, capsys, given):
    """A wheel install has no configs/ folder: the README's ``--config configs/cpu-demo.yaml`` and the name alone
    were "config file not found". Both now plan the shipped file, as the path to it does."""
    monkeypatch.chdir(tmp_path)
    code, by_path, _ = _plan(["--config", str(ROOT / "configs" / "cpu-demo.yaml")], capsys)
    assert code == 0
    code, by_name, err = _plan(["--config", given], capsys)
    assert code == 0, err
    shipped = str(shipped_configs()["cpu-demo"])
    assert by_name.replace(shipped, "FILE") == by_path.replace(str(ROOT / "configs" / "cpu-demo.yaml"), "FILE")
    assert "cache.max_tokens 640 fits" in by_name
    if "/" in given:  # a path that is not there: the user is told which file is read instead
        assert f"using the one shipped with edgekv, {shipped}" in err


def test_a_file_on_disk_wins_over_the_shipped_config_of_that_name(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").mkdir()
    text = (ROOT / "configs" / "cpu-demo.yaml").read_text().replace("max_tokens: 640", "max_tokens: 672")
    (tmp_path / "configs" / "cpu-demo.yaml").write_text(text)
    (tmp_path / "cpu-demo").write_text(text.replace("max_tokens: 672", "max_tokens: 704"))
    code, out, err = _plan(["--config", "configs/cpu-demo.yaml"], capsys)
    assert code == 0 and "configs/cpu-demo.yaml: cache.max_tokens 672 fits" in out and not err
    code, out, err = _plan(["--config", "cpu-demo"], capsys)
    assert code == 0 and "cpu-demo: cache.max_tokens 704 fits" in out and not err


@pytest.mark.parametrize("given", ["/nonexistent/deploy.yaml", "deploy.yaml", "configs/deploy.yaml", "./cpu-demo",
                                   "~/nonexistent-edgekv/cpu-demo.yaml"])
def test_a_path_that_is_not_there_is_still_the_loaders_one_line_error(tmp_path, monkeypatch, capsys, given):
    """Only a bare name, or configs/NAME, is looked up among the shipped configs; ``./cpu-demo`` is a file here."""
    monkeypatch.chdir(tmp_path)
    code, out, err = _plan(["--config", given], capsys)
    assert code == 2
    assert err.strip().splitlines() == [f"edgekv plan: {Path(given).expanduser()}: config file not found"]
    assert not out


def test_a_name_that_is_neither_a_file_nor_shipped_lists_the_shipped_names(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--config", "cpu-dmeo"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "argument --config: 'cpu-dmeo' is neither a file here nor the name of a config shipped with edgekv" in err
    assert "cpu-demo, cpu-two-cameras, orin-agx-64gb, orin-nano-8gb, tiny-random" in err


def test_the_daemon_commands_take_a_shipped_name(tmp_path, monkeypatch):
    """``edgekv-camera``, ``edgekv serve`` and ``edgekv build`` share add_config_arguments: the parsed ``--config``
    is the shipped file, so every later reader of args.config (a reload included) reads that file."""
    from edgekv.apps.daemon.camera import build_parser

    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args(["--config", "cpu-two-cameras"])
    assert Path(args.config) == shipped_configs()["cpu-two-cameras"]
    with pytest.raises(argparse.ArgumentTypeError, match="the config is empty"):  # `--config "$CONFIG"`, unset
        resolve_config("")
