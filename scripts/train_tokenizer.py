#!/usr/bin/env python
"""The ``vqlcmd-train-tokenizer`` command (vqlcmd/cli/train_tokenizer.py) as a file to run, for launchers
that take a script: ``python scripts/train_tokenizer.py --help``.
Needs the package installed (``bash scripts/install.sh``)."""
import sys

from vqlcmd.cli.train_tokenizer import command  # (its first lines set OpenMP's wait policy, before torch loads)

if __name__ == "__main__":
    sys.exit(command())
