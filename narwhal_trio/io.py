"""What trio lends the connection code both runtimes share: :class:`IO` (:class:`~narwhal_runtime.runtime_io.RuntimeIO`).

Sockets are plain non-blocking ones driven with
:func:`trio.lowlevel.wait_readable` / :func:`~trio.lowlevel.wait_writable`:
a ``SocketStream`` call costs several times the ``recv`` it wraps. A
connection (a client's, or an engine leg's) is read by a task that waits
for its socket and calls it, one per connection while it reads, also while
idle; another, only while the socket has not taken every byte, waits for
it to be writable. Closing a socket another task may wait on goes through
:func:`trio.lowlevel.notify_closing`. Every task runs in the server's
nursery.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from narwhal_runtime.control import TimeLimitExpired

__all__ = ["IO"]


class IO:
    """trio's clock, timers, tasks and socket waits, over one nursery."""

    CONTROL_BROKEN: tuple[type[BaseException], ...] = (trio.ClosedResourceError,)
    event = staticmethod(trio.Event)
    checkpoint = staticmethod(trio.lowlevel.checkpoint)
    sleep_until = staticmethod(trio.sleep_until)
    readable = staticmethod(trio.lowlevel.wait_readable)
    writable = staticmethod(trio.lowlevel.wait_writable)

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        #: ``trio.current_time``, one call instead of three (it asks the run's clock through two more).
        self.now: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self.soon = trio.lowlevel.current_trio_token().run_sync_soon
        #: The paused connections, and what resumes each.
        self._paused: dict[Any, trio.Event] = {}
        #: The tasks :meth:`spawn` started that have not ended, and what :meth:`cancel_tasks` waits for.
        self._tasks: set[trio.CancelScope] = set()
        self._no_tasks = trio.Event()

    def later(self, delay: float, callback: Callable[[], None]) -> trio.CancelScope:
        scope = trio.CancelScope()
        self._nursery.start_soon(_call_later, scope, delay, callback)
        return scope

    # -- tasks

    def spawn(self, function: Callable[..., Awaitable[object]], *args: Any) -> trio.CancelScope:
        scope = trio.CancelScope()
        self._tasks.add(scope)
        self._nursery.start_soon(self._task, scope, function, args)
        return scope

    async def _task(self, scope: trio.CancelScope, function: Callable[..., Awaitable[object]], args: Any) -> None:
        try:
            with scope:
                await function(*args)
        finally:
            self._tasks.discard(scope)
            if not self._tasks:
                self._no_tasks.set()

    async def cancel_tasks(self) -> None:
        while self._tasks:
            for scope in self._tasks:
                scope.cancel()
            self._no_tasks = trio.Event()
            await self._no_tasks.wait()

    # -- sockets a task waits for

    @staticmethod
    def close_socket(sock: socket.socket) -> None:
        if sock.fileno() != -1:
            trio.lowlevel.notify_closing(sock)  # wakes its tasks with ClosedResourceError
            sock.close()

    @staticmethod
    async def getaddrinfo(host: str, port: int, *, type: int) -> Sequence[Any]:
        return await trio.socket.getaddrinfo(host, port, type=type)

    @staticmethod
    @asynccontextmanager
    async def time_limit(seconds: float) -> AsyncIterator[None]:
        try:
            with trio.fail_after(seconds):
                yield
        except trio.TooSlowError:
            raise TimeLimitExpired from None

    # -- connections, called when their sockets are ready

    def read(self, conn: Any, read: bool) -> None:
        paused = self._paused
        if read:
            if conn in paused:
                paused.pop(conn).set()
            else:
                self._nursery.start_soon(self._read, conn)
        elif conn.reading:
            paused[conn] = trio.Event()  # (while the client it relays to is far behind)
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
        self.close_socket(conn.sock)  # wakes its tasks


async def _call_later(scope: trio.CancelScope, delay: float, callback: Callable[[], None]) -> None:
    with scope:
        await trio.sleep(delay)
        callback()
