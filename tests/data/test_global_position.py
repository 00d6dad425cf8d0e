"""The loader's position is global (vqlcmd/data/loader.py): a run resumed on another number of ranks,
accumulating more or fewer micro-batches for the same global batch, takes exactly the samples of the
uninterrupted run, in the same slots, none repeated and none skipped; on token shards and on the images
source."""
import numpy as np
import pytest
import torch
from image_tree import write_tree

from vqlcmd.data.loader import ShardLoader
from vqlcmd.data.online import OnlineTokenLoader


class _Ids:  # sample i is the token row [i]: what a batch holds is read off it
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def gather(self, idx):
        idx = torch.as_tensor(np.asarray(idx), dtype=torch.int64)
        return idx[:, None], torch.zeros(len(idx), dtype=torch.int64)


N, MICRO, SEED = 100, 3, 4  # global batch 12 -> 8 steps per epoch, 4 samples trimmed


def _loaders(world, acc, data=None):
    return [ShardLoader(data or _Ids(N), MICRO, rank=r, world_size=world, accumulation=acc, seed=SEED)
            for r in range(world)]


def _steps(loaders, n, its=None):
    """n optimizer steps of every rank: [{slot: sample ids}] (slot of rank r's micro-step k: r + world * k)."""
    world, acc = len(loaders), loaders[0].accumulation
    its = its or [iter(lo.forever()) for lo in loaders]
    out = []
    for _ in range(n):
        step = {}
        for k in range(acc):
            for r, it in enumerate(its):
                step[r + world * k] = next(it)[0][:, 0].tolist()
        out.append(step)
    return out, its


def _reference(steps):
    """The permutation's consecutive global batches, slot v taking every 4th sample from the v-th on."""
    out = []
    for s in range(steps):
        epoch, within = divmod(s, N // 12)
        order = np.random.Generator(np.random.PCG64([SEED, epoch])).permutation(N)
        chunk = order[within * 12:(within + 1) * 12]
        out.append({v: chunk[v::4].tolist() for v in range(4)})
    return out


@pytest.mark.parametrize("world,acc", [(1, 4), (2, 2), (4, 1)])
def test_the_slots_of_a_step_do_not_depend_on_the_number_of_ranks(world, acc):
    got, _ = _steps(_loaders(world, acc), 10)  # into the second epoch
    assert got == _reference(10)


@pytest.mark.parametrize("then,now", [((2, 2), (1, 4)), ((1, 4), (2, 2)), ((2, 2), (4, 1)), ((4, 1), (1, 4))])
@pytest.mark.parametrize("stop", [3, 8])  # mid-epoch, and at the epoch's end
def test_a_resume_on_another_world_size_takes_the_uninterrupted_runs_samples(then, now, stop):
    run = _loaders(*then)
    first, _ = _steps(run, stop)
    saved = [lo.state_dict() for lo in run]
    # global, alike on every rank (at the epoch's end: all of it, the next epoch begins at the next batch)
    assert all(s["samples"] == stop * 12 and s["epoch"] == 0 for s in saved)
    resumed = _loaders(*now)
    for lo in resumed:  # any saved rank's state will do: every rank loads rank 0's
        lo.load_state_dict(saved[0])
    rest, _ = _steps(resumed, 16 - stop)
    assert first + rest == _reference(16)
    epoch = [i for step in (first + rest)[:8] for ids in step.values() for i in ids]
    assert len(epoch) == len(set(epoch)) == 96  # none repeated, none skipped (4 trimmed)


def test_a_mid_step_position_resumes_on_its_own_layout_only():
    run = _loaders(1, 4)[0]
    it = iter(run)
    next(it)
    next(it)
    state = run.state_dict()
    assert state["micro_in_step"] == 2
    same = _loaders(1, 4)[0]
    same.load_state_dict(state)
    assert same.position == 2
    with pytest.raises(ValueError, match="2 micro-batch\\(es\\) into a step"):
        _loaders(2, 2)[0].load_state_dict(state)


def test_a_state_from_before_global_positions_maps_by_the_samples_it_consumed():
    # such a loader took one micro-batch per step on every rank: position p = p * micro * world samples
    legacy = {"epoch": 1, "position": 4, "seed": SEED, "rank": 0, "world_size": 4, "batch_size": MICRO,
              "num_samples": N, "drop_last": True, "shuffle": True}
    lo = _loaders(2, 2)[0]
    lo.load_state_dict(legacy)
    assert (lo.epoch, lo.position) == (1, 8)  # 48 samples = 4 global batches of 12, 2 micro-steps each


def test_the_images_source_resumes_on_another_world_size_alike(tmp_path):
    from vqlcmd.data.images import list_images
    from vqlcmd.tokenizer import VQModelTokenizer, small_vqmodel

    root = write_tree(tmp_path, sizes=[(20 + i, 24) for i in range(16)])
    torch.manual_seed(0)
    tok = VQModelTokenizer(small_vqmodel(channels=3, image_size=16, block_channels=(8, 16), codebook_size=16,
                                         code_dim=4, groups=4))
    images = list_images(root)

    def loaders(world, acc):
        return [OnlineTokenLoader(images, tok, 2, rank=r, world_size=world, accumulation=acc, seed=3, flip=True,
                                  backend="pil") for r in range(world)]

    def steps(los, n):
        its = [iter(lo.forever()) for lo in los]
        out = []
        for _ in range(n):
            out.append({r + len(los) * k: next(it)[0] for k in range(los[0]._order.accumulation)
                        for r, it in enumerate(its)})
        return out

    reference = steps(loaders(2, 1), 6)  # 16 images / global batch 4: 4 steps an epoch, into the next one
    run = loaders(2, 1)
    first = steps(run, 3)
    resumed = loaders(1, 2)
    resumed[0].load_state_dict(run[0].state_dict())
    rest = steps(resumed, 3)
    for want, got in zip(reference, first + rest):
        assert want.keys() == got.keys() and all(torch.equal(want[v], got[v]) for v in want)
