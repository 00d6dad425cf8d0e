"""mean_over_ranks on a real two-process gloo group: the logged loss terms are the ranks' mean, and a
non-finite term on one rank raises on both."""
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, init_file, out):
    from vqlcmd.engine.distributed import mean_over_ranks

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        out[rank] = mean_over_ranks(torch.tensor([0.0, 1.0 + rank, 10.0 * rank])).tolist()
        flag = torch.tensor([float(rank == 1)])  # only rank 1 saw a non-finite term
        out[2 + rank] = mean_over_ranks(flag).item()
    finally:
        dist.destroy_process_group()


def test_two_ranks_get_the_mean_and_the_flag(tmp_path):
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(str(tmp_path / "init"), out), nprocs=2, join=True)
    assert out[0] == out[1] == [0.0, 1.5, 5.0]
    assert out[2] == out[3] == 0.5  # > 0 on both ranks: both stop


def test_one_process_is_the_identity():
    from vqlcmd.engine.distributed import mean_over_ranks

    t = torch.tensor([1.0, 2.0])
    assert mean_over_ranks(t) is t and t.tolist() == [1.0, 2.0]


def _setup_worker(rank, init_file, out, case):
    from vqlcmd.engine.distributed import RankSetupError, agree_on_setup, data_fingerprint

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    header = {"tokenizer_id": "a", "num_samples": 96, "source": f"/node{rank}/digits"}  # paths may differ
    if case == "other data" and rank == 1:
        header["num_samples"] = 95
    error = ValueError("shard-00001: CRC mismatch") if case == "error" and rank == 1 else None
    try:
        agree_on_setup(error, data_fingerprint(header))
        out[rank] = "ok"
    except RankSetupError as exc:
        out[rank] = f"RankSetupError: {exc}"
    except ValueError as exc:
        out[rank] = f"own: {exc}"
    finally:
        dist.destroy_process_group()


def test_a_setup_error_on_one_rank_stops_every_rank(tmp_path):
    # rank 1 exited on a corrupt shard while rank 0 waited in DeepSpeed's set-up for up to two hours
    out = mp.Manager().dict()
    mp.spawn(_setup_worker, args=(str(tmp_path / "init"), out, "error"), nprocs=2, join=True)
    assert out[1] == "own: shard-00001: CRC mismatch"
    assert out[0].startswith("RankSetupError: rank 1 failed while opening its data (ValueError: shard-00001")


def test_ranks_that_opened_different_data_are_refused(tmp_path):
    out = mp.Manager().dict()
    mp.spawn(_setup_worker, args=(str(tmp_path / "init"), out, "other data"), nprocs=2, join=True)
    assert out[0] == out[1] and "rank(s) [1] disagree with rank 0" in out[0]
    out = mp.Manager().dict()
    mp.spawn(_setup_worker, args=(str(tmp_path / "init2"), out, "same data"), nprocs=2, join=True)
    assert out[0] == out[1] == "ok"  # the source path alone may differ


def test_an_mpi_launch_without_ranks_is_refused_not_run_as_copies(monkeypatch):
    # every process set up a one-rank group of its own and trained a copy of the run into one folder
    import pytest

    from vqlcmd.engine import distributed

    for var in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setattr(distributed, "_mpi4py_installed", lambda: False)
    with pytest.raises(distributed.LaunchError, match=r"started by Open MPI \(4 processes\) without RANK .* mpi4py"):
        distributed.init_distributed()
    assert "RANK" not in os.environ
    # sbatch / salloc set SLURM_NTASKS in the job's shell, where a plain one-process run is right
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert distributed._launcher_without_rank() is None
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")  # srun's processes
    assert distributed._launcher_without_rank() == "Slurm's srun (4 processes)"


def _prepare_worker(rank, init_file, out, cache):
    from vqlcmd.data import digits
    from vqlcmd.engine.config import DataSection
    from vqlcmd.engine.data import resolve_shards
    from vqlcmd.engine.distributed import exchanged

    def broken(**kw):
        raise OSError("disk full")

    digits.prepare_digits = broken
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        resolve_shards(DataSection(dataset="digits"), rank, log=lambda *a, **k: None)
        out[rank] = "no error"
    except Exception as exc:  # the Trainer re-raises what is exchanged, and exchanges only the rest
        out[rank] = (type(exc).__name__, exchanged(exc))
    finally:
        dist.destroy_process_group()


def test_rank_0_failing_to_prepare_the_digits_stops_every_rank_once(tmp_path):
    # rank 0's own error was exchanged, then exchanged again by the Trainer: a collective the others never
    # joined (gloo: "connection closed"; NCCL: a wait until the timeout)
    out = mp.Manager().dict()
    mp.spawn(_prepare_worker, args=(str(tmp_path / "init"), out, str(tmp_path)), nprocs=2, join=True)
    assert out[0] == ("OSError", True) and out[1] == ("RankSetupError", True)


@pytest.mark.parametrize("progress", [True, False])
def test_the_digits_preparation_shows_bars_only_when_asked(monkeypatch, progress):
    """train.py --no-progress still drew the tokenizer's and the tokenizer run's bars (the quick start's log)."""
    from vqlcmd.data import digits
    from vqlcmd.engine.config import DataSection
    from vqlcmd.engine.data import resolve_shards

    seen = {}

    def record(**kw):
        seen.update(kw)
        return {"shards": "s", "tokenizer": "t"}

    monkeypatch.setattr(digits, "prepare_digits", record)
    resolve_shards(DataSection(dataset="digits"), 0, log=lambda *a, **k: None, progress=progress)
    assert seen["progress"] is progress
