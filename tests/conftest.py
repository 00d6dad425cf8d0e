import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in the interpreter (docs/building.md, "Ops and backends"). triton.jit fixes
# interpreter or compiler when a kernel is decorated, and any test may be the first to load vqlcmd.kernels
# (through the op dispatcher), so the variable is set here, before any test module is imported. ``auto`` never
# picks the interpreter, so other tests are unaffected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Subprocesses (``python scripts/train.py``, the launchers' ranks) import the tree under test, as this process
# does, rather than whichever copy of vqlcmd is installed.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")) if p)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# A Trainer built inside the test process sets up a one-rank process group and writes RANK,
# MASTER_PORT, ... into os.environ (DeepSpeed reads them from there). A later test that starts
# scripts/train.py as a subprocess would inherit them, skip its own free-port choice and fail with
# EADDRINUSE on the port this process still holds; so each test leaves these as it found them.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launcher_env_restored():
    saved = {k: os.environ.get(k) for k in _LAUNCHER_VARS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def load_script():
    """``load_script("digits_table")``: scripts/digits_table.py as a module, to call its ``main(argv)`` in-process (the
    scripts are files, not a package)."""
    scripts = Path(__file__).resolve().parents[1] / "scripts"

    def load(name: str):
        spec = importlib.util.spec_from_file_location(f"{name}_script", scripts / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(0)


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
