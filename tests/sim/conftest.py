"""Fixtures of the simulator tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    """A plain HTTP client (fresh per test)."""
    with httpx.Client(timeout=10.0) as c:
        yield c
