"""Build hook: compile the hot modules of ``narwhal_core`` with Cython where this machine can.

``pyproject.toml`` holds everything else. Only the modules whose compiled
build measurably lowers the router's CPU per request are compiled
(``COMPILED`` in ``narwhal_build/__init__.py``; ``benchmarks/README.md``,
"Which modules are compiled (`setup.py`)", has the figures): they are the same source
files, built by Cython in pure-Python mode, so behaviour is the Python
source's. The others stay pure Python: compiled, they saved instructions but
not CPU time (the router and its parts), or under 1 % of the
instructions per request for seconds of install time each.
``config.py`` and ``__init__.py`` must stay pure: config is read once at
start-up, and its attrs field types must stay real types (Cython stores
annotations as strings), which its converter and tests read.

The ``.pxd`` files beside some compiled modules declare their hot classes
to Cython as extension types, whose methods then read and write their
fields directly (``wire.pxd``: the C locals of one byte-scanning loop);
annotations stay annotations, never C types.

The modules are translated (Cython) and then compiled (the C compiler) in
parallel, one job per core, the longest first, and the build says so on
the terminal: pip hides a build's output unless run with ``-v``, so the
two lines go to the controlling terminal when there is one, to stderr
otherwise. Without Cython or a C compiler, or with ``NARWHAL_PURE_PYTHON=1``
in the environment at install time, the install goes on with the pure
Python modules; a module whose compilation fails is left pure.
``narwhal serve`` logs which one it runs (``core``: ``compiled``, ``pure``
or ``mixed``); ``NARWHAL_PURE_PYTHON=1`` at run time picks the sources
(``narwhal_build``).
"""

from __future__ import annotations

import ast
import os
import sys
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent


def _compiled_modules() -> tuple[str, ...]:
    """``COMPILED`` of ``narwhal_build/__init__.py``, read without importing it (the environment may lack what it imports)."""
    tree = ast.parse((HERE / "narwhal_build" / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "COMPILED" and node.value is not None:
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("narwhal_build/__init__.py defines no COMPILED")


#: Python semantics throughout: annotations never become C types (but in
#: router.py, see above), functions stay introspectable Python-like functions.
DIRECTIVES = {
    "language_level": 3,
    "annotation_typing": False,
    "binding": True,
    "embedsignature": True,
    "always_allow_keywords": True,
}

#: After Python's own flags (``-g -O3``), so these win: without debug
#: information and with gcc's cheaper optimisation level, router.py compiles
#: in far less CPU time and its compiled build runs about as many
#: instructions per request (the figures: ``benchmarks/README.md``, "Which
#: modules are compiled"). The modules are calls into Python's C API
#: either way; a traceback through them names their Python source lines.
UNIX_COMPILE_ARGS = ["-O1", "-g0"]


class OptionalBuildExt(build_ext):
    """``build_ext`` that translates with Cython first, and leaves a module pure instead of failing the install."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        if self.inplace:
            _remove_leftovers()
        if not self.extensions:
            return
        jobs = max(1, int(self.parallel or 1))
        names = ", ".join(ext.name.removeprefix("narwhal_core.") for ext in self.extensions)
        _say(f"compiling narwhal_core's hot modules with Cython ({names}) on {jobs} "
             f"core{'s' if jobs > 1 else ''}; NARWHAL_PURE_PYTHON=1 skips this")
        started = time.monotonic()
        wanted = [ext.name for ext in self.extensions]
        self.extensions = _cythonize(self.extensions, jobs)
        translated = {ext.name for ext in self.extensions}
        for name in wanted:
            if name not in translated:
                self._stay_pure(name)
        if self.extensions:
            # The longest first: the build's wall time is then about the longest module's.
            self.extensions.sort(key=lambda ext: -sum(_size(source) for source in ext.sources))
            try:
                super().run()
            except Exception as exc:  # noqa: BLE001 - no compiler at all: stay pure
                _say(f"no C extension built ({exc}); narwhal_core runs as pure Python")
                for name in translated:
                    self._stay_pure(name)
                return
        built = ", ".join(ext.name.removeprefix("narwhal_core.") for ext in self.extensions) or "nothing"
        _say(f"compiled {built} in {time.monotonic() - started:.0f} s")

    def build_extension(self, ext: Extension) -> None:
        if self.compiler.compiler_type == "unix":
            ext.extra_compile_args = [*ext.extra_compile_args, *UNIX_COMPILE_ARGS]
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - one module failing stays pure
            self.extensions.remove(ext)  # nothing to copy beside the sources
            _say(f"{ext.name} not compiled ({exc}); it runs as pure Python")
            self._stay_pure(ext.name)

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
    compiled = _compiled_modules()
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
        Extension(f"narwhal_core.{name}", [f"narwhal_core/{name.replace('.', '/')}.py"]) for name in _compiled_modules()
    ]


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
