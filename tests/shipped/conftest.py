import pytest
from shipped_data import build

from vqlcmd.cli import tokenize_images


@pytest.fixture(scope="session")
def shipped_data(tmp_path_factory):
    """Token sets in ImageNet's and FFHQ's layouts and their tokenizer: shipped_data.build."""
    # vqlcmd-tokenize in this process: a subprocess would import torch again
    return build(tmp_path_factory.mktemp("shipped_data"), tokenize_images.main)
