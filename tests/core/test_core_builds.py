"""Both builds of ``narwhal_core`` pass the core's tests (``setup.py``, ``tests/corebuild.py``).

The suite runs the build that is installed: compiled by Cython where the
install could, pure Python otherwise. Here the core's own tests run once
more in a subprocess on the pure sources, so neither build goes untested
whichever is installed; and each run checks it loaded the build it claims.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import narwhal_core
from narwhal.corebuild import core_build

from .. import corebuild

ROOT = Path(__file__).resolve().parents[2]

#: The core's behavioural tests (the static ones -- purity, mypy -- read sources, the same for both builds).
CORE_TESTS = (
    "tests/core/test_router_scenarios.py",
    "tests/core/test_router_machine.py",
    "tests/core/test_http1.py",
    "tests/core/test_contract_properties.py",
    "tests/core/test_planning_properties.py",
    "tests/core/test_ids.py",
    "tests/core/test_auth.py",
    "tests/core/test_config.py",
    "tests/core/test_local_failure.py",
)


def loaded_core_modules() -> dict[str, str]:
    """Every loaded module of the core, with the file it was loaded from."""
    return {
        name: module.__file__ or ""
        for name, module in sys.modules.items()
        if name.startswith("narwhal_core.") and module is not None
    }


def test_this_run_loaded_the_build_it_should() -> None:
    # Importing the package loads every module the router uses.
    assert narwhal_core.Router is not None
    loaded = loaded_core_modules()
    assert "narwhal_core.router" in loaded and "narwhal_core.http1_fast" in loaded
    compiled = corebuild.compiled_files()
    for name, path in loaded.items():
        if corebuild.pure_requested() or name not in compiled:
            assert path.endswith(".py"), f"{name} should run from its source, runs {path}"
        else:
            assert Path(path) == compiled[name], f"{name} should run compiled ({compiled[name]}), runs {path}"
    # What the router's `listening` log line reports (config is never compiled).
    kind, stale = core_build()
    assert stale == []
    if corebuild.pure_requested() or not compiled:
        assert kind == "pure"
    elif all(name in compiled for name in loaded if name != "narwhal_core.config"):
        assert kind == "compiled"
    else:
        assert kind == "mixed"  # a module the compiler failed on stays pure


def test_the_pure_python_core_passes_the_core_tests() -> None:
    if corebuild.pure_requested():
        pytest.skip("this run tests the pure core already")
    env = {**os.environ, corebuild.PURE_ENV: "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         "tests/core/test_core_builds.py::test_this_run_loaded_the_build_it_should", *CORE_TESTS],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=280,
    )
    tail = (run.stdout + run.stderr)[-3000:]
    assert run.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail


def test_a_compiled_module_older_than_its_source_is_reported_stale() -> None:
    compiled = corebuild.compiled_files()
    if corebuild.pure_requested() or "narwhal_core.lifecycle" not in compiled:
        # Nothing compiled runs: nothing can be stale.
        assert core_build() == ("pure", [])
        return
    source = ROOT / "narwhal_core" / "lifecycle.py"
    before = source.stat()
    built = compiled["narwhal_core.lifecycle"].stat().st_mtime
    try:
        os.utime(source, (before.st_atime, built + 10))  # edited after it was compiled
        assert core_build()[1] == ["narwhal_core.lifecycle"]
    finally:
        os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert core_build()[1] == []
