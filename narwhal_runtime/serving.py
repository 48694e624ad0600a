"""The half of each runtime's ``Server`` that does not depend on its event loop (:class:`Serving`).

Each adapter's ``Server`` holds one :class:`Serving`, built once in its
constructor, and is its :class:`Adapter`: the few things only the runtime
can do (feed an event and decide when its batch is performed, keep the loop
polling). :class:`Serving` builds the router and its driver, opens the
journal (:mod:`.journal_file`; a failure is a start-up error), builds the
driver's effects once (:class:`~.effects.ServingEffects`, what is the same
on both runtimes) and turns SIGHUP into the router's new authenticator. It
binds the listening sockets (:mod:`.listening`).

It also holds the start and the end of serving, the same on both runtimes:
what starts once the loop serves (:meth:`Serving.begin`: the client and
engine connections over the runtime's :class:`~.runtime_io.RuntimeIO`, the
listener, the tasks of :meth:`Serving.background`, the threads) and, in
order, what stops at the end (:meth:`Serving.end`); the busy-poll rule
(each event from a socket opens the window); and which events go through
:meth:`Adapter.feed_now`. What is left in each adapter is its ``IO``, the
driver's timer, when a batch is performed, and signals.
"""

from __future__ import annotations

import functools
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol

from narwhal_core import AuthenticatorChanged, Config, ConfigError, Event, Router, ShutdownRequested
from narwhal_core.engine_config import EngineAddress
from narwhal_core.ids import PREFILL

from .app import StartupError, build_router, journal_failure, listen_failure, load_authenticator, log_listening
from .client_connections import ClientConnections
from .discovery import make_discovery
from .driver import BusyPoll, Driver
from .effects import ServingEffects
from .group_metrics import current_group
from .journal_file import JournalFile
from .kv_subscriber import make_kv_subscriber
from .leg_connections import Engines
from .listening import Listener, listening_sockets
from .log import log_event
from .runtime_io import RuntimeIO
from .tokenize_worker import make_tokenize_worker

__all__ = ["Adapter", "Serving", "start_tracer"]


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


class Adapter(Protocol):
    """What :class:`Serving` asks of a runtime's server (``narwhal_trio``, ``narwhal_asyncio``)."""

    def feed(self, event: Event) -> None:
        """Feed one event from a socket, synchronously; the adapter performs its batch when it decides."""

    def feed_now(self, event: Event) -> None:
        """Feed an event from no socket (discovery, a thread, SIGHUP, the shutdown): at once, never waiting."""

    def after_drain(self) -> None:
        """React to a drain of the driver: re-arm the timer, end the drain, perform the batch."""

    def flush(self) -> None:
        """Perform what the driver has pending."""

    def start_polling(self) -> None:
        """Keep the loop runnable while :meth:`~.driver.BusyPoll.keep_polling` says so."""


class Serving:
    """Router, driver, journal, effects and the start and end of serving, for one runtime's :class:`Adapter`."""

    #: Set once serving (:meth:`begin`): the engine connections, the client connections, the listener.
    engines: Engines | None
    clients: ClientConnections
    listener: Listener
    #: What the runtime lends the connections (set by :meth:`begin`).
    io: RuntimeIO

    def __init__(self, config: Config, router: Router | None, adapter: Adapter, *, runtime: str, now: float,
                 sleep: Callable[[float], Awaitable[object]],
                 in_thread: Callable[[Callable[[], None]], Awaitable[object]],
                 lookup_in_thread: Callable[[Callable[[], Any]], Awaitable[Any]] | None = None) -> None:
        """``runtime`` names it in the ``listening`` and ``stopped`` lines; ``sleep`` and ``in_thread`` are its.

        ``in_thread`` runs a function in a worker thread; ``lookup_in_thread``
        runs a discovery lookup (by default ``in_thread``; trio's abandons a
        lookup still running at shutdown: :meth:`background`).
        """
        self.config = config
        self.adapter = adapter
        self.runtime = runtime
        self.router = router or build_router(config, now=now)
        self.driver = Driver(self.router)
        j = config.journal
        try:
            self.journal = JournalFile(j.path, j.fsync, j.fsync_interval_s, sleep=sleep, in_thread=in_thread)
        except OSError as exc:
            raise journal_failure(config.journal.path, exc) from None
        self._in_thread = in_thread
        self._sleep = sleep
        self._lookup_in_thread = lookup_in_thread or in_thread
        self.engines = None
        #: The address the server listens on, once started.
        self.address: tuple[str, int] | None = None
        self.busy = BusyPoll(config.ingress.busy_poll_us / 1e6)
        #: What the connections feed an event from a socket with: the adapter's feed, or, busy
        #: polling (``ingress.busy_poll_us``), :meth:`feed_and_poll`, which opens the window first.
        self.feed: Callable[[Event], None] = self.feed_and_poll if self.busy.seconds else adapter.feed
        #: ``engine.discovery`` dns or file: the lookups the adapter runs while serving (``None``: static engines).
        self.discovery = make_discovery(config)
        #: ``engine.kv_events``: the prefill engines' KV-event streams, read by a thread of its own that
        #: starts once serving (:meth:`begin`) and stops at exit (``None``: not configured).
        self.kv_subscriber = make_kv_subscriber(config, self._kv_engines())
        #: ``routing.policy = "kv"``: the thread that tokenizes large prompts off the loop, started once serving
        #: (:meth:`begin`) and stopped at exit (``None``: the policy tokenizes nothing).
        self.tokenize_worker = make_tokenize_worker(self.router)
        #: What the driver's batches are performed through (spans out of the terminal records too:
        #: [tracing] endpoint, docs/operate.md, "Tracing"); given the engine connections by :meth:`begin`.
        self.effects = ServingEffects(config, self.journal.writer, tracer=start_tracer(config),
                                      kv_subscriber=self.kv_subscriber, tokenize_worker=self.tokenize_worker,
                                      feed_now=adapter.feed_now)
        #: A worker of a group (``ingress.workers`` > 1) snapshots its metrics after each flush.
        group = current_group()
        if group is not None:
            self.driver.after_flush = group.tick
        #: :meth:`shutdown` was asked for before serving began (a signal while starting).
        self._shutdown_asked = False

    # ------------------------------------------------- the start and the end

    def background(self) -> list[Callable[[], Coroutine[Any, Any, None]]]:
        """The tasks to run while serving, until cancelled at the end: the journal's fsync timer, discovery.

        Discovery feeds through the adapter's ``feed_now``, as every source
        that is not a socket does (the KV-event subscriber, the tokenizer
        thread, SIGHUP, :meth:`shutdown`): it never waits behind a slow
        client, and opens no busy-poll window. (A lookup in its thread is
        abandoned at shutdown on trio: the resolver's own timeout ends it.)
        """
        tasks: list[Callable[[], Coroutine[Any, Any, None]]] = []
        if self.config.journal.fsync == "interval":
            tasks.append(self.journal.run_sync_timer)
        if self.discovery is not None:
            tasks.append(functools.partial(self.discovery.run, self.adapter.feed_now, self._sleep,
                                           self._lookup_in_thread))
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
        self.effects.engines = self.engines = Engines(io, self.feed, self.config.engine.pool_connections_per_engine)
        self.listener = Listener(sockets, limit=ingress.max_connections, io=io)
        self.clients = ClientConnections(io, self.feed, self.driver.closing,
                                         send_timeout_s=ingress.send_timeout_s, release=self.listener.release)
        for task in self.background():
            io.spawn(task)
        # engine.kv_events: the subscriber's thread feeds this loop (docs/operate.md, "KV events").
        if self.kv_subscriber is not None:
            self.kv_subscriber.start(lambda events: call_soon_threadsafe(self._feed_kv, events))
        # routing.policy = "kv": large prompts are tokenized by a thread of their own (docs/routing.md).
        if self.tokenize_worker is not None:
            self.tokenize_worker.start(lambda answer: call_soon_threadsafe(self.adapter.feed_now, answer))
        self.driver.drain()
        self.adapter.after_drain()
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
        journal, then the span exporter, close.
        """
        self._stop_threads()
        self.busy.stop()
        self.adapter.flush()
        if self.engines is not None:
            self.listener.close()
            self.engines.stopped = True  # no leg or control request starts while the tasks are cancelled
            await self.io.cancel_tasks()
            self.engines.close_all()
            await self.clients.aclose()
        await self.journal.aclose()
        tracer, self.effects.tracer = self.effects.tracer, None
        if tracer is not None:  # the spans still pending are exported, after the last journal write
            await self._in_thread(tracer.shutdown)
        log_event("stopped", runtime=self.runtime)

    def _stop_threads(self) -> None:
        """Stop the KV-event subscriber's and the tokenizer's threads (bounded: each close wakes its thread)."""
        if self.kv_subscriber is not None and not self.kv_subscriber.close():
            log_event("kv_events_stop_timeout", level="warning",
                      consequence="the thread is left to end with the process")
        # (After the drain: nothing waits for the tokenizer's answers any more.)
        if self.tokenize_worker is not None and not self.tokenize_worker.close():
            log_event("tokenizer_stop_timeout", level="warning",
                      consequence="the thread is left to end with the process")

    def shutdown(self) -> None:
        """Begin a graceful drain (docs/operate.md: new requests get 503 ``shutting_down``); again: cut it short.

        Asked for before serving began, it begins once it does (:meth:`begin`).
        """
        if self.engines is None:
            self._shutdown_asked = True
            return
        self.adapter.feed_now(ShutdownRequested())

    def feed_and_poll(self, event: Event) -> None:
        """The adapter's feed while busy polling (``ingress.busy_poll_us``): each event opens the window."""
        if self.busy.event_fed(time.monotonic()):
            self.adapter.start_polling()
        self.adapter.feed(event)

    @property
    def busy_polls(self) -> int:
        """Loop iterations (trio: scheduler batches) spent busy polling, so far."""
        return self.busy.polls

    def reload_keys(self) -> None:
        """Re-read the API keys file (SIGHUP); a bad file keeps the old keys and logs why."""
        if self.engines is None:
            return  # not serving yet
        try:
            authenticator = load_authenticator(self.config)
        except ConfigError as exc:
            log_event("keys_reload_failed", error=exc.message)
            return
        self.adapter.feed_now(AuthenticatorChanged(authenticator))

    def _kv_engines(self) -> list[EngineAddress]:
        """The engines whose KV events are read at start: those taking prefill legs.

        Only a prefill leg is placed by what an engine holds; decode legs
        (and ``single`` requests) go by load (docs/routing.md), so a decode
        engine's stream would cost a socket, its decoding and its hashing
        per request for nothing. The fleet's changes follow
        (:meth:`~.effects.ServingEffects.fleet_changed`).
        """
        return [e.address for e in self.router.fleet.engines[PREFILL]]

    def _feed_kv(self, events: Sequence[Event]) -> None:
        """The events the subscriber's thread handed over, on the loop."""
        feed_now = self.adapter.feed_now
        for event in events:
            feed_now(event)

    def listen(self) -> list[socket.socket]:
        """Bind the listening sockets (:mod:`.listening`; a failure is a start-up error), set :attr:`address`."""
        i = self.config.ingress
        try:
            sockets = listening_sockets(i.listen_host, i.listen_port, reuse_port=i.workers not in (1, "auto"))
        except OSError as exc:
            raise listen_failure(i.listen, exc) from None
        host, port = sockets[0].getsockname()[:2]
        self.address = (host, port)
        return sockets
