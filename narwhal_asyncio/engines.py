"""Engine connections on asyncio: the shared legs (:mod:`narwhal_runtime.legs`) and control requests.

A leg's connection is the shared :class:`~narwhal_runtime.legs.LegConnection`;
the loop calls it when its socket is ready (``add_reader``, ``add_writer``:
:class:`LegIO`), also while idle. A task runs only to open one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from narwhal_core import Event, StartControl, StartLeg
from narwhal_runtime.control import TimeLimitExpired, run_control
from narwhal_runtime.legs import EngineLegs, LegConnection

__all__ = ["Engines", "LegIO", "Waits"]


class Waits:
    """asyncio's socket waits (:class:`~narwhal_runtime.socket_io.SocketWaits`): the loop watches the descriptor."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def readable(self, sock: socket.socket) -> None:
        await self._ready(sock, self._loop.add_reader, self._loop.remove_reader)

    async def writable(self, sock: socket.socket) -> None:
        await self._ready(sock, self._loop.add_writer, self._loop.remove_writer)

    async def _ready(self, sock: socket.socket, watch: Callable[..., object], unwatch: Callable[[int], object]) -> None:
        fd = sock.fileno()
        ready = self._loop.create_future()
        watch(fd, _set_once, ready)
        try:
            await ready
        finally:
            if sock.fileno() == fd:  # closed meanwhile: close_socket stopped watching (the number may be another's now)
                unwatch(fd)

    def close_socket(self, sock: socket.socket) -> None:
        if (fd := sock.fileno()) != -1:
            self._loop.remove_reader(fd)
            self._loop.remove_writer(fd)
            sock.close()


def _set_once(ready: asyncio.Future[None]) -> None:
    if not ready.done():  # the socket stays ready until the task that waits acts on it
        ready.set_result(None)


class LegIO(Waits):
    """What asyncio lends connections (:class:`~narwhal_runtime.legs.LegIO`): the loop watches their sockets."""

    def read(self, conn: Any, read: bool) -> None:
        if read:
            self._loop.add_reader(conn.sock.fileno(), conn.readable)
        else:
            self._loop.remove_reader(conn.sock.fileno())

    def write(self, conn: Any, wait: bool) -> None:
        if wait:
            self._loop.add_writer(conn.sock.fileno(), conn.writable)
        else:
            self._loop.remove_writer(conn.sock.fileno())

    def ended(self, conn: Any) -> None:
        self.close_socket(conn.sock)


class Engines(Waits, EngineLegs):
    """Legs (:class:`~narwhal_runtime.legs.EngineLegs`) and control requests for one router, on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, feed: Callable[[Event], None], *, pool_size: int) -> None:
        EngineLegs.__init__(self, feed, LegIO(loop), pool_size)
        Waits.__init__(self, loop)
        self._tasks: set[asyncio.Task[None]] = set()

    def _start_opening(self, conn: LegConnection, cmd: StartLeg) -> None:
        conn.runtime = self._spawn(self.open_connection(conn, cmd))

    def _stop_opening(self, conn: LegConnection) -> None:
        conn.runtime.cancel()

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in its own task (:func:`~narwhal_runtime.control.run_control`)."""
        if not self._closed:
            self._spawn(run_control(cmd, self))

    async def aclose(self) -> None:
        """Stop connecting and control requests (each reports its cancellation); close every connection."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.close_all()

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # what asyncio lends the shared engine connect and control requests (narwhal_runtime.control.ControlIO)

    CONTROL_BROKEN: tuple[type[BaseException], ...] = ()

    async def getaddrinfo(self, host: str, port: int, *, type: int) -> Sequence[Any]:
        return await self._loop.getaddrinfo(host, port, type=type)

    @asynccontextmanager
    async def time_limit(self, seconds: float) -> AsyncIterator[None]:
        limit = asyncio.timeout(seconds)
        try:
            async with limit:
                yield
        except TimeoutError:  # the limit's, or a socket's own (a failure)
            if limit.expired():
                raise TimeLimitExpired from None
            raise
