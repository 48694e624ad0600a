"""Engine legs: one HTTP request to a prefill or decode engine each, from start to end.

:class:`Legs` starts a request's leg on the engine the fleet chose, keeps
its time limit (suspended while the adapter holds it back for a client that
is not reading), and accounts for its end on its engine: load, health
verdict, the request's current leg; a failed leg's verdict is returned for
the lifecycle to act on. It reads a finished stream's connection to the end
of its body (the "tail"), keeps the prefill legs left running for a client
that went away so that their KV can be released (the "orphans"), and makes
the one re-send of a leg whose pooled connection the engine had closed.
What the engine answers is :mod:`~narwhal_core.answers`'.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from . import wire
from .errors import RemoteProtocolError
from .events import CancelLeg, FinishLeg, LegFailed, StartLeg
from .http import NEED_DATA, EngineCodec, ResponseEnd
from .ids import DECODE, PREFILL, Phase, backend_id
from .inflight import Leg
from .journal import LegOutcome
from .states import WAKE, LegEnded
from .verdicts import LegFailure, Verdict

if TYPE_CHECKING:
    from .context import Context
    from .fleet import EngineState
    from .health import Health
    from .inflight import Kv, Request
    from .slots import SlotQueue
    from .timers import Timer

__all__ = ["Leg", "Legs"]

# Leg outcomes that say nothing about the engine's health.
_NO_VERDICT: Final = frozenset({"cancelled", "local_error"})


class Legs:
    """The legs running, by backend ID; their time limits, ends, tails, orphans and re-sends."""

    __slots__ = ("ctx", "running", "active", "health", "slots", "protocol")

    def __init__(self, ctx: Context, active: Mapping[str, Request], health: Health, slots: SlotQueue) -> None:
        self.ctx: Final = ctx
        #: Legs whose engine connection is still in use, by backend ID.
        self.running: dict[str, Leg] = {}
        #: The requests not yet terminal, by rid (the registry's own map, read only).
        self.active: Final = active
        self.health: Final = health
        self.slots: Final = slots
        #: The legs' bodies are the engine protocol's (docs/design.md, "Engine protocols").
        self.protocol: Final = ctx.protocol

    # ------------------------------------------------------------------- start

    def start(self, req: Request, phase: Phase, engine: EngineState) -> None:
        """Send the request's next ``phase`` leg to ``engine``."""
        ctx = self.ctx
        attempt = req.attempts[phase] + 1
        req.attempts[phase] = attempt
        bid = backend_id(req.rid, phase, attempt)
        tokens = 0
        sent_id = None
        if phase == PREFILL:
            body = wire.dumps(self.protocol.prefill_body(req.accepted.body))
            plan = req.plan
            if plan is not None:
                tokens = plan.tokens
                if plan.hashes is not None:
                    ctx.fleet.policy.sent(engine, plan)  # the prefix index learns where the prompt went
        else:
            kv = req.kv
            if kv is None:
                body = wire.dumps(req.accepted.body)
            else:
                body = wire.dumps(self.protocol.decode_body(req.accepted.body, kv.handoff.params))
                sent_id = kv.decode_request_id()
        timeout = self.limit(phase, False)
        codec = ctx.codec.engine_connection(max_body_bytes=ctx.config.engine.max_response_bytes)
        headers = ctx.engine_headers(engine.address, bid if sent_id is None else sent_id)
        if req.trace is not None:
            headers += req.trace.leg_headers(bid)  # each leg a child span (docs/contract.md)
        data = codec.send_request("POST", req.route, headers, body)
        leg = Leg(
            bid=bid, phase=phase, attempt=attempt, engine=engine, codec=codec, rid=req.rid,
            started=ctx.now, data=data, deadline=0.0,
        )
        self.set_deadline(leg, ctx.now + timeout)
        if req.conn is not None and req.conn.stalled:
            leg.held = True  # its client is not reading (see hold)
        self.running[bid] = leg
        req.leg = leg
        req.legs.append(leg)
        if req.prompts is not None:
            leg.prompt = req.prompt
        leg.tokens = tokens
        leg.request_id = sent_id
        ctx.fleet.leg_started(engine, tokens)
        ctx.out.append(StartLeg(
            bid, engine.address, data, None if req.conn is None else req.conn.handle,
            ctx.config.engine.connect_timeout_s,
        ))

    # ------------------------------------------------------------- time limits

    def limit(self, phase: Phase, streaming: bool) -> float:
        """How long a leg may go without an answer (or, streaming, between two reads)."""
        e = self.ctx.config.engine
        if streaming:
            return e.stream_idle_timeout_s
        return e.prefill_timeout_s if phase == PREFILL else e.decode_timeout_s

    def set_deadline(self, leg: Leg, when: float) -> None:
        """Move the leg's time limit to ``when``."""
        # Deadlines move without touching the heap; a new timer is armed only
        # when the deadline comes earlier than the one already armed.
        leg.deadline = when
        if leg.timer is None or when < leg.armed:
            if leg.timer is not None:
                leg.timer.cancel()
            leg.armed = when
            leg.timer = self.ctx.timers.arm(when, self.timer_fired, leg)

    def timer_fired(self, leg: Leg) -> Verdict | None:
        """The leg's timer is due: its verdict when its time limit passed (the router hands it to the lifecycle)."""
        leg.timer = None
        if leg.deadline > self.ctx.now:
            self.set_deadline(leg, leg.deadline)
        elif leg.outcome is not None:
            self.drop_tail(leg)  # a finished stream's body that never ended
        elif not leg.held:  # (held: re-armed when its client catches up)
            return self.fail_leg(leg, "timeout")
        return None

    def hold(self, leg: Leg, stalled: bool) -> None:
        """The adapter holds back (or lets go) the leg feeding a client that is not reading.

        The engine's silence is then the client's doing, not a stalled
        engine (which would fail the request and count against a healthy
        engine). The leg's limit is suspended (a leg started meanwhile
        starts held); meanwhile the client's send timeout and the request
        deadline apply. A leg held past its limit gets the whole limit again
        once the client catches up.
        """
        if leg.held == stalled:
            return
        if stalled:
            leg.held = True
        else:
            self.unhold(leg)

    def unhold(self, leg: Leg) -> None:
        """The leg's time limit runs again; the whole limit, when it passed while held."""
        leg.held = False
        now = self.ctx.now
        if leg.deadline <= now:
            self.set_deadline(leg, now + self.limit(leg.phase, leg.streaming))

    # ------------------------------------------------------------------- ends

    def account_end(self, leg: Leg, outcome: LegOutcome, *, failed: bool = False) -> None:
        """Account for a leg's end: its outcome, its engine's load and health, the request's current leg."""
        ctx = self.ctx
        leg.outcome = outcome
        leg.ended = ctx.now
        if leg.timer is not None:
            leg.timer.cancel()
            leg.timer = None
        self.running.pop(leg.bid, None)
        engine = leg.engine
        ctx.fleet.leg_ended(engine, leg.tokens)
        req = self.active.get(leg.rid)
        if failed:
            self.health.engine_failed(engine, f"{leg.phase} leg: " + (
                f"HTTP {leg.status}" if outcome == "http_error" and leg.status else outcome))
            if req is not None:
                req.failed_on[leg.phase].append(engine)
        elif outcome not in _NO_VERDICT:
            ctx.fleet.record_success(engine, probe=False)
        if req is not None and req.leg is leg:
            req.leg = None
        if self.slots.waiting[leg.phase]:
            self.ctx.followups.append(WAKE[leg.phase])  # the router wakes a waiter once the event is handled

    def cancel(self, leg: Leg) -> None:
        """Stop the leg: close its connection; its outcome, if it has none yet, is ``cancelled``."""
        if leg.open:
            leg.open = False
            self.ctx.out.append(CancelLeg(leg.bid))
        if leg.outcome is None:
            self.account_end(leg, "cancelled")

    def fail_leg(self, leg: Leg, reason: LegOutcome) -> Verdict:
        """The leg failed on our side of the engine (timeout, bad bytes, dropped): its verdict."""
        if leg.open:
            leg.open = False
            self.ctx.out.append(CancelLeg(leg.bid))
        self.account_end(leg, reason, failed=True)
        return LegEnded.SETTLED if leg.orphan else LegFailure(reason, leg)

    def connection_lost(self, leg: Leg, event: LegFailed) -> Verdict | None:
        """The adapter reports the leg's connection failed (:class:`~narwhal_core.events.LegFailed`): its verdict."""
        if leg.outcome is not None:
            leg.open = False  # a finished stream's connection broke: nothing is lost
            self.drop_tail(leg)
        elif event.reused and not leg.got_bytes and not leg.fresh_retry and self.may_resend(leg):
            # A pooled connection the engine had closed: try once more on a
            # fresh one; the engine never saw the request.
            leg.fresh_retry = True
            conn = self.active[leg.rid].conn
            self.ctx.out.append(StartLeg(
                leg.bid, leg.engine.address, leg.data, None if conn is None else conn.handle,
                self.ctx.config.engine.connect_timeout_s, True,
            ))
        else:
            return self._connection_failed(leg, event)
        return None

    def _connection_failed(self, leg: Leg, event: LegFailed) -> Verdict:
        leg.open = False
        if event.reason == "local_error":
            # Narwhal's own shortage (file descriptors...): not the engine's fault.
            self.ctx.shortage(f"{leg.phase} leg")
            self.account_end(leg, "local_error")
        else:
            self.account_end(leg, "connect_failed" if event.reason != "dropped" else "dropped", failed=True)
        return LegEnded.SETTLED if leg.orphan else LegFailure(event.reason, leg)

    def may_resend(self, leg: Leg) -> bool:
        """Whether a leg may go out again on a fresh connection: a decode leg not past its KV's ``start_by``."""
        if leg.phase != DECODE:
            return True
        req = self.active.get(leg.rid)
        kv = None if req is None else req.kv
        return kv is None or self.ctx.now < kv.start_by

    # ---------------------------------------------------------------- orphans

    def orphan(self, req: Request, leg: Leg) -> None:
        """Keep reading a prefill whose client went away, to release the KV its answer names."""
        leg.orphan = True
        req.leg = None
        req.pending_releases += 1
        if leg.held:
            self.unhold(leg)  # its client is gone: nothing holds it back now

    def cancel_orphans(self, req: Request) -> None:
        """Stop the request's orphaned prefills (shutdown, or a request failed closed)."""
        for leg in req.legs:
            if leg.orphan and leg.outcome is None:
                self.cancel(leg)

    # ------------------------------------------------------------------ tails

    def read_tail(self, leg: Leg) -> None:
        """Read a finished stream's leg to the end of its body, dropping what comes.

        (See :meth:`~narwhal_core.answers.Answers.stream_done`.) It goes back
        to the pool if its body ends cleanly, else it is closed.
        """
        codec = leg.codec
        while leg.open:
            try:
                event = codec.next_event()
            except RemoteProtocolError:
                self.drop_tail(leg)
                return
            if event is NEED_DATA:
                return
            if type(event) is ResponseEnd:
                leg.open = False
                self.ctx.out.append(FinishLeg(leg.bid, event.reusable))
                self._tail_ended(leg)
                return

    def drop_tail(self, leg: Leg) -> None:
        """Close a finished stream's leg whose body did not end cleanly (no verdict on the engine)."""
        if leg.open:
            leg.open = False
            self.ctx.out.append(CancelLeg(leg.bid))
        self._tail_ended(leg)

    def _tail_ended(self, leg: Leg) -> None:
        if self.running.pop(leg.bid, None) is None:
            return
        if leg.timer is not None:
            leg.timer.cancel()
            leg.timer = None
        self.ctx.fleet.leg_ended(leg.engine, leg.tokens)
        if self.slots.waiting[leg.phase]:
            self.ctx.followups.append(WAKE[leg.phase])  # the router wakes a waiter once the event is handled
