"""Fixtures of the end-to-end conformance suite, on top of ``tests/conftest.py``.

* ``engine_key``: the engine credential that ``secure_fleet`` and
  ``start_secure_router`` (``tests/conftest.py``) demand and hand over
  through ``engine.engine_api_key_env`` (docs/contract.md, "The engine request").
* ``api_keys``: a keys file of SHA-256 digests for ``auth = "api_keys"`` (docs/security.md).
"""

from __future__ import annotations

import secrets
from pathlib import Path

import attrs
import pytest

from ..helpers import write_keys_file


@pytest.fixture
def engine_key() -> str:
    """A fresh engine credential (a secret that must never leak)."""
    return "ek-" + secrets.token_hex(16)


@attrs.frozen
class ApiKeys:
    """A keys file and the plaintext keys it stands for (the file holds digests only)."""

    path: Path
    keys: dict[str, str]  # client -> key


@pytest.fixture
def api_keys(tmp_path: Path) -> ApiKeys:
    """A keys file with two clients, ``team-a`` and ``team-b``."""
    keys = {"team-a": "sk-a-" + secrets.token_hex(16), "team-b": "sk-b-" + secrets.token_hex(16)}
    path = write_keys_file(tmp_path / "keys.toml", keys)
    assert not any(key in path.read_text() for key in keys.values())
    return ApiKeys(path=path, keys=keys)
