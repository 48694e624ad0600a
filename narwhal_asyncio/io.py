"""What asyncio lends the connection code both runtimes share: :class:`IO` (:class:`~narwhal_runtime.runtime_io.RuntimeIO`).

A connection (a client's, or an engine leg's) is a plain non-blocking
socket the loop watches (``add_reader``, ``add_writer``), also while idle,
calling it when it is ready; no task runs per connection or per request.
A task waits for a socket only to open a connection, accept, or run a
control request: the loop watches the descriptor until it is ready.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from narwhal_runtime.control import TimeLimitExpired

__all__ = ["IO"]


class IO:
    """asyncio's clock, timers, tasks and socket waits, on one event loop."""

    CONTROL_BROKEN: tuple[type[BaseException], ...] = ()
    event = staticmethod(asyncio.Event)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.now = loop.time
        self.later = loop.call_later
        self.soon = loop.call_soon
        #: The tasks :meth:`spawn` started that have not ended.
        self._tasks: set[asyncio.Task[Any]] = set()

    async def sleep_until(self, when: float) -> None:
        await asyncio.sleep(when - self._loop.time())

    @staticmethod
    async def checkpoint() -> None:
        await asyncio.sleep(0)

    # -- tasks

    def spawn(self, function: Callable[..., Awaitable[Any]], *args: Any) -> asyncio.Task[Any]:
        task = self._loop.create_task(function(*args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def cancel_tasks(self) -> None:
        while self._tasks:
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    # -- sockets a task waits for

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

    async def getaddrinfo(self, host: str, port: int, *, type: int) -> Sequence[Any]:
        return await self._loop.getaddrinfo(host, port, type=type)

    @staticmethod
    @asynccontextmanager
    async def time_limit(seconds: float) -> AsyncIterator[None]:
        limit = asyncio.timeout(seconds)
        try:
            async with limit:
                yield
        except TimeoutError:  # the limit's, or a socket's own (a failure)
            if limit.expired():
                raise TimeLimitExpired from None
            raise

    # -- connections, called when their sockets are ready

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


def _set_once(ready: asyncio.Future[None]) -> None:
    if not ready.done():  # the socket stays ready until the task that waits acts on it
        ready.set_result(None)
