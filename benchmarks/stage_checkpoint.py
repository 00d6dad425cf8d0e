"""What a checkpoint's manifest costs against the save itself, at the size of an ``imagenet-246m`` checkpoint.

The files are laid out as the trainer and DeepSpeed write them at ZeRO 2 in bf16 on one rank, from the
preset's real parameter shapes: ``mp_rank_00_model_states.pt`` (the bf16 module, and the fp32 teacher and
sampling EMAs of the client state) and ``zero_pp_rank_0_mp_rank_00_optim_states.pt`` (the flat fp32 master
weights and both Adam moments), 5.08 GB together, plus a rank state and ``config.json``. The tensors hold
constants rather than random draws: ``torch.save`` does not compress and XXH3 runs at one speed on any data,
so only drawing them would cost more.

Each repetition writes a fresh folder and times, in order:

- ``save``: the ``torch.save`` calls (into the page cache, as a save without the manifest returns);
- ``fsync``: flushing those files to the disk, which ``commit`` now does before it deletes older
  checkpoints (without it a power cut after the pruning could leave no checkpoint that verifies);
- ``manifest``: ``write_manifest`` hashing every file (from the page cache, as ``commit`` reads it);
- ``verify cold``: ``verify_manifest`` after the files' pages were dropped (``posix_fadvise``: only this
  folder's, nothing of other processes), as a resume on a fresh node reads them;
- ``verify hot``: ``verify_manifest`` again, from the page cache.

Each row's ``% of save`` is its time against the median ``save``. The folder is deleted after each
repetition; the full run needs ~5.1 GB free where ``VQLCMD_BENCH_DIR`` (default: the temp folder) points.
Run alone: ``python -m benchmarks.stage_checkpoint`` prints the table without the harness.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness import Context, Result, summarize
from vqlcmd.engine.manifest import verify_manifest, write_manifest

STAGE = "checkpoint"
CASES = ("save", "fsync", "manifest", "verify cold", "verify hot")


def _shapes(ctx: Context) -> tuple[str, list[torch.Size]]:
    from vqlcmd.model import preset_config
    from vqlcmd.network import VQLCMDNetwork

    preset = "tiny" if ctx.quick else "imagenet-246m"
    with torch.device("meta"):  # the shapes without the memory
        net = VQLCMDNetwork(preset_config(preset))
    return preset, [v.shape for v in net.state_dict().values()]


def _write(folder: Path, shapes: list[torch.Size]) -> float:
    """The checkpoint's files, one at a time (so that at most one file's tensors are in memory); returns the
    seconds spent in torch.save alone."""
    folder.mkdir(parents=True)
    numel = sum(s.numel() for s in shapes)
    saved = 0.0

    def save(obj, name):
        nonlocal saved
        t = time.perf_counter()
        torch.save(obj, folder / name)
        saved += time.perf_counter() - t

    module = {f"p{i}": torch.full(s, 0.5, dtype=torch.bfloat16) for i, s in enumerate(shapes)}
    emas = [{f"p{i}": torch.full(s, 0.25 + k) for i, s in enumerate(shapes)} for k in range(2)]
    save({"module": module, "teacher": emas[0], "sampling_ema": emas[1], "step": 1}, "mp_rank_00_model_states.pt")
    del module, emas
    flat = [torch.full((numel,), v) for v in (0.5, 0.01, 1e-4)]  # master weights, exp_avg, exp_avg_sq
    save({"optimizer_state_dict": {"fp32_flat_groups": flat[:1], "state": {"exp_avg": flat[1],
                                                                          "exp_avg_sq": flat[2]}}},
         "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    del flat
    save({"loader": {"epoch": 0, "batch": 7}, "torch_rng": torch.get_rng_state()}, "rank_00000_state.pt")
    (folder / "config.json").write_text('{"vqlcmd": {}}')
    return saved


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def _fsync_all(folder: Path) -> None:
    for path in _files(folder):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _drop_cache(folder: Path) -> None:
    for path in _files(folder):  # clean pages (after fsync) of these files only
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(ctx: Context) -> list:
    preset, shapes = _shapes(ctx)
    reps = 2 if ctx.quick else int(os.environ.get("VQLCMD_CHECKPOINT_REPS", "2"))
    root = Path(tempfile.mkdtemp(prefix="vqlcmd-bench-checkpoint-", dir=os.environ.get("VQLCMD_BENCH_DIR")))
    times = {case: [] for case in CASES}
    size = 0
    try:
        for rep in range(reps):
            folder = root / f"step_{rep:07d}"
            times["save"].append(_write(folder, shapes))
            size = sum(p.stat().st_size for p in _files(folder))
            times["fsync"].append(_timed(lambda: _fsync_all(folder)))
            times["manifest"].append(_timed(lambda: write_manifest(folder)))
            _fsync_all(folder)  # (the manifest file too: every page clean, so every page drops)
            _drop_cache(folder)
            times["verify cold"].append(_timed(lambda: verify_manifest(folder)))
            times["verify hot"].append(_timed(lambda: verify_manifest(folder)))
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    save_s = statistics.median(times["save"])
    out = []
    for case in CASES:
        timing = summarize([t * 1e3 for t in times[case]])
        out.append(Result(STAGE, case, "xxh3_64" if case in ("manifest", "verify cold", "verify hot") else "torch",
                          f"{preset} {size / 1e9:.2f} GB", "files", timing,
                          extra={"GB/s": size / 1e9 / (timing.median_ms / 1e3),
                                 "% of save": 100 * timing.median_ms / 1e3 / save_s}))
    return out


if __name__ == "__main__":
    import sys

    quick = "--quick" in sys.argv
    for r in run(Context(device=torch.device("cpu"), quick=quick)):
        print(f"{r.case:12s} {r.shape:22s} {r.timing.median_ms / 1e3:8.2f} s (spread {r.timing.spread_ms / 1e3:.2f},"
              f" {r.timing.reps} reps)  {r.extra['GB/s']:6.2f} GB/s  {r.extra['% of save']:6.1f}% of save")
