"""Which build of ``narwhal_core`` the tests run: compiled (when installed so) or pure.

The suite runs whatever is installed (``setup.py`` compiles the core where it
can); ``tests/core/test_core_builds.py`` runs the core's tests again in a
subprocess with ``NARWHAL_PURE_PYTHON=1``, which :func:`check` honours
(:mod:`narwhal_build`; importing a package never does). Without that variable, a compiled module
older than its source (an editable install edited afterwards) would test old
code: :func:`check` refuses.
"""

from __future__ import annotations

import pytest

from narwhal_build import COMPILED, PURE_ENV, compiled_files, pure_requested, stale_files, use_pure_core

__all__ = ["COMPILED", "PURE_ENV", "check", "compiled_files", "pure_requested"]


def check() -> None:
    """Called by ``conftest.py`` before anything imports the core."""
    if pure_requested():
        if not use_pure_core():
            raise pytest.UsageError("narwhal_core was imported before its pure build could be chosen")
        return
    stale = stale_files()
    if stale:
        raise pytest.UsageError(
            f"compiled core modules older than their sources: {', '.join(stale)}. "
            "Rebuild the edited modules (python setup.py build_ext --inplace), "
            f"reinstall (pip install -e .) or run with {PURE_ENV}=1."
        )
