"""Narwhal on trio: sockets, tasks, the timer and signals around the core router.

The adapter pumps: read bytes, feed the router, drain its commands, act on
each, re-arm the one timer. Draining is synchronous and writes nothing: bytes
for a client go into that client's outbox, leg requests for pooled engine
connections are queued, journal lines are gathered, new connections and
control requests are started in tasks. Under load, what a whole scheduler
batch produced is written at its end, from trio's ``before_io_wait`` hook
(an instrument), before the run loop waits for I/O again, as the asyncio
adapter does once per loop iteration: first every journal line in one
``write(2)``, then the queued leg requests, then each client's bytes in one
``send``. So a journal record is in the file before the bytes it describes
leave the process, a busy router writes the journal once per batch rather
than twice per request, and sockets are written in one burst (router CPU
per request at 32 concurrent clients: -22 %). When the last batch ran one
drain or none (light load), each drain writes the same way at its own end
instead: writing just before the loop sleeps would make the engine's answer
find the process asleep more often (+40 µs at one client). A socket that
cannot take all its bytes at once is finished by a writer task; a task that
feeds bytes to a client whose writer is more than ``HIGH_WATER`` behind
waits for it, so a slow client slows the engine leg relaying to it.

Client sockets, like engine connections (:mod:`.engines`), are plain
non-blocking sockets driven with :func:`trio.lowlevel.wait_readable`: a
read waits for the socket first (a checkpoint), and a write is tried at
once and waits only when the socket cannot take the bytes.

With ``ingress.busy_poll_us``, each event fed also keeps a polling task
runnable until that long after it (measured on the real clock, not trio's):
while a task is runnable, the run loop's wait for I/O returns at once
instead of sleeping.
"""

from __future__ import annotations

import math
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import trio

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

from .engines import Engines, close_socket, plain_socket, receive, send_all
from .journal_file import JournalFile

__all__ = ["Server", "run", "RUNTIME"]

RUNTIME = "trio"


class _Client:
    __slots__ = ("handle", "sock", "out", "buffered", "writing", "close_after", "closed", "drained", "release")

    out: list[bytes | memoryview]

    def __init__(self, handle: int, sock: socket.socket) -> None:
        #: The router's name for the connection.
        self.handle = handle
        self.sock = sock
        #: Frees the connection's slot (``ingress.max_connections``) once; set by its task.
        self.release: Callable[[], None] | None = None
        self.out = []
        #: Bytes in ``out``.
        self.buffered = 0
        #: A writer task owns the socket's sending (it could not take every byte at once).
        self.writing = False
        self.close_after = False
        self.closed = False
        self.drained: trio.Event | None = None


class Server:
    """One router serving on trio. Use :meth:`serve` inside a nursery (``nursery.start``)."""

    def __init__(self, config: Config, *, router: Router | None = None) -> None:
        self.config = config
        self.router = router or build_router(config, now=trio.current_time())
        try:
            self.journal = JournalFile(config.journal.path, config.journal.fsync, config.journal.fsync_interval_s)
        except OSError as exc:
            raise journal_failure(config.journal.path, exc) from None
        self._journal_ok = True
        self._send_timeout = config.ingress.send_timeout_s
        self._clients: dict[int, _Client] = {}
        self._next_handle = 0
        #: Clients with bytes (or a close) for the end of this batch.
        self._dirty: list[_Client] = []
        #: Clients whose writer is more than HIGH_WATER behind, fed by the drain just run.
        self._backlogged: list[_Client] = []
        #: Journal lines for the end of this batch.
        self._journal_lines: list[bytes] = []
        #: Set when the end-of-batch flush woke or started a task: the run
        #: loop computed its I/O wait before the flush, so it must be cut short.
        self._poke = False
        #: Drains since the last end of batch; with one or none in the last
        #: batch (light load) each drain writes at once (``_eager``).
        self._drains = 0
        self._eager = True
        self._flushing = False
        self._token: trio.lowlevel.TrioToken | None = None
        self._armed = math.inf
        self._timer_wakeup = trio.Event()
        self._drained = trio.Event()
        self._stop_accepting = trio.Event()
        self._nursery: trio.Nursery | None = None
        self.engines: Engines | None = None
        #: The address the server listens on, once started.
        self.address: tuple[str, int] | None = None
        #: ``ingress.busy_poll_us`` in seconds (0: no polling task).
        self._busy_poll = config.ingress.busy_poll_us / 1e6
        self._poll_until = 0.0
        self._poll_wakeup = trio.Event()
        #: Scheduler batches spent busy polling, so far.
        self.busy_polls = 0
        if self._busy_poll:
            # Only then does a fed event cost anything more.
            self.feed = self._feed_and_poll  # type: ignore[method-assign]

    # ------------------------------------------------------------------ run

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen, serve until a shutdown drains, then close the journal.

        ``task_status.started`` receives the bound ``(host, port)``.
        """
        i = self.config.ingress
        try:
            listeners = await trio.open_tcp_listeners(i.listen_port, host=i.listen_host)
        except OSError as exc:
            raise listen_failure(i.listen, exc) from None
        sock = listeners[0].socket
        host, port = sock.getsockname()[:2]
        self.address = (host, port)
        self._token = trio.lowlevel.current_trio_token()
        end_of_batch = _EndOfBatch(self._end_of_batch)
        trio.lowlevel.add_instrument(end_of_batch)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.engines = Engines(nursery, self.feed, pool_size=self.config.engine.pool_connections_per_engine)
                nursery.start_soon(self._timer_loop)
                if self._busy_poll:
                    nursery.start_soon(self._busy_poll_loop)
                if self.config.journal.fsync == "interval":
                    nursery.start_soon(self.journal.run_sync_timer)
                nursery.start_soon(self._accept_loop, listeners)
                self._drain()
                log_listening(self.config, host, port, RUNTIME, "trio")
                task_status.started((host, port))
                await self._drained.wait()
                self._stop_accepting.set()
                nursery.cancel_scope.cancel()
        finally:
            for listener in listeners:
                listener.socket.close()  # (closed already once drained)
            trio.lowlevel.remove_instrument(end_of_batch)
            self._flush_batch()  # what the last drain produced
            with trio.CancelScope(shield=True):
                if self.engines is not None:
                    await self.engines.aclose()
                await self.journal.aclose()
            log_event("stopped", runtime=RUNTIME)

    def shutdown(self) -> None:
        """Begin a graceful shutdown: drain, then :meth:`serve` returns.

        Until the drain ends, new connections are still accepted: their
        requests get 503 ``shutting_down`` (docs/operate.md). Called again
        (a second signal), it cuts the drain short: what is left is
        cancelled at once.
        """
        self._feed_now(ShutdownRequested())

    def reload_keys(self) -> None:
        """Re-read the API keys file (SIGHUP); a bad file keeps the old keys and logs why."""
        try:
            authenticator = load_authenticator(self.config)
        except ConfigError as exc:
            log_event("keys_reload_failed", error=exc.message)
            return
        self._feed_now(AuthenticatorChanged(authenticator))

    async def _accept_loop(self, listeners: list[trio.SocketListener]) -> None:
        limit = trio.Semaphore(self.config.ingress.max_connections)
        async with trio.open_nursery() as accepting:
            for listener in listeners:
                accepting.start_soon(self._accept, listener, limit)
            await self._stop_accepting.wait()
            accepting.cancel_scope.cancel()
        for listener in listeners:
            listener.socket.close()

    async def _accept(self, listener: trio.SocketListener, limit: trio.Semaphore) -> None:
        assert self._nursery is not None
        while True:
            await limit.acquire()
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: back off, keep serving
                limit.release()
                log_event("accept_failed", error=str(exc))
                await trio.sleep(0.1)
                continue
            except BaseException:
                limit.release()
                raise
            self._nursery.start_soon(self._client_task, stream, limit)

    # ----------------------------------------------------------------- pump

    async def feed(self, event: Event) -> None:
        """Feed one event and act on the commands; wait if a client it fed is far behind."""
        try:
            self.router.receive(event, now=trio.current_time())
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the server
            contain(self.router, event, exc)
        self._drain()
        if self._backlogged:
            backlogged, self._backlogged = self._backlogged, []
            for client in backlogged:
                # Backpressure: the writer owns the socket and is HIGH_WATER behind.
                if client.writing and client.buffered > HIGH_WATER:
                    if client.drained is None:
                        client.drained = trio.Event()
                    # The leg this task reads waits for the client: its
                    # engine's silence meanwhile is not the engine's fault.
                    self._feed_now(ClientStalled(client.handle, True))
                    await client.drained.wait()
                    self._feed_now(ClientStalled(client.handle, False))

    def _feed_now(self, event: Event) -> None:
        # For callers that must not block on a client socket (timer, cleanup).
        try:
            self.router.receive(event, now=trio.current_time())
        except Exception as exc:  # noqa: BLE001 - one bad event must not stop the server
            contain(self.router, event, exc)
        self._drain()
        self._backlogged.clear()

    def _drain(self) -> None:
        router = self.router
        engines = self.engines
        assert engines is not None
        lines = self._journal_lines
        while (cmd := router.next_output()) is not None:
            kind = type(cmd)
            if kind is Transmit:
                client = self._clients.get(cmd.conn)  # type: ignore[union-attr,arg-type]
                if client is not None and not client.closed:
                    client.out.append(cmd.data)  # type: ignore[union-attr]
                    client.buffered += len(cmd.data)  # type: ignore[union-attr]
                    if client.writing:
                        if client.buffered > HIGH_WATER:
                            self._backlogged.append(client)
                    else:
                        self._dirty.append(client)
            elif kind is WriteJournal:
                lines.append(cmd.line)  # type: ignore[union-attr]
            elif kind is StartLeg:
                # A pooled connection's request is queued for the end of the
                # batch; a new connection's task cannot send before then either.
                engines.start_leg(cmd)  # type: ignore[arg-type]
            elif kind is FinishLeg:
                engines.finish_leg(cmd.leg, cmd.reusable)  # type: ignore[union-attr]
            elif kind is CloseClient:
                client = self._clients.get(cmd.conn)  # type: ignore[union-attr,arg-type]
                if client is not None:
                    client.close_after = True
                    self._dirty.append(client)
            elif kind is CancelLeg:
                engines.cancel_leg(cmd.leg)  # type: ignore[union-attr]
            elif kind is StartControl:
                engines.start_control(cmd)  # type: ignore[arg-type]
            elif kind is Log:
                log_event(cmd.event, **cmd.fields)  # type: ignore[union-attr]
            elif kind is ShutdownComplete:
                self._drained.set()
        deadline = router.get_deadline()
        if deadline is None:
            deadline = math.inf
        if deadline < self._armed:
            self._armed = deadline
            self._timer_wakeup.set()
        self._drains += 1
        if self._eager and not self._flushing:
            # Light load: write now, while this task still has work to do,
            # rather than just before the run loop sleeps (the engine's
            # answer would then find the process asleep more often).
            self._flush_batch()

    # --------------------------------------------------------- end of batch

    def _end_of_batch(self) -> None:
        """trio's ``before_io_wait``: write what this batch produced."""
        self._eager = self._drains <= 1
        self._drains = 0
        if self._journal_lines or self._dirty or (self.engines is not None and self.engines.unsent):
            try:
                self._flush_batch()
            except Exception as exc:  # noqa: BLE001 - trio would drop an instrument that raises
                log_event("flush_error", level="error", error=f"{type(exc).__name__}: {exc}")
        if self._poke:
            self._poke = False
            assert self._token is not None
            self._token.run_sync_soon(_nothing)

    def _flush_batch(self) -> None:
        """The journal first, then the queued legs, then each client's bytes; nothing waits."""
        self._flushing = True
        try:
            if self._journal_lines:
                self._write_journal()
            engines = self.engines
            if engines is not None and engines.unsent and engines.write_unsent():
                self._poke = True
            while self._dirty:
                dirty, self._dirty = self._dirty, []
                for client in dirty:
                    self._send_now(client)
        finally:
            self._flushing = False

    def _write_journal(self) -> None:
        lines = self._journal_lines
        self._journal_lines = []
        ok = self.journal.writer.write_lines(lines)
        if ok != self._journal_ok:
            self._journal_ok = ok
            self._feed_now(JournalHealth(ok, self.journal.writer.error))
            self._poke = True
            if self._journal_lines:
                self._write_journal()

    def _send_now(self, client: _Client) -> None:
        if client.writing or client.closed:
            return  # the writer sends what is queued, in order; a closed client gets nothing
        out = client.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            client.out = []
            client.buffered = 0
            try:
                sent = client.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                # The reader task notices the dead socket and tells the router.
                client.closed = True
                close_socket(client.sock)
                return
            if sent < len(data):
                rest = memoryview(data)[sent:]
                client.out.append(rest)
                client.buffered = len(rest)
                client.writing = True
                assert self._nursery is not None
                self._nursery.start_soon(self._writer, client)
                self._poke = True
                return
        if client.close_after:
            self._close_client(client)

    async def _writer(self, client: _Client) -> None:
        """Finish sending to a client whose socket could not take every byte at once."""
        sock = client.sock
        try:
            while client.out and not client.closed:
                out = client.out
                data = out[0] if len(out) == 1 else b"".join(out)
                client.out = []
                client.buffered = 0
                with trio.move_on_after(self._send_timeout):
                    await send_all(sock, data)
                    continue
                # The client left our bytes unread for send_timeout_s: drop it,
                # so it cannot hold a connection slot (or a leg) forever.
                raise trio.BrokenResourceError("send timeout")
            if client.close_after and not client.closed:
                self._close_client(client)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            # The reader task notices the dead socket and tells the router.
            client.closed = True
            client.out = []
            close_socket(sock)
        finally:
            client.writing = False
            if client.drained is not None:
                client.drained.set()
                client.drained = None

    def _close_client(self, client: _Client) -> None:
        client.closed = True
        if client.release is not None:
            client.release()  # the router is done with it: its slot is free
        self._shut(client.sock)

    def _shut(self, sock: socket.socket) -> None:
        # Lingering close: shut our side (the answer is out), let the reader
        # task drop what the client still sends, close after LINGER_S at most.
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            close_socket(sock)
            return
        assert self._nursery is not None
        self._nursery.start_soon(self._end_linger, sock)
        self._poke = True

    @staticmethod
    async def _end_linger(sock: socket.socket) -> None:
        await trio.sleep(LINGER_S)
        close_socket(sock)  # wakes a reader still lingering; nothing if it is closed

    @staticmethod
    async def _linger(sock: socket.socket) -> None:
        left = LINGER_BYTES
        while left > 0 and sock.fileno() != -1:  # closed already: a failed write, or LINGER_S is over
            data = await receive(sock)
            if not data:
                return  # EOF, or closed
            left -= len(data)

    async def _feed_and_poll(self, event: Event) -> None:
        """:meth:`feed` with ``ingress.busy_poll_us`` set: open (or extend) the polling window first."""
        self._poll_until = time.monotonic() + self._busy_poll
        self._poll_wakeup.set()
        await Server.feed(self, event)

    async def _busy_poll_loop(self) -> None:
        # Runnable until the polling window after the last event closes (a
        # real-time window: it stands for CPU spent, and a test's mock clock
        # does not move while a task is runnable), then parked.
        while True:
            await self._poll_wakeup.wait()
            self._poll_wakeup = trio.Event()
            while time.monotonic() < self._poll_until:
                self.busy_polls += 1
                await trio.lowlevel.checkpoint()

    async def _timer_loop(self) -> None:
        while True:
            with trio.move_on_at(self._armed):
                await self._timer_wakeup.wait()
            self._timer_wakeup = trio.Event()
            now = trio.current_time()
            if now >= self._armed:
                self._armed = math.inf
                try:
                    self.router.handle_deadline(now=now)
                except Exception as exc:  # noqa: BLE001 - one bad timer must not stop the server
                    contain(self.router, None, exc)
                self._drain()
                self._backlogged.clear()
                if self._armed == math.inf:
                    deadline = self.router.get_deadline()
                    self._armed = math.inf if deadline is None else deadline

    # -------------------------------------------------------------- clients

    async def _client_task(self, stream: trio.SocketStream, limit: trio.Semaphore) -> None:
        handle = self._next_handle
        self._next_handle += 1
        sock = plain_socket(stream)
        client = _Client(handle, sock)
        self._clients[handle] = client

        def release() -> None:
            if client.release is not None:
                client.release = None
                del self._clients[handle]
                limit.release()

        client.release = release
        try:
            try:
                peer = sock.getpeername()
            except OSError:
                return
            await self.feed(ClientConnected(handle, str(peer[0]), int(peer[1])))
            while not client.closed:
                # Wait first: a client sends its next request only once it
                # has the answer to this one, so reading at once would
                # nearly always come back empty-handed.
                data = await receive(sock)
                if data is None:
                    break
                await self.feed(ClientData(handle, data))
                if not data:
                    break
            if client.close_after:
                await self._linger(sock)  # Narwhal closed it: drop what the client still sends
        finally:
            if not client.close_after:
                # The socket broke under us: the router must hear it.
                self._feed_now(ClientGone(handle))
            release()
            client.closed = True
            close_socket(sock)


class _EndOfBatch(trio.abc.Instrument):
    """Calls ``flush`` once per scheduler batch, before the run loop waits for I/O."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def before_io_wait(self, timeout: float) -> None:
        self._flush()


def _nothing() -> None:
    """Queued with ``run_sync_soon`` only to wake the run loop's I/O wait."""


def run(config: Config, on_ready: Callable[[str, int], None] | None = None) -> int:
    """``narwhal serve --runtime trio``: serve until SIGTERM/SIGINT, then drain and exit 0.

    SIGHUP re-reads the API keys file without dropping traffic. A second
    SIGTERM/SIGINT cancels what the drain has left at once (exit status
    128 + its number: 130 for Ctrl-C); a third stops without waiting for
    the router. A failure to start is one line on stderr, exit status 1.
    """
    status = 0
    serving = False

    async def main() -> None:
        nonlocal status, serving
        server = Server(config)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:

                async def serve(task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
                    try:
                        await server.serve(task_status=task_status)
                    finally:
                        nursery.cancel_scope.cancel()  # the signal loop below ends with it

                host, port = await nursery.start(serve)
                serving = True
                settle_gc()
                if on_ready is not None:
                    on_ready(host, port)
                stops = 0
                async for signum in signals:
                    if signum == signal.SIGHUP:
                        server.reload_keys()
                        continue
                    stops += 1
                    log_event("signal", signal=signal.Signals(signum).name)
                    if stops == 1:
                        server.shutdown()  # serve() returns once the drain completes
                    elif stops == 2:
                        status = STOPPED_BY_SIGNAL + signum
                        server.shutdown()  # cut the drain short
                    else:
                        nursery.cancel_scope.cancel()  # serve() still writes the journal out

    try:
        trio.run(main)
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
    """``narwhal demo`` on trio: :func:`run`, telling ``on_ready`` where it listens."""
    return run(config, on_ready)
