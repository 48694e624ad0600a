"""What one read costs in each shape an adapter could take: asyncio's protocol callback, or a task that waits.

    python benchmarks/read_shapes.py [--rounds N] [--repeats K]

Why the asyncio adapter keeps its own transports instead of the task-shaped
code trio runs (and both could share over :mod:`narwhal_runtime.socket_io`):
each leg answer and each client request is a read, several per request.
This times a ping-pong over a socket pair, one byte each way, ``N`` rounds,
the best of ``K`` repeats, in CPU microseconds per round trip (one read on
each side):

* ``asyncio protocol``: both ends ``asyncio.Protocol`` (``data_received``
  writes the answer), as the asyncio adapter reads clients and engines;
* ``asyncio task``: the measured end a task that waits with the shared
  :func:`~narwhal_runtime.socket_io.receive` and the asyncio adapter's
  ``Waits.readable``, the echo end a protocol as above;
* ``trio task``: the measured end the same shared ``receive`` with trio's
  ``wait_readable``, the echo end a trio task.

Each asyncio row runs on the standard loop and, when it is installed, on
uvloop (what ``narwhal serve`` runs). The figures go to
benchmarks/README.md ("The adapters' shape").
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from collections.abc import Callable
from typing import Any

import trio

from narwhal_runtime.socket_io import receive

PING = b"x"


class _Echo(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(data)


class _Pinger(asyncio.Protocol):
    def __init__(self, rounds: int, done: asyncio.Future[int]) -> None:
        self.left = rounds
        self.trips = 0
        self.done = done

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        transport.write(PING)

    def data_received(self, data: bytes) -> None:
        self.trips += len(data)
        self.left -= 1
        if self.left:
            self.transport.write(data)
        else:
            self.done.set_result(self.trips)


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def _asyncio_protocol(rounds: int) -> tuple[float, int]:
    loop = asyncio.get_running_loop()
    a, b = _pair()
    echo, _ = await loop.connect_accepted_socket(_Echo, b)
    done: asyncio.Future[int] = loop.create_future()
    start = time.process_time()
    transport, _ = await loop.connect_accepted_socket(lambda: _Pinger(rounds, done), a)
    trips = await done
    spent = time.process_time() - start
    transport.close()
    echo.close()
    return spent, trips


async def _asyncio_task(rounds: int) -> tuple[float, int]:
    from narwhal_asyncio.engines import Waits

    loop = asyncio.get_running_loop()
    waits = Waits(loop)
    a, b = _pair()
    echo, _ = await loop.connect_accepted_socket(_Echo, b)
    trips = 0
    start = time.process_time()
    for _ in range(rounds):
        a.send(PING)
        trips += len(await receive(a, waits.readable))
    spent = time.process_time() - start
    echo.close()
    a.close()
    return spent, trips


async def _trio_task(rounds: int) -> tuple[float, int]:
    a, b = _pair()

    async def echo() -> None:
        while data := await receive(b, trio.lowlevel.wait_readable):
            b.send(data)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(echo)
        trips = 0
        start = time.process_time()
        for _ in range(rounds):
            a.send(PING)
            trips += len(await receive(a, trio.lowlevel.wait_readable))
        spent = time.process_time() - start
        a.close()
    b.close()
    return spent, trips


def _loops() -> list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]]:
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [("asyncio", asyncio.new_event_loop)]
    try:
        import uvloop
    except ImportError:
        return loops
    return [*loops, ("uvloop", uvloop.new_event_loop)]


def _on(factory: Callable[[], asyncio.AbstractEventLoop], coro: Any) -> tuple[float, int]:
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(coro)  # type: ignore[no-any-return]


def measure(rounds: int, repeats: int) -> list[tuple[str, float, int]]:
    """``(shape, best CPU seconds, round trips made)`` of each shape, the best of ``repeats`` runs."""
    rows: list[tuple[str, float, int]] = []
    for loop_name, factory in _loops():
        for shape, run in (("protocol", _asyncio_protocol), ("task", _asyncio_task)):
            best = min(_on(factory, run(rounds)) for _ in range(repeats))
            rows.append((f"{loop_name} {shape}", *best))
    rows.append(("trio task", *min(trio.run(_trio_task, rounds) for _ in range(repeats))))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    for name, spent, _ in measure(args.rounds, args.repeats):
        print(f"{name:18} {spent / args.rounds * 1e6:7.2f} µs CPU per round trip")


if __name__ == "__main__":
    main()
