"""Data for the shipped configs' runs: token sets in ImageNet's and FFHQ's layouts (1024 codes, 16x16 tokens per
256x256 image), written by vqlcmd-tokenize from small image trees through a taming-layout f16/1024 VQGAN with
random weights, converted as a user converts the released checkpoint. conftest.py builds them once per test session."""
import importlib.util
import warnings
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1]

# The VQGAN's layout at the least cost: the released one's f16 downsampling (5 levels), 1024 codes, 256 px input
# and attention at 16x16, at 32 channels (taming's GroupNorm takes 32 groups). 0.2 s per image on one core.
TAMING_F16_1024_SMALL = dict(ch=32, ch_mult=[1, 1, 1, 1, 1], num_res_blocks=1, attn_resolutions=[16], z_channels=32,
                             embed_dim=8, n_embed=1024, resolution=256, in_channels=3, out_ch=3)
# ImageNet's 1000 class folders, images in a few of them (0.2 s each to tokenize: 1000 would take minutes). The
# empty folders keep their labels (vqlcmd-tokenize warns of them), so the label space is ImageNet's, as the
# imagenet-246m preset's 1000-row class table expects; the used classes include the first and the last.
IMAGENET_CLASSES = 1000
IMAGENET_USED = (0, 1, 207, 388, 511, 817, 998, 999)
FFHQ_IMAGES = 8


def _module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build(root: Path, tokenize) -> dict:
    """{"tokenizer": folder, "imagenet": shards, "ffhq": shards} under ``root``; ``tokenize``: vqlcmd-tokenize's
    main."""
    from PIL import Image

    from vqlcmd.tokenizer import convert_taming_checkpoint

    taming = _module(TESTS / "tokenizer" / "taming_reference.py")
    picture = _module(TESTS / "data" / "image_tree.py").picture
    torch.manual_seed(0)
    ref = taming.TamingVQModel(TAMING_F16_1024_SMALL)
    with torch.no_grad():
        ref.quantize.embedding.weight.normal_()  # spread out, so random encodings use many codes
    torch.save({"state_dict": ref.state_dict(), "global_step": 0, "epoch": 0}, root / "last.ckpt")
    convert_taming_checkpoint(root / "last.ckpt", root / "vqgan", TAMING_F16_1024_SMALL)

    imagenet = root / "imagenet"
    for c in range(IMAGENET_CLASSES):
        (imagenet / f"n{c:08d}").mkdir(parents=True)
    for i, c in enumerate(IMAGENET_USED):  # sizes that need a resize and a crop, as ImageNet's do
        Image.fromarray(picture(80 + 8 * i, 96, i)).save(imagenet / f"n{c:08d}" / f"im{i}.jpg", quality=92)
    ffhq = root / "ffhq"
    ffhq.mkdir()
    for i in range(FFHQ_IMAGES):
        Image.fromarray(picture(96, 96, 100 + i)).save(ffhq / f"{i:05d}.png")
    for images in (imagenet, ffhq):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*class folder.*hold no readable image")  # as meant
            tokenize(["--images", str(images), "--tokenizer", str(root / "vqgan"), "--out",
                      str(root / f"{images.name}_tokens"), "--device", "cpu", "--no-progress", "--batch-size", "8"])
    return {"tokenizer": root / "vqgan", "imagenet": root / "imagenet_tokens", "ffhq": root / "ffhq_tokens"}
