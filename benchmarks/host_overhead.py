#!/usr/bin/env python
"""The host's share of a training step: configs/ds_imagenet.json's step at sizes where compute vanishes.

    python benchmarks/host_overhead.py                     # tiny tensors, imagenet-246m's structure
    python benchmarks/host_overhead.py --size full --batch 32   # on a GPU: the real step, same breakdown
    python benchmarks/host_overhead.py --profile torch     # + aten op counts per phase
    python benchmarks/host_overhead.py --profile cprofile  # + the Python functions that cost most

The step is the engine's own (``Trainer.train_step`` with ``train.fast``, DeepSpeed ZeRO 2 on one rank,
both EMAs, the teacher forward, the whole loss), built from configs/ds_imagenet.json with its DeepSpeed
keys. ``--size tiny`` keeps the preset's structure (depth 24, the same parameter tensors, K = 1024, 1000
classes) and shrinks width, heads, embedding and tokens (64, 4, 16, 4x4) so that what a step costs is
the Python and dispatch work around the math: on a GPU that work runs ahead of the kernels only when it
is shorter than them, so at the paper's 32 per GPU it is the step time. Each phase is timed by wrapping
the engine's calls (forward+loss, backward, DeepSpeed's step, the EMA updates, the next batch); the
device is synchronised only at the ends of the timed steps, so a phase's host time includes any wait
for the device it forces (a ``.item()`` inside DeepSpeed shows up there). ``--reads`` counts the
tensor read-backs (each a device sync on a GPU) per phase with where they come from.

Printed: ms per step, per phase; with ``--profile torch`` the aten ops dispatched from Python per step
and phase (each one launches at least one kernel on a GPU: ~5-20 us of host time each there). Runs on
the CPU (gloo) or a GPU (nccl) alike; ``--json FILE`` appends one row per run.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import json
import os
import pstats
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import synthetic_shards  # noqa: E402

PHASES = ("data", "forward+loss", "backward", "engine.step", "ema", "other")
# the preset's structure at sizes where the math is negligible: heads must divide width, the grid is square
TINY = dict(width=64, heads=4, embed_dim=16, seq_len=16, time_features=32)
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


def build_trainer(work: Path, size: str, batch: int, bf16, zero: dict, overrides: dict, compile_: bool,
                  ds_extra: dict):
    from vqlcmd.engine.config_file import load_config
    from vqlcmd.engine.trainer import Trainer
    from vqlcmd.model import preset_config

    layout = dict(synthetic_shards.LAYOUTS["imagenet-246m"])
    model = {**layout, **(TINY if size == "tiny" else {}), **overrides}
    cfg = preset_config("imagenet-246m", **model)
    shards = work / "shards"
    if not shards.exists():
        _write_shards(shards, cfg, images=max(256, 8 * batch))

    def edit(section):
        section["model"] = {"preset": "imagenet-246m", "overrides": model}
        section["data"] = {"shards": str(shards)}
        section["train"] = {**section["train"], "output_dir": str(work / "run"), "fast": True, "compile": compile_,
                            "log_every": 10 ** 6, "sample_every": 0, "checkpoint_every": 0, "steps": 10 ** 6}

    def edit_ds(raw):
        raw.pop("train_batch_size", None)
        raw["train_micro_batch_size_per_gpu"] = batch
        raw["bf16"] = {"enabled": bf16}
        raw["zero_optimization"] = {**raw["zero_optimization"], **zero}
        for key, value in ds_extra.items():
            raw[key] = {**raw[key], **value} if isinstance(value, dict) and isinstance(raw.get(key), dict) else value

    ds, vcfg = load_config("configs/ds_imagenet.json", edit=edit, edit_deepspeed=edit_ds)
    return Trainer(ds, vcfg, log=lambda *a, **k: None, progress=False)


def _write_shards(folder: Path, cfg, images: int) -> None:
    import math

    import numpy as np

    from vqlcmd.data.shards import write_shard

    side = math.isqrt(cfg.seq_len)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.codebook_size, (images, cfg.seq_len), dtype=np.uint16)
    labels = rng.integers(0, cfg.num_classes, images)
    header = {"codebook_size": cfg.codebook_size, "grid": [side, side], "tokenizer_id": "synthetic-host-overhead",
              "num_classes": cfg.num_classes, "class_names": [f"class{i}" for i in range(cfg.num_classes)]}
    write_shard(folder / "shard_00000.vqtok", tokens, labels, header)


class Phases:
    """Host seconds per phase, by wrapping the calls ``engine.step.TrainStep`` makes (instance attributes of the
    DeepSpeed engine, the module-level ``update_emas`` and the batch iterator)."""

    def __init__(self, tr):
        from vqlcmd.engine import step as fast

        self.seconds = collections.Counter()
        self.cpu_seconds = collections.Counter()  # this thread's CPU time: less swayed by other jobs' load
        self.current = "other"
        self._undo = []
        engine = tr.engine
        for attr, phase in (("forward", "forward+loss"), ("backward", "backward"), ("step", "engine.step")):
            self._wrap(engine, attr, phase, instance=True)
        self._wrap(fast, "update_emas", "ema")

    def _wrap(self, owner, attr, phase, instance=False):
        fn = getattr(owner, attr)
        outer = self

        def timed(*args, **kwargs):
            with outer.phase(phase):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn, instance))

    @contextlib.contextmanager
    def phase(self, name):
        from torch.profiler import record_function

        before, self.current = self.current, name
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            with record_function(f"phase:{name}"):
                yield
        finally:
            # nested phases (the loss's own module calls) count in the outer one only
            if before == "other" or before == name:
                self.seconds[name] += time.perf_counter() - t0
                self.cpu_seconds[name] += time.thread_time() - c0
            self.current = before

    def batches(self, it):
        while True:
            with self.phase("data"):
                item = next(it)
            yield item

    def restore(self):
        for owner, attr, fn, instance in reversed(self._undo):
            if instance:
                delattr(owner, attr)
            else:
                setattr(owner, attr, fn)


@contextlib.contextmanager
def counting_reads(phases: Phases):
    """Tensor read-backs (``.item()``, ``bool(t)``, ...; named with the tensor's device: a CPU tensor's waits
    for nothing) and DeepSpeed's device syncs, per phase, with the innermost frame outside torch that asked:
    on a GPU each read of a device tensor and each sync waits for the device queue to drain."""
    found = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def note(kind):
        at = "?"
        for frame in reversed(traceback.extract_stack()[:-2]):
            if "/torch/" not in frame.filename and "host_overhead" not in frame.filename:
                at = f"{Path(frame.filename).name}:{frame.lineno} {frame.name}"
                break
        found[(phases.current, kind, at)] += 1

    def guard(name):
        def read(self, *args, **kwargs):
            note(f"{name}[{self.device.type}]")
            return originals[name](self, *args, **kwargs)
        return read

    accelerator = None
    try:
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        synchronize = accelerator.synchronize

        def counted_sync(*args, **kwargs):
            note("synchronize")
            return synchronize(*args, **kwargs)

        accelerator.synchronize = counted_sync
    except ImportError:  # no DeepSpeed: reads only
        accelerator = None
    for name in READS:
        setattr(torch.Tensor, name, guard(name))
    try:
        yield found
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        if accelerator is not None:
            del accelerator.synchronize


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(tr, batches, n: int):
    for _ in range(n):
        tr.train_step(batches)
    tr.stepper.flush()  # the deferred reads, as a log step does: the queue drains here


# ops that only make a tensor's metadata (views, allocations): no kernel on a GPU
NO_KERNEL = {"aten::" + n for n in (
    "view", "view_as", "_unsafe_view", "narrow", "slice", "select", "t", "transpose", "permute", "expand",
    "expand_as", "as_strided", "reshape", "unsqueeze", "squeeze", "detach", "alias", "chunk", "split", "unbind",
    "empty", "empty_like", "empty_strided", "resolve_conj", "resolve_neg", "lift_fresh", "to", "_to_copy",
    "_has_compatible_shallow_copy_type", "flatten", "unflatten", "contiguous", "set_", "result_type")}


MULTI_TENSOR = ("aten::_foreach_", "aten::_fused_")


def count_ops(prof, steps: int) -> dict:
    """aten ops per step: all of them, and those dispatched from Python (no aten op above them), per phase."""
    events = prof.events()
    total, top, per_phase, names = 0, 0, collections.Counter(), collections.defaultdict(collections.Counter)
    kernels_by_phase = collections.Counter()
    for ev in events:
        if not ev.name.startswith("aten::"):
            continue
        total += 1
        leaf = not any(c.name.startswith("aten::") for c in ev.cpu_children)
        parent, phase, nested, in_multi = ev.cpu_parent, "other", False, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                # on a CPU a multi-tensor op runs one op per tensor; on a GPU it launches a few kernels
                in_multi = in_multi or parent.name.startswith(MULTI_TENSOR)
            if parent.name.startswith("phase:") and phase == "other":
                phase = parent.name[len("phase:"):]
            parent = parent.cpu_parent
        if ev.name.startswith(MULTI_TENSOR) and not in_multi:
            kernels_by_phase[phase] += 1
        elif leaf and not in_multi and ev.name not in NO_KERNEL:  # (a no-op .to() has no child: not counted)
            kernels_by_phase[phase] += 1
        if not nested:
            top += 1
            per_phase[phase] += 1
            names[phase][ev.name] += 1
    kernels = sum(1 for ev in events if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA)
    out = {"aten_ops": total / steps, "top_level_ops": top / steps,
           "kernel_ops": sum(kernels_by_phase.values()) / steps,
           "kernel_ops_by_phase": {k: v / steps for k, v in sorted(kernels_by_phase.items())},
           "top_level_by_phase": {k: v / steps for k, v in sorted(per_phase.items())},
           "commonest_by_phase": {k: {n: c / steps for n, c in v.most_common(8)} for k, v in sorted(names.items())}}
    if kernels:
        out["cuda_kernels"] = kernels / steps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--batch", type=int, default=2, help="per-GPU micro-batch (the paper's: 32)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bf16", default="auto", help="bf16.enabled: true, false or auto (default)")
    p.add_argument("--zero", default="{}", help="JSON merged into zero_optimization, e.g. '{\"stage\": 1}'")
    p.add_argument("--ds", default="{}", help="JSON merged into the DeepSpeed config, e.g. '{\"bf16\": "
                   "{\"check_grad_overflow\": false}}'")
    p.add_argument("--set", default="{}", help="JSON merged into model.overrides")
    p.add_argument("--compile", action="store_true", help="train.compile")
    p.add_argument("--profile", choices=("none", "torch", "cprofile"), default="none")
    p.add_argument("--reads", action="store_true", help="count tensor read-backs and syncs per phase")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="append the row to this .jsonl file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    bf16 = {"true": True, "false": False}.get(args.bf16.lower(), args.bf16)

    with tempfile.TemporaryDirectory(prefix="host_overhead_") as tmp:
        tr = build_trainer(Path(tmp), args.size, args.batch, bf16, json.loads(args.zero), json.loads(args.set),
                           args.compile, json.loads(args.ds))
        phases = Phases(tr)
        batches = phases.batches(tr.loader.forever())
        run_steps(tr, batches, args.warmup)
        sync(tr.device)
        phases.seconds.clear()
        phases.cpu_seconds.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        run_steps(tr, batches, args.steps)
        sync(tr.device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        host, host_cpu = dict(phases.seconds), dict(phases.cpu_seconds)
        # the rest of the step: the trainer's own lines, the copies to the device, the flush
        host["other"], host_cpu["other"] = wall - sum(host.values()), cpu - sum(host_cpu.values())
        from benchmarks.run import device_name, git_commit

        row = {"device_name": device_name(tr.device), "torch": torch.__version__, "commit": git_commit(),
               "size": args.size, "batch": args.batch, "bf16": tr.bf16, "device": str(tr.device),
               "zero": tr.resolved_config["zero_optimization"], "compile": args.compile,
               "params": sum(q.numel() for q in tr.net.parameters()),
               "param_tensors": len(list(tr.net.parameters())), "threads": torch.get_num_threads(),
               "load": os.getloadavg()[0], "ms_per_step": 1e3 * wall / args.steps, "cpu_ms_per_step": 1e3 * cpu / args.steps,
               "host_ms_by_phase": {k: round(1e3 * host.get(k, 0.0) / args.steps, 3) for k in PHASES},
               "cpu_ms_by_phase": {k: round(1e3 * host_cpu.get(k, 0.0) / args.steps, 3) for k in PHASES}}
        if args.reads:
            with counting_reads(phases) as found:
                run_steps(tr, batches, 2)
            row["reads_per_step"] = {f"{ph} {kind} {at}": n / 2 for (ph, kind, at), n in sorted(found.items())}
        if args.profile == "torch":
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if tr.device.type == "cuda" else [])
            with profile(activities=acts) as prof:
                run_steps(tr, batches, 3)
            row.update(count_ops(prof, 3))
        elif args.profile == "cprofile":
            pr = cProfile.Profile()
            pr.enable()
            run_steps(tr, batches, args.steps)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
            pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
            print(buf.getvalue())
        row["deepspeed"] = {k: v for k, v in tr.resolved_config.items() if k != "vqlcmd"}
        phases.restore()
    print(json.dumps(row, indent=1))
    print(f"host_overhead: {row['ms_per_step']:.1f} ms/step, {row['cpu_ms_per_step']:.1f} CPU ms ({row['size']}, "
          f"batch {row['batch']}, {'bf16' if row['bf16'] else 'fp32'}, load {row['load']:.1f}); CPU ms: "
          + ", ".join(f"{k} {v:.1f}" for k, v in row["cpu_ms_by_phase"].items())
          + (f"; {row['top_level_ops']:.0f} ops/step from Python, {row['kernel_ops']:.0f} that run a kernel ("
             + ", ".join(f"{k} {v:.0f}" for k, v in row["kernel_ops_by_phase"].items()) + ")"
             if "top_level_ops" in row else ""))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
