"""ShardLoader: deterministic shuffle per (seed, epoch), rank sharding, exact resume."""
import numpy as np
import pytest
import torch

from vqlcmd.data.loader import ShardLoader
from vqlcmd.data.shards import TokenShardDataset, write_shard

N = 103  # odd on purpose: uneven shards, batches and ranks


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    ids = np.arange(N)
    # sample i carries its own index in token 0, so batches can be traced back to samples
    toks = np.stack([ids % 1000, ids // 1000, np.zeros(N, np.int64), np.zeros(N, np.int64)], 1)
    header = dict(codebook_size=1000, grid=[2, 2], tokenizer_id="t", num_classes=7, class_names=list("abcdefg"))
    for k, (a, b) in enumerate([(0, 40), (40, 41), (41, N)]):
        write_shard(root / f"s-{k}.vqtok", toks[a:b], ids[a:b] % 7, header)
    return TokenShardDataset(root)


def ids_of(batches):
    return [int(i) for t, _ in batches for i in t[:, 0]]


def test_batches_shapes_and_labels(ds):
    loader = ShardLoader(ds, 8, seed=1)
    batches = list(loader)
    assert len(batches) == len(loader) == N // 8
    t, y = batches[0]
    assert t.shape == (8, 4) and t.dtype == torch.int64 and y.shape == (8,) and y.dtype == torch.int64
    assert all((y == t[:, 0] % 7).all() for t, y in batches)
    assert loader.epoch == 1


def test_deterministic_per_seed_and_epoch(ds):
    a, b = ShardLoader(ds, 8, seed=3), ShardLoader(ds, 8, seed=3)
    e0a, e0b = ids_of(a), ids_of(b)
    assert e0a == e0b
    assert ids_of(a) != e0a  # a new epoch reshuffles
    assert ids_of(ShardLoader(ds, 8, seed=4)) != e0a
    assert len(set(e0a)) == len(e0a)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_partition_the_epoch(ds, world):
    per_rank = [ids_of(ShardLoader(ds, 5, rank=r, world_size=world, seed=0)) for r in range(world)]
    assert len({len(p) for p in per_rank}) == 1  # same step count on every rank
    flat = [i for p in per_rank for i in p]
    assert len(set(flat)) == len(flat)  # disjoint
    assert len(flat) == N // (5 * world) * 5 * world


def test_drop_last_false_covers_everything(ds):
    per_rank = [ids_of(ShardLoader(ds, 5, rank=r, world_size=2, drop_last=False)) for r in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) == 52
    assert set(per_rank[0]) | set(per_rank[1]) == set(range(N))


@pytest.mark.parametrize("stop_after", [0, 1, 6, 12])
def test_resume_exactly(ds, stop_after):
    ref = ShardLoader(ds, 8, rank=1, world_size=2, seed=9)
    expected = ids_of(ref) + ids_of(ref)  # two epochs
    run = ShardLoader(ds, 8, rank=1, world_size=2, seed=9)
    it, seen = iter(run.forever()), []
    for _ in range(stop_after):
        seen += ids_of([next(it)])
    state = run.state_dict()
    resumed = ShardLoader(ds, 8, rank=1, world_size=2, seed=9)
    resumed.load_state_dict(state)
    it = iter(resumed.forever())
    while len(seen) < len(expected):
        seen += ids_of([next(it)])
    assert seen == expected  # no repeats, no skips, across the epoch boundary


def test_resume_refuses_a_different_setup(ds):
    state = ShardLoader(ds, 8, seed=1).state_dict()
    with pytest.raises(ValueError, match="saved seed=1"):
        ShardLoader(ds, 8, seed=2).load_state_dict(state)
    run = ShardLoader(ds, 8, seed=1)
    next(iter(run))
    with pytest.raises(ValueError, match="saved at a global batch of 8 samples, this loader's is 12"):
        ShardLoader(ds, 4, seed=1, world_size=3).load_state_dict(run.state_dict())


def test_bad_arguments(ds):
    with pytest.raises(ValueError, match="rank 2 out of range"):
        ShardLoader(ds, 8, rank=2, world_size=2)
    with pytest.raises(ValueError, match="cannot fill one batch"):
        ShardLoader(ds, 64, world_size=2)


class _Seq:  # a data set without gather(): the per-item path
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i, 0]), torch.tensor(0)


@pytest.mark.parametrize("n, world", [(2, 5), (1, 3), (3, 8)])
def test_drop_last_false_gives_every_rank_its_batch_when_ranks_outnumber_samples(n, world):
    """The wrap-around padding was at most n long, so the last ranks got empty batches (a crash without gather)."""
    per_rank = [ids_of(ShardLoader(_Seq(n), 4, rank=r, world_size=world, drop_last=False)) for r in range(world)]
    assert all(len(ids) == 1 for ids in per_rank), per_rank
    assert set(sum(per_rank, [])) == set(range(n))


def test_an_empty_data_set_is_refused():
    with pytest.raises(ValueError, match="holds no samples"):
        ShardLoader(_Seq(0), 4, drop_last=False)


# ---- the documented rank split and the resume refusals for every setting the order depends on ----

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
