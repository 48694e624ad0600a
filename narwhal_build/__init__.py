"""Which build of ``narwhal_core`` this process runs: compiled (by Cython and mypyc), or pure Python.

``pip install`` compiles some of the core's modules, with Cython or mypyc,
where it can (``setup.py``; ``docs/operate.md``, "Compiled core"), and the
compiled modules take precedence over the sources next to them. With
``NARWHAL_PURE_PYTHON=1`` in the environment, :func:`use_pure_core_if_requested`
makes every module of the core load from its ``.py`` file instead: the
reference build, for comparing the two or ruling the compiled one out.

Nothing does that as a side effect of an import: the entry points that
honour the variable call it themselves, before anything imports the core —
the ``narwhal`` command (:func:`narwhal.cli.main`), ``python -m
narwhal_bench``, the core benchmark and the test suite (``tests/conftest.py``).
An embedding application gets whatever is installed unless it calls it too.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

__all__ = [
    "COMPILED", "CYTHON", "MYPYC", "MYPYC_LIBRARY", "PURE_ENV", "compiled_files", "core_build", "pure_requested",
    "stale_files", "use_pure_core", "use_pure_core_if_requested",
]

#: The environment variable asking for the pure Python core (at install time: build no extension).
PURE_ENV = "NARWHAL_PURE_PYTHON"

#: The modules of the core that ``setup.py`` compiles with Cython (it reads this
#: list): those whose compiled build measurably lowers the router's CPU per
#: request (``benchmarks/README.md``, "Which modules are compiled"): the codec,
#: the JSON scan, the SSE relay, the journal's encoding.
CYTHON = (
    "contract", "http.codec", "http.engine", "http.grammar", "http.request_head", "http.request_reader",
    "http.server", "ids", "journal", "leg_bodies", "policies", "prefix", "relay", "routing", "stats", "tracecontext",
    "wire",
)

#: The router's parts, which ``setup.py`` compiles with mypyc (it reads this list
#: too). mypyc makes their classes native: compiled code reads their fields and
#: calls their methods directly, as the annotations say they are. Cython keeps
#: Python's semantics for such classes, and compiled them into slower code than
#: the interpreter's (benchmarks/README.md, "Which modules are compiled").
MYPYC = (
    "answers", "clients", "context", "fleet", "health", "inflight", "kv", "legs", "lifecycle", "requests", "router",
    "slots", "states", "timers",
)

#: The shared library mypyc builds the code of all of :data:`MYPYC` into
#: (``narwhal_core/_parts__mypyc.*.so``); each module's own compiled file only
#: loads its part of it. It is not a module of the core.
MYPYC_LIBRARY = "_parts__mypyc"

#: Every module of the core that the build compiles; the others always run from their sources.
COMPILED = CYTHON + MYPYC

_CORE = "narwhal_core"
#: Where the core's sources are (the compiled modules, when built in place, sit next to them).
CORE_DIR = Path(__file__).resolve().parents[1] / _CORE


class _PureCoreFinder(importlib.abc.MetaPathFinder):
    """Finds ``narwhal_core.<module>`` (also ``narwhal_core.http.<module>``) as its source file, never its compiled twin."""

    def __init__(self, package_dir: Path) -> None:
        self.package_dir = package_dir

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, module = fullname.partition(".")
        if package != _CORE or not module:
            return None
        source = self.package_dir.joinpath(*module.split(".")).with_suffix(".py")
        if not source.is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def pure_requested() -> bool:
    """The environment asks for the pure Python core."""
    return bool(os.environ.get(PURE_ENV))


def use_pure_core() -> bool:
    """Load the core's modules from their sources from now on; ``False`` if already imported (too late)."""
    if any(isinstance(f, _PureCoreFinder) for f in sys.meta_path):
        return True
    if any(name == _CORE or name.startswith(_CORE + ".") for name in sys.modules):
        return False
    sys.meta_path.insert(0, _PureCoreFinder(CORE_DIR))
    return True


def use_pure_core_if_requested() -> bool:
    """Honour ``NARWHAL_PURE_PYTHON``: :func:`use_pure_core` when it is set.

    Returns whether the core will load as the environment asks (``False``:
    the pure core was asked for, but the core was already imported).
    """
    return use_pure_core() if pure_requested() else True


def compiled_files(package_dir: Path = CORE_DIR) -> dict[str, Path]:
    """The compiled modules next to the core's sources, by module name."""
    return {
        ".".join((_CORE, *path.relative_to(package_dir).parent.parts, path.name.partition(".")[0])): path
        for path in package_dir.rglob("*")
        if path.suffix in (".so", ".pyd") and path.name.partition(".")[0] != MYPYC_LIBRARY
    }


def stale_files(package_dir: Path = CORE_DIR) -> list[str]:
    """The compiled modules older than their sources, by module name (a source checkout only).

    A module's sources are its ``.py`` and, where there is one, the ``.pxd``
    that declares its classes to Cython. An editable install edited
    afterwards: it still runs the old code until rebuilt. In an installed
    wheel the files' times are those of its unpacking, so nothing there
    counts as stale.
    """
    if not all((package_dir.parent / name).is_file() for name in ("setup.py", "pyproject.toml")):
        return []
    stale = []
    for name, path in compiled_files(package_dir).items():
        stem = package_dir.joinpath(*name.split(".")[1:])
        try:
            built = path.stat().st_mtime
            sources = [stem.with_suffix(".py"), stem.with_suffix(".pxd")]
            if any(source.stat().st_mtime > built for source in sources if source.exists()):
                stale.append(name)
        except OSError:
            pass  # a source removed: nothing to compare
    return sorted(stale)


def core_build() -> tuple[str, list[str]]:
    """How the core runs in this process, and which of its loaded compiled modules are stale.

    The first value is ``compiled`` (every loaded module of the core that the
    build compiles is a C extension), ``pure`` (none is) or ``mixed`` (a
    module the compiler failed on stays pure); the second, the loaded ones
    of :func:`stale_files`.
    """
    compiled: list[str] = []
    pure: list[str] = []
    for name, module in sorted(sys.modules.items()):
        # Only the modules the build compiles count (the others are always pure).
        if not name.startswith(_CORE + ".") or name.partition(".")[2] not in COMPILED or module is None:
            continue
        path = Path(getattr(module, "__file__", None) or "")
        (pure if path.suffix == ".py" else compiled).append(name)
    stale = [name for name in stale_files() if name in compiled]
    kind = "mixed" if compiled and pure else ("compiled" if compiled else "pure")
    return kind, stale
