"""Build hook: compile the hot modules of ``narwhal_core`` with Cython and mypyc where this machine can.

``pyproject.toml`` holds everything else. Only the modules whose compiled
build measurably lowers the router's CPU per request are compiled
(``benchmarks/README.md``, "Which modules are compiled"), each by the
compiler that pays for it; ``narwhal_build/__init__.py`` lists them:

* ``CYTHON``: the codec, the JSON scan, the SSE relay and a few more, built
  by Cython in pure-Python mode, so behaviour is the Python source's. The
  ``.pxd`` files beside some of them declare their hot classes to Cython as
  extension types, whose methods then read and write their fields directly
  (``wire.pxd``: the C locals of one byte-scanning loop); annotations stay
  annotations, never C types. ``config.py`` and ``__init__.py`` must stay
  pure: config is read once at start-up, and its attrs field types must
  stay real types (Cython stores annotations as strings), which its
  converter and tests read.
* ``MYPYC``: the router and its parts, built by mypyc into one shared
  library (``MYPYC_LIBRARY``) and a stub per module. mypyc type-checks them
  first, then compiles their classes as native classes; they are built
  all together or not at all (a stub without its library would not load).

Cython's modules are translated and then compiled (the C compiler) in
parallel, one job per core, the longest first, mypyc's library among
them, and the build says so on the terminal: pip hides a build's output
unless run with ``-v``, so the two lines go to the controlling terminal
when there is one, to stderr otherwise. Without Cython, mypy or a C
compiler, or with ``NARWHAL_PURE_PYTHON=1`` in the environment at install
time, the install goes on with the pure Python modules; a module whose
compilation fails is left pure. ``narwhal serve`` logs which one it runs
(``core``: ``compiled``, ``pure`` or ``mixed``); ``NARWHAL_PURE_PYTHON=1``
at run time picks the sources (``narwhal_build``).
"""
from __future__ import annotations

import ast
import os
import sys
import time
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _listed(name: str) -> Any:
    """``name`` of ``narwhal_build/__init__.py`` (a literal), read without importing it (the environment may lack what it imports)."""
    tree = ast.parse((HERE / "narwhal_build" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == name and node.value is not None:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"narwhal_build/__init__.py defines no {name}")


def _compiled_modules() -> tuple[str, ...]:
    """Every module the build compiles: ``CYTHON`` and ``MYPYC``."""
    return (*_listed("CYTHON"), *_listed("MYPYC"))


#: Cython's modules keep Python's semantics: annotations never become C types,
#: functions stay introspectable Python-like functions.
DIRECTIVES = {
    "language_level": 3,
    "annotation_typing": False,
    "binding": True,
    "embedsignature": True,
    "always_allow_keywords": True,
}

#: For Cython's modules, after Python's own flags (``-g -O3``), so these win:
#: without debug information and with gcc's cheaper optimisation level, a
#: module (the Cython-compiled router of an earlier version, measured)
#: compiles in far less CPU time and runs about as many instructions per
#: request (the figures: ``benchmarks/README.md``, "Which modules are
#: compiled"). They are calls into Python's C API either way; a traceback
#: through them names their Python source lines. mypyc's library keeps
#: mypyc's own flags.
UNIX_COMPILE_ARGS = ["-O1", "-g0"]


class OptionalBuildExt(build_ext):
    """``build_ext`` that translates with Cython first, and leaves a module pure instead of failing the install."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.parallel = os.cpu_count() or 1
        #: mypyc's extensions (the router's parts), and whether one of them failed to build.
        self._parts: list[Extension] = []
        self._parts_failed = False

    def finalize_options(self) -> None:
        if self.distribution.ext_modules:  # (none with NARWHAL_PURE_PYTHON=1)
            # Before build_ext's own: it prepares every extension it will build.
            self._parts = _mypycify()
            self._parts_failed = not self._parts
            self.distribution.ext_modules = [*self.distribution.ext_modules, *self._parts]
        super().finalize_options()

    def run(self) -> None:
        if self.inplace:
            _remove_leftovers()
        if not self.extensions:
            return
        jobs = max(1, int(self.parallel or 1))
        names = ", ".join(ext.name.removeprefix("narwhal_core.") for ext in self.extensions if ext not in self._parts)
        _say(f"compiling narwhal_core's hot modules with Cython ({names}) and the router's parts with mypyc "
             f"({', '.join(_listed('MYPYC'))}) on {jobs} core{'s' if jobs > 1 else ''}; NARWHAL_PURE_PYTHON=1 skips this")
        started = time.monotonic()
        cython = [ext for ext in self.extensions if ext not in self._parts]
        self.extensions = _cythonize(cython, jobs)
        translated = {ext.name for ext in self.extensions}
        for ext in cython:
            if ext.name not in translated:
                self._stay_pure(ext.name)
        self.extensions += self._parts
        if self.extensions:
            # The longest first: the build's wall time is then about the longest module's.
            self.extensions.sort(key=lambda ext: -sum(_size(source) for source in ext.sources))
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - no compiler at all: stay pure
                _say(f"no C extension built ({exc}); narwhal_core runs as pure Python")
                for name in translated | {ext.name for ext in self._parts}:
                    self._stay_pure(name)
                return
        self._settle_parts()
        built = ", ".join(ext.name.removeprefix("narwhal_core.") for ext in self.extensions) or "nothing"
        _say(f"compiled {built} in {time.monotonic() - started:.0f} s")

    def build_extension(self, ext: Extension) -> None:
        part = ext in self._parts
        if self.compiler.compiler_type == "unix" and not part:  # (mypyc sets its own flags)
            ext.extra_compile_args = [*ext.extra_compile_args, *UNIX_COMPILE_ARGS]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - one module failing stays pure
            self.extensions.remove(ext)  # nothing to copy beside the sources
            _say(f"{ext.name} not compiled ({exc}); it runs as pure Python")
            self._stay_pure(ext.name)
            if part:
                self._parts_failed = True

    def _settle_parts(self) -> None:
        """The router's parts are compiled all together or not at all: a stub without its library would not load."""
        names = [f"narwhal_core.{name}" for name in _listed("MYPYC")] + [f"narwhal_core.{_listed('MYPYC_LIBRARY')}"]
        if self._parts_failed:
            self.extensions = [ext for ext in self.extensions if ext not in self._parts]
            for name in names:
                # Those of them this build made too (in the source tree, or in the build directory a wheel takes).
                path = Path(self.get_ext_fullpath(name))
                if path.exists():
                    path.unlink()
                    _say(f"removed {path.name}: the router's parts are compiled all together or not at all")
        elif self.inplace:
            # mypyc rewrites only the library when a part changes: the stubs are up to date with their sources.
            for name in names:
                os.utime(self.get_ext_fullpath(name))

    def _stay_pure(self, name: str) -> None:
        """``name`` was not compiled: in a source tree, its compiled file of an older build goes.

        Left there, it would shadow the source it was built from, running old code.
        """
        if self.inplace:
            path = Path(self.get_ext_fullpath(name))
            if path.exists():
                path.unlink()
                _say(f"removed {path.name}: it was built from an older {name}")


def _remove_leftovers() -> None:
    """In a source tree, the compiled modules of an older build that are no longer compiled.

    They would shadow their sources for good (a compiled module takes
    precedence over the ``.py`` beside it), running old code.
    """
    compiled = (*_compiled_modules(), _listed("MYPYC_LIBRARY"))
    core = HERE / "narwhal_core"
    for path in sorted(core.rglob("*")):
        stem = ".".join((*path.relative_to(core).parent.parts, path.name.partition(".")[0]))
        if path.suffix in (".so", ".pyd") and stem not in compiled:
            path.unlink()
            _say(f"removed {path.name}: narwhal_core.{stem} is no longer compiled, it runs from its source")


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _say(message: str) -> None:
    """One line for whoever runs the install: its terminal (pip hides the build's stderr without ``-v``), else stderr."""
    line = f"narwhal setup: {message}\n"
    if not sys.stderr.isatty():
        try:
            with open("/dev/tty", "w", encoding="utf-8") as tty:
                tty.write("\n" + line)  # below pip's spinner, not after it
                return
        except OSError:
            pass  # no controlling terminal (CI, a container): stderr, shown by pip -v
    sys.stderr.write(line)
    sys.stderr.flush()


def _cythonize(modules: list[Extension], jobs: int) -> list[Extension]:
    """The modules Cython translated, their sources now the C files (the same objects: ``build_ext`` prepared them)."""
    try:
        from Cython.Build import cythonize
    except ImportError:
        _say("Cython is not installed; narwhal_core runs as pure Python")
        return []
    options = {"compiler_directives": DIRECTIVES, "build_dir": "build/cython", "quiet": True}
    try:
        translated = list(cythonize(modules, nthreads=jobs, **options))
    except Exception:  # noqa: BLE001 - Cython refused one: find which, leave it pure
        translated = []
        for module in modules:
            try:
                translated.extend(cythonize([module], **options))
            except Exception as exc:  # noqa: BLE001
                _say(f"{module.name} not compiled (Cython: {exc}); it runs as pure Python")
    sources = {ext.name: ext.sources for ext in translated}
    for module in modules:
        module.sources = sources.get(module.name, module.sources)
    return [module for module in modules if module.name in sources]


def extensions() -> list[Extension]:
    """The modules to compile (translated by Cython when ``build_ext`` runs, not each time this file is read)."""
    if os.environ.get("NARWHAL_PURE_PYTHON"):
        return []
    return [
        Extension(f"narwhal_core.{name}", [f"narwhal_core/{name.replace('.', '/')}.py"]) for name in _listed("CYTHON")
    ]


def _mypycify() -> list[Extension]:
    """The router's parts (``MYPYC``) as mypyc builds them: its shared library and a stub per module; none if it cannot.

    mypyc type-checks them first (with mypy, as the project's own check
    does), then writes the C of native classes and functions.
    """
    modules = _listed("MYPYC")
    if not modules:
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _say("mypyc is not installed; the router's parts run as pure Python")
        return []
    library = _listed("MYPYC_LIBRARY").removesuffix("__mypyc")
    try:
        return list(mypycify([f"narwhal_core/{name}.py" for name in modules],
                             group_name=f"narwhal_core.{library}", target_dir="build/mypyc"))
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - mypy's errors end in SystemExit
        _say(f"mypyc did not compile the router's parts ({exc!r}); they run as pure Python")
        return []


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
