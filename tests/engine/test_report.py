"""The end-of-run report (scripts/train.py --evaluate): grid, report.json, and the digits verdict."""
import json
from pathlib import Path

from PIL import Image

from vqlcmd.data.digits import DIGITS_SOURCE
from vqlcmd.engine.config_file import load_config
from vqlcmd.engine.report import final_report, on_digits
from vqlcmd.engine.trainer import Trainer

SCORES = ("accuracy", "spread_ratio", "num_samples")


def test_report_writes_grid_and_json_and_scores_digits_shards_given_by_path(tiny_config, capsys):
    ds, cfg = load_config(str(tiny_config(steps=2)))
    trainer = Trainer(ds, cfg, log=lambda *a, **k: None)
    trainer.train(progress=False)
    # the tiny digits' shards carry no source: no digits verdict, the rest of the report is there
    assert not on_digits(trainer)
    report = final_report(trainer, per_class=2)
    assert not set(SCORES) & set(report)
    saved = json.loads((trainer.out_dir / "report.json").read_text())
    assert saved == report and saved["step"] == 2 and saved["collapse_indicator"] > 0
    with Image.open(saved["grid"]) as grid:  # a row per class: 4 classes x 2 samples of 16 px
        assert grid.size == (2 * 17 + 1, 4 * 17 + 1)
    # shards given by path but written from the digits (their header says so) get the verdict too,
    # as studies/reproduce.py's runs do
    trainer.header["source"] = DIGITS_SOURCE
    assert on_digits(trainer)
    report = final_report(trainer, per_class=2)
    assert report["num_samples"] == 8 and 0.0 <= report["accuracy"] <= 1.0 and report["spread_ratio"] >= 0
    printed = capsys.readouterr().out
    assert "classifier accuracy" in printed
    # the distribution figures are printed too, as report.json holds them
    assert f"FID {report['fid']:.3f}" in printed and f"recall {report['recall']:.3f}" in printed


def test_a_report_off_the_digits_samples_only_the_grid(tiny_config, monkeypatch):
    """Only the digits' samples are scored: elsewhere 50 per class of every class were sampled and decoded
    (ImageNet: 50,000 images) for a grid of 10 per class."""
    from vqlcmd.engine import report as report_module

    ds, cfg = load_config(str(tiny_config(steps=1)))
    trainer = Trainer(ds, cfg, log=lambda *a, **k: None)
    trainer.train(progress=False)
    monkeypatch.setattr(report_module, "GRID_ROWS", 3)
    pipe = trainer.pipeline()
    asked = []

    def recording(labels, **kw):
        asked.append(labels.tolist())
        return pipe(labels, **kw)

    monkeypatch.setattr(trainer, "pipeline", lambda: type("P", (), {"__call__": staticmethod(recording),
                                                                    "sample_defaults": pipe.sample_defaults})())
    report = final_report(trainer, per_class=50)
    assert asked == [[c for c in (0, 2, 3) for _ in range(10)]]  # 3 of the 4 classes, 10 each
    with Image.open(report["grid"]) as grid:
        assert grid.size == (10 * 17 + 1, 3 * 17 + 1)


def test_a_maskgit_run_reports_its_own_sampler(tiny_config):
    # the report read the diffusion sampler's settings (ancestral, 50 steps) for samples MaskGIT drew in 8
    ds, cfg = load_config(str(tiny_config(steps=1, method="maskgit", maskgit={"num_steps": 3})))
    trainer = Trainer(ds, cfg, log=lambda *a, **k: None)
    trainer.train(progress=False)
    report = final_report(trainer, per_class=1)
    assert (report["sampler"], report["num_steps"]) == ("maskgit", 3)


def test_an_unconditional_digits_run_reports_without_accuracy(tiny_config, capsys):
    """Its samples have no labels, so no accuracy: the report read report['accuracy'] and died with a KeyError
    after training, before report.json was written."""
    ds, cfg = load_config(str(tiny_config(steps=1, model={"preset": "tiny", "overrides": {"num_classes": 0}})))
    trainer = Trainer(ds, cfg, log=lambda *a, **k: None)
    trainer.train(progress=False)
    trainer.header["source"] = DIGITS_SOURCE
    report = final_report(trainer, per_class=2)
    assert "accuracy" not in report and report["spread_ratio"] >= 0 and "fid" in report
    assert report["guidance_scale"] == 0.0  # the exported default (1.0) guided nothing
    assert json.loads((trainer.out_dir / "report.json").read_text()) == report
    assert "within-class spread" in capsys.readouterr().out


def test_evaluate_without_a_tokenizer_is_refused_before_training(tiny_config, tiny_digits, load_script, capsys):
    """It trained the whole run and then died in the report, with a hint for API users, writing no report."""
    shards, _ = tiny_digits
    path = tiny_config(steps=1, data={"shards": str(shards)})  # no data.tokenizer
    train = load_script("train")
    assert train.main(["--config", str(path), "--evaluate", "--no-progress"]) == 2
    assert "--evaluate saves a decoded sample grid and needs data.tokenizer" in capsys.readouterr().err
    _, cfg = load_config(str(path))
    assert not (Path(cfg.train.output_dir) / "checkpoints").exists()  # nothing trained
