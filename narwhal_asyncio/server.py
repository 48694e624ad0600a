"""Narwhal on asyncio: protocols, the timer and signals around the core router.

The adapter pumps, synchronously: a transport's ``data_received`` feeds the
router, the commands are drained and acted on at once, and the one
``call_at`` timer is re-armed if the router's deadline moved earlier. What a
drain has to write is gathered instead — journal lines, leg requests for
pooled engine connections, bytes for each client — and written by one
``call_soon`` callback per event-loop iteration, before the loop waits for
I/O again: first every journal line of the iteration in one ``write(2)``,
then the legs, then each client's bytes in one ``transport.write``. So a
journal record reaches the file before the answer or leg it describes
leaves the process, and a busy loop writes the journal once per iteration,
not twice per request. With ``ingress.busy_poll_us``, each event also keeps
the loop polling (a ``call_soon`` callback that re-queues itself) until that
long after it, instead of sleeping. No task runs per request: tasks only
open new engine connections and run control requests. Backpressure: when a
client's transport stops taking bytes (``pause_writing``), the server stops
reading from that client and from every engine leg relaying to it, until
``resume_writing``. uvloop runs the loop when it is installed.
"""

from __future__ import annotations

import asyncio
import errno
import math
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from narwhal.app import (
    HIGH_WATER,
    LINGER_BYTES,
    LINGER_S,
    STOPPED_BY_SIGNAL,
    build_router,
    contain,
    journal_failure,
    listen_failure,
    load_authenticator,
    log_listening,
    settle_gc,
    startup_failure,
)
from narwhal.log import log_event
from narwhal_core import (
    AuthenticatorChanged,
    ConfigError,
    CancelLeg,
    ClientConnected,
    ClientData,
    ClientGone,
    ClientStalled,
    CloseClient,
    Config,
    Event,
    FinishLeg,
    JournalHealth,
    Log,
    Router,
    ShutdownComplete,
    ShutdownRequested,
    StartControl,
    StartLeg,
    Transmit,
    WriteJournal,
)

from .engines import Engines
from .journal_file import JournalFile

__all__ = ["Server", "run", "run_demo", "new_event_loop", "RUNTIME"]

RUNTIME = "asyncio"
#: Listen backlog (the kernel caps it at ``somaxconn``), as trio asks for.
BACKLOG = 0xFFFF
#: Connections accepted per readiness of the listening socket, at most.
ACCEPT_BATCH = 128
#: After an accept failed for want of descriptors or memory: seconds before
#: the next try (as on trio).
ACCEPT_RETRY_S = 0.1
_ACCEPT_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
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


class _Client(asyncio.Protocol):
    """One client connection; it is its own handle in the router's events and commands."""

    __slots__ = (
        "server", "transport", "out", "closed", "close_after", "lost", "write_paused", "relays", "waiting", "stall",
        "linger", "discarded",
    )

    def __init__(self, server: Server) -> None:
        self.server = server
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        #: Bytes transmitted during the current loop iteration, written at its end.
        self.out: list[bytes] = []
        #: The router no longer knows this connection (it closed it, or heard it is gone).
        self.closed = False
        #: The router closed it: close the transport once ``out`` is written.
        self.close_after = False
        self.lost = False
        self.write_paused = False
        #: Engine leg connections relaying to this client (paused with it).
        self.relays: set[Any] = set()
        #: Bytes read while waiting for a connection slot (``None`` once admitted).
        self.waiting: list[bytes] | None = None
        #: Fires when the client has left our bytes unread for ``send_timeout_s``.
        self.stall: asyncio.TimerHandle | None = None
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
            if self.discarded > LINGER_BYTES:
                self.transport.close()
            return
        if self.waiting is None:
            self.server.feed(ClientData(self, data))
        else:
            self.waiting.append(data)
            self.transport.pause_reading()

    def eof_received(self) -> bool:
        if self.waiting is not None:
            self.waiting.append(b"")
            return True
        self.server._client_eof(self)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.linger is not None:
            self.linger.cancel()
        self.server._client_lost(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.transport.pause_reading()  # no next request either, until this one is read
        for leg in self.relays:
            leg.pause()
        self._tell_stalled(True)
        if self.stall is None:
            # A client that never reads must not hold its connection (or its legs) forever.
            self.stall = asyncio.get_running_loop().call_later(
                self.server.config.ingress.send_timeout_s, _abort_unless_lost, self
            )

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None
        if not self.closed:
            self.transport.resume_reading()
        for leg in self.relays:
            leg.resume()
        self._tell_stalled(False)

    def _tell_stalled(self, stalled: bool) -> None:
        # The legs relaying to this client wait for it (and those started
        # meanwhile start paused, see Engines._attach): their engines'
        # silence is not their fault. (Fed from the loop, not from inside
        # the transport write that called us.)
        if not self.closed:
            asyncio.get_running_loop().call_soon(self.server.feed, ClientStalled(self, stalled))


class _Listener:
    """Listening sockets accepted by hand, not by ``loop.create_server``.

    CPython 3.11's own accept loop answers ``EMFILE`` by logging a traceback
    and scheduling a retry for each of its ``backlog`` iterations per
    wake-up: with a large backlog, a router out of file descriptors spends
    all its time there and stops serving the connections it has. Here a
    shortage logs one line, stops watching the sockets for
    :data:`ACCEPT_RETRY_S` and goes on serving (uvloop gets the same code).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: list[socket.socket],
                 factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop = loop
        self.sockets = sockets
        self._factory = factory
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop, host: str, port: int,
             factory: Callable[[], asyncio.Protocol]) -> _Listener:
        """Bind and listen on every address ``host`` resolves to."""
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                if port == 0:  # every address on the one port the first got
                    port = sock.getsockname()[1]
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        listener = cls(loop, sockets, factory)
        listener._watch()
        return listener

    def _watch(self) -> None:
        self._retry = None
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                log_event("accept_failed", error=str(exc))
                if exc.errno in _ACCEPT_SHORTAGE and self._retry is None:
                    for listening in self.sockets:
                        self._loop.remove_reader(listening.fileno())
                    self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._watch)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._start(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:
            conn.close()

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for sock in self.sockets:
            if sock.fileno() != -1:
                self._loop.remove_reader(sock.fileno())
                sock.close()


class Server:
    """One router serving on asyncio. Run :meth:`serve` on the running loop."""

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        self.config = config
        self.router = router or build_router(config, now=clock())
        try:
            self.journal = JournalFile(config.journal.path, config.journal.fsync, config.journal.fsync_interval_s)
        except OSError as exc:
            raise journal_failure(config.journal.path, exc) from None
        self._journal_ok = True
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: set[_Client] = set()
        #: Connections Narwhal closed, dropping what their clients still send (:data:`LINGER_S`).
        self._lingering: set[_Client] = set()
        #: Clients with bytes (or a close) waiting for the end of the loop iteration.
        self._dirty: list[_Client] = []
        #: Journal lines waiting for the end of the loop iteration.
        self._journal_lines: list[bytes] = []
        self._flush_scheduled = False
        self._waiting: deque[_Client] = deque()
        self._max_clients = config.ingress.max_connections
        self._armed = math.inf
        self._timer: asyncio.TimerHandle | None = None
        self._drained: asyncio.Future[None] | None = None
        self._listener: _Listener | None = None
        self._stopping = False
        self.engines: Engines | None = None
        #: The address the server listens on, once started.
        self.address: tuple[str, int] | None = None
        #: ``ingress.busy_poll_us`` in seconds: after each event, the loop
        #: polls (a callback re-queued per iteration) instead of sleeping
        #: until this long after the last one (0: it never polls).
        self._busy_poll = config.ingress.busy_poll_us / 1e6
        self._poll_until = 0.0
        self._polling = False
        #: Loop iterations spent busy polling, so far.
        self.busy_polls = 0
        if self._busy_poll:
            # Only then does a fed event cost anything more.
            self.feed = self._feed_and_poll  # type: ignore[method-assign]

    # ------------------------------------------------------------------ run

    async def serve(self, *, started: Callable[[tuple[str, int]], object] | None = None) -> None:
        """Listen, serve until a shutdown drains, then close the journal.

        ``started`` receives the bound ``(host, port)``.
        """
        loop = self._loop = asyncio.get_running_loop()
        self._drained = loop.create_future()
        i = self.config.ingress
        try:
            listener = _Listener.open(loop, i.listen_host, i.listen_port, lambda: _Client(self))
        except OSError as exc:
            raise listen_failure(i.listen, exc) from None
        host, port = listener.sockets[0].getsockname()[:2]
        self.address = (host, port)
        sync_task: asyncio.Task[None] | None = None
        try:
            self._listener = listener
            self.engines = Engines(loop, self.feed, pool_size=self.config.engine.pool_connections_per_engine)
            if self.config.journal.fsync == "interval":
                sync_task = loop.create_task(self.journal.run_sync_timer())
            self._drain()
            log_listening(self.config, host, port, RUNTIME, loop_name(loop))
            if started is not None:
                started((host, port))
            if self._stopping:  # a signal came while starting
                self._stopping = False
                self.shutdown()
            await self._drained
        finally:
            self._busy_poll = 0.0
            self._poll_until = 0.0
            self._flush()
            self._stop_listening()
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if sync_task is not None:
                sync_task.cancel()
                await asyncio.gather(sync_task, return_exceptions=True)
            if self.engines is not None:
                await self.engines.aclose()
            await self._close_clients()
            await self.journal.aclose()
            log_event("stopped", runtime=RUNTIME)

    def shutdown(self) -> None:
        """Begin a graceful shutdown: drain, then :meth:`serve` returns.

        Until the drain ends, new connections are still accepted: their
        requests get 503 ``shutting_down`` (docs/operate.md). Called again
        (a second signal), it cuts the drain short: what is left is
        cancelled at once.
        """
        if self.engines is None:
            self._stopping = True  # serve() shuts down as soon as it listens
            return
        self.feed(ShutdownRequested())

    def reload_keys(self) -> None:
        """Re-read the API keys file (SIGHUP); a bad file keeps the old keys and logs why."""
        try:
            authenticator = load_authenticator(self.config)
        except ConfigError as exc:
            log_event("keys_reload_failed", error=exc.message)
            return
        self.feed(AuthenticatorChanged(authenticator))

    def _stop_listening(self) -> None:
        self._stopping = True
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        while self._waiting:
            self._waiting.popleft().transport.abort()

    async def _close_clients(self) -> None:
        # After a drain the router has closed every connection; give the last
        # bytes a moment to leave, then cut what is left. (If serve() was
        # cancelled instead, connection_lost tells the router of each client.)
        for client in list(self._lingering):
            client.transport.abort()
        for client in list(self._clients):
            client.transport.close()
        deadline = clock() + EXIT_FLUSH_S
        while self._clients and clock() < deadline:
            await asyncio.sleep(0.01)
        for client in list(self._clients):
            client.transport.abort()
        await asyncio.sleep(0)  # let connection_lost run

    # ----------------------------------------------------------------- pump

    def feed(self, event: Event) -> None:
        """Feed one event and act on the commands (synchronously)."""
        try:
            self.router.receive(event, now=clock())
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the server
            # What the event concerned ends (500, journalled); the router
            # queued what it must: act on it as after any event.
            contain(self.router, event, exc)
        self._drain()

    def _drain(self) -> None:
        router = self.router
        next_output = router.next_output
        engines = self.engines
        assert engines is not None
        dirty = self._dirty
        while (cmd := next_output()) is not None:
            kind = type(cmd)
            if kind is Transmit:
                # Coalesced per client: one write(2) per loop iteration, not one per SSE event.
                client: _Client = cmd.conn  # type: ignore[union-attr,assignment]
                if not client.closed:
                    out = client.out
                    if not out:
                        dirty.append(client)
                    out.append(cmd.data)  # type: ignore[union-attr]
            elif kind is WriteJournal:
                self._journal_lines.append(cmd.line)  # type: ignore[union-attr]
            elif kind is StartLeg:
                engines.start_leg(cmd)  # type: ignore[arg-type]
            elif kind is FinishLeg:
                engines.finish_leg(cmd.leg, cmd.reusable)  # type: ignore[union-attr]
            elif kind is CloseClient:
                client = cmd.conn  # type: ignore[union-attr,assignment]
                if not client.closed:
                    # Closed once what was transmitted before is written.
                    client.closed = client.close_after = True
                    if not client.out:
                        dirty.append(client)
            elif kind is CancelLeg:
                engines.cancel_leg(cmd.leg)  # type: ignore[union-attr]
            elif kind is StartControl:
                engines.start_control(cmd)  # type: ignore[arg-type]
            elif kind is Log:
                log_event(cmd.event, **cmd.fields)  # type: ignore[union-attr]
            elif kind is ShutdownComplete:
                if self._drained is not None and not self._drained.done():
                    self._drained.set_result(None)
        if not self._flush_scheduled and (dirty or self._journal_lines or engines.unsent):
            self._flush_scheduled = True
            assert self._loop is not None
            self._loop.call_soon(self._flush)
        deadline = router.get_deadline()
        if deadline is not None and deadline < self._armed:
            # Only an earlier deadline re-arms; a later one waits for this one to fire.
            if self._timer is not None:
                self._timer.cancel()
            self._armed = deadline
            assert self._loop is not None
            self._timer = self._loop.call_at(deadline + TIMER_SLACK_S, self._on_timer)

    def _feed_and_poll(self, event: Event) -> None:
        """:meth:`feed` with ``ingress.busy_poll_us`` set: open (or extend) the polling window first."""
        self._poll_until = clock() + self._busy_poll
        if not self._polling and self._loop is not None:
            self._polling = True
            self._loop.call_soon(self._poll)
        Server.feed(self, event)

    def _poll(self) -> None:
        # Busy polling: while a callback is queued, the loop's next wait for
        # I/O returns at once, so a socket that becomes ready is served
        # without the process going to sleep and being woken.
        if clock() < self._poll_until:
            self.busy_polls += 1
            assert self._loop is not None
            self._loop.call_soon(self._poll)
        else:
            self._polling = False

    def _flush(self) -> None:
        """Write what the loop iteration produced: the journal first, then legs, then clients."""
        self._flush_scheduled = False
        lines = self._journal_lines
        if lines:
            self._journal_lines = []
            ok = self.journal.writer.write_lines(lines)
            if ok != self._journal_ok:
                self._journal_ok = ok
                self.feed(JournalHealth(ok, self.journal.writer.error))
        if self.engines is not None and self.engines.unsent:
            self.engines.write_unsent()
        dirty = self._dirty
        if dirty:
            self._dirty = []
            for client in dirty:
                _write(client)
                if client.close_after and not client.lost:
                    client.close_after = False
                    self._close(client)

    def _on_timer(self) -> None:
        # The armed deadline is due (were it not, nothing would fire and the
        # drain would re-arm the same deadline).
        self._timer = None
        self._armed = math.inf
        try:
            self.router.handle_deadline(now=clock())
        except Exception as exc:  # noqa: BLE001 - one bad timer must not stop the server
            contain(self.router, None, exc)
        self._drain()

    # -------------------------------------------------------------- clients

    def _accepted(self, client: _Client) -> None:
        if self._stopping:
            client.transport.abort()
            return
        client.transport.set_write_buffer_limits(high=HIGH_WATER)
        if len(self._clients) >= self._max_clients:
            # At the connection limit: hold it unread until a slot frees (like
            # a connection waiting in the backlog on trio), within a bound.
            if len(self._waiting) >= self._max_clients:
                client.transport.abort()
                return
            client.waiting = []
            client.transport.pause_reading()
            self._waiting.append(client)
            return
        self._admit(client)

    def _admit(self, client: _Client) -> None:
        self._clients.add(client)
        peer = client.transport.get_extra_info("peername")
        if not peer:
            self._clients.discard(client)
            client.closed = True
            client.transport.abort()
            return
        self.feed(ClientConnected(client, str(peer[0]), int(peer[1])))

    def _client_eof(self, client: _Client) -> None:
        if client.closed:
            return
        self.feed(ClientData(client, b""))
        if not client.closed:
            # The client closed its side and the router kept the connection:
            # as on trio, the connection ends here and the router must hear it.
            client.closed = True
            self.feed(ClientGone(client))

    def _client_lost(self, client: _Client) -> None:
        self._lingering.discard(client)
        if client.waiting is not None:
            try:
                self._waiting.remove(client)
            except ValueError:
                pass
            return
        self._clients.discard(client)
        client.write_paused = False
        for leg in client.relays:
            leg.resume()
        if not client.closed:
            # The socket broke under us: the router must hear it.
            client.closed = True
            self.feed(ClientGone(client))
        while self._waiting and len(self._clients) < self._max_clients:
            self._admit_waiting(self._waiting.popleft())

    def _admit_waiting(self, client: _Client) -> None:
        early, client.waiting = client.waiting or [], None
        self._admit(client)
        for data in early:
            if client.closed:
                return
            if data:
                self.feed(ClientData(client, data))
            else:
                self._client_eof(client)
                client.transport.close()
                return
        if not client.closed and not client.write_paused:
            client.transport.resume_reading()

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
            # The router is done with it: its connection slot is free.
            self._clients.discard(client)
            self._lingering.add(client)
            while self._waiting and len(self._clients) < self._max_clients:
                self._admit_waiting(self._waiting.popleft())
        else:
            transport.close()  # after the bytes written before it
        if transport.get_write_buffer_size() and client.stall is None:
            # A client that never reads must not hold its socket forever.
            assert self._loop is not None
            client.stall = self._loop.call_later(self.config.ingress.send_timeout_s, _abort_unless_lost, client)


def _write(client: _Client) -> None:
    out = client.out
    if out and not client.lost:
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        try:
            client.transport.write(data)
        except RuntimeError:
            pass  # uvloop: the socket just failed; connection_lost tells the router


def _abort_unless_lost(client: _Client) -> None:
    if not client.lost:
        client.transport.abort()


_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run(config: Config, on_ready: Callable[[str, int], None] | None = None) -> int:
    """``narwhal serve --runtime asyncio``: serve until SIGTERM/SIGINT, then drain and exit 0.

    SIGHUP re-reads the API keys file without dropping traffic. A second
    SIGTERM/SIGINT cancels what the drain has left at once (exit status
    128 + its number: 130 for Ctrl-C); a third stops without waiting for
    the router. A failure to start is one line on stderr, exit status 1.
    """
    status = 0
    serving = False

    async def main() -> None:
        nonlocal status
        loop = asyncio.get_running_loop()
        server = Server(config)
        serve = asyncio.current_task()
        stops = 0

        def on_signal(signum: int) -> None:
            nonlocal stops, status
            if signum == signal.SIGHUP:
                if server.engines is not None:
                    server.reload_keys()
                return
            stops += 1
            log_event("signal", signal=signal.Signals(signum).name)
            if stops == 1:
                server.shutdown()  # serve() returns once the drain completes
            elif stops == 2:
                status = STOPPED_BY_SIGNAL + signum
                server.shutdown()  # cut the drain short
            elif serve is not None:
                serve.cancel()  # serve() still writes the journal out

        for sig in _SIGNALS:
            loop.add_signal_handler(sig, on_signal, sig)

        def started(address: tuple[str, int]) -> None:
            nonlocal serving
            serving = True
            settle_gc()
            if on_ready is not None:
                on_ready(*address)

        try:
            await server.serve(started=started)
        except asyncio.CancelledError:
            if stops < 3:
                raise
        finally:
            for sig in _SIGNALS:
                loop.remove_signal_handler(sig)
        # serve() returns once draining completes (or the grace period ends).

    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(main())
    except KeyboardInterrupt:  # a Ctrl-C before the signal handlers were in place
        return STOPPED_BY_SIGNAL + signal.SIGINT
    except BaseException as exc:
        failure = None if serving else startup_failure(exc)
        if failure is None:
            raise
        print(f"narwhal: {failure}", file=sys.stderr)
        return 1
    return status


def run_demo(config: Config, on_ready: Callable[[str, int], None]) -> int:
    """``narwhal demo`` on asyncio: :func:`run`, telling ``on_ready`` where it listens."""
    return run(config, on_ready)
