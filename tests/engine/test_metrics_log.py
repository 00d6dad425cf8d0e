"""metrics.jsonl truncated to the resumed step (vqlcmd/engine/metrics_log.py)."""
import json
import os

from vqlcmd.engine import metrics_log
from vqlcmd.engine.metrics_log import truncate_metrics


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_rows_after_the_resumed_step_are_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(10, 130, 10)))
    os.chmod(path, 0o640)
    assert truncate_metrics(path, 100) == 2
    assert [r["step"] for r in _rows(path)] == list(range(10, 101, 10))
    assert _rows(path)[-1] == {"step": 100, "loss": 0.01}  # rows kept byte for byte
    assert oct(path.stat().st_mode & 0o777) == "0o640" and not (tmp_path / "metrics.jsonl.tmp").exists()
    assert truncate_metrics(path, 100) == 0  # again: nothing to drop, the file untouched
    assert truncate_metrics(tmp_path / "none.jsonl", 5) == 0 and not (tmp_path / "none.jsonl").exists()


def test_a_line_cut_off_by_the_kill_goes_and_foreign_lines_stay(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"note": "no step"}\n{"step": 2}\n{"step": 3, "lo')
    assert truncate_metrics(path, 2) == 1
    assert path.read_text() == '{"step": 1}\nnot json\n{"note": "no step"}\n{"step": 2}\n'


def test_a_crash_while_rewriting_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    before = "".join(json.dumps({"step": s}) + "\n" for s in range(1, 6))
    path.write_text(before)

    def crash(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(metrics_log.os, "replace", crash)
    try:
        truncate_metrics(path, 2)
    except OSError:
        pass
    assert path.read_text() == before
