#!/usr/bin/env python
"""The ``vqlcmd-evaluate`` command (vqlcmd/cli/evaluate.py) as a file to run, for launchers that take a script:
``python scripts/evaluate.py --help``. Needs the package installed (``bash scripts/install.sh``)."""
import sys

from vqlcmd.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
