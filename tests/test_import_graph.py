"""The packages' import graph (docs/design.md, "Packages"): no cycle, and each layer imports only those below it.

The graph is read from the sources: every ``import`` and ``from ... import``
at any depth (inside functions too: a lazy import is still a dependency),
except those under ``if TYPE_CHECKING:``, which name types only. A module
importing its own package (``from . import x``) depends on ``x``, not on
the package's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from .helpers import REPO

PACKAGES = (
    "narwhal_core", "narwhal_runtime", "narwhal_trio", "narwhal_asyncio", "narwhal", "narwhal_build",
    "narwhal_sim", "narwhal_bench",
)  # fmt: skip
ADAPTERS = ("narwhal_trio", "narwhal_asyncio")


def module_files(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Every module of ``packages`` under ``root``, by dotted name."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    return "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that module ``name`` (at ``path``) imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name and not name.startswith(dotted + "."):
            found.add(dotted)  # (a module's own packages are loaded before it anyway)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if node.module:
                resolve(source)
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    resolve(f"{source}.{alias.name}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_two_modules_import_each_other_even_through_others() -> None:
    graph = import_graph(REPO, PACKAGES)
    assert len(graph) > 90, sorted(graph)  # the packages were found
    assert cycles(graph) == []


def test_each_layer_imports_only_those_below_it() -> None:
    graph = import_graph(REPO, PACKAGES)
    for name, deps in graph.items():
        top = name.partition(".")[0]
        for dep in deps:
            dep_top = dep.partition(".")[0]
            if top in ("narwhal_core", "narwhal_runtime"):
                assert dep_top not in (*ADAPTERS, "narwhal"), (name, dep)
            if top in ADAPTERS:
                others = [a for a in ADAPTERS if a != top]
                assert dep_top not in ("narwhal", *others), (name, dep)


def test_the_graph_finds_a_cycle_through_a_lazy_import_and_skips_type_checking(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import thing\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\nelse:\n    from .e import y\n"
    )
    (pkg / "e.py").write_text("from .d import z\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.e"}
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]
