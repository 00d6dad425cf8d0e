"""Loads a ``torch.save`` file that pickles training objects next to its weights (a PyTorch Lightning
``.ckpt``: callbacks keyed by class, ``hparams``, optimizer states) without running code from it.

``torch.load(weights_only=True)`` refuses any global it does not know, and ``safe_globals`` stand-ins do
not help here: torch's weights-only unpickler only fills exact ``dict``/``list`` objects (SETITEMS/APPENDS),
so a dict subclass such as Lightning's ``AttributeDict`` cannot be rebuilt through a stand-in, and the
stand-ins would have to be named before the load. So this keeps torch's own reader (``torch.load`` with
its storage and tensor handling; only the pickle module is ours) and swaps in a restricted unpickler:

- a global torch's weights-only list allows (tensor rebuild functions, storages, dtypes, ``OrderedDict``,
  ...) resolves as in a weights-only load;
- any other global becomes an inert placeholder class named after it; nothing is imported;
- a placeholder may be *created* as pickle creates data (NEWOBJ: ``cls.__new__``, no ``__init__``) and
  filled (BUILD, SETITEMS, APPENDS store what they are given), but never *called* (REDUCE, or INST/OBJ with
  arguments): a call is how a pickle runs ``os.system`` and the like, so it is refused by name;
- REDUCE/NEWOBJ/BUILD/SETITEMS/APPENDS on anything else follow the weights-only unpickler's rules, and the
  extension registry opcodes (EXT1/2/4) are refused.
It is built on the pure-Python ``pickle._Unpickler`` so that every opcode that can reach a callable goes
through a method here; the C unpickler would resolve EXT codes from ``copyreg``'s cache unseen.
"""
from __future__ import annotations

import pickle
from collections import Counter, OrderedDict

import torch
from torch import _weights_only_unpickler


class RefusedGlobal(pickle.UnpicklingError):
    """The file asks to call or use ``name`` in a way that could run code; nothing was run."""

    def __init__(self, name: str, how: str):
        super().__init__(f"it would call {name} ({how}) while loading, which could run code from the file")
        self.name = name


class _PlaceholderMeta(type):
    def __call__(cls, *args, **kwargs):  # REDUCE and INST/OBJ with arguments: the named global would run
        raise RefusedGlobal(cls._global_name, "a call")


class Placeholder(metaclass=_PlaceholderMeta):
    """An inert object in place of an instance of ``_global_name``; keeps what the pickle gave it."""
    _global_name = "?"

    def __new__(cls, *args, **kwargs):  # NEWOBJ: cls.__new__(cls, *args), which never runs __init__
        self = object.__new__(cls)
        object.__setattr__(self, "_pickled", {"args": args, "kwargs": kwargs, "state": None, "items": [],
                                              "entries": {}})
        return self

    def __setstate__(self, state):
        self._pickled["state"] = state

    def __setitem__(self, key, value):
        self._pickled["entries"][key] = value

    def append(self, item):
        self._pickled["items"].append(item)

    def extend(self, items):
        self._pickled["items"].extend(items)

    def __repr__(self):
        return f"<placeholder for {self._global_name}>"


def _allowed() -> dict:
    return _weights_only_unpickler._get_allowed_globals()


class InertUnpickler(pickle._Unpickler):
    """See the module docstring. ``placeholders``: the globals that were replaced, by name."""
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.placeholders: dict[str, type] = {}
        self._allowed_ids = {id(v) for v in _allowed().values()}

    def find_class(self, module, name):
        if self.proto < 3 and self.fix_imports:  # names written by Python 2, as pickle maps them
            import _compat_pickle

            module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
            module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        full = f"{module}.{name}"
        allowed = _allowed()
        if full in allowed:
            return allowed[full]
        if full not in self.placeholders:
            self.placeholders[full] = _PlaceholderMeta(
                name.rpartition(".")[2] or "_", (Placeholder,),
                {"_global_name": full, "__module__": module, "__qualname__": name})
        return self.placeholders[full]

    def _is_allowed(self, obj) -> bool:
        return id(obj) in self._allowed_ids

    @staticmethod
    def _name(obj) -> str:
        if isinstance(obj, _PlaceholderMeta):
            return obj._global_name
        return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"

    def load_reduce(self):
        func = self.stack[-2]
        if not self._is_allowed(func):
            raise RefusedGlobal(self._name(func), "pickle REDUCE")
        super().load_reduce()
    dispatch[pickle.REDUCE[0]] = load_reduce

    def _check_new(self, cls, how):
        if not (isinstance(cls, _PlaceholderMeta) or self._is_allowed(cls)):
            raise RefusedGlobal(self._name(cls), how)

    def load_newobj(self):
        self._check_new(self.stack[-2], "pickle NEWOBJ")
        super().load_newobj()
    dispatch[pickle.NEWOBJ[0]] = load_newobj

    def load_newobj_ex(self):
        self._check_new(self.stack[-3], "pickle NEWOBJ_EX")
        super().load_newobj_ex()
    dispatch[pickle.NEWOBJ_EX[0]] = load_newobj_ex

    def _instantiate(self, klass, args):  # INST / OBJ: a placeholder with arguments refuses in its __call__
        self._check_new(klass, "pickle INST/OBJ")
        super()._instantiate(klass, args)

    def load_build(self):
        inst = self.stack[-2]
        if not (isinstance(inst, Placeholder) or type(inst) in (torch.Tensor, torch.nn.Parameter, OrderedDict)
                or self._is_allowed(type(inst))):
            raise RefusedGlobal(self._name(type(inst)), "pickle BUILD")
        super().load_build()
    dispatch[pickle.BUILD[0]] = load_build

    def _check_target(self, target, kinds, how):
        if not (isinstance(target, Placeholder) or type(target) in kinds):
            raise RefusedGlobal(self._name(type(target)), how)

    # the target of SETITEM/APPEND sits under its operands; that of SETITEMS/APPENDS/ADDITEMS under the MARK
    def load_setitem(self):
        self._check_target(self.stack[-3], (dict, OrderedDict, Counter), "pickle SETITEM")
        super().load_setitem()
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):
        self._check_target(self.metastack[-1][-1], (dict, OrderedDict, Counter), "pickle SETITEMS")
        super().load_setitems()
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_append(self):
        self._check_target(self.stack[-2], (list,), "pickle APPEND")
        super().load_append()
    dispatch[pickle.APPEND[0]] = load_append

    def load_appends(self):
        self._check_target(self.metastack[-1][-1], (list,), "pickle APPENDS")
        super().load_appends()
    dispatch[pickle.APPENDS[0]] = load_appends

    def load_additems(self):
        self._check_target(self.metastack[-1][-1], (set,), "pickle ADDITEMS")
        super().load_additems()
    dispatch[pickle.ADDITEMS[0]] = load_additems

    def _refuse_ext(self):
        raise RefusedGlobal("the copyreg extension registry", "pickle EXT")
    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = _refuse_ext
    del _op


class _PickleModule:
    """What ``torch.load(pickle_module=...)`` uses: ``Unpickler`` (subclassed by torch for storages) and
    ``load`` (the legacy format's header records)."""
    __name__ = "vqlcmd.inert_pickle"
    Unpickler = InertUnpickler

    @staticmethod
    def load(file, **kwargs):
        return InertUnpickler(file, **kwargs).load()


def inert_torch_load(path, map_location="cpu"):
    """``torch.load`` of ``path`` with every non-torch global an inert placeholder (see the module docstring).
    Raises ``RefusedGlobal`` (an ``UnpicklingError``) naming the global if the file would run code."""
    return torch.load(path, map_location=map_location, weights_only=False, pickle_module=_PickleModule)
