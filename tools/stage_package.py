"""Copy the ``edgekv`` import namespace into one folder, laid out as it is installed.

``setup.cfg`` maps the design card's top-level folders (``kernels/``, ``engines/``, ``calibration/``,
``apps/``) into ``edgekv`` (``package_dir``). Tools that read the source tree by folder (import-linter's
``grimp``) see only ``edgekv/``; this writes the installed layout of the ``.py`` files to
``DEST/edgekv/...`` for them:

    python tools/stage_package.py /tmp/staged && (cd /tmp/staged && PYTHONPATH=. lint-imports --config ../setup.cfg)
"""

from __future__ import annotations

import configparser
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """``{"edgekv": root/"edgekv", "edgekv.kernels": root/"kernels", ...}`` from setup.cfg's ``package_dir``."""
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    mapping = {}
    for line in config["options"]["package_dir"].strip().splitlines():
        name, _, folder = (part.strip() for part in line.partition("="))
        mapping[name] = root / folder
    return mapping


def stage(dest: Path, root: Path = ROOT) -> Path:
    """Write the installed layout of the package's Python files under ``dest``; returns ``dest``."""
    dest = Path(dest)
    shutil.rmtree(dest / "edgekv", ignore_errors=True)
    mapping = package_dirs(root)
    for name, folder in sorted(mapping.items(), key=lambda item: item[0].count(".")):
        target = dest.joinpath(*name.split("."))
        nested = {mapping[other] for other in mapping if other.startswith(name + ".")}
        for source in folder.rglob("*.py"):
            if any(source.is_relative_to(inner) for inner in nested) or "__pycache__" in source.parts:
                continue
            out = target / source.relative_to(folder)
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, out)
    return dest


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="copy the edgekv import namespace into DEST/edgekv, laid out as "
                                                 "it is installed (for import-linter)")
    parser.add_argument("dest", help="folder to write DEST/edgekv/... in (its edgekv/ is replaced)")
    print(stage(Path(parser.parse_args().dest)))
