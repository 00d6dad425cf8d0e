"""A pipeline folder's files besides the weights: the tokenizer it carries (``tokenizer/``), file modes,
and the manifest that lets a load verify every file (``vqlcmd.engine.manifest``)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

WEIGHTS, CONFIG = "model.safetensors", "config.json"
TOKENIZER_DIR = "tokenizer"  # the tokenizer's subfolder in a pipeline folder


def save_tokenizer(tokenizer, tokenizer_ref: dict, folder: Path) -> dict:
    """The tokenizer saved inside the pipeline folder (``tokenizer/``, as diffusers pipelines keep their
    parts) and named relative to it, so that a copied or moved folder still decodes; returns the reference
    for config.json. A folder that already holds this tokenizer keeps it (the trainer re-exports the
    pipeline with every checkpoint)."""
    ref = dict(tokenizer_ref)
    model = getattr(tokenizer, "model", None)
    if not hasattr(model, "save_pretrained"):  # no tokenizer object: the reference as it was
        return ref
    ref["path"] = TOKENIZER_DIR
    ref["identifier"] = getattr(tokenizer, "identifier", None) or ref.get("identifier")
    try:
        had = (json.loads((folder / CONFIG).read_text()).get("tokenizer") or {})
    except (OSError, ValueError):
        had = {}
    if (had.get("path") == TOKENIZER_DIR and had.get("identifier") == ref["identifier"]
            and (folder / TOKENIZER_DIR / "config.json").is_file()):
        return ref
    staging, old = folder / (TOKENIZER_DIR + ".tmp"), folder / (TOKENIZER_DIR + ".old")
    for leftover in (staging, old):
        if leftover.exists():
            shutil.rmtree(leftover)
    model.save_pretrained(str(staging))
    for f in staging.rglob("*"):
        if f.is_file():
            _user_mode(f)
    if (folder / TOKENIZER_DIR).exists():
        os.replace(folder / TOKENIZER_DIR, old)
    os.replace(staging, folder / TOKENIZER_DIR)
    if old.exists():
        shutil.rmtree(old)
    return ref



def _user_mode(path: Path) -> None:
    """The mode a plain ``open`` would have given the file (0666 less the umask): files written through a
    library that creates them private (0600) are readable by whom the user's other files are."""
    try:  # Linux: read without changing it (os.umask can only be read by setting it, racing other threads)
        umask = int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                         if line.startswith("Umask:")), 8)
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _load_tokenizer(folder: Path, ref: dict, device):
    from .tokenizer import load_tokenizer

    path = Path(ref["path"])
    if not path.is_absolute():
        path = folder / path
    if not path.exists():
        raise FileNotFoundError(f"tokenizer folder {path} named by {folder / CONFIG} is missing: restore it, or "
                                "point tokenizer.path there at its new place (from Python, tokens alone need none: "
                                "load_tokenizer=False, output_type='tokens')")
    tok = load_tokenizer(path)
    if ref.get("identifier") and getattr(tok, "identifier", None) not in (None, ref["identifier"]):
        raise ValueError(f"tokenizer at {path} has identifier {tok.identifier}, but the model was trained on "
                         f"tokens of {ref['identifier']}")
    return tok.to(device) if hasattr(tok, "to") else tok
