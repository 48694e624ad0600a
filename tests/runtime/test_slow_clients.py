"""The client connection both runtimes run (narwhal_runtime/client_connections.py), over real socket pairs.

What the connection is lent (:class:`ClientConnections`) is a stand-in here: its clock is
set by the test and its timers fire when the test says, so each rule is
checked at the exact second it must act (slow_clients.py, the lingering
close). The end-to-end suites run the same connection on trio and asyncio.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from narwhal_core import ClientConnected, ClientData, ClientGone, ClientStalled
from narwhal_runtime.client_connections import ClientConnection
from narwhal_runtime.driver import HIGH_WATER, LINGER_S

TIMEOUT = 30.0


class _Timer:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _IO:
    """A runtime stand-in: a clock the test sets, timers the test fires, and a record of what it was asked."""

    send_timeout_s = TIMEOUT

    def __init__(self) -> None:
        self.clock = 100.0
        self.fed: list[Any] = []
        self.timers: list[_Timer] = []
        self.calls: list[tuple[str, bool]] = []
        self.ended_conns: list[ClientConnection] = []
        self.releases = 0

    def feed(self, event: Any) -> None:
        self.fed.append(event)

    def now(self) -> float:
        return self.clock

    def later(self, delay: float, callback: Callable[[], None]) -> _Timer:
        timer = _Timer(self.clock + delay, callback)
        self.timers.append(timer)
        return timer

    def fire_until(self, when: float) -> None:
        """Move the clock to ``when``, firing each timer due by then, in order."""
        while due := sorted((t for t in self.timers if not t.cancelled and t.when <= when), key=lambda t: t.when):
            timer = due[0]
            self.timers.remove(timer)
            self.clock = timer.when
            timer.callback()
        self.clock = when

    def read(self, conn: ClientConnection, read: bool) -> None:
        self.calls.append(("read", read))

    def write(self, conn: ClientConnection, wait: bool) -> None:
        self.calls.append(("write", wait))

    def soon(self, callback: Callable[..., object], *args: Any) -> None:
        callback(*args)  # (the test's loop turn is now)

    def ended(self, conn: ClientConnection) -> None:
        self.ended_conns.append(conn)
        conn.sock.close()

    def released(self, conn: ClientConnection) -> None:
        self.releases += 1

    @staticmethod
    def closing(conn: ClientConnection) -> bool:
        return False  # (the driver's: the router is not closing it)


@pytest.fixture
def pair() -> Iterator[tuple[ClientConnection, _IO, socket.socket]]:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        theirs = socket.create_connection(listening.getsockname())
        ours, _ = listening.accept()
    for sock in (ours, theirs):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    ours.setblocking(False)
    theirs.setblocking(False)
    io = _IO()
    conn = ClientConnection(ours, io)  # type: ignore[arg-type]
    conn.start()
    yield conn, io, theirs
    theirs.close()
    ours.close()


def _fill(conn: ClientConnection) -> None:
    """Write until some bytes are left unsent (the peer reads nothing)."""
    while not conn.out:
        conn.send(b"x" * 65536, False)


def _drain(theirs: socket.socket) -> int:
    got = 0
    while True:
        try:
            data = theirs.recv(1 << 20)
        except BlockingIOError:
            return got
        got += len(data)


def test_a_connection_tells_the_router_and_reads(pair: Any) -> None:
    conn, io, theirs = pair
    assert isinstance(io.fed[0], ClientConnected) and io.fed[0].conn is conn
    assert io.calls == [("read", True)]
    theirs.send(b"GET / HTTP/1.1\r\n")
    conn.readable()
    assert io.fed[1] == ClientData(conn, b"GET / HTTP/1.1\r\n")


def test_a_client_that_takes_nothing_is_dropped_send_timeout_s_after_the_first_unsent_byte(pair: Any, caplog) -> None:
    conn, io, theirs = pair
    _fill(conn)
    assert ("write", True) in io.calls
    io.fire_until(100.0 + TIMEOUT - 0.001)
    assert not conn.closed
    io.fire_until(100.0 + TIMEOUT)
    assert conn.closed and io.ended_conns == [conn] and io.releases == 1
    assert io.fed[-1] == ClientGone(conn)  # the router hears it is gone


def test_each_byte_taken_moves_the_send_timeout_on(pair: Any) -> None:
    conn, io, theirs = pair
    _fill(conn)
    conn.send(b"y" * (1 << 20), False)  # more than the socket can take after one read
    io.fire_until(100.0 + TIMEOUT / 2)
    assert _drain(theirs) > 0
    conn.writable()  # the socket took some, not all: the last byte taken is now
    assert conn.out
    io.fire_until(100.0 + TIMEOUT)  # the first deadline: not due any more
    assert not conn.closed
    io.fire_until(100.0 + TIMEOUT / 2 + TIMEOUT - 0.001)
    assert not conn.closed
    io.fire_until(100.0 + TIMEOUT / 2 + TIMEOUT)
    assert conn.closed and io.fed[-1] == ClientGone(conn)


def test_a_client_that_takes_everything_is_not_dropped_however_long_it_took(pair: Any) -> None:
    conn, io, theirs = pair
    _fill(conn)
    io.fire_until(100.0 + TIMEOUT - 1)
    while conn.out:
        _drain(theirs)
        conn.writable()
    assert ("write", False) in io.calls
    io.fire_until(100.0 + 10 * TIMEOUT)
    assert not conn.closed and not any(isinstance(e, ClientGone) for e in io.fed)


def test_a_client_that_read_while_the_loop_was_late_to_say_so_is_not_dropped(pair: Any) -> None:
    """The timer comes due before the loop reports the room the client made (this process was paused)."""
    conn, io, theirs = pair
    _fill(conn)
    assert _drain(theirs) > 0  # the client read, but conn.writable() was never called
    io.fire_until(100.0 + TIMEOUT)
    assert not conn.closed and not any(isinstance(e, ClientGone) for e in io.fed)
    assert conn.out == [] or conn.timer is not None  # all sent, or the next deadline armed from the bytes just taken
    # A client that still reads nothing after that is dropped one timeout later, as ever.
    _fill(conn)
    io.fire_until(io.clock + TIMEOUT)
    assert conn.closed and io.fed[-1] == ClientGone(conn)


class _Leg:
    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def test_a_client_far_behind_is_held_until_it_took_every_byte(pair: Any) -> None:
    conn, io, theirs = pair
    leg = _Leg()
    conn.relays.add(leg)  # a leg relaying to it (legs.Engines._link)
    _fill(conn)
    assert not conn.held and not any(isinstance(e, ClientStalled) for e in io.fed)
    while conn.unsent <= HIGH_WATER:
        conn.send(b"y" * 65536, False)
    # Held: the client is not read (no next request), nor is the leg; the router hears it.
    assert conn.held and leg.paused and io.calls[-1] == ("read", False)
    assert io.fed[-1] == ClientStalled(conn, True)
    conn.send(b"z" * 65536, False)
    assert [e for e in io.fed if isinstance(e, ClientStalled)] == [ClientStalled(conn, True)]  # told once
    while conn.out:
        _drain(theirs)
        conn.writable()
    assert not conn.held and not leg.paused and ("read", True) in io.calls[-2:]
    assert io.fed[-1] == ClientStalled(conn, False)


def test_narwhals_close_waits_for_the_queued_bytes_then_lingers(pair: Any) -> None:
    conn, io, theirs = pair
    _fill(conn)
    conn.send(b"last", True)
    assert not conn.closed and not conn.lingering  # bytes still queued: the close waits for them
    received = b""
    while conn.out:
        received_now = _drain(theirs)
        received += b"." * received_now
        conn.writable()
    assert conn.closed and conn.lingering and io.releases == 1  # its slot is free at once
    # What the client still sends is read and dropped, not fed.
    fed = len(io.fed)
    theirs.send(b"more")
    conn.readable()
    assert len(io.fed) == fed and conn.discarded == 4
    io.fire_until(io.clock + LINGER_S)
    assert io.ended_conns == [conn]
    assert not any(isinstance(e, ClientGone) for e in io.fed)  # the router closed it: nothing to tell


def test_the_clients_eof_ends_the_lingering_at_once(pair: Any) -> None:
    conn, io, theirs = pair
    conn.send(b"bye", True)
    assert conn.lingering
    theirs.shutdown(socket.SHUT_WR)
    conn.readable()
    assert io.ended_conns == [conn]


def test_eof_on_a_connection_the_router_keeps_ends_it_and_the_router_hears(pair: Any) -> None:
    conn, io, theirs = pair
    theirs.shutdown(socket.SHUT_WR)
    conn.readable()
    assert io.fed[-2:] == [ClientData(conn, b""), ClientGone(conn)]
    assert io.ended_conns == [conn] and ("read", False) in io.calls


def test_eof_while_the_router_closes_stops_reading_and_closes_once_the_bytes_are_out(pair: Any) -> None:
    conn, io, theirs = pair
    _fill(conn)
    conn.send(b"", True)  # the router's close, behind queued bytes
    theirs.shutdown(socket.SHUT_WR)
    conn.readable()
    assert ("read", False) in io.calls and not conn.closed
    assert not any(isinstance(e, ClientGone) for e in io.fed)
    while conn.out:
        _drain(theirs)
        conn.writable()
    assert io.ended_conns == [conn] and not conn.lingering  # nothing to linger for: the client closed already


def test_a_broken_socket_tells_the_router_once(pair: Any) -> None:
    conn, io, theirs = pair
    theirs.close()
    conn.send(b"x" * 65536, False)
    conn.send(b"x" * 65536, False)
    conn.readable()
    assert [e for e in io.fed if isinstance(e, ClientGone)] == [ClientGone(conn)]
    assert io.releases == 1
