"""Run by test_safe_load.py in a process of its own (a one-rank gloo group): saves real DeepSpeed checkpoints,
loads them back under ``inert_deepspeed_loads``, then swaps in malicious files. Prints one JSON line."""
import json
import os
import shutil
import sys
from pathlib import Path

import torch

MARKER = Path(sys.argv[2])


class Evil:  # what a malicious checkpoint pickles: a call that leaves MARKER behind
    def __reduce__(self):
        return (exec, (f"open({str(MARKER)!r}, 'w').close()",))


def build(stage, bf16, seed):
    import deepspeed

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 1.0, "zero_optimization": {"stage": stage},
           "bf16": {"enabled": bf16}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def step(engine, i, bf16):
    g = torch.Generator().manual_seed(100 + i)
    x = torch.randn(4, 6, generator=g, dtype=torch.bfloat16 if bf16 else torch.float32)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()


def optimizer_tensors(engine):
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)  # ZeRO 1/2 wrap the torch optimizer
    out = [t for group in base.param_groups for p in group["params"] for t in base.state[p].values()
           if torch.is_tensor(t)]
    masters = getattr(engine.optimizer, "single_partition_of_fp32_groups", None)  # ZeRO 1/2's fp32 master copy
    return out + list(masters or [])


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x.float(), y.float()) for x, y in zip(a, b))


def case(root, stage, bf16):
    from vqlcmd.engine.safe_load import UnsafeCheckpointError, inert_deepspeed_loads

    out = {}
    saved = build(stage, bf16, seed=0)
    for i in range(3):
        step(saved, i, bf16)
    ck = root / f"zero{stage}{'_bf16' if bf16 else ''}"
    saved.save_checkpoint(str(ck), tag="t", client_state={"step": 3})
    fresh = build(stage, bf16, seed=1)
    with inert_deepspeed_loads(fresh):
        path, client = fresh.load_checkpoint(str(ck), tag="t")
    out["loaded"] = path is not None and client.get("step") == 3
    out["weights_equal"] = same(list(saved.module.parameters()), list(fresh.module.parameters()))
    out["optimizer_equal"] = same(optimizer_tensors(saved), optimizer_tensors(fresh))
    out["optimizer_tensors"] = len(optimizer_tensors(saved))
    step(saved, 9, bf16)
    step(fresh, 9, bf16)  # the resumed optimizer takes the very step the saved one does
    out["next_step_equal"] = same(list(saved.module.parameters()), list(fresh.module.parameters()))
    files = sorted(p.name for p in (ck / "t").glob("*.pt"))
    out["files"] = files
    out["malicious"] = {}
    for name in files:
        bad = root / f"bad_{ck.name}_{name}"
        shutil.copytree(ck, bad)
        good = torch.load(bad / "t" / name, weights_only=False)  # the real content, with one evil entry
        good["extra"] = Evil()
        torch.save(good, bad / "t" / name)
        res = {}
        try:  # before: DeepSpeed's own load runs the file's call
            build(stage, bf16, seed=2).load_checkpoint(str(bad), tag="t")
        except Exception as exc:
            res["plain_error"] = f"{type(exc).__name__}: {exc}"[:200]
        res["plain_ran"] = MARKER.exists()
        MARKER.unlink(missing_ok=True)
        try:
            engine = build(stage, bf16, seed=2)
            with inert_deepspeed_loads(engine):
                engine.load_checkpoint(str(bad), tag="t")
            res["error"] = None
        except UnsafeCheckpointError as exc:
            res["error"] = str(exc)
        res["inert_ran"] = MARKER.exists()
        MARKER.unlink(missing_ok=True)
        out["malicious"][name] = res
    return out


def main():
    from vqlcmd.engine.distributed import init_distributed

    init_distributed()
    root = Path(sys.argv[1])
    result = {f"{stage}{'_bf16' if bf16 else ''}": case(root, stage, bf16)
              for stage, bf16 in ((2, False), (0, False), (2, True))}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(var, None)
    main()
