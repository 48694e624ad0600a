"""The engines' KV-event streams: subscribed on one thread, decoded and ordered, handed to the event loop.

(docs/operate.md, "KV events"; docs/configure.md, ``engine.kv_events``.)
vLLM publishes each engine's KV-cache events on a ZMQ PUB socket (vLLM binds
``tcp://*:5557``; the router connects), one message of three frames per
batch, and, when its ``replay_endpoint`` is set, answers replay requests on
a ROUTER socket (``vllm/distributed/kv_events.py``, vLLM commits
``b4e69e0af33f`` and ``0181ea3173e5``: ``ZmqEventPublisher._publisher_thread``
for the frames, ``ZmqEventPublisher._service_replay`` for replay). The
replay socket takes ``[identity, b"", start_seq]`` (8 bytes, big-endian) and
answers every buffered batch from ``start_seq`` on as ``[identity, b"", seq,
payload]``, then ``seq = -1`` with an empty payload: several answers to one
request, which a REQ socket cannot take (it accepts exactly one reply), so
the subscriber asks from a DEALER, with the empty delimiter frame a REQ
would add. The decoding and the order (which batch is next, when to ask
for a replay) are the core's :class:`~narwhal_core.kv_events.KvStream`;
only the sockets live here.

**One thread.** pyzmq sockets are not thread-safe, and their file
descriptors are edge-triggered signals that must be re-checked
(``zmq.EVENTS``) after every send and receive: driving them from the event
loop would take a different, delicate integration per runtime (zmq.asyncio
on asyncio, a hand-written ``wait_readable`` loop on trio). Instead one
thread (``narwhal-kv-events``) owns every socket of every engine and waits
on a ``zmq.Poller``: for as long as it takes while no replay is in flight,
for at most :data:`POLL_S` while one is (to fail it on time); it hands what it
decoded to the loop through the adapter's thread-safe ``feed`` (trio: the
trio token's ``run_sync_soon``; asyncio: ``loop.call_soon_threadsafe``),
once per wake-up, so both runtimes run the same code. The loop side only
queues commands (:meth:`KvSubscriber.set_engines`, :meth:`KvSubscriber.close`)
and wakes the thread with a byte on a socket pair the poller watches, so
an idle thread costs nothing.

What the router hears (:mod:`narwhal_core.events`):

* :class:`~narwhal_core.KvEventsReceived` for every batch that applies in
  order;
* :class:`~narwhal_core.KvStreamChanged` ``(live=True, "connected")`` when the
  SUB socket connects (a ZMQ socket monitor says so), ``(False,
  "disconnected")`` when the connection drops (ZMQ reconnects by itself;
  after a reconnect the stream asks for what it missed), ``(False,
  "replay_failed")`` when a gap could not be filled (the replay socket did
  not answer within :data:`REPLAY_TIMEOUT_S`: what the missed batches said
  is lost), then ``(True, "resumed")`` as soon as batches apply again.

Without a replay endpoint a gap is only logged (``kv_events_gap``): the
operator chose none, as vLLM's default does, and the stream goes on.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import attrs
import zmq
from zmq.utils.monitor import recv_monitor_message

from narwhal_core import Config, EngineAddress, Event, KvEventsReceived, KvStreamChanged
from narwhal_core.config import kv_endpoint, kv_endpoint_problem
from narwhal_core.engine_config import kv_rank_endpoint
from narwhal_core.kv_events import REPLAY_END, RESTARTED, KvEventError, KvStream, StreamStep, decode_seq

from .log import log_event

__all__ = [
    "KvSource", "KvSubscriber", "KvCounters", "kv_sources", "make_kv_subscriber",
    "POLL_S", "REPLAY_TIMEOUT_S", "CLOSE_TIMEOUT_S",
]

#: Longest the thread waits on its sockets while a replay is in flight (its deadline is checked after each wait).
POLL_S: Final = 0.05
#: Longest a replay may stay silent (before its first answer, or between two) before it counts as failed.
REPLAY_TIMEOUT_S: Final = 2.0
#: Longest :meth:`KvSubscriber.close` waits for the thread.
CLOSE_TIMEOUT_S: Final = 2.0
#: Most messages read from one socket per wake-up (the others get their turn).
READ_BURST: Final = 256
#: The SUB socket's queue (vLLM's PUB default high-water mark): a slow loop loses no batch before it.
RCVHWM: Final = 100_000
#: Longest pause between two reconnection attempts to an engine that went away (ZMQ backs off up to it).
RECONNECT_MAX_MS: Final = 2_000

#: The monitor events that say an engine's PUB socket reached the SUB socket (connected, or accepted when bound).
_UP: Final = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED

#: The adapter's thread-safe hand-over: called on the subscriber's thread with the events of one wake-up.
Feed = Callable[[Sequence[Event]], object]


@attrs.frozen
class KvSource:
    """One engine's KV-event endpoints."""

    #: The engine's URL (``EngineAddress.url``), as the router names it.
    url: str
    #: Its PUB socket, ``tcp://HOST:PORT``.
    endpoint: str
    #: Its replay ROUTER socket (``None``: no replay).
    replay: str | None = None
    #: Its data-parallel rank: the endpoints are the configured ones' ports + the rank (``engine.data_parallel_size``).
    rank: int = 0
    #: Narwhal binds ``endpoint`` and the engine connects (``engine.kv_events_socket = "bind"``).
    bind: bool = False


def kv_sources(config: Config, addresses: Iterable[EngineAddress]) -> tuple[KvSource, ...]:
    """The endpoints ``engine.kv_events`` and ``engine.kv_events_replay`` give each engine (once per URL and rank).

    Rank *r* of ``engine.data_parallel_size`` is on both ports + *r*
    (vLLM's ``ZmqEventPublisher.offset_endpoint_port``,
    ``vllm/distributed/kv_events.py``). An engine added at run time whose
    filled-in template is not ``tcp://HOST:PORT`` for every rank (the
    configured ones were checked at load) is left out, with a
    ``kv_events_endpoint_invalid`` log line.
    """
    engine = config.engine
    events, replay = engine.kv_events, engine.kv_events_replay
    if events is None:
        return ()
    sources: dict[tuple[str, int], KvSource] = {}
    for address in addresses:
        if (address.url, 0) in sources:
            continue  # a mixed engine: one stream
        ranks = [
            KvSource(address.url, kv_rank_endpoint(kv_endpoint(events, address), rank),
                     None if replay is None else kv_rank_endpoint(kv_endpoint(replay, address), rank),
                     rank, engine.kv_events_socket == "bind")
            for rank in range(engine.data_parallel_size)
        ]  # fmt: skip
        problem = next(filter(None, (
            kv_endpoint_problem(endpoint) for s in ranks for endpoint in (s.endpoint, s.replay) if endpoint
        )), None)  # fmt: skip
        if problem is not None:
            log_event("kv_events_endpoint_invalid", level="warning", engine=address.url, problem=problem)
            continue
        sources.update(((s.url, s.rank), s) for s in ranks)
    return tuple(sources.values())


def make_kv_subscriber(config: Config, addresses: Iterable[EngineAddress]) -> KvSubscriber | None:
    """The subscriber ``engine.kv_events`` asks for, for ``addresses`` (``None``: not configured)."""
    if config.engine.kv_events is None:
        return None
    return KvSubscriber(kv_sources(config, addresses))


@attrs.define
class KvCounters:
    """What the thread did so far, for tests and debugging (written by the thread only)."""

    #: Live messages received.
    messages: int = 0
    #: Replays asked for.
    replays: int = 0
    #: Replays that failed (timeout, a bad answer, the request not sent).
    replays_failed: int = 0
    #: Gaps left open because the engine has no replay endpoint.
    gaps: int = 0
    #: Frames or payloads that could not be read.
    malformed: int = 0
    #: Times the thread's poll returned (a message, a command, a replay deadline to check).
    wakeups: int = 0


class _Sockets:
    """The thread's ZMQ context, poller, and which engine owns each socket."""

    def __init__(self) -> None:
        self.ctx: Any = zmq.Context()
        self.poller = zmq.Poller()
        self.owner: dict[Any, _Engine] = {}
        #: Each engine URL's streams, by data-parallel rank, and whether the router was last told they are live.
        self.ranks: dict[str, dict[int, _Engine]] = {}
        self.told: dict[str, bool] = {}

    def open(self, kind: int, endpoint: str) -> Any:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        if endpoint.startswith("tcp://["):
            sock.setsockopt(zmq.IPV6, 1)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.RCVHWM, RCVHWM)
            sock.setsockopt(zmq.SUBSCRIBE, b"")  # every topic: vLLM's default topic is empty
        return sock

    def watch(self, sock: Any, engine: _Engine) -> None:
        self.poller.register(sock, zmq.POLLIN)
        self.owner[sock] = engine

    def close(self, sock: Any) -> None:
        if sock in self.owner:
            self.poller.unregister(sock)
            del self.owner[sock]
        sock.close(linger=0)


def _is_monitor(sockets: _Sockets, sock: Any) -> bool:
    engine = sockets.owner.get(sock)
    return engine is not None and engine.monitor is sock


class _Engine:
    """One engine's sockets and stream order, on the subscriber's thread.

    ``live``: what the router was last told (:class:`KvStreamChanged`).
    ``warned``: the kinds of warning already logged since the last connect
    (each is logged once per connection, then only counted).
    """

    def __init__(self, source: KvSource, sockets: _Sockets, counters: KvCounters, replay_timeout: float,
                 clock: Callable[[], float]) -> None:  # fmt: skip
        self.source = source
        self.url = source.url
        self.sockets = sockets
        self.counters = counters
        self.replay_timeout = replay_timeout
        self.clock = clock
        self.stream = KvStream()
        self.connected = False
        self.ever_connected = False
        self.live = False
        #: When the replay in flight counts as failed (``None``: none in flight).
        self.deadline: float | None = None
        self.warned: set[str] = set()
        self.sub: Any = None
        self.monitor: Any = None
        self.replay: Any = None
        try:
            self.sub = sockets.open(zmq.SUB, source.endpoint)
            # The monitor first, so that it sees the first connection too. Bound, an engine's connection
            # is ACCEPTED, and attached (its subscription sent) when the thread next polls the socket.
            self.monitor = self.sub.get_monitor_socket(_UP | zmq.EVENT_DISCONNECTED)
            sockets.watch(self.monitor, self)
            (self.sub.bind if source.bind else self.sub.connect)(source.endpoint)
            sockets.watch(self.sub, self)
            self._open_replay()
        except zmq.ZMQError:
            self.close()
            raise
        sockets.ranks.setdefault(self.url, {})[source.rank] = self
        log_event("kv_events_subscribed", engine=self.url, endpoint=source.endpoint, replay=source.replay,
                  rank=source.rank, socket="bind" if source.bind else "connect")  # fmt: skip

    def _open_replay(self) -> None:
        if self.source.replay is not None:
            self.replay = self.sockets.open(zmq.DEALER, self.source.replay)
            self.replay.connect(self.source.replay)
            self.sockets.watch(self.replay, self)

    def _reset_replay(self) -> None:
        """Drop the replay in flight: a new socket, so its late answers cannot mix with the next replay's."""
        self.deadline = None
        if self.replay is not None:
            self.sockets.close(self.replay)
            self._open_replay()

    def close(self) -> None:
        sockets = self.sockets
        ranks = sockets.ranks.get(self.url, {})
        if ranks.get(self.source.rank) is self:
            del ranks[self.source.rank]
            if not ranks:
                sockets.ranks.pop(self.url, None)
                sockets.told.pop(self.url, None)
        if self.monitor is not None:
            try:
                self.sub.disable_monitor()
            except zmq.ZMQError:
                pass
        for sock in (self.monitor, self.sub, self.replay):
            if sock is not None:
                sockets.close(sock)

    # ------------------------------------------------------------ readable

    def readable(self, sock: Any, out: list[Event]) -> None:
        """Read what ``sock`` (one of this engine's) holds, up to :data:`READ_BURST` messages."""
        for _ in range(READ_BURST):
            try:
                if sock is self.monitor:
                    self._monitor_event(recv_monitor_message(sock, flags=zmq.NOBLOCK), out)
                    continue
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock is self.sub:
                self._live(frames, out)
            else:
                self._replayed(frames, out)
                if sock is not self.replay:
                    return  # the replay failed on this answer: its socket was replaced

    def _monitor_event(self, message: dict[str, Any], out: list[Event]) -> None:
        event = message["event"]
        if event & _UP and not self.connected:
            self.connected = True
            if self.ever_connected:
                # What was published while away is a gap: the next message asks for it.
                self.stream.restart()
                if self.deadline is not None:
                    self._reset_replay()
            self.ever_connected = True
            self.warned.clear()
            self._tell(True, "connected", out)
            log_event("kv_events_connected", engine=self.url, endpoint=self.source.endpoint)
        elif event == zmq.EVENT_DISCONNECTED and self.connected:
            self.connected = False
            self._tell(False, "disconnected", out)
            log_event("kv_events_disconnected", level="warning", engine=self.url, endpoint=self.source.endpoint,
                      consequence="reconnecting; routing falls back while the stream is down")

    def _live(self, frames: list[bytes], out: list[Event]) -> None:
        self.counters.messages += 1
        try:
            seq, payload = KvStream.decode(frames)
        except KvEventError as exc:
            # Without a sequence number the message cannot be placed: the next one shows the gap.
            self._malformed(str(exc))
            return
        self._take(self.stream.message(seq, payload), out)

    def _replayed(self, frames: list[bytes], out: list[Event]) -> None:
        if self.deadline is None:
            return  # (an answer after the replay ended: nothing is waiting for it)
        try:
            if len(frames) != 3 or frames[0]:
                raise KvEventError(f"a replay answer is [b'', seq, payload], not {len(frames)} frames")
            seq = decode_seq(frames[1])
        except KvEventError as exc:
            self._malformed(str(exc))
            self._replay_failed("a malformed answer", out)
            return
        self.deadline = None if seq == REPLAY_END else self.clock() + self.replay_timeout
        self._take(self.stream.replayed(seq, frames[2]), out)

    # ------------------------------------------------------------ the order

    def _take(self, step: StreamStep, out: list[Event]) -> None:
        """Act on what :class:`KvStream` said: log its problem, pass its events on, ask for its replay."""
        if step.problem == RESTARTED:
            log_event("kv_events_restarted", engine=self.url,
                      consequence="the engine's cache is new: what it held before is forgotten")
        elif step.problem is not None:
            self._malformed(step.problem)
        if step.events:
            if self.connected and not self.live:
                self._tell(True, "resumed", out)
            out.append(KvEventsReceived(self.url, step.events))
        if step.replay_from is not None:
            self._ask_replay(step.replay_from, out)

    def _ask_replay(self, start: int, out: list[Event]) -> None:
        self.counters.replays += 1
        if self.replay is None:
            self.counters.gaps += 1
            self._warn("kv_events_gap", from_seq=start,
                       consequence="no engine.kv_events_replay: the batches missed are lost")
            self._skip_gap(out)
            return
        try:
            self.replay.send_multipart((b"", start.to_bytes(8, "big")), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._replay_failed(f"not sent: {exc}", out)
            return
        self.deadline = self.clock() + self.replay_timeout

    def expire(self, now: float, out: list[Event]) -> None:
        """The replay in flight stayed silent too long: fail it."""
        if self.deadline is not None and now >= self.deadline:
            self._replay_failed(f"no answer within {self.replay_timeout} s", out)

    def _replay_failed(self, why: str, out: list[Event]) -> None:
        self.counters.replays_failed += 1
        self._reset_replay()
        if self.live:
            self._tell(False, "replay_failed", out)
        self._warn("kv_replay_failed", why=why, replay=self.source.replay,
                   consequence="the batches missed are lost; the stream goes on from the next one")
        self._skip_gap(out)

    def _skip_gap(self, out: list[Event]) -> None:
        """No replay will come: go on from what is held, over the hole."""
        self.stream.replay_failed()
        # The end of the replay that will not come applies the batches held back meanwhile.
        self._take(self.stream.replayed(REPLAY_END, b""), out)

    # ------------------------------------------------------------- telling

    def _tell(self, live: bool, reason: str, out: list[Event]) -> None:
        """Tell the router the engine's stream is up or down: with several ranks, up while every rank heard is."""
        self.live = live
        ranks = self.sockets.ranks.get(self.url, {})
        if len(ranks) > 1:
            heard = [e for e in ranks.values() if e.ever_connected]
            live = bool(heard) and all(e.live for e in heard)
            if self.sockets.told.get(self.url) == live:
                return
            self.sockets.told[self.url] = live
        out.append(KvStreamChanged(self.url, live, reason))

    def _malformed(self, problem: str) -> None:
        self.counters.malformed += 1
        self._warn("kv_events_malformed", problem=problem[:200],
                   consequence="the batch is asked for again from the replay socket, or lost without one")

    def _warn(self, event: str, **fields: Any) -> None:
        if event not in self.warned:
            self.warned.add(event)
            log_event(event, level="warning", engine=self.url, **fields)


class KvSubscriber:
    """Every engine's KV-event stream, read by one thread (see the module docstring for why one)."""

    def __init__(self, sources: Iterable[KvSource] = (), *, replay_timeout: float = REPLAY_TIMEOUT_S,
                 poll_s: float = POLL_S, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self._sources = tuple(sources)
        self._replay_timeout = replay_timeout
        self._poll_ms = max(1, round(poll_s * 1000))
        self._clock = clock
        #: Commands for the thread: a new set of engines, or ``None`` to stop.
        self._commands: queue.SimpleQueue[tuple[KvSource, ...] | None] = queue.SimpleQueue()
        #: A byte written to ``_wake_out`` wakes the thread's poll to read the commands (``_wake_in``).
        self._wake_in, self._wake_out = socket.socketpair()
        self._wake_in.setblocking(False)
        self._wake_out.setblocking(False)
        self._thread: threading.Thread | None = None
        self.counters = KvCounters()
        #: The URLs the thread subscribes to now (replaced, never mutated, by the thread).
        self.subscribed: frozenset[str] = frozenset()

    @property
    def alive(self) -> bool:
        """Whether the thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, feed: Feed) -> None:
        """Start the thread; ``feed`` must be safe to call from it (it hands events to the loop)."""
        if self._thread is not None:
            raise RuntimeError("the KV-event subscriber was started already")
        self._thread = threading.Thread(target=self._run, args=(feed,), name="narwhal-kv-events", daemon=True)
        self._thread.start()

    def set_engines(self, sources: Iterable[KvSource]) -> None:
        """Subscribe to exactly these engines from now on (from any thread; the thread applies it)."""
        sources = tuple(sources)
        if self._thread is None:
            self._sources = sources
        else:
            self._command(sources)

    def _command(self, command: tuple[KvSource, ...] | None) -> None:
        self._commands.put(command)
        try:
            self._wake_out.send(b"\0")
        except OSError:
            pass  # (a full pair: the thread has wake-ups pending already)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> bool:
        """Stop the thread and close its sockets; whether it ended within ``timeout`` seconds."""
        thread = self._thread
        if thread is None:
            self._close_wake()
            return True
        self._command(None)
        thread.join(timeout)
        if thread.is_alive():
            return False
        self._close_wake()
        return True

    def _close_wake(self) -> None:
        self._wake_in.close()
        self._wake_out.close()

    # ---------------------------------------------------------- the thread

    def _run(self, feed: Feed) -> None:
        sockets = _Sockets()
        engines: dict[tuple[str, int], _Engine] = {}
        sockets.poller.register(self._wake_in, zmq.POLLIN)
        try:
            self._apply(self._sources, engines, sockets)
            while True:
                stop, wanted = self._take_commands()
                if stop:
                    break
                if wanted is not None:
                    self._apply(wanted, engines, sockets)
                out: list[Event] = []
                replaying = any(engine.deadline is not None for engine in engines.values())
                ready = dict(sockets.poller.poll(self._poll_ms if replaying else None))
                self.counters.wakeups += 1
                if ready.pop(self._wake_in, None):
                    self._drain_wake()
                # Connection changes first: a reconnect's restart comes before the new connection's messages.
                for sock in sorted(ready, key=lambda s: not _is_monitor(sockets, s)):
                    engine = sockets.owner.get(sock)
                    if engine is not None:  # (None: a replay socket replaced during this wake-up)
                        engine.readable(sock, out)
                now = self._clock()
                for engine in engines.values():
                    engine.expire(now, out)
                if out:
                    feed(tuple(out))
        except Exception as exc:  # noqa: BLE001 - logged; the router goes on without KV events
            log_event("kv_events_stopped", level="error", error=f"{type(exc).__name__}: {exc}",
                      consequence="no more KV events: routing falls back to the approximate index")
        finally:
            for engine in engines.values():
                engine.close()
            self.subscribed = frozenset()
            sockets.ctx.destroy(linger=0)

    def _drain_wake(self) -> None:
        try:
            while self._wake_in.recv(4096):
                pass
        except OSError:
            pass  # (BlockingIOError: drained)

    def _take_commands(self) -> tuple[bool, tuple[KvSource, ...] | None]:
        """Whether to stop, and the latest set of engines asked for (``None``: no change)."""
        latest: tuple[KvSource, ...] | None = None
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return False, latest
            if command is None:
                return True, latest
            latest = command

    def _apply(self, sources: tuple[KvSource, ...], engines: dict[tuple[str, int], _Engine],
               sockets: _Sockets) -> None:  # fmt: skip
        wanted = {(s.url, s.rank): s for s in sources}
        for key, engine in list(engines.items()):
            if wanted.get(key) != engine.source:
                engine.close()
                del engines[key]
                log_event("kv_events_unsubscribed", engine=key[0], rank=key[1])
        for key, source in wanted.items():
            if key not in engines:
                try:
                    engines[key] = _Engine(source, sockets, self.counters, self._replay_timeout, self._clock)
                except zmq.ZMQError as exc:  # (an endpoint ZMQ refuses, a port bound already: the others go on)
                    log_event("kv_events_endpoint_invalid", level="warning", engine=key[0], problem=str(exc),
                              endpoint=source.endpoint)  # fmt: skip
        self.subscribed = frozenset(url for url, _ in engines)
