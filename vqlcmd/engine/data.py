"""Resolving the data section: token shards (prepared on first use for the embedded digits data set), or an
image tree encoded on the fly (``source: "images"``)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from .config import ConfigError, DataSection, repo_path
from .distributed import agree_on_setup


def resolve_shards(data: DataSection, rank: int, log=print, progress: bool = True) -> tuple[Path, Optional[Path]]:
    """(shard folder, tokenizer folder or None). For ``dataset: "digits"`` rank 0 prepares (or reuses) the
    cached tokenizer and shards while the other ranks wait; ``progress``: its bars."""
    if data.dataset is not None:
        if data.dataset != "digits":
            raise ConfigError(f"vqlcmd.data.dataset must be 'digits' (the embedded data set), got {data.dataset!r}; "
                              "for other data give vqlcmd.data.shards (see vqlcmd-tokenize)")
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
        raise ConfigError(f"vqlcmd.data.shards: shard folder {shards} does not exist (make it with vqlcmd-tokenize)")
    tok = repo_path(data.tokenizer)
    if tok is not None and not tok.exists():
        raise ConfigError(f"vqlcmd.data.tokenizer: folder {tok} does not exist")
    return shards, tok


@dataclass
class DataSource:
    """What the trainer reads, whichever ``data.source``: the data's header (a ``TokenShardDataset``'s keys),
    how errors name it, the tokenizer folder, and ``loader(micro, rank=, world_size=, seed=)``."""
    header: dict
    where: str  # "the shards in X" / "the images under X"
    tokenizer_dir: Optional[Path]
    loader: Callable
    dataset: Any = None  # the TokenShardDataset of source "shards"


def check_data_paths(data: DataSection) -> None:
    """Path errors, reported before any process group is set up."""
    if data.source == "images":
        _image_paths(data)
    elif data.dataset is None:
        resolve_shards(data, rank=0)


def _image_paths(data: DataSection) -> tuple[Path, Path]:
    images, tok = repo_path(data.images), repo_path(data.tokenizer)
    if not images.is_dir():
        raise ConfigError(f"vqlcmd.data.images: image folder {images} "
                          f"{'is a file, not a folder' if images.exists() else 'does not exist'}")
    if not tok.is_dir():
        raise ConfigError(f"vqlcmd.data.tokenizer: folder {tok} does not exist")
    return images, tok


def open_data(data: DataSection, rank: int, *, local_rank: int = 0, device=None, log=print,
              progress: bool = True) -> DataSource:
    """The run's data: token shards (``source: "shards"``, the default), or an image tree that the
    ``OnlineTokenLoader`` decodes (DALI), flips and encodes with the tokenizer on ``device`` every epoch."""
    if data.source == "images":
        return _open_images(data, device, log)
    from ..data.loader import ShardLoader
    from ..data.shards import TokenShardDataset

    shard_dir, tok_dir = resolve_shards(data, rank, log=log, progress=progress)
    # One full check (CRC, id ranges: a read of every shard) per node is enough: the ranks of a node
    # read the same files, and a failure on one rank stops all of them (the trainer's agree_on_setup).
    dataset = TokenShardDataset(shard_dir, verify=local_rank == 0)
    return DataSource(dataset.header, f"the shards in {shard_dir}", tok_dir,
                      lambda micro, **kw: ShardLoader(dataset, micro, **kw), dataset)


def _open_images(data: DataSection, device, log) -> DataSource:
    from ..data.images import list_images
    from ..data.online import OnlineTokenLoader
    from ..tokenizer import load_tokenizer

    root, tok_dir = _image_paths(data)
    tokenizer = load_tokenizer(tok_dir, device=device or "cpu")
    images = list_images(root, check=data.check_images)  # (warns of the files it skips, by name)

    def loader(micro, **kw):
        return OnlineTokenLoader(images, tokenizer, micro, flip=data.flip, backend=data.image_backend,
                                 device=tokenizer.device, num_threads=data.decode_threads, **kw)

    header = loader(1).header  # (no image is read before iterating)
    skipped = f", {len(images.skipped)} unreadable skipped (e.g. {images.skipped[0][0]})" if images.skipped else ""
    log(f"data: {len(images)} images under {root} ({images.num_classes} classes{skipped}), encoded every epoch by "
        f"{tok_dir} on {tokenizer.device}{', random flips' if data.flip else ''}")
    return DataSource(header, f"the images under {root} (encoded by tokenizer {tok_dir})", tok_dir, loader)
