"""vqlcmd.cli: the scripts' argparse value types."""
import argparse

import pytest

from vqlcmd.cli import choices_list, comma_list, non_negative_float, positive_float, positive_int


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


def test_lists():
    assert comma_list(positive_int)("5, 10,20") == [5, 10, 20]
    assert comma_list(non_negative_float)("0,1.5") == [0.0, 1.5]
    with pytest.raises(argparse.ArgumentTypeError, match=r"in '5,0': must be a positive integer, got 0"):
        comma_list(positive_int)("5,0")
    with pytest.raises(argparse.ArgumentTypeError, match="in '1,x'"):
        comma_list(non_negative_float)("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="without empty items"):
        comma_list(positive_int)("5,,10")
    assert choices_list(("ancestral", "ddim"))("ddim") == ["ddim"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"unknown \['dpm'\]"):
        choices_list(("ancestral", "ddim"))("ddim,dpm")


def test_digits_table_refuses_bad_lists_before_loading_anything(capsys, tmp_path):
    # each failed only after the pipeline and the digit classifiers were loaded (steps 0, guidance -1), or
    # after the first cells were sampled (an unknown sampler)
    from studies import digits_table as mod

    missing = str(tmp_path / "no_pipeline")
    for flag, value, said in (("--steps", "5,0", "must be a positive integer"),
                              ("--guidance", "1,-1", "must be a finite number >= 0"),
                              ("--samplers", "ancestral,dpm", "unknown ['dpm']")):
        with pytest.raises(SystemExit) as exc:
            mod.main(["--pipeline", missing, flag, value])
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_scripts_refuse_bad_numbers_with_a_usage_error(capsys):
    from studies import collapse_study as mod
    from studies import digits_table

    with pytest.raises(SystemExit) as exc:
        mod.main(["--every", "0"])  # was a ZeroDivisionError after the first step
    assert exc.value.code == 2 and "--every: must be a positive integer, got 0" in capsys.readouterr().err
    # found only after both training runs (2 min at 20 steps)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--plot", "/nonexistent-folder/cs.png"])
    assert exc.value.code == 2 and "no folder /nonexistent-folder" in capsys.readouterr().err
    # digits_table packs (seed << 32) | image into an int64
    with pytest.raises(SystemExit) as exc:
        digits_table.main(["--pipeline", "x", "--seed", str(2 ** 32)])
    assert exc.value.code == 2 and "must be an integer in [0, 2**31)" in capsys.readouterr().err
