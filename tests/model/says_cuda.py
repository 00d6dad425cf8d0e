"""A CPU tensor that reports CUDA: enough for the attention backends' dispatch decisions and checks."""
import torch


class SaysCuda(torch.Tensor):
    @property
    def is_cuda(self):
        return True

    @property
    def device(self):
        return torch.device("cuda", 0)
