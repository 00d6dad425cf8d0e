#!/usr/bin/env python
"""The ``vqlcmd-train`` command (vqlcmd/cli/train.py) as a file to run, for launchers that take a script:
``python scripts/train.py --help``. Needs the package installed (``bash scripts/install.sh``)."""
import sys

from vqlcmd.cli.train import main  # (its first lines set OpenMP's wait policy, before torch loads)

if __name__ == "__main__":
    sys.exit(main())
