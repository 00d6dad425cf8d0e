import pytest
import torch

from vqlcmd.model import preset_config
from vqlcmd.network import VQLCMDNetwork
from vqlcmd.pipeline import VQLCMDPipeline
from vqlcmd.schedule import ShiftedCosineSchedule


def _tiny_tokenizer(folder):
    """An untrained diffusers VQModel with 16 codes on a 4x4 grid (16 px, 1 channel): fits the tiny preset."""
    from vqlcmd.tokenizer import load_tokenizer
    from vqlcmd.tokenizer.small import small_vqmodel

    torch.manual_seed(0)
    small_vqmodel(channels=1, image_size=16, block_channels=(8, 8, 8), codebook_size=16, code_dim=4,
                  groups=4).save_pretrained(str(folder))
    return load_tokenizer(folder)


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """A randomly initialised tiny class-conditional pipeline (4 classes, K=16, 4x4 tokens) with a tokenizer."""
    root = tmp_path_factory.mktemp("tiny_pipeline")
    tok = _tiny_tokenizer(root / "tokenizer")
    torch.manual_seed(1)
    net = VQLCMDNetwork(preset_config("tiny"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # sharper logits than the init gives, so samples depend on the class and on z
        net.denoiser.head.weight.mul_(20)
        # AdaLN's maps start at zero, and they are the only way t and y reach the logits: without this every
        # label and guidance assertion on this pipeline was blind (test_pipeline_contract.py checks it is not)
        for m in net.modules():
            if hasattr(m, "to_ab"):
                m.to_ab.weight.normal_(0, 0.5, generator=gen)
    ref = {"path": str(root / "tokenizer"), "grid": [4, 4], "identifier": tok.identifier}
    return VQLCMDPipeline(net, ShiftedCosineSchedule(), tokenizer=tok, tokenizer_ref=ref, class_names=list("abcd"),
                          sample_defaults={"num_steps": 4, "guidance_scale": 1.0, "sampler": "ancestral",
                                           "final": "sample"})
