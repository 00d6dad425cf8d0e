"""ShardLoader: the documented rank split (every world_size-th sample of one shared permutation) and the
resume refusals for every setting the order depends on."""
import pytest
import torch

from vqlcmd.data.loader import ShardLoader


class _Seq:  # sample i is [i, 0]: batches trace back to samples
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, 0]), torch.tensor(0)


def ids_of(batches):
    return [int(i) for t, _ in batches for i in t[:, 0]]


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_take_every_world_size_th_sample_of_the_one_rank_order(world):
    """Module docstring: every rank computes the same permutation and takes every world_size-th sample of it.
    Interleaving the ranks' batches must give back the one-rank order of the same seed and epoch."""
    n = 23
    one = ShardLoader(_Seq(n), 4, seed=7, drop_last=False)
    ids_of(one)  # epoch 0
    single = ids_of(one)  # epoch 1: the permutation depends on the epoch too
    per_rank = []
    for r in range(world):
        loader = ShardLoader(_Seq(n), 4, rank=r, world_size=world, seed=7, drop_last=False)
        ids_of(loader)
        per_rank.append(ids_of(loader))
    interleaved = [per_rank[i % world][i // world] for i in range(n)]
    assert interleaved == single
    assert sorted(single) == list(range(n))


@pytest.mark.parametrize("change", [dict(seed=2), dict(n=24), dict(drop_last=False), dict(shuffle=False)])
def test_resume_refuses_every_setting_the_order_depends_on(change):
    """load_state_dict's own comment: resuming under different values would silently repeat or skip."""
    base = dict(seed=1, n=25, drop_last=True, shuffle=True)
    saved = ShardLoader(_Seq(base["n"]), 4, seed=base["seed"], drop_last=base["drop_last"], shuffle=base["shuffle"])
    it = iter(saved)
    next(it)
    state = saved.state_dict()
    new = {**base, **change}
    other = ShardLoader(_Seq(new["n"]), 4, seed=new["seed"], drop_last=new["drop_last"], shuffle=new["shuffle"])
    key = {"n": "num_samples"}.get(next(iter(change)), next(iter(change)))
    with pytest.raises(ValueError, match=rf"cannot resume loader: saved {key}="):
        other.load_state_dict(state)
    same = ShardLoader(_Seq(base["n"]), 4, seed=base["seed"], drop_last=base["drop_last"], shuffle=base["shuffle"])
    same.load_state_dict(state)
    assert (same.epoch, same.position) == (0, 1)


@pytest.mark.parametrize("stop_after", [5, 7])
def test_resume_inside_a_later_epoch(stop_after):
    """The existing resume test stops at batches 0, 1, 6, 12 of a 6-batch epoch: at 6 and 12 nothing of the
    compared two epochs is left, so a loader that restored the position but not the epoch passed."""
    def make():
        return ShardLoader(_Seq(50), 8, rank=1, world_size=2, seed=9)

    ref = make()
    expected = ids_of(ref) + ids_of(ref) + ids_of(ref)  # three epochs of 3 batches
    run = make()
    it, seen = iter(run.forever()), []
    for _ in range(stop_after):
        seen += ids_of([next(it)])
    state = run.state_dict()
    assert state["epoch"] >= 1 and 0 < state["position"] < 3
    resumed = make()
    resumed.load_state_dict(state)
    it = iter(resumed.forever())
    while len(seen) < len(expected):
        seen += ids_of([next(it)])
    assert seen == expected
