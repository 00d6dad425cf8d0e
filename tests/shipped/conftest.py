import pytest
from shipped_data import build


@pytest.fixture(scope="session")
def shipped_data(tmp_path_factory, load_script):
    """Token sets in ImageNet's and FFHQ's layouts and their tokenizer: shipped_data.build."""
    # tokenize.py in this process: a subprocess would import torch again
    return build(tmp_path_factory.mktemp("shipped_data"), load_script("tokenize").main)
