"""A taming VQGAN checkpoint as released: a PyTorch Lightning 1.x training checkpoint whose pickle names
Lightning classes (callbacks keyed by class, an AttributeDict of hparams) next to optimizer states.
The stand-in Lightning modules exist only while the file is written, as on the machine that trained it."""
import builtins
import os
import pickle
import subprocess
import sys
import types

import pytest
import torch
from taming_reference import TamingVQModel, fake_loss_tensors
from test_taming_converter import SMALL

from vqlcmd.tokenizer import convert_taming_checkpoint, load_vqmodel, taming_to_diffusers_state_dict
from vqlcmd.tokenizer.inert_load import Placeholder, inert_torch_load

CALLBACK = "pytorch_lightning.callbacks.model_checkpoint.ModelCheckpoint"
ATTRDICT = "pytorch_lightning.utilities.parsing.AttributeDict"


def _standin_lightning():
    """Modules named as Lightning 1.x names them, registered in sys.modules: pickle records classes by
    module and qualname, so the file names the real Lightning classes."""
    mods = {}
    for name in ("pytorch_lightning", "pytorch_lightning.callbacks", "pytorch_lightning.callbacks.model_checkpoint",
                 "pytorch_lightning.utilities", "pytorch_lightning.utilities.parsing"):
        mods[name] = types.ModuleType(name)

    class ModelCheckpoint:
        def __init__(self):
            self.monitor, self.save_top_k, self.best_k_models = "val/rec_loss", 1, {"a.ckpt": torch.tensor(0.25)}

    class AttributeDict(dict):
        def __getattr__(self, key):
            return self[key]

    for cls, mod in ((ModelCheckpoint, "pytorch_lightning.callbacks.model_checkpoint"),
                     (AttributeDict, "pytorch_lightning.utilities.parsing")):
        cls.__module__, cls.__qualname__ = mod, cls.__name__
        setattr(mods[mod], cls.__name__, cls)
    return mods, ModelCheckpoint, AttributeDict


def _lightning_checkpoint(path, legacy=False, extra=None, reference=True):
    torch.manual_seed(0)
    ref = TamingVQModel(SMALL)
    state = dict(ref.state_dict(), **fake_loss_tensors())
    opt = torch.optim.Adam(ref.parameters(), lr=4.5e-6, betas=(0.5, 0.9))
    sum(p.square().sum() for p in ref.parameters()).backward()
    opt.step()
    mods, ModelCheckpoint, AttributeDict = _standin_lightning()
    sys.modules.update(mods)
    try:
        moments = opt.state_dict()["state"][0]["exp_avg"]
        ckpt = {"epoch": 3, "global_step": 1200, "pytorch-lightning_version": "1.0.8",
                "callbacks": {ModelCheckpoint: {"best_model_score": torch.tensor(0.5), "best_model_path": "x.ckpt"}},
                "callback_objects": [ModelCheckpoint()],
                "optimizer_states": [opt.state_dict(), opt.state_dict()],
                "lr_schedulers": [], "shared_view": moments.view(-1)[:4],  # shares storage with exp_avg
                "state_dict": state,
                "hyper_parameters": AttributeDict(n_embed=SMALL["n_embed"], embed_dim=SMALL["embed_dim"],
                                                  ddconfig=dict(SMALL)),
                "hparams_name": "kwargs", **(extra or {})}
        torch.save(ckpt, path, _use_new_zipfile_serialization=not legacy)
        if reference:  # what an unrestricted load gives, with Lightning present
            reference = torch.load(path, weights_only=False)
    finally:
        for name in mods:
            del sys.modules[name]
    return state, reference


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_lightning_training_checkpoint_converts_to_its_weights(tmp_path, legacy):
    path = tmp_path / "last.ckpt"
    state, _ = _lightning_checkpoint(path, legacy)
    assert "pytorch_lightning" not in sys.modules
    with pytest.raises(pickle.UnpicklingError, match="pytorch_lightning"):  # what stopped users
        torch.load(path, weights_only=True)
    report = convert_taming_checkpoint(path, tmp_path / "vq", SMALL)
    assert report["mapped"] + report["dropped"] == report["total"] == len(state)
    expected, _ = taming_to_diffusers_state_dict(state, len(SMALL["ch_mult"]))
    got = load_vqmodel(tmp_path / "vq").state_dict()
    assert set(got) == set(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k
    assert "pytorch_lightning" not in sys.modules  # nothing was imported


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_inert_load_reads_tensors_as_torch_load_does_and_keeps_the_rest_inert(tmp_path, legacy):
    path = tmp_path / "last.ckpt"
    _, reference = _lightning_checkpoint(path, legacy)
    got = inert_torch_load(path)
    assert sorted(got) == sorted(reference)
    for k in ("epoch", "global_step", "pytorch-lightning_version", "lr_schedulers", "hparams_name"):
        assert got[k] == reference[k]
    for k, v in reference["state_dict"].items():
        g = got["state_dict"][k]
        assert g.dtype == v.dtype and g.shape == v.shape and g.stride() == v.stride() and torch.equal(g, v), k
    for g_opt, r_opt in zip(got["optimizer_states"], reference["optimizer_states"]):
        assert g_opt["param_groups"] == r_opt["param_groups"]
        for i, s in r_opt["state"].items():
            for name, t in s.items():
                assert torch.equal(g_opt["state"][i][name], t)
    # storage sharing survives, as in torch.load: the view and exp_avg are one storage
    shared = got["optimizer_states"][0]["state"][0]["exp_avg"]
    assert got["shared_view"].untyped_storage().data_ptr() == shared.untyped_storage().data_ptr()
    [(cls, cb_state)] = got["callbacks"].items()
    assert issubclass(cls, Placeholder) and cls._global_name == CALLBACK
    assert torch.equal(cb_state["best_model_score"], torch.tensor(0.5))
    obj = got["callback_objects"][0]
    assert isinstance(obj, Placeholder) and obj._pickled["state"]["monitor"] == "val/rec_loss"
    hp = got["hyper_parameters"]
    assert type(hp)._global_name == ATTRDICT and hp._pickled["entries"]["ddconfig"] == dict(SMALL)


class _Payload:
    """Pickles as a call of ``func(*args)``: how a malicious pickle runs code."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("func,name", [(os.system, f"{os.system.__module__}.system"),
                                       (builtins.exec, "builtins.exec"),
                                       (subprocess.Popen, "subprocess.Popen")])
def test_a_checkpoint_that_would_run_code_is_refused_by_name_and_nothing_runs(tmp_path, func, name):
    marker = tmp_path / "ran"
    args = {os.system: (f"touch {marker}",), builtins.exec: (f"open({str(marker)!r}, 'w')",),
            subprocess.Popen: (["touch", str(marker)],)}[func]
    path = tmp_path / "last.ckpt"
    # hidden among the Lightning objects, so the inert loader (not the weights-only load) meets it
    _lightning_checkpoint(path, extra={"more_callbacks": {"ModelCheckpoint": [_Payload(func, *args)]}},
                          reference=False)
    with pytest.raises(ValueError) as err:
        convert_taming_checkpoint(path, tmp_path / "vq", SMALL)
    msg = str(err.value)
    assert f"it would call {name}" in msg and "Nothing from the file was run" in msg, msg
    assert "\x1b" not in msg and "\n" not in msg
    assert not marker.exists()
    assert not (tmp_path / "vq").exists()


@pytest.mark.parametrize("data,name", [
    (b"cposix\nsystem\n(S'touch MARK'\ntR.", "posix.system"),  # REDUCE
    (b"(S'touch MARK'\niposix\nsystem\n.", "posix.system"),  # INST with arguments: a call of the class
    (b"cbuiltins\nexec\n(S'open(\"MARK\", \"w\")'\ntR.", "builtins.exec"),
    # BUILD may not set attributes on anything but data objects (here: a torch function's defaults)
    (b"ctorch._utils\n_rebuild_tensor_v2\n(N(dS'__defaults__'\n(tstb.", "builtins.function"),
    (b"\x80\x02\x82\x01.", "the copyreg extension registry"),  # EXT1
], ids=["reduce", "inst", "exec", "build-on-function", "ext"])
def test_inert_unpickler_refuses_calls_in_hand_written_pickles(tmp_path, data, name):
    import io

    from vqlcmd.tokenizer.inert_load import InertUnpickler, RefusedGlobal

    marker = tmp_path / "ran"
    with pytest.raises(RefusedGlobal, match=f"would call {name}"):
        InertUnpickler(io.BytesIO(data.replace(b"MARK", str(marker).encode()))).load()
    assert not marker.exists()


def test_a_class_created_without_a_call_stays_an_inert_placeholder():
    import io

    from vqlcmd.tokenizer.inert_load import InertUnpickler

    # NEWOBJ of posix.system (cls.__new__(cls, 'touch x')) and INST without arguments: data, never a call
    obj = InertUnpickler(io.BytesIO(b"\x80\x02cposix\nsystem\nX\x07\x00\x00\x00touch x\x85\x81.")).load()
    assert isinstance(obj, Placeholder) and type(obj)._global_name == "posix.system"
    assert obj._pickled["args"] == ("touch x",)
    obj = InertUnpickler(io.BytesIO(b"(iposix\nsystem\n.")).load()
    assert isinstance(obj, Placeholder)
