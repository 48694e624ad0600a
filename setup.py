"""Build hook: compile ``narwhal_core``'s modules with Cython where this machine can.

``pyproject.toml`` holds everything else. The compiled modules are the same
source files, built by Cython in pure-Python mode, so behaviour is the
Python source's; they run faster under load, a little slower at idle
(``benchmarks/README.md``, "Results (latest)"). The ``.pxd``
files beside some modules declare their hot classes to Cython as extension
types, whose methods then read and write their fields directly
(``wire.pxd``: the C locals of one byte-scanning loop), and
annotations stay annotations, never C types, except in ``router.py``:
there Cython also types the parameters annotated with the classes
``router.pxd`` declares (its header comment turns ``annotation_typing`` on). Without Cython or a C compiler, or with
``NARWHAL_PURE_PYTHON=1`` in the environment at install time, the install
goes on with the pure Python modules; a module whose compilation fails is
left pure. ``narwhal serve`` logs which one it runs (``core``: ``compiled``,
``pure`` or ``mixed``); ``NARWHAL_PURE_PYTHON=1`` at run time picks the
sources (``narwhal/corebuild.py``).

``config.py`` and ``__init__.py`` stay pure: config is read once at start-up,
and its attrs field types must stay real types (Cython stores annotations as
strings), which its converter and tests read.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

#: The modules compiled: the request path and what it calls.
COMPILED = (
    "auth", "contract", "errors", "events", "fleet", "http1", "http1_fast", "ids",
    "journal", "lifecycle", "planning", "router", "stats", "wire",
)

#: Python semantics throughout: annotations never become C types (but in
#: router.py, see above), functions stay introspectable Python-like functions.
DIRECTIVES = {
    "language_level": 3,
    "annotation_typing": False,
    "binding": True,
    "embedsignature": True,
    "always_allow_keywords": True,
}


class OptionalBuildExt(build_ext):
    """``build_ext`` that leaves a module pure instead of failing the install."""

    def initialize_options(self) -> None:
        super().initialize_options()
        self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001 - no compiler at all: stay pure
            _warn(f"no C extensions built ({exc}); narwhal_core runs as pure Python")

    def build_extension(self, ext: object) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001 - one module failing stays pure
            _warn(f"{getattr(ext, 'name', ext)} not compiled ({exc}); it runs as pure Python")


def _warn(message: str) -> None:
    print(f"narwhal setup: {message}", file=sys.stderr)


def extensions() -> list[object]:
    if os.environ.get("NARWHAL_PURE_PYTHON"):
        return []
    try:
        from Cython.Build import cythonize
        from setuptools import Extension
    except ImportError:
        _warn("Cython is not installed; narwhal_core runs as pure Python")
        return []
    modules = [Extension(f"narwhal_core.{name}", [f"narwhal_core/{name}.py"]) for name in COMPILED]
    options = {"compiler_directives": DIRECTIVES, "build_dir": "build/cython", "quiet": True}
    try:
        return list(cythonize(modules, nthreads=os.cpu_count() or 1, **options))
    except Exception:  # noqa: BLE001 - Cython refused one: find which, leave it pure
        pass
    built = []
    for module in modules:
        try:
            built.extend(cythonize([module], **options))
        except Exception as exc:  # noqa: BLE001
            _warn(f"{module.name} not compiled (Cython: {exc}); it runs as pure Python")
    return built


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
