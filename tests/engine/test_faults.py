"""Injected faults, driving the real scripts/train.py under the deepspeed launcher (2 ranks, gloo): what the
run resumed from, that nothing that had verified was lost, and the exact losses afterwards."""
import shutil

from test_world_size import _config, _launch, _losses


def test_a_byte_flip_and_a_save_killed_midway_fall_back_to_the_previous_checkpoint(tmp_path, tiny_shards):
    ref = tmp_path / "ref"
    _launch(2, _config(tmp_path, tiny_shards, ref, 2, 4))
    want = _losses(ref, {3, 4})

    run = tmp_path / "run"
    shutil.copytree(ref, run)
    ck = run / "checkpoints"
    victim = ck / "step_0000004" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit of an Adam moment: no NaN, DeepSpeed would load it silently
    victim.write_bytes(bytes(data))
    flipped = bytes(data)
    partial = ck / "step_0000006.partial"  # a save SIGKILLed midway: the folder never published
    shutil.copytree(ck / "step_0000002", partial)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"cut short")

    log = _launch(2, _config(tmp_path, tiny_shards, run, 2, 4))
    assert "failed verification" in log and victim.name in log
    assert "resuming from" in log and "step_0000002" in log
    aside = ck / "step_0000004.corrupt"
    assert (aside / victim.name).read_bytes() == flipped  # set aside whole, nothing deleted
    assert (ck / "step_0000002" / "manifest.json").is_file()  # the checkpoint that verified is kept
    assert (ck / "latest").read_text().strip() == "step_0000004" and (ck / "step_0000004").is_dir()
    assert _losses(run, {3, 4}) == want  # same ranks: bit for bit the uninterrupted run's
