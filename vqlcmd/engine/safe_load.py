"""Loading a run folder's checkpoint files without running code from them.

DeepSpeed (0.19) reads every file of a ZeRO 0/1/2 checkpoint through one method,
``TorchCheckpointEngine.load``: the model states (``mp_rank_XX_model_states.pt``, read by the
``SDLoader`` in ``_load_checkpoint``, which at ZeRO 0 also holds the optimizer and the client state) and
the ZeRO optimizer partitions (``*_optim_states.pt``, read by ``_get_all_zero_checkpoint_state_dicts``).
That method calls ``torch.load(weights_only=False)``, so a malicious file in a shared or copied run
folder runs its pickle's calls on resume. ``inert_deepspeed_loads`` replaces that one method, for the
duration of the ``with``, by a weights-only load.

Why ``weights_only=True`` with an allowlist, not ``tokenizer.inert_load``'s placeholders: DeepSpeed uses
what it loads. The ZeRO partitions hold a ``LossScaler`` object (whose ``cur_scale`` the optimizer reads
back), ``ZeroStageEnum(2)`` (an enum rebuilt by a call, which the inert unpickler refuses) and
``fragment_address`` dataclasses; placeholders would load but break the resume. Those classes are plain
data holders whose construction runs nothing but attribute stores, so they are allowed by name; every
other global (``os.system``, ``builtins.exec``, any class) is refused by torch's weights-only unpickler,
and the refusal names the file. The universal-checkpoint and ZeRO-3 paths (``torch.load`` elsewhere in
DeepSpeed) are not patched: the trainer uses neither.
"""
from __future__ import annotations

import contextlib
import pickle
import re
import threading
from pathlib import Path
from typing import Union

import torch


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asks for something a weights-only load does not allow; nothing from it ran."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: refused to load, it is not a plain weights/optimizer file ({reason}); nothing "
                         "from it was run. Was the run folder copied from elsewhere or shared? Resume only from "
                         "checkpoints this engine wrote")
        self.path = str(path)


def deepspeed_checkpoint_globals() -> list:
    """The non-torch globals that DeepSpeed's own ZeRO 0/1/2 checkpoints pickle (seen in bf16 and fp32 files
    of ZeRO stages 0, 1 and 2), each a data holder: the loss scalers, the ZeRO stage enum, a fragment's
    (numel, start)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path: Union[str, Path], map_location=None, extra_globals=()):
    """``torch.load(weights_only=True)`` of ``path`` with ``extra_globals`` allowed; any refusal or
    unreadable pickle is an ``UnsafeCheckpointError`` naming the file."""
    try:
        with torch.serialization.safe_globals(list(extra_globals)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:  # torch's "Weights only load failed ... Unsupported global: X"
        raise UnsafeCheckpointError(path, _reason(exc)) from None


def _reason(exc: BaseException) -> str:
    text = str(exc)
    # torch's message is a page that ends by suggesting to allowlist the global: only the global is kept
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it asks for {found.group(1)}, which a weights-only load does not allow"
    return text.strip().splitlines()[0][:300] if text.strip() else type(exc).__name__


def load_rank_state(path: Union[str, Path]) -> dict:
    """A checkpoint's ``rank_XXXXX_state.pt`` (the data loader's position and the RNG states; tensors,
    dicts and numbers only) loaded weights-only; a file that asks for more is refused by name."""
    return weights_only_load(path, map_location="cpu")


_lock = threading.Lock()
_depth = 0
_original = None


@contextlib.contextmanager
def inert_deepspeed_loads(engine=None):
    """While inside, DeepSpeed's checkpoint files load weights-only (see the module docstring); a file that
    would run code raises ``UnsafeCheckpointError`` naming it. ``engine``: a ``DeepSpeedEngine`` whose
    ``checkpoint_engine`` is checked to be the patched ``TorchCheckpointEngine`` (a configured Nebula or
    decoupled writer reads files through other code, which this does not cover)."""
    global _depth, _original
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    if engine is not None:
        used = getattr(engine, "checkpoint_engine", None)
        if used is not None and not isinstance(used, TorchCheckpointEngine):
            raise TypeError(f"the engine reads checkpoints through {type(used).__name__}, not DeepSpeed's "
                            "TorchCheckpointEngine that inert_deepspeed_loads patches; drop the checkpoint "
                            "writer setting from the DeepSpeed config")
    allowed = deepspeed_checkpoint_globals()

    def load(self, path: str, map_location=None):
        return weights_only_load(path, map_location=map_location, extra_globals=allowed)

    with _lock:  # nested or concurrent uses: the first one in patches, the last one out restores
        if _depth == 0:
            _original = TorchCheckpointEngine.load
            TorchCheckpointEngine.load = load
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                TorchCheckpointEngine.load = _original
                _original = None
