"""The package's shape (issue 46): imports point one way, methods are registered rather than branched on,
and files stay small enough to read in one sitting."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vqlcmd"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, module: str, modules=None) -> set:
    """Every module of the package that ``path`` imports, at module level or inside a function alike (a
    function-level import closes a circle as surely, only later). ``from pkg import sub`` of a submodule is an
    import of ``sub``, not of ``pkg``'s own code (``modules``: the package's module names, when known)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names]
            if modules is None:
                names = [target] + subs
            else:
                names = [n if n in modules else target for n in subs]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        found.update(n for n in names if n == "vqlcmd" or n.startswith("vqlcmd."))
    return found


def import_graph() -> dict:
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    extensions = {"vqlcmd._C"}  # the compiled extension: imports nothing of the package
    graph = {name: set() for name in extensions}
    modules_and_extensions = set(modules) | extensions
    for name, path in modules.items():
        # an import of a package's name means its __init__; of a name inside a module, that module
        graph[name] = {t for t in _imports(path, name, modules_and_extensions)
                       if t in modules_and_extensions and t != name}
    return graph


def find_cycle(graph: dict):
    """One import circle as a list of modules, or None. Importing ``a.b`` runs ``a/__init__`` first, but that
    edge is Python's, not the code's: only the written imports count."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circle_in_the_package():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_circle_finder_finds_a_planted_circle():
    graph = {"vqlcmd.a": {"vqlcmd.b"}, "vqlcmd.b": {"vqlcmd.c"}, "vqlcmd.c": {"vqlcmd.a"}, "vqlcmd.d": set()}
    assert find_cycle(graph) == ["vqlcmd.a", "vqlcmd.b", "vqlcmd.c", "vqlcmd.a"]
    assert find_cycle({"vqlcmd.a": {"vqlcmd.b"}, "vqlcmd.b": set()}) is None


def test_function_level_imports_count(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("def f():\n    from ..pipeline import X\n    import vqlcmd.ops\n")
    assert _imports(src, "vqlcmd.engine.mod") == {"vqlcmd.pipeline", "vqlcmd.pipeline.X", "vqlcmd.ops"}


def test_the_config_schema_imports_nothing_of_the_package():
    """engine/config.py is the experiment's whole schema, read in one place: standard library only, at module
    level or inside a function, so nothing of the package runs when it loads."""
    path = PACKAGE / "engine" / "config.py"
    assert _imports(path, "vqlcmd.engine.config") == set()
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"line {node.lineno}: a relative import"
            tops.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            tops.update(a.name.split(".")[0] for a in node.names)
    assert tops <= stdlib, f"not the standard library: {sorted(tops - stdlib)}"


def test_the_config_schema_loads_alone():
    """Importing it (which runs vqlcmd/ and vqlcmd/engine/'s __init__ first) loads no other module of the
    package, nor torch: the lower layers import their names from it, so those files must stay light too."""
    code = ("import sys, vqlcmd.engine.config; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('vqlcmd.', 'torch.'))))")
    run = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split("\n")[0] == "['vqlcmd.engine', 'vqlcmd.engine.config']", run.stdout


def _method_comparisons(tree) -> list:
    """Lines that compare something called ``method`` with ``==`` / ``!=`` / ``in`` (a string branch on the
    method's name)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any((isinstance(s, ast.Attribute) and s.attr == "method") or
                        (isinstance(s, ast.Name) and s.id == "method") or
                        (isinstance(s, ast.Call) and isinstance(s.func, ast.Attribute) and s.func.attr == "get"
                         and s.args and isinstance(s.args[0], ast.Constant) and s.args[0].value == "method")
                        for s in sides)
            strings = any(isinstance(s, ast.Constant) and isinstance(s.value, str) for s in sides)
            if named and strings:
                lines.append(node.lineno)
    return lines


def test_no_method_name_branches_outside_the_registry():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        if "methods" in path.relative_to(PACKAGE).parts:
            continue
        lines = _method_comparisons(ast.parse(path.read_text()))
        if lines:
            found[str(path.relative_to(PACKAGE))] = lines
    assert not found, f"branches on a method's name outside vqlcmd/methods/: {found}"


@pytest.mark.parametrize("src", ['if cfg.method == "maskgit": pass', 'x = config.get("method") == "maskgit"',
                                 'if method != "vqlcmd": pass'])
def test_the_branch_finder_finds_planted_branches(src):
    assert _method_comparisons(ast.parse(src)) == [1]


def test_files_stay_small():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert sizes["engine/trainer.py"] <= 250
    assert not {k: n for k, n in sizes.items() if n > 500}
