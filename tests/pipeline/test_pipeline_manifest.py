"""A manifest on an exported pipeline folder: every file listed (the tokenizer's too), and a damaged weights
file named, though safetensors itself still loads it."""

import pytest
import torch
from safetensors.torch import load_file

from vqlcmd.engine.manifest import MANIFEST, ManifestError, verify_manifest, write_manifest


def _flip_in_tensor_data(path):
    """One byte flipped inside the tensor data of a safetensors file (past its JSON header)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    at = header + (len(data) - header) // 2
    data[at] ^= 0x04
    path.write_bytes(bytes(data))


def test_a_pipeline_folder_manifest_names_a_damaged_weights_file(tiny_pipeline, tmp_path):
    folder = tiny_pipeline.save_pretrained(tmp_path / "pipeline")
    manifest = write_manifest(folder)
    assert {"model.safetensors", "config.json"} <= set(manifest["files"])
    assert any(name.startswith("tokenizer/") for name in manifest["files"])
    verify_manifest(folder)
    weights = folder / "model.safetensors"
    before = {k: v.clone() for k, v in load_file(str(weights)).items()}  # (load_file maps the file)
    _flip_in_tensor_data(weights)
    after = load_file(str(weights))  # still a valid file: only the manifest tells
    assert any(not torch.equal(before[k], after[k]) for k in before)
    with pytest.raises(ManifestError, match="corrupt") as err:
        verify_manifest(folder)
    assert err.value.path == weights


def test_a_pipeline_folder_manifest_names_a_damaged_tokenizer_file(tiny_pipeline, tmp_path):
    folder = tiny_pipeline.save_pretrained(tmp_path / "pipeline")
    write_manifest(folder)
    tok_config = folder / "tokenizer" / "config.json"
    tok_config.write_text(tok_config.read_text() + " ")
    with pytest.raises(ManifestError, match="longer than written") as err:
        verify_manifest(folder)
    assert err.value.path == tok_config
    (folder / MANIFEST).unlink()
    write_manifest(folder)  # saved again: the manifest follows the folder
    verify_manifest(folder)
