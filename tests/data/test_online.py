"""Online mode: the DALI pipeline feeding a frozen tokenizer batch by batch."""
import pytest
import torch
from image_tree import write_tree

from vqlcmd.data import image_batches, list_images
from vqlcmd.data.online import OnlineTokenLoader
from vqlcmd.tokenizer import VQModelTokenizer, small_vqmodel

SIZES = [(40, 52), (44, 40), (50, 50), (41, 60), (64, 48), (33, 32), (48, 64), (40, 40), (45, 38), (39, 51)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = write_tree(tmp_path_factory.mktemp("online"), sizes=SIZES)
    torch.manual_seed(0)
    tok = VQModelTokenizer(small_vqmodel(channels=3, image_size=16, block_channels=(8, 16), codebook_size=16,
                                         code_dim=4, groups=4))
    il = list_images(root)
    x = torch.cat([b for b, _ in image_batches(il, 16, 16, backend="dali")])
    plain = tok.encode(x).reshape(len(x), -1)
    flipped = tok.encode(x.flip(-1)).reshape(len(x), -1)
    return il, tok, plain, flipped


def _epoch(loader):
    return [(t, y) for t, y in loader]


def _sample_ids(batches, plain, flipped):
    """Which sample (and whether flipped) produced each row."""
    out = []
    for t, _ in batches:
        for row in t:
            hits = [(i, False) for i in range(len(plain)) if torch.equal(row, plain[i])] + \
                   [(i, True) for i in range(len(flipped)) if torch.equal(row, flipped[i])]
            assert hits, "row matches no image"
            out.append(hits[0])
    return out


def test_tokens_match_offline_tokenization_in_shardloader_order(setup):
    il, tok, plain, flipped = setup
    loader = OnlineTokenLoader(il, tok, 3, seed=5, flip=False, backend="dali")
    batches = _epoch(loader)
    assert len(batches) == len(loader) == 3 and loader.epoch == 1
    order = loader._order.epoch_indices(0)[:9]
    got = torch.cat([t for t, _ in batches])
    assert got.dtype == torch.int64 and got.shape == (9, 64)
    assert torch.equal(got, plain[order])
    assert torch.cat([y for _, y in batches]).tolist() == [il.labels[i] for i in order]
    assert loader.header["codebook_size"] == 16 and loader.header["tokenizer_id"] == tok.identifier


def test_random_flips_change_between_epochs(setup):
    il, tok, plain, flipped = setup
    loader = OnlineTokenLoader(il, tok, 5, seed=0, flip=True, backend="dali")
    e0 = _sample_ids(_epoch(loader), plain, flipped)
    e1 = _sample_ids(_epoch(loader), plain, flipped)
    assert any(f for _, f in e0) and not all(f for _, f in e0)
    flips0, flips1 = dict(e0), dict(e1)
    assert any(flips0[i] != flips1[i] for i in flips0 if i in flips1)


def test_ranks_and_resume(setup):
    il, tok, plain, flipped = setup
    ranks = [_sample_ids(_epoch(OnlineTokenLoader(il, tok, 2, rank=r, world_size=2, flip=False, backend="dali")),
                         plain, flipped) for r in range(2)]
    seen = [i for r in ranks for i, _ in r]
    assert len(seen) == len(set(seen)) == 8
    a = OnlineTokenLoader(il, tok, 2, seed=3, flip=False, backend="dali")
    it = iter(a)
    first = [next(it)]
    b = OnlineTokenLoader(il, tok, 2, seed=3, flip=False, backend="dali")
    b.load_state_dict(a.state_dict())
    rest = _epoch(b)
    ref = _epoch(OnlineTokenLoader(il, tok, 2, seed=3, flip=False, backend="dali"))
    assert torch.equal(torch.cat([t for t, _ in first + rest]), torch.cat([t for t, _ in ref]))


def test_the_flip_coins_are_drawn_afresh_each_epoch(setup):
    """'A fresh random flip every epoch': the coins themselves must differ between epochs. Reusing one coin
    sequence per position still flipped other samples (the order is reshuffled), which the existing test
    took for fresh flips."""
    il, tok, plain, flipped = setup
    loader = OnlineTokenLoader(il, tok, 5, seed=0, flip=True, backend="dali")
    coins = [[f for _, f in _sample_ids(loader, plain, flipped)] for _ in range(3)]
    assert all(len(c) == 10 for c in coins)
    assert coins[0] != coins[1] or coins[1] != coins[2]
    assert any(any(c) for c in coins) and not all(all(c) for c in coins)


def test_drop_last_false_gives_every_sample(setup):
    """drop_last is ShardLoader's: False keeps the last, smaller batch, so an epoch holds every sample."""
    il, tok, plain, flipped = setup
    loader = OnlineTokenLoader(il, tok, 3, seed=1, flip=False, backend="dali", drop_last=False)
    assert len(loader) == 4
    seen = [i for i, _ in _sample_ids(loader, plain, flipped)]
    assert sorted(seen) == list(range(10))  # batches of 3, 3, 3, 1
    assert len(OnlineTokenLoader(il, tok, 3, seed=1, flip=False, backend="dali")) == 3
