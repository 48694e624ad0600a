"""The shape of the code: module sizes, the longest classes and functions, import cycles.

    python benchmarks/code_shape.py [TREE] [--top N]

Reads the Python sources of the project's packages under ``TREE`` (default:
this checkout) without importing them, and prints

* lines per module of the core (``narwhal_core``), then per package;
* the adapters' sizes (every module of ``narwhal_trio`` and ``narwhal_asyncio``);
* the ``N`` longest classes and functions (methods included) of the product
  packages, with where they are;
* the import graph's cycles, between packages and between modules (every
  import counts, including those inside functions: a lazy import is still a
  dependency), as strongly connected components of more than one node.

To compare two trees' shapes, run it on a checkout of each commit
(``benchmarks/README.md`` lists it among the scripts).
"""

from __future__ import annotations

import argparse
import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

PRODUCT = ("narwhal_core", "narwhal_runtime", "narwhal_trio", "narwhal_asyncio", "narwhal", "narwhal_build")
ALSO = ("narwhal_sim", "narwhal_bench")
ADAPTERS = ("narwhal_trio", "narwhal_asyncio")


def modules(tree: Path, packages: tuple[str, ...]) -> Iterator[tuple[str, Path]]:
    """``(dotted name, path)`` of every module of ``packages`` present under ``tree``."""
    for package in packages:
        root = tree / package
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(tree).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            yield ".".join(parts), path


def line_count(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def definitions(name: str, path: Path) -> Iterator[tuple[int, str, str]]:
    """``(lines, kind, where)`` of every class and function (nested ones too) in one module."""
    tree = ast.parse(path.read_text(encoding="utf-8"))

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[int, str, str]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                assert child.end_lineno is not None
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                kind = "class" if isinstance(child, ast.ClassDef) else "def"
                qualified = f"{prefix}.{child.name}"
                yield child.end_lineno - first + 1, kind, qualified
                yield from walk(child, qualified)

    yield from walk(tree, name)


def type_only_nodes(tree: ast.AST) -> set[int]:
    """``id()`` of every node under an ``if TYPE_CHECKING:`` block (imports for annotations only)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                found.update(id(n) for n in ast.walk(child))
    return found


def imports(name: str, path: Path, known: set[str], *, type_only: bool = True) -> set[str]:
    """The project modules ``name`` imports (resolved to the longest known module name).

    With ``type_only=False``, imports under ``if TYPE_CHECKING:`` (for annotations only) do not count.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"))
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    skipped = set() if type_only else type_only_nodes(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # ``from package import module`` depends on the module, not on the package's ``__init__``.
            submodules = [f"{stem}.{alias.name}" for alias in node.names if f"{stem}.{alias.name}" in known]
            targets = submodules if len(submodules) == len(node.names) else [stem, *submodules]
        for target in targets:
            parts = target.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != name:
                found.add(".".join(parts))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in graph:
                    continue
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", default=str(Path(__file__).resolve().parents[1]))
    parser.add_argument("--top", type=int, default=12, help="how many of the longest classes and functions")
    args = parser.parse_args()
    tree = Path(args.tree)
    product = dict(modules(tree, PRODUCT))
    everything = {**product, **dict(modules(tree, ALSO))}

    print(f"# code shape of {tree}")
    print("\n## core modules (lines)")
    for name, path in sorted(product.items(), key=lambda item: -line_count(item[1])):
        if name.startswith("narwhal_core"):
            print(f"  {line_count(path):6,}  {name}")
    print("\n## packages (modules, lines, largest module)")
    by_package: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for name, path in everything.items():
        by_package[name.split(".")[0]].append((line_count(path), name))
    for package, sizes in sorted(by_package.items()):
        largest = max(sizes)
        print(f"  {package:<16} {len(sizes):3} modules {sum(n for n, _ in sizes):7,} lines   largest {largest[1]} ({largest[0]:,})")
    print("\n## adapters (lines per module)")
    for adapter in ADAPTERS:
        sizes = sorted(((line_count(p), n) for n, p in product.items() if n.split(".")[0] == adapter), reverse=True)
        listed = ", ".join(f"{n.rpartition('.')[2] or n} {c}" for c, n in sizes if c)
        print(f"  {adapter:<16} {sum(c for c, _ in sizes):5,} lines: {listed}")
    for kind in ("class", "def"):
        print(f"\n## longest {'classes' if kind == 'class' else 'functions and methods'} (product packages)")
        found = [(n, where) for name, path in product.items() for n, k, where in definitions(name, path) if k == kind]
        for n, where in sorted(found, reverse=True)[: args.top]:
            print(f"  {n:6,}  {where}")
    print("\n## import cycles")
    known = set(everything)
    graph = {name: imports(name, path, known) for name, path in product.items()}
    run_time = {name: imports(name, path, known, type_only=False) for name, path in product.items()}
    package_graph: dict[str, set[str]] = defaultdict(set)
    for name, targets in graph.items():
        package_graph[name.split(".")[0]] |= {t.split(".")[0] for t in targets if t.split(".")[0] != name.split(".")[0]}
    for label, g in (("between packages", package_graph), ("between modules, imports that run", run_time),
                     ("between modules, counting imports for annotations only", graph)):
        found_cycles = cycles(dict(g))
        print(f"  {label}: {len(found_cycles)}")
        for cycle in found_cycles:
            print("    " + " <-> ".join(cycle))


if __name__ == "__main__":
    main()
