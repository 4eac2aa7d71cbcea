"""The help formatter every ``edgekv`` command uses (``apps/args.py`` re-exports it; the library's own commands,
``edgekv/eval/cli.py`` and ``edgekv/toy/cli.py``, sit below the apps and take it from here)."""

from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default when it has a meaningful one (not None, False or empty) and its help does not
    already say it: argparse's own formatter printed "(default 1,2,3) (default: None)" and "(default: (2000,))"."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("%(default)" in text or "default" in text.lower() or not action.option_strings or action.nargs == 0
                or default is argparse.SUPPRESS or default is None or default is False
                or (isinstance(default, (list, tuple, str)) and not default)):
            return text
        if isinstance(default, (list, tuple)):  # as it is typed: 2000 or 1,2,3
            return text + " (default: " + ",".join(str(v) for v in default).replace("%", "%%") + ")"
        return text + " (default: %(default)s)"
