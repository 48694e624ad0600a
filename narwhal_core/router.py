"""The router: fleet-wide state driven by events, answering with commands.

An adapter owns sockets, tasks and the clock; the :class:`Router` owns every
decision. The adapter calls :meth:`Router.receive` with an event and the
current time, then drains :meth:`Router.next_output` and executes each
command in order; it re-arms its one timer at :meth:`Router.get_deadline`
and calls :meth:`Router.handle_deadline` when it fires. Nothing here does
I/O, reads a clock or draws a random number.

The router is a dispatcher over parts with one job each (docs/design.md,
"The parts of the core"): :class:`~narwhal_core.clients.Clients` (client connections and
the routes that are not completions), :class:`~narwhal_core.requests.Requests`
(admission, answers, terminal records), :class:`~narwhal_core.lifecycle.Lifecycle`
(the request lifecycle table and its handlers, the one part that changes a
request's state), :class:`~narwhal_core.legs.Legs`
and :class:`~narwhal_core.answers.Answers` (engine legs and their answers),
:class:`~narwhal_core.slots.SlotQueue` (requests waiting for an engine's slot), :class:`~narwhal_core.kv.KvLedger` (prefilled KV and
its release), :class:`~narwhal_core.health.Health` (probes and verdicts on
engines; the engine choice is :meth:`~narwhal_core.fleet.Fleet.choose`), and
:class:`~narwhal_core.timers.Timers`. They share one
:class:`~narwhal_core.context.Context`. The parts below the lifecycle return
values and verdicts that the router hands to it; the work an event leaves
for other requests waits on one queue, drained once the event is handled.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Final, cast

import attrs

from .admin import Admin
from .answers import Answers
from .auth import Authenticator
from .clients import Clients, Conn
from .config import Config
from .context import Context
from .errors import NarwhalError
from .events import (
    AuthenticatorChanged,
    ClientConnected,
    ClientData,
    ClientGone,
    ClientStalled,
    Command,
    ControlDone,
    EngineResolved,
    EnginesChanged,
    Event,
    JournalHealth,
    KvEventsReceived,
    KvStreamChanged,
    LegData,
    LegFailed,
    PromptTokenized,
    ShutdownRequested,
)
from .fleet import Admission, Fleet
from .health import Health
from .ids import DECODE, PREFILL, Phase
from .http import Codec, CodecLike
from .kv import LEASE_SHORT, NOTHING_HELD, KvLedger
from .kv_feed import KvEventFeed
from .engine_metrics import EngineLoad
from .legs import Legs
from .load import LoadReports
from .membership import Membership
from .slots import SlotQueue
from .lifecycle import Lifecycle
from .requests import Request, Requests
from .routing import Routing, make_policy
from .states import FollowUp, Input, State
from .stats import Stats
from .tenants import FairAdmission
from .verdicts import Verdict

if TYPE_CHECKING:
    from .kv_policy import PromptTokenizer

__all__ = ["Router", "RouterStatistics", "LEASE_SHORT", "NOTHING_HELD"]


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
    #: What each engine's ``/metrics`` said last, and how many seconds ago (engines with figures only).
    engine_reports: dict[tuple[str, str], tuple[EngineLoad, float]] = attrs.Factory(dict)
    #: With ``routing.policy = "kv"``: whether each prefill engine is weighed from its KV events now
    #: (``False``: from the approximate index), by URL (docs/routing.md, "KV events").
    kv_events_live: dict[str, bool] = attrs.Factory(dict)


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
        codec: CodecLike | None = None,
        render_metrics: Callable[[Stats, RouterStatistics], bytes] | None = None,
        tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.config: Final = config
        fleet = _fleet(config, tokenizer)
        ctx = self._ctx = Context(
            config, fleet=fleet, routing=Routing(config.routing, fleet), admission=_admission(config),
            codec=Codec() if codec is None else codec,  # a codec of its own: its line memory is this router's
            rid_source=rid_source, engine_api_key=engine_api_key, wall_offset=wall_offset, now=now,
        )
        if isinstance(ctx.admission, FairAdmission):
            ctx.admission.bind(ctx, ctx.stats)  # it reads the event's time; its figures are the router's
        # A policy that ages what it knows (kv) reads the time of the event being handled from the context.
        fleet.policy.bind(ctx, ctx.log)
        self.fleet: Final = ctx.fleet
        self.admission: Final = ctx.admission
        self.stats: Final = ctx.stats
        self._render_metrics: Final = render_metrics
        # Each part gets what it calls at construction, the lower ones first (docs/design.md,
        # "The parts of the core"); the map of unfinished requests is the registry's, read by the others.
        active: dict[str, Request] = {}
        self.health: Final = Health(ctx)
        self.load: Final = LoadReports(ctx)
        self.kv_events: Final = KvEventFeed(ctx)
        self.kv: Final = KvLedger(ctx)
        self.membership: Final = Membership(ctx, self.health, self.load, self.kv, active)
        self.clients: Final = Clients(ctx, authenticator, render_metrics is not None, Admin(ctx, self.membership))
        self.requests: Final = Requests(ctx, self.clients, active)
        self.slots: Final = SlotQueue(active)
        self.legs: Final = Legs(ctx, active, self.health, self.slots)
        self.answers: Final = Answers(ctx, self.legs, self.requests, self.kv, self.health)
        self.lifecycle: Final = Lifecycle(ctx, self.requests, self.legs, self.kv, self.slots)
        # Every engine is probed at once: /ready waits for answers (docs/operate.md).
        self.health.probe_all()
        self.load.scrape_all()

    # ------------------------------------------------------------ public API

    def receive(self, event: Event, *, now: float) -> None:
        """Feed one event; then drain :meth:`next_output`."""
        ctx = self._ctx
        ctx.now = now
        if isinstance(event, ClientData):
            gone = self.clients.data(event.conn, event.data)
            if gone is not None:
                self._client_gone(gone)
            elif self.clients.arrived:
                self._admit_arrivals()
            if self.clients.metrics_wanted:
                self._answer_metrics()
        elif isinstance(event, LegData):
            leg = self.legs.running.get(event.leg)
            if leg is not None:
                verdict = self.answers.data(leg, event.data)
                if verdict is not None:
                    self.lifecycle.judged(leg, verdict)
                    if leg.open and leg.outcome is not None:
                        self.legs.read_tail(leg)  # [DONE] came: what follows is dropped
        elif isinstance(event, ClientConnected):
            self.clients.connected(event)
        elif isinstance(event, ClientGone):
            conn = self.clients.gone(event.conn)
            if conn is not None:
                self._client_gone(conn)
        elif isinstance(event, ClientStalled):
            self._client_stalled(event)
        elif isinstance(event, LegFailed):
            leg = self.legs.running.get(event.leg)
            if leg is not None and leg.open:
                verdict = self.legs.connection_lost(leg, event)
                if verdict is not None:
                    self.lifecycle.judged(leg, verdict)
        elif isinstance(event, ControlDone):
            self._control_done(event)
        elif isinstance(event, ShutdownRequested):
            self._begin_shutdown()
        elif isinstance(event, AuthenticatorChanged):
            self.clients.auth = event.authenticator
            ctx.log("keys_reloaded")
        elif isinstance(event, EngineResolved):
            self.fleet.resolved(event.engine, event.addresses)
        elif isinstance(event, EnginesChanged):
            self.membership.discovered(event)
        elif isinstance(event, JournalHealth):
            self._journal_health(event)
        elif isinstance(event, KvEventsReceived):
            self.kv_events.events(event)
        elif isinstance(event, KvStreamChanged):
            self.kv_events.stream(event)
        elif isinstance(event, PromptTokenized):
            req = self.requests.tokenized(event)
            if req is not None:
                self.lifecycle.fire(req, Input.TOKENIZED, event)
        else:
            raise NarwhalError(f"unknown event {event!r}")
        if ctx.followups or self.clients.pump:
            self._follow_up()

    def next_output(self) -> Command | None:
        """The next command to execute, or ``None`` when there is none."""
        out = self._ctx.out
        return out.popleft() if out else None

    def get_deadline(self) -> float | None:
        """When :meth:`handle_deadline` should next be called, or ``None``."""
        return self._ctx.timers.deadline()

    def handle_deadline(self, *, now: float) -> None:
        """Fire every timer due at ``now``."""
        self._ctx.now = now
        timers = self._ctx.timers
        timer = timers.pop_due(now)
        followups = self._ctx.followups
        while timer is not None:
            owner = timer.owner
            verdict = timer.action(owner)
            if verdict is not None:  # a request's input, or a leg's verdict
                if isinstance(verdict, Input):
                    self.lifecycle.fire(owner, verdict)
                else:
                    self.lifecycle.judged(owner, cast("Verdict", verdict))
            while followups:  # each timer's follow-ups are done before the next timer fires
                self._follow_up_one(followups.popleft())
            timer = timers.pop_due(now)
        if self.clients.pump:
            self._follow_up()

    def statistics(self) -> RouterStatistics:
        """A snapshot of the live counters."""
        ctx = self._ctx
        return RouterStatistics(
            connections=len(self.clients.conns),
            requests=len(self.requests.active),
            inflight=self.admission.inflight,
            queued=len(self.admission.queue),
            legs=len(self.legs.running),
            controls=len(self.kv.releases) + len(self.health.probes),
            engine_outstanding={(e.url, e.phase): e.outstanding for e in self.fleet.all()},
            engine_healthy={(e.url, e.phase): e.healthy for e in self.fleet.all()},
            draining=ctx.draining,
            ready=not ctx.ready_problems(),
            buffered_bytes=self.clients.buffered,
            engines_probed=self.fleet.all_probed(),
            engine_reports={
                (e.url, e.phase): (e.reported, ctx.now - e.reported_at) for e in self.fleet.all() if e.reported
            },
            kv_events_live=self.kv_events.live(),
        )

    def contain_failure(self, event: Event | None, problem: str, trace: str | None = None) -> None:
        """The adapter caught ``problem``, raised by :meth:`receive` on ``event`` (``None``: :meth:`handle_deadline`).

        The request the event concerns ends ``failed`` with 500
        ``internal_error`` and its terminal record; a connection with no
        request yet is answered 500 and closed. One ``internal_error`` log
        line names the request and carries ``trace``. Everything else goes
        on (the follow-up work queued for other requests is done); drain
        :meth:`next_output` as after any event.
        """
        req = self._request_of(event)
        fields: dict[str, Any] = {
            "rid": None if req is None else req.rid, "problem": problem,
            "during": "deadline" if event is None else type(event).__name__,
        }
        if trace:
            fields["traceback"] = trace
        self._ctx.log("internal_error", **fields)
        if req is not None:
            self.lifecycle.abort(req)
        else:
            handle = getattr(event, "conn", None)
            conn = self.clients.conns.get(handle) if handle is not None else None
            if conn is not None and not conn.closed:
                self.clients.send_internal_error(conn, None)
                self.clients.close_client(conn)
        self._follow_up()  # what the event (or the abort) left for other requests

    # ---------------------------------------------------------- compatibility

    @property
    def _conns(self) -> dict[Hashable, Conn]:
        """The client connections (tests read their byte counts)."""
        return self.clients.conns

    @property
    def _auth(self) -> Authenticator:
        """The client authenticator in force (tests check a reload reached it)."""
        return self.clients.auth

    @property
    def _codec(self) -> CodecLike:
        """The HTTP/1.1 codec in use."""
        return self._ctx.codec

    # ------------------------------------------------------------- dispatching

    def _follow_up(self) -> None:
        """Do the work the event left for other requests, in the order it was queued; then the pipelined requests.

        (docs/design.md, "Follow-up work".) A piece may queue more; a
        connection whose answer just ended serves its next request once the
        queue is empty, as a new arrival comes after the requests already
        waiting.
        """
        followups = self._ctx.followups
        clients = self.clients
        while True:
            while followups:
                self._follow_up_one(followups.popleft())
            if not clients.pump:
                return
            clients.serve_pipelined()
            if clients.arrived:
                self._admit_arrivals()
            if clients.metrics_wanted:
                self._answer_metrics()

    def _answer_metrics(self) -> None:
        """Render ``/metrics`` for the scrapes the clients part has read: the figures come from every part."""
        render = self._render_metrics
        assert render is not None  # the clients part queues none without a renderer
        clients = self.clients
        wanted, clients.metrics_wanted = clients.metrics_wanted, []
        for conn, rid in wanted:
            if not conn.closed and conn.rid == rid:
                clients.answer_metrics(conn, rid, render(self.stats, self.statistics()))

    def _journal_health(self, event: JournalHealth) -> None:
        ctx = self._ctx
        if event.ok != ctx.journal_ok:
            ctx.log("journal_ok" if event.ok else "journal_failed", message=event.message)
        ctx.journal_ok = event.ok
        ctx.journal_problem = event.message

    def _control_done(self, event: ControlDone) -> None:
        settled = self.kv.release_done(event)
        if settled is not None:
            self.lifecycle.release_settled(settled)
        elif not self.load.done(event):
            self.health.probe_done(event)

    def _admit_arrivals(self) -> None:
        """Hand the completion requests read whole to admission; fire ``ADMIT`` for those admitted at once."""
        arrived = self.clients.arrived
        while arrived:
            conn, rid, route, request = arrived.popleft()
            req = self.requests.accept(conn, rid, route, request)
            if req is not None:
                self.lifecycle.fire(req, Input.ADMIT)

    def _client_gone(self, conn: Conn) -> None:
        """The connection went away: its request, if it has no answer yet, is cancelled."""
        req = self.requests.unanswered(conn)
        if req is not None:
            self.lifecycle.fire(req, Input.CLIENT_GONE)

    def _abandon_all(self) -> None:
        """Shutdown's grace ran out: every request left ends now."""
        fire = self.lifecycle.fire
        for pending in list(self.requests.active.values()):
            if pending.state is not State.DONE:
                fire(pending, Input.ABANDON)

    def _follow_up_one(self, work: FollowUp) -> None:
        """Do one piece of the work an event left for other requests."""
        if work is FollowUp.ADMIT:
            self._admit_from_queue()
        elif work is FollowUp.WAKE_DECODE:
            self._wake(DECODE)
        elif work is FollowUp.WAKE_PREFILL:
            self._wake(PREFILL)
        elif self.slots.waiting[PREFILL]:  # WAKE_PREFILLS
            self._wake_prefills()

    def _admit_from_queue(self) -> None:
        """Admit queued requests while slots are free."""
        admission = self.admission
        active = self.requests.active
        rid = admission.next_from_queue()
        while rid is not None:
            req = active[rid]
            self.requests.disarm(req, "queue")
            self.lifecycle.fire(req, Input.ADMIT)
            rid = admission.next_from_queue()

    def _wake(self, phase: Phase) -> None:
        """A slot freed up on an engine of ``phase``: the oldest request waiting for one takes it."""
        slots = self.slots
        if phase == PREFILL and self._ctx.pd and slots.decode_backlog():
            return  # prefilled requests waiting for a decode engine go first
        req = slots.next_waiter(phase)
        while req is not None:
            self.lifecycle.fire(req, Input.WAKE)
            leg = req.leg
            if (leg is not None and leg.phase == phase) or (req.waiting_for_slot and req.retry_phase == phase):
                break  # it took the slot (or found none)
            # It went elsewhere (its KV's lease ran short: prefilled again): the slot is still free.
            req = slots.next_waiter(phase)
        if phase == DECODE and slots.waiting[PREFILL]:
            self._wake_prefills()

    def _wake_prefills(self) -> None:
        """Start the prefills held back behind the decode backlog, as many as the prefill engines take."""
        ctx = self._ctx
        slots = self.slots
        waiters = slots.waiting[PREFILL]
        for _ in range(len(waiters)):
            if not waiters or (ctx.pd and slots.decode_backlog()) or not ctx.fleet.has_room(PREFILL):
                return
            self._wake(PREFILL)

    def _client_stalled(self, event: ClientStalled) -> None:
        conn = self.clients.conns.get(event.conn)
        if conn is None:
            return
        conn.stalled = event.stalled
        req = None if conn.rid is None else self.requests.active.get(conn.rid)
        leg = None if req is None else req.leg
        if leg is not None:
            self.legs.hold(leg, event.stalled)

    def _request_of(self, event: Event | None) -> Request | None:
        """The unfinished request ``event`` is about, if any (a client's, or one of its legs')."""
        active = self.requests.active
        if isinstance(event, (ClientData, ClientGone, ClientStalled, ClientConnected)):
            handle = event.conn
            conn = self.clients.conns.get(handle)
            if conn is not None and conn.rid is not None:
                return active.get(conn.rid)
            for req in active.values():
                if req.conn is not None and req.conn.handle == handle:
                    return req
        elif isinstance(event, (LegData, LegFailed)):
            leg = self.legs.running.get(event.leg)
            if leg is not None:
                return active.get(leg.rid)
            for req in active.values():
                if any(leg.bid == event.leg for leg in req.legs):
                    return req
        elif isinstance(event, ControlDone):
            return self.kv.request_of(event.key)
        elif isinstance(event, PromptTokenized):
            return active.get(event.key.partition(":")[0])
        return None

    def _begin_shutdown(self) -> None:
        ctx = self._ctx
        requests = self.requests
        if ctx.draining:
            # Asked again (a second signal): what is left is cut short now,
            # as when the grace period ends, KV releases included.
            self._abandon_all()
            self._abandon_all()
            requests.check_drained()
            return
        ctx.draining = True
        ctx.log("draining", requests=len(requests.active))
        self.clients.close_idle()
        self.health.stop_probing()
        self.load.stop()
        ctx.timers.arm(ctx.now + self.config.shutdown.grace_s, self._grace_over, self)
        requests.check_drained()

    def _grace_over(self, _: object) -> None:
        self._abandon_all()
        self.requests.check_drained()


def _admission(config: Config) -> Admission | FairAdmission:
    """The admission limits; with ``[tenants]``, a fair queue (docs/operate.md, "Tenants"), else a FIFO one."""
    a = config.admission
    if config.tenants is None:
        return Admission(
            max_inflight=a.max_inflight, queue_size=a.queue_size, per_client_max_inflight=a.per_client_max_inflight,
        )
    return FairAdmission(
        max_inflight=a.max_inflight, queue_size=a.queue_size, per_client_max_inflight=a.per_client_max_inflight,
        tenants=config.tenants,
    )


def _fleet(config: Config, tokenizer: PromptTokenizer | None) -> Fleet:
    """The configured engines, with the routing policy the configuration names."""
    e = config.engine
    return Fleet(
        e.prefill_engines,
        e.decode_engines,
        max_inflight_per_engine=e.max_inflight_per_engine,
        unhealthy_after=config.health.unhealthy_after,
        healthy_after=config.health.healthy_after,
        kv_host_allowed=e.kv_host_allowed,
        policy=make_policy(config.routing, tokenizer),
        pd=bool(e.prefill_engines) or config.discovery.may_prefill(e.discovery),
    )
