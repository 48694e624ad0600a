"""The guard of docs/design.md's pure core: ``narwhal_core`` does no I/O and reads no clock.

(a) Statically, no module of ``narwhal_core`` imports sockets, event loops,
clocks, randomness, threads, processes or ``os`` -- at any nesting level,
including inside functions and ``if TYPE_CHECKING`` blocks -- and none calls
the builtin ``open``.
(b) Dynamically, importing ``narwhal_core`` and every submodule of it in a
fresh interpreter loads no networking or event-loop module, dependencies
included.
(c) No module of ``narwhal_core`` imports an adapter, the runtime support
around them or the CLI.
(d) No module of ``narwhal_core`` holds module-level mutable state: every
top-level binding is immutable all the way down (tables are read-only
mappings of immutable values), so two routers in one process share nothing
that either could change.
"""

from __future__ import annotations

import __future__
import ast
import enum
import json
import re
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path

import attrs
import pytest

from ..helpers import REPO as ROOT

PACKAGE = ROOT / "narwhal_core"

FORBIDDEN_IMPORTS = (
    "socket", "ssl", "selectors", "asyncio", "trio", "time", "datetime", "random", "secrets", "uuid",
    "threading", "subprocess", "os",
    # The same capabilities under other names.
    "_socket", "_ssl", "_thread", "_asyncio", "multiprocessing", "concurrent", "signal", "anyio", "httpx",
    "sniffio", "posix", "nt",
    # The layers above the core: it never reaches up to them.
    "narwhal", "narwhal_runtime", "narwhal_trio", "narwhal_asyncio", "narwhal_build", "narwhal_bench",
)
# ``_socket`` (the C extension) is not in this list: typing_extensions, which
# cattrs imports, loads it only to name ``types.CapsuleType`` on Python < 3.13.
# The ``socket`` module itself must never be loaded.
FORBIDDEN_AT_RUNTIME = ("socket", "ssl", "selectors", "asyncio", "trio", "_ssl", "anyio", "httpx")


def forbidden(module: str) -> bool:
    return any(module == name or module.startswith(name + ".") for name in FORBIDDEN_IMPORTS)


def core_files() -> list[Path]:
    files = sorted(PACKAGE.rglob("*.py"))
    assert files, f"no Python files under {PACKAGE}"
    return files


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """Every forbidden import or call in one file, as ``file:line: what``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    where = path.relative_to(root)
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if forbidden(alias.name):
                    found.append(f"{where}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module is not None:
                if forbidden(node.module):
                    found.append(f"{where}:{node.lineno}: from {node.module} import ...")
                for alias in node.names:
                    if forbidden(f"{node.module}.{alias.name}") and not forbidden(node.module):
                        found.append(f"{where}:{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id == "open":
                found.append(f"{where}:{node.lineno}: call to open()")
            elif isinstance(func, ast.Attribute) and func.attr == "open" and isinstance(func.value, ast.Name) and (
                func.value.id in ("builtins", "io", "codecs")
            ):
                found.append(f"{where}:{node.lineno}: call to {func.value.id}.open()")
            # Dynamic imports of a forbidden module by name.
            is_dynamic_import = (isinstance(func, ast.Name) and func.id == "__import__") or (
                isinstance(func, ast.Attribute) and func.attr == "import_module"
            )
            if is_dynamic_import and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and forbidden(arg.value):
                    found.append(f"{where}:{node.lineno}: dynamic import of {arg.value}")
        elif isinstance(node, ast.Name) and node.id == "open" and isinstance(node.ctx, ast.Load):
            # ``reader = open`` then ``reader(path)`` is the same call.
            found.append(f"{where}:{node.lineno}: reference to open")
    return found


@pytest.mark.parametrize("path", core_files(), ids=lambda p: p.name)
def test_no_forbidden_imports_or_open(path: Path) -> None:
    found = violations(path)
    assert not found, "narwhal_core must stay pure (docs/design.md):\n" + "\n".join(found)


def test_the_guard_catches_what_it_should(tmp_path: Path) -> None:
    sample = tmp_path / "narwhal_core" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        textwrap.dedent(
            """
            import os.path
            from time import monotonic
            from concurrent import futures
            import json, uuid as u
            def f():
                import asyncio
                from datetime import datetime
                return open("x")
            from . import wire
            __import__("socket")
            """
        ),
        encoding="utf-8",
    )
    found = violations(sample, root=tmp_path)
    text = "\n".join(found)
    for needle in ("import os.path", "from time", "from concurrent", "import uuid", "import asyncio",
                   "from datetime", "open()", "dynamic import of socket"):
        assert needle in text, (needle, found)
    assert "wire" not in text and "json" not in text


PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil, sys
    watched = {watched!r}
    def loaded():
        return {{m for m in sys.modules if m.split(".")[0] in watched}}
    report = {{"baseline": sorted(loaded()), "by_module": {{}}, "errors": {{}}}}
    seen = loaded()
    names = ["narwhal_core"]
    import narwhal_core
    names += sorted(m.name for m in pkgutil.walk_packages(narwhal_core.__path__, "narwhal_core."))
    for name in names:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            report["errors"][name] = f"{{type(exc).__name__}}: {{exc}}"
        now = loaded()
        report["by_module"][name] = sorted(now - seen)
        seen = now
    report["modules"] = names
    print(json.dumps(report))
    """
)


def test_importing_the_core_loads_no_network_or_event_loop_module() -> None:
    code = PROBE.format(watched=sorted({m.split(".")[0] for m in FORBIDDEN_AT_RUNTIME}))
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["baseline"], f"the interpreter loads {report['baseline']} before narwhal_core is imported"
    assert len(report["modules"]) > 5, report["modules"]
    assert not report["errors"], "narwhal_core submodules that fail to import:\n" + "\n".join(
        f"  {name}: {err}" for name, err in report["errors"].items()
    )
    culprits = {name: mods for name, mods in report["by_module"].items() if mods}
    assert not culprits, "importing narwhal_core loaded forbidden modules (first importer -> modules):\n" + "\n".join(
        f"  {name} -> {', '.join(mods)}" for name, mods in culprits.items()
    )


# --- (c) no module-level mutable state -------------------------------------------------------------

STATE_PROBE = textwrap.dedent(
    """
    import importlib, json, pkgutil
    import narwhal_core
    from narwhal_build import MYPYC_LIBRARY
    names = ["narwhal_core"] + sorted(
        m.name for m in pkgutil.walk_packages(narwhal_core.__path__, "narwhal_core.")
        if m.name != "narwhal_core." + MYPYC_LIBRARY  # mypyc's code of the parts, not a module of the core
    )
    from tests.core.test_core_purity import mutable_globals
    found = []
    for name in names:
        found += mutable_globals(importlib.import_module(name))
    print(json.dumps({"modules": names, "found": found}))
    """
)

_IMMUTABLE_SCALARS = (str, bytes, int, float, complex, bool, type(None), range, type(Ellipsis))
_DEFINITIONS = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                types.MethodDescriptorType,  # a method of a class mypyc compiled
                typing.TypeVar, re.Pattern, __future__._Feature)


def immutable(value: object, depth: int = 0) -> bool:
    """Whether ``value`` (and everything it holds) can never change: what a module may bind at its top level."""
    if depth > 8:
        return False
    if isinstance(value, _IMMUTABLE_SCALARS) or isinstance(value, enum.Enum):
        return True
    if isinstance(value, _DEFINITIONS) or type(value).__name__ == "cython_function_or_method":
        return not hasattr(value, "cache_info")  # an lru_cache is process-global state
    if type(value).__module__ in ("typing", "types", "collections.abc") and not isinstance(value, types.MappingProxyType):
        return True  # Literal[...], unions, aliases: type expressions
    if isinstance(value, (tuple, frozenset)):
        return all(immutable(item, depth + 1) for item in value)
    if isinstance(value, types.MappingProxyType):
        return all(immutable(k, depth + 1) and immutable(v, depth + 1) for k, v in value.items())
    if attrs.has(type(value)):
        fields = attrs.fields(type(value))
        if not fields:
            return not hasattr(value, "__dict__")  # slotted and field-less: nothing to change
        try:  # writing a field's own value back changes nothing, and a frozen class refuses it
            setattr(value, fields[0].name, getattr(value, fields[0].name))
        except attrs.exceptions.FrozenInstanceError:
            return all(immutable(getattr(value, f.name), depth + 1) for f in fields)
        return False
    return False


#: Bindings that are mutable objects but hold no state between calls, each with the reason.
STATELESS: dict[str, str] = {
    # Configuration only (parse_float/parse_int/parse_constant); its scanner's memo of object keys
    # is emptied at the end of every decode.
    "narwhal_core.wire._EXACT": "JSONDecoder",
}


def mutable_globals(module: types.ModuleType) -> list[str]:
    """``module.name: type`` for every top-level binding of ``module`` that could change."""
    skip = {"__all__", "__builtins__", "__loader__", "__spec__", "__path__", "__annotations__", "__test__",
            "__pyx_capi__", "__cached__", "__file__", "__name__", "__package__", "__doc__"}
    return [
        f"{module.__name__}.{key}: {type(value).__name__}"
        for key, value in vars(module).items()
        if key not in skip and not immutable(value)
        and STATELESS.get(f"{module.__name__}.{key}") != type(value).__name__
    ]


def test_the_state_guard_catches_what_it_should() -> None:
    sample = types.ModuleType("narwhal_core.sample")
    exec(textwrap.dedent(
        """
        import functools, re, types, enum
        TABLE = {"a": 1}
        ITEMS = [1, 2]
        SEEN = set()
        NESTED = (1, [2])
        PROXY = types.MappingProxyType({"a": [1]})
        @functools.lru_cache
        def cached(x): return x
        OK_PROXY = types.MappingProxyType({"a": (1, 2)})
        OK = (1, "b", frozenset({2}))
        PATTERN = re.compile("x")
        class Color(enum.Enum):
            RED = 1
        def plain(): pass
        """
    ), vars(sample))
    found = {entry.split(":")[0].rpartition(".")[2] for entry in mutable_globals(sample)}
    assert found == {"TABLE", "ITEMS", "SEEN", "NESTED", "PROXY", "cached"}, found


def test_no_core_module_holds_module_level_mutable_state() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", STATE_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}\n{proc.stderr}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(report["modules"]) > 5, report["modules"]
    assert not report["found"], (
        "module-level bindings of narwhal_core that could change (tables: types.MappingProxyType of immutable "
        "values; sequences: tuples; per-instance memories belong to the instance):\n  " + "\n  ".join(report["found"])
    )
