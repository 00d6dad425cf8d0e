"""Inception-v3 features for FID, Inception Score and precision/recall, from a local weights file.

The network is torch-fidelity's port of the TensorFlow FID Inception (the graph the reference FID
numbers, and the ADM evaluation suite, use), including its TF-compatible resize to 299x299. Its
weights cannot be downloaded here: give the file ``weights-inception-2015-12-05-6726825d.pth``
(torch-fidelity's release asset) by path or through ``$VQLCMD_INCEPTION_WEIGHTS``.

The file is checked against its known SHA-256 and then loaded weights-only, here: torch-fidelity's own
loader reads a given file with ``torch.load(weights_only=False)``, which runs whatever the file's pickle
asks for. Its feature extractor is built around the already-loaded state dict, so it reads nothing itself.

Features: ``pool`` (N, 2048), the pool_3 layer used for FID and precision/recall, and ``logits``
(N, 1008), the unbiased logits used for the Inception Score. The metric math is ``stats.py``.
"""
from __future__ import annotations

import hashlib
import os
import pickle
import threading
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np
import torch

WEIGHTS_FILE = "weights-inception-2015-12-05-6726825d.pth"
ENV = "VQLCMD_INCEPTION_WEIGHTS"
# The release asset's SHA-256, as recorded by users of torch-fidelity; its first eight digits are the name's
# "6726825d" (torch hub's naming convention for a file's hash prefix). torch-fidelity itself checks no hash.
WEIGHTS_SHA256 = "6726825d0af5f729cebd5821db510b11b1cfad8faad88a03f1befd49fb9129b2"
FEATURES = ["2048", "logits_unbiased"]


class UnsafeWeightsError(ValueError):
    """The weights file asks for more than tensors and containers (a pickled call); nothing from it ran."""


def inception_weights_path(path: Optional[Union[str, Path]] = None) -> Path:
    """The weights file to use: ``path``, else ``$VQLCMD_INCEPTION_WEIGHTS``; errors name what is missing."""
    given = path if path is not None else os.environ.get(ENV)
    if not given:
        raise FileNotFoundError(
            f"no Inception weights given: pass --inception-weights PATH (or set ${ENV}) to a local copy of "
            f"torch-fidelity's {WEIGHTS_FILE}; nothing is downloaded at run time")
    p = Path(given).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"Inception weights file {p} does not exist (expected torch-fidelity's "
                                f"{WEIGHTS_FILE}, the TF FID Inception converted to PyTorch)")
    return p


class InceptionFeatures:
    """Callable: uint8 images (N, 3, H, W) (or (N, 1, H, W), repeated to RGB) -> dict(pool, logits) numpy."""

    def __init__(self, weights: Optional[Union[str, Path]] = None, device: Union[str, torch.device] = "cpu",
                 batch_size: int = 64, verify: bool = True):
        """``verify``: check the file's SHA-256 against torch-fidelity's release (``WEIGHTS_SHA256``); False
        for weights of one's own in the same format (still loaded weights-only)."""
        path = inception_weights_path(weights)
        if verify:
            check_weights_hash(path)
        self.net = feature_extractor(load_inception_state(path), source=path)
        self.device = torch.device(device)
        self.net.to(self.device)
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, images: Union[torch.Tensor, np.ndarray, Iterable]) -> dict:
        pools, logits = [], []
        for batch in _batches(images, self.batch_size):
            pool, logit = self.net(batch.to(self.device))
            pools.append(pool.double().cpu().numpy())
            logits.append(logit.double().cpu().numpy())
        if not pools:
            raise ValueError("no images to compute Inception features of")
        return {"pool": np.concatenate(pools), "logits": np.concatenate(logits)}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_weights_hash(path: Path) -> None:
    got = file_sha256(path)
    if got != WEIGHTS_SHA256:
        raise ValueError(f"{path}: SHA-256 {got} is not that of torch-fidelity's {WEIGHTS_FILE} ({WEIGHTS_SHA256}): "
                         "another or a damaged file, and FID against published numbers needs that one; for Inception "
                         "weights of your own in its format, pass --any-inception-weights (verify=False)")


def load_inception_state(path: Path) -> dict:
    """The weights file's state dict, loaded weights-only (tensors and containers; no pickled call runs)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message names the refused global, then suggests allowlisting it: only the global is kept
        found = [ln.strip() for ln in str(exc).splitlines() if "Unsupported global" in ln]
        if not found:  # no pickle, or opcodes a weights file never holds: refused all the same, nothing ran
            raise ValueError(f"{path} is not torch-fidelity's Inception-v3 ({WEIGHTS_FILE}): a weights-only load "
                             f"refused it ({str(exc).strip().splitlines()[-1][:200]})") from None
        raise UnsafeWeightsError(f"{path}: refused to load, it is not a plain weights file "
                                 f"({found[0].split(' was not')[0]}); nothing from it was run. Use torch-fidelity's "
                                 f"{WEIGHTS_FILE}") from None
    except (RuntimeError, ValueError, EOFError, OSError) as exc:  # not a torch.save file at all
        raise ValueError(f"{path} is not torch-fidelity's Inception-v3 ({WEIGHTS_FILE}): {exc}") from exc
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path} is not torch-fidelity's Inception-v3 ({WEIGHTS_FILE}): it holds a "
                         f"{type(state).__name__}, not a state dict of tensors")
    return state


_building = threading.Lock()


def feature_extractor(state: dict, source="the state dict"):
    """torch-fidelity's ``FeatureExtractorInceptionV3`` (the TF-compatible FID Inception) with ``state`` as its
    weights. Its constructor loads weights itself, from a path with ``weights_only=False`` or from its URL;
    the URL fetch (``load_state_dict_from_url``, looked up in its module) is swapped for one that hands over
    ``state``, so nothing is read or downloaded."""
    try:
        import torch_fidelity.feature_extractor_inceptionv3 as fe
    except ImportError as exc:
        raise ImportError("Inception metrics need torch-fidelity: pip install torch-fidelity") from exc
    with _building:
        fetch = fe.load_state_dict_from_url
        fe.load_state_dict_from_url = lambda url, **kw: state
        try:
            return fe.FeatureExtractorInceptionV3("inception-v3-compat", FEATURES, verbose=False)
        except RuntimeError as exc:  # load_state_dict: other keys or shapes
            raise ValueError(f"{source} is not torch-fidelity's Inception-v3 ({WEIGHTS_FILE}): {exc}") from exc
        finally:
            fe.load_state_dict_from_url = fetch


def as_uint8_nchw(images: Union[torch.Tensor, np.ndarray]) -> torch.Tensor:
    """uint8 NHWC (the ADM .npz layout) or NCHW, 1 or 3 channels -> uint8 (N, 3, H, W)."""
    x = torch.as_tensor(images)
    if x.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 (0..255), got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"images must be 4-D (N, H, W, C) or (N, C, H, W), got {tuple(x.shape)}")
    if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
        x = x.permute(0, 3, 1, 2)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    if x.shape[1] != 3:
        raise ValueError(f"images must have 1 or 3 channels, got shape {tuple(x.shape)}")
    return x.contiguous()


def _batches(images, batch_size: int):
    if isinstance(images, (torch.Tensor, np.ndarray)):
        x = as_uint8_nchw(images)
        for i in range(0, x.shape[0], batch_size):
            yield x[i:i + batch_size]
    else:
        for batch in images:
            yield as_uint8_nchw(batch)


def inception_metrics(fake: dict, ref: dict, *, k: int = 3, splits: int = 10, metrics=("fid", "is", "pr")) -> dict:
    """FID / IS / precision-recall of ``fake`` features against ``ref``.

    ``fake``: dict(pool, logits) from ``InceptionFeatures``. ``ref``: dict with ``pool`` features, or
    with ``mu`` and ``sigma`` only (precomputed statistics, e.g. an ADM reference batch's; then no
    precision/recall, which needs the reference's features).
    """
    from .stats import feature_statistics, frechet_distance, inception_score, precision_recall

    out = {"num_samples": int(len(fake["pool"]))}
    if "fid" in metrics:
        mu_r, sigma_r = (ref["mu"], ref["sigma"]) if "mu" in ref else feature_statistics(ref["pool"])
        out["fid"] = frechet_distance(*feature_statistics(fake["pool"]), mu_r, sigma_r)
    if "is" in metrics:
        out["is"], out["is_std"] = inception_score(fake["logits"], splits=min(splits, len(fake["logits"])))
    if "pr" in metrics:
        if "pool" not in ref:
            raise ValueError("precision/recall need the reference's features, not only its mu/sigma statistics "
                             "(give the reference images, or statistics saved with --save-ref)")
        out.update(precision_recall(ref["pool"], fake["pool"], k=k))
    return out
