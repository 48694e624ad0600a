"""Tests of the benchmarks' own logic (the scripts in ``benchmarks/``, loaded by path)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

#: The benchmark scripts: not a package, so each is loaded from its file.
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_benchmark(name: str, *, with_siblings: bool = False) -> ModuleType:
    """``benchmarks/NAME.py`` as a module; ``with_siblings``: it imports other scripts there (on ``sys.path``)."""
    if with_siblings and str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
