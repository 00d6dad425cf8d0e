"""An exported pipeline folder is self-contained: it carries its tokenizer (``tokenizer/``, named relatively),
so a copy decodes after the original tokenizer folder is gone; its files get the user's umask."""
import json
import os
import shutil

import pytest
import torch

from vqlcmd.pipeline import VQLCMDPipeline
from vqlcmd.tokenizer import load_tokenizer


def _own_pipeline(tiny_pipeline, tmp_path):
    """tiny_pipeline's network with its own copy of the tokenizer, named by absolute path as the trainer names it."""
    tok_dir = tmp_path / "checkout" / ".cache" / "tokenizer"
    shutil.copytree(tiny_pipeline.tokenizer_ref["path"], tok_dir)
    ref = {**tiny_pipeline.tokenizer_ref, "path": str(tok_dir.resolve())}
    pipe = VQLCMDPipeline(tiny_pipeline.network, tiny_pipeline.schedule, tokenizer=load_tokenizer(tok_dir),
                          tokenizer_ref=ref, class_names=tiny_pipeline.class_names,
                          sample_defaults=tiny_pipeline.sample_defaults)
    return pipe, tok_dir


def test_a_copied_pipeline_decodes_without_the_original_tokenizer(tiny_pipeline, tmp_path, monkeypatch):
    pipe, tok_dir = _own_pipeline(tiny_pipeline, tmp_path)
    expected = pipe([0, 1, 2, 3], generator=torch.Generator().manual_seed(3), output_type="pt")
    pipe.save_pretrained(tmp_path / "out" / "pipeline")
    config = json.loads((tmp_path / "out" / "pipeline" / "config.json").read_text())
    assert config["tokenizer"]["path"] == "tokenizer" and str(tmp_path) not in json.dumps(config)
    shutil.copytree(tmp_path / "out" / "pipeline", tmp_path / "elsewhere" / "copied")
    shutil.rmtree(tmp_path / "out")
    shutil.rmtree(tmp_path / "checkout")  # the checkout's .cache/ with the tokenizer is gone
    monkeypatch.chdir(tmp_path / "elsewhere")
    loaded = VQLCMDPipeline.from_pretrained("copied")
    assert loaded.tokenizer is not None and loaded.tokenizer.identifier == pipe.tokenizer.identifier
    images = loaded([0, 1, 2, 3], generator=torch.Generator().manual_seed(3), output_type="pt")
    torch.testing.assert_close(images, expected)
    assert not tok_dir.exists()


def test_saving_again_keeps_the_tokenizer_and_a_reloaded_pipeline_saves_it_too(tiny_pipeline, tmp_path):
    pipe, _ = _own_pipeline(tiny_pipeline, tmp_path)
    folder = pipe.save_pretrained(tmp_path / "p")
    weights = next((folder / "tokenizer").glob("*.safetensors"))
    stamp = weights.stat().st_mtime_ns
    pipe.save_pretrained(folder)  # as the trainer re-exports at every checkpoint: the same tokenizer stays
    assert weights.stat().st_mtime_ns == stamp
    # a pipeline loaded without its tokenizer and saved elsewhere still names one that exists
    bare = VQLCMDPipeline.from_pretrained(folder, load_tokenizer=False)
    bare.save_pretrained(tmp_path / "q")
    again = VQLCMDPipeline.from_pretrained(tmp_path / "q")
    assert again.tokenizer.identifier == pipe.tokenizer.identifier


def test_an_old_pipeline_naming_its_tokenizer_by_absolute_path_still_loads(tiny_pipeline, tmp_path):
    pipe, tok_dir = _own_pipeline(tiny_pipeline, tmp_path)
    old = VQLCMDPipeline(pipe.network, pipe.schedule, tokenizer=None, tokenizer_ref=pipe.tokenizer_ref)
    old.save_pretrained(tmp_path / "old")  # (no tokenizer object: the reference is written as it is)
    assert json.loads((tmp_path / "old" / "config.json").read_text())["tokenizer"]["path"] == str(tok_dir.resolve())
    assert VQLCMDPipeline.from_pretrained(tmp_path / "old").tokenizer.identifier == pipe.tokenizer.identifier


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_pipeline_files_get_the_users_umask(tiny_pipeline, tmp_path, umask):
    pipe, _ = _own_pipeline(tiny_pipeline, tmp_path)
    previous = os.umask(umask)
    try:
        folder = pipe.save_pretrained(tmp_path / "p")
    finally:
        os.umask(previous)
    files = [folder / "model.safetensors", folder / "config.json", *(folder / "tokenizer").iterdir()]
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}


def test_a_folder_that_does_not_exist_is_named_as_such(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"pipeline folder 'no/such/folder' does not exist"):
        VQLCMDPipeline.from_pretrained("no/such/folder")
    (tmp_path / "f").write_text("x")
    with pytest.raises(FileNotFoundError, match=r"is a file, not a folder"):
        VQLCMDPipeline.from_pretrained(tmp_path / "f")
