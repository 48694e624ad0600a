"""Engine connections on asyncio: pooled keep-alive legs and control requests.

Legs run on pooled HTTP/1.1 connections, each an :class:`asyncio.Protocol`:
write the request bytes the router built, feed every read back as
``LegData`` straight from ``data_received``, and return the connection to
the pool when the router says the answer is complete and the connection
reusable. A leg on a pooled connection is written when the server flushes
the loop iteration (after the journal: :meth:`Engines.write_unsent`); one
on a new connection as soon as it is open. A task runs only to open a new
connection. A leg's connection
stops reading while the client it relays to cannot take more bytes (the
server pauses and resumes the legs linked to a client). Control requests
(health probes, KV releases) use httpx; a ``decode_abort`` release writes a
raw request and hangs up. Every failure and cancellation is reported back
to the router.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import httpx

from narwhal_runtime.app import control_request
from narwhal.engine_probe import addresses_of, describe_failure
from narwhal_core import (
    ControlDone,
    Event,
    LegData,
    LegFailed,
    StartControl,
    StartLeg,
    local_failure,
)
from narwhal_core.events import EngineResolved

__all__ = ["Engines"]


class _Connecting:
    """A leg waiting for its new connection."""

    __slots__ = ("task", "cancelled")

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.cancelled = False


class _LegConnection(asyncio.Protocol):
    """One keep-alive connection to an engine: idle in the pool, or carrying one leg."""

    __slots__ = ("_engines", "url", "transport", "leg", "client", "reused", "got_bytes", "lost", "paused", "unsent")

    def __init__(self, engines: Engines, url: str) -> None:
        self._engines = engines
        self.url = url
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        #: The backend ID of the leg it carries, ``None`` while idle.
        self.leg: str | None = None
        #: The client connection the answer is for (its ``relays`` holds this connection).
        self.client: Any = None
        #: It carried an earlier leg (a stale pooled connection can fail unseen by the engine).
        self.reused = False
        self.got_bytes = False
        self.lost = False
        self.paused = False
        #: The leg's request, until :meth:`Engines.write_unsent` writes it.
        self.unsent = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        leg = self.leg
        if leg is None:
            # An idle connection has nothing to say: bytes here make it unusable.
            self._engines._drop_idle(self)
            self.transport.abort()
            return
        self.got_bytes = True
        self._engines._feed(LegData(leg, data))

    def eof_received(self) -> bool:
        leg = self.leg
        if leg is not None:
            if self.reused and not self.got_bytes:
                # The engine closed a pooled connection before answering:
                # it never saw the request (the router retries on a fresh one).
                self._engines._lost(self, leg)
            else:
                self._engines._feed(LegData(leg, b""))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        leg = self.leg
        if leg is None:
            self._engines._drop_idle(self)
        else:
            self._engines._lost(self, leg)

    def pause(self) -> None:
        """Stop reading: the client this leg relays to is not keeping up."""
        if not self.paused:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        """Read again."""
        if self.paused:
            self.paused = False
            self.transport.resume_reading()


class Engines:
    """Legs and control requests for one router, on one event loop."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        feed: Callable[[Event], None],
        *,
        pool_size: int,
    ) -> None:
        self._loop = loop
        self._feed = feed
        self._pool_size = pool_size
        self._idle: dict[str, list[_LegConnection]] = {}
        self._legs: dict[str, _LegConnection | _Connecting] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._http: httpx.AsyncClient | None = None
        self._closed = False
        #: Pooled connections given a leg whose request is not written yet.
        self.unsent: list[_LegConnection] = []

    # commands from the router (synchronous: they only write, flag or start things)

    def start_leg(self, cmd: StartLeg) -> None:
        """Write the leg on a pooled connection, or open one in a task."""
        if self._closed:
            return  # shutting down: the loop is about to end
        idle = None if cmd.fresh_connection else self._idle.get(cmd.engine.url)
        while idle:
            conn = idle.pop()
            if not conn.lost and not conn.transport.is_closing():
                conn.reused = True
                self._attach(conn, cmd)
                conn.unsent = cmd.data
                self.unsent.append(conn)
                return
        pending = _Connecting()
        self._legs[cmd.leg] = pending
        pending.task = self._spawn(self._connect(cmd, pending))

    def cancel_leg(self, key: str) -> None:
        """Stop a leg: closing its connection makes the engine abort the request."""
        conn = self._legs.pop(key, None)
        if conn is None:
            return
        if type(conn) is _Connecting:
            conn.cancelled = True
            assert conn.task is not None
            conn.task.cancel()
            return
        assert isinstance(conn, _LegConnection)
        conn.leg = None
        self._unlink(conn)
        conn.transport.abort()

    def finish_leg(self, key: str, reusable: bool) -> None:
        """The answer is complete: return the connection to the pool, or close it."""
        conn = self._legs.pop(key, None)
        if conn is None or type(conn) is _Connecting:
            return
        assert isinstance(conn, _LegConnection)
        conn.leg = None
        self._unlink(conn)
        if reusable and not conn.lost and not conn.transport.is_closing():
            pool = self._idle.get(conn.url)
            if pool is None:
                pool = self._idle[conn.url] = []
            if len(pool) < self._pool_size:
                conn.resume()  # an idle connection reads, so an engine's close is noticed at once
                pool.append(conn)
                return
        conn.transport.close()

    def write_unsent(self) -> None:
        """Write the requests of legs started on pooled connections since the last call."""
        unsent, self.unsent = self.unsent, []
        for conn in unsent:
            data, conn.unsent = conn.unsent, b""
            if data and conn.leg is not None and not conn.lost:
                conn.transport.write(data)

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in its own task."""
        if not self._closed:
            self._spawn(self._run_control(cmd))

    async def aclose(self) -> None:
        """Stop connecting and control requests (each reports its cancellation); close every connection."""
        self._closed = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        for pool in self._idle.values():
            for conn in pool:
                conn.transport.abort()
        self._idle.clear()
        for leg in list(self._legs.values()):
            if isinstance(leg, _LegConnection):
                leg.transport.abort()
        if self._http is not None:
            await self._http.aclose()

    # connections

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _attach(self, conn: _LegConnection, cmd: StartLeg) -> None:
        conn.leg = cmd.leg
        conn.got_bytes = False
        self._legs[cmd.leg] = conn
        client = cmd.conn
        if client is not None:
            conn.client = client
            client.relays.add(conn)  # type: ignore[attr-defined]
            if client.write_paused:  # type: ignore[attr-defined]
                conn.pause()

    def _unlink(self, conn: _LegConnection) -> None:
        client = conn.client
        if client is not None:
            conn.client = None
            client.relays.discard(conn)

    def _lost(self, conn: _LegConnection, key: str) -> None:
        # Detach before reporting: the router may start the leg again at once
        # (a fresh connection after a stale pooled one), under the same key.
        if self._legs.get(key) is conn:
            del self._legs[key]
        conn.leg = None
        self._unlink(conn)
        self._feed(LegFailed(key, "dropped", conn.reused))

    def _drop_idle(self, conn: _LegConnection) -> None:
        pool = self._idle.get(conn.url)
        if pool:
            try:
                pool.remove(conn)
            except ValueError:
                pass

    def _connect_failed(self, key: str, pending: _Connecting, reason: Any) -> None:
        if self._legs.get(key) is pending:
            del self._legs[key]
            self._feed(LegFailed(key, reason))

    async def _connect(self, cmd: StartLeg, pending: _Connecting) -> None:
        key = cmd.leg
        engine = cmd.engine
        try:
            async with asyncio.timeout(cmd.connect_timeout):
                transport, conn = await self._loop.create_connection(
                    lambda: _LegConnection(self, engine.url), engine.host, engine.port
                )
        except TimeoutError:  # before OSError, of which it is a subclass
            self._connect_failed(key, pending, "connect_timeout")
            return
        except OSError as exc:
            self._connect_failed(key, pending, "local_error" if local_failure(exc) else "connect_failed")
            return
        except BaseException:
            # CancelLeg: the router knows. Anything else (shutdown): tell it.
            if not pending.cancelled:
                self._connect_failed(key, pending, "dropped")
            raise
        if self._legs.get(key) is not pending:
            transport.abort()  # cancelled just as the connection opened
            return
        if conn.lost or transport.is_closing():
            del self._legs[key]
            self._feed(LegFailed(key, "dropped"))
            return
        self._attach(conn, cmd)
        # Its journal line was flushed with the iteration that started the leg.
        transport.write(cmd.data)

    # control requests

    async def _run_control(self, cmd: StartControl) -> None:
        status: int | None = None
        error: str | None = None
        local = False
        body = b""
        try:
            async with asyncio.timeout(cmd.timeout):
                if cmd.resolve:
                    # The engine's name, resolved at every probe: its addresses
                    # may name its KV side channel (docs/configure.md).
                    infos = await self._loop.getaddrinfo(cmd.engine.host, cmd.engine.port, type=socket.SOCK_STREAM)
                    self._feed(EngineResolved(cmd.engine, addresses_of(infos)))
                if cmd.drop_after_send:
                    transport, _ = await self._loop.create_connection(
                        asyncio.Protocol, cmd.engine.host, cmd.engine.port
                    )
                    try:
                        transport.write(cmd.data)
                    finally:
                        transport.close()  # after the bytes are written
                else:
                    if self._http is None:
                        # identity: the answer's bytes are read raw (a KV release's is parsed).
                        # Engines are plain http:// (config refuses https://): no TLS context,
                        # whose certificate loading would delay every first probe.
                        self._http = httpx.AsyncClient(
                            trust_env=False, verify=False, headers={"accept-encoding": "identity"}
                        )
                    status, body = await control_request(self._http, cmd)
        except httpx.ConnectTimeout:
            error = "connect timeout"  # nothing was sent (a KV release's record says so)
        except (TimeoutError, httpx.TimeoutException):
            error = "timeout"
        except (OSError, httpx.HTTPError) as exc:
            error = describe_failure(exc)
            local = local_failure(exc)
        except BaseException:
            self._feed(ControlDone(cmd.key, None, "cancelled"))
            raise
        self._feed(ControlDone(cmd.key, status, error, local, body))
