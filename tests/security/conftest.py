"""Fixtures of the security suite, on top of ``tests/conftest.py`` (``runtime``, ``start_router``...).

* ``client_key`` / ``engine_key``: distinctive secrets, so that a leak of
  either is found by a plain substring search;
* ``keys_file``: an ``ingress.api_keys_file`` naming ``client_key`` (digests only);
* ``secure_fleet`` / ``start_secure_router``: engines that refuse requests
  without ``engine_key``, and a router holding it through
  ``engine.engine_api_key_env`` (SPEC §2.2);
* ``router_log``: the router's process log captured in memory.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet, RouterThread
from .support import LogCapture, write_keys_file

#: The environment variable the router reads the engine credential from.
ENGINE_KEY_ENV = "NARWHAL_SECURITY_ENGINE_KEY"


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


@pytest.fixture
def secure_fleet(engine_key: str) -> Iterator[Fleet]:
    """A prefill and a decode engine that answer 401 without ``engine_key``."""
    with SimThread(role="prefill", speed=0, api_key=engine_key) as prefill, SimThread(
        role="decode", speed=0, api_key=engine_key
    ) as decode:
        yield Fleet(prefill=[prefill], decode=[decode])


@pytest.fixture
def start_secure_router(
    start_router: Callable[..., RouterThread], secure_fleet: Fleet, engine_key: str
) -> Callable[..., RouterThread]:
    """Start a router in front of ``secure_fleet`` (or ``fleet_``) holding the engine credential."""

    def start(*, fleet_: Fleet | None = None, **sections: Any) -> RouterThread:
        engine = {"engine_api_key_env": ENGINE_KEY_ENV, **sections.pop("engine", {})}
        return start_router(
            env={ENGINE_KEY_ENV: engine_key}, fleet_=fleet_ or secure_fleet, engine=engine, **sections
        )

    return start


@pytest.fixture
def router_log() -> Iterator[LogCapture]:
    """Everything the router logs while the test runs."""
    with LogCapture() as capture:
        yield capture
