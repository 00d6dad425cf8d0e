"""studies/digits_table.py on the tiny pipeline: cells, cache-based continuation, Markdown layout."""
import pytest


@pytest.mark.slow  # fits the digit classifiers at 16 px: minutes on the shared 2-core CPU
def test_table_runs_caches_and_continues(tiny_pipeline, tmp_path, capsys):
    folder = tiny_pipeline.save_pretrained(tmp_path / "pipe")
    from studies import digits_table as mod

    out = tmp_path / "table.md"
    args = ["--pipeline", str(folder), "--out", str(out), "--steps", "1,2", "--samplers", "ddim",
            "--guidance", "0,1", "--per-class", "4", "--machine", "2-core CPU (test), 2 threads"]
    assert mod.main(args) == 0
    text = out.read_text()
    import re
    import shlex

    made_by = re.search(r"Made by `python -m studies\.digits_table (.*?)`\.", text).group(1)
    assert shlex.split(made_by) == args  # pasted into a shell, it runs (it lost the --machine quotes)
    rows = [line for line in text.splitlines() if line.startswith("| ddim")]
    assert len(rows) == 4 and "| ddim | 1 | 2 |" in text
    assert len((tmp_path / "digits_table.jsonl").read_text().splitlines()) == 4
    capsys.readouterr()
    mod.main(args + ["--steps", "1,2,3"])  # only the new cells are sampled
    printed = capsys.readouterr().out
    assert "3 steps" in printed and " 1 steps" not in printed and " 2 steps" not in printed
    assert len([line for line in out.read_text().splitlines() if line.startswith("| ddim")]) == 6


def test_digits_table_cache_key_covers_the_pipelines_config(tmp_path, tiny_pipeline):
    """It hashed the weights only: a pipeline with another schedule shift took the cached cells."""
    import json

    from studies import digits_table as mod

    folder = tiny_pipeline.save_pretrained(tmp_path / "p")
    key = mod.digest(folder)
    config = json.loads((folder / "config.json").read_text())
    config["schedule"]["shift"] = 3.0
    (folder / "config.json").write_text(json.dumps(config))
    assert mod.digest(folder) != key
    config["schedule"]["shift"], config["save_id"] = tiny_pipeline.schedule.shift, "another"
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    assert mod.digest(folder) == key  # neither the save id nor the file's layout

