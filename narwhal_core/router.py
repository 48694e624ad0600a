# cython: annotation_typing=True
# (Compiled, the parameters annotated with a class that router.pxd declares are typed: see setup.py.)
"""The router: fleet-wide state driven by events, answering with commands.

An adapter owns sockets, tasks and the clock; the :class:`Router` owns every
decision. The adapter calls :meth:`Router.receive` with an event and the
current time, then drains :meth:`Router.next_output` and executes each
command in order; it re-arms its one timer at :meth:`Router.get_deadline`
and calls :meth:`Router.handle_deadline` when it fires. Nothing here does
I/O, reads a clock or draws a random number.

Client connections and engine legs are HTTP/1.1 codec objects held here, so
adapters move bytes only. Each completion request walks the table in
:mod:`narwhal_core.lifecycle`.
"""

from __future__ import annotations

import math
import zlib
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Final

import attrs

from . import journal, wire
from .auth import Authenticator
from .config import Config, EngineAddress, is_ip_address
from .contract import CHAT, COMPLETIONS, AcceptedRequest, Route, check_request
from .errors import AuthError, ContractError, NarwhalError, RemoteProtocolError, TransitionError
from .events import (
    AuthenticatorChanged,
    CancelLeg,
    ClientConnected,
    ClientData,
    ClientGone,
    ClientStalled,
    CloseClient,
    Command,
    ControlDone,
    EngineResolved,
    Event,
    FinishLeg,
    JournalHealth,
    LegData,
    LegFailed,
    Log,
    ShutdownComplete,
    ShutdownRequested,
    StartControl,
    StartLeg,
    Transmit,
    WriteJournal,
)
from .fleet import Admission, EngineState, Fleet
from .http1 import (
    NEED_DATA,
    BodyData,
    Codec,
    ConnectionClosed,
    ContinueExpected,
    EngineCodec,
    HttpRequest,
    ResponseEnd,
    ResponseHead,
    ServerCodec,
)
from .http1_fast import FAST_CODEC
from .ids import DECODE, PREFILL, Phase, backend_id, sanitize_client_rid
from .journal import ErrorRecord, LegOutcome, Terminal
from .lifecycle import TRANSITIONS, Input, State
from .planning import (
    KvHandoff,
    PrefillAnswerError,
    SseRelay,
    check_prefill_answer,
    decode_body,
    engine_error,
    merge_answers,
    normalise_answer,
    prefill_body,
    release_body,
    release_said,
    release_unconfirmed,
)
from .stats import Stats
from .timers import Timer, Timers

__all__ = ["Router", "RouterStatistics"]

_JSON: Final = (b"content-type", b"application/json")
_SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
)
_CLOSE: Final = (b"connection", b"close")
_COMPLETION_ROUTES: Final[dict[str, Route]] = {COMPLETIONS: COMPLETIONS, CHAT: CHAT}
_GET_ROUTES: Final = frozenset({"/v1/models", "/health", "/ready", "/metrics"})
_CLIENT_GONE_STATUS: Final = 499
_REDACTED: Final = b"[redacted]"
#: A KV record's ``error`` when the abort endpoint found nothing to free.
NOTHING_HELD: Final = (
    "the engine held no KV for this owner any more: pulled or freed by the decode engine, or its lease expired"
)
#: A decode leg (or a release carried by a decode request) starts only within
#: this share of ``engine.kv_lease_s`` after the prefill's answer; the rest
#: covers its way to the decode engine's scheduler and, on vLLM with KV
#: leases, the decode engine's first lease renewal, sent every sixth of the
#: lease (docs/operate.md, "KV leases").
_LEASE_START_SHARE: Final = 2.0 / 3.0
#: A KV record's ``error`` when its lease ran short before a decode request could carry it.
LEASE_SHORT: Final = "its lease was running short before a decode request could carry it"
#: Failures that mean a control request never reached the engine (nothing was sent).
_NOT_SENT: Final = ("connection refused", "DNS failure", "connection failed", "connect timeout")

# Why a leg failed -> (status, code) once retries are exhausted, per phase.
_GIVE_UP: Final[dict[str, tuple[int, str]]] = {
    "timeout": (504, "engine_timeout"),
    "connect_failed": (503, "engine_unavailable"),
    "connect_timeout": (503, "engine_unavailable"),
    "local_error": (503, "router_resources_exhausted"),
}
# An engine's 4xx that is not a verdict on the client's request: a timeout or
# overload (another engine may take it), a credential, route or model name of
# Narwhal's own. These fail the leg like a 5xx; any other 4xx is the client's
# mistake (see Router._refused).
_NOT_THE_CLIENTS: Final = frozenset({401, 403, 404, 408, 429})
# Leg outcomes that say nothing about the engine's health.
_NO_VERDICT: Final = frozenset({"cancelled", "local_error"})


@attrs.frozen(kw_only=True)
class RouterStatistics:
    """A snapshot of the router's live counters (like ``trio``'s ``statistics()``)."""

    #: Open client connections.
    connections: int
    #: Completion requests not yet terminal (queued, running or releasing KV).
    requests: int
    #: Requests holding an admission slot.
    inflight: int
    #: Requests waiting in the admission queue.
    queued: int
    #: Engine legs running.
    legs: int
    #: Control requests in flight (probes, KV releases).
    controls: int
    #: Outstanding legs per engine URL and phase.
    engine_outstanding: dict[tuple[str, str], int]
    #: Health per engine URL and phase.
    engine_healthy: dict[tuple[str, str], bool]
    #: Whether shutdown has begun.
    draining: bool
    #: Whether ``/ready`` would answer 200.
    ready: bool
    #: Bytes of unfinished requests held across client connections.
    buffered_bytes: int = 0
    #: Every engine's first health probe (sent at start) has finished.
    engines_probed: bool = True


# The per-request state below is plain classes, not attrs ones: compiled,
# they are extension types declared in ``router.pxd`` (keep both in step;
# ``tests/core/test_core_builds.py`` compares them), so that the router's
# methods read and write their fields directly.


class _Conn:
    __slots__ = (
        "handle", "codec", "peer_host", "rid", "read_deadline", "timer", "armed", "closed", "reading",
        "body_phase", "buffered", "stalled",
    )

    def __init__(self, handle: Hashable, codec: ServerCodec, peer_host: str) -> None:
        self.handle = handle
        self.codec = codec
        self.peer_host = peer_host
        self.rid: str | None = None
        #: When the connection gives up waiting for the client (lazy timer).
        self.read_deadline = 0.0
        self.timer: Timer | None = None
        self.armed = 0.0
        self.closed = False
        #: Bytes of a next request have arrived.
        self.reading = False
        #: Its head is parsed: the body timeout now applies.
        self.body_phase = False
        #: Bytes of unfinished requests its codec holds, as last counted.
        self.buffered = 0
        #: The adapter holds back the legs feeding it: it is not reading (:class:`ClientStalled`).
        self.stalled = False


class _Kv:
    __slots__ = ("handoff", "engine", "leg", "outcome", "method", "error", "release_id", "start_by")

    def __init__(self, handoff: KvHandoff, engine: EngineState, leg: str) -> None:
        self.handoff = handoff
        self.engine = engine
        self.leg = leg
        self.outcome: str | None = None
        self.method: str | None = None
        self.error: str | None = None
        self.release_id: str | None = None
        #: No decode request (leg or release) carries this KV from then on:
        #: its lease may run out before it gets there (see Router._lease_ok).
        self.start_by = math.inf


class _Leg:
    __slots__ = (
        "bid", "phase", "attempt", "engine", "codec", "rid", "started", "data", "deadline", "timer", "armed",
        "status", "body", "outcome", "ended", "kv", "open", "streaming", "got_bytes", "fresh_retry", "orphan",
        "held", "prompt",
    )

    def __init__(
        self, bid: str, phase: Phase, attempt: int, engine: EngineState, codec: EngineCodec, rid: str,
        started: float, data: bytes, deadline: float,
    ) -> None:  # fmt: skip
        self.bid = bid
        self.phase = phase
        self.attempt = attempt
        self.engine = engine
        self.codec = codec
        self.rid = rid
        self.started = started
        self.data = data
        self.deadline = deadline
        self.timer: Timer | None = None
        self.armed = 0.0
        self.status: int | None = None
        self.body: list[bytes] = []
        self.outcome: LegOutcome | None = None
        self.ended: float | None = None
        self.kv: _Kv | None = None
        self.open = True
        self.streaming = False
        self.got_bytes = False
        self.fresh_retry = False
        #: A prefill leg left running after its client went away, so that the KV
        #: it may already hold can be named and released.
        self.orphan = False
        #: Held back by the adapter for a client that is not reading
        #: (:class:`ClientStalled`): its time limit does not run.
        self.held = False
        #: The batch prompt it serves (``None``: a one-prompt request).
        self.prompt: int | None = None


class _Request:
    __slots__ = (
        "rid", "conn", "route", "client", "client_rid", "received", "stream", "accepted", "state", "attempts",
        "failed_on", "leg", "legs", "kv", "pending_releases", "admitted", "answered", "bytes_sent",
        "first_byte", "relay", "retry_phase", "pulled_cached_tokens", "waiting_for_slot", "terminal",
        "status", "error", "usage", "timers", "plain_decode", "prompts", "prompt", "answers", "prompt_base",
    )

    def __init__(
        self, rid: str, conn: _Conn | None, route: Route, client: str, client_rid: str | None,
        received: float, stream: bool, accepted: AcceptedRequest,
    ) -> None:  # fmt: skip
        self.rid = rid
        self.conn = conn
        self.route = route
        self.client = client
        self.client_rid = client_rid
        self.received = received
        self.stream = stream
        self.accepted = accepted
        self.state = State.QUEUED
        self.attempts: dict[str, int] = {PREFILL: 0, DECODE: 0}
        self.failed_on: dict[str, list[EngineState]] = {PREFILL: [], DECODE: []}
        self.leg: _Leg | None = None
        self.legs: list[_Leg] = []
        self.kv: _Kv | None = None
        self.pending_releases = 0
        self.admitted = False
        self.answered = False
        self.bytes_sent = False
        self.first_byte: float | None = None
        self.relay: SseRelay | None = None
        self.retry_phase: Phase = PREFILL
        #: ``cached_tokens`` of the prefill whose KV the decode leg pulled.
        self.pulled_cached_tokens: int | None = None
        self.waiting_for_slot = False
        self.terminal: Terminal | None = None
        self.status: int | None = None
        self.error: ErrorRecord | None = None
        self.usage: dict[str, Any] | None = None
        self.timers: dict[str, Timer] = {}
        #: The last prefill handed off no KV: the decode leg runs as a plain
        #: request (docs/operate.md, "Prefill answers without KV").
        self.plain_decode = False
        #: A batch's prompts (``None``: one prompt), served one after another;
        #: ``prompt`` is the current one's index, ``answers`` the finished
        #: ones' answers (not streamed), ``prompt_base`` the attempts per
        #: phase before the current prompt began (docs/operate.md, "Batch prompts").
        self.prompts: list[Any] | None = accepted.prompts
        self.prompt = 0
        self.answers: list[dict[str, Any]] = []
        self.prompt_base: dict[str, int] = {PREFILL: 0, DECODE: 0}
        if self.prompts is not None:
            accepted.body["prompt"] = self.prompts[0]


class Router:
    """Narwhal's decisions, driven by events; see the module docstring."""

    def __init__(
        self,
        config: Config,
        *,
        rid_source: Callable[[], str],
        authenticator: Authenticator,
        engine_api_key: str | None = None,
        wall_offset: float = 0.0,
        now: float = 0.0,
        codec: Codec = FAST_CODEC,
        render_metrics: Callable[[Router], bytes] | None = None,
    ) -> None:
        self.config: Final = config
        self._rid: Final = rid_source
        self._auth = authenticator
        self._wall_offset = wall_offset
        self._codec: Final = codec
        self._render_metrics = render_metrics
        self._now = now
        self._model: Final = config.model.name
        self._names: Final = config.model_names
        e = config.engine
        self.fleet: Final = Fleet(
            e.prefill_engines,
            e.decode_engines,
            max_inflight_per_engine=e.max_inflight_per_engine,
            unhealthy_after=config.health.unhealthy_after,
            healthy_after=config.health.healthy_after,
            kv_host_allowed=e.kv_host_allowed,
        )
        a = config.admission
        self.admission: Final = Admission(
            max_inflight=a.max_inflight,
            queue_size=a.queue_size,
            per_client_max_inflight=a.per_client_max_inflight,
        )
        self.stats: Final = Stats()
        self._auth_header: tuple[tuple[bytes, bytes], ...] = (
            ((b"authorization", b"Bearer " + engine_api_key.encode("latin-1")),)
            if engine_api_key
            else ()
        )
        #: The engine credential, scrubbed from anything an engine says.
        self._secret: Final = engine_api_key.encode("latin-1") if engine_api_key else None
        self._pd: Final = self.fleet.pd
        self._mode: Final = "pd" if self._pd else "single"
        self._first_phase: Final[Phase] = PREFILL if self._pd else DECODE
        #: The phases a request needs an engine for.
        self._phases: Final[tuple[Phase, ...]] = (PREFILL, DECODE) if self._pd else (DECODE,)
        self._conns: dict[Hashable, _Conn] = {}
        self._requests: dict[str, _Request] = {}
        self._legs: dict[str, _Leg] = {}
        self._controls: dict[str, tuple[str, Any]] = {}
        self._slot_waiters: dict[str, deque[str]] = {PREFILL: deque(), DECODE: deque()}
        self._timers: Final = Timers()
        #: Each engine's next health probe (cancelled when shutdown begins).
        self._probe_timers: dict[EngineState, Timer] = {}
        self._out: deque[Command] = deque()
        #: Connections whose response just finished: serve their next
        #: (pipelined) request once the current event is handled.
        self._pump: list[_Conn] = []
        self._draining = False
        self._shutdown_reported = False
        self._journal_ok = True
        self._journal_problem: str | None = None
        self._probe_seq = 0
        #: Prefill engines already warned about answers without KV (see _no_handoff).
        self._no_kv_warned: set[str] = set()
        #: Bytes of unfinished requests held across client connections, and their bound.
        self._buffered = 0
        self._max_buffered: Final = config.ingress.max_buffered_bytes
        #: Local shortages (out of descriptors...) since the last log line about them, and its time.
        self._shortages = 0
        self._shortage_logged = -math.inf
        self._retry_after: Final = str(a.retry_after_s).encode()
        #: The lifecycle table with its handlers bound once, not looked up per input.
        self._transitions: Final = {
            key: (getattr(self, handler), handler, allowed) for key, (handler, allowed) in TRANSITIONS.items()
        }
        #: What each kind of request timer does when its time comes.
        self._request_timer_actions: Final[dict[str, Callable[[_Request], None]]] = {
            "deadline": self._deadline_passed, "queue": self._queue_wait_over,
            "wake": self._backoff_over, "lease": self._lease_running_short,
        }
        # Every engine is probed at once: /ready waits for answers (docs/operate.md).
        for engine in self.fleet.all():
            self._probe(engine)

    # ------------------------------------------------------------ public API

    def receive(self, event: Event, *, now: float) -> None:
        """Feed one event; then drain :meth:`next_output`."""
        self._now = now
        if isinstance(event, ClientData):
            self._client_data(event.conn, event.data)
        elif isinstance(event, LegData):
            leg = self._legs.get(event.leg)
            if leg is not None:
                self._leg_data(leg, event.data)
        elif isinstance(event, ClientConnected):
            self._client_connected(event)
        elif isinstance(event, ClientGone):
            conn = self._conns.pop(event.conn, None)
            if conn is not None:
                conn.closed = True
                self._count_buffered(conn)
                self._disarm(conn.timer)
                conn.timer = None
                self._client_left(conn)
        elif isinstance(event, ClientStalled):
            conn = self._conns.get(event.conn)
            if conn is not None:
                self._client_stalled(conn, event.stalled)
        elif isinstance(event, LegFailed):
            leg = self._legs.get(event.leg)
            if leg is not None and leg.open:
                if leg.outcome is not None:
                    leg.open = False  # a finished stream's connection broke: nothing is lost
                    self._drop_tail(leg)
                else:
                    self._leg_connection_failed(leg, event)
        elif isinstance(event, ControlDone):
            self._control_done(event)
        elif isinstance(event, ShutdownRequested):
            self._begin_shutdown()
        elif isinstance(event, AuthenticatorChanged):
            self._auth = event.authenticator
            self._log("keys_reloaded")
        elif isinstance(event, EngineResolved):
            self.fleet.resolved(event.engine, event.addresses)
        elif isinstance(event, JournalHealth):
            if event.ok != self._journal_ok:
                self._log("journal_ok" if event.ok else "journal_failed", message=event.message)
            self._journal_ok = event.ok
            self._journal_problem = event.message
        else:
            raise NarwhalError(f"unknown event {event!r}")
        if self._pump:
            self._serve_pipelined()

    def next_output(self) -> Command | None:
        """The next command to execute, or ``None`` when there is none."""
        out = self._out
        return out.popleft() if out else None

    def get_deadline(self) -> float | None:
        """When :meth:`handle_deadline` should next be called, or ``None``."""
        return self._timers.deadline()

    def handle_deadline(self, *, now: float) -> None:
        """Fire every timer due at ``now``."""
        self._now = now
        timers = self._timers
        timer = timers.pop_due(now)
        while timer is not None:
            timer.action(timer.owner)
            timer = timers.pop_due(now)
        if self._pump:
            self._serve_pipelined()

    def _serve_pipelined(self) -> None:
        while self._pump:
            conn = self._pump.pop()
            if conn.rid is None and not conn.closed:
                self._next_request(conn)
                self._count_buffered(conn)

    def statistics(self) -> RouterStatistics:
        """A snapshot of the live counters."""
        return RouterStatistics(
            connections=len(self._conns),
            requests=len(self._requests),
            inflight=self.admission.inflight,
            queued=len(self.admission.queue),
            legs=len(self._legs),
            controls=len(self._controls),
            engine_outstanding={(e.url, e.phase): e.outstanding for e in self.fleet.all()},
            engine_healthy={(e.url, e.phase): e.healthy for e in self.fleet.all()},
            draining=self._draining,
            ready=not self._ready_problems(),
            buffered_bytes=self._buffered,
            engines_probed=self.fleet.all_probed(),
        )

    # --------------------------------------------------------------- timers

    @staticmethod
    def _disarm(timer: Timer | None) -> None:
        if timer is not None:
            timer.cancel()

    def _arm_request(self, req: _Request, kind: str, when: float) -> None:
        self._disarm(req.timers.get(kind))
        req.timers[kind] = self._timers.arm(when, self._request_timer_actions[kind], req)

    def _disarm_request(self, req: _Request, *kinds: str) -> None:
        for kind in kinds or tuple(req.timers):
            self._disarm(req.timers.pop(kind, None))

    def _conn_timer_fired(self, conn: _Conn) -> None:
        conn.timer = None
        if conn.rid is not None:
            pass  # a request runs: its own deadlines apply
        elif conn.read_deadline > self._now:
            self._conn_deadline(conn, conn.read_deadline)
        else:
            self._read_timeout(conn)

    def _leg_timer_fired(self, leg: _Leg) -> None:
        leg.timer = None
        if leg.deadline > self._now:
            self._leg_deadline(leg, leg.deadline)
        elif leg.outcome is not None:
            self._drop_tail(leg)  # a finished stream's body that never ended
        elif not leg.held:  # (held: re-armed when its client catches up)
            self._leg_broke(leg, "timeout")

    def _deadline_passed(self, req: _Request) -> None:
        del req.timers["deadline"]
        self._fire(req, Input.DEADLINE)

    def _queue_wait_over(self, req: _Request) -> None:
        del req.timers["queue"]
        self._fire(req, Input.QUEUE_TIMEOUT)

    def _backoff_over(self, req: _Request) -> None:
        del req.timers["wake"]
        self._fire(req, Input.WAKE)

    def _lease_running_short(self, req: _Request) -> None:
        del req.timers["lease"]
        if req.state is State.DECODE_WAIT:
            self._fire(req, Input.WAKE)  # its KV's lease runs short: _start_leg prefills it again

    def _grace_over(self, _: object) -> None:
        self._abandon_all()
        self._check_shutdown()

    # ----------------------------------------------------- client connections

    def _client_connected(self, event: ClientConnected) -> None:
        i = self.config.ingress
        codec = self._codec.server_connection(
            max_request_line_bytes=i.max_request_line_bytes,
            max_header_bytes=i.max_header_bytes,
            max_headers=i.max_headers,
            max_body_bytes=i.max_body_bytes,
        )
        conn = _Conn(handle=event.conn, codec=codec, peer_host=event.peer_host)
        self._conns[event.conn] = conn
        # While draining too: until the adapter closes its listener, a new
        # client's request gets its answer (503 shutting_down, journalled),
        # not a connection closed unanswered (docs/operate.md).
        conn.reading = True  # a new client must send its request head promptly
        self._wait_for_request(conn, i.header_timeout_s)

    def _wait_for_request(self, conn: _Conn, seconds: float) -> None:
        self._conn_deadline(conn, self._now + seconds)

    def _conn_deadline(self, conn: _Conn, when: float) -> None:
        # Deadlines move without touching the heap; a new entry is pushed only
        # when the deadline comes earlier than the one already armed.
        conn.read_deadline = when
        if conn.timer is None or when < conn.armed:
            self._disarm(conn.timer)
            conn.armed = when
            conn.timer = self._timers.arm(when, self._conn_timer_fired, conn)

    def _leg_deadline(self, leg: _Leg, when: float) -> None:
        leg.deadline = when
        if leg.timer is None or when < leg.armed:
            self._disarm(leg.timer)
            leg.armed = when
            leg.timer = self._timers.arm(when, self._leg_timer_fired, leg)

    def _client_stalled(self, conn: _Conn, stalled: bool) -> None:
        # The adapter holds back the leg feeding a client that is not
        # reading: the engine's silence is then the client's doing, not a
        # stalled engine (which would fail the request and count against a
        # healthy engine). The leg's limit is suspended (a leg started
        # meanwhile starts held); meanwhile the client's send timeout and
        # the request deadline apply. A leg held past its limit gets the
        # whole limit again once the client catches up.
        conn.stalled = stalled
        req = None if conn.rid is None else self._requests.get(conn.rid)
        leg = None if req is None else req.leg
        if leg is None or leg.held == stalled:
            return
        if stalled:
            leg.held = True
        else:
            self._unhold(leg)

    def _unhold(self, leg: _Leg) -> None:
        """The leg's time limit runs again; the whole limit, when it passed while held."""
        leg.held = False
        if leg.deadline <= self._now:
            self._leg_deadline(leg, self._now + self._leg_limit(leg.phase, leg.streaming))

    def _leg_limit(self, phase: Phase, streaming: bool) -> float:
        """How long a leg may go without an answer (or, streaming, between two reads)."""
        e = self.config.engine
        if streaming:
            return e.stream_idle_timeout_s
        return e.prefill_timeout_s if phase == PREFILL else e.decode_timeout_s

    def _read_timeout(self, conn: _Conn) -> None:
        # An idle keep-alive connection just closes; a half-sent request gets
        # 408, and its terminal record when it names a completion route (the
        # rid in its answer must be in the journal: docs/operate.md).
        if conn.reading:
            message = "Timed out reading the request."
            rid = self._rid()
            route = _COMPLETION_ROUTES.get((conn.codec.partial_target or "").partition("?")[0])
            if route is not None:
                self._journal_refused(rid, route, "invalid", NarwhalError(
                    message, status=408, type="invalid_request_error", code="request_timeout"
                ))
            self._send(conn, conn.codec.send_error_response(
                408, self._error_headers(rid), _error_body(message, "request_timeout"),
            ))
        self._close(conn)

    def _journal_refused(self, rid: str, route: Route, terminal: Terminal, error: NarwhalError) -> None:
        """The terminal record of a completion request refused before it was read whole."""
        wall = self._wall()
        self._write_terminal(journal.TerminalRecord(
            ts=wall, rid=rid, client_rid=None, client=None, route=route, model=None,
            stream=False, mode=self._mode, terminal=terminal, status=error.status,
            error=_error_record(error), legs=(), usage=None, received=wall,
            duration_ms=0.0, ttft_ms=None, stripped=(),
        ))

    def _client_data(self, handle: Hashable, data: bytes) -> None:
        conn = self._conns.get(handle)
        if conn is None:
            return
        if not data and conn.rid is not None:
            # The client closed its side while its request runs: it is gone.
            self._conns.pop(handle, None)
            self._close(conn)
            self._client_left(conn)
            return
        conn.codec.receive_data(data)
        if conn.rid is None:
            self._next_request(conn)
        self._count_buffered(conn)

    def _next_request(self, conn: _Conn) -> None:
        i = self.config.ingress
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
                    self._conn_deadline(conn, self._now + i.header_timeout_s)
                if conn.reading and not conn.body_phase and codec.reading_body:
                    # ...and once the head is in, the body timeout.
                    conn.body_phase = True
                    self._conn_deadline(conn, self._now + i.body_timeout_s)
                return
            if isinstance(event, HttpRequest):
                self._on_request(conn, event)
            elif isinstance(event, ContinueExpected):
                self._on_continue(conn, event)
            elif isinstance(event, ConnectionClosed):
                self._close(conn)
                return
            else:  # PAUSED cannot happen while no request runs
                return

    def _count_buffered(self, conn: _Conn) -> None:
        """Recount what ``conn``'s codec holds; past ``ingress.max_buffered_bytes``, refuse it."""
        held = 0 if conn.closed else conn.codec.buffered_bytes
        self._buffered += held - conn.buffered
        conn.buffered = held
        if held and conn.rid is None and not conn.closed and self._buffered > self._max_buffered:
            self._over_budget(conn)

    def _over_budget(self, conn: _Conn) -> None:
        # The connection whose unfinished request pushed the total past the
        # bound gets 503 and is closed: memory stays bounded whatever the
        # number of slow uploads. A completion request whose head is parsed
        # is journalled, as a 413 is.
        message = "Narwhal holds too many unfinished requests; retry later."
        error = NarwhalError(message, status=503, code="overloaded")
        rid = self._rid()
        route = _COMPLETION_ROUTES.get((conn.codec.partial_target or "").partition("?")[0])
        if route is not None:
            conn.rid = rid
            self._journal_refused(rid, route, "rejected", error)
        self._send(conn, conn.codec.send_error_response(
            503, (*self._error_headers(rid), (b"retry-after", self._retry_after)), _error_body(message, "overloaded")
        ))
        self._close(conn)

    def _bad_request(self, conn: _Conn, exc: RemoteProtocolError) -> None:
        if exc.reason != "dropped":
            message = {
                413: "Request body too large.", 431: "Request header fields too large.",
                505: "HTTP version not supported; use HTTP/1.1.",
            }.get(exc.status, "Malformed HTTP request.")
            code = {413: "body_too_large", 431: "headers_too_large", 505: "http_version_not_supported"}.get(
                exc.status, "bad_http_request"
            )
            rid = self._rid()
            route = _COMPLETION_ROUTES.get((exc.target or "").partition("?")[0])
            if route is not None:
                # Its request line named a completion route: journalled (docs/operate.md).
                conn.rid = rid
                error = NarwhalError(message, status=exc.status, type="invalid_request_error", code=code)
                self._journal_refused(rid, route, "invalid", error)
            self._send(conn, conn.codec.send_error_response(
                exc.status, self._error_headers(rid), _error_body(message, code)
            ))
        self._close(conn)

    def _on_continue(self, conn: _Conn, head: ContinueExpected) -> None:
        path = head.target.partition("?")[0]
        route = _COMPLETION_ROUTES.get(path)
        if route is not None and head.method == "POST":
            try:
                self._auth.authenticate(head.headers, conn.peer_host)
            except AuthError as exc:
                rid = self._rid()
                self._denied(conn, rid, route, sanitize_client_rid(head.header(b"x-request-id")), exc)
                return
        self._send(conn, conn.codec.send_continue())

    def _on_request(self, conn: _Conn, request: HttpRequest) -> None:
        rid = self._rid()
        conn.rid = rid
        conn.reading = conn.body_phase = False
        path = request.target.partition("?")[0]
        route = _COMPLETION_ROUTES.get(path)
        if route is not None:
            if request.method == "POST":
                self._on_completion(conn, rid, route, request)
            else:
                # A completion route: journalled like every request to it (SPEC §5).
                error = NarwhalError(
                    f"Method {request.method} is not allowed on {path}; use POST.",
                    status=405, type="invalid_request_error", code="method_not_allowed",
                )
                self._refuse(conn, rid, route, sanitize_client_rid(request.header(b"x-request-id")),
                             None, "invalid", error, extra=((b"allow", b"POST"),))
            return
        if path in _GET_ROUTES:
            if request.method not in ("GET", "HEAD"):
                self._respond_plain(conn, rid, 405, _error_body(
                    f"Method {request.method} is not allowed on {path}; use GET.", "method_not_allowed"
                ), extra=((b"allow", b"GET, HEAD"),))
            elif path == "/health":
                self._respond_plain(conn, rid, 200, b'{"status":"ok"}')
            elif path == "/ready":
                problems = self._ready_problems()
                body = wire.dumps({"ready": not problems, "problems": problems})
                self._respond_plain(conn, rid, 503 if problems else 200, body)
            elif path == "/metrics":
                self._metrics(conn, rid)
            else:
                self._models(conn, rid, request)
            return
        shown = path if len(path) <= 200 else path[:200] + "..."
        self._respond_plain(conn, rid, 404, _error_body(
            f"Unknown route {shown}.", "not_found"
        ))

    def _metrics(self, conn: _Conn, rid: str) -> None:
        if self._render_metrics is None:
            self._respond_plain(conn, rid, 503, _error_body("Metrics are not available.", "no_metrics"))
            return
        body = self._render_metrics(self)
        self._finish(conn, conn.codec.send_response(200, (
            (b"content-type", b"text/plain; version=0.0.4; charset=utf-8"),
            (b"x-request-id", rid.encode()),
            *self._closing(conn),
        ), body))

    def _models(self, conn: _Conn, rid: str, request: HttpRequest) -> None:
        try:
            self._auth.authenticate(request.headers, conn.peer_host)
        except AuthError as exc:
            self._respond_plain(conn, rid, 401, exc.body())
            return
        names = [self._model, *self.config.model.aliases]
        body = wire.dumps({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "narwhal", "root": self._model}
            for n in names
        ]})
        self._respond_plain(conn, rid, 200, body)

    def _ready_problems(self) -> list[str]:
        problems = []
        if self._draining:
            problems.append("shutting down")
        if not self._journal_ok:
            problems.append(f"journal: {self._journal_problem or 'write failed'}")
        for phase in self._phases:
            if not self.fleet.has_healthy(phase):
                problems.append(f"no healthy {phase} engine")
            elif not self.fleet.has_answered(phase):
                # Never reached yet (a typo'd host looks healthy until its probes fail).
                problems.append(f"no {phase} engine has answered yet")
        return problems

    # ----------------------------------------------------- completion ingress

    def _on_completion(self, conn: _Conn, rid: str, route: Route, request: HttpRequest) -> None:
        client_rid = sanitize_client_rid(request.header(b"x-request-id"))
        try:
            client = self._auth.authenticate(request.headers, conn.peer_host)
        except AuthError as exc:
            self._denied(conn, rid, route, client_rid, exc)
            return
        try:
            accepted = check_request(
                route, request.body, self._names, self._model, max_prompts=self.config.ingress.max_batch_prompts
            )
        except ContractError as exc:
            self._refuse(conn, rid, route, client_rid, client, "invalid", exc)
            return
        if self._draining:
            self._refuse(conn, rid, route, client_rid, client, "rejected", NarwhalError(
                "Narwhal is shutting down; retry on another instance.", status=503, code="shutting_down"
            ), retry_after=True, accepted=accepted)
            return
        for phase in self._phases:
            if not self.fleet.has_healthy(phase):
                self._refuse(conn, rid, route, client_rid, client, "rejected", NarwhalError(
                    f"No healthy {phase} engine is available.", status=503, code="engine_unavailable"
                ), retry_after=True, accepted=accepted)
                return
        decision = self.admission.offer(rid, client)
        if decision == "client_limit":
            self._refuse(conn, rid, route, client_rid, client, "rejected", NarwhalError(
                "Too many requests in flight for this client.", status=429, type="rate_limit_error",
                code="rate_limited",
            ), retry_after=True, accepted=accepted)
            return
        if decision == "fleet_full":
            self._refuse(conn, rid, route, client_rid, client, "rejected", NarwhalError(
                "The fleet is at capacity; retry later.", status=503, code="overloaded"
            ), retry_after=True, accepted=accepted)
            return
        req = _Request(
            rid=rid, conn=conn, route=route, client=client, client_rid=client_rid,
            received=self._now, stream=accepted.stream, accepted=accepted,
        )
        self._requests[rid] = req
        a = self.config.admission
        self._arm_request(req, "deadline", self._now + a.request_timeout_s)
        if decision == "admitted":
            self._fire(req, Input.ADMIT)
        else:
            self._arm_request(req, "queue", self._now + a.queue_timeout_s)

    def _denied(self, conn: _Conn, rid: str, route: Route, client_rid: str | None, exc: AuthError) -> None:
        self._refuse(conn, rid, route, client_rid, None, "denied", exc)

    def _refuse(
        self,
        conn: _Conn,
        rid: str,
        route: Route,
        client_rid: str | None,
        client: str | None,
        terminal: Terminal,
        exc: NarwhalError,
        *,
        retry_after: bool = False,
        accepted: AcceptedRequest | None = None,
        extra: tuple[tuple[bytes, bytes], ...] = (),
    ) -> None:
        """Answer a request that never reached admission, with its one terminal record."""
        conn.rid = rid
        wall = self._wall()
        record = journal.TerminalRecord(
            ts=wall, rid=rid, client_rid=client_rid, client=client, route=route,
            model=None if accepted is None else accepted.requested_model or self._model,
            stream=False if accepted is None else accepted.stream,
            mode=self._mode, terminal=terminal, status=exc.status,
            error=_error_record(exc), legs=(), usage=None, received=wall, duration_ms=0.0,
            ttft_ms=None, stripped=() if accepted is None else accepted.stripped,
        )
        self._write_terminal(record)
        if retry_after:
            extra += ((b"retry-after", self._retry_after),)
        if conn.codec.in_response or conn.closed:
            return
        self._respond_plain(conn, rid, exc.status, exc.body(), extra=extra)

    # ----------------------------------------------------------- lifecycle

    def _fire(self, req: _Request, event: Input, **info: Any) -> None:
        row = self._transitions.get((req.state, event))
        if row is None:
            state = req.state
            if state is State.DONE:
                return
            self._force_end(req, f"no transition for {state.value} on {event.value}")
            raise TransitionError(f"request {req.rid}: no transition for state {state.value} on input {event.value}")
        method, handler, allowed = row
        new_state: State = method(req, **info)
        if new_state not in allowed:
            self._force_end(req, f"{handler} left {req.state.value} for {new_state.value} on {event.value}")
            raise TransitionError(
                f"request {req.rid}: {handler} moved {req.state.value} to {new_state.value} on {event.value}"
            )
        if req.state is not State.DONE:
            req.state = new_state
        if new_state is State.RELEASING and req.pending_releases == 0:
            self._fire(req, Input.RELEASED)

    def _force_end(self, req: _Request, why: str) -> None:
        self._log("internal_error", rid=req.rid, problem=why)
        self._fail_closed(req)

    def _fail_closed(self, req: _Request) -> None:
        # Fail closed: stop everything the request holds, answer its client
        # 500 internal_error if it has no answer yet (a stream gets its error
        # event), free its slot and journal it. Its unpulled KV is left to the
        # engine's lease: the request's state cannot be trusted to release it.
        if req.leg is not None:
            self._stop_leg(req.leg, "cancelled")
        self._stop_orphans(req)
        if not req.answered:
            if req.state is State.QUEUED:
                self.admission.leave_queue(req.rid, req.client)
            self._end(req, "failed", NarwhalError("Internal router error.", status=500, code="internal_error"),
                      sent=req.bytes_sent)
            conn = self._live_conn(req)
            if conn is not None:
                try:
                    self._send_error(req)
                except Exception:  # noqa: BLE001 - the connection's state is what failed
                    if not req.bytes_sent:
                        self._send_internal_error(conn, req.rid)
                self._close(conn)  # what it was in the middle of cannot be trusted either
            self._after_answer(req)
        elif req.terminal is None:
            self._end(req, "failed", NarwhalError("Internal router error.", status=500, code="internal_error"))
        req.pending_releases = 0
        req.state = State.DONE
        self._write_request_terminal(req)

    def contain_failure(self, event: Event | None, problem: str, trace: str | None = None) -> None:
        """The adapter caught ``problem``, raised by :meth:`receive` on ``event`` (``None``: :meth:`handle_deadline`).

        The request the event concerns ends ``failed`` with 500
        ``internal_error`` and its terminal record; a connection with no
        request yet is answered 500 and closed. One ``internal_error`` log
        line names the request and carries ``trace``. Everything else goes
        on; drain :meth:`next_output` as after any event.
        """
        req = self._request_of(event)
        fields: dict[str, Any] = {
            "rid": None if req is None else req.rid, "problem": problem,
            "during": "deadline" if event is None else type(event).__name__,
        }
        if trace:
            fields["traceback"] = trace
        self._log("internal_error", **fields)
        if req is not None:
            self._fail_closed(req)
            return
        handle = getattr(event, "conn", None)
        conn = self._conns.get(handle) if handle is not None else None
        if conn is not None and not conn.closed:
            self._send_internal_error(conn, None)
            self._close(conn)

    def _send_internal_error(self, conn: _Conn, rid: str | None) -> None:
        try:
            self._send(conn, conn.codec.send_error_response(500, self._error_headers(rid), _error_body(
                "Internal router error.", "internal_error", "server_error")))
        except Exception:  # noqa: BLE001 - a response had begun: closing is all that is left
            pass

    def _request_of(self, event: Event | None) -> _Request | None:
        """The unfinished request ``event`` is about, if any (a client's, or one of its legs')."""
        if isinstance(event, (ClientData, ClientGone, ClientStalled, ClientConnected)):
            handle = event.conn
            conn = self._conns.get(handle)
            if conn is not None and conn.rid is not None:
                return self._requests.get(conn.rid)
            for req in self._requests.values():
                if req.conn is not None and req.conn.handle == handle:
                    return req
        elif isinstance(event, (LegData, LegFailed)):
            leg = self._legs.get(event.leg)
            if leg is not None:
                return self._requests.get(leg.rid)
            for req in self._requests.values():
                if any(leg.bid == event.leg for leg in req.legs):
                    return req
        elif isinstance(event, ControlDone):
            control = self._controls.get(event.key)
            if control is not None and control[0] == "release":
                return self._requests.get(control[1][0].rid)
        return None

    # handlers: each returns the request's next state

    def _begin(self, req: _Request) -> State:
        req.admitted = True
        self.stats.journal_records["progress"] += 1
        self._out.append(WriteJournal(journal.progress_line(
            self._wall(), req.rid, "admitted", req.route, req.client, req.client_rid, self._mode, req.stream,
        ), False))
        return self._start_leg(req, self._first_phase)

    def _resume(self, req: _Request) -> State:
        return self._start_leg(req, req.retry_phase)

    def _prefill_ok(self, req: _Request) -> State:
        kv = req.kv
        if kv is not None:
            # Its lease runs from the prefill's answer (docs/operate.md, "KV leases").
            kv.start_by = self._now + self.config.engine.kv_lease_s * _LEASE_START_SHARE
        return self._start_leg(req, DECODE)

    def _first_bytes(self, req: _Request) -> State:
        return State.STREAMING

    def _decode_ok(self, req: _Request, answer: dict[str, Any] | None = None) -> State:
        kv = req.kv
        if kv is not None:
            kv.outcome, kv.method = "pulled", "decode"
            req.kv = None
        prompts = req.prompts
        if prompts is not None:
            if req.stream:
                assert req.relay is not None
                if req.prompt + 1 < len(prompts) and req.relay.error is None:
                    req.usage = req.relay.usage
                    return self._next_prompt(req)
            else:
                assert answer is not None
                req.answers.append(answer)
                if req.prompt + 1 < len(prompts):
                    return self._next_prompt(req)
                answer = merge_answers(req.answers)
                req.answers = []
        conn = self._live_conn(req)
        if req.stream:
            relay = req.relay
            assert relay is not None
            req.usage = relay.usage
            if relay.error is not None:
                err = relay.error
                error = NarwhalError(
                    str(err.get("message", "engine error"))[:1000], status=200,
                    type=str(err.get("type", "server_error")), code="engine_error",
                )
                self._end(req, "failed", error, leg=req.legs[-1], sent=True)
            else:
                self._end(req, "completed", None, status=200)
            if conn is not None:
                self._finish(conn, conn.codec.send_stream_end())
        else:
            assert answer is not None
            req.usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else None
            body = wire.dumps(answer)
            self._end(req, "completed", None, status=200)
            if conn is not None:
                req.first_byte = self._now
                self._finish(conn, conn.codec.send_response(200, (
                    _JSON, (b"x-request-id", req.rid.encode()), *self._closing(conn),
                ), body))
        return self._after_answer(req)

    def _next_prompt(self, req: _Request) -> State:
        """The current batch prompt is answered: the next one gets its own legs (docs/operate.md, "Batch prompts")."""
        assert req.prompts is not None
        req.prompt += 1
        req.accepted.body["prompt"] = req.prompts[req.prompt]
        req.prompt_base = dict(req.attempts)
        req.plain_decode = False
        req.pulled_cached_tokens = None
        return self._start_leg(req, self._first_phase)

    def _refused(self, req: _Request, error: NarwhalError, leg: _Leg) -> State:
        # The engine judged the request itself bad (a bad temperature, a
        # prompt longer than the context...): the client's mistake, answered
        # 400 with the engine's message and param, journalled `invalid` with
        # the leg and engine; never retried elsewhere (docs/operate.md).
        self._stop(req)  # releases the prefilled KV no decode leg pulled
        self._end(req, "invalid", NarwhalError(
            error.message, status=400, type="invalid_request_error", param=error.param, code=error.code,
        ), leg=leg, sent=req.bytes_sent)  # (sent: a batch's earlier prompts streamed already)
        self._send_error(req)
        return self._after_answer(req)

    def _leg_failed(self, req: _Request, reason: str, leg: _Leg, error: NarwhalError | None = None) -> State:
        phase = leg.phase
        if phase == DECODE:
            self._release(req)  # the decode leg failed before the handoff
        retry_phase: Phase = PREFILL if self._pd else DECODE
        if phase == PREFILL:
            retry_phase = PREFILL
        r = self.config.retry
        # (Attempts count per prompt of a batch: prompt_base is what earlier prompts used.)
        if req.attempts[retry_phase] - req.prompt_base[retry_phase] < r.max_attempts and self.fleet.has_healthy(
            retry_phase
        ) and (
            retry_phase == DECODE or self.fleet.has_healthy(DECODE)
        ):
            req.retry_phase = retry_phase
            attempt = req.attempts[retry_phase]
            self._arm_request(req, "wake", self._now + _backoff(leg.bid, attempt, r.backoff_base_s, r.backoff_max_s))
            return State.PREFILL_WAIT if retry_phase == PREFILL else State.DECODE_WAIT
        status, code = _GIVE_UP.get(reason, (502, f"{phase}_failed"))
        if error is not None and reason == "bad_kv":
            message = f"The prefill engine's answer was unusable: {error.message}"
        elif reason == "timeout":
            message = f"The {phase} engine did not answer in time."
        elif reason in ("connect_failed", "connect_timeout"):
            message = f"Could not connect to a {phase} engine."
        elif reason == "local_error":
            message = (
                f"Narwhal could not open a connection to a {phase} engine: it is out of file "
                "descriptors, memory or local ports."
            )
        else:
            message = (
                f"The {phase} leg failed ({reason}) after {req.attempts[phase] - req.prompt_base[phase]} attempt(s)."
            )
        return self._fail(req, NarwhalError(message, status=status, code=code), leg=leg)

    def _stream_failed(self, req: _Request, reason: str, leg: _Leg, error: NarwhalError | None = None) -> State:
        code = {"timeout": "stream_idle_timeout", "dropped": "engine_disconnected"}.get(reason, "bad_engine_response")
        status = 504 if reason == "timeout" else 502
        message = {
            "timeout": "The decode engine stopped sending the stream.",
            "dropped": "The decode engine closed the connection mid-stream.",
        }.get(reason, "The decode engine sent an invalid stream.")
        return self._fail(req, NarwhalError(message, status=status, code=code), leg=leg)

    def _cancel(self, req: _Request) -> State:
        if req.state is State.QUEUED:
            self.admission.leave_queue(req.rid, req.client)
        leg = req.leg
        if (
            leg is not None and leg.phase == PREFILL and leg.open and leg.got_bytes
            and self.config.engine.kv_release != "lease"
        ):
            # The prefill's answer is already arriving: the engine has done the
            # work and holds the KV, so cancelling saves nothing and would strand
            # the KV until its lease. Read the answer (its timeout bounds the
            # wait) and release the KV it names. Otherwise the leg is cancelled.
            leg.orphan = True
            req.leg = None
            req.pending_releases += 1
            if leg.held:
                self._unhold(leg)  # its client is gone: nothing holds it back now
        self._stop(req)
        req.answered = True
        self._end(req, "cancelled", NarwhalError(
            "The client closed the connection.", status=_CLIENT_GONE_STATUS, type="client_error",
            code="client_disconnected",
        ), status=_CLIENT_GONE_STATUS)
        return self._after_answer(req)

    def _expire(self, req: _Request) -> State:
        if req.state is State.QUEUED:
            self.admission.leave_queue(req.rid, req.client)
        leg = req.leg
        self._stop(req)
        return self._fail(req, NarwhalError(
            "The request did not finish within the router's deadline.", status=504, code="request_timeout"
        ), leg=leg)

    def _abandon(self, req: _Request) -> State:
        if req.state is State.QUEUED:
            self.admission.leave_queue(req.rid, req.client)
        self._stop(req)
        return self._fail(req, NarwhalError(
            "Narwhal shut down before the request finished.", status=503, code="shutting_down"
        ))

    def _queue_timeout(self, req: _Request) -> State:
        self.admission.leave_queue(req.rid, req.client)
        self._end(req, "rejected", NarwhalError(
            "The fleet is at capacity; the request waited too long for a slot.", status=503, code="overloaded"
        ))
        self._send_error(req, retry_after=True)
        return self._after_answer(req)

    def _released(self, req: _Request) -> State:
        self._write_request_terminal(req)
        return State.DONE

    def _abandon_releases(self, req: _Request) -> State:
        self._stop_orphans(req)
        for leg in req.legs:
            kv = leg.kv
            if kv is not None and kv.outcome is None:
                if kv.method is not None and kv.method != "lease":
                    kv.outcome, kv.error = "release_sent", "shutdown before the release was confirmed"
                else:
                    kv.outcome, kv.method, kv.error = "held_until_lease", "lease", "shutdown before release"
        req.pending_releases = 0
        self._write_request_terminal(req)
        return State.DONE

    def _ignore(self, req: _Request) -> State:
        return req.state

    # ------------------------------------------------------ ending requests

    def _stop(self, req: _Request) -> None:
        """Stop whatever the request is doing and release its unpulled KV."""
        if req.leg is not None:
            self._stop_leg(req.leg, "cancelled")
        self._release(req)

    def _fail(self, req: _Request, error: NarwhalError, *, leg: _Leg | None = None) -> State:
        self._stop(req)
        self._end(req, "failed", error, leg=leg, sent=req.bytes_sent)
        self._send_error(req, retry_after=error.status == 503)
        return self._after_answer(req)

    def _end(
        self,
        req: _Request,
        terminal: Terminal,
        error: NarwhalError | None,
        *,
        status: int | None = None,
        leg: _Leg | None = None,
        sent: bool = False,
    ) -> State:
        """Decide how the request ends (its terminal record is written once KV is settled)."""
        req.terminal = terminal
        if error is not None:
            req.error = _error_record(error, leg)
            req.status = 200 if sent else error.status
        else:
            req.status = status
        return State.RELEASING

    def _send_error(self, req: _Request, *, retry_after: bool = False) -> None:
        conn = self._live_conn(req)
        error = req.error
        if conn is None or error is None:
            return
        body = wire.dumps({"error": {
            "message": error.message, "type": error.type, "param": error.param, "code": error.code,
        }})
        if req.bytes_sent:
            # SPEC §4: a failure after the first byte ends the stream with one error event.
            data = conn.codec.send_stream_data(b"data: " + body + b"\n\n")
            self._send(conn, data)
            self._finish(conn, conn.codec.send_stream_end())
            return
        extra = ((b"retry-after", self._retry_after),) if retry_after else ()
        self._finish(conn, conn.codec.send_response(req.status or 500, (
            _JSON, (b"x-request-id", req.rid.encode()), *extra, *self._closing(conn),
        ), body))

    def _after_answer(self, req: _Request) -> State:
        """The client has its answer (or is gone): free the slot; the record waits for KV."""
        req.answered = True
        req.waiting_for_slot = False
        if req.admitted:
            req.admitted = False
            self.admission.release(req.client)
            self._admit_from_queue()
        req.conn = None
        self._disarm_request(req, "deadline", "queue", "wake", "lease")
        if self._slot_waiters[PREFILL]:
            self._wake_prefills()  # it may have been the last one waiting for a decode engine
        return State.RELEASING

    def _write_request_terminal(self, req: _Request) -> None:
        if req.terminal is None:
            return
        # The record's line and its metrics, straight from the request's
        # state (journal.terminal_line: the TerminalRecord's own shape).
        wall = self._wall()
        offset = self._wall_offset
        now = self._now
        stats = self.stats
        legs = []
        for leg in req.legs:
            kv = leg.kv
            kv_line = kv_counted = None
            if kv is not None:
                if kv.outcome is None:
                    # Never left unsettled in a terminal record.
                    kv.outcome, kv.method = "held_until_lease", "lease"
                method = kv.method or ""
                kv_line = journal.kv_json(
                    kv.outcome, kv.handoff.owner, kv.engine.url, method, kv.error, kv.release_id  # type: ignore[arg-type]
                )
                kv_counted = (kv.outcome, method)
            outcome: LegOutcome = leg.outcome or "cancelled"
            duration = _ms((now if leg.ended is None else leg.ended) - leg.started)
            legs.append(journal.leg_json(
                leg.phase, leg.attempt, leg.bid, leg.engine.url, leg.status, outcome,
                leg.started + offset, duration, kv_line, leg.prompt,
            ))
            stats.observe_leg(leg.phase, outcome, leg.attempt, duration, kv_counted)
        received = req.received + offset
        duration = _ms(wall - received)
        ttft = None if req.first_byte is None else _ms(req.first_byte - req.received)
        stats.observe_request(req.route, req.terminal, req.status, duration, ttft)
        stats.journal_records["terminal"] += 1
        self._out.append(WriteJournal(journal.terminal_line(
            wall, req.rid, req.client_rid, req.client, req.route, req.accepted.requested_model or self._model,
            req.stream, self._mode, req.terminal, req.status, req.error, legs, req.usage, received, duration,
            ttft, req.accepted.stripped,
        ), True))
        del self._requests[req.rid]
        req.state = State.DONE
        self._disarm_request(req)
        self._check_shutdown()

    def _write_terminal(self, record: journal.TerminalRecord) -> None:
        self.stats.observe(record)
        self.stats.journal_records["terminal"] += 1
        self._out.append(WriteJournal(journal.encode(record), True))

    def _admit_from_queue(self) -> None:
        while True:
            rid = self.admission.next_from_queue()
            if rid is None:
                return
            req = self._requests[rid]
            self._disarm_request(req, "queue")
            self._fire(req, Input.ADMIT)

    # ----------------------------------------------------------------- legs

    def _start_leg(self, req: _Request, phase: Phase) -> State:
        if phase == DECODE:
            kv = req.kv
            if kv is not None and self._now >= kv.start_by:
                return self._lease_ran_short(req, kv)  # never decode from KV whose lease may be gone
            engine = self.fleet.pick(phase, req.failed_on[phase])
        elif self._pd and self._decode_backlog():
            engine = None  # prefilled requests waiting for a decode engine go first (docs/operate.md, "KV leases")
        else:
            engine = self.fleet.pick(phase, req.failed_on[phase])
        if engine is None:
            if self.fleet.has_healthy(phase):
                req.waiting_for_slot = True
                req.retry_phase = phase
                self._slot_waiters[phase].append(req.rid)
                if phase == PREFILL:
                    return State.PREFILL_WAIT
                if req.kv is not None:
                    self._arm_request(req, "lease", req.kv.start_by)
                return State.DECODE_WAIT
            return self._fail(req, NarwhalError(
                f"No healthy {phase} engine is available.", status=503, code="engine_unavailable"
            ))
        req.waiting_for_slot = False
        if phase == DECODE and "lease" in req.timers:
            self._disarm_request(req, "lease")
        attempt = req.attempts[phase] + 1
        req.attempts[phase] = attempt
        bid = backend_id(req.rid, phase, attempt)
        if phase == PREFILL:
            body = wire.dumps(prefill_body(req.accepted.body))
        else:
            kv = req.kv
            body = wire.dumps(req.accepted.body if kv is None else decode_body(req.accepted.body, kv.handoff.params))
        timeout = self._leg_limit(phase, False)
        codec = self._codec.engine_connection(
            max_body_bytes=self.config.engine.max_response_bytes
        )
        data = codec.send_request("POST", req.route, self._leg_headers(engine.address, bid), body)
        leg = _Leg(
            bid=bid, phase=phase, attempt=attempt, engine=engine, codec=codec, rid=req.rid,
            started=self._now, data=data, deadline=0.0,
        )
        self._leg_deadline(leg, self._now + timeout)
        if req.conn is not None and req.conn.stalled:
            leg.held = True  # its client is not reading (see _client_stalled)
        self._legs[bid] = leg
        req.leg = leg
        req.legs.append(leg)
        if req.prompts is not None:
            leg.prompt = req.prompt
        self.fleet.leg_started(engine)
        self._out.append(StartLeg(
            bid, engine.address, data, None if req.conn is None else req.conn.handle,
            self.config.engine.connect_timeout_s,
        ))
        return State.PREFILL if phase == PREFILL else State.DECODE

    def _leg_headers(self, engine: EngineAddress, bid: str) -> tuple[tuple[bytes, bytes], ...]:
        return (
            (b"host", engine.authority),
            _JSON,
            (b"x-request-id", bid.encode()),
            *self._auth_header,
        )

    def _leg_data(self, leg: _Leg, data: bytes) -> None:
        if data:
            leg.got_bytes = True  # the engine saw the request: never re-send it
        codec = leg.codec
        codec.receive_data(data)
        if leg.outcome is not None:
            self._read_tail(leg)
            return
        req = self._requests[leg.rid]
        while leg.open:
            try:
                event = codec.next_event()
            except RemoteProtocolError as exc:
                self._leg_broke(leg, "dropped" if exc.reason == "dropped" else "bad_response")
                return
            if event is NEED_DATA:
                return
            kind = type(event)
            if kind is BodyData:
                if leg.streaming:
                    self._relay(req, leg, event.data)  # type: ignore[union-attr]
                    if leg.outcome is not None and leg.open:
                        self._read_tail(leg)  # [DONE] came: what follows is dropped
                        return
                else:
                    leg.body.append(event.data)  # type: ignore[union-attr]
            elif kind is ResponseHead:
                status: int = event.status  # type: ignore[union-attr]
                leg.status = status
                if leg.phase == DECODE and 200 <= status < 300:
                    kv = req.kv
                    if req.stream:
                        leg.streaming = True
                        previous = req.relay
                        req.relay = SseRelay(
                            route=req.route, model=self._model, pd=self._pd and not req.plain_decode,
                            cached_tokens=None if kv is None else kv.handoff.cached_tokens,
                            redact=self._secret,
                        )
                        if req.prompts is not None:
                            # One prompt of a batch: indexes rewritten, one [DONE] at the end.
                            req.relay.batch(
                                req.prompt, req.prompt + 1 == len(req.prompts), req.usage,
                                None if previous is None else previous.response_id,
                            )
                    if kv is not None and not req.stream:
                        # A whole answer's head comes after the generation: the
                        # decode engine had the KV. A stream's head proves nothing
                        # (vLLM sends it before the request reaches its engine):
                        # its KV counts as pulled at the first data event (_relay).
                        self._kv_pulled(req, kv)
            elif kind is ResponseEnd:
                leg.open = False
                self._out.append(FinishLeg(leg.bid, event.reusable))  # type: ignore[union-attr]
                self._leg_answered(req, leg)
                return

    def _relay(self, req: _Request, leg: _Leg, data: bytes) -> None:
        relay = req.relay
        assert relay is not None
        try:
            out = relay.feed(data)
        except NarwhalError:
            if relay.good_before_error:
                self._relay_out(req, relay.good_before_error)
            self._leg_broke(leg, "bad_response")
            return
        # (_leg_limit(phase, True), read directly: this runs once per relayed chunk)
        self._leg_deadline(leg, self._now + self.config.engine.stream_idle_timeout_s)
        kv = req.kv
        if kv is not None and relay.events and relay.error is None:
            # The first data event: the decode engine sampled a token, so it had the KV.
            self._kv_pulled(req, kv)
        if out:
            self._relay_out(req, out)
        if relay.done and leg.outcome is None:
            self._stream_done(req, leg)

    def _kv_pulled(self, req: _Request, kv: _Kv) -> None:
        kv.outcome, kv.method = "pulled", "decode"
        req.pulled_cached_tokens = kv.handoff.cached_tokens
        req.kv = None

    def _note_connector(self, url: str, params: dict[str, Any]) -> None:
        """Record the NIXL connector version a prefill engine's answer shows; warn once about version 1."""
        version = 2 if "remote_request_id" in params else 1
        known = self.stats.kv_connector.get(url)
        self.stats.kv_connector[url] = version
        if version == 1 and known != 1:
            self._log(
                "kv_connector_v1", level="warning", engine=url,
                consequence="its answers carry no remote_request_id (NIXL connector version 1): the decode "
                            "engine asks it to free the blocks by the decode leg's own request ID, which differs "
                            "from the prefill leg's, so every request's KV stays held until the engine's timeout "
                            "(VLLM_NIXL_ABORT_REQUEST_TIMEOUT, 120 s or 480 s)",
                fix="run vLLM 0.14 or later (connector version 2, remote_request_id) on every engine",
            )

    def _stream_done(self, req: _Request, leg: _Leg) -> None:
        """``data: [DONE]`` is relayed: the client's answer is complete.

        Its chunked body ends now and the request is ``completed``, whenever
        the engine's body ends (a client such as the openai SDK closes as
        soon as it reads ``[DONE]``). The leg is done too; its connection is
        still read, what comes is dropped, and it goes back to the pool if
        the body ends cleanly within the stream idle limit, else it is
        closed (:meth:`_read_tail`).
        """
        # The leg's outcome is settled; it stays in self._legs (fed LegData
        # and LegFailed) and counts against its engine until its body ends.
        leg.outcome = "ok"
        leg.ended = self._now
        leg.held = False
        self.fleet.record_success(leg.engine, probe=False)
        if req.leg is leg:
            req.leg = None
        self._leg_deadline(leg, self._now + self.config.engine.stream_idle_timeout_s)
        if req.state is State.STREAMING or req.state is State.DECODE:
            self._fire(req, Input.LEG_OK)

    def _read_tail(self, leg: _Leg) -> None:
        """Read a finished stream's leg to the end of its body, dropping what comes (see :meth:`_stream_done`)."""
        codec = leg.codec
        while leg.open:
            try:
                event = codec.next_event()
            except RemoteProtocolError:
                self._drop_tail(leg)
                return
            if event is NEED_DATA:
                return
            if type(event) is ResponseEnd:
                leg.open = False
                self._out.append(FinishLeg(leg.bid, event.reusable))
                self._tail_ended(leg)
                return

    def _drop_tail(self, leg: _Leg) -> None:
        """Close a finished stream's leg whose body did not end cleanly (no verdict on the engine)."""
        if leg.open:
            leg.open = False
            self._out.append(CancelLeg(leg.bid))
        self._tail_ended(leg)

    def _tail_ended(self, leg: _Leg) -> None:
        if self._legs.pop(leg.bid, None) is None:
            return
        self._disarm(leg.timer)
        leg.timer = None
        self.fleet.leg_ended(leg.engine)
        if self._slot_waiters[leg.phase]:
            self._wake_slot_waiter(leg.phase)

    def _relay_out(self, req: _Request, out: bytes) -> None:
        conn = self._live_conn(req)
        if conn is None:
            return
        if not req.bytes_sent:
            req.bytes_sent = True
            req.first_byte = self._now
            # No "connection: close" here, even while draining: a stream's head
            # goes out long before its end, and a request the client pipelines
            # meanwhile must still get its own answer (503 shutting_down) and
            # record. _finish decides at the end, as for a stream begun before
            # the shutdown.
            self._send(conn, conn.codec.send_stream_start(200, (
                *_SSE_HEADERS, (b"x-request-id", req.rid.encode()),
            )))
            self._fire(req, Input.FIRST_BYTES)
        elif req.state is State.DECODE:
            # A later prompt of a batch streams its first event: from now on
            # its decode leg cannot be retried (docs/operate.md, "Batch prompts").
            self._fire(req, Input.FIRST_BYTES)
        self._send(conn, conn.codec.send_stream_data(out))

    def _leg_answered(self, req: _Request, leg: _Leg) -> None:
        status = leg.status or 0
        body = b"".join(leg.body)
        leg.body = []
        secret = self._secret
        if secret is not None and secret in body:
            # An engine quoting the credential it was sent must not hand it on.
            body = body.replace(secret, _REDACTED)
        if leg.orphan:
            self._orphan_answered(req, leg, status, body)
            return
        if 200 <= status < 300:
            if leg.phase == PREFILL:
                try:
                    handoff = check_prefill_answer(
                        body, leg.bid, self._kv_host_allowed,
                        require_request_id=self.stats.kv_connector.get(leg.engine.url) == 2,
                    )
                except PrefillAnswerError as exc:
                    self._leg_done(leg, "bad_kv", failed=True)
                    self._fire(req, Input.LEG_FAILED, reason="bad_kv", leg=leg, error=exc)
                    return
                if handoff.params is not None:
                    self._note_connector(leg.engine.url, handoff.params)
                self._leg_done(leg, "ok")
                if handoff.params is None:
                    self._no_handoff(req, leg, handoff)
                else:
                    req.plain_decode = False
                    leg.kv = req.kv = _Kv(handoff=handoff, engine=leg.engine, leg=leg.bid)
                self._fire(req, Input.LEG_OK)
            elif leg.streaming:
                relay = req.relay
                assert relay is not None
                if relay.done or (relay.events and relay.error is not None):
                    self._leg_done(leg, "ok")
                    self._fire(req, Input.LEG_OK)
                else:
                    self._leg_done(leg, "bad_response", failed=True)
                    self._fire(req, Input.LEG_FAILED, reason="bad_response", leg=leg)
            else:
                try:
                    answer = wire.loads_answer(body)
                except wire.JsonError:
                    answer = None
                if not isinstance(answer, dict):
                    self._leg_done(leg, "bad_response", failed=True)
                    self._fire(req, Input.LEG_FAILED, reason="bad_response", leg=leg)
                    return
                self._leg_done(leg, "ok")
                normalise_answer(
                    req.route, answer, self._model, pd=self._pd and not req.plain_decode,
                    cached_tokens=req.pulled_cached_tokens,
                )
                self._fire(req, Input.LEG_OK, answer=answer)
        elif 400 <= status < 500 and status not in _NOT_THE_CLIENTS:
            self._leg_done(leg, "refused")
            self._fire(req, Input.LEG_REFUSED, error=engine_error(status, body), leg=leg)
        else:
            self._leg_done(leg, "http_error", failed=True)
            self._fire(req, Input.LEG_FAILED, reason="http_error", leg=leg)

    def _no_handoff(self, req: _Request, leg: _Leg, handoff: KvHandoff) -> None:
        """A 2xx prefill answer with ``kv_transfer_params: null``: nothing to hand off.

        The engine holds no KV (vLLM's connector keeps none when the one
        token ended the sequence), so there is nothing to pull or release:
        the leg's KV record says ``none`` and why, and the decode leg runs
        as a plain request that recomputes the prompt. Never retried: a
        greedy prefill would end the same way again (docs/operate.md).
        """
        kv = leg.kv = _Kv(handoff=handoff, engine=leg.engine, leg=leg.bid)
        kv.outcome, kv.method, kv.error = "none", "none", handoff.reason
        req.plain_decode = True
        url = leg.engine.url
        if handoff.finish_reason != "stop" and url not in self._no_kv_warned:
            # Not the end-of-sequence case: an engine without a KV connector
            # answers like this for every request. Said once per engine.
            self._no_kv_warned.add(url)
            self._log(
                "prefill_without_kv", level="warning", engine=url, finish_reason=handoff.finish_reason,
                fix="check the prefill engine's --kv-transfer-config (kv_role kv_producer or kv_both); "
                    "until then every decode leg recomputes its prompt",
            )

    def _leg_done(self, leg: _Leg, outcome: LegOutcome, *, failed: bool = False) -> None:
        """Account for a leg's end: engine load, health, the request's current leg."""
        leg.outcome = outcome
        leg.ended = self._now
        self._disarm(leg.timer)
        leg.timer = None
        self._legs.pop(leg.bid, None)
        engine = leg.engine
        self.fleet.leg_ended(engine)
        req = self._requests.get(leg.rid)
        if failed:
            self._engine_failed(engine, f"{leg.phase} leg: " + (
                f"HTTP {leg.status}" if outcome == "http_error" and leg.status else outcome))
            if req is not None:
                req.failed_on[leg.phase].append(engine)
        elif outcome not in _NO_VERDICT:
            self.fleet.record_success(engine, probe=False)
        if req is not None and req.leg is leg:
            req.leg = None
        if self._slot_waiters[leg.phase]:
            self._wake_slot_waiter(leg.phase)

    def _wake_slot_waiter(self, phase: Phase) -> None:
        waiters = self._slot_waiters[phase]
        if phase == PREFILL and self._pd and self._decode_backlog():
            return  # prefilled requests waiting for a decode engine go first
        while waiters:
            req = self._requests.get(waiters.popleft())
            if (
                req is not None
                and req.waiting_for_slot
                and req.retry_phase == phase
                and req.state in (State.PREFILL_WAIT, State.DECODE_WAIT)
            ):
                self._fire(req, Input.WAKE)
                leg = req.leg
                if (leg is not None and leg.phase == phase) or (req.waiting_for_slot and req.retry_phase == phase):
                    break  # it took the slot (or found none)
                # It went elsewhere (its KV's lease ran short: prefilled again): the slot is still free.
        if phase == DECODE and self._slot_waiters[PREFILL]:
            self._wake_prefills()

    def _decode_backlog(self) -> bool:
        """Whether a prefilled request waits for a decode engine's slot (the head of its queue; stale heads dropped)."""
        waiters = self._slot_waiters[DECODE]
        while waiters:
            req = self._requests.get(waiters[0])
            if (
                req is not None
                and req.waiting_for_slot
                and req.retry_phase == DECODE
                and req.state is State.DECODE_WAIT
            ):
                return True
            waiters.popleft()
        return False

    def _wake_prefills(self) -> None:
        """Start the prefills held back behind the decode backlog, as many as the prefill engines take."""
        waiters = self._slot_waiters[PREFILL]
        for _ in range(len(waiters)):
            if not waiters or (self._pd and self._decode_backlog()) or not self.fleet.has_room(PREFILL):
                return
            self._wake_slot_waiter(PREFILL)

    def _stop_leg(self, leg: _Leg, outcome: LegOutcome) -> None:
        if leg.open:
            leg.open = False
            self._out.append(CancelLeg(leg.bid))
        if leg.outcome is None:
            self._leg_done(leg, outcome)

    def _leg_broke(self, leg: _Leg, reason: LegOutcome) -> None:
        """The leg failed on our side of the engine (timeout, bad bytes, dropped)."""
        if leg.open:
            leg.open = False
            self._out.append(CancelLeg(leg.bid))
        self._leg_done(leg, reason, failed=True)
        req = self._requests[leg.rid]
        if leg.orphan:
            self._orphan_settled(req)
            return
        self._fire(req, Input.LEG_FAILED, reason=reason, leg=leg)

    def _orphan_answered(self, req: _Request, leg: _Leg, status: int, body: bytes) -> None:
        if 200 <= status < 300:
            try:
                handoff = check_prefill_answer(body, leg.bid, self._kv_host_allowed)
            except PrefillAnswerError:
                self._leg_done(leg, "bad_kv", failed=True)
            else:
                self._leg_done(leg, "ok")
                if handoff.params is None:
                    self._no_handoff(req, leg, handoff)  # nothing held: nothing to release
                else:
                    leg.kv = req.kv = _Kv(handoff=handoff, engine=leg.engine, leg=leg.bid)
                    self._release(req)
        else:
            self._leg_done(leg, "refused" if 400 <= status < 500 else "http_error", failed=status >= 500)
        self._orphan_settled(req)

    def _orphan_settled(self, req: _Request) -> None:
        req.pending_releases -= 1
        if req.pending_releases == 0 and req.state is State.RELEASING:
            self._fire(req, Input.RELEASED)

    def _stop_orphans(self, req: _Request) -> None:
        for leg in req.legs:
            if leg.orphan and leg.outcome is None:
                self._stop_leg(leg, "cancelled")

    def _leg_connection_failed(self, leg: _Leg, event: LegFailed) -> None:
        if event.reused and not leg.got_bytes and not leg.fresh_retry and self._may_resend(leg):
            # A pooled connection the engine had closed: try once more on a
            # fresh one; the engine never saw the request.
            leg.fresh_retry = True
            req = self._requests[leg.rid]
            self._out.append(StartLeg(
                leg.bid, leg.engine.address, leg.data,
                None if req.conn is None else req.conn.handle,
                self.config.engine.connect_timeout_s, True,
            ))
            return
        leg.open = False
        if event.reason == "local_error":
            # Narwhal's own shortage (file descriptors...): not the engine's fault.
            self._shortage(f"{leg.phase} leg")
            self._leg_done(leg, "local_error")
        else:
            self._leg_done(leg, "connect_failed" if event.reason != "dropped" else "dropped", failed=True)
        req = self._requests[leg.rid]
        if leg.orphan:
            self._orphan_settled(req)
            return
        self._fire(req, Input.LEG_FAILED, reason=event.reason if event.reason != "dropped" else "dropped", leg=leg)

    # ------------------------------------------------------------ KV release

    def _may_resend(self, leg: _Leg) -> bool:
        """Whether a leg may go out again on a fresh connection: a decode leg not past its KV's ``start_by``."""
        if leg.phase != DECODE:
            return True
        req = self._requests.get(leg.rid)
        kv = None if req is None else req.kv
        return kv is None or self._now < kv.start_by

    def _lease_ran_short(self, req: _Request, kv: _Kv) -> State:
        """No decode engine had room before the KV's ``start_by``: prefill again (a new attempt), or fail 503.

        Never decode from KV whose lease may have run out: the prefill
        engine may have handed its blocks to another request
        (docs/operate.md, "KV leases").
        """
        req.waiting_for_slot = False
        self._disarm_request(req, "lease")
        retry = req.attempts[PREFILL] < self.config.retry.max_attempts
        self._log(
            "kv_lease_short", level="warning", rid=req.rid, engine=kv.engine.url, owner=kv.handoff.owner,
            kv_lease_s=self.config.engine.kv_lease_s, then="prefill again" if retry else "fail 503",
        )
        self._release(req, LEASE_SHORT + ": no decode engine had room in time")
        if retry:
            return self._start_leg(req, PREFILL)
        return self._fail(req, NarwhalError(
            "No decode engine had room before the prefilled KV's lease ran short; try again later.",
            status=503, code="kv_lease_expired",
        ))

    def _release(self, req: _Request, short: str = LEASE_SHORT) -> None:
        """Release the request's prefilled KV that no decode leg pulled (docs/operate.md, "KV release in operation").

        ``decode_pull`` (the default) sends a one-token decode request that
        the decode engine runs, pulling the KV, which frees it on the prefill
        engine; ``abort_endpoint`` asks the prefill engine's abort endpoint;
        ``decode_abort`` sends a decode request and closes at once; ``lease``
        does nothing. The outcome is settled by :meth:`_control_done`. A
        decode request never carries KV past its ``start_by`` (``short``
        says why in the record).
        """
        kv = req.kv
        if kv is None:
            return
        req.kv = None
        mode = self.config.engine.kv_release
        if mode == "lease":
            kv.outcome, kv.method = "held_until_lease", "lease"
            return
        key = f"release-{kv.leg}"
        timeout = self.config.engine.control_timeout_s
        if mode == "abort_endpoint":
            engine = kv.engine.address
            owner = kv.handoff.owner
            # SGLang's AbortReq names the request "rid"; the simulator reads "request_id".
            body = wire.dumps({"rid": owner, "request_id": owner})
            command = StartControl(
                key, engine, "POST", self.config.engine.abort_path,
                ((b"host", engine.authority), _JSON, *self._auth_header), body, timeout,
            )
        else:
            if self._now >= kv.start_by:
                kv.outcome, kv.method, kv.error = "held_until_lease", "lease", short
                return
            target = self.fleet.pick(DECODE, req.failed_on[DECODE]) or next(
                (e for e in self.fleet.engines[DECODE] if e.healthy), None
            )
            if target is None:
                kv.outcome, kv.method, kv.error = "held_until_lease", mode, "no healthy decode engine"
                return
            params = kv.handoff.params
            assert params is not None  # (a prefill that handed off nothing holds nothing: never req.kv)
            if not isinstance(params.get("remote_request_id"), str):
                # Params without remote_request_id (vLLM's NIXL connector before
                # version 2): the decode engine names the KV to the prefill
                # engine by its own request ID, which matches the prefill's
                # only when both were sent the same X-Request-Id.
                bid = kv.leg
            else:
                attempt = req.attempts[DECODE] + 1
                req.attempts[DECODE] = attempt
                bid = backend_id(req.rid, DECODE, attempt)
            headers = self._leg_headers(target.address, bid)
            if mode == "decode_pull":
                command = StartControl(
                    key, target.address, "POST", req.route, headers,
                    wire.dumps(release_body(req.accepted.body, params)), timeout,
                )
            else:
                raw = self._codec.engine_connection(max_body_bytes=None).send_request(
                    "POST", req.route, headers, wire.dumps(decode_body(req.accepted.body, params))
                )
                command = StartControl(
                    key, target.address, "POST", req.route, (), b"", timeout, drop_after_send=True, data=raw
                )
            kv.release_id = bid
        kv.method = mode
        req.pending_releases += 1
        self._controls[key] = ("release", (req, kv))
        self._out.append(command)

    def _control_done(self, event: ControlDone) -> None:
        entry = self._controls.pop(event.key, None)
        if entry is None:
            return
        kind, owner = entry
        ok = event.error is None and (event.status is None or 200 <= event.status < 300)
        if kind == "probe":
            engine: EngineState = owner
            first = not engine.probed
            engine.probed = True
            if event.local:
                change = None  # Narwhal's own shortage: no verdict on the engine
                self._shortage("health probe")
            elif ok and event.status is not None:
                change = self.fleet.record_success(engine, probe=True)
            else:
                reason = event.error if event.status is None else f"HTTP {event.status}"
                if first and not engine.answered:
                    self._log("engine_not_answering", level="warning", engine=engine.url, phase=engine.phase,
                              reason=reason or "no answer")
                change = self._engine_failed(engine, reason or "no answer")
            if not self._draining:
                self._probe_timers[engine] = self._timers.arm(
                    self._now + self.config.health.probe_interval_s, self._probe, engine
                )
            if change == "up":
                self._log("engine_up", engine=engine.url, phase=engine.phase)
                self._wake_slot_waiter(engine.phase)
            return
        req, kv = owner
        kv.outcome, kv.error = self._release_outcome(kv.method, event)
        req.pending_releases -= 1
        if req.pending_releases == 0 and req.state is State.RELEASING:
            self._fire(req, Input.RELEASED)

    def _release_outcome(self, method: str | None, event: ControlDone) -> tuple[str, str | None]:
        """A release's KV outcome and error: ``released`` only when the engine confirmed it.

        (docs/operate.md, "KV release in operation".) ``release_sent``: it
        went out (or may have: a timeout) and nothing confirmed it;
        ``held_until_lease``: it never reached the engine, or the engine
        refused it.
        """
        status = event.status
        if status is None:
            error = event.error
            if error is None:
                return "release_sent", None  # decode_abort: written, and nothing comes back
            if event.local or error.startswith(_NOT_SENT):
                return "held_until_lease", error
            return "release_sent", error
        if method == "decode_pull":
            why = release_unconfirmed(status, event.body)
            return ("released", None) if why is None else ("release_sent", why)
        if not 200 <= status < 300:
            if status == 404:
                return "held_until_lease", (
                    f"release answered 404: the engine has no {self.config.engine.abort_path} "
                    '(vLLM has none: use kv_release = "decode_pull")'
                )
            return "held_until_lease", f"release answered {status}"
        said = release_said(event.body)
        if said is True:
            return "released", None
        if said is False:
            return "released", NOTHING_HELD  # nothing was left to free: not a leak, not Narwhal's doing
        return "release_sent", "the engine took the abort and did not say whether it freed anything"

    # --------------------------------------------------------------- health

    def _probe(self, engine: EngineState) -> None:
        self._probe_seq += 1
        key = f"probe-{self._probe_seq}"
        h = self.config.health
        self._controls[key] = ("probe", engine)
        self._out.append(StartControl(
            key, engine.address, "GET", h.probe_path,
            ((b"host", engine.address.authority), *self._auth_header), b"", h.probe_timeout_s,
            # A prefill engine's name is resolved at every probe: its addresses
            # may name its KV side channel (docs/configure.md, engine.kv_hosts).
            resolve=engine.phase == PREFILL and not is_ip_address(engine.address.host),
        ))

    def _engine_failed(self, engine: EngineState, reason: str | None = None) -> Any:
        change = self.fleet.record_failure(engine)
        if change == "down":
            self._log("engine_down", engine=engine.url, phase=engine.phase, failures=engine.failures,
                      reason=reason or "failed")
        return change

    def _kv_host_allowed(self, host: str) -> bool:
        """The SSRF guard on a prefill answer's ``remote_host``; a refused value is logged once, with the fix."""
        if self.fleet.kv_host_allowed(host):
            return True
        if self.fleet.first_refusal(host):
            self._log(
                "kv_host_refused", level="warning", remote_host=host[:200],
                fix="if this is a prefill engine's KV side channel host (VLLM_NIXL_SIDE_CHANNEL_HOST), "
                    "add it, or its network in CIDR form, to engine.kv_hosts",
            )
        return False

    # -------------------------------------------------------------- shutdown

    def _begin_shutdown(self) -> None:
        if self._draining:
            # Asked again (a second signal): what is left is cut short now,
            # as when the grace period ends, KV releases included.
            self._abandon_all()
            self._abandon_all()
            self._check_shutdown()
            return
        self._draining = True
        self._log("draining", requests=len(self._requests))
        for conn in list(self._conns.values()):
            if conn.rid is None and not conn.codec.in_response and not conn.codec.has_partial_request:
                self._close(conn)
        for timer in self._probe_timers.values():
            timer.cancel()  # no more probes: the engines' health no longer matters
        self._probe_timers.clear()
        self._timers.arm(self._now + self.config.shutdown.grace_s, self._grace_over, self)
        self._check_shutdown()

    def _abandon_all(self) -> None:
        for pending in list(self._requests.values()):
            if pending.state is not State.DONE:
                self._fire(pending, Input.ABANDON)

    def _check_shutdown(self) -> None:
        if self._draining and not self._requests and not self._shutdown_reported:
            self._shutdown_reported = True
            self._log("drained")
            self._out.append(ShutdownComplete())

    # ------------------------------------------------------------- plumbing

    def _wall(self) -> float:
        # To the microsecond; floor(x + 0.5) is round() but for exact ties,
        # and a fraction of round()'s cost (which formats the number).
        return math.floor((self._now + self._wall_offset) * 1e6 + 0.5) / 1e6

    def _log(self, event: str, **fields: Any) -> None:
        self._out.append(Log(event, fields))

    def _shortage(self, what: str) -> None:
        """Log Narwhal's own shortages (out of descriptors, memory, ports), at most once a second."""
        self._shortages += 1
        if self._now - self._shortage_logged >= 1.0:
            self._log("local_resources_exhausted", level="error", failed=what, count=self._shortages)
            self._shortages = 0
            self._shortage_logged = self._now

    def _live_conn(self, req: _Request) -> _Conn | None:
        conn = req.conn
        if conn is None or conn.closed or conn.rid != req.rid:
            return None
        return conn

    def _client_left(self, conn: _Conn) -> None:
        rid = conn.rid
        if rid is not None:
            req = self._requests.get(rid)
            if req is not None and not req.answered:
                self._fire(req, Input.CLIENT_GONE)

    def _send(self, conn: _Conn, data: bytes) -> None:
        if data and not conn.closed:
            self._out.append(Transmit(conn.handle, data))

    def _finish(self, conn: _Conn, data: bytes) -> None:
        """Send the last bytes of a response; close or wait for the next request."""
        self._send(conn, data)
        if conn.codec.must_close or (self._draining and not conn.codec.has_partial_request):
            self._close(conn)
        else:
            conn.rid = None
            conn.reading = conn.body_phase = False
            self._wait_for_request(conn, self.config.ingress.keepalive_timeout_s)
            self._pump.append(conn)

    def _close(self, conn: _Conn) -> None:
        if not conn.closed:
            conn.closed = True
            self._count_buffered(conn)
            self._disarm(conn.timer)
            conn.timer = None
            self._conns.pop(conn.handle, None)
            self._out.append(CloseClient(conn.handle))

    def _closing(self, conn: _Conn) -> tuple[tuple[bytes, bytes], ...]:
        # While draining, a connection closes after its response, unless the
        # client already sent (pipelined) its next request: that one gets its
        # own answer (503 shutting_down) and record first.
        return (_CLOSE,) if self._draining and not conn.codec.has_partial_request else ()

    def _error_headers(self, rid: str | None) -> tuple[tuple[bytes, bytes], ...]:
        headers: tuple[tuple[bytes, bytes], ...] = (_JSON,)
        if rid is not None:
            headers += ((b"x-request-id", rid.encode()),)
        return headers

    def _respond_plain(
        self, conn: _Conn, rid: str, status: int, body: bytes, *, extra: tuple[tuple[bytes, bytes], ...] = ()
    ) -> None:
        self._finish(conn, conn.codec.send_response(status, (
            _JSON, (b"x-request-id", rid.encode()), *extra, *self._closing(conn),
        ), body))
        if conn.rid == rid:
            conn.rid = None


def _ms(seconds: float) -> float:
    # To the microsecond, as _wall.
    return math.floor(seconds * 1e6 + 0.5) / 1000.0


def _backoff(seed: str, attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter in [0.5, 1.5) drawn from a hash of the leg's ID (no randomness)."""
    jitter = 0.5 + (zlib.crc32(seed.encode()) & 0xFFFF) / 65536.0
    return float(min(cap, base * 2.0 ** (attempt - 1)) * jitter)


def _error_body(message: str, code: str, type: str = "invalid_request_error") -> bytes:
    return wire.dumps({"error": {"message": message, "type": type, "param": None, "code": code}})


def _error_record(error: NarwhalError, leg: _Leg | None = None) -> ErrorRecord:
    return ErrorRecord(
        type=error.type, code=error.code, param=error.param, message=error.message,
        leg=None if leg is None else leg.phase, engine=None if leg is None else leg.engine.url,
    )
