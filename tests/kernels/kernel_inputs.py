"""Inputs shared by the Triton kernel tests."""
import torch


def make(lead, K, D, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(*lead, K, generator=g)).to(device, dtype)  # peaked, as trained logits are
    table = torch.randn(K, D, generator=g).to(device, dtype)
    return logits, table
