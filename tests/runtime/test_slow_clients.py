"""The send timeout's watch, for runtimes that see a client's unsent bytes only when they look (slow_clients.py)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace
from typing import Any

import trio

from narwhal_runtime.slow_clients import LOOKS, SendWatch


def test_a_client_that_takes_nothing_is_dropped_at_the_last_look_of_the_timeout() -> None:
    watch = SendWatch(1000)
    assert [watch.look(1000) for _ in range(LOOKS)] == ["again"] * (LOOKS - 1) + ["drop"]


def test_bytes_written_meanwhile_do_not_hide_that_none_was_taken() -> None:
    watch = SendWatch(1000)
    for _ in range(LOOKS - 1):
        watch.wrote(500)  # the buffer grows by what was written, no more and no less
        assert watch.look(watch.unsent + 500) == "again"
    watch.wrote(500)
    assert watch.look(watch.unsent + 500) == "drop"


def test_any_byte_taken_starts_the_timeout_again() -> None:
    watch = SendWatch(1000)
    for _ in range(LOOKS - 1):
        assert watch.look(1000) == "again"
    watch.wrote(500)
    assert watch.look(1499) == "again"  # one byte of the 1,500 was taken
    assert [watch.look(1499) for _ in range(LOOKS)] == ["again"] * (LOOKS - 1) + ["drop"]


def test_the_watch_ends_once_nothing_is_left_however_long_it_took() -> None:
    watch = SendWatch(1000)
    for _ in range(LOOKS - 1):
        assert watch.look(1000) == "again"
    assert watch.look(0) == "done"


# ------------------------------------------------------------ how each adapter feeds the rule


class _Transport:
    """What asyncio's ``send`` asks of a transport whose buffer keeps ``unsent`` bytes; counts the asks."""

    def __init__(self, unsent: int) -> None:
        self.unsent = unsent
        self.asked = 0

    def write(self, data: bytes) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        self.asked += 1
        return self.unsent


def test_asyncio_asks_the_transport_once_when_a_write_leaves_bytes_unsent() -> None:
    from narwhal_asyncio.server import Server, _Client

    async def main() -> tuple[int, int | None]:
        server: Any = SimpleNamespace(_look_every=60.0)
        client = _Client(server)
        client.transport = transport = _Transport(700)  # type: ignore[assignment]
        Server.send(server, client, b"x" * 1000, False)
        assert client.next_look is not None
        client.next_look.cancel()
        return transport.asked, None if client.watch is None else client.watch.unsent

    assert asyncio.run(main()) == (1, 700)  # the watch starts from the one answer


async def test_trios_send_loop_tells_each_byte_the_socket_takes() -> None:
    from narwhal_runtime.socket_io import send_all

    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    data = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes at once
    took: list[int] = []
    received = bytearray()

    async def read() -> None:
        while len(received) < len(data):
            await trio.lowlevel.wait_readable(b)
            received.extend(b.recv(65536))

    with a, b:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await send_all(a, data, trio.lowlevel.wait_writable, took.append)
    assert bytes(received) == data and sum(took) == len(data) and len(took) > 1
