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


def _finite(text: str, ok, what: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be {what}, got {text}")
    return value


def positive_float(text: str) -> float:
    return _finite(text, lambda v: v > 0, "a finite number > 0")


def non_negative_float(text: str) -> float:
    return _finite(text, lambda v: v >= 0, "a finite number >= 0")
