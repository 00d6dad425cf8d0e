"""vqlcmd.cli: the scripts' argparse value types."""
import argparse

import pytest

from vqlcmd.cli import non_negative_float, positive_float, positive_int


def test_positive_int():
    assert positive_int("3") == 3
    for bad in ("0", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a positive integer"):
            positive_int(bad)
    with pytest.raises(ValueError):  # argparse reports it as "invalid positive_int value"
        positive_int("1.5")


def test_positive_float():
    assert positive_float("2e-3") == 2e-3
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number > 0"):
            positive_float(bad)


def test_non_negative_float():
    assert non_negative_float("0") == 0.0 and non_negative_float("1.5") == 1.5
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(argparse.ArgumentTypeError, match="must be a finite number >= 0"):
            non_negative_float(bad)


def test_scripts_refuse_bad_numbers_with_a_usage_error(capsys):
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("collapse_study", root / "scripts" / "collapse_study.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--every", "0"])  # was a ZeroDivisionError after the first step
    assert exc.value.code == 2 and "--every: must be a positive integer, got 0" in capsys.readouterr().err
