"""Crash-safe checkpoints: DeepSpeed's state plus EMAs, loader position and RNG states.

A checkpoint is written under ``<dir>/step_XXXXXXX.partial/`` and renamed to
``<dir>/step_XXXXXXX/`` once every rank has finished writing; only then is the
``latest`` file replaced (write to a temporary file, then ``os.replace``, which is
atomic on POSIX). A crash mid-write therefore leaves at most a ``.partial``
folder behind and ``latest`` still names a complete checkpoint.

Before the rename, ``commit`` writes ``manifest.json`` (every file's size and checksum, see
``manifest.py``) and flushes the folder to the disk; a resume takes :func:`resumable_checkpoint`, the newest
checkpoint whose files still match it, and sets the ones that fail aside as ``step_XXXXXXX.corrupt``.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Callable, Optional

from .manifest import (MANIFEST, CheckpointError, ManifestError, NoManifest, atomic_write_text,
                       verify_manifest, write_manifest)

_STEP_DIR = re.compile(r"^step_(\d+)$")
_STEP_ASIDE = re.compile(r"^step_(\d+)(?:\.corrupt(?:\.\d+)?)?$")  # a step folder, or one set aside


def unreadable(folder: Path, why) -> str:
    """The message of a checkpoint that cannot be read: which, why, and the way out."""
    older = [p.name for p in complete_checkpoints(folder.parent) if p != folder]
    out = (f"resume from the previous one ({older[-1]}) by moving {folder} away" if older else
           "move it away to train afresh")
    return f"cannot resume from {folder}: {why}. If a file there is truncated or corrupt, {out}"


def tag_for(step: int) -> str:
    return f"step_{step:07d}"


def commit(ckpt_dir: Path, step: int, keep: int) -> Path:
    """Rank 0, after all ranks wrote ``<tag>.partial``: write its manifest, publish it and prune old ones.

    Retention never deletes the only checkpoint that verifies: the one published here verifies by
    construction (its manifest is computed from its files as they lie on the disk, and they are flushed there,
    with the renames, before anything older is deleted), and folders set aside as ``.corrupt`` are never
    pruned. A file that cannot be read for the manifest stops the commit before anything is renamed or
    deleted."""

    tag = tag_for(step)
    partial, final = ckpt_dir / f"{tag}.partial", ckpt_dir / tag
    aside = ckpt_dir / f"{tag}.replaced"
    try:
        write_manifest(partial, durable=True)
    except OSError as exc:  # a full disk, a file another rank's node has not made visible: the old ones stay
        raise CheckpointError(f"cannot write the manifest of {partial} ({type(exc).__name__}: {exc}); the "
                              f"checkpoints before it are kept") from exc
    if final.exists():  # the same step saved again: set the complete one aside (not deleted) until the new one is in
        if aside.exists():
            shutil.rmtree(aside)
        os.replace(final, aside)
    os.replace(partial, final)
    atomic_write_text(ckpt_dir / "latest", tag + "\n")  # (flushes ckpt_dir: both renames are on the disk)
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


def _step(folder: Path) -> int:
    return int(_STEP_ASIDE.match(folder.name).group(1))


def _set_aside(folder: Path) -> Path:
    """``folder`` renamed to ``<name>.corrupt`` (``.corrupt.2``, ... where taken): kept, out of every listing."""
    aside, n = folder.with_name(folder.name + ".corrupt"), 1
    while aside.exists():
        n += 1
        aside = folder.with_name(f"{folder.name}.corrupt.{n}")
    os.replace(folder, aside)
    return aside


def set_aside_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The folders :func:`resumable_checkpoint` set aside, newest step first."""
    found = [p for p in ckpt_dir.glob("step_*.corrupt*") if p.is_dir() and _STEP_ASIDE.match(p.name)]
    return sorted(found, key=lambda p: (int(_STEP_ASIDE.match(p.name).group(1)), p.name), reverse=True)


def check_checkpoint(folder: Path, older: list[Path]) -> bool:
    """Verify one checkpoint against its manifest: True when it verified, False for one written before
    checkpoints carried manifests (it cannot be verified); :class:`~.manifest.ManifestError` naming the file
    that failed otherwise. A folder without a manifest counts as that old only when none of the ``older``
    checkpoints beside it has one: after one that has, its manifest was lost."""

    try:
        verify_manifest(folder)
    except NoManifest as exc:
        if any((p / MANIFEST).is_file() for p in older):
            raise ManifestError(exc.path, "missing, though an older checkpoint beside it has one") from None
        return False
    return True


def _named_by_latest(ckpt_dir: Path) -> Optional[str]:
    try:
        return (ckpt_dir / "latest").read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _failure(folder: Path, exc) -> str:
    """``step_X/file: reason``: the file as it was named in the checkpoint."""
    try:
        where = f"{folder.name}/{exc.path.relative_to(folder).as_posix()}"
    except ValueError:
        where = str(exc.path)
    return f"{where}: {exc.reason}"


def resumable_checkpoint(ckpt_dir: Path, log: Callable[[str], None] = print) -> Optional[Path]:
    """The checkpoint a resume loads: the newest one that verifies against its manifest, or None when the
    folder holds none (train afresh).

    Candidates are the one ``latest`` names (else the newest complete one, as :func:`latest_tag`), then the
    other complete ones, newest step first. Each that fails is renamed aside (``step_XXXXXXX.corrupt``;
    nothing is deleted) with a log line naming the file that failed, and the next is tried; ``latest`` is then
    rewritten to name the one chosen, so that :func:`latest_tag` on every rank agrees with it. Where
    checkpoints existed but none verifies (now, or set aside by an earlier launch), a
    :class:`CheckpointError` with a one-line message names the file: an unattended job stops there rather
    than training afresh beside them.

    Rank 0 alone calls it (it renames folders), before the other ranks look, e.g. behind a barrier."""

    ckpt_dir = Path(ckpt_dir)
    named, head = _named_by_latest(ckpt_dir), latest_tag(ckpt_dir)
    if named is not None and head != named:
        log(f"{ckpt_dir / 'latest'} names {named}, which is not there; "
            + (f"taking the newest complete checkpoint, {head}" if head else "no complete checkpoint is left"))
    done = complete_checkpoints(ckpt_dir)
    candidates = ([ckpt_dir / head] + [p for p in reversed(done) if p.name != head]) if head else []
    failed = []
    for folder in candidates:
        try:
            verified = check_checkpoint(folder, [p for p in done if _step(p) < _step(folder)])
        except ManifestError as exc:
            aside = _set_aside(folder)
            failed.append(_failure(folder, exc))
            log(f"checkpoint {folder} failed verification: {failed[-1]}; set aside as {aside.name} (nothing "
                "deleted)" + ("; trying the previous one" if folder != candidates[-1] else ""))
            continue
        if not verified:
            log(f"{folder} has no manifest.json (written before checkpoints carried one): resuming it unverified")
        if failed or head != named:
            atomic_write_text(ckpt_dir / "latest", folder.name + "\n")
            log(f"resuming from {folder}, the newest checkpoint that verifies"
                + (f" ({len(failed)} newer set aside)" if failed else ""))
        return folder
    if not failed:
        older = set_aside_checkpoints(ckpt_dir)
        if not older:
            return None  # nothing was ever there: a fresh run
        try:
            check_checkpoint(older[0], [])
            failed.append(f"{older[0].name} (set aside earlier, now verifies)")
        except ManifestError as exc:
            failed.append(f"{_failure(older[0], exc)} (set aside earlier)")
    shown = "; ".join(failed[:3]) + (f"; and {len(failed) - 3} more" if len(failed) > 3 else "")
    raise CheckpointError(f"no checkpoint in {ckpt_dir} verifies: {shown}. They are set aside as *.corrupt, "
                          "nothing deleted: rename one back to its step_ name to resume it anyway, or move the "
                          "folder away to train afresh")


def verify_checkpoints_cli(path, out: Callable[[str], None] = print) -> int:
    """``scripts/train.py --verify-checkpoints PATH``: check every checkpoint under a run's output_dir, its
    checkpoints/ folder, one checkpoint, or an exported pipeline folder, against their manifests, without
    training or changing anything. One line per folder; the exit status is 1 when the one a resume would
    take first (what ``latest`` names, else the newest) fails, or when there is nothing to check; 0 else."""

    path = Path(path)
    if not path.is_dir():
        out(f"{path}: {'not a folder' if path.exists() else 'no such folder'}")
        return 1
    ckpt_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    done, aside = complete_checkpoints(ckpt_dir), set_aside_checkpoints(ckpt_dir)
    if not done and not aside:  # one checkpoint, or a pipeline folder
        if not (path / MANIFEST).is_file() and not _STEP_DIR.match(path.name):
            out(f"{path}: no checkpoints (step_* folders) and no {MANIFEST} here")
            return 1
        done, first = [path], path
    else:
        named = _named_by_latest(ckpt_dir)
        first = next((p for p in done if p.name == named), done[-1] if done else None)
        if named and (first is None or first.name != named):
            out(f"{ckpt_dir / 'latest'} names {named}, which is not there")
    status = 0
    for folder in [*reversed(done), *aside]:
        mark = " (resumed first)" if folder == first else ""
        try:
            verified = check_checkpoint(folder, [p for p in done if _STEP_DIR.match(p.name) and
                                                 _STEP_DIR.match(folder.name) and _step(p) < _step(folder)])
        except ManifestError as exc:
            out(f"{folder.name}{mark}: FAILED: {_failure(folder, exc)}")
            status = 1 if folder == first else status
            continue
        out(f"{folder.name}{mark}: " + ("ok" if verified else f"unverified: no {MANIFEST} (written before "
                                                               "checkpoints carried one)"))
    if first is None:
        out(f"{ckpt_dir}: no checkpoint to resume (only folders set aside as .corrupt)")
        return 1
    return status


def latest_tag(ckpt_dir: Path) -> Optional[str]:
    """The tag ``latest`` names, if that checkpoint is complete; else the newest complete one."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text(errors="replace").strip()
        tag = tag if _STEP_DIR.match(tag) else ""  # a damaged `latest` names nothing (not ckpt_dir itself)
        aside = ckpt_dir / f"{tag}.replaced"
        if not (ckpt_dir / tag).is_dir() and aside.is_dir():  # a crash while commit() replaced it: take it back
            try:
                os.replace(aside, ckpt_dir / tag)
            except FileNotFoundError:  # another rank took it back first
                pass
        if tag and (ckpt_dir / tag).is_dir():
            return tag
    done = complete_checkpoints(ckpt_dir)
    return done[-1].name if done else None
