"""Commands and names the docs give a user, run as written (small sizes where the docs allow them).

Each test here came from a line of README.md or docs/ that did not do what it said.
"""

from __future__ import annotations

import argparse
import json

from edgekv.apps.cli import main


def test_bench_stream_takes_builtin_toy_on_both_sides(tmp_path, capsys):
    """README "On a robot": ``edgekv bench stream ... --model builtin:toy`` ran edgekv's side, then the transformers
    side failed reading ``builtin:toy/config.json`` (exit 2)."""
    out_json = tmp_path / "b.json"
    code = main(["bench", "stream", "--model", "builtin:toy", "--source", "synthetic:events?size=112x112&fps=2",
                 "--resolution", "112", "112", "--frames", "4", "--policy", "infinipot_v", "--threads", "1",
                 "--json", str(out_json), "--plot", ""])
    assert code == 0, capsys.readouterr().err
    data = json.loads(out_json.read_text())
    assert [r["policy"] for r in data["results"]] == ["infinipot_v", "transformers"]


def _config_keys(cls: type, prefix: str = "") -> dict[str, object]:
    """Every key a deployment YAML may hold (``video.sources[].name`` for a list's items) -> its default."""
    import dataclasses
    import typing

    keys: dict[str, object] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init or (not prefix and f.name == "source"):  # EdgeKVConfig.source: where it was read from
            continue
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            keys.update(_config_keys(kind, f"{prefix}{f.name}."))
            continue
        keys[prefix + f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        items = [a for a in typing.get_args(kind) if dataclasses.is_dataclass(a)]
        if items:
            keys.update(_config_keys(items[0], f"{prefix}{f.name}[]."))
    return keys


def _as_written(value: object) -> str:
    """A default as docs/configuration.md writes it (YAML's spelling)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"' if not value or " " in value else value
    if isinstance(value, list):
        return "[" + ", ".join(_as_written(v) for v in value) + "]"
    return repr(value)


def test_the_configuration_page_names_every_key_with_its_default():
    """No page listed many config keys (server.keep_alive_s, ros2.image_depth, fleet.topic_prefix ... 87 of 209
    appeared nowhere in the docs): docs/configuration.md lists each with its default, and this keeps it true."""
    import re
    from pathlib import Path

    from edgekv.config import EdgeKVConfig

    page = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    written = dict(re.findall(r"^- `([a-z_0-9.\[\]]+)` \(`(.*?)`\):", page, flags=re.M))
    expected = {key: _as_written(default) for key, default in _config_keys(EdgeKVConfig).items()}
    assert sorted(set(expected) - set(written)) == [], "keys the page lacks"
    assert sorted(set(written) - set(expected)) == [], "keys the page names that the config does not have"
    assert {k: v for k, v in written.items() if v != expected[k]} == {}, "defaults the page gets wrong"


def test_no_help_text_says_its_default_twice_or_as_python():
    """``edgekv train-toy --help`` printed "(default 1,2,3) (default: None)" and ``eval needle --help``
    "(default: (2000,))": the library's commands used argparse's own formatter. Every command's help, and each
    subcommand of ``bench`` and ``eval``, now goes through edgekv's."""
    import re

    from edgekv.apps.cli import COMMANDS, build_parser

    def helps(name: str) -> list[str]:
        """The command's help, and each of its subcommands' (bench's, eval's)."""
        (action,) = [a for a in build_parser([name])._actions if isinstance(a, argparse._SubParsersAction)]
        command = action.choices[name]
        texts = [command.format_help()]
        for inner in [a for a in command._actions if isinstance(a, argparse._SubParsersAction)]:
            texts += [choice.format_help() for choice in inner.choices.values()]
        return texts

    texts = [text for name in COMMANDS for text in helps(name)]
    assert len(texts) > len(COMMANDS)  # bench's and eval's subcommands too
    for text in texts:
        flat = " ".join(text.split())
        assert "(default: None)" not in flat and not re.search(r"\(default: [(\[]", flat), flat[:200]
        assert not re.search(r"\(default [^()]*\) \(default: ", flat), flat[:200]
