"""Engine connections on trio: the I/O of legs (:mod:`narwhal_runtime.legs`) and control requests.

One task per engine connection (not per leg) reads whatever the engine
sends, also while the connection is idle; a leg on a pooled connection is
written straight from the flush (a non-blocking ``send``, a task finishing
what the socket could not take); a new connection is opened by the task
that then serves it. Sockets are plain non-blocking ones driven with
:func:`trio.lowlevel.wait_readable` / :func:`~trio.lowlevel.wait_writable`:
a ``SocketStream`` call costs several times the ``recv`` it wraps. Closing
a socket another task may wait on goes through
:func:`trio.lowlevel.notify_closing`.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from narwhal_core import Event, StartControl, StartLeg
from narwhal_core.events import LegFailure
from narwhal_runtime.control import TimeLimitExpired, run_control
from narwhal_runtime.legs import EngineLegs, connect_failure
from narwhal_runtime.pool import PooledConnection
from narwhal_runtime.socket_io import send_all
from narwhal_runtime.socket_options import READ_SIZE

__all__ = ["Engines", "Waits", "close_socket", "receive"]


def close_socket(sock: socket.socket) -> None:
    """Close ``sock``, waking any task waiting on it with :class:`trio.ClosedResourceError`."""
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()


async def receive(sock: socket.socket) -> bytes | None:
    """The next bytes from ``sock`` (``b""`` at EOF), once some arrive; ``None`` once it is closed or broken."""
    while True:
        try:
            await trio.lowlevel.wait_readable(sock)
            return sock.recv(READ_SIZE)
        except BlockingIOError:
            continue
        except (trio.ClosedResourceError, OSError):
            return None


class Waits:
    """trio's socket waits (:class:`~narwhal_runtime.socket_io.SocketWaits`)."""

    @staticmethod
    async def readable(sock: socket.socket) -> None:
        await trio.lowlevel.wait_readable(sock)

    @staticmethod
    async def writable(sock: socket.socket) -> None:
        await trio.lowlevel.wait_writable(sock)

    @staticmethod
    def close_socket(sock: socket.socket) -> None:
        close_socket(sock)


class _Connection(PooledConnection):
    """One keep-alive connection to an engine, and the task serving it."""

    __slots__ = ("sock", "scope")

    def __init__(self, url: str) -> None:
        super().__init__(url)
        #: ``None`` while connecting.
        self.sock: socket.socket | None = None
        #: The connect in progress, cancelled by a CancelLeg.
        self.scope: trio.CancelScope | None = None


class Engines(Waits, EngineLegs[_Connection]):
    """Legs (:class:`~narwhal_runtime.legs.EngineLegs`) and control requests for one router, on one nursery."""

    def __init__(self, nursery: trio.Nursery, feed: Callable[[Event], Awaitable[None]], *, pool_size: int) -> None:
        super().__init__(feed, pool_size)
        self._nursery = nursery

    def _open(self, cmd: StartLeg) -> _Connection:
        conn = _Connection(cmd.engine.url)
        self._nursery.start_soon(self._connect, conn, cmd)
        return conn

    def write_unsent(self) -> bool:
        """Write the queued leg requests; return whether a task was started to finish one."""
        started = False
        for conn, data in self._pool.take_unsent():
            assert conn.sock is not None
            try:
                sent = conn.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                # A broken socket: its task wakes up to the error and
                # reports the leg (the router retries a stale connection).
                continue
            if sent < len(data):
                self._nursery.start_soon(self._send_rest, conn, memoryview(data)[sent:])
                started = True
        return started

    def _finished(self, conn: _Connection, kept: bool) -> None:
        if not kept:
            self._close(conn)  # a kept one's task reads on

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in its own task (:func:`~narwhal_runtime.control.run_control`)."""
        self._nursery.start_soon(run_control, cmd, self)

    async def aclose(self) -> None:
        """Close every connection (their tasks report the legs they carried)."""
        self._closed = True
        for conn in self._pool.all_connections():
            self._close(conn)

    # connections

    def _close(self, conn: _Connection) -> None:
        """Close ``conn``: a cancelled leg's, one not kept, or at shutdown."""
        conn.closed = True
        if conn.sock is not None:
            close_socket(conn.sock)  # wakes its task's wait with ClosedResourceError
        elif conn.scope is not None:
            conn.scope.cancel()  # still connecting

    _cancelled = _close

    async def _fail(self, conn: _Connection, reason: LegFailure) -> None:
        event = self._pool.failed(conn, reason)  # None: the leg was cancelled, the router knows
        if event is not None:
            await self._feed(event)

    async def _connect(self, conn: _Connection, cmd: StartLeg) -> None:
        try:
            try:
                with trio.CancelScope() as scope:
                    conn.scope = scope
                    sock = await self.connect(cmd.engine.host, cmd.engine.port, cmd.connect_timeout)
            except (TimeLimitExpired, OSError) as exc:
                await self._fail(conn, connect_failure(exc))
                return
            conn.scope = None
            if scope.cancelled_caught:
                return  # CancelLeg while connecting: the router knows
            conn.sock = sock
            if conn.closed:  # cancelled just as the connection opened
                close_socket(sock)
                return
            try:
                await send_all(sock, cmd.data, trio.lowlevel.wait_writable)
            except (trio.ClosedResourceError, OSError):
                await self._fail(conn, "dropped")
                close_socket(sock)
                return
        except BaseException:
            # Cancelled from outside (shutdown): the router must not think the leg still runs.
            with trio.CancelScope(shield=True):
                await self._fail(conn, "dropped")
            raise
        await self._serve(conn)

    async def _send_rest(self, conn: _Connection, rest: memoryview) -> None:
        # The rare leg request a socket could not take at once.
        assert conn.sock is not None
        try:
            await send_all(conn.sock, rest, trio.lowlevel.wait_writable)
        except (trio.ClosedResourceError, OSError):
            pass  # the connection's own task reports the broken socket

    async def _serve(self, conn: _Connection) -> None:
        """Read the connection until it closes, feeding what arrives to the leg it carries."""
        sock = conn.sock
        assert sock is not None
        try:
            while not conn.closed:
                data = await receive(sock)
                if data is None and conn.closed:
                    return  # we closed it: the router knows why
                if not data:
                    end = self._pool.ended(conn, reset=data is None)
                    if end is not None:
                        await self._feed(end)
                    return
                event = self._pool.received(conn, data)
                if event is None:
                    return  # an idle connection spoke: unusable
                await self._feed(event)
        except BaseException:
            # Cancelled from outside (shutdown): the router must not think the leg still runs.
            with trio.CancelScope(shield=True):
                await self._fail(conn, "dropped")
            raise
        finally:
            conn.closed = True
            self._pool.forget(conn)
            close_socket(sock)

    # what trio lends the shared engine connect and control requests (narwhal_runtime.control.ControlIO)

    CONTROL_BROKEN: tuple[type[BaseException], ...] = (trio.ClosedResourceError,)

    async def getaddrinfo(self, host: str, port: int, *, type: int) -> Sequence[Any]:
        return await trio.socket.getaddrinfo(host, port, type=type)

    @asynccontextmanager
    async def time_limit(self, seconds: float) -> AsyncIterator[None]:
        try:
            with trio.fail_after(seconds):
                yield
        except trio.TooSlowError:
            raise TimeLimitExpired from None

    async def control_feed(self, event: Event, *, cancelled: bool = False) -> None:
        if cancelled:
            with trio.CancelScope(shield=True):
                await self._feed(event)
        else:
            await self._feed(event)
