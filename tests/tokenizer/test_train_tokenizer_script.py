"""scripts/train_tokenizer.py, for a couple of steps, run as a real script: it saves a folder load_tokenizer
reads."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from vqlcmd.tokenizer import load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tokenizer.py"


def test_trains_and_saves(tmp_path):
    out = tmp_path / "tok"
    res = subprocess.run([sys.executable, str(SCRIPT), "--dataset", "digits", "--out", str(out), "--steps", "2",
                          "--size", "16", "--channels-per-block", "8,16", "--codebook-size", "32", "--code-dim", "4",
                          "--batch-size", "8", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    tok = load_tokenizer(out)
    assert tok.grid == (8, 8) and tok.codebook_size == 32 and tok.channels == 1
    assert tok.identifier == metrics["tokenizer_id"]
    assert metrics["images"] == 1797 and 1 <= metrics["codebook_usage"] <= 32
    # a second run into the same folder would replace the tokenizer that shards and models name by its folder
    again = subprocess.run([sys.executable, str(SCRIPT), "--dataset", "digits", "--out", str(out), "--steps", "2",
                            "--size", "16", "--channels-per-block", "8,16", "--codebook-size", "32", "--code-dim",
                            "4", "--batch-size", "8", "--seed", "1", "--no-progress"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 1 and f"--out {out} is not empty" in again.stderr and "--overwrite" in again.stderr
    assert load_tokenizer(out).identifier == metrics["tokenizer_id"]  # untouched


def _parse(*argv):
    from vqlcmd.cli.train_tokenizer import parse_args

    return parse_args(["--dataset", "digits", *argv])


@pytest.mark.parametrize("argv, message", [
    (["--channels", "2"], "invalid choice: 2"),
    (["--steps", "-3"], "--steps: must be a positive integer, got -3"),
    (["--lr", "0"], "--lr: must be a finite number > 0"),
    (["--size", "18"], "--size 18 must be divisible by 4"),
    (["--channels-per-block", "16,x"], "takes comma-separated integers"),
    (["--channels-per-block", "16,20"], "each must be a positive multiple of 8"),
])
def test_bad_arguments_are_refused_before_training(argv, message, capsys):
    # before, --size 18 trained and then failed on a tensor shape; --steps -3 saved an untrained model
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err
    assert _parse("--size", "16", "--channels-per-block", "8,16", "--out", "tok").blocks == (8, 16)


@pytest.mark.parametrize("argv, named", [
    (["--lr", "1e-3"], "--lr"),
    (["--codebook-size", "64", "--code-dim", "4"], "--codebook-size, --code-dim"),
    (["--channels-per-block", "8,16"], "--channels-per-block"),
])
def test_digits_cache_refuses_the_settings_it_would_ignore(argv, named, capsys):
    # before, these were dropped without a word and the quick start's default tokenizer was trained or reused
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2 and f"{named}: --dataset digits without --out" in capsys.readouterr().err
    _parse(*argv, "--out", "tok")  # with a folder of its own they are used
    _parse("--lr", "2e-3", "--channels-per-block", "16,32,64")  # the values the cache uses are no conflict


def test_digits_are_grayscale(capsys):
    with pytest.raises(SystemExit) as exc:
        _parse("--channels", "3", "--out", "tok")
    assert exc.value.code == 2 and "--channels 3: the digits are grayscale" in capsys.readouterr().err
    assert _parse("--channels", "1").channels == 1
