"""Client connections: reading requests, their time limits and memory budget, and the answers of no request.

:class:`Clients` owns every client connection's server codec. It reads a
connection's requests one at a time (pipelined ones wait for the answer
before), applies the idle, header and body timeouts and the bound on the
bytes of unfinished requests held across connections, answers the routes
that are not completions (``/health``, ``/ready``, ``/metrics``,
``/v1/models``, an unknown route) and every refusal before admission, with
its terminal record when it names a completion route (docs/operate.md).
Completion requests read whole wait in :attr:`Clients.arrived`; the router
hands them to :class:`~narwhal_core.requests.Requests` (admission).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from . import journal, wire
from .auth import Authenticator
from .context import JSON_HEADER, Context, error_record
from .contract import CHAT, COMPLETIONS, AcceptedRequest, Route
from .errors import AuthError, NarwhalError, RemoteProtocolError
from .events import ClientConnected, CloseClient, Transmit
from .http import NEED_DATA, ConnectionClosed, ContinueExpected, HttpRequest, ServerCodec
from .ids import sanitize_client_rid
from .inflight import Conn
from .journal import Terminal
from .tracecontext import request_trace

if TYPE_CHECKING:
    from .admin import Admin
    from .tracecontext import TraceContext
    from .timers import Timer

__all__ = ["Conn", "Clients"]

_CLOSE: Final = (b"connection", b"close")
_COMPLETION_ROUTES: Final[Mapping[str, Route]] = MappingProxyType({COMPLETIONS: COMPLETIONS, CHAT: CHAT})
_GET_ROUTES: Final = frozenset({"/v1/models", "/health", "/ready", "/metrics"})
_Headers = tuple[tuple[bytes, bytes], ...]


class Clients:
    """The client connections, by the adapter's handle; what they send and what they are answered."""

    __slots__ = ("ctx", "conns", "pump", "arrived", "buffered", "max_buffered", "auth", "metrics", "metrics_wanted",
                 "retry_after", "admin")

    def __init__(
        self, ctx: Context, authenticator: Authenticator, metrics: bool, admin: Admin | None = None,
    ) -> None:
        self.ctx: Final = ctx
        self.conns: dict[Hashable, Conn] = {}
        #: Connections whose response just finished: serve their next
        #: (pipelined) request once the current event is handled.
        self.pump: list[Conn] = []
        #: Completion requests read whole, oldest first, for the router to hand to admission
        #: (:meth:`~narwhal_core.requests.Requests.accept`): connection, rid, route, request.
        self.arrived: deque[tuple[Conn, str, Route, HttpRequest]] = deque()
        #: Bytes of unfinished requests held across client connections, and their bound.
        self.buffered = 0
        self.max_buffered: Final = ctx.config.ingress.max_buffered_bytes
        self.auth = authenticator
        #: Whether ``/metrics`` can be rendered (the adapter gave the router a renderer).
        self.metrics: Final = metrics
        #: ``GET /metrics`` requests read whole, for the router to render and hand to :meth:`answer_metrics`:
        #: the figures are the whole router's, which no part below it holds.
        self.metrics_wanted: list[tuple[Conn, str]] = []
        self.retry_after: Final = str(ctx.config.admission.retry_after_s).encode()
        #: The admin API (docs/operate.md); ``None``: its routes are unknown.
        self.admin: Final = admin

    # ------------------------------------------------------------- connections

    def connected(self, event: ClientConnected) -> None:
        """A client connected: it must send its request head within ``ingress.header_timeout_s``."""
        i = self.ctx.config.ingress
        codec = self.ctx.codec.server_connection(
            max_request_line_bytes=i.max_request_line_bytes,
            max_header_bytes=i.max_header_bytes,
            max_headers=i.max_headers,
            max_body_bytes=i.max_body_bytes,
        )
        conn = Conn(handle=event.conn, codec=codec, peer_host=event.peer_host)
        self.conns[event.conn] = conn
        # While draining too: until the adapter closes its listener, a new
        # client's request gets its answer (503 shutting_down, journalled),
        # not a connection closed unanswered (docs/operate.md).
        conn.reading = True  # a new client must send its request head promptly
        self.wait_for_request(conn, i.header_timeout_s)

    def data(self, handle: Hashable, data: bytes) -> Conn | None:
        """Bytes from a client (empty: it closed its side); the connection, if it left while its request runs.

        (The router then ends that request.) A completion request read whole waits in :attr:`arrived`.
        """
        conn = self.conns.get(handle)
        if conn is None:
            return None
        if not data and conn.rid is not None:
            # The client closed its side while its request runs: it is gone.
            self.conns.pop(handle, None)
            self.close_client(conn)
            return conn
        conn.codec.receive_data(data)
        if conn.rid is None:
            self.next_request(conn)
        self.count_buffered(conn)
        return None

    def gone(self, handle: Hashable) -> Conn | None:
        """The adapter reports the connection gone; the connection, if it was ours."""
        conn = self.conns.pop(handle, None)
        if conn is not None:
            conn.closed = True
            self.count_buffered(conn)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None
        return conn

    def serve_pipelined(self) -> None:
        """Serve the next request of each connection whose response just finished."""
        pump = self.pump
        while pump:
            conn = pump.pop()
            if conn.rid is None and not conn.closed:
                self.next_request(conn)
                self.count_buffered(conn)

    def close_idle(self) -> None:
        """Shutdown: close every connection with no request in progress."""
        for conn in list(self.conns.values()):
            if conn.rid is None and not conn.codec.in_response and not conn.codec.has_partial_request:
                self.close_client(conn)

    def next_request(self, conn: Conn) -> None:
        """Read the connection's next request, if its bytes are in; else move its time limit."""
        i = self.ctx.config.ingress
        while conn.rid is None and not conn.closed:
            try:
                event = conn.codec.next_event()
            except RemoteProtocolError as exc:
                self._bad_request(conn, exc)
                return
            if event is NEED_DATA:
                codec = conn.codec
                if not conn.reading and codec.has_partial_request:
                    # The first bytes of a request: the client now has the
                    # header timeout, not the idle keep-alive one...
                    conn.reading = True
                    self.set_deadline(conn, self.ctx.now + i.header_timeout_s)
                if conn.reading and not conn.body_phase and codec.reading_body:
                    # ...and once the head is in, the body timeout.
                    conn.body_phase = True
                    self.set_deadline(conn, self.ctx.now + i.body_timeout_s)
                return
            if isinstance(event, HttpRequest):
                self._on_request(conn, event)
            elif isinstance(event, ContinueExpected):
                self._on_continue(conn, event)
            elif isinstance(event, ConnectionClosed):
                self.close_client(conn)
                return
            else:  # PAUSED cannot happen while no request runs
                return

    # ----------------------------------------------------------- time limits

    def wait_for_request(self, conn: Conn, seconds: float) -> None:
        self.set_deadline(conn, self.ctx.now + seconds)

    def set_deadline(self, conn: Conn, when: float) -> None:
        """Move the connection's read deadline to ``when``."""
        # Deadlines move without touching the heap; a new timer is armed only
        # when the deadline comes earlier than the one already armed.
        conn.read_deadline = when
        if conn.timer is None or when < conn.armed:
            if conn.timer is not None:
                conn.timer.cancel()
            conn.armed = when
            conn.timer = self.ctx.timers.arm(when, self.timer_fired, conn)

    def timer_fired(self, conn: Conn) -> None:
        conn.timer = None
        if conn.rid is not None:
            pass  # a request runs: its own deadlines apply
        elif conn.read_deadline > self.ctx.now:
            self.set_deadline(conn, conn.read_deadline)
        else:
            self._read_timeout(conn)

    def _read_timeout(self, conn: Conn) -> None:
        # An idle keep-alive connection just closes; a half-sent request gets
        # 408, and its terminal record when it names a completion route (the
        # rid in its answer must be in the journal: docs/operate.md).
        if conn.reading:
            message = "Timed out reading the request."
            rid = self.ctx.new_rid()
            route = _COMPLETION_ROUTES.get((conn.codec.partial_target or "").partition("?")[0])
            if route is not None:
                self._journal_refused(rid, route, "invalid", NarwhalError(
                    message, status=408, type="invalid_request_error", code="request_timeout"
                ))
            self.send(conn, conn.codec.send_error_response(
                408, self._error_headers(rid), error_body(message, "request_timeout"),
            ))
        self.close_client(conn)

    # ---------------------------------------------------------- memory budget

    def count_buffered(self, conn: Conn) -> None:
        """Recount what ``conn``'s codec holds; past ``ingress.max_buffered_bytes``, refuse it."""
        held = 0 if conn.closed else conn.codec.buffered_bytes
        self.buffered += held - conn.buffered
        conn.buffered = held
        if held and conn.rid is None and not conn.closed and self.buffered > self.max_buffered:
            self._over_budget(conn)

    def _over_budget(self, conn: Conn) -> None:
        # The connection whose unfinished request pushed the total past the
        # bound gets 503 and is closed: memory stays bounded whatever the
        # number of slow uploads. A completion request whose head is parsed
        # is journalled, as a 413 is.
        message = "Narwhal holds too many unfinished requests; retry later."
        error = NarwhalError(message, status=503, code="overloaded")
        rid = self.ctx.new_rid()
        route = _COMPLETION_ROUTES.get((conn.codec.partial_target or "").partition("?")[0])
        if route is not None:
            conn.rid = rid
            self._journal_refused(rid, route, "rejected", error)
        self.send(conn, conn.codec.send_error_response(
            503, (*self._error_headers(rid), (b"retry-after", self.retry_after)),
            error_body(message, "overloaded", error.type),  # the type the record says too
        ))
        self.close_client(conn)

    # ----------------------------------------------------------------- routes

    def _bad_request(self, conn: Conn, exc: RemoteProtocolError) -> None:
        if exc.reason != "dropped":
            message = {
                413: "Request body too large.", 431: "Request header fields too large.",
                505: "HTTP version not supported; use HTTP/1.1.",
            }.get(exc.status, "Malformed HTTP request.")
            code = {413: "body_too_large", 431: "headers_too_large", 505: "http_version_not_supported"}.get(
                exc.status, "bad_http_request"
            )
            rid = self.ctx.new_rid()
            route = _COMPLETION_ROUTES.get((exc.target or "").partition("?")[0])
            if route is not None:
                # Its request line named a completion route: journalled (docs/operate.md).
                conn.rid = rid
                error = NarwhalError(message, status=exc.status, type="invalid_request_error", code=code)
                self._journal_refused(rid, route, "invalid", error)
            self.send(conn, conn.codec.send_error_response(
                exc.status, self._error_headers(rid), error_body(message, code)
            ))
        self.close_client(conn)

    def _on_continue(self, conn: Conn, head: ContinueExpected) -> None:
        path = head.target.partition("?")[0]
        route = _COMPLETION_ROUTES.get(path)
        if route is not None and head.method == "POST":
            try:
                self.auth.authenticate(head.headers, conn.peer_host)
            except AuthError as exc:
                rid = self.ctx.new_rid()
                self.refuse(conn, rid, route, sanitize_client_rid(head.header(b"x-request-id")), None, "denied", exc,
                            trace=request_trace(head.headers, rid, self.ctx.config.tracing))
                return
        self.send(conn, conn.codec.send_continue())

    def _on_request(self, conn: Conn, request: HttpRequest) -> None:
        rid = self.ctx.new_rid()
        conn.rid = rid
        conn.reading = conn.body_phase = False
        path = request.target.partition("?")[0]
        route = _COMPLETION_ROUTES.get(path)
        if route is not None:
            if request.method == "POST":
                self.arrived.append((conn, rid, route, request))  # the router hands it to admission
            else:
                # A completion route: journalled like every request to it (docs/contract.md).
                error = NarwhalError(
                    f"Method {request.method} is not allowed on {path}; use POST.",
                    status=405, type="invalid_request_error", code="method_not_allowed",
                )
                self.refuse(conn, rid, route, sanitize_client_rid(request.header(b"x-request-id")),
                            None, "invalid", error, extra=((b"allow", b"POST"),),
                            trace=request_trace(request.headers, rid, self.ctx.config.tracing))
        elif path in _GET_ROUTES:
            self._get(conn, rid, path, request)
        elif path.startswith("/admin/") and self.admin is not None:
            status, body, extra = self.admin.answer(self.auth, path, request)
            self.respond_plain(conn, rid, status, body, extra=extra)
        else:
            shown = path if len(path) <= 200 else path[:200] + "..."
            self.respond_plain(conn, rid, 404, error_body(f"Unknown route {shown}.", "not_found"))

    def _get(self, conn: Conn, rid: str, path: str, request: HttpRequest) -> None:
        """``/health``, ``/ready``, ``/metrics``, ``/v1/models``."""
        if request.method not in ("GET", "HEAD"):
            self.respond_plain(conn, rid, 405, error_body(
                f"Method {request.method} is not allowed on {path}; use GET.", "method_not_allowed"
            ), extra=((b"allow", b"GET, HEAD"),))
        elif path == "/health":
            self.respond_plain(conn, rid, 200, b'{"status":"ok"}')
        elif path == "/ready":
            problems = self.ctx.ready_problems()
            body = wire.dumps({"ready": not problems, "problems": problems})
            self.respond_plain(conn, rid, 503 if problems else 200, body)
        elif path == "/metrics":
            self._metrics(conn, rid)
        else:
            self._models(conn, rid, request)

    def _metrics(self, conn: Conn, rid: str) -> None:
        if not self.metrics:
            self.respond_plain(conn, rid, 503, error_body("Metrics are not available.", "no_metrics"))
            return
        self.metrics_wanted.append((conn, rid))

    def answer_metrics(self, conn: Conn, rid: str, body: bytes) -> None:
        """Answer a ``GET /metrics`` from :attr:`metrics_wanted` with the exposition ``body``."""
        self.end_response(conn, conn.codec.send_response(200, (
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"x-request-id", rid.encode()),
            *self.closing(conn),
        ), body))

    def _models(self, conn: Conn, rid: str, request: HttpRequest) -> None:
        try:
            self.auth.authenticate(request.headers, conn.peer_host)
        except AuthError as exc:
            self.respond_plain(conn, rid, 401, exc.body())
            return
        model = self.ctx.model
        names = [model, *self.ctx.config.model.aliases]
        body = wire.dumps({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "narwhal", "root": model}
            for n in names
        ]})
        self.respond_plain(conn, rid, 200, body)

    # --------------------------------------------------------------- refusals

    def refuse(
        self, conn: Conn, rid: str, route: Route, client_rid: str | None, client: str | None, terminal: Terminal,
        exc: NarwhalError, *, retry_after: bool = False, accepted: AcceptedRequest | None = None,
        extra: _Headers = (), trace: TraceContext | None = None,
    ) -> None:
        """Answer a request that never reached admission, with its one terminal record."""
        ctx = self.ctx
        conn.rid = rid
        wall = ctx.wall()
        record = journal.TerminalRecord(
            ts=wall, rid=rid, client_rid=client_rid, client=client, route=route,
            model=None if accepted is None else accepted.requested_model or ctx.model,
            stream=False if accepted is None else accepted.stream,
            mode=ctx.mode, terminal=terminal, status=exc.status,
            error=error_record(exc), legs=(), usage=None, received=wall, duration_ms=0.0,
            ttft_ms=None, stripped=() if accepted is None else accepted.stripped,
            trace_id=None if trace is None else trace.trace_id,
            traceparent=None if trace is None else trace.traceparent,
        )
        ctx.write_terminal(record)
        if retry_after:
            extra += ((b"retry-after", self.retry_after),)
        if conn.codec.in_response or conn.closed:
            return
        self.respond_plain(conn, rid, exc.status, exc.body(), extra=extra)

    def _journal_refused(self, rid: str, route: Route, terminal: Terminal, error: NarwhalError) -> None:
        """The terminal record of a completion request refused before it was read whole."""
        ctx = self.ctx
        wall = ctx.wall()
        ctx.write_terminal(journal.TerminalRecord(
            ts=wall, rid=rid, client_rid=None, client=None, route=route, model=None,
            stream=False, mode=ctx.mode, terminal=terminal, status=error.status,
            error=error_record(error), legs=(), usage=None, received=wall,
            duration_ms=0.0, ttft_ms=None, stripped=(),
        ))

    # ---------------------------------------------------------------- writing

    def send(self, conn: Conn, data: bytes) -> None:
        """Bytes for the client."""
        if data and not conn.closed:
            self.ctx.out.append(Transmit(conn.handle, data))

    def end_response(self, conn: Conn, data: bytes) -> None:
        """Send the last bytes of a response; close, or wait for the next request."""
        self.send(conn, data)
        if conn.codec.must_close or (self.ctx.draining and not conn.codec.has_partial_request):
            self.close_client(conn)
        else:
            conn.rid = None
            conn.reading = conn.body_phase = False
            self.wait_for_request(conn, self.ctx.config.ingress.keepalive_timeout_s)
            self.pump.append(conn)

    def close_client(self, conn: Conn) -> None:
        """Close the connection (the adapter closes its socket)."""
        if not conn.closed:
            conn.closed = True
            self.count_buffered(conn)
            if conn.timer is not None:
                conn.timer.cancel()
                conn.timer = None
            self.conns.pop(conn.handle, None)
            self.ctx.out.append(CloseClient(conn.handle))

    def closing(self, conn: Conn) -> _Headers:
        """``connection: close`` while draining, unless the client already sent its next request."""
        # That one gets its own answer (503 shutting_down) and record first.
        return (_CLOSE,) if self.ctx.draining and not conn.codec.has_partial_request else ()

    def _error_headers(self, rid: str | None) -> _Headers:
        headers: _Headers = (JSON_HEADER,)
        if rid is not None:
            headers += ((b"x-request-id", rid.encode()),)
        return headers

    def respond_plain(self, conn: Conn, rid: str, status: int, body: bytes, *, extra: _Headers = ()) -> None:
        """A whole JSON answer that ends no completion request's lifecycle."""
        self.end_response(conn, conn.codec.send_response(status, (
            JSON_HEADER, (b"x-request-id", rid.encode()), *extra, *self.closing(conn),
        ), body))
        if conn.rid == rid:
            conn.rid = None

    def send_internal_error(self, conn: Conn, rid: str | None) -> None:
        """500 ``internal_error``, if a response can still begin."""
        try:
            self.send(conn, conn.codec.send_error_response(500, self._error_headers(rid), error_body(
                "Internal router error.", "internal_error", "server_error")))
        except Exception:  # noqa: BLE001 - a response had begun: closing is all that is left
            pass


def error_body(message: str, code: str, type: str = "invalid_request_error") -> bytes:
    """An OpenAI-shaped error body."""
    return wire.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})
