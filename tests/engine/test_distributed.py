"""mean_over_ranks on a real two-process gloo group: the logged loss terms are the ranks' mean, and a
non-finite term on one rank raises on both."""
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
