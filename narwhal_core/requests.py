"""Completion requests: admission, their timers, their answers and their one terminal record.

:class:`Requests` holds every completion request not yet terminal. It takes
a completion request from its client connection through the contract check
and admission (or refuses it, with its record), keeps each request's timers
(deadline, queue wait, retry backoff, KV lease), writes what the client
gets at the end (the whole answer, a stream's end, an error), frees the
request's admission slot once the client has its answer, and writes the
terminal record once its KV is settled. What happens in between is the
lifecycle's (:mod:`~narwhal_core.lifecycle`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from . import journal, wire
from .budgets import BudgetRefusal
from .errors import AuthError
from .context import JSON_HEADER, Context, error_record
from .contract import AcceptedRequest, Route, check_request
from .errors import ContractError, NarwhalError
from .events import PromptTokenized, ShutdownComplete, WriteJournal
from .fleet import AdmitDecision
from .http import HttpRequest
from .ids import DECODE, PREFILL, sanitize_client_rid
from .inflight import Conn, Leg, Request
from .journal import ErrorRecord, LegOutcome, Terminal
from .policies import estimate_tokens
from .states import Input, State
from .tenants import FairAdmission
from .tenants_config import PRIORITY_HEADER
from .tracecontext import TraceContext, request_trace

if TYPE_CHECKING:
    from .clients import Clients
    from .policies import Plan

__all__ = ["Request", "Requests"]

_SSE_HEADERS: Final = (
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
)


class Requests:
    """The completion requests not yet terminal, by rid; their admission, timers, answers and records."""

    __slots__ = ("ctx", "clients", "active", "timer_actions", "shutdown_reported")

    def __init__(self, ctx: Context, clients: Clients, active: dict[str, Request]) -> None:
        self.ctx: Final = ctx
        self.clients: Final = clients
        #: The requests not yet terminal, by rid (the router makes the map; the parts that read it hold it too).
        self.active: Final = active
        #: What each kind of request timer does when its time comes.
        #: (Each returns the request's input, which the router fires.)
        self.timer_actions: Final[dict[str, Callable[[Request], Input | None]]] = {
            "deadline": self._deadline_passed, "queue": self._queue_wait_over,
            "wake": self._backoff_over, "lease": self._lease_running_short,
        }
        self.shutdown_reported = False

    # -------------------------------------------------------------- admission

    def accept(self, conn: Conn, rid: str, route: Route, request: HttpRequest) -> Request | None:
        """A completion request arrived whole: check it, queue it, or refuse it with its record.

        Returns the request when it is admitted at once (the router fires its ``ADMIT``).
        """
        ctx = self.ctx
        clients = self.clients
        client_rid = sanitize_client_rid(request.header(b"x-request-id"))
        trace = request_trace(request.headers, rid, ctx.config.tracing)  # a refusal's record names it too
        try:
            client = clients.auth.authenticate(request.headers, conn.peer_host)
        except AuthError as exc:
            clients.refuse(conn, rid, route, client_rid, None, "denied", exc, trace=trace)
            return None
        try:
            accepted = check_request(
                route, request.body, ctx.config.model_names, ctx.model,
                max_prompts=ctx.config.ingress.max_batch_prompts,
            )
        except ContractError as exc:
            clients.refuse(conn, rid, route, client_rid, client, "invalid", exc, trace=trace)
            return None
        tenants = ctx.config.tenants
        fair = None
        if tenants is not None:  # (docs/operate.md, "Tenants")
            try:
                band, weight = tenants.band_and_weight(client, request.header(PRIORITY_HEADER))
            except ContractError as exc:
                clients.refuse(conn, rid, route, client_rid, client, "invalid", exc, accepted=accepted, trace=trace)
                return None
            fair = (estimate_tokens(len(request.body)), band, weight)
        decision = self._admission(rid, client, fair)
        if isinstance(decision, NarwhalError):
            # A budget's refusal brings its own Retry-After and rate-limit headers (docs/operate.md, "Tenants").
            extra = decision.headers if isinstance(decision, BudgetRefusal) else ()
            clients.refuse(conn, rid, route, client_rid, client, "rejected", decision, retry_after=not extra,
                           accepted=accepted, extra=extra, trace=trace)
            return None
        req = Request(
            rid=rid, conn=conn, route=route, client=client, client_rid=client_rid,
            received=ctx.now, stream=accepted.stream, accepted=accepted, size=len(request.body), trace=trace,
        )
        if fair is not None:
            req.rate_headers = self._rate_headers(client)
        self.active[rid] = req
        a = ctx.config.admission
        self.arm(req, "deadline", ctx.now + a.request_timeout_s)
        if decision == "admitted":
            return req
        self.arm(req, "queue", ctx.now + a.queue_timeout_s)
        return None

    def _admission(
        self, rid: str, client: str, fair: tuple[int, int, float] | None
    ) -> AdmitDecision | NarwhalError:
        """``admitted`` or ``queued``; or why a checked request is refused (shutdown, no engine, limits).

        ``fair``: with ``[tenants]``, the request's estimated prompt tokens, band and weight.
        """
        ctx = self.ctx
        if ctx.draining:
            return NarwhalError("Narwhal is shutting down; retry on another instance.", status=503,
                                code="shutting_down")
        for phase in ctx.phases:
            if not ctx.fleet.has_healthy(phase):
                return ctx.no_engine(phase)
        admission = ctx.admission
        if fair is None:
            decision = admission.offer(rid, client)
        else:
            assert isinstance(admission, FairAdmission)
            decision = admission.offer(rid, client, *fair)
            if isinstance(decision, BudgetRefusal):
                return decision
        if decision == "client_limit":
            return NarwhalError("Too many requests in flight for this client.", status=429,
                                type="rate_limit_error", code="rate_limited")
        if decision == "fleet_full":
            return NarwhalError("The fleet is at capacity; retry later.", status=503, code="overloaded")
        return decision

    def _rate_headers(self, client: str) -> tuple[tuple[bytes, bytes], ...]:
        """The OpenAI rate-limit headers a tenant's answers carry: its budget after this request's charge."""
        admission = self.ctx.admission
        assert isinstance(admission, FairAdmission)
        budgets = admission.budgets
        return () if budgets is None else budgets.headers(client)

    def journal_admitted(self, req: Request) -> None:
        """The request's progress record: it holds an admission slot now."""
        ctx = self.ctx
        ctx.stats.journal_records["progress"] += 1
        plan = req.plan
        ctx.out.append(WriteJournal(journal.progress_line(
            ctx.wall(), req.rid, "admitted", req.route, req.client, req.client_rid,
            ctx.mode if plan is None else "pd" if plan.pd else "single", req.stream,
        ), False))

    def tokenized(self, event: PromptTokenized) -> Request | None:
        """The request a prompt's token ids came back for (docs/routing.md, "Tokenizing off the event loop").

        ``None`` when its request has ended (its client left, its deadline
        passed, shutdown) or is no longer waiting for this prompt's ids: the
        answer is ignored. Else the router fires the request's ``TOKENIZED``.
        """
        req = self.active.get(event.key.partition(":")[0])
        if req is None or req.state is not State.TOKENIZING or req.tokenizing != event.key:
            return None
        return req

    # ----------------------------------------------------------------- timers

    def arm(self, req: Request, kind: str, when: float) -> None:
        """Arm the request's ``kind`` timer for ``when`` (replacing one armed before)."""
        timer = req.timers.get(kind)
        if timer is not None:
            timer.cancel()
        req.timers[kind] = self.ctx.timers.arm(when, self.timer_actions[kind], req)

    def disarm(self, req: Request, *kinds: str) -> None:
        """Cancel the request's timers of ``kinds`` (none named: all of them)."""
        for kind in kinds or tuple(req.timers):
            timer = req.timers.pop(kind, None)
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _deadline_passed(req: Request) -> Input:
        del req.timers["deadline"]
        return Input.DEADLINE

    @staticmethod
    def _queue_wait_over(req: Request) -> Input:
        del req.timers["queue"]
        return Input.QUEUE_TIMEOUT

    @staticmethod
    def _backoff_over(req: Request) -> Input:
        del req.timers["wake"]
        return Input.WAKE

    def _lease_running_short(self, req: Request) -> Input | None:
        del req.timers["lease"]
        state = req.state
        if state is State.DECODE_WAIT:
            return Input.WAKE  # its KV's lease runs short: start_phase prefills it again
        if state is State.DECODE and req.kv is not None and self.ctx.now >= req.kv.hold_ends:
            return Input.KV_HOLD_ENDING  # its decode leg has not read the KV yet
        return None

    # ---------------------------------------------------------------- answers

    def live_conn(self, req: Request) -> Conn | None:
        """The request's client connection, if it is still there and still waits for this request's answer."""
        conn = req.conn
        if conn is None or conn.closed or conn.rid != req.rid:
            return None
        return conn

    def stream_out(self, req: Request, out: bytes) -> bool:
        """Relay a stream's bytes to the client (its head first); whether ``FIRST_BYTES`` is due now."""
        conn = self.live_conn(req)
        if conn is None:
            return False
        clients = self.clients
        first = False
        if not req.bytes_sent:
            req.bytes_sent = True
            req.first_byte = self.ctx.now
            # No "connection: close" here, even while draining: a stream's head
            # goes out long before its end, and a request the client pipelines
            # meanwhile must still get its own answer (503 shutting_down) and
            # record. Clients.end_response decides at the end, as for a stream
            # begun before the shutdown.
            clients.send(conn, conn.codec.send_stream_start(200, (
                *_SSE_HEADERS, (b"x-request-id", req.rid.encode()), *req.rate_headers,
            )))
            first = True
        elif req.state is State.DECODE:
            # A later prompt of a batch streams its first event: from now on
            # its decode leg cannot be retried (docs/operate.md, "Batch prompts").
            first = True
        clients.send(conn, conn.codec.send_stream_data(out))
        return first

    def end_stream(self, req: Request) -> None:
        """The streamed answer is complete: ``completed``, or ``failed`` on the engine's in-stream error."""
        relay = req.relay
        assert relay is not None
        req.usage = relay.usage
        if relay.error is not None:
            err = relay.error
            error = NarwhalError(
                str(err.get("message", "engine error"))[:1000], status=200,
                type=str(err.get("type", "server_error")), code="engine_error",
            )
            self.decide_end(req, "failed", error, leg=req.legs[-1], sent=True)
        else:
            self.decide_end(req, "completed", None, status=200)
        conn = self.live_conn(req)
        if conn is not None:
            self.clients.end_response(conn, conn.codec.send_stream_end())

    def answer(self, req: Request, answer: dict[str, Any]) -> None:
        """The whole answer, ``completed``."""
        req.usage = answer.get("usage") if isinstance(answer.get("usage"), dict) else None
        body = wire.dumps(answer)
        self.decide_end(req, "completed", None, status=200)
        conn = self.live_conn(req)
        if conn is not None:
            req.first_byte = self.ctx.now
            self.clients.end_response(conn, conn.codec.send_response(200, (
                JSON_HEADER, (b"x-request-id", req.rid.encode()), *req.rate_headers, *self.clients.closing(conn),
            ), body))

    def answer_error(self, req: Request, *, retry_after: bool = False) -> None:
        """Answer the client the request's error (a begun stream: one error event, then its end)."""
        conn = self.live_conn(req)
        error = req.error
        if conn is None or error is None:
            return
        clients = self.clients
        body = wire.dumps({"error": {
            "message": error.message, "type": error.type, "param": error.param, "code": error.code,
        }})
        if req.bytes_sent:
            # docs/contract.md: a failure after the first byte ends the stream with one error event.
            data = conn.codec.send_stream_data(b"data: " + body + b"\n\n")
            clients.send(conn, data)
            clients.end_response(conn, conn.codec.send_stream_end())
            return
        extra = ((b"retry-after", clients.retry_after),) if retry_after else ()
        clients.end_response(conn, conn.codec.send_response(req.status or 500, (
            JSON_HEADER, (b"x-request-id", req.rid.encode()), *extra, *clients.closing(conn),
        ), body))

    def answer_internal_error(self, req: Request) -> None:
        """Answer 500 ``internal_error`` (the request failed closed) and close the connection."""
        conn = self.live_conn(req)
        if conn is None:
            return
        try:
            self.answer_error(req)
        except Exception:  # noqa: BLE001 - the connection's state is what failed
            if not req.bytes_sent:
                self.clients.send_internal_error(conn, req.rid)
        self.clients.close_client(conn)  # what it was in the middle of cannot be trusted either

    # ------------------------------------------------------------------- ends

    def decide_end(
        self,
        req: Request,
        terminal: Terminal,
        error: NarwhalError | None,
        *,
        status: int | None = None,
        leg: Leg | None = None,
        sent: bool = False,
    ) -> None:
        """Decide how the request ends (its terminal record is written once KV is settled)."""
        req.terminal = terminal
        if error is not None:
            req.error = error_record(error, leg)
            req.status = 200 if sent else error.status
        else:
            req.status = status

    def write_record(self, req: Request) -> None:
        """Journal the request's terminal record and count it; the request is done."""
        if req.terminal is None:
            return
        # The record's line and its metrics, straight from the request's
        # state (journal.terminal_line: built from the TerminalRecord's own fields, in order).
        ctx = self.ctx
        wall = ctx.wall()
        legs = [self._leg_line(leg) for leg in req.legs]
        received = req.received + ctx.wall_offset
        duration = _ms(wall - received)
        ttft = None if req.first_byte is None else _ms(req.first_byte - req.received)
        stats = ctx.stats
        stats.observe_request(req.route, req.terminal, req.status, duration, ttft)
        stats.journal_records["terminal"] += 1
        plan = req.plan
        trace = req.trace
        ctx.out.append(WriteJournal(journal.terminal_line(
            wall, req.rid, req.client_rid, req.client, req.route, req.accepted.requested_model or ctx.model,
            req.stream, ctx.mode if plan is None else "pd" if plan.pd else "single", req.terminal, req.status,
            None if req.error is None else req.error.to_json(), legs, req.usage, received, duration, ttft,
            req.accepted.stripped,
            None if plan is None else self._routing_line(req, plan),
            None if trace is None else trace.trace_id, None if trace is None else trace.traceparent,
        ), True))
        del self.active[req.rid]
        req.state = State.DONE
        self.disarm(req)
        self.check_drained()

    def _routing_line(self, req: Request, plan: Plan) -> dict[str, Any]:
        """The record's ``routing`` object: the plan, and the engines the request's legs last went to."""
        prefill = decode = None
        for leg in req.legs:
            if leg.phase == PREFILL:
                prefill = leg.engine.address.url
            else:
                decode = leg.engine.address.url
        return plan.to_json(self.ctx.routing.name, prefill, decode)

    def _leg_line(self, leg: Leg) -> Any:
        """One leg of a terminal record (its KV settled, if it was not), counted in the metrics."""
        kv = leg.kv
        kv_line = kv_counted = None
        if kv is not None:
            if kv.outcome is None:
                # Never left unsettled in a terminal record.
                kv.outcome, kv.method = "held_until_lease", "lease"
            method = kv.method or ""
            kv_line = journal.kv_json(
                kv.outcome, kv.handoff.owner, kv.engine.url, method, kv.error, kv.release_id
            )
            kv_counted = (kv.outcome, method)
        outcome: LegOutcome = leg.outcome or "cancelled"
        ctx = self.ctx
        duration = _ms((ctx.now if leg.ended is None else leg.ended) - leg.started)
        self.ctx.stats.observe_leg(leg.phase, outcome, leg.attempt, duration, kv_counted)
        return journal.leg_json(
            leg.phase, leg.attempt, leg.bid, leg.engine.url, leg.status, outcome,
            leg.started + ctx.wall_offset, duration, kv_line, leg.prompt, leg.request_id,
        )

    # ------------------------------------------------------- clients and shutdown

    def unanswered(self, conn: Conn) -> Request | None:
        """The request of a connection that went away, if it has no answer yet (the router fires ``CLIENT_GONE``)."""
        rid = conn.rid
        if rid is None:
            return None
        req = self.active.get(rid)
        return req if req is not None and not req.answered else None

    def check_drained(self) -> None:
        """While draining, the last terminal record completes the shutdown (once)."""
        ctx = self.ctx
        if ctx.draining and not self.active and not self.shutdown_reported:
            self.shutdown_reported = True
            ctx.log("drained")
            ctx.out.append(ShutdownComplete())


def _ms(seconds: float) -> float:
    # To the microsecond, as Context.wall.
    return math.floor(seconds * 1e6 + 0.5) / 1000.0
