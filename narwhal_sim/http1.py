"""HTTP/1.1 for the simulator: raw asyncio protocols with httptools parsing.

:class:`HttpServer` accepts connections and feeds each request to an app's
``handle(conn, request)``, which answers at once (returning ``None``) or
returns a coroutine. The coroutine is run *eagerly*: its first step runs
inside the read callback, and only if it really suspends does it become a
task. At ``--speed 0`` most answers thus cost no task at all.

One request is handled at a time per connection (pipelined requests wait
their turn); keep-alive follows the request (HTTP/1.0 and ``Connection:
close`` close after the answer). An idle keep-alive connection is closed
after ``keep_alive_s`` (uvicorn, which serves vLLM, does this after 5 s),
a request whose headers and body take longer than ``read_timeout_s`` is
cut off (slowloris), and a parse error answers 400 and closes: one bad
connection never stops the server.

The client side, for the simulator's own calls to other engines, is
:mod:`narwhal_sim.http_client`.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import logging
import socket
import time
from collections import deque
from collections.abc import Coroutine, Generator
from typing import Any, Protocol, cast

import attrs
import httptools

from narwhal_sim.protocol import error_body

__all__ = ["Limits", "HttpRequest", "ServerConnection", "HttpServer", "App"]

log = logging.getLogger("narwhal_sim")

JSON = b"application/json"


@attrs.frozen(kw_only=True)
class Limits:
    """Per-connection limits of the simulator's HTTP server."""

    #: Close a keep-alive connection idle this long (uvicorn's default is 5 s).
    keep_alive_s: float = 5.0
    #: A request's headers and body must arrive within this time.
    read_timeout_s: float = 30.0
    #: Largest request head (request line plus headers).
    max_header_bytes: int = 64 * 1024
    #: Largest request body.
    max_body_bytes: int = 64 * 1024 * 1024
    #: Pipelined requests buffered behind the one being handled.
    max_pipelined: int = 64


class HttpRequest:
    """One parsed request; ``headers`` are ``(name, value)`` bytes exactly as received."""

    __slots__ = (
        "method",
        "target",
        "path",
        "headers",
        "body",
        "keep_alive",
        "http_10",
        "request_id",
        "authorization",
        "tag",
    )

    def __init__(
        self,
        method: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        keep_alive: bool,
        http_10: bool,
        request_id: str | None,
        authorization: bytes | None,
    ) -> None:
        self.method = method
        self.target = target
        query = target.find(b"?")
        self.path = (target if query < 0 else target[:query]).decode("latin-1")
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.http_10 = http_10
        #: ``X-Request-Id`` as received, if any.
        self.request_id = request_id
        self.authorization = authorization
        #: Free for the app (the simulator keeps its request record here).
        self.tag: Any = None


class App(Protocol):
    """What :class:`HttpServer` serves."""

    def handle(self, conn: ServerConnection, request: HttpRequest) -> Coroutine[Any, Any, None] | None: ...

    def abandon(self, request: HttpRequest) -> None: ...

    def bad_request(self) -> None: ...


# --------------------------------------------------------------------------- writing

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_DATE = [b""]


def _refresh_date() -> None:
    _DATE[0] = email.utils.formatdate(time.time(), usegmt=True).encode()


_refresh_date()


def response_head(
    status: int,
    *,
    content_type: bytes | None,
    length: int | None,
    keep_alive: bool,
    extra: list[tuple[bytes, bytes]] | tuple[()] = (),
) -> bytes:
    """Status line and headers; ``length=None`` means a chunked body."""
    start = _STATUS_LINES.get(status)
    if start is None:
        start = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    parts = [start, b"date: ", _DATE[0], b"\r\nserver: narwhal-sim\r\n"]
    if content_type is not None:
        parts.append(b"content-type: " + content_type + b"\r\n")
    if length is None:
        parts.append(b"transfer-encoding: chunked\r\n")
    else:
        parts.append(b"content-length: %d\r\n" % length)
    for name, value in extra:
        parts.append(name + b": " + value + b"\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


# --------------------------------------------------------------------------- eager coroutines


class _Resume:
    """Continue a coroutine whose first step already ran outside any task."""

    __slots__ = ("_coro", "_yielded")

    def __init__(self, coro: Coroutine[Any, Any, None], yielded: Any) -> None:
        self._coro = coro
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, None]:
        coro, value = self._coro, self._yielded
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancellation and errors go to the handler
                try:
                    value = coro.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    value = coro.send(sent)
                except StopIteration:
                    return


async def _resume(coro: Coroutine[Any, Any, None], yielded: Any) -> None:
    await _Resume(coro, yielded)


class _Reject(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


# --------------------------------------------------------------------------- server side

_IDLE, _READING, _BUSY = 0, 1, 2


class ServerConnection(asyncio.Protocol):
    """One client connection: parse, hand requests to the app one at a time, write answers."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._app = server.app
        self._limits = server.limits
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._pending: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._current: HttpRequest | None = None
        self._state = _IDLE
        self.deadline = 0.0
        self.closed = False
        self._closed_waiter: asyncio.Future[None] | None = None
        self._close_after = False
        self._broken = False
        self._in_message = False
        # Response progress of the current request.
        self._responded = False
        self._stream_open = False
        self._chunked = True
        self._stream_head = b""
        # Request being parsed.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._request_id: bytes | None = None
        self._authorization: bytes | None = None

    # -- asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._server.connections.add(self)
        self.deadline = self._loop.time() + self._limits.keep_alive_s

    def data_received(self, data: bytes) -> None:
        if self.closed or self._broken:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            reason = exc.__context__
            if isinstance(reason, _Reject):
                self._reject(reason.status, reason.message)
            else:
                log.exception("request parsing failed")
                self._reject(400, "malformed HTTP request")
            return
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError:
            self._reject(400, "malformed HTTP request")
            return
        self._pump()

    def eof_received(self) -> bool:
        # A client that half-closes is gone: vLLM aborts its request, and
        # the decode_abort release mode (docs/simulator.md) relies on exactly that.
        self._mark_closed()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._mark_closed()
        self._server.connections.discard(self)
        if self._task is not None and not self._task.done():
            # Scheduled, not direct: the task's first step is already queued
            # ahead of us, so the handler always sees the cancellation.
            self._loop.call_soon(self._task.cancel)
        while self._pending:
            request = self._pending.popleft()
            self._app.abandon(request)

    def _mark_closed(self) -> None:
        if not self.closed:
            self.closed = True
            if self._closed_waiter is not None and not self._closed_waiter.done():
                self._closed_waiter.set_result(None)

    # -- httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = []
        self._head_bytes = 0
        self._body = []
        self._body_bytes = 0
        self._request_id = None
        self._authorization = None
        self._in_message = True
        if self._state == _IDLE:
            self._state = _READING
            self.deadline = self._loop.time() + self._limits.read_timeout_s

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        if self._head_bytes > self._limits.max_header_bytes:
            raise _Reject(431, "request line too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._limits.max_header_bytes:
            raise _Reject(431, "request headers too large")
        self._headers.append((name, value))
        lowered = name.lower()
        if lowered == b"x-request-id":
            self._request_id = value
        elif lowered == b"authorization":
            self._authorization = value
        elif lowered == b"expect" and value.lower() == b"100-continue":
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_headers_complete(self) -> None:
        for name, value in self._headers:
            if name.lower() == b"content-length" and value.isdigit() and int(value) > self._limits.max_body_bytes:
                raise _Reject(413, "request body too large")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._limits.max_body_bytes:
            raise _Reject(413, "request body too large")
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        parser = self._parser
        rid = self._request_id
        request = HttpRequest(
            parser.get_method().decode("latin-1"),
            self._url,
            self._headers,
            b"".join(self._body),
            parser.should_keep_alive(),
            parser.get_http_version() == "1.0",
            rid.decode("latin-1") if rid is not None else None,
            self._authorization,
        )
        self._pending.append(request)
        if len(self._pending) > self._limits.max_pipelined:
            raise _Reject(429, "too many pipelined requests")

    # -- request dispatch

    def _pump(self) -> None:
        while self._pending and self._task is None and self._current is None and not self.closed:
            self._run(self._pending.popleft())
        if self._current is None and self._task is None and not self._pending and self._state == _BUSY:
            if self._in_message:
                self._state = _READING
                self.deadline = self._loop.time() + self._limits.read_timeout_s
            else:
                self._state = _IDLE
                self.deadline = self._loop.time() + self._limits.keep_alive_s

    def _run(self, request: HttpRequest) -> None:
        self._state = _BUSY
        self._current = request
        self._responded = False
        self._stream_open = False
        self._stream_head = b""
        try:
            coro = self._app.handle(self, request)
            if coro is not None:
                try:
                    yielded = coro.send(None)
                except StopIteration:
                    pass
                else:
                    self._task = self._loop.create_task(_resume(coro, yielded))
                    self._task.add_done_callback(self._task_done)
                    return
        except Exception:
            log.exception("handler failed")
        self._request_done()

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._task = None
        if not task.cancelled() and task.exception() is not None:
            log.error("handler failed", exc_info=task.exception())
        self._request_done()
        self._pump()

    def _request_done(self) -> None:
        request, self._current = self._current, None
        if self.closed or request is None:
            return
        if not self._responded:
            self.respond(500, error_body(500, "the simulator failed to answer"))
        if self._stream_open or self._close_after or not request.keep_alive:
            self.close()

    # -- answering (used by the app)

    def respond(
        self,
        status: int,
        body: bytes = b"",
        *,
        content_type: bytes | None = JSON,
        headers: list[tuple[bytes, bytes]] | tuple[()] = (),
    ) -> None:
        """Send a whole answer with ``content-length``."""
        if self._responded:
            return
        self._responded = True
        request = self._current
        keep_alive = request is not None and request.keep_alive and not self._close_after
        head = response_head(status, content_type=content_type, length=len(body), keep_alive=keep_alive, extra=headers)
        self._write(head + body)

    def start_stream(
        self, status: int, *, content_type: bytes, headers: list[tuple[bytes, bytes]] | tuple[()] = ()
    ) -> None:
        """Start a chunked answer (an HTTP/1.0 client gets the body up to the close)."""
        self._responded = True
        self._stream_open = True
        request = self._current
        self._chunked = request is None or not request.http_10
        keep_alive = request is not None and request.keep_alive and self._chunked
        length = None if self._chunked else -1
        head = response_head(status, content_type=content_type, length=length, keep_alive=keep_alive, extra=headers)
        if length == -1:
            head = head.replace(b"content-length: -1\r\n", b"")
        # Written with the first chunks: one send instead of two.
        self._stream_head = head

    def send_chunks(self, chunks: list[bytes], *, end: bool = False) -> None:
        """Send body chunks of a started stream in one write (and finish it when ``end``)."""
        if self._chunked:
            data = b"".join([b"%x\r\n%s\r\n" % (len(c), c) for c in chunks])
        else:
            data = b"".join(chunks)
        if end:
            self._stream_open = False
            if self._chunked:
                data += b"0\r\n\r\n"
            else:
                self._close_after = True
        head, self._stream_head = self._stream_head, b""
        if head or data:
            self._write(head + data)

    def end_stream(self) -> None:
        """Finish a chunked answer; the connection can serve the next request."""
        if self._stream_open:
            self.send_chunks([], end=True)

    def flush(self) -> None:
        """Send a stream's pending head now."""
        if self._stream_head:
            self.send_chunks([])

    def close(self) -> None:
        """Close after what was written is flushed."""
        self._mark_closed()
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Reset the connection at once."""
        self._mark_closed()
        if self.transport is not None:
            self.transport.abort()

    def gone(self) -> asyncio.Future[None]:
        """A future done once the client has gone: to ``asyncio.wait`` on with other work, never to cancel."""
        if self._closed_waiter is None:
            self._closed_waiter = self._loop.create_future()
            if self.closed:
                self._closed_waiter.set_result(None)
        return self._closed_waiter

    async def wait_closed(self, timeout: float | None = None) -> bool:
        """Wait until the client has gone (EOF, reset or close), at most ``timeout`` s; whether it has."""
        if self.closed:
            return True
        if self._closed_waiter is None:
            self._closed_waiter = self._loop.create_future()
        if timeout is None:
            await self._closed_waiter
        else:
            await asyncio.wait((self._closed_waiter,), timeout=timeout)
        return self.closed

    def check_deadline(self, now: float) -> None:
        """Close the connection if it idled or dribbled past its deadline."""
        if self._state != _BUSY and now > self.deadline and not self.closed:
            if self._state == _READING:
                self._server.app.bad_request()
            self.close()

    def _write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    def _reject(self, status: int, message: str) -> None:
        self._app.bad_request()
        self._pending.clear()
        self._broken = True
        if self._current is None:
            body = error_body(status, message)
            head = response_head(status, content_type=JSON, length=len(body), keep_alive=False)
            self._write(head + body)
            self.close()
        else:
            # An answer is in progress: finish it, then close.
            self._close_after = True


class HttpServer:
    """A listening socket serving an :class:`App`."""

    def __init__(self, app: App, *, limits: Limits, loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.limits = limits
        self.loop = loop
        self.connections: set[ServerConnection] = set()
        self._server: asyncio.base_events.Server | None = None
        self._sock: socket.socket | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def bind(self, host: str, port: int) -> tuple[str, int]:
        """Bind and listen (with ``SO_REUSEADDR``, so a restart can take the same port).

        Clients may connect from now on (the kernel queues them); they are
        served once :meth:`start_serving` runs.
        """
        family, _, _, _, address = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.create_server(address, family=family, backlog=2048)
        sock.setblocking(False)
        self._sock = sock
        sockname = sock.getsockname()
        return sockname[0], sockname[1]

    async def start_serving(self) -> None:
        """Accept connections."""
        assert self._sock is not None
        self._server = await self.loop.create_server(lambda: ServerConnection(self), sock=self._sock, backlog=2048)
        self._sweep()

    def _sweep(self) -> None:
        _refresh_date()
        now = self.loop.time()
        for conn in list(self.connections):
            conn.check_deadline(now)
        self._sweeper = self.loop.call_later(0.25, self._sweep)

    async def close(self) -> None:
        """Stop listening and close every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        elif self._sock is not None:
            self._sock.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
