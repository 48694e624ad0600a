"""Engine connections on asyncio: the I/O of legs (:mod:`narwhal_runtime.legs`) and control requests.

Each engine connection is an :class:`asyncio.Protocol` feeding every read
from ``data_received``, also while idle; a task runs only to open one. A
leg on a pooled connection is written by the flush, one on a new
connection as soon as it is open. A leg's connection stops reading while
the client it relays to cannot take more bytes (the server pauses and
resumes the legs linked to a client). On asyncio's own loop they read into
a buffer of their router's (:class:`BufferedReads`).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from narwhal_core import Event, LegData, LegFailed, StartControl, StartLeg
from narwhal_core.events import LegFailure
from narwhal_runtime.control import TimeLimitExpired, run_control
from narwhal_runtime.legs import EngineLegs, connect_failure
from narwhal_runtime.pool import PooledConnection
from narwhal_runtime.socket_options import READ_SIZE

__all__ = ["BufferedReads", "Engines", "Waits", "is_uvloop", "read_buffer"]


def is_uvloop(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` is uvloop's (else: asyncio's own)."""
    return type(loop).__module__.startswith("uvloop")


def read_buffer() -> memoryview:
    """A buffer for :class:`BufferedReads` protocols: one per router, read into by one of its connections at a time."""
    return memoryview(bytearray(READ_SIZE))


class BufferedReads(asyncio.BufferedProtocol):
    """Mixed into a protocol run on asyncio's own loop: reads land in the router's buffer, then go to ``data_received``.

    Without it, the standard loop's transport receives each read into a new
    256 KiB ``bytes``, which glibc maps and unmaps (two system calls and fresh
    pages a read: benchmarks/read_shapes.py). uvloop reads into a buffer of
    its own, and there a plain protocol costs less. The class mixing it in
    sets ``buffer`` (:func:`read_buffer`); the transport fills it and calls
    :meth:`buffer_updated` before any other read, so a loop's connections can
    share one.
    """

    __slots__ = ()
    buffer: memoryview

    if TYPE_CHECKING:
        def data_received(self, data: bytes) -> None: ...

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self.buffer[:nbytes]))


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


class _LegConnection(PooledConnection, asyncio.Protocol):
    """One keep-alive connection to an engine."""

    __slots__ = ("_engines", "transport", "task", "client", "paused")

    def __init__(self, engines: Engines, url: str) -> None:
        super().__init__(url)
        self._engines = engines
        #: ``None`` while connecting.
        self.transport: asyncio.Transport | None = None
        #: The task opening it.
        self.task: asyncio.Task[None] | None = None
        #: The client connection the answer is for (its ``runtime`` set holds this connection).
        self.client: Any = None
        self.paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        engines = self._engines  # once: this runs for every read of an answer
        event = engines._pool.received(self, data)
        if event is None:  # an idle connection spoke: unusable
            engines._close(self, abort=True)
        else:
            engines._feed(event)

    def eof_received(self) -> bool:
        self.closed = True  # the transport closes itself (returning False)
        self._engines._deliver(self, self._engines._pool.ended(self))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._engines._deliver(self, self._engines._pool.ended(self, reset=True))

    def pause(self) -> None:
        """Stop reading: the client this leg relays to is not keeping up."""
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read again."""
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()


class _BufferedLegConnection(_LegConnection, BufferedReads):
    __slots__ = ("buffer",)

    def __init__(self, engines: Engines, url: str) -> None:
        super().__init__(engines, url)
        self.buffer = engines.buffer


class Engines(Waits, EngineLegs[_LegConnection]):
    """Legs (:class:`~narwhal_runtime.legs.EngineLegs`) and control requests for one router, on one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, feed: Callable[[Event], None], *, pool_size: int) -> None:
        EngineLegs.__init__(self, feed, pool_size)
        Waits.__init__(self, loop)
        self._tasks: set[asyncio.Task[None]] = set()
        self._connection = _LegConnection if is_uvloop(loop) else _BufferedLegConnection
        self.buffer = read_buffer()

    def _open(self, cmd: StartLeg) -> _LegConnection:
        conn = self._connection(self, cmd.engine.url)
        conn.task = self._spawn(self._connect(conn, cmd))
        return conn

    def _cancelled(self, conn: _LegConnection) -> None:
        if conn.transport is None:
            assert conn.task is not None
            conn.task.cancel()  # still connecting
            return
        self._unlink(conn)
        self._close(conn, abort=True)

    def _finished(self, conn: _LegConnection, kept: bool) -> None:
        # _unlink(conn), inlined: this runs for every leg.
        client = conn.client
        if client is not None:
            conn.client = None
            client.runtime.discard(conn)
        if kept:
            if conn.paused:  # seldom: only a leg that relayed to a slow client
                conn.resume()
        else:
            self._close(conn)

    def write_unsent(self) -> None:
        """Write the requests of legs started on pooled connections since the last call."""
        for conn, data in self._pool.take_unsent():
            assert conn.transport is not None
            conn.transport.write(data)

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
        for conn in self._pool.all_connections():
            if conn.transport is not None:
                self._close(conn, abort=True)

    # connections

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _close(self, conn: _LegConnection, *, abort: bool = False) -> None:
        conn.closed = True
        assert conn.transport is not None
        if abort:
            conn.transport.abort()
        else:
            conn.transport.close()

    def _link(self, conn: _LegConnection, cmd: StartLeg) -> None:
        # The leg relays to cmd.conn (if any): it pauses with that client.
        client: Any = cmd.conn  # a ClientConnection; its ``runtime``: the legs relaying to it
        if client is not None:
            conn.client = client
            client.runtime.add(conn)
            if client.held:
                conn.pause()

    #: A pooled connection taking a leg links to its client at once (a new one: once open, in _connect).
    _reused = _link

    def _unlink(self, conn: _LegConnection) -> None:
        client = conn.client
        if client is not None:
            conn.client = None
            client.runtime.discard(conn)

    def _deliver(self, conn: _LegConnection, event: LegData | LegFailed | None) -> None:
        if conn.leg is None:
            self._unlink(conn)  # the pool detached the leg: the router may start it again at once
        if event is not None:
            self._feed(event)

    def _fail(self, conn: _LegConnection, reason: LegFailure) -> None:
        self._deliver(conn, self._pool.failed(conn, reason))  # None: the leg was cancelled, the router knows

    async def _connect(self, conn: _LegConnection, cmd: StartLeg) -> None:
        key = cmd.leg
        try:
            sock = await self.connect(cmd.engine.host, cmd.engine.port, cmd.connect_timeout)
            try:
                transport, _ = await self._loop.create_connection(lambda: conn, sock=sock)
            except BaseException:
                sock.close()
                raise
        except (TimeLimitExpired, OSError) as exc:
            self._fail(conn, connect_failure(exc))
            return
        except BaseException:
            self._fail(conn, "dropped")  # shutdown (a CancelLeg detached the leg first)
            raise
        if conn.leg != key or conn.closed:
            transport.abort()  # cancelled just as the connection opened, or already lost (reported)
            return
        self._link(conn, cmd)
        # Its journal line was flushed with the iteration that started the leg.
        transport.write(cmd.data)

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

    async def control_feed(self, event: Event, *, cancelled: bool = False) -> None:
        self._feed(event)
