"""Engine legs as both runtimes carry them out: the router's leg commands, and the connections that carry them.

A leg starts on an idle pooled connection when there is one (its request
then waits in the pool until the adapter writes it, after the batch's
journal records: :meth:`Engines.write_unsent`), else on a new connection
opened in a task of the runtime's, attached to the leg at once so that a
``CancelLeg`` finds it while it is still connecting. A cancelled leg's
connection is closed (the engine then aborts the request); a finished
leg's goes back to the pool or is closed, as
:class:`~narwhal_runtime.pool.Pool` decides.

Each connection is a :class:`LegConnection`: a plain non-blocking socket
the runtime watches, calling :meth:`LegConnection.readable` and
:meth:`LegConnection.writable` when it is ready
(:class:`~.runtime_io.RuntimeIO`: asyncio
with its loop's ``add_reader``/``add_writer``, trio with a task that waits
for the socket), as it does for client connections
(:mod:`.client_connections`). A new connection is opened the same way on
both (:meth:`Engines.connect`, with the runtime's ``getaddrinfo`` and
its wait for a writable socket), as a control request's is
(:mod:`.control`: :meth:`Engines.start_control`), and a connect that failed is named by one rule
(:func:`connect_failure`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

from narwhal_core import StartControl, StartLeg, local_failure
from narwhal_core.events import LegFailure

from .control import TimeLimitExpired, connect_first, resolve, run_control
from .pool import Pool, PooledConnection
from .runtime_io import RuntimeIO
from .socket_options import READ_SIZE, set_up_engine

__all__ = ["Engines", "LegConnection", "connect_failure"]


def connect_failure(exc: BaseException) -> LegFailure:
    """Why a leg's new connection could not be opened (what :meth:`Engines.connect` raised): one rule (docs/design.md).

    ``connect_timeout`` means the router's own limit (the leg's
    ``connect_timeout``, ``engine.connect_timeout_s``) ran out
    (:class:`~.control.TimeLimitExpired`), and only that. Any ``OSError`` is
    the engine's ``connect_failed`` -- the kernel's own ``ETIMEDOUT`` too
    (its SYNs went unanswered), a ``TimeoutError`` -- unless Narwhal itself
    was short of descriptors, memory or ports
    (:func:`~narwhal_core.local_failure`): ``local_error``, no verdict on
    the engine.
    """
    if isinstance(exc, TimeLimitExpired):
        return "connect_timeout"
    return "local_error" if local_failure(exc) else "connect_failed"


class LegConnection(PooledConnection):
    """One keep-alive connection to an engine, the same on both runtimes; the runtime says when its socket is ready.

    It reads whatever the engine sends, also while idle (an idle
    connection that speaks is closed); writes a leg's request, queueing what
    the socket does not take at once; and reports the engine's close or a
    broken socket to the pool, which says what the router hears.
    """

    __slots__ = ("sock", "legs", "out", "reading", "client", "paused", "runtime")

    def __init__(self, url: str, legs: Engines) -> None:
        super().__init__(url)
        #: ``None`` while connecting.
        self.sock: socket.socket | None = None
        self.legs = legs
        #: Request bytes the socket has still to take.
        self.out: list[bytes | memoryview] = []
        #: The runtime calls :meth:`readable` (from the leg's request on, until the connection ends).
        self.reading = False
        #: The client connection the answer is for (its ``relays`` holds this connection).
        self.client: Any = None
        self.paused = False
        #: The task opening it (:meth:`~.runtime_io.RuntimeIO.spawn`), cancelled if its leg is meanwhile.
        self.runtime: Any = None

    def readable(self) -> None:
        """The socket has bytes, or EOF, or an error."""
        try:
            data = self.sock.recv(READ_SIZE)  # type: ignore[union-attr]  # reading: it is open
        except BlockingIOError:
            return
        except OSError:
            self.lost(reset=True)
            return
        if not data:
            self.lost(reset=False)
            return
        legs = self.legs
        event = legs._pool.received(self, data)
        if event is None:
            legs.close(self)  # an idle connection spoke: unusable
        else:
            legs._feed(event)

    def lost(self, *, reset: bool) -> None:
        """The engine closed the connection (``reset``: or it broke): the pool says what the router hears."""
        legs = self.legs
        event = legs._pool.ended(self, reset=reset)
        if self.leg is None:
            legs._unlink(self)  # the pool detached the leg: the router may start it again at once
        legs.close(self)
        if event is not None:
            legs._feed(event)

    def broken(self) -> None:
        """The runtime stops (its task was cancelled): the leg, if any, failed as ``dropped``."""
        self.legs._fail(self, "dropped")
        self.legs.close(self)

    def send(self, data: bytes) -> None:
        """Write a leg's request (queued behind what the socket has still to take)."""
        if self.out:
            self.out.append(data)
            return
        try:
            sent = self.sock.send(data)  # type: ignore[union-attr]
        except BlockingIOError:
            sent = 0
        except OSError:
            return  # a broken socket: its read says so, and the pool whether the router retries
        if sent < len(data):
            self.out.append(memoryview(data)[sent:])
            self.legs.io.write(self, True)

    def writable(self) -> None:
        """The socket can take bytes: send what is queued."""
        out = self.out
        data = out[0] if len(out) == 1 else b"".join(out)
        try:
            sent = self.sock.send(data)  # type: ignore[union-attr]
        except BlockingIOError:
            return
        except OSError:
            sent = len(data)  # its read says so
        if sent < len(data):
            self.out = [memoryview(data)[sent:]]
            return
        self.out = []
        self.legs.io.write(self, False)

    def pause(self) -> None:
        """Stop reading: the client this leg relays to is far behind."""
        if not self.paused and self.reading:
            self.paused = True
            self.legs.io.read(self, False)

    def resume(self) -> None:
        """Read again."""
        if self.paused:
            self.paused = False
            if self.reading:
                self.legs.io.read(self, True)


class Engines:
    """Start, cancel and finish legs on pooled engine connections, and run control requests (:class:`~.driver.EngineCommands`)."""

    def __init__(self, io: RuntimeIO, feed: Callable[[Any], object], pool_size: int) -> None:
        #: Where the connections' events go (the adapter's ``Server.feed``, synchronous).
        self._feed = feed
        self.io = io
        self._pool: Pool[LegConnection] = Pool(pool_size)
        #: The requests of legs started on pooled connections, waiting for
        #: :meth:`write_unsent` (non-empty: some wait). The pool's own list,
        #: read without a call: an adapter asks once per scheduler batch.
        self.unsent = self._pool.unsent
        #: The server ends: no leg or control request starts any more.
        self.stopped = False

    def start_leg(self, cmd: StartLeg) -> None:
        """Queue the leg on an idle pooled connection, or open a new one for it."""
        if self.stopped:
            return
        conn = self._pool.take_idle(cmd.engine.url, cmd.leg, cmd.data, cmd.fresh_connection)
        if conn is not None:
            self._link(conn, cmd)
            return
        conn = self._open(cmd)
        self._pool.attach(conn, cmd.leg)

    def cancel_leg(self, key: str) -> None:
        """Stop a leg: closing its connection makes the engine abort the request."""
        conn = self._pool.cancel(key)
        if conn is not None:
            self._cancelled(conn)

    def finish_leg(self, key: str, reusable: bool) -> None:
        """The answer is complete: its connection goes back to the pool (read on while idle), or is closed."""
        finished = self._pool.finish(key, reusable)
        if finished is not None:
            conn, kept = finished  # (unpacked here: a call with *args takes a slower path)
            self._finished(conn, kept)

    async def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        """A socket connected to an engine: the name resolved once, its addresses tried in turn, the engine's options set.

        (:func:`~.control.resolve`, :func:`~.control.connect_first`,
        :func:`~.socket_options.set_up_engine`.) All within ``timeout``, the
        leg's ``connect_timeout``, which the addresses share; raises
        :class:`~.control.TimeLimitExpired` when it runs out, else
        ``OSError`` (named by :func:`connect_failure`).
        """
        io = self.io
        async with io.time_limit(timeout):
            infos = await resolve(host, port, io.getaddrinfo)
            sock = await connect_first(infos, io.writable, io.time_limit, timeout)
        set_up_engine(sock)
        return sock

    # the connections

    def _link(self, conn: LegConnection, cmd: StartLeg) -> None:
        """``conn`` carries ``cmd``'s leg: it relays to ``cmd.conn`` (if any), and is held with it."""
        client: Any = cmd.conn  # a ClientConnection
        if client is not None:
            conn.client = client
            client.relays.add(conn)
            if client.held:
                conn.pause()

    def _unlink(self, conn: LegConnection) -> None:
        client = conn.client
        if client is not None:
            conn.client = None
            client.relays.discard(conn)

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in a task of its own (:func:`~.control.run_control`)."""
        if not self.stopped:
            self.io.spawn(run_control, cmd, self.io, self._feed)

    def write_unsent(self) -> None:
        """Write the requests of legs started on pooled connections since the last call."""
        for conn, data in self._pool.take_unsent():
            conn.send(data)

    def _open(self, cmd: StartLeg) -> LegConnection:
        conn = LegConnection(cmd.engine.url, self)
        conn.runtime = self.io.spawn(self.open_connection, conn, cmd)
        return conn

    async def open_connection(self, conn: LegConnection, cmd: StartLeg) -> None:
        """Connect ``conn`` for ``cmd``'s leg, write its request and start reading (in the runtime's task)."""
        try:
            sock = await self.connect(cmd.engine.host, cmd.engine.port, cmd.connect_timeout)
        except (TimeLimitExpired, OSError) as exc:
            self._fail(conn, connect_failure(exc))
            return
        except BaseException:
            self._fail(conn, "dropped")  # shutdown (a CancelLeg detached the leg first: nothing to say)
            raise
        if conn.leg != cmd.leg or conn.closed:
            self.io.close_socket(sock)  # cancelled just as it opened
            return
        conn.sock = sock
        self._link(conn, cmd)
        conn.send(cmd.data)  # its journal line was flushed with the batch that started the leg
        conn.reading = True
        self.io.read(conn, True)

    def _cancelled(self, conn: LegConnection) -> None:
        if conn.sock is None:
            conn.runtime.cancel()  # still connecting
        else:
            self._unlink(conn)
            self.close(conn)

    def _finished(self, conn: LegConnection, kept: bool) -> None:
        self._unlink(conn)
        if not kept:
            self.close(conn)
        elif conn.paused:  # seldom: only a leg that relayed to a slow client
            conn.resume()

    def _fail(self, conn: LegConnection, reason: LegFailure) -> None:
        event = self._pool.failed(conn, reason)  # None: the leg was cancelled, the router knows
        if conn.leg is None:
            self._unlink(conn)
        if event is not None:
            self._feed(event)

    def close(self, conn: LegConnection) -> None:
        """Close ``conn`` (cancelled, not kept, an idle one that spoke, the engine's close, shutdown)."""
        conn.closed = True
        self._pool.forget(conn)
        if conn.sock is not None and conn.reading:
            conn.reading = False
            self.io.ended(conn)

    def close_all(self) -> None:
        """Close every connection (at shutdown: the router knows)."""
        self.stopped = True
        for conn in self._pool.all_connections():
            if conn.sock is None:
                conn.runtime.cancel()
            else:
                self.close(conn)
