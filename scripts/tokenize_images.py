#!/usr/bin/env python
"""The ``vqlcmd-tokenize`` command (vqlcmd/cli/tokenize_images.py) as a file to run, for launchers that take a script:
``python scripts/tokenize_images.py --help``. Needs the package installed (``bash scripts/install.sh``)."""
import sys

from vqlcmd.cli.tokenize_images import command

if __name__ == "__main__":
    sys.exit(command())
