"""Narwhal on asyncio: callbacks, the timer and signals around the driver (:mod:`narwhal_runtime.driver`).

Client and engine connections are the ones both runtimes run
(:mod:`narwhal_runtime.client_connections`, :mod:`narwhal_runtime.legs`);
the loop calls them when their sockets are ready (``add_reader``,
``add_writer``: :class:`_ClientIO`, :class:`~.engines.LegIO`), and they
feed the driver synchronously. One ``call_soon`` callback per loop
iteration performs the batch, before the loop waits for I/O again. No
task runs per request (tasks only open engine connections and run control
requests). Slow clients: see narwhal_runtime/slow_clients.py. uvloop runs
the loop when installed.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable

from narwhal_core import Config, Event, Router
from narwhal_runtime.app import Run
from narwhal_runtime.client_connections import ClientConnection
from narwhal_runtime.serving import ServerBase

from .engines import Engines, LegIO
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
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


class _ClientIO(LegIO):
    """What asyncio lends its client connections (:class:`~narwhal_runtime.client_connections.ClientIO`).

    The loop watches each socket (``add_reader``, ``add_writer``), as for
    legs (:class:`~.engines.LegIO`).
    """

    def __init__(self, server: Server, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.send_timeout_s = server.config.ingress.send_timeout_s
        self.feed = server.feed
        self.now = loop.time
        self.later = loop.call_later
        self.soon = loop.call_soon
        self._server = server

    def ended(self, conn: ClientConnection) -> None:
        super().ended(conn)
        self._server._live.discard(conn)

    def released(self, conn: ClientConnection) -> None:
        if self._server._listener is not None:
            self._server._listener.release()


class Server(ServerBase):
    """One router serving on asyncio. Run :meth:`serve` on the running loop."""

    engines: Engines | None
    runtime = RUNTIME

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        super().__init__(config, router, now=clock(), sleep=asyncio.sleep, in_thread=asyncio.to_thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Every client connection not yet ended (with its slot, or lingering after Narwhal closed it).
        self._live: set[ClientConnection] = set()
        self._io: _ClientIO | None = None
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._listener: Listener | None = None
        self._stopping = False

    async def serve(self, *, started: Callable[[tuple[str, int]], object] | None = None) -> None:
        """Listen, serve until a shutdown drains, then close the journal (the start and the end: :class:`ServerBase`).

        ``started`` gets the bound ``(host, port)``.
        """
        loop = self._loop = asyncio.get_running_loop()
        self._drained = loop.create_future()
        self._io = _ClientIO(self, loop)
        listener = Listener(loop, self._listen(), self._start_client, limit=self.config.ingress.max_connections)
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
        # cancelled instead, each client's end tells the router.)
        live = self._live
        for conn in list(live):
            if conn.lingering:
                conn.end()
        deadline = clock() + EXIT_FLUSH_S
        while any(conn.out for conn in live) and clock() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(live):
            conn.broken()

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

    send = staticmethod(ClientConnection.send)  # type: ignore[assignment]  # the connection is the driver's handle

    # -------------------------------------------------------------- clients

    def _start_client(self, sock: socket.socket, _: object) -> None:
        assert self._io is not None
        conn = ClientConnection(sock, self._io)
        self._live.add(conn)
        if self._stopping:
            conn.end()  # the router never hears of it
        else:
            conn.start(self.driver.closing)


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

