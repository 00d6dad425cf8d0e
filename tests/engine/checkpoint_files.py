"""Checkpoint folders for the manifest and fallback tests (a helper module, imported as the kernel tests do)."""
import json

import torch


def fake_checkpoint(folder, ranks=1, seed=0):
    """The files a checkpoint holds, laid out as DeepSpeed and the trainer write them (real torch.save zip
    archives, so that a flipped byte lands in tensor data exactly as it would on a disk)."""
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    torch.save({"module": {"w": torch.randn(64, 64, generator=g)}, "step": 20}, folder / "mp_rank_00_model_states.pt")
    for r in range(ranks):
        torch.save({"exp_avg": torch.randn(4096, generator=g)}, folder / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        torch.save({"loader": {"epoch": 0, "batch": 3}, "torch_rng": torch.get_rng_state()},
                   folder / f"rank_{r:05d}_state.pt")
    (folder / "config.json").write_text(json.dumps({"vqlcmd": {"train": {"seed": 0}}, "bf16": {"enabled": False}}))
    return folder


def flip_byte(path, at=None):
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if at is None else at
    data[at] ^= 0x10
    path.write_bytes(bytes(data))
