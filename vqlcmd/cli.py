"""argparse value types shared by the scripts: a bad number is refused with argparse's usage error (exit
code 2) before any work starts, rather than failing later inside the run (a zero range step, an empty loop
that exits 0, a NaN that propagates)."""
from __future__ import annotations

import argparse
import math


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
