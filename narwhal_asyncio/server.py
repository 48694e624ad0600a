"""Narwhal on asyncio: protocols, the timer and signals around the driver (:mod:`narwhal_runtime.driver`).

A transport's ``data_received`` feeds the driver synchronously; one
``call_soon`` callback per loop iteration performs the batch, before the
loop waits for I/O again. No task runs per request (tasks only open engine
connections and run control requests). Slow clients: see
narwhal_runtime/slow_clients.py. uvloop runs the loop when installed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from narwhal_core import (
    ClientConnected, ClientData, ClientGone, ClientStalled, Config, Event, Router,
)
from narwhal_runtime.app import Run
from narwhal_runtime.driver import HIGH_WATER, LINGER_S, keep_lingering
from narwhal_runtime.serving import ServerBase
from narwhal_runtime.slow_clients import LOOKS, SendWatch, log_send_timeout

from .engines import BufferedReads, Engines, is_uvloop, read_buffer
from .listener import Listener

__all__ = ["Server", "run", "new_event_loop", "RUNTIME"]

RUNTIME = "asyncio"
#: Seconds the last client connections get to flush at exit.
EXIT_FLUSH_S = 1.0
#: Timers fire this much after the router's deadline: uvloop schedules in
#: whole milliseconds and may otherwise fire a little early, only to re-arm.
TIMER_SLACK_S = 0.001
#: The router's clock: ``loop.time()`` of asyncio's own loop, at microsecond
#: resolution under uvloop too (whose ``loop.time()`` counts milliseconds).
clock = time.monotonic


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when it is installed, asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``"uvloop"`` or ``"asyncio"``: which event loop implementation runs the server."""
    return "uvloop" if is_uvloop(loop) else "asyncio"


class _Client(asyncio.Protocol):
    """One client connection; it is its own handle in the router's events and commands."""

    __slots__ = (
        "server", "transport", "closed", "lost", "write_paused", "relays", "watch", "next_look", "linger", "discarded",
    )

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        #: The router no longer knows this connection (it closed it, or heard it is gone).
        self.closed = False
        self.lost = False
        self.write_paused = False
        #: Engine leg connections relaying to this client (paused with it).
        self.relays: set[Any] = set()
        #: While the transport holds unsent bytes: whether the client takes them, and the next look.
        self.watch: SendWatch | None = None
        self.next_look: asyncio.TimerHandle | None = None
        #: Closes the socket at the end of the lingering close (see :data:`LINGER_S`).
        self.linger: asyncio.TimerHandle | None = None
        #: Bytes read and dropped since Narwhal closed its side.
        self.discarded = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server._accepted(self)

    def data_received(self, data: bytes) -> None:
        if self.linger is not None:
            # Lingering close: the router is done with this client.
            self.discarded += len(data)
            if not keep_lingering(self.discarded):
                self.transport.close()
            return
        self.server.feed(ClientData(self, data))

    def eof_received(self) -> bool:
        self.server._client_eof(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.linger is not None:
            self.linger.cancel()
        if self.next_look is not None:
            self.next_look.cancel()
        self.server._client_lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.transport.pause_reading()  # no next request either, until this one is read
        for leg in self.relays:
            leg.pause()
        self._tell_stalled(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if not self.closed:
            self.transport.resume_reading()
        for leg in self.relays:
            leg.resume()
        self._tell_stalled(False)

    def watch_sends(self, unsent: int) -> None:
        """A write left ``unsent`` bytes in the transport: watch them until the client takes them (the send timeout)."""
        self.watch = SendWatch(unsent)
        self.next_look = asyncio.get_running_loop().call_later(self.server._look_every, self._look)

    def _look(self) -> None:
        assert self.watch is not None
        unsent = self.transport.get_write_buffer_size()
        verdict = self.watch.look(unsent)
        if verdict == "again":
            self.next_look = asyncio.get_running_loop().call_later(self.server._look_every, self._look)
            return
        self.watch = self.next_look = None
        if verdict == "drop" and not self.lost:
            log_send_timeout(self.server.config.ingress.send_timeout_s, unsent)
            self.transport.abort()  # it took none of our bytes for send_timeout_s

    def _tell_stalled(self, stalled: bool) -> None:
        # The legs relaying to this client wait for it (and those started
        # meanwhile start paused, see Engines._attach): their engines'
        # silence is not their fault. (Fed from the loop, not from inside
        # the transport write that called us.)
        if not self.closed:
            asyncio.get_running_loop().call_soon(self.server.feed, ClientStalled(self, stalled))


class _BufferedClient(_Client, BufferedReads):
    __slots__ = ("buffer",)

    def __init__(self, server: Server) -> None:
        super().__init__(server)
        self.buffer = server.buffer


class Server(ServerBase):
    """One router serving on asyncio. Run :meth:`serve` on the running loop."""

    engines: Engines | None
    runtime = RUNTIME

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        super().__init__(config, router, now=clock(), sleep=asyncio.sleep, in_thread=asyncio.to_thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: The connections holding a slot (``ingress.max_connections``, counted by the :class:`Listener`).
        self._clients: set[_Client] = set()
        #: Connections Narwhal closed, dropping what their clients still send (:data:`LINGER_S`).
        self._lingering: set[_Client] = set()
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._listener: Listener | None = None
        self._stopping = False
        #: Seconds between two looks at a client's unsent bytes (narwhal_runtime/slow_clients.py).
        self._look_every = config.ingress.send_timeout_s / LOOKS
        #: What its clients read into on asyncio's own loop (:class:`~.engines.BufferedReads`).
        self.buffer = read_buffer()

    async def serve(self, *, started: Callable[[tuple[str, int]], object] | None = None) -> None:
        """Listen, serve until a shutdown drains, then close the journal (the start and the end: :class:`ServerBase`).

        ``started`` gets the bound ``(host, port)``.
        """
        loop = self._loop = asyncio.get_running_loop()
        self._drained = loop.create_future()
        client = _Client if is_uvloop(loop) else _BufferedClient
        listener = Listener(loop, self._listen(), lambda: client(self), limit=self.config.ingress.max_connections)
        tasks: list[asyncio.Task[None]] = []
        try:
            self._listener = listener
            self.engines = Engines(loop, self.feed, pool_size=self.config.engine.pool_connections_per_engine)
            tasks = [loop.create_task(task()) for task in self.background()]
            self.started(loop.call_soon_threadsafe, loop_name(loop))
            if started is not None:
                started(self.address)  # type: ignore[arg-type]
            await self._drained
        finally:
            self.stopping()
            self._flush()
            self._stop_listening()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.closed()

    def _stop_listening(self) -> None:
        self._stopping = True
        if self._listener is not None:
            self._listener.close()

    async def _close_clients(self) -> None:
        # After a drain the router has closed every connection; give the last
        # bytes a moment to leave, then cut what is left. (If serve() was
        # cancelled instead, connection_lost tells the router of each client.)
        for client in list(self._lingering):
            client.transport.abort()
        clients = self._clients
        for client in list(clients):
            client.transport.close()
        deadline = clock() + EXIT_FLUSH_S
        while clients and clock() < deadline:
            await asyncio.sleep(0.01)
        for client in list(clients):
            client.transport.abort()
        await asyncio.sleep(0)  # let connection_lost run

    # ----------------------------------------------------------- the driver

    def feed(self, event: Event) -> None:
        """Feed one event (synchronously); its batch is performed at the end of the loop iteration."""
        driver = self.driver
        pending = driver.feed(event, clock())
        if driver.rearm or driver.shutdown_complete:
            self._after_drain(pending)
        elif pending and not self._flush_scheduled:
            # _after_drain()'s common case, inlined: this runs once per event.
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    _feed_now = feed

    def _after_drain(self, pending: bool | None = None) -> None:
        """Act on the driver's last drain: re-arm the timer, end the drain, schedule the flush.

        ``pending``: what :meth:`Driver.feed` returned (``None``: ask the driver).
        """
        driver = self.driver
        if driver.rearm:
            driver.rearm = False
            if self._timer is not None:
                self._timer.cancel()
            assert self._loop is not None
            self._timer = self._loop.call_at(driver.armed + TIMER_SLACK_S, self._on_timer)
        if driver.shutdown_complete and self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        if not self._flush_scheduled and (driver.pending() if pending is None else pending):
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)

    def _on_timer(self) -> None:
        # The armed deadline is due (were it not, the drain would re-arm the same deadline).
        self._timer = None
        self.driver.fire_timer(now=clock())
        self._after_drain()

    def _start_polling(self) -> None:
        if self._loop is not None:
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        # While a callback is queued, the loop's next wait for I/O returns at once.
        if self._busy.keep_polling(clock()):
            assert self._loop is not None
            self._loop.call_soon(self._poll)

    # -------------------------------------------------- effects (the I/O)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self.engines is None:
            return
        if self.driver.flush(self):  # (it contains a failed write: a failed write must not stop the server)
            # The flush fed the driver itself (journal health): act on that
            # drain too. (A client admitted meanwhile went through feed().)
            self._after_drain()

    def send(self, client: _Client, data: bytes, close: bool) -> None:
        if client.lost:
            return
        if data:
            try:
                client.transport.write(data)
            except RuntimeError:
                pass  # uvloop: the socket just failed; connection_lost tells the router
            else:  # bytes left unsent: the send timeout watches them
                if client.watch is not None:
                    client.watch.wrote(len(data))
                elif unsent := client.transport.get_write_buffer_size():
                    client.watch_sends(unsent)
        if close:
            client.closed = True
            self._close(client)

    def _close(self, client: _Client) -> None:
        transport = client.transport
        assert self._loop is not None
        if client.linger is None and not transport.is_closing() and transport.can_write_eof():
            # Lingering close: our side shuts once the bytes written before
            # are out; what the client still sends is read and dropped, for a
            # while, before the socket closes.
            transport.write_eof()
            transport.resume_reading()
            client.linger = self._loop.call_later(LINGER_S, transport.close)
            self._release(client)  # the router is done with it: its connection slot is free
            self._lingering.add(client)
        else:
            transport.close()  # after the bytes written before it (the send timeout still watches them)

    # -------------------------------------------------------------- clients

    def _accepted(self, client: _Client) -> None:
        self._clients.add(client)  # its slot, taken by the listener's accept
        peer = client.transport.get_extra_info("peername")
        if self._stopping or not peer:
            client.closed = True  # the router never hears of it
            client.transport.abort()
            return
        client.transport.set_write_buffer_limits(high=HIGH_WATER, low=0)  # held until all is sent
        self.feed(ClientConnected(client, str(peer[0]), int(peer[1])))

    def _release(self, client: _Client) -> None:
        if client in self._clients:
            self._clients.discard(client)
            if self._listener is not None:
                self._listener.release()

    def _client_eof(self, client: _Client) -> None:
        if self._closing(client):
            return
        self.feed(ClientData(client, b""))
        if not self._closing(client):
            # The client closed its side and the router kept the connection:
            # as on trio, the connection ends here and the router must hear it.
            client.closed = True
            self.feed(ClientGone(client))

    def _client_lost(self, client: _Client) -> None:
        self._lingering.discard(client)
        self._release(client)
        client.write_paused = False
        for leg in client.relays:
            leg.resume()
        if not self._closing(client):
            # The socket broke under us: the router must hear it.
            client.closed = True
            self.feed(ClientGone(client))

    def _closing(self, client: _Client) -> bool:
        return client.closed or self.driver.closing(client)


def run(config: Config, on_ready: Callable[[str, int], None] | None = None) -> int:
    """``narwhal serve --runtime asyncio``: serve until SIGTERM/SIGINT, then drain (signals: :class:`Run`)."""
    process = Run(on_ready)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = Server(config)
        serve = asyncio.current_task()
        stopped = False

        def on_signal(signum: int) -> None:
            nonlocal stopped
            if process.signal_received(signum, server) and serve is not None:
                stopped = True
                serve.cancel()  # serve() still writes the journal out

        for sig in Run.SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)
        try:
            await server.serve(started=lambda address: process.started(*address))
        except asyncio.CancelledError:
            if not stopped:
                raise
        finally:
            for sig in Run.SIGNALS:
                loop.remove_signal_handler(sig)

    def body() -> None:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(main())

    return process.exit_status(body)

