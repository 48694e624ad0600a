"""What one read costs in each shape a connection could take: a protocol callback, a readiness callback, a task.

    python benchmarks/read_shapes.py [--rounds N] [--repeats K] [--shape NAME]

Why the connections both runtimes share (clients, legs) are driven by the
loop's readiness callbacks on asyncio, not by a task that waits for the
socket: each leg answer and each client request is a read, several per
request.
This times a ping-pong over a socket pair, one byte each way, ``N`` rounds,
the best of ``K`` repeats, in CPU microseconds per round trip (one read on
each side):

* ``asyncio protocol``: both ends ``asyncio.Protocol`` (``data_received``
  writes the answer), as the asyncio adapter read clients and engines
  before stop 38;
* ``asyncio reader``: the measured end a plain socket the loop watches
  (``add_reader``), its callback receiving and answering, as the shared
  client and leg connections are driven on asyncio
  (:mod:`narwhal_runtime.client_connections`, :mod:`narwhal_runtime.leg_connections`);
* ``asyncio task``: the measured end a task that waits with the shared
  :func:`~narwhal_runtime.socket_io.receive` and the asyncio adapter's
  ``Waits.readable``, the echo end a protocol as above;
* ``trio task``: the measured end the same shared ``receive`` with trio's
  ``wait_readable``, the echo end a trio task.

Each asyncio row runs on the standard loop and, when it is installed, on
uvloop (what ``narwhal serve`` runs). Each row is timed in an interpreter
of its own (``--shape``): what the C allocator does with the standard
transport's 256 KiB read buffers depends on what the process allocated
before. The figures go to benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
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


async def _echoed() -> tuple[asyncio.AbstractEventLoop, socket.socket, asyncio.BaseTransport]:
    """The running loop, and the measured end of a socket pair whose other end a protocol echoes (its transport)."""
    loop = asyncio.get_running_loop()
    a, b = _pair()
    echo, _ = await loop.connect_accepted_socket(_Echo, b)
    return loop, a, echo


async def _asyncio_protocol(rounds: int) -> tuple[float, int]:
    loop, a, echo = await _echoed()
    done: asyncio.Future[int] = loop.create_future()
    start = time.process_time()
    transport, _ = await loop.connect_accepted_socket(lambda: _Pinger(rounds, done), a)
    trips = await done
    spent = time.process_time() - start
    transport.close()
    echo.close()
    return spent, trips


async def _asyncio_reader(rounds: int) -> tuple[float, int]:
    loop, a, echo = await _echoed()
    done: asyncio.Future[int] = loop.create_future()
    left, trips = rounds, 0

    def readable() -> None:
        nonlocal left, trips
        data = a.recv(65536)
        trips += len(data)
        left -= 1
        if left:
            a.send(data)
        else:
            loop.remove_reader(a.fileno())
            done.set_result(trips)

    start = time.process_time()
    loop.add_reader(a.fileno(), readable)
    a.send(PING)
    await done
    spent = time.process_time() - start
    echo.close()
    a.close()
    return spent, trips


async def _asyncio_task(rounds: int) -> tuple[float, int]:
    from narwhal_asyncio.io import IO

    loop, a, echo = await _echoed()
    waits = IO(loop)
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


def _loops() -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {"asyncio": asyncio.new_event_loop}
    try:
        import uvloop
    except ImportError:
        return loops
    return {**loops, "uvloop": uvloop.new_event_loop}


_ASYNCIO_SHAPES = {
    "protocol": _asyncio_protocol, "reader": _asyncio_reader, "task": _asyncio_task,
}


def shapes() -> list[str]:
    """The rows :func:`measure` times, in order."""
    return [f"{loop} {shape}" for loop in _loops() for shape in _ASYNCIO_SHAPES] + ["trio task"]


def measure_here(shape: str, rounds: int, repeats: int) -> tuple[float, int]:
    """``(best CPU seconds, round trips made)`` of one shape, timed in this interpreter."""
    if shape == "trio task":
        return min(trio.run(_trio_task, rounds) for _ in range(repeats))
    loop, kind = shape.split()
    factory, run = _loops()[loop], _ASYNCIO_SHAPES[kind]
    results = []
    for _ in range(repeats):
        with asyncio.Runner(loop_factory=factory) as runner:
            results.append(runner.run(run(rounds)))
    return min(results)


def measure(rounds: int, repeats: int) -> list[tuple[str, float, int]]:
    """``(shape, best CPU seconds, round trips made)`` of each shape, each timed in a new interpreter."""
    rows: list[tuple[str, float, int]] = []
    for shape in shapes():
        out = subprocess.run(
            [sys.executable, __file__, "--shape", shape, "--rounds", str(rounds), "--repeats", str(repeats), "--json"],
            check=True, capture_output=True, text=True,
        ).stdout
        spent, trips = json.loads(out)
        rows.append((shape, spent, trips))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shape", choices=shapes(), help="time this shape alone, here")
    parser.add_argument("--json", action="store_true", help="with --shape: print [CPU seconds, round trips]")
    args = parser.parse_args()
    if args.shape:
        spent, trips = measure_here(args.shape, args.rounds, args.repeats)
        print(json.dumps([spent, trips]) if args.json else f"{spent / args.rounds * 1e6:.2f} µs")
        return
    for name, spent, _ in measure(args.rounds, args.repeats):
        print(f"{name:18} {spent / args.rounds * 1e6:7.2f} µs CPU per round trip")


if __name__ == "__main__":
    main()
