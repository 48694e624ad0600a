"""Fixtures of the end-to-end conformance suite, on top of ``tests/conftest.py``.

* ``engine_key`` / ``secure_fleet`` / ``start_secure_router``: engines that
  demand ``Authorization: Bearer <key>`` on every route, and a router given
  that credential through ``engine.engine_api_key_env`` (SPEC §2.2).
* ``api_keys``: a keys file of SHA-256 digests for ``auth = "api_keys"`` (SPEC §6).
* ``router_log``: the router's process log captured in memory.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from narwhal_core.auth import api_key_digest
from narwhal_sim.testing import SimThread

from ..harness import Fleet, RouterThread
from .support import LogCapture

#: The environment variable the router reads the engine credential from.
ENGINE_KEY_ENV = "NARWHAL_ENGINE_API_KEY"


@pytest.fixture
def engine_key() -> str:
    """A fresh engine credential (a secret that must never leak)."""
    return "ek-" + secrets.token_hex(16)


@pytest.fixture
def secure_fleet(engine_key: str) -> Iterator[Fleet]:
    """A prefill and a decode engine that refuse requests without ``engine_key``."""
    with SimThread(role="prefill", speed=0, api_key=engine_key) as prefill, SimThread(
        role="decode", speed=0, api_key=engine_key
    ) as decode:
        yield Fleet(prefill=[prefill], decode=[decode])


@pytest.fixture
def start_secure_router(
    start_router: Callable[..., RouterThread], secure_fleet: Fleet, engine_key: str
) -> Callable[..., RouterThread]:
    """Start a router in front of ``secure_fleet`` holding the engine credential."""

    def start(**sections: Any) -> RouterThread:
        engine = {"engine_api_key_env": ENGINE_KEY_ENV, **sections.pop("engine", {})}
        return start_router(env={ENGINE_KEY_ENV: engine_key}, fleet_=secure_fleet, engine=engine, **sections)

    return start


@attrs.frozen
class ApiKeys:
    """A keys file and the plaintext keys it stands for (the file holds digests only)."""

    path: Path
    keys: dict[str, str]  # client -> key


@pytest.fixture
def api_keys(tmp_path: Path) -> ApiKeys:
    """A keys file with two clients, ``team-a`` and ``team-b``."""
    keys = {"team-a": "sk-a-" + secrets.token_hex(16), "team-b": "sk-b-" + secrets.token_hex(16)}
    path = tmp_path / "keys.toml"
    path.write_text("".join(
        f'[[keys]]\nclient = "{client}"\nsha256 = "{api_key_digest(key)}"\n\n' for client, key in keys.items()
    ))
    assert not any(key in path.read_text() for key in keys.values())
    return ApiKeys(path=path, keys=keys)


@pytest.fixture
def router_log() -> Iterator[LogCapture]:
    """Everything the router logs while the test runs (restored afterwards)."""
    with LogCapture() as capture:
        yield capture
