"""A client connection, the same on both runtimes: reads, writes, the send timeout, backpressure, the lingering close.

A :class:`ClientConnection` is a plain non-blocking socket and what
Narwhal does with it. The runtime only tells it when the socket is ready
(:meth:`ClientConnection.readable`, :meth:`ClientConnection.writable`) and
lends what it needs: its clock, a timer, and how it watches and closes a
socket (:class:`~.runtime_io.RuntimeIO`); :class:`ClientConnections` adds
the driver's feed and the listener's slots. asyncio watches the socket
with its loop's ``add_reader``/``add_writer`` (on uvloop this costs what a
transport's ``data_received`` does: benchmarks/README.md, "What one read costs"); trio
with a task that waits for it. The connection is its own handle in the
router's events and commands.

What happens to bytes a client does not take (backpressure, the send
timeout) is narwhal_runtime/slow_clients.py; the lingering close is
:data:`~narwhal_runtime.driver.LINGER_S`; what is still queued when the
server stops gets :data:`EXIT_FLUSH_S` (:meth:`ClientConnections.aclose`),
on both runtimes.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from narwhal_core import ClientConnected, ClientData, ClientGone, ClientStalled, Event

from .driver import HIGH_WATER, LINGER_S, keep_lingering
from .runtime_io import Handle, RuntimeIO
from .slow_clients import log_send_timeout
from .socket_options import READ_SIZE

__all__ = ["ClientConnection", "ClientConnections", "EXIT_FLUSH_S"]

#: Seconds the last client connections get to take their bytes when the server stops.
EXIT_FLUSH_S = 1.0


class ClientConnections:
    """A server's client connections: what each is lent, which are live, and their end.

    Each :class:`ClientConnection` is lent the runtime's clock, timers and
    socket callbacks (:class:`~.runtime_io.RuntimeIO`), the driver's feed and
    ``closing``, ``ingress.send_timeout_s``, and its listener's connection
    slot. :meth:`start` is the listener's ``start_client``; :meth:`aclose`
    the exit flush.
    """

    def __init__(self, io: RuntimeIO, feed: Callable[[Event], object], closing: Callable[[Any], bool], *,
                 send_timeout_s: float, release: Callable[[], None]) -> None:
        self._io = io
        # The runtime's own bound methods, so a connection's call goes straight to them.
        self.now, self.later, self.soon, self.read, self.write = io.now, io.later, io.soon, io.read, io.write
        #: Feed the driver (synchronously).
        self.feed = feed
        #: ``driver.closing``: whether the router closed a connection, or is closing it.
        self.closing = closing
        self.send_timeout_s = send_timeout_s
        self._release = release
        #: Every connection not yet ended (holding its slot, or lingering after Narwhal closed it).
        self.live: set[ClientConnection] = set()
        #: Serving is over: a connection accepted now is closed unheard.
        self.stopped = False

    def start(self, sock: socket.socket, listener: object = None) -> None:
        """Serve the accepted ``sock`` (it holds a slot of ``listener``'s)."""
        conn = ClientConnection(sock, self)
        self.live.add(conn)
        if self.stopped:
            conn.end()  # the router never hears of it
        else:
            conn.start()

    def ended(self, conn: ClientConnection) -> None:
        """``conn`` is over: stop watching its socket, and close it."""
        self._io.ended(conn)
        self.live.discard(conn)

    def released(self, conn: ClientConnection) -> None:
        """Narwhal is done with ``conn``: its connection slot is free."""
        self._release()

    async def aclose(self) -> None:
        """The exit flush: the last bytes get :data:`EXIT_FLUSH_S` to leave, then what is left is cut.

        After a drain the router has closed every connection; if serving was
        cancelled instead, each connection cut tells the router.
        """
        self.stopped = True
        live = self.live
        for conn in list(live):
            if conn.lingering:
                conn.end()
        io = self._io
        deadline = io.now() + EXIT_FLUSH_S
        while any(conn.out for conn in live) and io.now() < deadline:
            await io.sleep_until(min(deadline, io.now() + 0.01))
        for conn in list(live):
            conn.broken()


class ClientConnection:
    """One client connection; see the module docstring."""

    __slots__ = (
        "sock", "connections", "out", "unsent", "close_after", "closed", "held", "lingering", "discarded",
        "taken_at", "timer", "slot", "reading", "relays",
    )

    def __init__(self, sock: socket.socket, connections: ClientConnections) -> None:
        self.sock = sock
        self.connections = connections
        #: Bytes the socket has still to take, in order, and how many.
        self.out: list[bytes | memoryview] = []
        self.unsent = 0
        #: Close once every unsent byte is taken (Narwhal's close came after bytes still queued).
        self.close_after = False
        #: Narwhal closed its side (lingering) or the connection ended: the router is done with it.
        self.closed = False
        #: More than HIGH_WATER unsent bytes: neither it nor the legs relaying to it are read.
        self.held = False
        #: Narwhal's side is shut; what the client still sends is dropped until LINGER_S is over.
        self.lingering = False
        self.discarded = 0
        #: When the socket last took bytes, and the send timeout's or the linger's timer.
        self.taken_at = 0.0
        self.timer: Handle | None = None
        #: Holds a connection slot (``ingress.max_connections``) until released.
        self.slot = True
        #: The runtime calls :meth:`readable` (until EOF or the end), unless the connection is held.
        self.reading = False
        #: The engine leg connections relaying to it (:meth:`~.leg_connections.Engines._link`), held with it.
        self.relays: set[Any] = set()

    def start(self) -> None:
        """Tell the router of the connection and start reading it."""
        try:
            host, port = self.sock.getpeername()[:2]
        except OSError:  # gone before it was served: the router never hears of it
            self.end()
            return
        self.connections.feed(ClientConnected(self, str(host), int(port)))
        if not self.closed:
            self.reading = True
            self.connections.read(self, True)

    # ------------------------------------------------------------ reading

    def readable(self) -> None:
        """The socket has bytes, or EOF, or an error."""
        try:
            data = self.sock.recv(READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            self.broken()
            return
        if self.lingering:
            self.discarded += len(data)
            if not data or not keep_lingering(self.discarded):
                self.end()  # the client closed too, or sends too much
            return
        if data:
            if not self.closed:
                self.connections.feed(ClientData(self, data))
        elif self.router_closed():
            self._stop_reading()  # EOF, and the router's close is coming: nothing more to read
        else:
            self.connections.feed(ClientData(self, data))  # EOF
            if not self.router_closed():
                # The client closed its side and the router kept the connection: it ends here.
                self.broken()

    # ------------------------------------------------------------ writing

    def send(self, data: bytes, close: bool) -> None:
        """The driver's ``send``: write ``data``, then close if ``close`` (after every byte is taken)."""
        if self.closed:
            return
        if close:
            self.close_after = True
        if self.out:
            if data:  # queued behind what the socket has still to take
                self.out.append(data)
                self.unsent += len(data)
                self._hold_if_far_behind()
            return
        if data:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.broken()
                return
            if sent < len(data):
                rest = memoryview(data)[sent:]
                self.out.append(rest)
                self.unsent = len(rest)
                self.taken_at = self.connections.now()
                self.timer = self.connections.later(self.connections.send_timeout_s, self._send_timeout)
                self.connections.write(self, True)
                self._hold_if_far_behind()
                return
        if self.close_after:
            self._close()

    def writable(self) -> None:
        """The socket can take bytes: send what is queued."""
        out = self.out
        data = out[0] if len(out) == 1 else b"".join(out)
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            return
        except OSError:
            self.broken()
            return
        if sent:
            self.taken_at = self.connections.now()
        if sent < len(data):
            self.out = [memoryview(data)[sent:]]
            self.unsent = len(data) - sent
            return
        self.out = []
        self.unsent = 0
        self.connections.write(self, False)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.held:
            self._hold(False)
        if self.close_after:
            self._close()

    def _hold_if_far_behind(self) -> None:
        if not self.held and self.unsent > HIGH_WATER:
            self._hold(True)

    def _hold(self, held: bool) -> None:
        # Backpressure (slow_clients.py): the client's next request and the legs relaying to it wait.
        self.held = held
        if self.reading:
            self.connections.read(self, not held)
        for leg in self.relays:
            if held:
                leg.pause()
            else:
                leg.resume()
        if not self.closed:
            # The legs wait for the client (and those started meanwhile start
            # paused): their engines' silence is not their fault.
            self.connections.soon(self.connections.feed, ClientStalled(self, held))

    def _send_timeout(self) -> None:
        # The send timeout (slow_clients.py): none of the bytes taken for send_timeout_s.
        timeout = self.connections.send_timeout_s
        if self.out and self.connections.now() >= self.taken_at + timeout:
            # Offer the bytes once more before giving up: after a long pause of this
            # process (a collector's, a CPU burst) the timer can be served before the
            # loop reports that a client which kept reading has room again.
            self.timer = None
            self.writable()
            if self.closed or not self.out:
                return
        due = self.taken_at + timeout
        if self.connections.now() < due:
            self.timer = self.connections.later(due - self.connections.now(), self._send_timeout)
            return
        self.timer = None
        log_send_timeout(timeout, self.unsent)
        self.broken()  # it cannot hold a slot forever

    # ------------------------------------------------------------ ending

    def _close(self) -> None:
        # Lingering close: shut our side, drop what the client still sends, close after LINGER_S.
        self.closed = True
        self._release()  # the router is done with it: its slot is free
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.end()
            return
        if not self.reading:
            self.end()  # the client closed its side already: nothing to linger for
            return
        self.lingering = True
        self.timer = self.connections.later(LINGER_S, self.end)
        if self.held:
            self._hold(False)  # (read again: the lingering reads what comes)

    def broken(self) -> None:
        """The socket failed, or the client went: end it, and tell the router unless it closed it."""
        tell = not self.router_closed()
        self.end()
        if tell:
            self.connections.feed(ClientGone(self))

    def router_closed(self) -> bool:
        """The router is done with the connection (it closed it, maybe in the batch not yet performed)."""
        return self.closed or self.close_after or self.connections.closing(self)

    def _stop_reading(self) -> None:
        if self.reading:
            self.reading = False
            self.connections.read(self, False)

    def end(self) -> None:
        """End the connection now (the router is done with it, or must hear it is gone: :meth:`broken`)."""
        self._stop_reading()
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.out:
            self.out = []
            self.connections.write(self, False)
        self.unsent = 0
        if self.held:
            self._hold(False)
        self.connections.ended(self)
        self._release()

    def _release(self) -> None:
        if self.slot:
            self.slot = False
            self.connections.released(self)

