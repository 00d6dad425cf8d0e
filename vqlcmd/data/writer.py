"""Images -> token shards, restartable.

Shard ``i`` holds samples ``[i * shard_size, (i + 1) * shard_size)`` of a fixed source order, so a
rerun knows which shards exist (and are valid, for this tokenizer) and only makes the missing ones.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch

from .shards import SUFFIX, ShardError, open_shard, write_shard

BatchSource = Callable[[int, int], Iterable[tuple[torch.Tensor, torch.Tensor]]]


def shard_path(out_dir, index: int, prefix: str = "shard") -> Path:
    return Path(out_dir) / f"{prefix}-{index:05d}{SUFFIX}"


# Header values a finished shard need not share with the run: where the tree was mounted (its file list's
# digest, which uses paths relative to the tree, says whether it holds the same images)
_NOT_COMPARED = ("source",)
# Added to the header later: shards written before lack it, and keep the checks they were made under
_LEGACY_OPTIONAL = ("files_sha256",)


def _redo_reason(path: Path, header: dict, count: int):
    """None if ``path`` is a finished shard of this run: intact, as long as its range, and written with the
    header values this run writes (tokenizer, the tree's file list, image size, channels, flip, ...); else
    why it is (re)made."""
    if not path.exists():
        return "missing"
    try:
        s = open_shard(path)
    except ShardError as exc:
        return f"unreadable ({exc})"  # a corrupt or foreign leftover is redone, not trusted
    left_out = len(s.header.get("skipped_files", []))  # files of its range that failed to decode
    if len(s) + left_out != count:
        return f"{len(s)} samples{f' + {left_out} skipped' if left_out else ''}, not {count}"
    for k, v in header.items():
        if k in _NOT_COMPARED or (k in _LEGACY_OPTIONAL and k not in s.header):
            continue
        if s.header.get(k) != v:
            return f"another {k}"
    return None


def _other_shard_size(out_dir: Path, prefix: str, first_count: int) -> bool:
    """Whether the folder's first shard was written with another shard size than this run's: its count is
    every shard's but the last's, so it differs from this run's first unless both runs have one shard."""
    try:
        return len(open_shard(shard_path(out_dir, 0, prefix), verify=False)) != first_count
    except (OSError, ShardError):  # missing or unreadable: redone anyway
        return False


def _index(path: Path, prefix: str) -> int:
    """The shard index in ``<prefix>-<index>.vqtok``, or -1 for another name."""
    stem = path.name[len(prefix) + 1:-len(SUFFIX)]
    return int(stem) if path.name.startswith(prefix + "-") and stem.isdigit() else -1


def _refuse_stale(out_dir: Path, prefix: str, num_shards: int) -> None:
    """Shards past this run's last index come from a run with more images or smaller shards; the data set
    would read them beside this run's, duplicating or mixing samples."""
    stale = sorted(p.name for p in out_dir.glob(f"{prefix}-*{SUFFIX}") if _index(p, prefix) >= num_shards)
    if stale:
        raise ShardError(f"{out_dir} holds {len(stale)} {prefix} shard(s) past this run's {num_shards} "
                         f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}), from a run with other "
                         "settings; write into an empty folder, or remove them")


def _foreign_shards(out_dir: Path, header: dict, prefix: str) -> list[tuple[Path, str]]:
    """The readable shards in ``out_dir`` that another data set wrote: (path, the first header value that
    differs). Any prefix counts (a flip-* shard of another tokenizer would be read beside this run's), its
    own ``flipped`` aside; unreadable leftovers are a crashed run's, redone as before."""
    foreign = []
    for path in sorted(out_dir.glob(f"*{SUFFIX}")):
        try:
            theirs = open_shard(path, verify=False).header
        except ShardError:
            continue
        for k, v in header.items():
            if k in _NOT_COMPARED or (k in _LEGACY_OPTIONAL and k not in theirs):
                continue
            if k == "flipped" and not path.name.startswith(prefix + "-"):
                continue
            if theirs.get(k) != v:
                foreign.append((path, f"{k} {json.dumps(theirs.get(k))[:80]}, not {json.dumps(v)[:80]}"))
                break
    return foreign


def write_token_shards(out_dir, tokenizer, count: int, batches: BatchSource, header: dict, *,
                       shard_size: int = 10000, prefix: str = "shard", progress: bool = True,
                       log: Callable[[str], None] = print, overwrite: bool = False,
                       skipped: Callable[[int, int], list[str]] | None = None) -> dict:
    """Tokenizes ``count`` samples into ``out_dir``; ``batches(start, stop)`` yields
    ``(images in [-1, 1] (B, C, H, W), labels (B,))`` for samples ``[start, stop)`` in order.
    ``skipped(start, stop)``, once those batches are done, names the samples of the range that the source left
    out (files that failed to decode); the shard records them (header ``skipped_files``), so that a restart keeps
    it though it holds fewer samples than its range.
    Returns counts and throughput. Existing valid shards of the same data set (tokenizer and header) are
    kept. Shards of another (tokenizer, image tree, size, ...) are an error naming the difference: they were
    silently replaced, and a model trained on them could no longer resume. ``overwrite`` deletes them first."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    header = dict(header, tokenizer_id=tokenizer.identifier, codebook_size=tokenizer.codebook_size,
                  grid=list(tokenizer.grid))
    if shard_size < 1:
        raise ValueError(f"shard_size must be >= 1, got {shard_size}")
    ranges = [(i, s, min(s + shard_size, count)) for i, s in enumerate(range(0, count, shard_size))]
    foreign = _foreign_shards(out_dir, header, prefix)
    if foreign and not overwrite:
        path, why = foreign[0]
        raise ShardError(f"{out_dir} holds {len(foreign)} shard(s) of another data set ({path.name}: {why}); write "
                         "into another folder, or overwrite them (vqlcmd-tokenize --overwrite)")
    for path, _ in foreign:
        path.unlink()
    if foreign:
        log(f"{out_dir}: deleted {len(foreign)} shard(s) of another data set (overwrite)")
    _refuse_stale(out_dir, prefix, len(ranges))
    reasons = {r: _redo_reason(shard_path(out_dir, r[0], prefix), header, r[2] - r[1]) for r in ranges}
    if _other_shard_size(out_dir, prefix, min(shard_size, count)):
        # a shard records no range: after a run of other shard sizes, one whose count happens to equal this
        # run's (an old last shard) was kept for another range, losing and duplicating that many samples
        reasons = {r: "another shard size" if why is None else why for r, why in reasons.items()}
    todo = [r for r in ranges if reasons[r] is not None]
    redo = {why for why in reasons.values() if why not in (None, "missing")}
    if len(todo) < len(ranges) or redo:  # say why existing shards are not kept: a redo can take hours
        why = f" (redoing existing ones: {'; '.join(sorted(redo)[:3])})" if redo else ""
        log(f"{out_dir}: keeping {len(ranges) - len(todo)} finished {prefix} shard(s), making {len(todo)}{why}")
    bar = None
    if progress and todo:
        from tqdm import tqdm
        bar = tqdm(total=sum(b - a for _, a, b in todo), desc=f"tokenize {prefix}", unit="img")
    t0, done = time.perf_counter(), 0
    for i, start, stop in todo:
        toks, labs = [], []
        for images, labels in batches(start, stop):
            toks.append(tokenizer.encode(images).reshape(len(images), -1).cpu().numpy().astype(np.uint16))
            labs.append(labels.cpu().numpy())
            done += len(images)
            if bar is not None:
                bar.update(len(images))
                bar.set_postfix({"img/s": f"{done / (time.perf_counter() - t0):.0f}"})
        left_out = skipped(start, stop) if skipped is not None else []
        got = sum(len(l) for l in labs)
        if got + len(left_out) != stop - start:
            raise RuntimeError(f"source gave {got} samples for shard {i} ({start}..{stop}), expected {stop - start}"
                               + (f" less {len(left_out)} skipped" if left_out else ""))
        if not got:  # every file of the range skipped: an empty shard keeps the ranges' numbering
            toks, labs = [np.zeros((0, tokenizer.num_tokens), np.uint16)], [np.zeros(0, np.int64)]
        shard_header = dict(header, skipped_files=list(left_out)) if left_out else header
        write_shard(shard_path(out_dir, i, prefix), np.concatenate(toks), np.concatenate(labs), shard_header)
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - t0
    # every shard's, kept ones' included: the run's whole loss, not just this restart's
    left_out = [f for i, _, _ in ranges
                for f in open_shard(shard_path(out_dir, i, prefix), verify=False).header.get("skipped_files", [])]
    return {"shards": len(ranges), "written": len(todo), "images": done, "seconds": seconds,
            "images_per_s": done / seconds if done and seconds > 0 else 0.0, "skipped_files": left_out}
