"""No code runs from a run folder's checkpoint files (vqlcmd/engine/safe_load.py): real DeepSpeed checkpoints
round-trip under ``inert_deepspeed_loads``; malicious model, optimizer and rank-state files are refused by
name, and their pickled call never runs (while DeepSpeed's own load does run it)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vqlcmd.engine import safe_load
from vqlcmd.engine.safe_load import UnsafeCheckpointError, inert_deepspeed_loads, load_rank_state

ROOT = Path(__file__).resolve().parents[2]


class _Evil:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.fixture(scope="module")
def deepspeed_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("ds_safe_load_worker.py")), str(root),
                           str(root / "MARKER")], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("case", ["2", "0", "2_bf16"])
def test_a_real_deepspeed_checkpoint_resumes_exactly_under_the_patch(deepspeed_results, case):
    r = deepspeed_results[case]
    assert r["loaded"] and r["weights_equal"] and r["optimizer_equal"] and r["next_step_equal"]
    assert r["optimizer_tensors"] >= 4  # Adam's moments (and ZeRO's fp32 master) were compared, not nothing
    expected = {"2": 2, "0": 1, "2_bf16": 2}[case]  # ZeRO 0 keeps its optimizer in the model states file
    assert len(r["files"]) == expected and any(f.startswith("mp_rank_00_model_states") for f in r["files"])


@pytest.mark.parametrize("case", ["2", "0", "2_bf16"])
def test_a_malicious_checkpoint_file_is_refused_by_name_and_nothing_runs(deepspeed_results, case):
    r = deepspeed_results[case]
    assert set(r["malicious"]) == set(r["files"])  # model states and, at ZeRO 1/2, the optimizer partition
    for name, res in r["malicious"].items():
        assert res["plain_ran"], f"{name}: the planted call did not run under DeepSpeed's own load"
        assert res["error"] is not None and not res["inert_ran"], (name, res)
        assert f"/t/{name}: refused to load" in res["error"], res["error"]
        assert "it asks for exec, which a weights-only load does not allow" in res["error"], res["error"]


def test_the_patch_is_undone_on_exit_and_on_error():
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    original = TorchCheckpointEngine.load
    with inert_deepspeed_loads():
        with inert_deepspeed_loads():
            assert TorchCheckpointEngine.load is not original
        assert TorchCheckpointEngine.load is not original  # the outer one still holds
    assert TorchCheckpointEngine.load is original
    with pytest.raises(KeyError):
        with inert_deepspeed_loads():
            raise KeyError("x")
    assert TorchCheckpointEngine.load is original


def test_an_engine_reading_through_another_checkpoint_engine_is_refused():
    class Other:
        checkpoint_engine = object()

    with pytest.raises(TypeError, match="reads checkpoints through object, not DeepSpeed's TorchCheckpointEngine"):
        with inert_deepspeed_loads(Other()):
            pass


def _rank_state():  # what the trainer's _rank_state writes: the loader position and RNG states
    g = torch.Generator().manual_seed(3)
    return {"loader": {"epoch": 2, "position": 17, "order_seed": 5}, "generator": g.get_state(),
            "torch_rng": torch.get_rng_state(), "cuda_rng": None}


def test_a_rank_state_file_loads_and_a_malicious_one_is_refused(tmp_path):
    good = tmp_path / "rank_00000_state.pt"
    state = _rank_state()
    torch.save(state, good)
    back = load_rank_state(good)
    assert back["loader"] == state["loader"] and torch.equal(back["generator"], state["generator"])
    assert torch.equal(back["torch_rng"], state["torch_rng"]) and back["cuda_rng"] is None

    bad = tmp_path / "bad" / "rank_00001_state.pt"
    bad.parent.mkdir()
    torch.save({**state, "loader": _Evil(tmp_path / "MARKER")}, bad)
    with pytest.raises(UnsafeCheckpointError) as err:
        load_rank_state(bad)
    assert str(err.value).startswith(f"{bad}: refused to load") and "exec" in str(err.value)
    assert "add_safe_globals" not in str(err.value)  # torch's advice to allowlist the call is not passed on
    assert not (tmp_path / "MARKER").exists()
    torch.load(bad, weights_only=False)  # the file is live: an unchecked load runs it
    assert (tmp_path / "MARKER").exists()


def test_only_deepspeeds_data_holders_are_allowed():
    names = sorted(f"{c.__module__}.{c.__qualname__}" for c in safe_load.deepspeed_checkpoint_globals())
    assert names == ["deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address"]
