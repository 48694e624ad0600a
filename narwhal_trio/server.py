"""Narwhal on trio: sockets, tasks, the timer and signals around the driver (:mod:`narwhal_runtime.driver`).

When a batch is performed is trio's: under load, at the end of the scheduler
batch, from the ``before_io_wait`` hook (an instrument), so a busy router
writes the journal once per batch and the sockets in one burst; under light
load (the driver's :meth:`~narwhal_runtime.driver.Driver.batch_ended`), at
once from each feed: writing just before the loop sleeps would make the
engine's answer find the process asleep more often (benchmarks/README.md).
A client socket that cannot take all its bytes at once is finished by a
writer task; a task feeding a client more than ``HIGH_WATER`` behind waits
for it to finish, and the writer drops a client that takes none of its
bytes for ``send_timeout_s`` (narwhal_runtime/slow_clients.py). Sockets
are plain non-blocking ones (see :mod:`.engines`).
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Callable
from typing import Any

import trio

from narwhal_core import (
    ClientConnected, ClientData, ClientGone, ClientStalled, Config, Event, Router,
)
from narwhal_runtime.app import Run
from narwhal_runtime.driver import HIGH_WATER, LINGER_S, keep_lingering
from narwhal_runtime.listening import Listener
from narwhal_runtime.serving import ServerBase
from narwhal_runtime.slow_clients import log_send_timeout
from narwhal_runtime.socket_io import send_all

from .engines import Engines, close_socket, receive
from .listener import listener as make_listener, serve as serve_listener

__all__ = ["Server", "run", "RUNTIME"]

RUNTIME = "trio"


class _Client:
    __slots__ = ("handle", "sock", "out", "buffered", "writing", "close_after", "closed", "drained", "release")

    def __init__(self, handle: int, sock: socket.socket) -> None:
        self.handle = handle
        self.sock = sock
        #: Frees the connection's slot (``ingress.max_connections``) once; set by its task.
        self.release: Callable[[], None] | None = None
        #: Bytes the writer task has still to send, and how many.
        self.out: list[bytes | memoryview] = []
        self.buffered = 0
        #: A writer task owns the socket's sending (it could not take every byte at once).
        self.writing = False
        self.close_after = False
        self.closed = False
        self.drained: trio.Event | None = None


class Server(ServerBase):
    """One router serving on trio. Use :meth:`serve` inside a nursery (``nursery.start``)."""

    engines: Engines | None
    runtime = RUNTIME

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        super().__init__(config, router, now=trio.current_time(), sleep=trio.sleep, in_thread=trio.to_thread.run_sync,
                         lookup_in_thread=functools.partial(trio.to_thread.run_sync, abandon_on_cancel=True))
        #: ``trio.current_time``, one call instead of three (it asks the run's clock through two more).
        self._current_time: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self._clients: dict[int, _Client] = {}
        self._next_handle = 0
        #: Writer tasks running (clients whose socket could not take every byte at once).
        self._writers = 0
        self._eager = True  # the last batch was light: perform each at once
        self._token: trio.lowlevel.TrioToken | None = None
        self._timer_wakeup = trio.Event()
        self._drained = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._poll_wakeup = trio.Event()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, serve until a shutdown drains, then close the journal (the start and the end: :class:`ServerBase`).

        ``task_status.started`` receives the bound ``(host, port)``.
        """
        listener = make_listener(self._listen(), limit=self.config.ingress.max_connections)
        self._token = trio.lowlevel.current_trio_token()
        end_of_batch = _EndOfBatch(self._end_of_batch)
        trio.lowlevel.add_instrument(end_of_batch)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.engines = Engines(nursery, self.feed, pool_size=self.config.engine.pool_connections_per_engine)
                nursery.start_soon(self._timer_loop)
                if self._busy.seconds:
                    nursery.start_soon(self._busy_poll_loop)
                for task in self.background():
                    nursery.start_soon(task)
                self.started(self._token.run_sync_soon, "trio")
                accepting = await nursery.start(serve_listener, listener, self._start_client)
                task_status.started(self.address)
                await self._drained.wait()
                accepting.cancel()
                nursery.cancel_scope.cancel()
        finally:
            self.stopping()
            listener.close()
            trio.lowlevel.remove_instrument(end_of_batch)
            self._flush()  # what the last drain produced
            with trio.CancelScope(shield=True):
                await self.closed()

    # ----------------------------------------------------------- the driver

    async def feed(self, event: Event) -> None:
        """Feed one event; wait if a client it fed is far behind (backpressure)."""
        driver = self.driver
        pending = driver.feed(event, self._current_time())
        # _after_drain(pending) and its _flush(), inlined: this runs once per event.
        if pending and self._eager:
            driver.flush(self)  # light load: perform now, while this task still has work to do
        if driver.rearm or driver.shutdown_complete:
            self._notice()  # (nothing of the flush waited for it: it only wakes tasks)
        if self._writers and driver.transmitted:
            for client in self._backlogged(driver.transmitted):
                if client.drained is None:
                    client.drained = trio.Event()
                # The leg this task reads waits for the client: its engine's silence is not its fault.
                self._feed_now(ClientStalled(client.handle, True))
                await client.drained.wait()
                self._feed_now(ClientStalled(client.handle, False))

    def _backlogged(self, handles: list[Any]) -> list[_Client]:
        found = []
        for handle in dict.fromkeys(handles):
            client = self._clients.get(handle)
            if (client is not None and client.writing
                    and client.buffered + self.driver.pending_bytes(handle) > HIGH_WATER):
                found.append(client)
        return found

    def _feed_now(self, event: Event) -> None:
        # For callers that must not block on a client socket (timer, cleanup).
        self._after_drain(self.driver.feed(event, self._current_time()))

    def _after_drain(self, pending: bool | None = None) -> None:
        # pending: what Driver.feed returned (None: ask the driver).
        self._notice()
        if self._eager and (self.driver.pending() if pending is None else pending):
            self._flush()  # light load: perform now, while this task still has work to do

    def _notice(self) -> None:
        driver = self.driver
        if driver.rearm:
            driver.rearm = False
            self._timer_wakeup.set()
        if driver.shutdown_complete:
            self._drained.set()

    def _start_polling(self) -> None:
        self._poll_wakeup.set()

    async def _busy_poll_loop(self) -> None:
        # Runnable (a checkpoint per batch) while the window is open, then parked.
        while True:
            await self._poll_wakeup.wait()
            self._poll_wakeup = trio.Event()
            while self._busy.keep_polling(time.monotonic()):
                await trio.lowlevel.checkpoint()

    async def _timer_loop(self) -> None:
        driver = self.driver
        while True:
            with trio.move_on_at(driver.armed):
                await self._timer_wakeup.wait()
            self._timer_wakeup = trio.Event()
            now = self._current_time()
            if now >= driver.armed:
                driver.fire_timer(now=now)
                self._after_drain()

    def _end_of_batch(self, timeout: float) -> None:
        """trio's ``before_io_wait``: perform what this batch produced."""
        driver = self.driver
        self._eager = driver.batch_ended()
        if driver.unflushed or (self.engines is not None and self.engines.unsent):
            self._flush()
            if timeout > 0 and trio.lowlevel.current_statistics().tasks_runnable:
                # The run loop chose its I/O wait before the flush woke or started a task: cut it short.
                assert self._token is not None
                self._token.run_sync_soon(_nothing)

    # -------------------------------------------------- effects (the I/O)

    def _flush(self) -> None:
        if self.driver.flush(self):  # (at once if a flush runs: that one performs what was added)
            self._notice()  # an effect fed the driver

    def send(self, conn: Any, data: bytes, close: bool) -> None:
        client = self._clients.get(conn)
        if client is None or client.closed:
            return
        if close:
            client.close_after = True
        if client.writing:
            if data:  # the writer sends what is queued, in order, then closes
                client.out.append(data)
                client.buffered += len(data)
            return
        if data:
            try:
                sent = client.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                client.closed = True  # the reader task notices the dead socket and tells the router
                close_socket(client.sock)
                return
            if sent < len(data):
                rest = memoryview(data)[sent:]
                client.out.append(rest)
                client.buffered = len(rest)
                client.writing = True
                self._writers += 1
                assert self._nursery is not None
                self._nursery.start_soon(self._writer, client)
                return
        if client.close_after:
            self._close_client(client)

    async def _writer(self, client: _Client) -> None:
        """Finish sending to a client whose socket could not take every byte at once."""
        sock = client.sock
        timeout = self.config.ingress.send_timeout_s
        try:
            left = 0  # of the bytes being sent: unsent, with those queued since (client.buffered)
            # The send timeout (narwhal_runtime/slow_clients.py): each byte the socket takes moves it on.
            with trio.CancelScope(deadline=trio.current_time() + timeout) as taking:

                def took(sent: int) -> None:
                    nonlocal left
                    left -= sent
                    taking.deadline = trio.current_time() + timeout

                while client.out and not client.closed:
                    out = client.out
                    data = out[0] if len(out) == 1 else b"".join(out)
                    client.out = []
                    client.buffered = 0
                    left = len(data)
                    await send_all(sock, data, trio.lowlevel.wait_writable, took)
            if taking.cancelled_caught:
                log_send_timeout(timeout, left + client.buffered)
                raise trio.BrokenResourceError("send timeout")  # drop it: it cannot hold a slot forever
            if client.close_after and not client.closed:
                self._close_client(client)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            client.closed = True  # the reader task notices the dead socket and tells the router
            client.out = []
            close_socket(sock)
        finally:
            client.writing = False
            self._writers -= 1
            if client.drained is not None:
                client.drained.set()
                client.drained = None

    def _close_client(self, client: _Client) -> None:
        # Lingering close: shut our side, let the reader drop what the client still sends, close after LINGER_S.
        client.closed = True
        if client.release is not None:
            client.release()  # the router is done with it: its slot is free
        try:
            client.sock.shutdown(socket.SHUT_WR)
        except OSError:
            close_socket(client.sock)
            return
        assert self._nursery is not None
        self._nursery.start_soon(_end_linger, client.sock)

    # -------------------------------------------------------------- clients

    def _start_client(self, sock: socket.socket, listener: Listener) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(self._client_task, sock, listener)

    async def _client_task(self, sock: socket.socket, listener: Listener) -> None:
        handle = self._next_handle
        self._next_handle += 1
        client = self._clients[handle] = _Client(handle, sock)

        def release() -> None:
            if client.release is not None:
                client.release = None
                del self._clients[handle]
                listener.release()

        client.release = release
        try:
            try:
                peer = sock.getpeername()
            except OSError:
                return
            await self.feed(ClientConnected(handle, str(peer[0]), int(peer[1])))
            while not client.closed:
                # Wait first: a client sends its next request only once it has this answer.
                data = await receive(sock)
                if data is None:
                    break
                await self.feed(ClientData(handle, data))
                if not data:
                    break
            if self._closing(client):
                await _linger(sock)  # Narwhal closed it: drop what the client still sends
        finally:
            if not self._closing(client):
                self._feed_now(ClientGone(handle))  # the socket broke under us: the router must hear it
            release()
            client.closed = True
            close_socket(sock)

    def _closing(self, client: _Client) -> bool:
        return client.close_after or self.driver.closing(client.handle)


async def _linger(sock: socket.socket) -> None:
    discarded = 0
    while keep_lingering(discarded) and sock.fileno() != -1:  # closed: a failed write, or LINGER_S is over
        data = await receive(sock)
        if not data:
            return  # EOF, or closed
        discarded += len(data)


async def _end_linger(sock: socket.socket) -> None:
    await trio.sleep(LINGER_S)
    close_socket(sock)  # wakes a reader still lingering; nothing if it is closed


class _EndOfBatch(trio.abc.Instrument):
    """Calls ``flush(timeout)`` once per scheduler batch, before the run loop waits for I/O."""

    def __init__(self, flush: Callable[[float], None]) -> None:
        # The hook is ``flush`` itself (trio looks it up on the instance): no call more per batch.
        self.before_io_wait = flush  # type: ignore[method-assign,assignment]


def _nothing() -> None:
    """Queued with ``run_sync_soon`` only to wake the run loop's I/O wait."""


def run(config: Config, on_ready: Callable[[str, int], None] | None = None) -> int:
    """``narwhal serve --runtime trio``: serve until SIGTERM/SIGINT, then drain (signals: :class:`Run`)."""
    process = Run(on_ready)

    async def main() -> None:
        server = Server(config)
        with trio.open_signal_receiver(*Run.SIGNALS) as signals:
            async with trio.open_nursery() as nursery:

                async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    try:
                        await server.serve(task_status=task_status)
                    finally:
                        nursery.cancel_scope.cancel()  # the signal loop below ends with it

                process.started(*await nursery.start(serve))
                async for signum in signals:
                    if process.signal_received(signum, server):
                        nursery.cancel_scope.cancel()  # serve() still writes the journal out

    return process.exit_status(lambda: trio.run(main))

