"""``metrics.jsonl`` on resume: the rows a run logged after the checkpoint it resumes from are dropped, since
the resumed run logs those steps again (after a ``kill -9`` and a resume the file held them twice)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Union


def truncate_metrics(path: Union[str, Path], step: int) -> int:
    """Drop the rows of ``path`` whose ``step`` is above ``step``; returns how many were dropped. The file is
    rewritten under a temporary name and renamed over (a crash leaves the old file or the new one, never half
    of one). A last line cut off mid-write (no newline, not JSON) goes too; other lines that are not rows
    with a step are kept as they are. No file: nothing to do."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    lines = text.splitlines(keepends=True)
    kept, dropped = [], 0
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except ValueError:
            if i == len(lines) - 1 and not line.endswith("\n"):  # the write a kill interrupted
                dropped += 1
                continue
            kept.append(line)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
            dropped += 1
        else:
            kept.append(line if line.endswith("\n") else line + "\n")
    if not dropped:
        return 0
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, path.stat().st_mode & 0o777)
    os.replace(tmp, path)
    return dropped
