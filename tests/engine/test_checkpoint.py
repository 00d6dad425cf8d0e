"""Checkpoint publishing and pruning (vqlcmd/engine/checkpoint.py), on plain folders."""
import pytest

from vqlcmd.engine import checkpoint_folder as ckpt


def _partial(ck, step):
    (ck / f"{ckpt.tag_for(step)}.partial").mkdir(parents=True)


def _steps(ck):
    return [int(p.name[5:]) for p in ckpt.complete_checkpoints(ck)]


@pytest.mark.parametrize("keep, kept", [(1, [5]), (2, [4, 5]), (3, [3, 4, 5]), (5, [1, 2, 3, 4, 5]),
                                        (0, [1, 2, 3, 4, 5])])
def test_commit_keeps_the_newest(tmp_path, keep, kept):
    for step in range(1, 6):
        _partial(tmp_path, step)
        ckpt.commit(tmp_path, step, keep)
    assert _steps(tmp_path) == kept
    assert (tmp_path / "latest").read_text().strip() == "step_0000005"


def test_commit_never_prunes_what_it_just_published(tmp_path):
    # higher step numbers than the one being published (another run's): pruning by step number alone
    # deleted the new checkpoint and left `latest` naming a missing folder
    for step in (20, 30):
        _partial(tmp_path, step)
        ckpt.commit(tmp_path, step, 3)
    _partial(tmp_path, 15)
    ckpt.commit(tmp_path, 15, 2)
    assert _steps(tmp_path) == [15, 30]
    assert ckpt.latest_tag(tmp_path) == "step_0000015"


def test_a_stale_partial_is_cleared_and_latest_stays_complete(tmp_path):
    _partial(tmp_path, 1)
    ckpt.commit(tmp_path, 1, 2)
    _partial(tmp_path, 2)  # a crash mid-write
    assert ckpt.latest_tag(tmp_path) == "step_0000001"
    _partial(tmp_path, 3)
    ckpt.commit(tmp_path, 3, 2)
    assert not list(tmp_path.glob("*.partial")) and _steps(tmp_path) == [1, 3]


def test_saving_a_step_again_keeps_the_complete_one_until_the_new_one_is_in(tmp_path, monkeypatch):
    # the complete checkpoint was deleted first: a crash before the new one was renamed in left none
    _partial(tmp_path, 4)
    (tmp_path / "step_0000004.partial" / "old").write_text("first")
    ckpt.commit(tmp_path, 4, 1)
    _partial(tmp_path, 4)
    (tmp_path / "step_0000004.partial" / "new").write_text("second")
    real_replace = ckpt.os.replace

    def crash_on_the_new_one(src, dst):
        if str(src).endswith(".partial"):
            raise KeyboardInterrupt("killed")
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", crash_on_the_new_one)
    with pytest.raises(KeyboardInterrupt):
        ckpt.commit(tmp_path, 4, 1)
    monkeypatch.setattr(ckpt.os, "replace", real_replace)
    # the next launch finds the complete checkpoint again, under its own name
    assert ckpt.latest_tag(tmp_path) == "step_0000004"
    assert (tmp_path / "step_0000004" / "old").read_text() == "first"
    ckpt.commit(tmp_path, 4, 1)  # and a later save of that step replaces it cleanly
    assert (tmp_path / "step_0000004" / "new").exists() and not list(tmp_path.glob("*.replaced"))


def _complete(ck, step):
    (ck / ckpt.tag_for(step)).mkdir(parents=True)


def test_without_latest_the_newest_complete_checkpoint_is_taken(tmp_path):
    """latest_tag: 'else the newest complete one'; a .partial or .replaced folder is never complete."""
    for step in (2, 10, 4):
        _complete(tmp_path, step)
    (tmp_path / "step_0000020.partial").mkdir()
    (tmp_path / "step_0000030.replaced").mkdir()
    (tmp_path / "step_0000040.tmp").mkdir()
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path)] == ["step_0000002", "step_0000004", "step_0000010"]
    assert ckpt.latest_tag(tmp_path) == "step_0000010"
    # `latest` naming a folder that is gone (deleted by hand): the newest complete one, again
    (tmp_path / "latest").write_text("step_0000099\n")
    assert ckpt.latest_tag(tmp_path) == "step_0000010"
    assert ckpt.latest_tag(tmp_path / "nowhere") is None


def test_a_damaged_checkpoint_names_the_one_just_before_it(tmp_path):
    for step in (2, 4, 6):
        _complete(tmp_path, step)
    msg = ckpt.unreadable(tmp_path / "step_0000006", "truncated file")
    assert msg.startswith(f"cannot resume from {tmp_path / 'step_0000006'}: truncated file.")
    assert "resume from the previous one (step_0000004) by moving" in msg
    only = tmp_path / "only"
    _complete(only, 2)
    assert ckpt.unreadable(only / "step_0000002", "x").endswith("move it away to train afresh")


# ---- manifests, fallback and retention ------------------------------------------------------------------
from checkpoint_files import fake_checkpoint, flip_byte  # noqa: E402
from vqlcmd.engine.manifest import MANIFEST, ManifestError, verify_manifest  # noqa: E402


def _saved(ck, step, keep=0, **kw):
    """A checkpoint as the trainer publishes one: files in <tag>.partial, then commit."""
    fake_checkpoint(ck / f"{ckpt.tag_for(step)}.partial", seed=step, **kw)
    return ckpt.commit(ck, step, keep)


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_commit_writes_the_manifest_before_the_rename(tmp_path, monkeypatch):
    fake_checkpoint(tmp_path / "step_0000005.partial")
    seen = []
    real_replace = ckpt.os.replace

    def look(src, dst):
        if str(src).endswith(".partial"):
            seen.append(verify_manifest(src))  # complete and verifying while still .partial
        real_replace(src, dst)

    monkeypatch.setattr(ckpt.os, "replace", look)
    final = ckpt.commit(tmp_path, 5, 2)
    assert len(seen) == 1 and set(seen[0]["files"]) == set(_files(final)) - {MANIFEST}
    assert verify_manifest(final) == seen[0]


def test_old_checkpoints_are_deleted_only_after_the_new_one_is_on_disk(tmp_path, monkeypatch):
    _saved(tmp_path, 1)
    fake_checkpoint(tmp_path / "step_0000002.partial")
    events = []
    real_fsync, real_rmtree = ckpt.os.fsync, ckpt.shutil.rmtree
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(ckpt.shutil, "rmtree", lambda p, **kw: (events.append(f"rm {p.name}"), real_rmtree(p, **kw)))
    ckpt.commit(tmp_path, 2, 1)
    # every file of the new one, its manifest, its folder, and `latest` with the renames, then the old one goes
    assert events.index("rm step_0000001") > max(i for i, e in enumerate(events) if e == "fsync")
    assert events.count("fsync") >= len(_files(tmp_path / "step_0000002")) + 2


def test_a_commit_whose_manifest_cannot_be_written_publishes_and_prunes_nothing(tmp_path, monkeypatch):
    import errno

    from vqlcmd.engine import manifest

    _saved(tmp_path, 1)
    fake_checkpoint(tmp_path / "step_0000002.partial")

    def full_disk(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(manifest, "atomic_write_text", full_disk)
    with pytest.raises(ckpt.CheckpointError, match="No space left on device.*checkpoints before it are kept"):
        ckpt.commit(tmp_path, 2, 1)
    assert _steps(tmp_path) == [1] and ckpt.latest_tag(tmp_path) == "step_0000001"
    verify_manifest(tmp_path / "step_0000001")


@pytest.mark.parametrize("keep", [1, 2])
def test_retention_never_leaves_no_checkpoint_that_verifies(tmp_path, keep):
    """Every other save is corrupted on disk right after it is published, and the run resumes (a crash): each
    save's pruning leaves a checkpoint that verifies (the one it published), a resume finds the newest good
    one (with keep=2 the one before the corrupted), and what was set aside is never pruned."""
    def verifying():
        good = []
        for p in ckpt.complete_checkpoints(tmp_path):
            try:
                verify_manifest(p)
                good.append(p.name)
            except ManifestError:
                pass
        return good

    for step in range(1, 7):
        _saved(tmp_path, step, keep=keep)
        assert ckpt.tag_for(step) in verifying() and len(ckpt.complete_checkpoints(tmp_path)) == min(step, keep)
        if step % 2 == 0 and keep == 2:
            flip_byte(tmp_path / ckpt.tag_for(step) / "rank_00000_state.pt")
            assert ckpt.resumable_checkpoint(tmp_path, log=lambda s: None) == tmp_path / ckpt.tag_for(step - 1)
    if keep == 2:
        assert [p.name for p in ckpt.set_aside_checkpoints(tmp_path)] == [
            "step_0000006.corrupt", "step_0000004.corrupt", "step_0000002.corrupt"]


def test_the_fallback_takes_the_previous_good_one_and_logs_it_by_name(tmp_path):
    for step in (10, 20, 30):
        _saved(tmp_path, step)
    bad = tmp_path / "step_0000030" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    flip_byte(bad, at=bad.stat().st_size - 2000)
    before = _files(tmp_path / "step_0000030")
    lines = []
    chosen = ckpt.resumable_checkpoint(tmp_path, log=lines.append)
    assert chosen == tmp_path / "step_0000020"
    assert ckpt.latest_tag(tmp_path) == "step_0000020"  # what the other ranks and the next launch read
    aside = tmp_path / "step_0000030.corrupt"
    assert _files(aside) == before  # nothing deleted, nothing changed
    assert _steps(tmp_path) == [10, 20]
    assert any("step_0000030/zero_pp_rank_0_mp_rank_00_optim_states.pt: corrupt" in ln and "step_0000030.corrupt"
               in ln for ln in lines)
    assert any(f"resuming from {chosen}" in ln for ln in lines)
    # the run goes on and saves step 30 again: the set-aside one stays beside it, and is never pruned
    _saved(tmp_path, 30, keep=1)
    assert _steps(tmp_path) == [30] and _files(aside) == before
    assert ckpt.resumable_checkpoint(tmp_path, log=lines.append) == tmp_path / "step_0000030"


@pytest.mark.parametrize("damage", ["truncate", "delete", "config", "rank state", "manifest"])
def test_each_damage_falls_back_by_name(tmp_path, damage):
    _saved(tmp_path, 1, ranks=2)
    _saved(tmp_path, 2, ranks=2)
    folder = tmp_path / "step_0000002"
    name = {"truncate": "mp_rank_00_model_states.pt", "delete": "rank_00001_state.pt", "config": "config.json",
            "rank state": "rank_00000_state.pt", "manifest": MANIFEST}[damage]
    path = folder / name
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "delete":
        path.unlink()
    elif damage == "config":
        path.write_text(path.read_text()[:-1] + "#")  # invalid JSON, same size
    elif damage == "rank state":
        flip_byte(path, at=path.stat().st_size - 600)
    else:
        path.write_text(path.read_text()[:40])
    lines = []
    assert ckpt.resumable_checkpoint(tmp_path, log=lines.append) == tmp_path / "step_0000001"
    assert f"step_0000002/{name}:" in lines[0] and "set aside as step_0000002.corrupt" in lines[0]


def test_latest_naming_a_missing_folder_falls_back_with_a_log_line(tmp_path):
    for step in (1, 2):
        _saved(tmp_path, step)
    (tmp_path / "latest").write_text("step_0000009\n")
    lines = []
    assert ckpt.resumable_checkpoint(tmp_path, log=lines.append) == tmp_path / "step_0000002"
    assert "names step_0000009, which is not there; taking the newest complete checkpoint, step_0000002" in lines[0]
    assert (tmp_path / "latest").read_text() == "step_0000002\n"
    (tmp_path / "latest").write_bytes(b"\xff\x00garbage")  # a damaged `latest`: named nothing, not ckpt_dir
    assert ckpt.latest_tag(tmp_path) == "step_0000002"
    assert ckpt.resumable_checkpoint(tmp_path, log=lines.append) == tmp_path / "step_0000002"


def test_none_verifying_is_one_line_naming_the_file_now_and_at_the_next_launch(tmp_path):
    for step in (1, 2):
        _saved(tmp_path, step)
    (tmp_path / "step_0000002" / "rank_00000_state.pt").unlink()
    path = tmp_path / "step_0000001" / "config.json"
    path.write_text(path.read_text().replace("{", "(", 1))
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.resumable_checkpoint(tmp_path, log=lambda s: None)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"no checkpoint in {tmp_path} verifies: ")
    assert "step_0000002/rank_00000_state.pt: missing" in msg and "step_0000001/config.json: corrupt" in msg
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_0000001.corrupt", "step_0000002.corrupt"]
    # the next launch (a scheduler's retry) does not train afresh beside them: the same stop, by name
    with pytest.raises(ckpt.CheckpointError, match=r"step_0000002\.corrupt/rank_00000_state\.pt: missing"):
        ckpt.resumable_checkpoint(tmp_path, log=lambda s: None)
    assert ckpt.resumable_checkpoint(tmp_path / "fresh", log=lambda s: None) is None


def test_a_name_taken_by_an_earlier_set_aside_gets_a_number(tmp_path):
    _saved(tmp_path, 1)
    for n in range(2):
        _saved(tmp_path, 2)
        flip_byte(tmp_path / "step_0000002" / "config.json", at=3)
        assert ckpt.resumable_checkpoint(tmp_path, log=lambda s: None) == tmp_path / "step_0000001"
    assert (tmp_path / "step_0000002.corrupt").is_dir() and (tmp_path / "step_0000002.corrupt.2").is_dir()
    assert [p.name for p in ckpt.set_aside_checkpoints(tmp_path)] == ["step_0000002.corrupt.2", "step_0000002.corrupt"]


def test_checkpoints_from_before_manifests_resume_unverified_and_a_lost_manifest_does_not(tmp_path):
    for step in (1, 2):
        fake_checkpoint(tmp_path / ckpt.tag_for(step))  # written before commit wrote manifests
    lines = []
    assert ckpt.resumable_checkpoint(tmp_path, log=lines.append) == tmp_path / "step_0000002"
    assert "has no manifest.json (written before checkpoints carried one): resuming it unverified" in lines[0]
    _saved(tmp_path, 3)
    _saved(tmp_path, 4)
    (tmp_path / "step_0000004" / MANIFEST).unlink()  # after one that has a manifest: it was lost
    lines.clear()
    assert ckpt.resumable_checkpoint(tmp_path, log=lines.append) == tmp_path / "step_0000003"
    assert "step_0000004/manifest.json: missing, though an older checkpoint beside it has one" in lines[0]


def test_verify_checkpoints_prints_a_line_each_and_fails_only_on_the_one_resumed_first(tmp_path, load_script,
                                                                                      capsys):
    run = tmp_path / "run"
    ck = run / "checkpoints"
    for step in (1, 2, 3):
        _saved(ck, step)
    fake_checkpoint(ck / "step_0000000")  # from before manifests
    train = load_script("train")
    assert train.main(["--verify-checkpoints", str(run)]) == 0  # no --config needed
    assert capsys.readouterr().out.splitlines() == [
        "step_0000003 (resumed first): ok", "step_0000002: ok", "step_0000001: ok",
        "step_0000000: unverified: no manifest.json (written before checkpoints carried one)"]
    (ck / "step_0000001" / "config.json").write_text("{}")
    assert ckpt.verify_checkpoints_cli(ck) == 0  # an older one failing: said, but a resume would not take it
    assert "step_0000001: FAILED: step_0000001/config.json: truncated" in capsys.readouterr().out
    before = {p.name: _files(p) for p in ck.iterdir() if p.is_dir()}
    (ck / "step_0000003" / "rank_00000_state.pt").unlink()
    assert train.main(["--verify-checkpoints", str(ck)]) == 1
    out = capsys.readouterr().out
    assert "step_0000003 (resumed first): FAILED: step_0000003/rank_00000_state.pt: missing" in out
    del before["step_0000003"]
    assert {p.name: _files(p) for p in ck.iterdir() if p.is_dir() and p.name != "step_0000003"} == before  # read-only
    # one folder on its own, and what is not a checkpoint folder
    assert ckpt.verify_checkpoints_cli(ck / "step_0000002") == 0
    assert capsys.readouterr().out == "step_0000002 (resumed first): ok\n"
    assert ckpt.verify_checkpoints_cli(tmp_path / "nowhere") == 1
    (tmp_path / "empty").mkdir()
    assert ckpt.verify_checkpoints_cli(tmp_path / "empty") == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{tmp_path / 'nowhere'}: no such folder",
        f"{tmp_path / 'empty'}: no checkpoints (step_* folders) and no manifest.json here"]


def test_verify_checkpoints_names_latest_pointing_nowhere_and_set_aside_folders(tmp_path, capsys):
    for step in (1, 2):
        _saved(tmp_path, step)
    (tmp_path / "latest").write_text("step_0000007\n")
    assert ckpt.verify_checkpoints_cli(tmp_path) == 0
    assert capsys.readouterr().out.splitlines()[:2] == [
        f"{tmp_path / 'latest'} names step_0000007, which is not there", "step_0000002 (resumed first): ok"]
    for step in (1, 2):
        flip_byte(tmp_path / ckpt.tag_for(step) / "config.json", at=2)
    with pytest.raises(ckpt.CheckpointError):
        ckpt.resumable_checkpoint(tmp_path, log=lambda s: None)
    assert ckpt.verify_checkpoints_cli(tmp_path) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("step_0000002.corrupt: FAILED: step_0000002.corrupt/config.json: corrupt: xxh3_64 ")
    assert out[2].startswith("step_0000001.corrupt: FAILED: step_0000001.corrupt/config.json: corrupt: xxh3_64 ")
    assert out[3] == f"{tmp_path}: no checkpoint to resume (only folders set aside as .corrupt)" and len(out) == 4
