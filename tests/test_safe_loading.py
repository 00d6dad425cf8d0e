"""No loader in the package or the scripts unpickles a file outside the allowed loaders below.

An AST walk of vqlcmd/, scripts/, benchmarks/ (and studies/ where present) finds every use of a loader that
can run code from a file: ``torch.load`` without a literal ``weights_only=True``, ``np.load`` with
``allow_pickle`` other than a literal False, any ``pickle`` / ``dill`` / ``joblib`` / ... loader, and any
widening of torch's weights-only allowlist. Names are followed through imports (``from torch import load as
L``), and a reference counts as a use (``partial(torch.load)``, a subclass of ``pickle.Unpickler``).
"""
import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREES = ("vqlcmd", "scripts", "benchmarks", "studies")

# (file, enclosing def/class) -> why the use there runs no code from the file
ALLOWED = {
    ("vqlcmd/tokenizer/inert_load.py", "InertUnpickler"):
        "the inert unpickler: built on pickle._Unpickler so that every opcode that can call goes through its checks",
    ("vqlcmd/tokenizer/inert_load.py", "inert_torch_load"):
        "weights_only=False only to hand torch.load the inert pickle module, which refuses every call",
    ("vqlcmd/engine/safe_load.py", "weights_only_load"):
        "widens the weights-only load by DeepSpeed's four data-holder classes (deepspeed_checkpoint_globals)",
}

# a use of these is always a finding (outside ALLOWED)
UNPICKLERS = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "pickle._Unpickler", "pickle._load", "pickle._loads",
    "_pickle.load", "_pickle.loads", "_pickle.Unpickler", "cPickle.load", "cPickle.loads",
    "dill.load", "dill.loads", "cloudpickle.load", "cloudpickle.loads", "joblib.load", "pandas.read_pickle",
    "shelve.open", "marshal.load", "marshal.loads", "numpy.lib.format.read_array",
    "torch.serialization.add_safe_globals", "torch.serialization.safe_globals", "torch.jit.load",
}
# these are findings unless called with the keyword set to this literal (or left out, where its default is
# safe: numpy's allow_pickle is False, while torch.load's weights_only default can be flipped by
# $TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD)
GUARDED = {"torch.load": ("weights_only", True, False), "torch.serialization.load": ("weights_only", True, False),
           "numpy.load": ("allow_pickle", False, True)}


class _Finder(ast.NodeVisitor):
    def __init__(self, rel: str):
        self.rel, self.aliases, self.scope, self.found, self.used = rel, {}, [], [], set()

    def visit_Import(self, node):
        for a in node.names:
            if a.asname:
                self.aliases[a.asname] = a.name
            else:
                self.aliases.setdefault(a.name.split(".")[0], a.name.split(".")[0])

    def visit_ImportFrom(self, node):
        for a in node.names:
            if node.module and node.level == 0:
                self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _dotted(self, node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if not isinstance(node, ast.Name):
            return None
        head = self.aliases.get(node.id, node.id)
        head = {"np": "numpy"}.get(head, head)  # (only through `import numpy as np`, which aliases resolve)
        return ".".join([head, *reversed(parts)])

    def _report(self, node, name, why):
        key = (self.rel, self.scope[0] if self.scope else "<module>")
        if key in ALLOWED:
            self.used.add(key)
            return
        self.found.append(f"{self.rel}:{node.lineno} ({'.'.join(self.scope) or 'module'}): {name} {why}")

    def visit_Call(self, node):
        name = self._dotted(node.func)
        if name in GUARDED:
            kw, want, may_omit = GUARDED[name]
            given = next((k.value for k in node.keywords if k.arg == kw), None)
            if not ((given is None and may_omit and not any(k.arg is None for k in node.keywords))
                    or (isinstance(given, ast.Constant) and given.value is want)):
                self._report(node, name, f"without a literal {kw}={want}")
            for arg in node.args:
                self.visit(arg)
            for k in node.keywords:
                self.visit(k.value)
            return
        self.generic_visit(node)

    def visit_Attribute(self, node):
        self._reference(node)

    def visit_Name(self, node):
        self._reference(node)

    def _reference(self, node):
        name = self._dotted(node)
        if name in UNPICKLERS:
            self._report(node, name, "(a loader that can run code from the file)")
        elif name in GUARDED:  # not called directly: its arguments cannot be checked
            self._report(node, name, "used other than in a direct call")
        elif isinstance(node, ast.Attribute):
            self.visit(node.value)


def find_unsafe_loads(root: Path, trees=TREES):
    """(findings, ALLOWED entries that matched) over the .py files under ``root``'s ``trees``."""
    found, used = [], set()
    for tree in trees:
        for path in sorted((root / tree).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            finder = _Finder(rel)
            finder.visit(ast.parse(path.read_text(), filename=rel))
            found += finder.found
            used |= finder.used
    return found, used


def test_no_loader_outside_the_allowed_ones_can_run_code_from_a_file():
    found, used = find_unsafe_loads(ROOT)
    assert not found, "loads that could run code from a file:\n" + "\n".join(found)
    assert used == set(ALLOWED), f"allowlist entries that match nothing any more: {set(ALLOWED) - used}"


BAD = """
import pickle as pk
import numpy as np
import torch
from functools import partial
from torch import load as tload
from pickle import Unpickler

def fine(p):
    torch.load(p, weights_only=True)
    np.load(p)
    np.load(p, allow_pickle=False)

def bad(p):
    torch.load(p)
    torch.load(p, weights_only=False)
    tload(p, weights_only=flag)
    np.load(p, allow_pickle=True)
    np.load(p, **options)
    pk.loads(p.read_bytes())
    partial(torch.load, map_location="cpu")

class Mine(Unpickler):
    pass
"""


def test_the_walk_finds_planted_loads(tmp_path):
    (tmp_path / "vqlcmd" / "sub").mkdir(parents=True)
    (tmp_path / "vqlcmd" / "sub" / "planted.py").write_text(textwrap.dedent(BAD))
    found, _ = find_unsafe_loads(tmp_path, trees=("vqlcmd",))
    lines = sorted(int(f.split(":")[1].split()[0]) for f in found)
    assert lines == [15, 16, 17, 18, 19, 20, 21, 23], found
    assert any("bad): torch.load without a literal weights_only=True" in f for f in found)
    assert any("numpy.load without a literal allow_pickle=False" in f for f in found)
    assert any("pickle.loads (a loader that can run code" in f for f in found)
    assert any("(Mine): pickle.Unpickler" in f or "(module): pickle.Unpickler" in f for f in found)


@pytest.mark.parametrize("entry", sorted(ALLOWED))
def test_each_allowed_loader_has_a_reason(entry):
    assert len(ALLOWED[entry]) > 20 and (ROOT / entry[0]).is_file()
