"""The package's import structure, read from the sources: no import cycles between modules of
specdec at import time, and no module importing another module's private (underscore) name."""
from __future__ import annotations

import ast
import pathlib
import sys

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "specdec"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources():
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def _resolve(mod: str, is_pkg: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _top_level_imports(mod: str, path: pathlib.Path, modules):
    """(imported module, names) of the imports that run when the module is imported: module level,
    including under if / try, excluding function bodies and ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                out.extend((a.name, []) for a in node.names if a.name.startswith("specdec"))
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(mod, is_pkg, node)
                if target.startswith("specdec"):
                    names = [a.name for a in node.names]
                    # ``from specdec.pkg import sub`` imports the submodule (the compiled
                    # extension ``_C`` is one too), not only the package
                    subs = [n for n in names if f"{target}.{n}" in modules or n == "_C"]
                    rest = [n for n in names if n not in subs]
                    if rest:
                        out.append((target, rest))
                    out.extend((f"{target}.{n}", []) for n in subs)
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if "TYPE_CHECKING" not in test:
                    visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)
                for h in node.handlers:
                    visit(h.body)
                visit(node.orelse)
                visit(node.finalbody)
    visit(tree.body)
    return out


def _owner(name: str, modules) -> str:
    """The specdec module (or package) a dotted import target lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def test_no_import_cycles():
    modules = _sources()
    graph = {m: set() for m in modules}
    for mod, path in modules.items():
        for target, _ in _top_level_imports(mod, path, modules):
            if target.endswith("._C"):  # the compiled extension imports nothing of the package
                continue
            owner = _owner(target, modules)
            if owner and owner != mod:
                graph[mod].add(owner)
                # importing a.b.c runs a and a.b first
                parts = owner.split(".")
                for i in range(1, len(parts)):
                    parent = ".".join(parts[:i])
                    if parent in modules and parent != mod and not mod.startswith(parent + "."):
                        graph[mod].add(parent)
    state, stack, cycles = {}, [], []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                dfs(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            dfs(m)
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_no_private_names_across_modules():
    modules = _sources()
    bad = set()
    for mod, path in modules.items():
        for target, names in _top_level_imports(mod, path, modules) + _function_imports(mod, path):
            owner = _owner(target, modules)
            if owner == mod:
                continue
            for n in names:
                private = n.startswith("_") and not n.startswith("__") and n != "_C"  # _C: the extension
                if private and f"{target}.{n}" not in modules:
                    bad.add(f"{mod} imports {n} from {target}")
    assert not bad, "\n".join(sorted(bad))


def _function_imports(mod: str, path: pathlib.Path):
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = _resolve(mod, is_pkg, node)
            if target.startswith("specdec"):
                out.append((target, [a.name for a in node.names]))
    return out


@pytest.mark.parametrize("rule", ["cycles", "private"])
def test_checks_catch_what_they_look_for(tmp_path, monkeypatch, rule):
    """The two checks above, on a tiny package that breaks each rule."""
    pkg = tmp_path / "specdec"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    if rule == "cycles":
        (pkg / "a.py").write_text("from specdec.b import f\n")
        (pkg / "b.py").write_text("import specdec.a\n\ndef f():\n    pass\n")
        monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
        with pytest.raises(AssertionError, match="import cycles"):
            test_no_import_cycles()
    else:
        (pkg / "a.py").write_text("def f():\n    from specdec.b import _hidden\n")
        (pkg / "b.py").write_text("_hidden = 1\n")
        monkeypatch.setattr(sys.modules[__name__], "PKG", pkg)
        with pytest.raises(AssertionError, match="imports _hidden"):
            test_no_private_names_across_modules()
