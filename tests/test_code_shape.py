"""The code's shape (docs/design.md, "Sizes and layers"): sizes within bounds, no import cycle, layers in order.

Sizes: no module of the core or the simulator over 600 lines, no class over
400, no function or method of the product or the simulator over 60, except the
few named in :data:`LONG_ON_PURPOSE` (parsers, tables and rule sequences that
read best in one piece).

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
MAX_CORE_MODULE = 600
#: Held to the core's bounds too (docs/simulator.md, "Package layout"): the simulator, split by flow like the core.
SHAPED = (*code_shape.PRODUCT, "narwhal_sim")
#: Packages whose every module is held to MAX_CORE_MODULE.
BOUNDED_MODULES = ("narwhal_core", "narwhal_sim")
MAX_CLASS = 400
#: Lines of each adapter, every module of it counted (comments and docstrings too): its ``IO`` and its server.
MAX_ADAPTER = 400
MAX_FUNCTION = 60
#: Functions longer than MAX_FUNCTION on purpose, and why (docs/design.md, "Sizes and layers").
LONG_ON_PURPOSE = {
    "narwhal_core.contract.check_request": "the request rules in docs/contract.md's order, one after another",
    "narwhal_core.leg_bodies.check_prefill_answer": "the prefill answer's checks in order, each with its error",
    "narwhal_core.auth.parse_api_keys": "a parser: the API keys file's tables, each field checked with its own message",
    "narwhal_core.http.engine.EngineConnection._read_chunked": "a parser: a chunked body's state machine",
    "narwhal_core.http.request_head.read_clean_head": "a parser: the fast reading of a clean request head",
    "narwhal_core.http.request_head.decide_head": "a parser: any request head accepted or refused with its status",
    "narwhal_runtime.driver.Driver.feed": "a table: each command kind the router gives, taken in one loop with "
    "the containment of what raises (the driver's hottest path: once per event, a call costs)",
    "narwhal_runtime.driver.Driver.flush": "a sequence: the batch's effects in the order docs/design.md gives, the "
    "engine commands' table among them (once per batch: a call more per batch costs)",
    "narwhal_core.http.engine.encode_request": "an encoder: a leg's request in one pass, h11's rules on names and values",
    # The simulator's one exception: a data table, not logic.
    "narwhal_sim.cli.build_parser": "a table: every `narwhal sim` flag with its default and help, in the order "
    "--help prints them (docs/simulator.md)",
}


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


def oversized(root: Path, packages: tuple[str, ...]) -> tuple[list[tuple[str, str, int]], set[str]]:
    """What is over its bound under ``root`` (LONG_ON_PURPOSE aside), and the long functions seen."""
    too_long = []
    seen = set()
    for name, path in code_shape.modules(root, packages):
        if name.partition(".")[0] in BOUNDED_MODULES and code_shape.line_count(path) > MAX_CORE_MODULE:
            too_long.append(("module", name, code_shape.line_count(path)))
        for lines, kind, where in code_shape.definitions(name, path):
            if kind == "class" and lines > MAX_CLASS:
                too_long.append((kind, where, lines))
            elif kind == "def" and lines > MAX_FUNCTION:
                seen.add(where)
                if where not in LONG_ON_PURPOSE:
                    too_long.append((kind, where, lines))
    return too_long, seen


def test_modules_classes_and_functions_stay_within_their_sizes() -> None:
    too_long, seen = oversized(REPO, SHAPED)
    assert too_long == []
    assert seen == set(LONG_ON_PURPOSE)  # an exception that is no longer needed leaves the list


def test_the_simulator_is_measured_with_the_core(tmp_path: Path) -> None:
    # Its modules are found, and one too long (a SimEngine of old, one flow too many) is named.
    assert sum(1 for name, _ in code_shape.modules(REPO, SHAPED) if name.startswith("narwhal_sim.")) > 20
    pkg = tmp_path / "narwhal_sim"
    pkg.mkdir()
    body = "".join(f"    def route_{i}(self) -> None:\n" + "        pass\n" * 3 for i in range(160))
    (pkg / "server.py").write_text("class SimEngine:\n" + body + "    def _complete(self) -> None:\n" + "        x = 1\n" * 61)
    too_long, _ = oversized(tmp_path, ("narwhal_sim",))
    assert too_long == [("module", "narwhal_sim.server", 703), ("class", "narwhal_sim.server.SimEngine", 703),
                        ("def", "narwhal_sim.server.SimEngine._complete", 62)]  # fmt: skip


def test_each_adapter_stays_within_its_size() -> None:
    # What the runtimes share lives in narwhal_runtime: an adapter that grows past this has taken some back.
    sizes = {adapter: sum(code_shape.line_count(path) for _, path in code_shape.modules(REPO, (adapter,)))
             for adapter in ADAPTERS}
    assert all(0 < size <= MAX_ADAPTER for size in sizes.values()), sizes
