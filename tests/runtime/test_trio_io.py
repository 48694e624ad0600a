"""trio's :class:`narwhal_trio.io.IO` watching the connections that read: one task, pauses, closes, the end.

Real socket pairs; each connection stands in for a client's or an engine
leg's (``sock``, ``reading``, ``readable()``, ``broken()``: what the IO
calls on them).
"""

from __future__ import annotations

import socket
from typing import Any

import trio
import trio.testing

from narwhal_trio.io import IO


class _Conn:
    """Reads whatever its socket has; ``reading`` until told otherwise."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reading = True
        self.got = bytearray()
        self.calls = 0
        self.broke = False
        self.arrived = trio.Event()

    def readable(self) -> None:
        self.calls += 1
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return
        self.got += data
        self.arrived.set()

    def broken(self) -> None:
        self.broke = True


def _pairs(n: int) -> list[tuple[socket.socket, socket.socket]]:
    pairs = [socket.socketpair() for _ in range(n)]
    for a, b in pairs:
        a.setblocking(False)
        b.setblocking(False)
    return pairs


def _run(body: Any) -> None:
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await body(IO(nursery))
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_one_task_reads_every_connection_and_a_batch_takes_one_wake_up() -> None:
    pairs = _pairs(8)

    async def body(io: IO) -> None:
        before = trio.lowlevel.current_statistics().tasks_living
        conns = [_Conn(b) for _, b in pairs]
        for conn in conns:
            io.read(conn, True)
        await trio.testing.wait_all_tasks_blocked()
        assert trio.lowlevel.current_statistics().tasks_living == before + 1  # one watcher, not eight
        for i, (a, _) in enumerate(pairs):
            a.send(b"x%d" % i)
        await conns[-1].arrived.wait()
        await trio.testing.wait_all_tasks_blocked()
        assert [bytes(c.got) for c in conns] == [b"x%d" % i for i in range(8)]
        assert all(c.calls == 1 for c in conns)

    _run(body)


def test_a_paused_connection_is_not_read_until_resumed_and_a_closed_one_never_again() -> None:
    (a1, b1), (a2, b2) = _pairs(2)

    async def body(io: IO) -> None:
        paused, closed = _Conn(b1), _Conn(b2)
        io.read(paused, True)
        io.read(closed, True)
        io.read(paused, False)  # still ``reading``: paused
        io.close_socket(b2)
        a1.send(b"held")
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.01)
        assert paused.calls == 0 and closed.calls == 0
        io.read(paused, True)
        await paused.arrived.wait()
        assert bytes(paused.got) == b"held"

    _run(body)


def test_a_connection_that_stops_reading_leaves_the_set() -> None:
    (a, b), = _pairs(1)

    async def body(io: IO) -> None:
        conn = _Conn(b)
        io.read(conn, True)
        a.send(b"one")
        await conn.arrived.wait()
        conn.reading = False  # (as a connection does once it has read its end)
        conn.arrived = trio.Event()
        a.send(b"two")
        await conn.arrived.wait()  # the IO sees ``reading`` after each call: this one still came
        a.send(b"three")
        await trio.testing.wait_all_tasks_blocked()
        await trio.sleep(0.01)
        assert conn.calls == 2 and bytes(conn.got) == b"onetwo"

    _run(body)


def test_cancelling_the_nursery_breaks_the_reading_and_the_paused_connections() -> None:
    pairs = _pairs(3)  # (held: a closed peer would make each socket readable, at EOF)
    conns = [_Conn(b) for _, b in pairs]

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            io = IO(nursery)
            for conn in conns:
                io.read(conn, True)
            io.read(conns[1], False)  # paused
            conns[2].reading = False
            io.read(conns[2], False)  # stopped: not the IO's any more
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [c.broke for c in conns] == [True, True, False]
