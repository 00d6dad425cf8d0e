"""Process-group setup for ``deepspeed`` launches and for a plain ``python scripts/train.py``."""
from __future__ import annotations

import datetime
import os
import socket

import torch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed() -> tuple[int, int, int, torch.device]:
    """(rank, world_size, local_rank, device). Without a launcher, sets up a one-rank group."""
    import deepspeed

    if "RANK" not in os.environ:  # plain `python scripts/train.py`: one process, its own group
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) == 1:
            _skip_shm_comm_build()
    # Rank 0 may spend many minutes preparing data (the digits tokenizer) while the others wait at a
    # barrier; the default 10-minute collective timeout would kill them.
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=datetime.timedelta(hours=2))
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device


def _skip_shm_comm_build() -> None:
    """DeepSpeed JIT-compiles its shared-memory CPU all-reduce (``deepspeed_shm_comm``) whenever it sets up
    a CPU process group: 1-2 minutes of g++ on a fresh 2-core machine, for collectives that a one-rank run
    never makes. DeepSpeed builds it only for ops its cached compatibility table marks compatible, and
    keeps that table in ``deepspeed.ops`` so that edits to it persist; runs with several ranks keep it."""
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
