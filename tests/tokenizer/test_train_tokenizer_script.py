"""scripts/train_tokenizer.py, for a couple of steps: it saves a folder load_tokenizer reads."""
import importlib.util
from pathlib import Path

from vqlcmd.tokenizer import load_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train_tokenizer.py"


def test_trains_and_saves(tmp_path):
    spec = importlib.util.spec_from_file_location("train_tokenizer_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "tok"
    metrics = mod.main(["--dataset", "digits", "--out", str(out), "--steps", "2", "--size", "16",
                        "--channels-per-block", "8,16", "--codebook-size", "32", "--code-dim", "4",
                        "--batch-size", "8", "--no-progress"])
    tok = load_tokenizer(out)
    assert tok.grid == (8, 8) and tok.codebook_size == 32 and tok.channels == 1
    assert tok.identifier == metrics["tokenizer_id"] and (out / "metrics.json").is_file()
    assert metrics["images"] == 1797 and 1 <= metrics["codebook_usage"] <= 32
