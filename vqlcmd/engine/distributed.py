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
    # Rank 0 may spend many minutes preparing data (the digits tokenizer) while the others wait at a
    # barrier; the default 10-minute collective timeout would kill them.
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=datetime.timedelta(hours=2))
    return torch.distributed.get_rank(), torch.distributed.get_world_size(), local_rank, device


def barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def any_rank(flag: bool, device) -> bool:
    """True if ``flag`` is true on any rank (so all ranks take the same branch)."""
    if not torch.distributed.is_initialized():
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())
