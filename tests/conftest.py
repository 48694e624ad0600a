"""Shared fixtures: simulated fleets and routers on real loopback sockets."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from . import corebuild

# Before anything imports the core: which build of it this run tests
# (NARWHAL_PURE_PYTHON=1 installs the pure core here, explicitly: importing
# a package never does).
corebuild.check()

from narwhal_sim.testing import SimThread  # noqa: E402

from .harness import Fleet, LogCapture, RouterThread, make_config  # noqa: E402

#: The environment variable the routers of ``start_secure_router`` read the engine credential from.
ENGINE_KEY_ENV = "NARWHAL_TEST_ENGINE_KEY"

#: The runtimes every end-to-end test runs on (the conformance suite).
CONFORMANCE_RUNTIMES = ("trio", "asyncio")


@pytest.fixture(params=CONFORMANCE_RUNTIMES)
def runtime(request: pytest.FixtureRequest) -> str:
    """The runtime an end-to-end test runs the router on."""
    return str(request.param)


@pytest.fixture
def fleet() -> Iterator[Fleet]:
    """One prefill and one decode engine simulator, instant (speed 0)."""
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        yield Fleet(prefill=[prefill], decode=[decode])


@pytest.fixture
def sims() -> Iterator[Callable[..., SimThread]]:
    """``sims(role, **options)``: a started SimThread (speed 0 by default), stopped after the test."""
    started: list[SimThread] = []

    def start(role: str, **options: Any) -> SimThread:
        options.setdefault("speed", 0)
        sim = SimThread(role=role, **options).start()
        started.append(sim)
        return sim

    yield start
    for sim in reversed(started):
        sim.stop()


@pytest.fixture
def journal_path(tmp_path: Path) -> Path:
    return tmp_path / "journal.jsonl"


@pytest.fixture
def start_router(
    runtime: str, fleet: Fleet, journal_path: Path
) -> Iterator[Callable[..., RouterThread]]:
    """Start a router on ``runtime`` in front of ``fleet``; keyword args override config sections."""
    started: list[RouterThread] = []

    def start(*, env: dict[str, str] | None = None, fleet_: Fleet | None = None, **sections: Any) -> RouterThread:
        f = fleet_ or fleet
        config = make_config(
            journal_path, prefill=f.prefill_urls, decode=f.decode_urls, **sections
        )
        router = RouterThread(config, runtime, env=env).start()
        started.append(router)
        return router

    yield start
    for router in started:
        router.stop()


# The engine credential: ``engine_key`` is each suite's own fixture (the
# security suite wants a key with a distinctive prefix to search for).


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
    """Everything the router logs while the test runs (restored afterwards)."""
    with LogCapture() as capture:
        yield capture
