"""Narwhal on trio: sockets, tasks, the timer and signals around the driver (:mod:`narwhal_runtime.driver`).

When a batch is performed is trio's: under load, at the end of the scheduler
batch, from the ``before_io_wait`` hook (an instrument), so a busy router
writes the journal once per batch and the sockets in one burst; under light
load (the driver's :meth:`~narwhal_runtime.driver.Driver.batch_ended`), at
once from each feed: writing just before the loop sleeps would make the
engine's answer find the process asleep more often (benchmarks/README.md).
Connections, the listener and control requests are the ones both runtimes
run, over trio's :class:`~.io.IO`: tasks that wait for their sockets. The
server is the :class:`~narwhal_runtime.serving.Adapter` of its
:class:`~narwhal_runtime.serving.Serving`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import trio

from narwhal_core import Config, Event, Router
from narwhal_runtime.app import Run
from narwhal_runtime.serving import Serving

from .io import IO

__all__ = ["Server", "run", "RUNTIME"]

RUNTIME = "trio"


class Server:
    """One router serving on trio. Use :meth:`serve` inside a nursery (``nursery.start``)."""

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        #: What both runtimes share: the router, its driver and effects, the start and the end of serving.
        self.serving = Serving(config, router, self, runtime=RUNTIME, now=trio.current_time(), sleep=trio.sleep,
                               in_thread=trio.to_thread.run_sync,
                               lookup_in_thread=functools.partial(trio.to_thread.run_sync, abandon_on_cancel=True))
        self.driver = self.serving.driver
        self._effects = self.serving.effects
        #: ``trio.current_time``, one call instead of three (it asks the run's clock through two more).
        self._current_time: Callable[[], float] = trio.lowlevel.current_clock().current_time
        self._eager = True  # the last batch was light: perform each at once
        self._token: trio.lowlevel.TrioToken | None = None
        self._timer_wakeup = trio.Event()
        self._drained = trio.Event()
        self._poll_wakeup = trio.Event()

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, serve until a shutdown drains, then close the journal (the start and the end: :class:`Serving`).

        ``task_status.started`` receives the bound ``(host, port)``.
        """
        serving = self.serving
        sockets = serving.listen()
        self._token = trio.lowlevel.current_trio_token()
        end_of_batch = _EndOfBatch(self.before_io_wait)
        trio.lowlevel.add_instrument(end_of_batch)
        try:
            async with trio.open_nursery() as nursery:
                io = IO(nursery)
                try:
                    io.spawn(self._timer_loop)
                    if serving.busy.seconds:
                        io.spawn(self._busy_poll_loop)
                    serving.begin(io, sockets, self._token.run_sync_soon, "trio")
                    task_status.started(serving.address)
                    await self._drained.wait()
                finally:
                    with trio.CancelScope(shield=True):
                        await serving.end()  # (the connections' tasks still run: the exit flush needs them)
                    nursery.cancel_scope.cancel()
        finally:
            trio.lowlevel.remove_instrument(end_of_batch)

    # ----------------------------------------------------------- the driver

    def feed(self, event: Event) -> None:
        """Feed one event from a socket."""
        driver = self.driver
        pending = driver.feed(event, self._current_time())
        # after_drain(pending) and its flush(), inlined: this runs once per event.
        if pending and self._eager:
            driver.flush(self._effects)  # light load: perform now, while this task still has work to do
        if driver.rearm or driver.shutdown_complete:
            self._notice()  # (nothing of the flush waited for it: it only wakes tasks)

    def feed_now(self, event: Event) -> None:
        """Feed an event from no socket (it never waits behind a client's)."""
        self.after_drain(self.driver.feed(event, self._current_time()))

    def after_drain(self, pending: bool | None = None) -> None:
        """Act on the driver's last drain; ``pending``: what :meth:`Driver.feed` returned (``None``: ask)."""
        self._notice()
        if self._eager and (self.driver.pending() if pending is None else pending):
            self.flush()  # light load: perform now, while this task still has work to do

    def _notice(self) -> None:
        driver = self.driver
        if driver.rearm:
            driver.rearm = False
            self._timer_wakeup.set()
        if driver.shutdown_complete:
            self._drained.set()

    def start_polling(self) -> None:
        """Wake the busy-poll task."""
        self._poll_wakeup.set()

    async def _busy_poll_loop(self) -> None:
        # Runnable (a checkpoint per batch) while the window is open, then parked.
        while True:
            await self._poll_wakeup.wait()
            self._poll_wakeup = trio.Event()
            while self.serving.busy.keep_polling(time.monotonic()):
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
                self.after_drain()

    def before_io_wait(self, timeout: float) -> None:
        """Once per scheduler batch, before the run loop waits for I/O (:class:`_EndOfBatch`): perform the batch."""
        driver = self.driver
        self._eager = driver.batch_ended()
        engines = self._effects.engines
        if driver.unflushed or (engines is not None and engines.unsent):
            self.flush()
            if timeout > 0 and trio.lowlevel.current_statistics().tasks_runnable:
                # The run loop chose its I/O wait before the flush woke or started a task: cut it short.
                assert self._token is not None
                self._token.run_sync_soon(_nothing)

    # -------------------------------------------------- effects (the I/O)

    def flush(self) -> None:
        """Perform what the driver has pending."""
        if self.driver.flush(self._effects):  # (at once if a flush runs: that one performs what was added)
            self._notice()  # an effect fed the driver


class _EndOfBatch(trio.abc.Instrument):
    """Calls ``flush(timeout)`` once per scheduler batch, before the run loop waits for I/O."""

    def __init__(self, flush: Callable[[float], None]) -> None:
        # The hook is ``flush`` itself (trio looks it up on the instance): the server as its own
        # instrument, the hook a method, measured dearer (benchmarks/instructions.py, on trio).
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
                    if process.signal_received(signum, server.serving):
                        nursery.cancel_scope.cancel()  # serve() still writes the journal out

    return process.exit_status(lambda: trio.run(main))

