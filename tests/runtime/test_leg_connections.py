"""The legs both adapters share (narwhal_runtime/leg_connections.py): commands and connections, over real socket pairs.

The runtime's side is a recording stand-in (how it spawns the task that
opens a connection, and how it watches and closes sockets); the end-to-end
suites run the same code on trio and asyncio.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal_core import LegData, LegFailed, StartLeg
from narwhal_core.config import parse_engine_url
from narwhal_runtime.leg_connections import Engines, LegConnection

URL = "http://127.0.0.1:9001"
REQUEST = b"GET / HTTP/1.1\r\n\r\n"


class _Task:
    def __init__(self, calls: list[tuple[str, Any]], conn: LegConnection) -> None:
        self.calls = calls
        self.conn = conn

    def cancel(self) -> None:
        self.calls.append(("stop opening", self.conn))


class _IO:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, bool | None]] = []
        #: The tasks spawned: ("open", leg key).
        self.spawned: list[tuple[str, Any]] = []

    def spawn(self, function: Any, conn: LegConnection, cmd: StartLeg) -> _Task:
        assert function.__name__ == "open_connection"
        self.spawned.append(("open", cmd.leg))
        return _Task(self.spawned, conn)

    def close_socket(self, sock: socket.socket) -> None:
        sock.close()

    def read(self, conn: Any, read: bool) -> None:
        self.calls.append(("read", conn, read))

    def write(self, conn: Any, wait: bool) -> None:
        self.calls.append(("write", conn, wait))

    def ended(self, conn: Any) -> None:
        self.calls.append(("ended", conn, None))
        conn.sock.close()


class Recording(Engines):
    def __init__(self, pool_size: int = 2) -> None:
        self.fed: list[Any] = []
        self.io_: _IO = _IO()
        super().__init__(self.io_, self.fed.append, pool_size)  # type: ignore[arg-type]
        self.calls = self.io_.spawned
        self.peers: list[socket.socket] = []

    def opened(self, key: str) -> tuple[LegConnection, socket.socket]:
        """Leg ``key``'s connection, now open over a socket pair: what the runtime's task does once connected."""
        conn = self._pool.legs[key]
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        theirs.setblocking(False)
        self.peers.append(theirs)
        conn.sock = ours
        conn.send(REQUEST)
        conn.reading = True
        return conn, theirs


def start(key: str, *, fresh: bool = False) -> StartLeg:
    return StartLeg(key, parse_engine_url(URL, key="engine"), REQUEST, None, 1.0, fresh)


@pytest.fixture
def legs() -> Iterator[Recording]:
    legs = Recording()
    yield legs
    for peer in legs.peers:
        peer.close()


def test_a_leg_opens_a_connection_attached_to_it_at_once(legs: Recording) -> None:
    legs.start_leg(start("a"))
    assert legs.calls == [("open", "a")]
    conn = legs._pool.legs["a"]
    assert conn.leg == "a" and conn.sock is None and not legs.unsent  # it writes its own request once open


def test_a_finished_leg_s_connection_carries_the_next_leg_and_writes_it_with_the_batch(legs: Recording) -> None:
    legs.start_leg(start("a"))
    conn, engine = legs.opened("a")
    assert engine.recv(100) == REQUEST
    legs.finish_leg("a", True)
    assert conn.leg is None and not conn.closed  # kept, idle, still read
    legs.start_leg(start("b"))
    assert legs._pool.legs["b"] is conn and legs.calls == [("open", "a")]
    with pytest.raises(BlockingIOError):
        engine.recv(100)  # not written yet: it waits for the batch's journal records
    legs.write_unsent()
    assert engine.recv(100) == REQUEST
    legs.start_leg(start("c", fresh=True))  # the router asks for a fresh one after a stale failure
    assert legs.calls[-1] == ("open", "c")


def test_cancel_and_finish_reach_the_connection_only_for_a_running_leg() -> None:
    legs = Recording(pool_size=0)
    legs.start_leg(start("a"))
    conn, _ = legs.opened("a")
    legs.finish_leg("a", True)
    assert conn.closed and legs.io_.calls[-1] == ("ended", conn, None)  # the pool holds none: closed
    calls = len(legs.io_.calls)
    legs.cancel_leg("a")
    legs.finish_leg("a", True)
    assert len(legs.io_.calls) == calls
    legs.start_leg(start("b"))
    connecting = legs._pool.legs["b"]
    legs.cancel_leg("b")
    assert legs.calls[-1] == ("stop opening", connecting) and connecting.leg is None


def test_no_leg_starts_once_closing(legs: Recording) -> None:
    legs.stopped = True
    legs.start_leg(start("a"))
    assert legs.calls == [] and not legs._pool.legs


def test_what_the_engine_sends_is_the_leg_s_and_its_close_ends_the_answer(legs: Recording) -> None:
    legs.start_leg(start("a"))
    conn, engine = legs.opened("a")
    assert engine.recv(100) == REQUEST
    engine.send(b"HTTP/1.1 200 OK\r\n")
    conn.readable()
    engine.close()
    conn.readable()
    assert legs.fed == [LegData("a", b"HTTP/1.1 200 OK\r\n"), LegData("a", b"")]
    assert conn.closed and ("ended", conn, None) in legs.io_.calls


def test_a_reused_connection_the_engine_closed_before_any_byte_fails_the_leg_as_stale(legs: Recording) -> None:
    legs.start_leg(start("a"))
    conn, engine = legs.opened("a")
    legs.finish_leg("a", True)
    legs.start_leg(start("b"))
    legs.write_unsent()
    engine.close()
    conn.readable()
    assert legs.fed == [LegFailed("b", "dropped", True)]


def test_an_idle_connection_that_speaks_is_closed_and_nothing_is_fed(legs: Recording) -> None:
    legs.start_leg(start("a"))
    conn, engine = legs.opened("a")
    legs.finish_leg("a", True)
    engine.send(b"junk")
    conn.readable()
    assert conn.closed and legs.fed == []
    legs.start_leg(start("b"))
    assert legs.calls[-1] == ("open", "b")  # not the closed one


def test_a_request_the_socket_cannot_take_at_once_is_finished_when_it_can(legs: Recording) -> None:
    legs.start_leg(start("a"))
    conn, engine = legs.opened("a")
    big = b"x" * (4 << 20)
    conn.send(big)
    assert conn.out and ("write", conn, True) in legs.io_.calls
    received = len(engine.recv(1 << 20))
    while conn.out:
        try:
            received += len(engine.recv(1 << 20))
        except BlockingIOError:
            pass
        conn.writable()
    while received < len(REQUEST) + len(big):
        received += len(engine.recv(1 << 20))
    assert received == len(REQUEST) + len(big) and legs.io_.calls[-1] == ("write", conn, False)
