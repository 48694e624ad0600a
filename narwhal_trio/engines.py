"""Engine connections on trio: pooled keep-alive legs and control requests.

Legs run on pooled HTTP/1.1 connections, one task per connection (not per
leg), as the asyncio adapter has one protocol object per connection: the
task reads whatever the engine sends and feeds it back as ``LegData``, and
the connection returns to the pool when the router says the answer is
complete and the connection reusable; an idle connection is read too, so an
engine's close is noticed at once. A leg on a pooled connection is written
straight from the drain that started it (a non-blocking ``send`` of the
whole request; a send the socket cannot take at once is finished by a
task); a new connection is opened by the task that will then serve it.

The sockets are plain non-blocking sockets driven with
:func:`trio.lowlevel.wait_readable` / :func:`~trio.lowlevel.wait_writable`:
a ``SocketStream`` call costs a cancel scope, two context managers and a
yield per call, several times the ``recv`` it wraps. Each wait is a
checkpoint; closing a socket another task may wait on goes through
:func:`trio.lowlevel.notify_closing`.

Control requests (health probes, KV releases) use httpx; a ``decode_abort``
release writes a raw request and hangs up. Every failure and cancellation
is reported back to the router.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import httpx
import trio

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

__all__ = ["Engines", "plain_socket", "close_socket", "send_all", "receive"]

READ_SIZE = 65536


def plain_socket(stream: trio.SocketStream) -> socket.socket:
    """The stream's socket as a plain non-blocking socket (the stream is unusable afterwards)."""
    ts = stream.socket
    sock = socket.socket(ts.family, ts.type, ts.proto, fileno=ts.detach())
    sock.setblocking(False)
    return sock


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


async def send_all(sock: socket.socket, data: bytes | memoryview) -> None:
    """Write all of ``data``: at once when the socket takes it, else waiting until it does."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)
            continue
        view = view[sent:]


class _Connection:
    """One keep-alive connection to an engine: idle in the pool, or carrying one leg."""

    __slots__ = ("url", "sock", "leg", "reused", "got_bytes", "closed", "scope")

    def __init__(self, url: str) -> None:
        self.url = url
        #: ``None`` while connecting.
        self.sock: socket.socket | None = None
        #: The backend ID of the leg it carries, ``None`` while idle.
        self.leg: str | None = None
        #: It carried an earlier leg (a stale pooled connection can fail unseen by the engine).
        self.reused = False
        self.got_bytes = False
        #: We closed it (cancelled leg, finished and not reusable, pool full, shutdown).
        self.closed = False
        #: The connect in progress, cancelled by a CancelLeg.
        self.scope: trio.CancelScope | None = None


class Engines:
    """Legs and control requests for one router, on one nursery."""

    def __init__(
        self,
        nursery: trio.Nursery,
        feed: Callable[[Event], Awaitable[None]],
        *,
        pool_size: int,
    ) -> None:
        self._nursery = nursery
        self._feed = feed
        self._pool_size = pool_size
        self._idle: dict[str, list[_Connection]] = {}
        self._legs: dict[str, _Connection] = {}
        self._http: httpx.AsyncClient | None = None
        #: Leg requests for pooled connections, written by :meth:`write_unsent`.
        self.unsent: list[tuple[_Connection, str, bytes]] = []

    # commands from the router (synchronous: they only write, flag or start things)

    def start_leg(self, cmd: StartLeg) -> None:
        """Queue the leg on a pooled connection (see :meth:`write_unsent`), or open one in a task."""
        idle = None if cmd.fresh_connection else self._idle.get(cmd.engine.url)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                self._attach(conn, cmd.leg)
                self.unsent.append((conn, cmd.leg, cmd.data))
                return
        conn = _Connection(cmd.engine.url)
        self._attach(conn, cmd.leg)
        self._nursery.start_soon(self._connect, conn, cmd)

    def write_unsent(self) -> bool:
        """Write the queued leg requests; return whether a task was started to finish one."""
        unsent, self.unsent = self.unsent, []
        started = False
        for conn, key, data in unsent:
            if conn.closed or conn.leg != key:
                continue  # cancelled, or its connection failed, before it went out
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
                self._nursery.start_soon(self._send_rest, conn, key, memoryview(data)[sent:])
                started = True
        return started

    def cancel_leg(self, key: str) -> None:
        """Stop a leg: closing its connection makes the engine abort the request."""
        conn = self._legs.pop(key, None)
        if conn is None:
            return
        conn.leg = None
        self._close(conn)

    def finish_leg(self, key: str, reusable: bool) -> None:
        """The answer is complete: return the connection to the pool, or close it."""
        conn = self._legs.pop(key, None)
        if conn is None:
            return
        conn.leg = None
        if reusable and not conn.closed:
            pool = self._idle.setdefault(conn.url, [])
            if len(pool) < self._pool_size:
                pool.append(conn)  # its task reads on, so an engine's close is noticed at once
                return
        self._close(conn)

    def start_control(self, cmd: StartControl) -> None:
        """Run a control request in its own task."""
        self._nursery.start_soon(self._run_control, cmd)

    async def aclose(self) -> None:
        """Close every connection and the control client."""
        for pool in self._idle.values():
            for conn in pool:
                self._close(conn)
        self._idle.clear()
        for conn in list(self._legs.values()):
            self._close(conn)
        if self._http is not None:
            await self._http.aclose()

    # connections

    def _attach(self, conn: _Connection, key: str) -> None:
        conn.leg = key
        conn.got_bytes = False
        self._legs[key] = conn

    def _close(self, conn: _Connection) -> None:
        conn.closed = True
        if conn.sock is not None:
            close_socket(conn.sock)  # wakes its task's wait with ClosedResourceError
        elif conn.scope is not None:
            conn.scope.cancel()  # still connecting

    def _drop_idle(self, conn: _Connection) -> None:
        pool = self._idle.get(conn.url)
        if pool and conn in pool:
            pool.remove(conn)

    async def _report(self, conn: _Connection, event: Event) -> None:
        # Detach before reporting: the router may start the leg again at once
        # (a fresh connection after a stale pooled one), under the same key.
        key = conn.leg
        if key is not None and self._legs.get(key) is conn:
            del self._legs[key]
        conn.leg = None
        await self._feed(event)

    async def _connect(self, conn: _Connection, cmd: StartLeg) -> None:
        key = cmd.leg
        try:
            try:
                with trio.CancelScope() as scope:
                    conn.scope = scope
                    with trio.fail_after(cmd.connect_timeout):
                        stream = await trio.open_tcp_stream(cmd.engine.host, cmd.engine.port)
            except trio.TooSlowError:
                await self._report(conn, LegFailed(key, "connect_timeout"))
                return
            except OSError as exc:
                await self._report(conn, LegFailed(key, "local_error" if local_failure(exc) else "connect_failed"))
                return
            conn.scope = None
            if scope.cancelled_caught:
                return  # CancelLeg while connecting: the router knows
            conn.sock = sock = plain_socket(stream)
            if conn.closed:  # cancelled just as the connection opened
                close_socket(sock)
                return
            try:
                await send_all(sock, cmd.data)
            except (trio.ClosedResourceError, OSError):
                if conn.leg == key:
                    await self._report(conn, LegFailed(key, "dropped"))
                close_socket(sock)
                return
        except BaseException:
            # Cancelled from outside (shutdown): the router must not think the leg still runs.
            if conn.leg == key:
                with trio.CancelScope(shield=True):
                    await self._report(conn, LegFailed(key, "dropped"))
            raise
        await self._serve(conn)

    async def _send_rest(self, conn: _Connection, key: str, rest: memoryview) -> None:
        # The rare leg request a socket could not take at once.
        assert conn.sock is not None
        try:
            await send_all(conn.sock, rest)
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
                key = conn.leg
                if key is None:
                    # An idle connection has nothing to say: bytes or a close
                    # here make it unusable.
                    self._drop_idle(conn)
                    return
                if not data:
                    if data is None or (conn.reused and not conn.got_bytes):
                        # Reset, or a pooled connection the engine had closed
                        # while idle: then the router retries on a fresh one.
                        await self._report(conn, LegFailed(key, "dropped", conn.reused))
                        return
                    await self._feed(LegData(key, b""))
                    return
                conn.got_bytes = True
                await self._feed(LegData(key, data))
        except BaseException:
            # Cancelled from outside (shutdown): the router must not think the leg still runs.
            if conn.leg is not None:
                with trio.CancelScope(shield=True):
                    await self._report(conn, LegFailed(conn.leg, "dropped"))
            raise
        finally:
            conn.closed = True
            self._drop_idle(conn)
            close_socket(sock)

    # control requests

    async def _run_control(self, cmd: StartControl) -> None:
        status: int | None = None
        error: str | None = None
        local = False
        body = b""
        try:
            with trio.fail_after(cmd.timeout):
                if cmd.resolve:
                    # The engine's name, resolved at every probe: its addresses
                    # may name its KV side channel (docs/configure.md).
                    infos = await trio.socket.getaddrinfo(cmd.engine.host, cmd.engine.port, type=socket.SOCK_STREAM)
                    await self._feed(EngineResolved(cmd.engine, addresses_of(infos)))
                if cmd.drop_after_send:
                    stream = await trio.open_tcp_stream(cmd.engine.host, cmd.engine.port)
                    try:
                        await stream.send_all(cmd.data)
                    finally:
                        stream.socket.close()
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
        except (trio.TooSlowError, httpx.TimeoutException):
            error = "timeout"
        except (OSError, httpx.HTTPError, trio.BrokenResourceError) as exc:
            error = describe_failure(exc)
            local = local_failure(exc)
        except BaseException:
            with trio.CancelScope(shield=True):
                await self._feed(ControlDone(cmd.key, None, "cancelled"))
            raise
        await self._feed(ControlDone(cmd.key, status, error, local, body))
