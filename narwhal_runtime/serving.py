"""The half of each runtime's ``Server`` that does not depend on its event loop.

Both adapters subclass :class:`ServerBase`: it builds the router and its
driver, opens the journal (:mod:`.journal_file`; a failure is a start-up
error), performs the effects that are the same on both runtimes (the
journal write, process-log lines, the queued leg requests) and turns SIGHUP
into the router's new authenticator. It binds the listening sockets
(:mod:`.listening`).

It also holds the start and the end of serving, the same on both runtimes:
what starts once the loop serves (:meth:`ServerBase.begin`: the client and
engine connections over the runtime's :class:`~.runtime_io.RuntimeIO`, the
listener, the tasks of :meth:`ServerBase.background`, the threads) and, in
order, what stops at the end (:meth:`ServerBase.end`); the busy-poll rule
(each event fed opens the window); and which events go through
``_feed_now``. What is left in each adapter is its ``IO``, the driver's
timer, when a batch is performed, and signals.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Final

from narwhal_core import (
    AuthenticatorChanged, Config, ConfigError, Event, PromptTokenized, Router, ShutdownRequested, TokenizePrompt,
)
from narwhal_core.engine_config import EngineAddress
from narwhal_core.ids import PREFILL

from .app import StartupError, build_router, journal_failure, listen_failure, load_authenticator, log_listening
from .client_connections import ClientConnection, ClientConnections
from .discovery import make_discovery
from .driver import BusyPoll, Driver
from .group_metrics import current_group
from .journal_file import JournalFile
from .kv_subscriber import kv_sources, make_kv_subscriber
from .legs import Engines
from .listening import Listener, listening_sockets
from .log import log_event
from .runtime_io import RuntimeIO
from .tokenize_worker import make_tokenize_worker

__all__ = ["ServerBase", "start_tracer", "FLEET_CHANGES"]

#: The router's log lines that say the fleet's membership changed (discovery or the admin API):
#: the KV-event subscriber follows them.
FLEET_CHANGES: Final = frozenset({"engine_added", "engine_removed"})


def start_tracer(config: Config) -> Any:
    """The span exporter ``[tracing]`` asks for (a :class:`~.tracing.Tracer`), or ``None`` when it is off."""
    if config.tracing.endpoint is None:
        return None
    try:
        from .tracing import Tracer
    except ImportError as exc:
        raise StartupError(
            f"tracing.endpoint is set but the OpenTelemetry SDK cannot be imported ({exc}); "
            "install narwhal[tracing]"
        ) from None
    return Tracer(config.tracing)


class ServerBase:
    """Router, driver, journal and the loop-independent effects of one server."""

    #: Set once serving (:meth:`begin`): the engine connections, the client connections, the listener.
    engines: Engines | None
    clients: ClientConnections
    listener: Listener
    #: What the runtime lends the connections (set by :meth:`begin`).
    io: RuntimeIO
    #: The runtime's name in the ``listening`` and ``stopped`` log lines (``"trio"``, ``"asyncio"``).
    runtime: str

    def __init__(self, config: Config, router: Router | None, *, now: float,
                 sleep: Callable[[float], Awaitable[object]],
                 in_thread: Callable[[Callable[[], None]], Awaitable[object]],
                 lookup_in_thread: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None) -> None:
        """``sleep`` and ``in_thread`` (a function in a worker thread) are the runtime's.

        ``lookup_in_thread`` runs a discovery lookup (by default ``in_thread``;
        trio's abandons a lookup still running at shutdown: :meth:`background`).
        """
        self.config = config
        self.router = router or build_router(config, now=now)
        self.driver = Driver(self.router)
        j = config.journal
        try:
            self.journal = JournalFile(j.path, j.fsync, j.fsync_interval_s, sleep=sleep, in_thread=in_thread)
        except OSError as exc:
            raise journal_failure(config.journal.path, exc) from None
        #: Spans out of the terminal records ([tracing] endpoint; docs/operate.md, "Tracing").
        self.tracer = start_tracer(config)
        if self.tracer is None:
            # The driver's write_journal, without a call more: it runs once per flush.
            self.write_journal = self.journal.writer.write_lines  # type: ignore[method-assign]
        self._in_thread = in_thread
        self._sleep = sleep
        self._lookup_in_thread = lookup_in_thread or in_thread
        self.engines = None
        #: The address the server listens on, once started.
        self.address: tuple[str, int] | None = None
        self._busy = BusyPoll(config.ingress.busy_poll_us / 1e6)
        #: ``engine.discovery`` dns or file: the lookups the adapter runs while serving (``None``: static engines).
        self.discovery = make_discovery(config)
        #: ``engine.kv_events``: the prefill engines' KV-event streams, read by a thread of its own that the
        #: adapter starts once serving (:meth:`start_kv_events`) and stops at exit (``None``: not configured).
        self.kv_subscriber = make_kv_subscriber(config, self._kv_engines())
        #: ``routing.policy = "kv"``: the thread that tokenizes large prompts off the loop, started once serving
        #: (:meth:`start_tokenizer`) and stopped at exit (``None``: the policy tokenizes nothing).
        self.tokenize_worker = make_tokenize_worker(self.router)
        #: A worker of a group (``ingress.workers`` > 1) snapshots its metrics after each flush.
        self._group = current_group()
        if self._group is not None:
            self.driver.after_flush = self._group.tick
        #: :meth:`shutdown` was asked for before serving began (a signal while starting).
        self._shutdown_asked = False
        if self._busy.seconds:
            # Only then does an event cost more: the adapter's feed, wrapped so that each opens the window.
            self._feed_unpolled = self.feed
            self.feed = self._feed_and_poll  # type: ignore[method-assign]

    # ------------------------------------------------- the start and the end

    def background(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        """The tasks to run while serving, until cancelled at the end: the journal's fsync timer, discovery.

        Discovery feeds through ``_feed_now``, as every source that is not a
        socket does (the KV-event subscriber, the tokenizer thread, SIGHUP,
        :meth:`shutdown`): it never waits behind a slow client, and opens no
        busy-poll window. (A lookup in its thread is abandoned at shutdown
        on trio: the resolver's own timeout ends it.)
        """
        tasks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        if self.config.journal.fsync == "interval":
            tasks.append(self.journal.run_sync_timer)
        if self.discovery is not None:
            tasks.append(functools.partial(self.discovery.run, self._feed_now, self._sleep, self._lookup_in_thread))
        return tasks

    def begin(self, io: RuntimeIO, sockets: list[socket.socket], call_soon_threadsafe: Callable[..., object],
              loop: str) -> None:
        """The loop serves: connections over ``io``, accepting on ``sockets``, the :meth:`background` tasks, the threads.

        ``call_soon_threadsafe`` is how the KV-event subscriber's and the
        tokenizer's threads hand over to the loop (trio: the trio token's
        ``run_sync_soon``; asyncio: ``loop.call_soon_threadsafe``); ``loop``
        names the event loop in the ``listening`` line. The first drain
        takes what the router queued on its own (the first health probes).
        A :meth:`shutdown` asked for while starting begins now.
        """
        self.io = io
        ingress = self.config.ingress
        self.engines = Engines(io, self.feed, self.config.engine.pool_connections_per_engine)
        self.listener = Listener(sockets, limit=ingress.max_connections, io=io)
        self.clients = ClientConnections(io, self.feed, self.driver.closing,
                                         send_timeout_s=ingress.send_timeout_s, release=self.listener.release)
        for task in self.background():
            io.spawn(task)
        # engine.kv_events: the subscriber's thread feeds this loop (docs/operate.md, "KV events").
        self.start_kv_events(call_soon_threadsafe)
        # routing.policy = "kv": large prompts are tokenized by a thread of their own (docs/routing.md).
        self.start_tokenizer(call_soon_threadsafe)
        # The driver's write_legs, without a call more: it runs after each flush that started a leg.
        self.write_legs = self.engines.write_unsent  # type: ignore[method-assign]
        self.driver.drain()
        self._after_drain()
        self.listener.start(self.clients.start)
        host, port = self.address  # type: ignore[misc]
        log_listening(self.config, host, port, self.runtime, loop)
        if self._shutdown_asked:
            self._shutdown_asked = False
            self.shutdown()

    async def end(self) -> None:
        """Serving ends, drained or cancelled. In order, each once:

        the threads that feed the loop and busy polling stop; the last
        drain's effects are performed; accepting stops; every task cancelled
        (each reports its cancellation: a leg still connecting, a control
        request); the engine connections close; the client connections get
        the exit flush (:meth:`~.client_connections.ClientConnections.aclose`); the
        journal, then the tracer, close.
        """
        self.stop_kv_events()
        self.stop_tokenizer()
        self._busy.stop()
        self._flush()
        if self.engines is not None:
            self.listener.close()
            self.engines.stopped = True  # no leg or control request starts while the tasks are cancelled
            await self.io.cancel_tasks()
            self.engines.close_all()
            await self.clients.aclose()
        await self.journal.aclose()
        await self.close_tracer()
        log_event("stopped", runtime=self.runtime)

    def _flush(self) -> None:
        """The adapter's: perform what the driver has pending."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Begin a graceful drain (docs/operate.md: new requests get 503 ``shutting_down``); again: cut it short.

        Asked for before serving began, it begins once it does (:meth:`begin`).
        """
        if self.engines is None:
            self._shutdown_asked = True
            return
        self._feed_now(ShutdownRequested())

    def _after_drain(self) -> None:
        """The adapter's reaction to a drain of the driver: re-arm the timer, end the drain, flush."""
        raise NotImplementedError

    def feed(self, event: Event) -> Any:
        """The adapter's feed of one event from a socket (synchronous; it opens the busy-poll window)."""
        raise NotImplementedError

    def _feed_and_poll(self, event: Event) -> Any:
        """:meth:`feed` while busy polling (``ingress.busy_poll_us``): each event opens the window."""
        if self._busy.event_fed(time.monotonic()):
            self._start_polling()
        return self._feed_unpolled(event)

    def _start_polling(self) -> None:
        """The adapter's poller: keep the loop runnable while :meth:`BusyPoll.keep_polling` says so."""
        raise NotImplementedError

    @property
    def busy_polls(self) -> int:
        """Loop iterations (trio: scheduler batches) spent busy polling, so far."""
        return self._busy.polls

    def reload_keys(self) -> None:
        """Re-read the API keys file (SIGHUP); a bad file keeps the old keys and logs why."""
        if self.engines is None:
            return  # not serving yet
        try:
            authenticator = load_authenticator(self.config)
        except ConfigError as exc:
            log_event("keys_reload_failed", error=exc.message)
            return
        self._feed_now(AuthenticatorChanged(authenticator))

    def _feed_now(self, event: Event) -> None:
        """The adapter's feed for events from no socket: at once, never waiting, opening no busy-poll window."""
        raise NotImplementedError

    def start_kv_events(self, call_soon_threadsafe: Callable[..., object]) -> None:
        """Start the KV-event subscriber's thread, which hands its events over with ``call_soon_threadsafe``.

        (trio: the trio token's ``run_sync_soon``; asyncio: ``loop.call_soon_threadsafe``.)
        """
        if self.kv_subscriber is not None:
            self.kv_subscriber.start(lambda events: call_soon_threadsafe(self._feed_kv, events))

    def stop_kv_events(self) -> None:
        """Stop the KV-event subscriber's thread (bounded: the close wakes its poll; see ``CLOSE_TIMEOUT_S``)."""
        if self.kv_subscriber is not None and not self.kv_subscriber.close():
            log_event("kv_events_stop_timeout", level="warning",
                      consequence="the thread is left to end with the process")

    def start_tokenizer(self, call_soon_threadsafe: Callable[..., object]) -> None:
        """Start the tokenizer thread, which hands each answer over with ``call_soon_threadsafe`` (as :meth:`start_kv_events`)."""
        if self.tokenize_worker is not None:
            self.tokenize_worker.start(lambda answer: call_soon_threadsafe(self._feed_now, answer))

    def stop_tokenizer(self) -> None:
        """Stop the tokenizer thread (after the drain: nothing waits for its answers any more)."""
        if self.tokenize_worker is not None and not self.tokenize_worker.close():
            log_event("tokenizer_stop_timeout", level="warning",
                      consequence="the thread is left to end with the process")

    def tokenize(self, cmd: TokenizePrompt) -> None:
        """The driver's effect for a :class:`TokenizePrompt`: to the thread (:mod:`.tokenize_worker`)."""
        if self.tokenize_worker is None:  # (the router asks only when its policy tokenizes: never here)
            self._feed_now(PromptTokenized(cmd.key, None, "no tokenizer thread"))
            return
        self.tokenize_worker.submit(cmd)

    def _kv_engines(self) -> list[EngineAddress]:
        """The engines whose KV events are read: those taking prefill legs.

        Only a prefill leg is placed by what an engine holds; decode legs
        (and ``single`` requests) go by load (docs/routing.md), so a decode
        engine's stream would cost a socket, its decoding and its hashing
        per request for nothing.
        """
        return [e.address for e in self.router.fleet.engines[PREFILL]]

    def _feed_kv(self, events: Sequence[Event]) -> None:
        """The events the subscriber's thread handed over, on the loop."""
        for event in events:
            self._feed_now(event)

    #: The driver's client write (:meth:`~.driver.Effects.send`): the connection is the driver's handle.
    send = staticmethod(ClientConnection.send)

    def _listen(self) -> list[socket.socket]:
        """Bind the listening sockets (:mod:`.listening`; a failure is a start-up error), set :attr:`address`."""
        i = self.config.ingress
        try:
            sockets = listening_sockets(i.listen_host, i.listen_port, reuse_port=i.workers not in (1, "auto"))
        except OSError as exc:
            raise listen_failure(i.listen, exc) from None
        host, port = sockets[0].getsockname()[:2]
        self.address = (host, port)
        return sockets

    # Effects (narwhal_runtime.driver.Effects) that are the same on both runtimes.

    def flush_failed(self, exc: Exception) -> None:
        """A batch's effect raised ``exc``: log it (``flush_error``); the server goes on."""
        log_event("flush_error", level="error", error=f"{type(exc).__name__}: {exc}")

    def write_journal(self, lines: list[bytes]) -> bool:
        ok = self.journal.writer.write_lines(lines)
        if self.tracer is not None:
            self.tracer.take(lines)
        return ok

    def journal_error(self) -> str | None:
        return self.journal.writer.error

    async def close_tracer(self) -> None:
        """Export the spans still pending and stop the tracer (at shutdown, after the last journal write)."""
        if self.tracer is not None:
            tracer, self.tracer = self.tracer, None
            await self._in_thread(tracer.shutdown)

    def log(self, event: str, fields: dict[str, Any]) -> None:
        log_event(event, **fields)
        if event in FLEET_CHANGES and self.kv_subscriber is not None:
            # An engine joined or was forgotten: subscribe to the fleet as it is now.
            self.kv_subscriber.set_engines(kv_sources(self.config, self._kv_engines()))

    def write_legs(self) -> None:
        # The driver calls this only after starting legs, so there are engines;
        # write_unsent finds out itself whether a request waits. (Replaced by
        # the engines' own write_unsent once serving: :meth:`begin`.)
        self.engines.write_unsent()  # type: ignore[union-attr]
