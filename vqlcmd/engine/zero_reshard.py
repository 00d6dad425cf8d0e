"""A ZeRO 1/2 checkpoint written by N ranks, loaded into an engine of M ranks.

DeepSpeed refuses this ("Automatic adjustment of ZeRO's optimizer state partitioning with a new world size
is not currently supported") and points to its universal checkpoint: an offline ``ds_to_universal``
conversion into one file per parameter, then ``"checkpoint": {"load_universal": true}``. That is not used
here: the conversion doubles the checkpoint on disk and runs as a separate step (a job coming back on fewer
machines would need it between the two runs), and its files are read by ``torch.load`` calls outside
``TorchCheckpointEngine``, which ``safe_load.inert_deepspeed_loads`` does not cover.

Instead every rank reads the N ``*_optim_states.pt`` files weights-only, joins each parameter group's
flat fp32 partitions and Adam moments (in parameter order: DeepSpeed's flat groups do not depend on the
number of ranks, unless ``round_robin_gradients`` reorders them, which is refused), and copies its own slice
of the M-rank layout into the engine. The model weights, the rate schedule and the client state come
through DeepSpeed's own load (``load_optimizer_states=False``).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from .safe_load import deepspeed_checkpoint_globals, weights_only_load

_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


class ReshardError(RuntimeError):
    """The checkpoint's optimizer state cannot be laid out for this world size; the message says why."""


def optimizer_files(folder: Path) -> list[Path]:
    """The checkpoint's ZeRO partition files, by the rank that wrote them."""
    found = {int(m.group(1)): p for p in folder.iterdir() if (m := _FILE.match(p.name))}
    if sorted(found) != list(range(len(found))):
        raise ReshardError(f"{folder}: ZeRO partition files of ranks {sorted(found)}, not 0..N-1")
    return [found[r] for r in range(len(found))]


def load_resharded(engine, folder: Path) -> int:
    """Lays the optimizer state of ``folder`` (any number of ranks) out for ``engine``'s ranks; returns the
    number of ranks that wrote it. Call after ``engine.load_checkpoint(..., load_optimizer_states=False)``."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    import deepspeed.comm as dist

    opt = engine.optimizer
    if not isinstance(opt, DeepSpeedZeroOptimizer):  # (BF16_Optimizer: ZeRO 1 in bf16 with fp32 accumulation)
        raise ReshardError(f"the optimizer is DeepSpeed's {type(opt).__name__}, whose state this engine cannot "
                           "lay out for another number of ranks; resume with the number that wrote it")
    if getattr(opt, "round_robin_gradients", False) or getattr(opt, "cpu_offload", False):
        raise ReshardError("zero_optimization.round_robin_gradients / offload_optimizer lay the optimizer state "
                           "out per rank count; resume with the number of ranks that wrote it")
    files = optimizer_files(folder)
    saved = [weights_only_load(f, map_location="cpu", extra_globals=deepspeed_checkpoint_globals())
             ["optimizer_state_dict"] for f in files]
    base = [sd["base_optimizer_state"] for sd in saved]
    if not all(isinstance(b, dict) for b in base):
        raise ReshardError(f"{folder} holds elastic-format ZeRO state, which this engine does not write")
    if saved[0].get("param_alignment_paddings") not in (None, opt.round_robin_bit16_padding):
        raise ReshardError(f"{folder}: another zero_optimization.parameter_alignment than this run's")
    for i, fp32 in enumerate(opt.single_partition_of_fp32_groups):
        parts = [sd["single_partition_of_fp32_groups"][i] for sd in saved]  # (saved without their padding)
        lengths = [p.numel() for p in parts]
        full = {"fp32": torch.cat(parts)}
        states = [b["state"].get(i, b["state"].get(str(i), {})) for b in base]
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.dim() > 0:  # a moment: partitioned like the weights, padded
                full[key] = torch.cat([s[key].reshape(-1)[:n] for s, n in zip(states, lengths)])
        sizes = [t.numel() for t in opt.parallel_partitioned_bit16_groups[i]]
        if full["fp32"].numel() > sum(sizes):
            raise ReshardError(f"{folder}: parameter group {i} holds {full['fp32'].numel()} values, this model's "
                               f"{sum(sizes)}; another model")
        pid = dist.get_rank(group=opt.real_dp_process_group[i])
        start, size = sum(sizes[:pid]), sizes[pid]

        def mine(flat: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(size, dtype=flat.dtype)
            piece = flat[start:start + size]
            out[:piece.numel()] = piece
            return out

        fp32.data.copy_(mine(full["fp32"]).to(fp32.dtype))
        group = opt.optimizer.param_groups[i]
        group.update({k: v for k, v in base[0]["param_groups"][i].items() if k != "params"})
        param = group["params"][0]
        state = opt.optimizer.state[param]
        for key, value in states[0].items():
            if key in full:
                state[key] = mine(full[key]).to(device=fp32.device, dtype=value.dtype)
            else:  # the step count: alike on every rank
                state[key] = value.clone() if torch.is_tensor(value) else value
    if hasattr(opt, "_link_all_hp_params"):  # DeepSpeed's fragment views of the state (safe_get_full_*), again
        opt._link_all_hp_params()
    return len(files)
