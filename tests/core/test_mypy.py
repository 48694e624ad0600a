"""``mypy --strict`` is clean for ``narwhal_core``."""

from __future__ import annotations

import pytest
from mypy import api

from ..helpers import REPO as ROOT


def test_mypy_strict_narwhal_core(monkeypatch: pytest.MonkeyPatch) -> None:
    # Run from the repository root so that pyproject.toml's [tool.mypy] applies.
    monkeypatch.chdir(ROOT)
    stdout, stderr, status = api.run(["--strict", "narwhal_core"])
    assert status == 0, f"mypy --strict narwhal_core failed (exit {status}):\n{stdout}{stderr}"
