"""Resolving the data section: token shards (prepared on first use for the embedded digits data set)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from .config import ConfigError, DataSection, repo_path
from .distributed import agree_on_setup


def resolve_shards(data: DataSection, rank: int, log=print, progress: bool = True) -> tuple[Path, Optional[Path]]:
    """(shard folder, tokenizer folder or None). For ``dataset: "digits"`` rank 0 prepares (or reuses) the
    cached tokenizer and shards while the other ranks wait; ``progress``: its bars."""
    if data.dataset is not None:
        if data.dataset != "digits":
            raise ConfigError(f"vqlcmd.data.dataset must be 'digits' (the embedded data set), got {data.dataset!r}; "
                              "for other data give vqlcmd.data.shards (see scripts/tokenize.py)")
        from ..data.digits import prepare_digits

        steps = data.tokenizer_steps
        info, error = None, None
        if rank == 0:
            try:
                info = prepare_digits(steps=steps, log=log, progress=progress)
            except Exception as exc:  # handed to every rank below: the others wait there, and would wait on
                error = exc
        agree_on_setup(error, None)  # the others wait here while rank 0 prepares; its failure stops them all
        if info is None:
            info = prepare_digits(steps=steps, log=lambda *a, **k: None, progress=False)
        return Path(info["shards"]), Path(info["tokenizer"])
    shards = repo_path(data.shards)
    if shards is None:
        raise ConfigError("vqlcmd.data needs 'shards' (a folder of token shards) or 'dataset': 'digits'")
    if not shards.is_dir():
        raise ConfigError(f"vqlcmd.data.shards: shard folder {shards} does not exist (make it with scripts/tokenize.py)")
    tok = repo_path(data.tokenizer)
    if tok is not None and not tok.exists():
        raise ConfigError(f"vqlcmd.data.tokenizer: folder {tok} does not exist")
    return shards, tok
