"""Crash-safe checkpoints: DeepSpeed's state plus EMAs, loader position and RNG states.

A checkpoint is written under ``<dir>/step_XXXXXXX.partial/`` and renamed to
``<dir>/step_XXXXXXX/`` once every rank has finished writing; only then is the
``latest`` file replaced (write to a temporary file, then ``os.replace``, which is
atomic on POSIX). A crash mid-write therefore leaves at most a ``.partial``
folder behind and ``latest`` still names a complete checkpoint.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Optional

_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint that exists but cannot be loaded (most often a truncated or corrupt file)."""


def unreadable(folder: Path, why) -> str:
    """The message of a checkpoint that cannot be read: which, why, and the way out."""
    older = [p.name for p in complete_checkpoints(folder.parent) if p != folder]
    out = (f"resume from the previous one ({older[-1]}) by moving {folder} away" if older else
           "move it away to train afresh")
    return f"cannot resume from {folder}: {why}. If a file there is truncated or corrupt, {out}"


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(ckpt_dir: Path, step: int, keep: int) -> Path:
    """Rank 0, after all ranks wrote ``<tag>.partial``: publish it and prune old ones."""
    tag = tag_for(step)
    partial, final = ckpt_dir / f"{tag}.partial", ckpt_dir / tag
    aside = ckpt_dir / f"{tag}.replaced"
    if final.exists():  # the same step saved again: set the complete one aside (not deleted) until the new one is in
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(partial, final)
    atomic_write_text(ckpt_dir / "latest", tag + "\n")
    # keep the one just published and the newest keep - 1 others (keep = 0: all), even where an older run's
    # checkpoints carry higher step numbers
    others = [p for p in complete_checkpoints(ckpt_dir) if p != final]
    for old in others[:max(0, len(others) - (keep - 1))] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    # the one set aside above, and any that an earlier crash left
    for stale in [*ckpt_dir.glob("*.partial"), *ckpt_dir.glob("*.replaced")]:
        shutil.rmtree(stale, ignore_errors=True)
    return final


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and _STEP_DIR.match(p.name)] if ckpt_dir.is_dir() else []
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def latest_tag(ckpt_dir: Path) -> Optional[str]:
    """The tag ``latest`` names, if that checkpoint is complete; else the newest complete one."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        aside = ckpt_dir / f"{tag}.replaced"
        if not (ckpt_dir / tag).is_dir() and aside.is_dir():  # a crash while commit() replaced it: take it back
            try:
                os.replace(aside, ckpt_dir / tag)
            except FileNotFoundError:  # another rank took it back first
                pass
        if (ckpt_dir / tag).is_dir():
            return tag
    done = complete_checkpoints(ckpt_dir)
    return done[-1].name if done else None
