"""What trio lends the connection code both runtimes share: :class:`IO` (:class:`~narwhal_runtime.runtime_io.RuntimeIO`).

Sockets are plain non-blocking ones: a ``SocketStream`` call costs several
times the ``recv`` it wraps. The connections that read (a client's, an
engine leg's) are watched by one task, not one each: their sockets sit in
an epoll set of the IO's own, level-triggered, and that task waits for the
set's descriptor with :func:`trio.lowlevel.wait_readable`, then calls every
ready connection in turn, as asyncio's selector loop does. A trio task step
costs tens of thousands of instructions (the run loop, the reschedule, the
epoll re-arm), so one step per batch of ready sockets instead of one per
socket is most of what trio spent more than asyncio (benchmarks/README.md,
"Instructions per request"). A connection whose socket has not taken every
byte gets a task of its own that waits for it to be writable. Closing a
socket another task may wait on goes through
:func:`trio.lowlevel.notify_closing`. Every task runs in the server's
nursery.
"""

from __future__ import annotations

import select
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
        #: The reading connections' sockets, level-triggered, and who reads each (by descriptor).
        self._poller = select.epoll()
        self._reading: dict[int, Any] = {}
        #: The connections paused while reading (they stay ``reading``, out of the set).
        self._paused: set[Any] = set()
        self._watching = False  # the task that reads: started with the first connection that reads
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

    def close_socket(self, sock: socket.socket) -> None:
        if (fd := sock.fileno()) != -1:
            if fd in self._reading:
                self._unwatch(fd)
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
        fd = conn.sock.fileno()
        if read:
            self._paused.discard(conn)
            if self._reading.get(fd) is not conn:
                if fd in self._reading:
                    self._unwatch(fd)  # a closed socket's number, reused
                self._poller.register(fd, select.EPOLLIN)
                self._reading[fd] = conn
                if not self._watching:
                    self._watching = True
                    self._nursery.start_soon(self._watch)
        else:
            if conn.reading:
                self._paused.add(conn)  # (while the client it relays to is far behind)
            else:
                self._paused.discard(conn)
            if fd in self._reading:
                self._unwatch(fd)

    def _unwatch(self, fd: int) -> None:
        del self._reading[fd]
        try:
            self._poller.unregister(fd)
        except (OSError, ValueError):
            pass  # closed without close_socket (the kernel dropped it from the set), or the set itself closed

    async def _watch(self) -> None:
        """The one task that reads: each ready connection's ``readable``, a batch per wake-up.

        It runs until the nursery is cancelled (the server's end does that),
        also while no connection reads.
        """
        poller = self._poller
        reading = self._reading
        paused = self._paused
        try:
            while True:
                await trio.lowlevel.wait_readable(poller.fileno())
                for fd, _ in poller.poll(0):
                    conn = reading.get(fd)
                    if conn is None:
                        continue  # closed by an earlier one of this batch
                    try:
                        conn.readable()
                    except OSError:
                        pass  # ended: whoever closed it told the router
                    if not conn.reading and reading.get(fd) is conn:
                        self._unwatch(fd)
        except BaseException:
            for conn in (*reading.values(), *paused):
                conn.broken()  # cancelled (the server stops): close it; the router hears unless it knows
            poller.close()
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
        self._paused.discard(conn)
        self.close_socket(conn.sock)  # wakes its tasks


async def _call_later(scope: trio.CancelScope, delay: float, callback: Callable[[], None]) -> None:
    with scope:
        await trio.sleep(delay)
        callback()
