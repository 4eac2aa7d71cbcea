"""``--config cpu-demo``, ``Runtime.from_config("cpu-demo")``: the deployment configs that ship with edgekv, found by
name wherever it is installed. The one resolver every place that takes a config goes through.

The source tree's ``configs/*.yaml`` are installed as package data, ``edgekv/configs/`` (setup.cfg maps the folder
into the package as it maps ``apps/`` and ``kernels/``). A config given as text that is a file is that file, as it
always was; one that is not is looked up among the shipped configs when it is a bare name (``cpu-demo``,
``cpu-demo.yaml``) or the README's ``configs/cpu-demo.yaml`` run from a folder without ``configs/`` (a wheel
install). A bare name without a suffix that is neither (``cpu-dmeo``) is refused listing the shipped names; any
other path not found is left to ``load_config``, whose one-line error names it.

Here, below the apps and the runtime (docs/architecture.md: the library never imports ``edgekv.apps``);
``edgekv.apps.config_names`` re-exports it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from edgekv.config import ConfigError

SUFFIXES = (".yaml", ".yml")


class UnknownConfigName(ConfigError):
    """A config given by a name that is neither a file here nor a config shipped with edgekv."""


def shipped_config_dir() -> Path | None:
    """The folder of the shipped configs: the installed package data (``edgekv/configs``), or in a source checkout
    (an editable install maps ``edgekv`` to the tree, not ``edgekv.configs``) the tree's own ``configs/``."""
    package = Path(__file__).resolve().parent
    installed, tree = package / "configs", package.parent / "configs"
    if installed.is_dir():
        return installed
    if tree.is_dir() and (package.parent / "setup.cfg").is_file():
        return tree
    return None


def shipped_configs() -> dict[str, Path]:
    """``{"cpu-demo": .../cpu-demo.yaml, ...}``: each shipped config by the name ``--config`` takes."""
    folder = shipped_config_dir()
    if folder is None:
        return {}
    return {path.stem: path for path in sorted(folder.iterdir()) if path.suffix in SUFFIXES and path.is_file()}


def shipped_names() -> str:
    """The shipped names as a help text or an error lists them: ``cpu-demo, cpu-two-cameras, ...``."""
    return ", ".join(shipped_configs()) or "none in this install"


def _asked_name(text: str) -> str | None:
    """The file name ``text`` asks the shipped configs for, if it may be asking: ``cpu-demo``, ``cpu-demo.yaml`` or
    ``configs/cpu-demo.yaml``; None for any other path (``./cpu-demo``, ``~/deploy.yaml``, ``/etc/edgekv/...``)."""
    words = text.split("/")
    if len(words) == 1 and text not in (".", "..") and not text.startswith("~"):
        return text
    if len(words) == 2 and words[0] == "configs" and words[1]:
        return words[1]
    return None


def config_file(text: str, say: Callable[[str], None] | None = None) -> str:
    """The file the config ``text`` means: ``text`` itself when something is there (or ``text`` is not a name a
    shipped config could have), else the shipped config of that name. ``say`` hears which file is read when the
    README's ``configs/NAME.yaml`` is not in this folder. A bare name without a suffix that is neither a file nor
    shipped (``cpu-dmeo``) is ``UnknownConfigName`` (a ``ConfigError``) listing the shipped names."""
    if not text:  # `--config "$CONFIG"` with the variable unset: the defaults were run, unsaid
        raise UnknownConfigName(f"the config is empty: give a YAML file or the name of a config shipped with edgekv "
                                f"(shipped: {shipped_names()})")
    # lexists: a link to a config that is not there (a volume not mounted yet) is that file, for load_config to
    # refuse, not a shipped demo config of the same name; and, unlike Path.exists, it never raises (a folder this
    # user may not enter raised PermissionError out of the argument parser)
    if os.path.lexists(os.path.expanduser(text)):
        return text
    asked = _asked_name(text)
    if asked is None:
        return text
    shipped = shipped_configs()
    for name, path in shipped.items():
        if asked in (name, path.name):
            if "/" in text and say is not None:  # the README's path, from a folder that has no configs/
                say(f"--config {text}: no such file in {Path.cwd()}; using the one shipped with edgekv, {path}")
            beside = [f"{text}{suffix}" for suffix in SUFFIXES if os.path.lexists(f"{text}{suffix}")
                      and os.path.realpath(f"{text}{suffix}") != os.path.realpath(path)]
            if beside and say is not None:  # a copy made to be edited, named as the shipped one it came from
                say(f"--config {text}: using the one shipped with edgekv, {path}, not {beside[0]} in {Path.cwd()} "
                    f"(give --config {beside[0]} to read that one)")
            return str(path)
    if text != asked or "." in asked:
        return text
    raise UnknownConfigName(f"{text!r} is neither a file here nor the name of a config shipped with edgekv "
                            f"(shipped: {shipped_names()})")


def resolve_config(text: str) -> str:
    """``config_file`` as an argparse ``type=`` for every ``--config``: the shipped file's path in ``args.config``
    (so every later reader of it, a reload included, reads that file), an unknown name the parser's usage error."""
    try:
        return config_file(text, say=lambda line: print(line, file=sys.stderr))
    except UnknownConfigName as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def config_help(what: str) -> str:
    """A ``--config`` help text: ``what`` the file is, then that a shipped config's name is taken too."""
    return f"{what}; a YAML file, or the name of one shipped with edgekv ({shipped_names()})"
