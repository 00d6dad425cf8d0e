"""glibc malloc settings for training on CPUs: keep freed tensor memory in the process.

PyTorch's CPU tensors come from malloc. glibc serves large blocks with fresh ``mmap``s and hands
the top of its heap back to the OS past a trim threshold, so a step's large activations (9 MiB
each for the digits model's MLP) arrive as untouched pages that fault in on first write: ~15,000
minor page faults per digits training step, ~50 ms of system time, and ~6,000 per tokenizer step
(2-core development machine). Serving blocks up to 32 MiB from the heap (glibc's largest
threshold) and never trimming it lets each step reuse the pages of the last one: ~200 faults per
step. Memory use stays what the largest step needs (the heap is reused, not grown).

The usual advice for PyTorch on CPUs is to ``LD_PRELOAD`` jemalloc or tcmalloc; neither comes
from the package index, and two ``mallopt`` calls do what is needed here.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's maximum on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 1 << 30


def keep_freed_memory(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> str:
    """Apply the settings process-wide; returns what happened, for the log.

    Both must be set: fixing either turns off glibc's own threshold adaptation, so a trim threshold
    alone would leave every block above 128 KiB to mmap (far worse). ``VQLCMD_MALLOC_TUNING=0``
    leaves malloc alone; elsewhere than glibc this does nothing.
    """
    if os.environ.get("VQLCMD_MALLOC_TUNING", "1") == "0":
        return "malloc: left alone (VQLCMD_MALLOC_TUNING=0)"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError, TypeError):
        return "malloc: not glibc, left alone"
    version.restype = ctypes.c_char_p
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1
    if not ok:
        return f"malloc: glibc {version().decode()} refused the thresholds, left as it was"
    return (f"malloc: glibc {version().decode()} keeps freed blocks up to {mmap_threshold >> 20} MiB in the "
            f"heap (no page faults re-touching each step's activations)")


def release_freed_memory() -> str:
    """Hands the free pages inside the heap back to the OS (glibc's ``malloc_trim``); returns what happened.

    For once after set-up. With the settings above, weights under 32 MiB live in the heap, and set-up frees a
    whole copy of them where no trim reaches: DeepSpeed moves the model's weights into its flat buffers after
    the EMA copies were allocated above them. At ``imagenet-246m`` size that hole is most of a GiB per rank,
    which the steps' activations reuse only in part."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return "malloc: not glibc, nothing released"
    before = _resident()
    trim(0)
    freed = before - _resident()
    return f"malloc: {freed / 2**20:.0f} MiB of freed set-up memory handed back to the OS"


def _resident() -> int:
    """Resident bytes of this process (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
