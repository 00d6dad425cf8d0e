"""Process-group setup for ``deepspeed`` launches and for a plain ``python scripts/train.py``."""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import socket
from typing import Optional

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, int, torch.device]:
    """(rank, world_size, local_rank, device). Without a launcher, sets up a one-rank group."""
    import deepspeed

    launcher = _launcher_without_rank() if "RANK" not in os.environ else None
    if launcher is not None and not _mpi4py_installed():  # (with mpi4py, DeepSpeed's MPI discovery sets RANK)
        raise LaunchError(f"started by {launcher} without RANK / WORLD_SIZE / MASTER_ADDR, and without mpi4py for "
                           "DeepSpeed to find them: launch with `deepspeed --hostfile ...` (or torchrun), set those "
                           "variables for each process, or install mpi4py")
    if "RANK" not in os.environ and launcher is None:  # plain `python scripts/train.py`: one process, its own group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo":
        _skip_shm_comm_build()
    if launcher is None:  # the device first, as NCCL prefers; under MPI discovery LOCAL_RANK is known only after
        device = _set_device(backend)
    # Rank 0 may spend many minutes preparing data (the digits tokenizer) while the others wait at a
    # barrier; the default 10-minute collective timeout would kill them.
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=datetime.timedelta(hours=2))
    if launcher is not None:
        device = _set_device(backend)
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)), device


def _set_device(backend: str) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


# (world size variable, launcher) of launchers that start every process without RANK / WORLD_SIZE
# (srun's per-step count: sbatch / salloc set SLURM_NTASKS in the job's own shell, where one process is right)
_LAUNCHER_SIZES = (("OMPI_COMM_WORLD_SIZE", "Open MPI"), ("PMI_SIZE", "MPICH / MVAPICH"),
                   ("SLURM_STEP_NUM_TASKS", "Slurm's srun"))


def _launcher_without_rank() -> Optional[str]:
    """The launcher that started this process as one of several without setting RANK, e.g. "Open MPI (4
    processes)", or None. Each such process set up a one-rank group of its own, and N copies of the run
    trained side by side into one output folder."""
    for var, launcher in _LAUNCHER_SIZES:
        size = os.environ.get(var, "1")
        if size.isdigit() and int(size) > 1:
            return f"{launcher} ({size} processes)"
    return None


def _mpi4py_installed() -> bool:
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def _skip_shm_comm_build() -> None:
    """Keep DeepSpeed from setting up its shared-memory CPU all-reduce (``deepspeed_shm_comm``) for gloo.

    Only ``inference_all_reduce`` (tensor-parallel inference) uses it; training's collectives go through
    torch.distributed. Yet with it, every CPU run paid 1-2 minutes of g++ on a fresh 2-core machine, and
    every run of several ranks left a 66 MB ``/dev/shm/deepspeed_allreduce_buffer_*`` file per rank that
    DeepSpeed never unlinks: held RAM until reboot (16 GB after a day of tests here). DeepSpeed builds the
    op only for ops its cached compatibility table marks compatible, and keeps that table in
    ``deepspeed.ops`` so that edits to it persist."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def mean_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """``t`` replaced in place by its elementwise mean over ranks, with no read-back to the host."""
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.SUM)
        t /= torch.distributed.get_world_size()
    return t


def data_identity(header: dict) -> dict:
    """What token shards hold, from a data set's header: without where they lie (``source``, which may differ
    between nodes holding copies, or after a move) and the shard file names."""
    return {k: v for k, v in header.items() if k not in ("source", "shards")}


def data_fingerprint(header: dict) -> str:
    """What every rank must agree on about its token shards: a digest of :func:`data_identity`."""
    return hashlib.sha256(json.dumps(data_identity(header), sort_keys=True, default=str).encode()).hexdigest()[:16]


class RankSetupError(RuntimeError):
    """Another rank failed while setting up; its own error says why."""

    vqlcmd_exchanged = True  # raised by agree_on_setup on every rank at once


class LaunchError(RuntimeError):
    """The processes were started in a way this run cannot form one group from."""


def exchanged(error: BaseException) -> bool:
    """Whether ``agree_on_setup`` already told the other ranks about ``error``."""
    return getattr(error, "vqlcmd_exchanged", False)


def agree_on_setup(error: Optional[BaseException], fingerprint: Optional[str]) -> None:
    """One exchange after each rank has opened its data: a rank's error stops every rank at once (the others
    would otherwise wait in the next collective until the two-hour timeout), and ranks that opened different
    data (another tokenizer, another sample count) are refused rather than trained together."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    if world > 1:
        said = [None] * world
        torch.distributed.all_gather_object(said, (None if error is None else f"{type(error).__name__}: {error}",
                                                   fingerprint))
    if error is not None:
        error.vqlcmd_exchanged = True  # the other ranks know: a caller must not exchange it again
        raise error
    if world == 1:
        return
    failed = [(r, e) for r, (e, _) in enumerate(said) if e is not None]
    if failed:
        raise RankSetupError(f"rank {failed[0][0]} failed while opening its data ({failed[0][1]}); stopping here too")
    prints = [fp for _, fp in said]
    if len(set(prints)) > 1:
        odd = [r for r, fp in enumerate(prints) if fp != prints[0]]
        raise RankSetupError(f"the ranks opened different token shards: rank(s) {odd} disagree with rank 0 about "
                             "their header (tokenizer, sample count, grid or classes); every rank must read the same "
                             "data set (on several nodes: the same shards and tokenizer, e.g. on a shared filesystem)")
