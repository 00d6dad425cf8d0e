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


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {value}")
    return value


def seed_int(text: str) -> int:
    """A seed: an integer in [0, 2**31) (numpy's SeedSequence refuses negatives, and the scripts pack seeds
    into 64-bit values)."""
    value = int(text)
    if not 0 <= value < 2 ** 31:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 2**31), got {value}")
    return value


def json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
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


def noise_interval(text: str) -> tuple[float, float]:
    """'LO,HI' -> (lo, hi), 0 <= lo <= hi <= 1: the noise levels where guidance applies (sample.guidance_interval)."""
    from ..samplers import checked_interval

    try:
        return checked_interval(text.split(","))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def comma_list(item):
    """A comma-separated list whose every item ``item`` (one of the types above) accepts, e.g.
    ``comma_list(positive_int)`` for ``--steps 5,10,20``."""
    def parse(text: str) -> list:
        parts = [t.strip() for t in text.split(",")]
        if not all(parts):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list without empty items, got {text!r}")
        try:
            return [item(t) for t in parts]
        except (ValueError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None
    parse.__name__ = f"list of {getattr(item, '__name__', 'values')}"
    return parse


def choices_list(allowed):
    """A comma-separated list of names out of ``allowed``."""
    def parse(text: str) -> list:
        names = [t.strip() for t in text.split(",")]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad} in {text!r}; choose from {', '.join(allowed)}")
        return names
    return parse


def threads_setting(text: str):
    """``--threads N|auto|torch`` (see vqlcmd.threads)."""
    from ..threads import parse_setting

    try:
        return parse_setting(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_threads_option(parser) -> None:
    parser.add_argument("--threads", type=threads_setting, default=None, metavar="N|auto|torch",
                        help="CPU threads for torch (default: $VQLCMD_THREADS, else auto: the free cores, fewer "
                             "when other work keeps some busy; torch: torch's own default)")

