"""The token sets the shipped-config runs train on have the layout the configs' presets expect."""
from shipped_data import FFHQ_IMAGES, IMAGENET_CLASSES, IMAGENET_USED

from vqlcmd.data import TokenShardDataset
from vqlcmd.model import preset_config


def test_token_sets_have_the_layout_of_the_shipped_configs(shipped_data):
    for name, preset, n in (("imagenet", "imagenet-246m", len(IMAGENET_USED)), ("ffhq", "ffhq-56m", FFHQ_IMAGES)):
        ds = TokenShardDataset(shipped_data[name])
        cfg = preset_config(preset)
        assert len(ds) == n
        assert ds.header["codebook_size"] == cfg.codebook_size == 1024
        assert list(ds.header["grid"]) == [16, 16] and cfg.seq_len == 256
        assert (ds.header["num_classes"] or 0) == cfg.num_classes
        tokens, labels = ds.arrays()
        assert tokens.min() >= 0 and tokens.max() < 1024 and len(set(tokens.reshape(-1).tolist())) > 8
    labels = sorted(TokenShardDataset(shipped_data["imagenet"]).arrays()[1].tolist())
    assert labels == list(IMAGENET_USED) and IMAGENET_CLASSES == 1000
