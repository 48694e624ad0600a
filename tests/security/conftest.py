"""Fixtures of the security suite, on top of ``tests/conftest.py`` (``runtime``, ``start_router``...).

* ``client_key`` / ``engine_key``: distinctive secrets, so that a leak of
  either is found by a plain substring search;
* ``keys_file``: an ``ingress.api_keys_file`` naming ``client_key`` (digests only);
* ``secure_fleet`` / ``start_secure_router`` / ``router_log`` come from
  ``tests/conftest.py`` and use this suite's ``engine_key``.
"""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from ..helpers import write_keys_file


@pytest.fixture
def client_key() -> str:
    """A client API key that must never reach an engine, a log line or the journal."""
    return "sk-client-SECRET-7f3a" + secrets.token_hex(12)


@pytest.fixture
def engine_key() -> str:
    """The engine credential, which must never reach a client, a log line or the journal."""
    return "engine-SECRET-91bc" + secrets.token_hex(12)


@pytest.fixture
def keys_file(tmp_path: Path, client_key: str) -> Path:
    """A keys file naming ``client_key`` as client ``team-a``."""
    return write_keys_file(tmp_path / "keys.toml", {"team-a": client_key})
