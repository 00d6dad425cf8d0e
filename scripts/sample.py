#!/usr/bin/env python
"""The ``vqlcmd-sample`` command (vqlcmd/cli/sample.py) as a file to run, for launchers that take a script:
``python scripts/sample.py --help``. Needs the package installed (``bash scripts/install.sh``)."""
import sys

from vqlcmd.cli.sample import main  # (its first lines set OpenMP's wait policy, before torch loads)

if __name__ == "__main__":
    sys.exit(main())
