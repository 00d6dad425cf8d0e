#!/usr/bin/env python
"""The host's share of a training step: configs/ds_imagenet.json's step at sizes where compute vanishes.

    python benchmarks/host_overhead.py                     # tiny tensors, imagenet-246m's structure
    python benchmarks/host_overhead.py --size full --batch 32   # on a GPU: the real step, same breakdown
    python benchmarks/host_overhead.py --profile torch     # + aten op counts per phase
    python benchmarks/host_overhead.py --profile cprofile  # + the Python functions that cost most
    python benchmarks/host_overhead.py --compare --bf16 true --pairs 3   # DeepSpeed's step against the flat one,
                                                   # alternated 3 times: each pair's ratios and their median

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
and phase (each one launches at least one kernel on a GPU: ~5-20 us of host time each there) and, on a CPU,
how much of the step is arithmetic that a GPU would run on the device (``benchmarks/cpu_arithmetic.py``). Runs on
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

from benchmarks import cpu_arithmetic, synthetic_shards  # noqa: E402

PHASES = ("data", "forward+loss", "teacher forward", "backward", "DeepSpeed gradient hooks", "DeepSpeed gradient norm",
          "AdamW", "update, other", "ema", "other")
# the preset's structure at sizes where the math is negligible: heads must divide width, the grid is square
TINY = dict(width=64, heads=4, embed_dim=16, seq_len=16, time_features=32)
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__")


def build_trainer(work: Path, size: str, batch: int, bf16, zero: dict, overrides: dict, compile_: bool,
                  ds_extra: dict, step: str = "deepspeed"):
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
        section["train"] = {**section["train"], "output_dir": str(work / "run"), "fast": True, "compile": compile_, "step": step,
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
    """Host seconds per phase, by wrapping the calls a step makes: the forward and backward (DeepSpeed's engine's,
    or the flat step's), the teacher's forward (eager only: compiled, it is inside the loss's graph), DeepSpeed's
    per-gradient hook and gradient norm, the inner AdamW step, the rest of the update (``engine.step`` or the
    flat step's ``update``), the EMAs and the next batch. Time and ops go to the innermost phase: a
    phase's figures exclude the phases inside it."""

    def __init__(self, tr):
        from vqlcmd.engine import step as step_module

        self.seconds = collections.Counter()
        self.cpu_seconds = collections.Counter()  # this thread's CPU time: less swayed by other jobs' load
        self.stack = ["other"]
        self._since = (time.perf_counter(), time.thread_time())
        self._undo = []
        flat = tr.stepper.flat
        if flat is None:
            self._wrap(tr.engine, "forward", "forward+loss", instance=True)
            self._wrap(tr.engine, "backward", "backward", instance=True)
            self._wrap(tr.engine, "step", "update, other", instance=True)
        else:
            self._wrap(flat, "forward", "forward+loss", instance=True)
            self._wrap(flat, "backward", "backward", instance=True)
            self._wrap(flat, "update", "update, other", instance=True)
            self._wrap(flat, "update_emas", "ema", instance=True)
        if not tr.cfg.train.compile:
            self._wrap(tr.teacher.compute, "forward", "teacher forward", instance=True)
        opt = tr.engine.optimizer
        for attr, phase in (("reduce_ready_partitions_and_remove_grads", "DeepSpeed gradient hooks"),
                            ("scaled_global_norm", "DeepSpeed gradient norm"), ("_optimizer_step", "AdamW")):
            if hasattr(opt, attr):
                self._wrap(opt, attr, phase, instance=True)
        self._wrap(step_module, "update_emas", "ema")

    def _wrap(self, owner, attr, phase, instance=False):
        fn = getattr(owner, attr)
        outer = self

        def timed(*args, **kwargs):
            with outer.phase(phase):
                return fn(*args, **kwargs)

        setattr(owner, attr, timed)
        self._undo.append((owner, attr, fn, instance))

    def _charge(self):
        now = (time.perf_counter(), time.thread_time())
        self.seconds[self.stack[-1]] += now[0] - self._since[0]
        self.cpu_seconds[self.stack[-1]] += now[1] - self._since[1]
        self._since = now

    @property
    def current(self) -> str:
        return self.stack[-1]

    @contextlib.contextmanager
    def phase(self, name):
        from torch.profiler import record_function

        self._charge()
        self.stack.append(name)
        try:
            with record_function(f"phase:{name}"):
                yield
        finally:
            self._charge()
            self.stack.pop()

    def clear(self):
        self._charge()
        self.seconds.clear()
        self.cpu_seconds.clear()

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
# the ops a step dispatches: aten's and this package's own (its C++ kernels and Triton ops are custom ops)
OP_PREFIXES = ("aten::", "vqlcmd::", "vqlcmd_triton::")


def _is_compiled_kernel(name: str) -> bool:
    """A kernel that inductor generated (``graph_N_cpp_fused_*`` on a CPU under ``cpp.enable_kernel_profile``,
    ``triton_*`` on a GPU): called from compiled code, not dispatched, but one launch each."""
    return "cpp_fused_" in name or name.startswith("triton_")


def count_ops(prof, steps: int) -> dict:
    """Per step: every op (``aten_ops``), those dispatched from Python (no op above them: ``top_level_ops``),
    those of them that launch a kernel (``kernel_ops``, views and allocations excluded, a multi-tensor op
    once), and inductor's own kernels (``compiled_kernels``), each by the innermost phase."""
    total, top, per_phase, names = 0, 0, collections.Counter(), collections.defaultdict(collections.Counter)
    kernels_by_phase, compiled_by_phase = collections.Counter(), collections.Counter()
    for ev in prof.events():
        compiled = _is_compiled_kernel(ev.name)
        if not (compiled or ev.name.startswith(OP_PREFIXES)):
            continue
        parent, phase, nested, in_multi = ev.cpu_parent, None, False, False
        while parent is not None:
            if parent.name.startswith(OP_PREFIXES):
                nested = True
                # on a CPU a multi-tensor op runs one op per tensor; on a GPU it launches a few kernels
                in_multi = in_multi or parent.name.startswith(MULTI_TENSOR)
            if parent.name.startswith("phase:") and phase is None:
                phase = parent.name[len("phase:"):]
            parent = parent.cpu_parent
        phase = phase or "other"
        if compiled:
            compiled_by_phase[phase] += 1
            continue
        total += 1
        leaf = not any(c.name.startswith(OP_PREFIXES) for c in ev.cpu_children)
        if ev.name.startswith(MULTI_TENSOR) and not in_multi:
            kernels_by_phase[phase] += 1
        elif leaf and not in_multi and ev.name not in NO_KERNEL:  # (a no-op .to() has no child: not counted)
            kernels_by_phase[phase] += 1
        if not nested:
            top += 1
            per_phase[phase] += 1
            names[phase][ev.name] += 1
    kernels = sum(1 for ev in prof.events() if getattr(ev, "device_type", None) == torch.autograd.DeviceType.CUDA)
    out = {"aten_ops": total / steps, "top_level_ops": top / steps,
           "kernel_ops": sum(kernels_by_phase.values()) / steps,
           "compiled_kernels": sum(compiled_by_phase.values()) / steps,
           "kernel_ops_by_phase": {k: v / steps for k, v in sorted(kernels_by_phase.items())},
           "compiled_kernels_by_phase": {k: v / steps for k, v in sorted(compiled_by_phase.items())},
           "top_level_by_phase": {k: v / steps for k, v in sorted(per_phase.items())},
           "commonest_by_phase": {k: {n: c / steps for n, c in v.most_common(8)} for k, v in sorted(names.items())}}
    if kernels:
        out["cuda_kernels"] = kernels / steps
    return out


def measure(args) -> dict:
    """One row: the step ``args`` describe, timed and (``--profile torch``) counted per phase."""
    bf16 = {"true": True, "false": False}.get(args.bf16.lower(), args.bf16)
    if args.profile == "torch":  # before anything compiles: each generated kernel then shows in the profile
        from torch._inductor import config as inductor_config

        inductor_config.cpp.enable_kernel_profile = True
    with tempfile.TemporaryDirectory(prefix="host_overhead_") as tmp:
        tr = build_trainer(Path(tmp), args.size, args.batch, bf16, json.loads(args.zero), json.loads(args.set),
                           args.compile, json.loads(args.ds), step=args.step)
        if args.engine_compile:  # DeepSpeed's own: torch.compile of the module in place (DeepCompile if configured)
            tr.engine.compile()
        phases = Phases(tr)
        batches = phases.batches(tr.loader.forever())
        t0 = time.perf_counter()
        run_steps(tr, batches, args.warmup)
        sync(tr.device)
        warmup_s = time.perf_counter() - t0
        phases.clear()
        t0, c0 = time.perf_counter(), time.process_time()
        run_steps(tr, batches, args.steps)
        sync(tr.device)
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        phases._charge()
        host, host_cpu = dict(phases.seconds), dict(phases.cpu_seconds)
        from benchmarks.run import device_name, git_commit

        row = {"device_name": device_name(tr.device), "torch": torch.__version__, "commit": git_commit(),
               "size": args.size, "batch": args.batch, "bf16": tr.bf16, "device": str(tr.device),
               "zero": tr.resolved_config["zero_optimization"], "compile": args.compile,
               "engine_compile": args.engine_compile,
               "step": "flat" if tr.stepper.flat is not None else "deepspeed",
               "params": sum(q.numel() for q in tr.net.parameters()),
               "param_tensors": len(list(tr.net.parameters())), "threads": torch.get_num_threads(),
               "load": os.getloadavg()[0], "warmup_s": round(warmup_s, 1),
               "ms_per_step": 1e3 * wall / args.steps, "cpu_ms_per_step": 1e3 * cpu / args.steps,
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
            if tr.device.type == "cpu":  # how much of the CPU's step is arithmetic a GPU would run on the device
                onednn = cpu_arithmetic.onednn_exec(lambda: run_steps(tr, batches, 3), 3)
                large = cpu_arithmetic.large_kernels(
                    prof, 3, lambda name: name.startswith(OP_PREFIXES) or _is_compiled_kernel(name))
                row["cpu_arithmetic"] = cpu_arithmetic.split(row["ms_per_step"], onednn, large,
                                                              cpu_arithmetic.matmul_calls_ms(prof, 3))
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
    return row


# The committed op counts of the compiled flat step at imagenet-246m's structure (tiny sizes, batch 2, bf16),
# which tests/benchmarks/test_op_count_gate.py holds the step to (at most 10% above)
GATE = Path(__file__).resolve().parent / "results" / "op_count_gate.json"
GATE_MARGIN = 1.10


def gate_failures(row: dict, gate: dict) -> list[str]:
    """What in ``row`` (a ``--profile torch`` row) rose more than ``GATE_MARGIN`` above the committed ``gate``."""
    out = []
    for key in ("top_level_ops", "kernel_ops", "compiled_kernels"):
        if row[key] > GATE_MARGIN * gate[key]:
            out.append(f"{key}: {row[key]:.0f} per step, more than {100 * (GATE_MARGIN - 1):.0f}% above the "
                       f"committed {gate[key]:.0f} ({GATE.name}, commit {gate.get('commit')}): "
                       f"by phase now {row.get('top_level_by_phase')}")
    return out


def summary(row: dict) -> str:
    return (f"{row['step']} step{' compiled' if row['compile'] else ''}: {row['ms_per_step']:.1f} ms/step, "
            f"{row['cpu_ms_per_step']:.1f} CPU ms ({row['size']}, batch {row['batch']}, "
            f"{'bf16' if row['bf16'] else 'fp32'}, load {row['load']:.1f})"
            + (f"; {row['top_level_ops']:.0f} ops/step from Python, {row['kernel_ops']:.0f} of them launching a "
               f"kernel, {row['compiled_kernels']:.0f} compiled kernels" if "top_level_ops" in row else "")
            + (f"; of it CPU arithmetic {row['cpu_arithmetic']['arithmetic_ms']:.1f} ms (oneDNN's kernels "
               f"{row['cpu_arithmetic']['onednn_exec_ms']:.1f} in {row['cpu_arithmetic']['onednn_calls']:.0f} calls, "
               f"{row['cpu_arithmetic']['large_kernels']:.0f} passes of >= "
               f"{row['cpu_arithmetic']['threshold_us']:.0f} us {row['cpu_arithmetic']['large_kernel_ms']:.1f}), "
               f"host work {row['cpu_arithmetic']['host_only_ms']:.1f} ms" if "cpu_arithmetic" in row else ""))


def compare_table(before: dict, after: dict) -> str:
    """Per phase: ops dispatched from Python and host ms, before and after, and the totals' ratios."""
    lines = [f"| phase | ops before | ops after | host ms before | host ms after |", "|---|---|---|---|---|"]
    ops_b, ops_a = before.get("top_level_by_phase", {}), after.get("top_level_by_phase", {})
    for phase in PHASES:
        cells = (ops_b.get(phase, 0), ops_a.get(phase, 0), before["host_ms_by_phase"][phase],
                 after["host_ms_by_phase"][phase])
        if any(cells):
            lines.append(f"| {phase} | {cells[0]:.0f} | {cells[1]:.0f} | {cells[2]:.1f} | {cells[3]:.1f} |")
    lines.append(f"| **total** | **{before.get('top_level_ops', 0):.0f}** | **{after.get('top_level_ops', 0):.0f}** | "
                 f"**{before['ms_per_step']:.1f}** | **{after['ms_per_step']:.1f}** |")
    split_b, split_a = before.get("cpu_arithmetic"), after.get("cpu_arithmetic")
    if split_b and split_a:
        lines.append(f"| of it, CPU arithmetic (oneDNN's kernels + passes of >= {split_a['threshold_us']:.0f} us) "
                     f"| | | {split_b['arithmetic_ms']:.1f} | {split_a['arithmetic_ms']:.1f} |")
        lines.append(f"| of it, host work | | | {split_b['host_only_ms']:.1f} | {split_a['host_only_ms']:.1f} |")
        if "matmul_setup_ms" in split_b and "matmul_setup_ms" in split_a:
            lines.append(f"| of the host work, the matmuls' set-up around oneDNN's kernel (as profiled) | | | "
                         f"{split_b['matmul_setup_ms']:.1f} | {split_a['matmul_setup_ms']:.1f} |")
    if before.get("top_level_ops"):
        lines.append(f"ops ratio {after['top_level_ops'] / before['top_level_ops']:.3f} "
                     f"(+ {after.get('compiled_kernels', 0):.0f} compiled kernels after), host ms ratio "
                     f"{after['ms_per_step'] / before['ms_per_step']:.3f}"
                     + (f", host work without the CPU's arithmetic {split_a['host_only_ms'] / split_b['host_only_ms']:.3f}"
                        if split_b and split_a else ""))
    return "\n".join(lines)


def pair_ratios(pairs: list) -> str:
    """The flat step's ratios to DeepSpeed's over alternating (before, after) pairs: each pair's, and the median
    and range of them (a shared VM's speed swings by 30% between runs a minute apart, both ways)."""
    import statistics

    def line(name, values):
        return (f"{name}: median {statistics.median(values):.3f} (range {min(values):.3f}-{max(values):.3f}; "
                + ", ".join(f"{v:.3f}" for v in values) + ")")

    lines = [line("host ms ratio", [a["ms_per_step"] / b["ms_per_step"] for b, a in pairs])]
    if all("cpu_arithmetic" in r for pair in pairs for r in pair):
        lines.append(line("host work ratio", [a["cpu_arithmetic"]["host_only_ms"] / b["cpu_arithmetic"]["host_only_ms"]
                                              for b, a in pairs]))
    return f"over {len(pairs)} alternating pairs, " + "; ".join(lines)


def _compare(args, argv) -> int:
    """The baseline (DeepSpeed's engine step, eager: ``train.fast`` before the flat step) and the new step (flat,
    compiled) in one run, each in a process of its own, then the per-phase table; ``--pairs N`` alternates them
    N times and adds the ratios' median."""
    import subprocess

    pairs = []
    rest = [a for i, a in enumerate(argv) if a not in ("--compare", "--compile", "--pairs")
            and not a.startswith("--pairs=") and (i == 0 or argv[i - 1] != "--pairs")]
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.pairs):
            rows = []
            for i, extra in enumerate((["--step", "deepspeed"], ["--step", "flat", "--compile"])):
                out = Path(tmp) / f"{k}-{i}.jsonl"
                subprocess.run([sys.executable, __file__, *rest, *extra, "--profile", "torch", "--json", str(out)],
                               check=True, stdout=subprocess.DEVNULL)
                rows.append(json.loads(out.read_text().splitlines()[-1]))
            pairs.append(rows)
            for row in rows:
                print(summary(row))
            print(compare_table(*rows), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.writelines(json.dumps(row) + "\n" for row in rows)
    if len(pairs) > 1:
        print(pair_ratios(pairs))
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", choices=("train", "sampling"), default="train",
                   help="the training step, or a guided sampling step (benchmarks/sampling_overhead.py)")
    p.add_argument("--size", choices=("tiny", "full"), default="tiny")
    p.add_argument("--batch", type=int, default=2, help="per-GPU micro-batch (the paper's: 32)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--bf16", default="auto", help="bf16.enabled: true, false or auto (default)")
    p.add_argument("--zero", default="{}", help="JSON merged into zero_optimization, e.g. '{\"stage\": 1}'")
    p.add_argument("--ds", default="{}", help="JSON merged into the DeepSpeed config, e.g. '{\"bf16\": "
                   "{\"check_grad_overflow\": false}}'")
    p.add_argument("--set", default="{}", help="JSON merged into model.overrides")
    p.add_argument("--step", choices=("deepspeed", "flat"), default="deepspeed", help="train.step")
    p.add_argument("--compile", action="store_true", help="train.compile (sampling: the compiled step)")
    p.add_argument("--engine-compile", action="store_true", help="DeepSpeed's engine.compile() after the build "
                   "(with --ds '{\"compile\": {\"deepcompile\": true}}': DeepCompile)")
    p.add_argument("--compare", action="store_true", help="DeepSpeed's eager step against the compiled flat step "
                   "(sampling: eager against compiled), each counted, and the per-phase table")
    p.add_argument("--pairs", type=int, default=1, help="with --compare: alternate the two steps this many times "
                   "and print the ratios' median")
    p.add_argument("--profile", choices=("none", "torch", "cprofile"), default="none")
    p.add_argument("--reads", action="store_true", help="count tensor read-backs and syncs per phase")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="append the row(s) to this .jsonl file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.stage == "sampling":
        from benchmarks import sampling_overhead

        rows = [sampling_overhead.measure(size=args.size, batch=args.batch, compile=c)
                for c in ((False, True) if args.compare else (args.compile,))]
        for row in rows:
            print(json.dumps(row))
        if args.compare:
            print(f"guided sampling step: {rows[0]['top_level_ops']:.0f} -> {rows[1]['top_level_ops']:.0f} ops "
                  f"({rows[1]['top_level_ops'] / rows[0]['top_level_ops']:.3f}), {rows[0]['ms_per_step']:.1f} -> "
                  f"{rows[1]['ms_per_step']:.1f} ms")
        if args.json:
            with open(args.json, "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
        return 0
    if args.compare:
        return _compare(args, argv)
    row = measure(args)
    print(json.dumps(row, indent=1))
    print("host_overhead: " + summary(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
