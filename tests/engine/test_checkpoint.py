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
