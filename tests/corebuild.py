"""Which build of ``narwhal_core`` the tests run: compiled (when installed so) or pure.

The suite runs whatever is installed (``setup.py`` compiles the core where it
can); ``tests/core/test_core_builds.py`` runs the core's tests again in a
subprocess with ``NARWHAL_PURE_PYTHON=1``, which :func:`check` honours
(:mod:`narwhal_build`; importing a package never does). Without that variable, a compiled module
older than its source (an editable install edited afterwards) would test old
code: :func:`check` refuses. The rerun walks fewer Hypothesis examples
(:func:`examples`): each property has just walked its full count on the
installed build, and both builds run the same sources.
"""

from __future__ import annotations

import os

import pytest

from narwhal_build import COMPILED, MYPYC, MYPYC_LIBRARY, PURE_ENV, compiled_files, pure_requested, stale_files, use_pure_core

__all__ = ["COMPILED", "MYPYC", "MYPYC_LIBRARY", "PURE_ENV", "RERUN_ENV", "check", "compiled_files", "examples", "pure_requested"]

#: Set by ``test_core_builds`` for its rerun of the core's tests on the pure sources, where the
#: properties walk fewer examples (:func:`examples`).
RERUN_ENV = "NARWHAL_TEST_PURE_RERUN"
#: In the rerun, a property walks 1/RERUN_DIVISOR of its examples, and at least RERUN_MIN_EXAMPLES
#: (its own count, if smaller).
RERUN_DIVISOR = 4
RERUN_MIN_EXAMPLES = 10


def examples(count: int, *, rerun: int | None = None) -> int:
    """A property's Hypothesis examples: ``count``; in the pure-core rerun ``rerun``, or a quarter of ``count``."""
    if not os.environ.get(RERUN_ENV):
        return count
    if rerun is not None:
        return rerun
    return max(min(count, RERUN_MIN_EXAMPLES), count // RERUN_DIVISOR)


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
