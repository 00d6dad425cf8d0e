"""scripts/train_tokenizer.py, for a couple of steps, run as a real script: it saves a folder load_tokenizer
reads (and, started as ``python scripts/...``, its folder's tokenize.py does not shadow the standard library's)."""
import json
import subprocess
import sys
from pathlib import Path

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
