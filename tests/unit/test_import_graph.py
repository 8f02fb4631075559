"""No import cycles inside atorch, counting imports hidden inside functions.

A function-level import that closes a cycle works at run time but hides a layering mistake
(the entry point reaching into the dry runner that reaches back into the entry point). The
graph is read statically from every module's source: an edge A -> B for each `import` of an
atorch module B anywhere in A (type-checking-only imports excluded). Importing a submodule
implicitly runs its package's `__init__`; that is not counted as an edge, since package
`__init__` files re-export their submodules by design.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, List, Set

import atorch

ROOT = Path(atorch.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> Dict[str, Path]:
    return {_module_name(p): p for p in ROOT.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, module: str, is_package: bool, known: Set[str]) -> Set[str]:
    found: Set[str] = set()

    def target(name: str) -> None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            found.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                target(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            for alias in node.names:
                full = f"{base}.{alias.name}"
                target(full if full in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph() -> Dict[str, Set[str]]:
    modules = _modules()
    known = set(modules)
    return {name: _imports(ast.parse(path.read_text(encoding="utf-8")), name, path.name == "__init__.py", known)
            for name, path in modules.items()}


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []
    counter = [0]

    def connect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from x.y import z\nif TYPE_CHECKING:\n    import x.w\n")
    assert _imports(tree, "m", False, {"x.y", "x.y.z", "x.w"}) == {"x.y.z"}


def test_atorch_has_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (move the shared piece down a layer): " + "; ".join(
        " <-> ".join(c) for c in found)
