"""studies/sampling_sweep.py: every setting scored once, with the pipeline's own sampler under those settings."""
import json

import pytest
import torch


@pytest.fixture
def sweep_setup(tiny_pipeline, tmp_path, monkeypatch):
    """The script, a saved tiny pipeline's folder, and the images each scored setting drew, in order."""
    folder = tmp_path / "pipe"
    tiny_pipeline.save_pretrained(folder)
    scored = []

    def fake_metrics(images, labels):  # the digits classifier needs 8x8-multiple digits: score the images' mean
        scored.append(images.clone())
        return {"num_samples": len(images), "accuracy": 0.99, "spread_ratio": float(images.mean()), "fid": 1.0,
                "precision": 0.5, "recall": 0.6}

    monkeypatch.setattr("vqlcmd.metrics.digits.evaluate_digit_samples", fake_metrics)
    from studies import sampling_sweep

    return sampling_sweep, folder, scored


def test_sweep_scores_each_setting_once_and_continues(tiny_pipeline, tmp_path, sweep_setup):
    sweep, folder, scored = sweep_setup
    out = tmp_path / "sweep.jsonl"
    argv = [str(folder), "--out", str(out), "--steps", "2", "--guidance", "0", "2", "--finals", "sample", "argmax",
            "--samplers", "ddim", "--per-class", "2"]
    assert sweep.main(argv) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["guidance"], r["final"]) for r in recs] == [(0.0, "sample"), (0.0, "argmax"), (2.0, "sample"),
                                                          (2.0, "argmax")]
    # each setting's images are the pipeline's own under that setting and seed
    for r, images in zip(recs, scored):
        want = tiny_pipeline(torch.arange(4).repeat_interleave(2), num_steps=2, guidance_scale=r["guidance"],
                             sampler="ddim", final=r["final"], output_type="pt",
                             generator=torch.Generator().manual_seed(0))
        assert torch.equal(images, want)
    assert not torch.equal(scored[0], scored[2])  # ω reached the sampler
    assert "| ddim | 2 | 2 | all | argmax |" in out.with_suffix(".md").read_text()
    # a rerun with one more ω samples only that one
    assert sweep.main(argv[:6] + ["0", "1", "2"] + argv[8:]) == 0
    assert [r["guidance"] for r in map(json.loads, out.read_text().splitlines())][4:] == [1.0, 1.0]
    assert len(scored) == 6
    # a guidance interval is a setting of its own: guided ones only (ω = 0 has nothing to limit), sampled by the
    # pipeline with that interval
    assert sweep.main(argv + ["--intervals", "0,1", "0.5,1"]) == 0
    new = [json.loads(line) for line in out.read_text().splitlines()][6:]
    assert [(r["guidance"], r["final"], r["interval"]) for r in new] == [(2.0, "sample", [0.5, 1.0]),
                                                                        (2.0, "argmax", [0.5, 1.0])]
    want = tiny_pipeline(torch.arange(4).repeat_interleave(2), num_steps=2, guidance_scale=2.0, sampler="ddim",
                         final="sample", output_type="pt", generator=torch.Generator().manual_seed(0),
                         guidance_interval=(0.5, 1.0))
    assert torch.equal(scored[6], want) and not torch.equal(scored[6], scored[2])
    assert "| ddim | 2 | 2 | 0.5-1 | sample |" in out.with_suffix(".md").read_text()


def test_a_second_sampling_seed_in_the_same_file_is_sampled_not_skipped(tiny_pipeline, tmp_path, sweep_setup):
    sweep, folder, scored = sweep_setup
    out = tmp_path / "sweep.jsonl"
    argv = [str(folder), "--out", str(out), "--steps", "2", "--guidance", "0", "--finals", "sample",
            "--samplers", "ddim", "--per-class", "2"]
    assert sweep.main(argv + ["--seed", "0"]) == 0
    assert sweep.main(argv + ["--seed", "1"]) == 0
    assert sweep.main(argv + ["--seed", "1"]) == 0  # a rerun of seed 1 is a repeat: skipped
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["seed"] for r in recs] == [0, 1]
    want = tiny_pipeline(torch.arange(4).repeat_interleave(2), num_steps=2, guidance_scale=0.0, sampler="ddim",
                         final="sample", output_type="pt", generator=torch.Generator().manual_seed(1))
    assert len(scored) == 2 and torch.equal(scored[1], want) and not torch.equal(scored[0], scored[1])
    table = out.with_suffix(".md").read_text()
    assert "| seed |" in table.splitlines()[0] and len(table.strip().splitlines()) == 4  # header, rule, two rows
