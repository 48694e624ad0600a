"""The shared budget store against a real redis-server (narwhal_runtime/shared_budget.py, tests/redis_server.py).

The client is written once over each runtime's ``IO`` (narwhal_trio/io.py,
narwhal_asyncio/io.py); every test here runs on both. The bucket's state
is read from Redis itself.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
import trio

from narwhal_runtime.shared_budget import (
    SCRIPT_SHA, RedisAddress, SharedBudgetClient, SliceGrant, SliceRequest, StoreUnreachable, parse_redis_url,
)

from ..helpers import on_runtime
from ..redis_server import RedisServer, redis_server, started  # noqa: F401  (the fixture)

RUNTIMES = ("trio", "asyncio")


def request(**changes: Any) -> SliceRequest:
    values: dict[str, Any] = dict(tenant="acme", kind="requests", rate=10.0, capacity=20, units=5)
    values.update(changes)
    return SliceRequest(**values)


async def gather(runtime: str, jobs: list[Callable[[], Awaitable[None]]]) -> None:
    """Run ``jobs`` concurrently on ``runtime`` and return when all have."""
    if runtime == "trio":
        async with trio.open_nursery() as nursery:
            for job in jobs:
                nursery.start_soon(job)
    else:
        await asyncio.gather(*(job() for job in jobs))


def run(runtime: str, body: Callable[[Any], Awaitable[None]]) -> None:
    async def main(io: Any, _event: Any) -> None:
        await body(io)

    on_runtime(runtime, main)


def tokens_left(server: RedisServer, req: SliceRequest) -> float:
    reply = server.command("HGET", f"narwhal:budget:{req.tenant}:{req.kind}", "tokens")
    return float(reply.split(b"\r\n")[1])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_full_bucket_grants_its_capacity_then_refills_at_its_rate_by_redis_time(
        runtime: str, redis_server: RedisServer) -> None:
    outcomes: list[Any] = []

    async def body(io: Any) -> None:
        client = SharedBudgetClient(io, parse_redis_url(redis_server.url), timeout=2.0)
        for units in (15, 15):
            outcomes.append(await client.take(request(units=units)))
        await io.sleep_until(io.now() + 0.3)
        outcomes.append(await client.take(request(units=15)))
        client.close()

    run(runtime, body)
    first, second, third = outcomes
    assert isinstance(first, SliceGrant) and first.granted == 15 and first.retry_after == 0
    # 20 at first, 15 taken, a unit refilled at most (a tenth of a second at 10 a second) before the second take.
    assert isinstance(second, SliceGrant) and second.granted in (5, 6)
    assert 0 < second.retry_after <= 0.1  # below one unit left: the next comes within 1/rate
    assert isinstance(third, SliceGrant) and 3 <= third.granted <= 5  # 0.3 s at 10 a second
    assert redis_server.command("SCRIPT", "EXISTS", SCRIPT_SHA) == b"*1\r\n:1\r\n"


def test_many_takers_on_many_connections_of_both_runtimes_never_get_more_than_the_bucket_holds(
        redis_server: RedisServer) -> None:
    # A bucket that barely refills: whatever the interleaving, the takers
    # together get exactly its capacity; a lost update would give more.
    req = request(tenant="crowd", rate=0.001, capacity=300, units=3)
    granted: list[int] = []
    lock = threading.Lock()
    errors: list[BaseException] = []

    def taker_thread(runtime: str) -> None:
        async def body(io: Any) -> None:
            clients = [SharedBudgetClient(io, parse_redis_url(redis_server.url), timeout=5.0) for _ in range(3)]

            def taker(client: SharedBudgetClient) -> Callable[[], Awaitable[None]]:
                async def take() -> None:
                    for _ in range(20):
                        outcome = await client.take(req)
                        assert isinstance(outcome, SliceGrant), outcome
                        with lock:
                            granted.append(outcome.granted)
                return take

            await gather(runtime, [taker(c) for c in clients for _ in range(2)])
            for client in clients:
                client.close()

        try:
            run(runtime, body)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=taker_thread, args=(r,)) for r in (*RUNTIMES, *RUNTIMES)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(granted) == 4 * 3 * 2 * 20  # 480 takes of 3 units: 1440 asked of 300
    assert sum(granted) == 300
    assert tokens_left(redis_server, req) < 1


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_takers_over_a_window_get_at_most_rate_times_t_plus_capacity(runtime: str, redis_server: RedisServer) -> None:
    req = request(tenant="steady", rate=50.0, capacity=10, units=2)
    granted: list[int] = []

    async def body(io: Any) -> None:
        clients = [SharedBudgetClient(io, parse_redis_url(redis_server.url), timeout=5.0) for _ in range(4)]
        stop = io.now() + 0.6

        def taker(client: SharedBudgetClient) -> Callable[[], Awaitable[None]]:
            async def take() -> None:
                while io.now() < stop:
                    outcome = await client.take(req)
                    assert isinstance(outcome, SliceGrant), outcome
                    granted.append(outcome.granted)
            return take

        await gather(runtime, [taker(c) for c in clients])
        for client in clients:
            client.close()

    started = time.time()  # Redis's TIME is this machine's wall clock
    run(runtime, body)
    elapsed = time.time() - started
    assert sum(granted) <= 10 + 50.0 * elapsed
    assert sum(granted) >= 10 + 50.0 * 0.6 * 0.5  # and it does grant: the capacity and most of the refill


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_the_script_survives_script_flush(runtime: str, redis_server: RedisServer) -> None:
    outcomes: list[Any] = []

    async def body(io: Any) -> None:
        client = SharedBudgetClient(io, parse_redis_url(redis_server.url), timeout=2.0)
        outcomes.append(await client.take(request(units=1)))
        assert redis_server.command("SCRIPT", "FLUSH") == b"+OK\r\n"
        assert redis_server.command("SCRIPT", "EXISTS", SCRIPT_SHA) == b"*1\r\n:0\r\n"
        outcomes.append(await client.take(request(units=1)))  # the same connection: NOSCRIPT, then EVAL
        outcomes.append(await client.take(request(units=1)))
        client.close()

    run(runtime, body)
    assert [type(o) for o in outcomes] == [SliceGrant] * 3 and [o.granted for o in outcomes] == [1, 1, 1]
    assert redis_server.command("SCRIPT", "EXISTS", SCRIPT_SHA) == b"*1\r\n:1\r\n"
    assert 16 <= tokens_left(redis_server, request()) < 18  # three taken of twenty, a little refilled


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_killed_redis_is_unreachable_within_the_timeout_and_the_client_reconnects_when_it_returns(
        runtime: str, redis_server: RedisServer) -> None:
    changes: list[tuple[bool, str]] = []
    outcomes: list[tuple[str, Any, float]] = []

    async def body(io: Any) -> None:
        client = SharedBudgetClient(io, parse_redis_url(redis_server.url), timeout=0.5, backoff=0.2,
                                    on_change=lambda up, reason: changes.append((up, reason)))

        async def take(label: str) -> None:
            started = io.now()
            outcome = await client.take(request(units=1))
            outcomes.append((label, outcome, io.now() - started))

        await take("up")
        redis_server.kill()
        await take("killed")
        await take("in backoff")
        await io.sleep_until(io.now() + 0.25)
        await take("down, tried again")
        redis_server.start()
        await io.sleep_until(io.now() + 0.45)  # the doubled backoff, 0.4 s
        await take("back")
        client.close()

    run(runtime, body)
    (_, up, _), (_, killed, killed_wait), (_, backoff, backoff_wait), (_, down, down_wait), (_, back, _) = outcomes
    assert isinstance(up, SliceGrant) and isinstance(back, SliceGrant) and back.granted == 1
    assert isinstance(killed, StoreUnreachable) and killed.reason in ("connection reset", "connection refused")
    assert killed_wait < 0.5 + 0.2
    assert isinstance(backoff, StoreUnreachable) and backoff.reason == killed.reason and backoff_wait < 0.05
    assert isinstance(down, StoreUnreachable) and down.reason == "connection refused" and down_wait < 0.5 + 0.2
    assert changes == [(True, ""), (False, killed.reason), (True, "")]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_redis_that_never_answers_is_a_timeout_within_the_limit(runtime: str) -> None:
    outcomes: list[tuple[Any, float]] = []
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()  # the kernel accepts; nothing ever answers

        async def body(io: Any) -> None:
            client = SharedBudgetClient(io, RedisAddress(host="127.0.0.1", port=silent.getsockname()[1]), timeout=0.3)
            started = io.now()
            outcomes.append((await client.take(request()), io.now() - started))
            client.close()

        run(runtime, body)
    ((outcome, waited),) = outcomes
    assert isinstance(outcome, StoreUnreachable) and outcome.reason == "timeout"
    assert 0.3 <= waited < 0.3 + 0.2


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_a_redis_with_a_password_and_a_database_is_logged_in_to_and_a_wrong_password_is_named_without_it(
        runtime: str) -> None:
    server = started(password="s3cret-pw")
    outcomes: list[Any] = []
    try:
        async def body(io: Any) -> None:
            right = parse_redis_url(f"redis://:s3cret-pw@127.0.0.1:{server.port}/3")
            for address in (right, attrs.evolve(right, password="wrong-pw"), attrs.evolve(right, password=None)):
                client = SharedBudgetClient(io, address, timeout=2.0)
                outcomes.append(await client.take(request(units=2)))
                client.close()

        run(runtime, body)
        key_in_db_3 = server.command("EVAL", "redis.call('SELECT', 3) return redis.call('EXISTS', KEYS[1])",
                                     "1", "narwhal:budget:acme:requests")
        assert key_in_db_3 == b":1\r\n"
        assert server.command("EXISTS", "narwhal:budget:acme:requests") == b":0\r\n"  # not in db 0
    finally:
        server.close()
    granted, wrong, missing = outcomes
    assert isinstance(granted, SliceGrant) and granted.granted == 2
    assert isinstance(wrong, StoreUnreachable) and wrong.reason == "redis refused AUTH: WRONGPASS"
    assert isinstance(missing, StoreUnreachable) and missing.reason == "redis refused SELECT: NOAUTH"
    assert "s3cret" not in repr(outcomes) and "wrong-pw" not in repr(outcomes)
