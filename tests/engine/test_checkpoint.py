"""Checkpoint publishing and pruning (vqlcmd/engine/checkpoint.py), on plain folders."""
import pytest

from vqlcmd.engine import checkpoint as ckpt


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
