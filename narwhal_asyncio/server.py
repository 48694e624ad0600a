"""Narwhal on asyncio: callbacks, the timer and signals around the driver (:mod:`narwhal_runtime.driver`).

Connections, the listener and control requests are the ones both runtimes
run, over asyncio's :class:`~.io.IO`: the loop calls a connection when its
socket is ready (``add_reader``, ``add_writer``), and it feeds the driver
synchronously. One ``call_soon`` callback per loop iteration performs the
batch, before the loop waits for I/O again. uvloop runs the loop when
installed. The server is the :class:`~narwhal_runtime.serving.Adapter` of
its :class:`~narwhal_runtime.serving.Serving`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from narwhal_core import Config, Event, Router
from narwhal_runtime.app import Run
from narwhal_runtime.serving import Serving

from .io import IO

__all__ = ["Server", "run", "new_event_loop", "RUNTIME"]

RUNTIME = "asyncio"
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


class Server:
    """One router serving on asyncio. Run :meth:`serve` on the running loop."""

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        #: What both runtimes share: the router, its driver and effects, the start and the end of serving.
        self.serving = Serving(config, router, self, runtime=RUNTIME, now=clock(), sleep=asyncio.sleep,
                               in_thread=asyncio.to_thread)
        self.driver = self.serving.driver
        self._effects = self.serving.effects
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        #: Serving ended: the driver's timer is no longer set.
        self._stopped = False

    async def serve(self, *, started: Callable[[tuple[str, int]], object] | None = None) -> None:
        """Listen, serve until a shutdown drains, then close the journal (the start and the end: :class:`Serving`).

        ``started`` gets the bound ``(host, port)``.
        """
        serving = self.serving
        loop = self._loop = asyncio.get_running_loop()
        self._drained = loop.create_future()
        sockets = serving.listen()
        try:
            serving.begin(IO(loop), sockets, loop.call_soon_threadsafe, loop_name(loop))
            if started is not None:
                started(serving.address)  # type: ignore[arg-type]
            await self._drained
        finally:
            self._stopped = True
            if self._timer is not None:
                self._timer.cancel()
            await serving.end()

    # ----------------------------------------------------------- the driver

    def feed(self, event: Event) -> None:
        """Feed one event (synchronously); its batch is performed at the end of the loop iteration."""
        driver = self.driver
        pending = driver.feed(event, clock())
        if driver.rearm or driver.shutdown_complete:
            self.after_drain(pending)
        elif pending and not self._flush_scheduled:
            # after_drain()'s common case, inlined: this runs once per event.
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self.flush)

    #: An event from no socket is fed the same way: asyncio's feed never waits.
    feed_now = feed

    def after_drain(self, pending: bool | None = None) -> None:
        """Act on the driver's last drain: re-arm the timer, end the drain, schedule the flush.

        ``pending``: what :meth:`Driver.feed` returned (``None``: ask the driver).
        """
        driver = self.driver
        if driver.rearm and not self._stopped:
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
            self._loop.call_soon(self.flush)

    def _on_timer(self) -> None:
        # The armed deadline is due (were it not, the drain would re-arm the same deadline).
        self._timer = None
        self.driver.fire_timer(now=clock())
        self.after_drain()

    def start_polling(self) -> None:
        """Queue the busy-poll callback."""
        if self._loop is not None:
            self._loop.call_soon(self._poll)

    def _poll(self) -> None:
        # While a callback is queued, the loop's next wait for I/O returns at once.
        if self.serving.busy.keep_polling(clock()):
            assert self._loop is not None
            self._loop.call_soon(self._poll)

    # -------------------------------------------------- effects (the I/O)

    def flush(self) -> None:
        """Perform what the driver has pending (once serving)."""
        self._flush_scheduled = False
        if self._effects.engines is None:
            return
        if self.driver.flush(self._effects):  # (it contains a failed write: a failed write must not stop the server)
            # The flush fed the driver itself (journal health): act on that
            # drain too. (A client admitted meanwhile went through feed().)
            self.after_drain()


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
            if process.signal_received(signum, server.serving) and serve is not None:
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

