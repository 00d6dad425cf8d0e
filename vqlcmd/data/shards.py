"""Token shards: one self-describing, memory-mappable file per shard (``*.vqtok``).

Layout (little endian)::

    b"VQLCMDT1"                 8 bytes, magic and format version
    header length L             uint64
    JSON header                 L bytes, padded with spaces so the arrays start 64-byte aligned
    tokens                      uint16 (count, h*w), row-major
    labels                      int32  (count,), starting 64-byte aligned

One file rather than ``.npy`` + ``.json`` pairs so that a shard is written atomically (temp file,
then rename) and can never be half old, half new. The header carries the tokenizer id, codebook
size, grid and class names, which every shard of a data set must share, a CRC-32 of the arrays and one
of the header itself (shards written before the header's CRC existed lack it and are read as before).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAGIC = b"VQLCMDT1"
SUFFIX = ".vqtok"
_ALIGN = 64
REQUIRED_KEYS = ("codebook_size", "grid", "tokenizer_id", "num_classes", "class_names")
# keys every shard of one data set must agree on
SHARED_KEYS = REQUIRED_KEYS
_MAX_HEADER = 1 << 24


class ShardError(ValueError):
    """A token shard (or a set of shards) that cannot be used; the message names the file and the problem."""


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_numpy(x, what: str, path) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    x = np.asarray(x)
    if x.dtype == np.bool_ or not np.issubdtype(x.dtype, np.integer):
        raise ShardError(f"token shard {path}: {what} must be integers, got dtype {x.dtype}")
    return x


def check_header(header: dict, path) -> dict:
    if not isinstance(header, dict):
        raise ShardError(f"token shard {path}: header must be a JSON object, got {type(header).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in header]
    if missing:
        raise ShardError(f"token shard {path}: header lacks {missing} (needs {list(REQUIRED_KEYS)})")
    h = dict(header)
    grid, names = h["grid"], h["class_names"]
    if not isinstance(grid, (list, tuple)) or len(grid) != 2 or not all(_is_int(v) and v >= 1 for v in grid):
        raise ShardError(f"token shard {path}: grid must be [h, w] of positive ints, got {grid!r}")
    h["grid"] = [int(v) for v in grid]
    for key in ("codebook_size", "num_classes"):
        if not _is_int(h[key]) or h[key] < 0:
            raise ShardError(f"token shard {path}: {key} must be a non-negative int, got {h[key]!r}")
    if not 1 <= h["codebook_size"] <= 65536:
        raise ShardError(f"token shard {path}: codebook_size {h['codebook_size']} does not fit uint16 ids")
    if not isinstance(names, (list, tuple)) or not all(isinstance(c, str) for c in names):
        raise ShardError(f"token shard {path}: class_names must be a list of strings, got {names!r}")
    h["class_names"] = list(names)
    if len(h["class_names"]) != h["num_classes"]:
        raise ShardError(f"token shard {path}: {len(h['class_names'])} class names for "
                         f"num_classes={h['num_classes']}")
    h.setdefault("flipped", False)
    return h


def _is_int(v) -> bool:
    # JSON's 2.7 or "2" or true taken as an int would be read as another value, silently
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def write_shard(path, tokens, labels, header: dict) -> Path:
    """Writes ``tokens`` (N, h, w) or (N, h*w) and ``labels`` (N,) to ``path`` (ending in .vqtok) atomically.

    ``header`` needs codebook_size, grid [h, w], tokenizer_id, num_classes and class_names; any other
    JSON-serialisable keys are kept. Unconditional data: num_classes 0, class_names [], labels all 0
    (the null class). Ids and labels are range-checked here so a bad shard is never written.
    """
    path = Path(path)
    if path.suffix != SUFFIX:
        raise ValueError(f"token shard path {path} must end in {SUFFIX} (TokenShardDataset reads *{SUFFIX})")
    h = check_header(header, path)
    toks = _as_numpy(tokens, "tokens", path)
    labs = _as_numpy(labels, "labels", path)
    m = h["grid"][0] * h["grid"][1]
    if toks.ndim == 3 and list(toks.shape[1:]) == h["grid"]:
        toks = toks.reshape(len(toks), m)
    if toks.ndim != 2 or toks.shape[1] != m:
        raise ShardError(f"token shard {path}: tokens must be (N, {h['grid'][0]}, {h['grid'][1]}) or (N, {m}), "
                         f"got {toks.shape}")
    if labs.shape != (len(toks),):
        raise ShardError(f"token shard {path}: labels must be ({len(toks)},), got {labs.shape}")
    _check_ranges(toks, labs, h, path)
    toks = np.ascontiguousarray(toks, dtype="<u2")
    labs = np.ascontiguousarray(labs, dtype="<i4")
    h.update(format="vqlcmd-token-shard", count=len(toks), tokens_dtype="uint16", labels_dtype="int32",
             crc32=zlib.crc32(labs.tobytes(), zlib.crc32(toks.tobytes())))
    h["header_crc32"] = _header_crc(h)
    body = json.dumps(h, sort_keys=True).encode()
    body += b" " * (_align(16 + len(body)) - 16 - len(body))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(body)) + body)
        f.write(toks.tobytes())
        f.write(b"\0" * (_align(toks.nbytes) - toks.nbytes))
        f.write(labs.tobytes())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)  # atomic: readers see the old file or the whole new one
    return path


def _header_crc(header: dict) -> int:
    # The arrays' CRC cannot catch a flipped bit in codebook_size or a class name, and a single shard has
    # no other shard to be compared with; the canonical JSON (what write_shard writes) is what is summed.
    return zlib.crc32(json.dumps({k: v for k, v in header.items() if k != "header_crc32"}, sort_keys=True).encode())


def _check_ranges(toks: np.ndarray, labs: np.ndarray, h: dict, path) -> None:
    if toks.size:
        lo, hi = int(toks.min()), int(toks.max())
        if lo < 0 or hi >= h["codebook_size"]:
            bad = int(np.argmax((toks < 0).any(1) | (toks >= h["codebook_size"]).any(1)))
            raise ShardError(f"token shard {path}: token ids must lie in [0, {h['codebook_size']}), "
                             f"found min {lo}, max {hi} (first bad row {bad})")
    if labs.size:
        lo, hi = int(labs.min()), int(labs.max())
        top = max(h["num_classes"], 1)  # unconditional data stores the null class 0
        if lo < 0 or hi >= top:
            raise ShardError(f"token shard {path}: labels must lie in [0, {top}) for num_classes="
                             f"{h['num_classes']}, found min {lo}, max {hi}")


@dataclass
class Shard:
    path: Path
    header: dict
    tokens: np.ndarray  # (count, M) uint16, memory-mapped
    labels: np.ndarray  # (count,) int32, memory-mapped

    def __len__(self) -> int:
        return len(self.labels)


def open_shard(path, *, verify: bool = True) -> Shard:
    """Opens and validates one shard. ``verify`` also checks the CRC and the id and label ranges
    (one pass over the data); without it only the header and file size are checked."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(16)
        if len(head) < 16 or head[:8] != MAGIC:
            raise ShardError(f"token shard {path}: not a token shard (bad magic {head[:8]!r}, expected {MAGIC!r})")
        (n,) = struct.unpack("<Q", head[8:])
        if n > _MAX_HEADER or 16 + n > size:
            raise ShardError(f"token shard {path}: header length {n} does not fit the file ({size} bytes); "
                             "truncated or corrupt")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ShardError(f"token shard {path}: header is not valid JSON ({e})") from None
    if isinstance(header, dict) and "header_crc32" in header and header["header_crc32"] != _header_crc(header):
        raise ShardError(f"token shard {path}: header checksum mismatch (file corrupt: CRC-32 "
                         f"{_header_crc(header):#010x}, header says {header['header_crc32']!r})")
    h = check_header(header, path)
    if h.get("format") != "vqlcmd-token-shard" or h.get("tokens_dtype") != "uint16" \
            or h.get("labels_dtype") != "int32":
        raise ShardError(f"token shard {path}: unsupported format/dtypes {h.get('format')}, "
                         f"{h.get('tokens_dtype')}, {h.get('labels_dtype')} (expected uint16 tokens, int32 labels)")
    count, m = h.get("count"), h["grid"][0] * h["grid"][1]
    if not _is_int(count) or count < 0:
        raise ShardError(f"token shard {path}: header count must be a non-negative int, got {count!r}")
    tok_off = 16 + n
    lab_off = tok_off + _align(count * m * 2)
    expected = lab_off + count * 4
    if size != expected:
        what = "truncated" if size < expected else "has trailing bytes"
        raise ShardError(f"token shard {path}: file {what}: {size} bytes, expected {expected} for {count} "
                         f"samples of {m} tokens")
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=tok_off, shape=(count, m)) if count else \
        np.zeros((0, m), np.uint16)
    labels = np.memmap(path, dtype="<i4", mode="r", offset=lab_off, shape=(count,)) if count else \
        np.zeros((0,), np.int32)
    if verify:
        crc = zlib.crc32(memoryview(labels).cast("B"), zlib.crc32(memoryview(tokens).cast("B"))) if count else 0
        if count and crc != h.get("crc32"):
            raise ShardError(f"token shard {path}: checksum mismatch (file corrupt: CRC-32 {crc:#010x}, "
                             f"header says {h.get('crc32', 0):#010x})")
        _check_ranges(tokens, labels, h, path)
    return Shard(path, h, tokens, labels)


def list_shards(folder) -> list[Path]:
    folder = Path(folder)
    if folder.is_file():
        return [folder]
    if not folder.is_dir():
        raise FileNotFoundError(f"token shard folder {str(folder)!r} does not exist")
    files = sorted(p for p in folder.glob(f"*{SUFFIX}") if not p.name.startswith("."))
    if not files:
        raise FileNotFoundError(f"token shard folder {str(folder)!r} holds no *{SUFFIX} files "
                                "(make some with vqlcmd-tokenize)")
    return files


class TokenShardDataset:
    """All shards of a folder as one data set: ``ds[i] -> (tokens int64 (M,), label int64)``.

    Every shard is validated on opening, and all must agree on the tokenizer, codebook, grid and
    classes; the errors name the shard and the problem.
    """

    def __init__(self, folder, *, verify: bool = True):
        self.folder = Path(folder)
        self.shards = [open_shard(p, verify=verify) for p in list_shards(folder)]
        first = self.shards[0]
        for s in self.shards[1:]:
            for k in SHARED_KEYS:
                if s.header[k] != first.header[k]:
                    raise ShardError(f"token shard {s.path}: header mismatch on {k!r}: {s.header[k]!r}, but "
                                     f"{first.path.name} has {first.header[k]!r}")
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])
        self._check_one_tree()
        self.header = {k: first.header[k] for k in SHARED_KEYS}
        self.header.update(num_samples=int(self.offsets[-1]), seq_len=self.seq_len,
                           flipped=any(s.header.get("flipped", False) for s in self.shards),
                           shards=[s.path.name for s in self.shards])
        for k in ("image_size", "channels", "source", "files_sha256"):
            if k in first.header:
                self.header[k] = first.header[k]
        self._arrays = None

    def _check_one_tree(self) -> None:
        """Shards of one image tree: a tree tokenized again (say without --flip) left the other run's shards
        beside the new ones, which passed the checks above and trained on images no longer in the tree."""
        digests = {}
        for s in self.shards:  # (shards from before the digest was recorded lack it)
            if "files_sha256" in s.header:
                digests.setdefault(s.header["files_sha256"], s.path.name)
        if len(digests) > 1:
            (a, fa), (b, fb) = list(digests.items())[:2]
            raise ShardError(f"token shards in {self.folder} come from different image trees: {fa} lists files "
                             f"{a}, {fb} lists {b} (files_sha256); delete the stale ones or tokenize into an empty "
                             "folder")
        flipped = sum(len(s) for s in self.shards if s.header.get("flipped", False))
        if flipped and flipped != len(self) - flipped:
            raise ShardError(f"token shards in {self.folder}: {flipped} flipped samples for {len(self) - flipped} "
                             "unflipped; an interrupted --flip run? run vqlcmd-tokenize --flip again to finish it")

    @property
    def seq_len(self) -> int:
        g = self.shards[0].header["grid"]
        return g[0] * g[1]

    @property
    def codebook_size(self) -> int:
        return self.header["codebook_size"]

    @property
    def num_classes(self) -> int:
        return self.header["num_classes"]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int):
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} samples in {self.folder}")
        i %= n
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        j = i - int(self.offsets[s])
        sh = self.shards[s]
        return torch.from_numpy(sh.tokens[j].astype(np.int64)), torch.tensor(int(sh.labels[j]), dtype=torch.int64)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(tokens uint16 (N, M), labels int64 (N,)): the memory map itself for one shard, else one
        in-memory copy made on first use."""
        if self._arrays is None:
            if len(self.shards) == 1:
                s = self.shards[0]
                self._arrays = (s.tokens, np.asarray(s.labels, dtype=np.int64))
            else:
                self._arrays = (np.concatenate([s.tokens for s in self.shards]),
                                np.concatenate([s.labels for s in self.shards]).astype(np.int64))
        return self._arrays

    def gather(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch by index without concatenating shards: tokens (B, M) int64, labels (B,) int64."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"indices out of range [0, {len(self)}) for {self.folder}")
        if self._arrays is not None or len(self.shards) == 1:
            toks, labs = self.arrays()
            return torch.from_numpy(toks[idx].astype(np.int64)), torch.from_numpy(labs[idx])
        toks = np.empty((len(idx), self.seq_len), np.int64)
        labs = np.empty(len(idx), np.int64)
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        for s in np.unique(which):
            sel = which == s
            local = idx[sel] - self.offsets[s]
            toks[sel] = self.shards[s].tokens[local]
            labs[sel] = self.shards[s].labels[local]
        return torch.from_numpy(toks), torch.from_numpy(labs)
