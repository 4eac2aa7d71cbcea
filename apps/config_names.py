"""``--config cpu-demo``: the deployment configs that ship with edgekv, found by name wherever it is installed.

The source tree's ``configs/*.yaml`` are installed as package data, ``edgekv/configs/`` (setup.cfg maps the folder
into the package as it maps ``apps/`` and ``kernels/``). A ``--config`` value that is a file is that file, as it
always was; one that is not is looked up among the shipped configs when it is a bare name (``cpu-demo``,
``cpu-demo.yaml``) or the README's ``configs/cpu-demo.yaml`` run from a folder without ``configs/`` (a wheel
install). Anything else is left to the config loader, whose error names the path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SUFFIXES = (".yaml", ".yml")


def shipped_config_dir() -> Path | None:
    """The folder of the shipped configs: the installed package data (``edgekv/configs``), or in a source checkout
    (an editable install maps ``edgekv`` to the tree, not ``edgekv.configs``) the tree's own ``configs/``."""
    import edgekv

    package = Path(edgekv.__file__).resolve().parent
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


def _asked_name(text: str) -> str | None:
    """The file name ``text`` asks the shipped configs for, if it may be asking: ``cpu-demo``, ``cpu-demo.yaml`` or
    ``configs/cpu-demo.yaml``; None for any other path (``./cpu-demo``, ``~/deploy.yaml``, ``/etc/edgekv/...``)."""
    words = text.split("/")
    if len(words) == 1 and text not in (".", "..") and not text.startswith("~"):
        return text
    if len(words) == 2 and words[0] == "configs" and words[1]:
        return words[1]
    return None


def resolve_config(text: str) -> str:
    """The file ``--config text`` means: ``text`` itself when something is there (or ``text`` is not a name a
    shipped config could have), else the shipped config of that name. A bare name without a suffix that is neither
    (``--config cpu-dmeo``) is ``argparse.ArgumentTypeError`` listing the shipped names; any other path not found
    is left to the config loader, whose one-line error names it as before."""
    if not text or Path(text).expanduser().exists():
        return text
    asked = _asked_name(text)
    if asked is None:
        return text
    shipped = shipped_configs()
    for name, path in shipped.items():
        if asked in (name, path.name):
            if "/" in text:  # the README's path, from a folder that has no configs/: say which file is read
                print(f"--config {text}: no such file in {Path.cwd()}; using the one shipped with edgekv, {path}",
                      file=sys.stderr)
            return str(path)
    if text != asked or "." in asked:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a file here nor the name of a config shipped with edgekv "
                                     f"(shipped: {', '.join(shipped) or 'none in this install'})")
