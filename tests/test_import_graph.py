"""The packages' import graph (docs/design.md, "Packages"): no cycle, and each layer imports only those below it.

The graph is the one ``benchmarks/code_shape.py`` prints (the architecture's
before/after tables): every ``import`` and ``from ... import`` at any depth
(inside functions too: a lazy import is still a dependency), except those
under ``if TYPE_CHECKING:``, which name types only. ``from package import
module`` depends on the module, not on the package's ``__init__``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .helpers import REPO

_PATH = REPO / "benchmarks" / "code_shape.py"
_spec = importlib.util.spec_from_file_location("code_shape", _PATH)
assert _spec is not None and _spec.loader is not None
code_shape = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(code_shape)

PACKAGES = (*code_shape.PRODUCT, *code_shape.ALSO)
ADAPTERS = code_shape.ADAPTERS


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the project modules it imports when it runs (annotations-only imports left out)."""
    found = dict(code_shape.modules(root, packages))
    known = set(found)
    return {name: code_shape.imports(name, path, known, type_only=False) for name, path in found.items()}


def test_no_two_modules_import_each_other_even_through_others() -> None:
    graph = import_graph(REPO, PACKAGES)
    assert len(graph) > 90, sorted(graph)  # the packages were found
    assert code_shape.cycles(graph) == []


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
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\nfrom .e import y\n")
    (pkg / "e.py").write_text("from .d import z\n")
    graph = import_graph(tmp_path, ("pkg",))
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.d"] == {"pkg.e"}
    assert code_shape.cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.d", "pkg.e"]]
