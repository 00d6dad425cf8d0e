"""Files that pass ``list_images``' header check but fail to decode (pixel data cut short): found by name when a
batch fails, recorded, and replaced in the decoder's input by a readable stand-in whose rows the caller drops.

Shared by the online loader (``online.py``) and the shard writer's source (``vqlcmd-tokenize``), so one bad
file in a million-image tree costs that file, not the run.
"""
from __future__ import annotations

import warnings

import torch

from .decode import image_batches
from .images import ImageList, unreadable_reason

# batches the DALI pipeline decodes ahead of the one it returns: a file failing there may surface a little early
PREFETCH = 2


class UndecodableTree(RuntimeError):
    """Every listed image failed to decode: nothing is left to skip to."""


def record_undecodable(images: ImageList, files, bad: dict) -> dict:
    """Decodes ``files`` (PIL) to find those that fail and are not yet in ``bad``; adds them to ``bad`` (file:
    reason) and returns them. Raises ``UndecodableTree`` once every file of ``images`` is bad."""
    found = {}
    for f in dict.fromkeys(files):
        if f not in bad and (reason := unreadable_reason(f, decode=True)) is not None:
            found[f] = reason
    bad.update(found)
    if found and len(bad) == len(set(images.files)):
        f, reason = next(iter(found.items()))
        raise UndecodableTree(f"no image of the {len(bad)} under {images.root} decodes (e.g. {f}: {reason})")
    return found


def skipping_message(found: dict) -> str:
    """The warning that names the files ``record_undecodable`` found, with their reasons."""
    return f"skipping {len(found)} image(s) that fail to decode: " + "; ".join(f"{f} ({r})" for f, r in found.items())


def stand_ins(images: ImageList, files: list[str], bad: dict) -> list[str]:
    """``files`` with each known-bad one replaced by a readable file of ``images``, so the decoder's batches keep
    their size and place; the caller drops those rows."""
    if not any(f in bad for f in files):
        return list(files)
    stand_in = next(f for f in images.files if f not in bad)
    return [stand_in if f in bad else f for f in files]


def readable_batches(images: ImageList, start: int, stop: int, bad: dict, size: int, batch_size: int, **kw):
    """``image_batches`` over ``images[start:stop]`` (``kw``: its keywords) without the files that fail to decode:
    they are found, added to ``bad``, warned about by name and left out, so batches may be smaller. A failure
    that no file explains (device memory, say) is re-raised."""
    files, labels = images.files[start:stop], images.labels[start:stop]
    done = 0  # rows of [start, stop) already yielded or dropped
    while done < len(files):
        rest = files[done:]
        keep = [f not in bad for f in rest]
        if not any(keep):
            return
        subset = ImageList(images.root, stand_ins(images, rest, bad), labels[done:], images.class_names)
        batches = image_batches(subset, size, batch_size, **kw)
        while True:
            try:
                x, y = next(batches)
            except StopIteration:
                return
            except (RuntimeError, OSError):  # DALI's error / PIL's, naming a file of this batch or the next ones
                stand_in = next(f for f in images.files if f not in bad)  # may be bad too, found no sooner
                window = rest[:(1 + PREFETCH) * batch_size] + [stand_in]
                found = record_undecodable(images, window, bad)
                if not found:
                    raise
                warnings.warn(skipping_message(found), stacklevel=2)
                break  # decode again from this batch, the bad files now stood in for
            sel = keep[:len(x)]
            keep, rest = keep[len(x):], rest[len(x):]
            done += len(x)
            if all(sel):
                yield x, y
            elif any(sel):
                s = torch.tensor(sel, device=x.device)
                yield x[s], y[s.to(y.device)]
