"""``python -m edgekv``: the ``edgekv`` command, for an install whose console scripts are not on PATH."""

import sys

from edgekv.apps.cli import main

if __name__ == "__main__":
    sys.exit(main())
