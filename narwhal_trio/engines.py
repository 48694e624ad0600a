"""Engine connections on trio: the shared legs (:mod:`narwhal_runtime.legs`) and control requests.

A leg's connection is the shared :class:`~narwhal_runtime.legs.LegConnection`;
tasks wait for its socket (:class:`LegIO`, which client connections use
too), one per connection while it reads, also while idle, and one while a
request waits for the socket to take it. A new connection is opened by a task of
its own, cancelled by a ``CancelLeg`` while it connects. Sockets are plain
non-blocking ones driven with :func:`trio.lowlevel.wait_readable` /
:func:`~trio.lowlevel.wait_writable`: a ``SocketStream`` call costs several
times the ``recv`` it wraps. Closing a socket another task may wait on
goes through :func:`trio.lowlevel.notify_closing`.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from narwhal_core import Event, StartControl, StartLeg
from narwhal_runtime.control import TimeLimitExpired, run_control
from narwhal_runtime.legs import EngineLegs, LegConnection

__all__ = ["Engines", "LegIO", "Waits", "close_socket"]


def close_socket(sock: socket.socket) -> None:
    """Close ``sock``, waking any task waiting on it with :class:`trio.ClosedResourceError`."""
    if sock.fileno() != -1:
        trio.lowlevel.notify_closing(sock)
        sock.close()


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


class LegIO:
    """What trio lends connections (:class:`~narwhal_runtime.legs.LegIO`): tasks that wait for their sockets.

    A task per connection waits for its socket to be readable and calls it,
    until it stops reading; while the connection is paused (a client it
    relays to is far behind) the task waits to be resumed instead. Another
    task, only while the socket has not taken every byte, waits for it to
    be writable.
    """

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        #: The paused connections, and what resumes each.
        self._paused: dict[Any, trio.Event] = {}

    def read(self, conn: Any, read: bool) -> None:
        paused = self._paused
        if read:
            if conn in paused:
                paused.pop(conn).set()
            else:
                self._nursery.start_soon(self._read, conn)
        elif conn.reading:
            paused[conn] = trio.Event()
        elif conn in paused:
            paused.pop(conn).set()  # over: the task ends

    async def _read(self, conn: Any) -> None:
        sock = conn.sock
        paused = self._paused
        try:
            while conn.reading:
                await trio.lowlevel.wait_readable(sock)
                if paused and conn in paused:
                    await paused[conn].wait()
                else:
                    conn.readable()
        except (trio.ClosedResourceError, OSError):
            pass  # ended: whoever closed it told the router
        except BaseException:
            conn.broken()  # cancelled (the server stops): close it; the router hears unless it knows
            raise

    def write(self, conn: Any, wait: bool) -> None:
        if wait:
            self._nursery.start_soon(self._write, conn)

    @staticmethod
    async def _write(conn: Any) -> None:
        sock = conn.sock
        try:
            while conn.out:
                await trio.lowlevel.wait_writable(sock)
                conn.writable()
        except (trio.ClosedResourceError, OSError):
            pass  # ended: whoever closed it told the router
        except BaseException:
            conn.broken()  # cancelled (the server stops)
            raise

    def ended(self, conn: Any) -> None:
        if conn in self._paused:
            self._paused.pop(conn).set()
        close_socket(conn.sock)  # wakes its tasks


class Engines(Waits, EngineLegs):
    """Legs (:class:`~narwhal_runtime.legs.EngineLegs`) and control requests for one router, on one nursery."""

    def __init__(self, nursery: trio.Nursery, feed: Callable[[Event], object], *, pool_size: int) -> None:
        super().__init__(feed, LegIO(nursery), pool_size)
        self._nursery = nursery

    def _start_opening(self, conn: LegConnection, cmd: StartLeg) -> None:
        self._nursery.start_soon(self._opening, conn, cmd)

    async def _opening(self, conn: LegConnection, cmd: StartLeg) -> None:
        with trio.CancelScope() as conn.runtime:
            await self.open_connection(conn, cmd)

    def _stop_opening(self, conn: LegConnection) -> None:
        if conn.runtime is not None:
            conn.runtime.cancel()

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in its own task (:func:`~narwhal_runtime.control.run_control`)."""
        self._nursery.start_soon(run_control, cmd, self)

    async def aclose(self) -> None:
        """Close every connection."""
        self.close_all()

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
