import json

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_digits(tmp_path_factory):
    """An untrained tiny VQModel tokenizer (16 codes of 4 dims, 16x16 px -> 4x4 tokens, fits the 'tiny'
    preset) and token shards of 96 real digits made by it: the whole pipeline in seconds."""
    from vqlcmd.data.digits import digits_images
    from vqlcmd.data.writer import write_token_shards
    from vqlcmd.tokenizer import load_tokenizer
    from vqlcmd.tokenizer.small import small_vqmodel

    root = tmp_path_factory.mktemp("tiny_digits")
    torch.manual_seed(0)
    model = small_vqmodel(channels=1, image_size=16, block_channels=(8, 8, 8), codebook_size=16, code_dim=4, groups=4)
    model.save_pretrained(str(root / "tokenizer"))
    tok = load_tokenizer(root / "tokenizer")
    images, labels = digits_images(16)
    images, labels = images[:96], labels[:96] % 4  # the tiny preset has 4 classes

    def batches(start, stop, bs=48):
        for i in range(start, stop, bs):
            yield images[i:min(i + bs, stop)], labels[i:min(i + bs, stop)]

    header = {"num_classes": 4, "class_names": ["0", "1", "2", "3"], "image_size": [16, 16], "channels": 1}
    write_token_shards(root / "shards", tok, len(images), batches, header, shard_size=64, progress=False,
                       log=lambda m: None)
    return root / "shards", root / "tokenizer"


@pytest.fixture
def tiny_config(tiny_digits, tmp_path):
    """make(**vqlcmd_overrides) -> path of a tiny-preset config on the tiny digits shards."""
    shards, tok = tiny_digits

    def make(steps=3, **section):
        cfg = {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_clipping": 1.0,
            "zero_optimization": {"stage": 2},
            "vqlcmd": {
                "model": {"preset": "tiny"},
                "data": {"shards": str(shards), "tokenizer": str(tok)},
                "optimizer": {"lr": 3e-3, "warmup_steps": 1},
                "train": {"steps": steps, "output_dir": str(tmp_path / "run"), "log_every": 1, "sample_every": 0,
                          "checkpoint_every": 0},
                **section,
            },
        }
        path = tmp_path / "cfg.json"
        path.write_text(json.dumps(cfg))
        return path

    return make
