"""Folder manifests (vqlcmd/engine/manifest.py): what is listed, and each kind of damage named by file."""
import json
import pickle

import pytest
import torch
import xxhash

from checkpoint_files import fake_checkpoint, flip_byte
from vqlcmd.engine.checkpoint import CheckpointError
from vqlcmd.engine.manifest import MANIFEST, ManifestError, NoManifest, verify_manifest, write_manifest


def test_the_manifest_lists_every_file_with_its_size_and_digest(tmp_path):
    folder = fake_checkpoint(tmp_path / "ck")
    (folder / "sub").mkdir()
    (folder / "sub" / "nested.bin").write_bytes(b"\x00\x01" * 1000)
    manifest = write_manifest(folder)
    assert json.loads((folder / MANIFEST).read_text()) == manifest
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    assert sorted(manifest["files"]) == files and "sub/nested.bin" in files
    for name, entry in manifest["files"].items():  # against the bytes, hashed here in one piece
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "xxh3_64": xxhash.xxh3_64(data).hexdigest()}
    assert not list(folder.glob(MANIFEST + ".tmp*"))
    assert verify_manifest(folder) == manifest


def test_a_large_file_is_hashed_across_chunks(tmp_path):
    from vqlcmd.engine import manifest as m

    folder = tmp_path / "big"
    folder.mkdir()
    data = torch.randint(0, 256, (m._CHUNK * 2 + 12345,), dtype=torch.uint8).numpy().tobytes()
    (folder / "blob").write_bytes(data)
    write_manifest(folder)
    assert json.loads((folder / MANIFEST).read_text())["files"]["blob"]["xxh3_64"] == xxhash.xxh3_64(data).hexdigest()
    flip_byte(folder / "blob", at=m._CHUNK + 7)  # in the second chunk
    with pytest.raises(ManifestError, match="corrupt"):
        verify_manifest(folder)


def test_a_flipped_byte_in_a_tensor_file_loads_silently_but_fails_the_manifest(tmp_path):
    folder = fake_checkpoint(tmp_path / "ck")
    write_manifest(folder)
    path = folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    before = torch.load(path, weights_only=True)["exp_avg"]
    flip_byte(path, at=path.stat().st_size - 2000)  # inside the tensor's data, not the zip's directory
    after = torch.load(path, weights_only=True)["exp_avg"]  # what a resume without the manifest took
    assert not torch.equal(before, after)
    with pytest.raises(ManifestError) as err:
        verify_manifest(folder)
    assert err.value.path == path and "corrupt" in err.value.reason
    assert str(err.value).startswith(str(path)) and "\n" not in str(err.value)
    assert isinstance(err.value, CheckpointError)


@pytest.mark.parametrize("damage, words", [
    (lambda p: p.write_bytes(p.read_bytes()[:-100]), "truncated"),
    (lambda p: p.write_bytes(p.read_bytes() + b"x"), "longer than written"),
    (lambda p: p.unlink(), "missing"),
])
def test_truncated_longer_and_deleted_files_are_named(tmp_path, damage, words):
    folder = fake_checkpoint(tmp_path / "ck", ranks=2)
    write_manifest(folder)
    path = folder / "rank_00001_state.pt"
    damage(path)
    with pytest.raises(ManifestError, match=words) as err:
        verify_manifest(folder)
    assert err.value.path == path


def test_a_damaged_config_json_is_named(tmp_path):
    folder = fake_checkpoint(tmp_path / "ck")
    write_manifest(folder)
    text = (folder / "config.json").read_text()
    (folder / "config.json").write_text(text.replace("{", "[", 1))  # same size, no longer JSON
    with pytest.raises(json.JSONDecodeError):
        json.loads((folder / "config.json").read_text())
    with pytest.raises(ManifestError, match="corrupt") as err:
        verify_manifest(folder)
    assert err.value.path == folder / "config.json"


@pytest.mark.parametrize("edit", ["not json", "size", "digest", "format", "no files"])
def test_a_damaged_manifest_is_named_as_the_manifest(tmp_path, edit):
    folder = fake_checkpoint(tmp_path / "ck")
    write_manifest(folder)
    path = folder / MANIFEST
    m = json.loads(path.read_text())
    if edit == "not json":
        text = path.read_text()
        path.write_text(text[:len(text) // 2])
    else:
        if edit == "size":  # a valid manifest in form: only its own digest tells the damage from a damaged file
            m["files"]["config.json"]["size"] += 1
        elif edit == "digest":
            m["files"]["config.json"]["xxh3_64"] = "0" * 16
        elif edit == "format":
            m["format"] = 99
        else:
            del m["files"]
        path.write_text(json.dumps(m))
    with pytest.raises(ManifestError, match="damaged") as err:
        verify_manifest(folder)
    assert err.value.path == path and not isinstance(err.value, NoManifest)


def test_a_folder_without_a_manifest_says_so(tmp_path):
    folder = fake_checkpoint(tmp_path / "ck")
    with pytest.raises(NoManifest, match="missing") as err:
        verify_manifest(folder)
    assert err.value.path == folder / MANIFEST
    with pytest.raises(ManifestError, match="no such folder"):
        write_manifest(tmp_path / "nowhere")


def test_files_added_later_are_not_checked_and_rewriting_the_manifest_takes_them_in(tmp_path):
    folder = fake_checkpoint(tmp_path / "ck")
    write_manifest(folder)
    (folder / "README.md").write_text("notes")
    verify_manifest(folder)
    assert "README.md" in write_manifest(folder, durable=True)["files"]
    verify_manifest(folder)


def test_the_error_survives_pickling_with_its_fields(tmp_path):
    err = pickle.loads(pickle.dumps(ManifestError(tmp_path / "a.pt", "truncated: 1 bytes")))
    assert (err.path, err.reason, str(err)) == (tmp_path / "a.pt", "truncated: 1 bytes", f"{tmp_path / 'a.pt'}: "
                                                                                           "truncated: 1 bytes")
    assert type(pickle.loads(pickle.dumps(NoManifest(tmp_path, "x")))) is NoManifest


def test_a_trainers_checkpoints_carry_manifests_and_a_corrupt_one_falls_back_to_the_same_losses(
        tmp_path, tiny_shards, make_config):
    """Real DeepSpeed checkpoints (ZeRO 2, one gloo rank): commit's manifest lists every file the trainer and
    DeepSpeed wrote; a byte flipped in the newest one's optimizer state is set aside, and the run resumed
    from the one before trains on exactly as the uninterrupted run did."""
    from vqlcmd.engine import checkpoint_folder as ckpt
    from vqlcmd.engine.config_file import load_config
    from vqlcmd.engine.trainer import Trainer

    def train(root, steps, **kw):
        ds, cfg = load_config(str(make_config(root, tiny_shards, steps=steps, **kw)))
        return Trainer(ds, cfg, log=lambda *a, **k: None).train(progress=False)

    straight = train(tmp_path / "a", 6)
    train(tmp_path / "b", 4, checkpoint_every=2, keep_checkpoints=3)
    ck = tmp_path / "b" / "run" / "checkpoints"
    for folder in ckpt.complete_checkpoints(ck):
        listed = set(verify_manifest(folder)["files"])
        assert listed == {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()} - {MANIFEST}
        assert {"config.json", "rank_00000_state.pt", "mp_rank_00_model_states.pt"} <= listed
    (optim,) = (ck / "step_0000004").glob("*optim_states.pt")
    flip_byte(optim, at=optim.stat().st_size - 4096)
    torch.load(optim, weights_only=False)  # still loads: without the manifest the resume took it
    lines = []
    assert ckpt.resumable_checkpoint(ck, log=lines.append) == ck / "step_0000002"
    assert f"step_0000004/{optim.name}: corrupt" in lines[0]
    resumed = train(tmp_path / "b", 6)
    assert [h["step"] for h in resumed] == [3, 4, 5, 6]
    assert [h["loss"] for h in resumed] == [h["loss"] for h in straight[2:]]
    assert (ck / "step_0000004.corrupt" / optim.name).is_file()
