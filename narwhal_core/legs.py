# cython: annotation_typing=True
# (Compiled, the parameters annotated with a class that a .pxd declares are typed: see setup.py.)
"""Engine legs: one HTTP request to a prefill or decode engine each, from start to verdict.

:class:`Legs` starts a request's leg on the engine the fleet chose, reads its
answer through the leg's codec, relays a streamed answer as it comes,
judges the whole answer (feeding the request's lifecycle the input it
amounts to), and accounts for the leg's end on its engine. It also keeps a
finished stream's connection read to its end (the "tail"), the prefill legs
left running for a client that went away so that their KV can be released
(the "orphans"), and the one re-send of a leg whose pooled connection the
engine had closed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from . import wire
from .errors import NarwhalError, RemoteProtocolError
from .events import CancelLeg, FinishLeg, LegFailed, StartLeg
from .http1 import NEED_DATA, BodyData, EngineCodec, ResponseEnd, ResponseHead
from .ids import DECODE, PREFILL, Phase, backend_id
from .journal import LegOutcome
from .states import Input, LegAnswer, LegFailure, LegRefusal, State
from .planning import (
    PrefillAnswerError,
    SseRelay,
    check_prefill_answer,
    decode_body,
    engine_error,
    normalise_answer,
    prefill_body,
)

if TYPE_CHECKING:
    from .context import Context
    from .fleet import EngineState, Health
    from .kv import Kv, KvLedger
    from .lifecycle import Lifecycle
    from .requests import Request, Requests
    from .slots import SlotQueue
    from .timers import Timer

__all__ = ["Leg", "Legs"]

_REDACTED: Final = b"[redacted]"
# An engine's 4xx that is not a verdict on the client's request: a timeout or
# overload (another engine may take it), a credential, route or model name of
# Narwhal's own. These fail the leg like a 5xx; any other 4xx is the client's
# mistake (see Lifecycle.refused).
_NOT_THE_CLIENTS: Final = frozenset({401, 403, 404, 408, 429})
# Leg outcomes that say nothing about the engine's health.
_NO_VERDICT: Final = frozenset({"cancelled", "local_error"})


class Leg:
    """One engine request of a completion request (a leg of its terminal record)."""

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
        self.kv: Kv | None = None
        self.open = True
        self.streaming = False
        self.got_bytes = False
        self.fresh_retry = False
        #: A prefill leg left running after its client went away, so that the KV
        #: it may already hold can be named and released.
        self.orphan = False
        #: Held back by the adapter for a client that is not reading
        #: (:class:`~narwhal_core.events.ClientStalled`): its time limit does not run.
        self.held = False
        #: The batch prompt it serves (``None``: a one-prompt request).
        self.prompt: int | None = None


class Legs:
    """The legs running, by backend ID; their answers, relays, tails, orphans and re-sends."""

    __slots__ = ("ctx", "running", "requests", "lifecycle", "kv", "health", "slots")

    def __init__(self, ctx: Context) -> None:
        self.ctx: Final = ctx
        #: Legs whose engine connection is still in use, by backend ID.
        self.running: dict[str, Leg] = {}

    def connect(
        self, *, requests: Requests, lifecycle: Lifecycle, kv: KvLedger, health: Health, slots: SlotQueue
    ) -> None:
        """The parts this one calls."""
        self.requests = requests
        self.lifecycle = lifecycle
        self.kv = kv
        self.health = health
        self.slots = slots

    # ------------------------------------------------------------------- start

    def start(self, req: Request, phase: Phase, engine: EngineState) -> None:
        """Send the request's next ``phase`` leg to ``engine``."""
        ctx = self.ctx
        attempt = req.attempts[phase] + 1
        req.attempts[phase] = attempt
        bid = backend_id(req.rid, phase, attempt)
        if phase == PREFILL:
            body = wire.dumps(prefill_body(req.accepted.body))
        else:
            kv = req.kv
            body = wire.dumps(req.accepted.body if kv is None else decode_body(req.accepted.body, kv.handoff.params))
        timeout = self.limit(phase, False)
        codec = ctx.codec.engine_connection(max_body_bytes=ctx.config.engine.max_response_bytes)
        data = codec.send_request("POST", req.route, ctx.engine_headers(engine.address, bid), body)
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
        ctx.fleet.leg_started(engine)
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

    def timer_fired(self, leg: Leg) -> None:
        leg.timer = None
        if leg.deadline > self.ctx.now:
            self.set_deadline(leg, leg.deadline)
        elif leg.outcome is not None:
            self.drop_tail(leg)  # a finished stream's body that never ended
        elif not leg.held:  # (held: re-armed when its client catches up)
            self.fail_leg(leg, "timeout")

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

    # ------------------------------------------------------------ the answer

    def data(self, leg: Leg, data: bytes) -> None:
        """Bytes of the leg's answer arrived (empty: the engine closed its side)."""
        if data:
            leg.got_bytes = True  # the engine saw the request: never re-send it
        codec = leg.codec
        codec.receive_data(data)
        if leg.outcome is not None:
            self.read_tail(leg)
            return
        req = self.requests.active[leg.rid]
        while leg.open:
            try:
                event = codec.next_event()
            except RemoteProtocolError as exc:
                self.fail_leg(leg, "dropped" if exc.reason == "dropped" else "bad_response")
                return
            if event is NEED_DATA:
                return
            kind = type(event)
            if kind is BodyData:
                if leg.streaming:
                    self.relay(req, leg, event.data)  # type: ignore[union-attr]
                    if leg.outcome is not None and leg.open:
                        self.read_tail(leg)  # [DONE] came: what follows is dropped
                        return
                else:
                    leg.body.append(event.data)  # type: ignore[union-attr]
            elif kind is ResponseHead:
                self._head(req, leg, event.status)  # type: ignore[union-attr]
            elif kind is ResponseEnd:
                leg.open = False
                self.ctx.out.append(FinishLeg(leg.bid, event.reusable))  # type: ignore[union-attr]
                self.answered(req, leg)
                return

    def _head(self, req: Request, leg: Leg, status: int) -> None:
        leg.status = status
        if leg.phase != DECODE or not 200 <= status < 300:
            return
        kv = req.kv
        if req.stream:
            leg.streaming = True
            previous = req.relay
            ctx = self.ctx
            req.relay = SseRelay(
                route=req.route, model=ctx.model, pd=ctx.pd and not req.plain_decode,
                cached_tokens=None if kv is None else kv.handoff.cached_tokens,
                redact=ctx.secret,
            )
            if req.prompts is not None:
                # One prompt of a batch: indexes rewritten, one [DONE] at the end.
                req.relay.batch(
                    req.prompt, req.prompt + 1 == len(req.prompts), req.usage,
                    None if previous is None else previous.response_id,
                )
        if kv is not None and not req.stream:
            # A whole answer's head comes after the generation: the decode
            # engine had the KV. A stream's head proves nothing (vLLM sends it
            # before the request reaches its engine): its KV counts as pulled
            # at the first data event (relay).
            self.kv.pulled(req, kv)

    def relay(self, req: Request, leg: Leg, data: bytes) -> None:
        """Relay a streamed answer's bytes to the client, rewritten (:class:`~narwhal_core.planning.SseRelay`)."""
        relay = req.relay
        assert relay is not None
        try:
            out = relay.feed(data)
        except NarwhalError:
            if relay.good_before_error:
                self.requests.stream_out(req, relay.good_before_error)
            self.fail_leg(leg, "bad_response")
            return
        # (limit(phase, True), read directly: this runs once per relayed chunk)
        self.set_deadline(leg, self.ctx.now + self.ctx.config.engine.stream_idle_timeout_s)
        kv = req.kv
        if kv is not None and relay.events and relay.error is None:
            # The first data event: the decode engine sampled a token, so it had the KV.
            self.kv.pulled(req, kv)
        if out:
            self.requests.stream_out(req, out)
        if relay.done and leg.outcome is None:
            self.stream_done(req, leg)

    def stream_done(self, req: Request, leg: Leg) -> None:
        """``data: [DONE]`` is relayed: the client's answer is complete.

        Its chunked body ends now and the request is ``completed``, whenever
        the engine's body ends (a client such as the openai SDK closes as
        soon as it reads ``[DONE]``). The leg is done too; its connection is
        still read, what comes is dropped, and it goes back to the pool if
        the body ends cleanly within the stream idle limit, else it is
        closed (:meth:`read_tail`).
        """
        # The leg's outcome is settled; it stays in self.running (fed LegData
        # and LegFailed) and counts against its engine until its body ends.
        ctx = self.ctx
        leg.outcome = "ok"
        leg.ended = ctx.now
        leg.held = False
        ctx.fleet.record_success(leg.engine, probe=False)
        if req.leg is leg:
            req.leg = None
        self.set_deadline(leg, ctx.now + ctx.config.engine.stream_idle_timeout_s)
        if req.state is State.STREAMING or req.state is State.DECODE:
            self.lifecycle.fire(req, Input.LEG_OK)

    def answered(self, req: Request, leg: Leg) -> None:
        """The leg's whole answer is in: judge it, and feed the request the input it amounts to."""
        status = leg.status or 0
        body = b"".join(leg.body)
        leg.body = []
        secret = self.ctx.secret
        if secret is not None and secret in body:
            # An engine quoting the credential it was sent must not hand it on.
            body = body.replace(secret, _REDACTED)
        if leg.orphan:
            self._orphan_answered(req, leg, status, body)
        elif not 200 <= status < 300:
            if 400 <= status < 500 and status not in _NOT_THE_CLIENTS:
                self.record_end(leg, "refused")
                self.lifecycle.fire(req, Input.LEG_REFUSED, LegRefusal(engine_error(status, body), leg))
            else:
                self._failed(req, leg, "http_error")
        elif leg.phase == PREFILL:
            self._prefill_answered(req, leg, body)
        elif leg.streaming:
            relay = req.relay
            assert relay is not None
            if relay.done or (relay.events and relay.error is not None):
                self.record_end(leg, "ok")
                self.lifecycle.fire(req, Input.LEG_OK)
            else:
                self._failed(req, leg, "bad_response")
        else:
            self._decode_answered(req, leg, body)

    def _failed(self, req: Request, leg: Leg, reason: LegOutcome, error: NarwhalError | None = None) -> None:
        self.record_end(leg, reason, failed=True)
        self.lifecycle.fire(req, Input.LEG_FAILED, LegFailure(reason, leg, error))

    def _prefill_answered(self, req: Request, leg: Leg, body: bytes) -> None:
        try:
            handoff = check_prefill_answer(
                body, leg.bid, self.health.kv_host_allowed,
                require_request_id=self.ctx.stats.kv_connector.get(leg.engine.url) == 2,
            )
        except PrefillAnswerError as exc:
            self._failed(req, leg, "bad_kv", exc)
            return
        if handoff.params is not None:
            self.kv.note_connector(leg.engine.url, handoff.params)
        self.record_end(leg, "ok")
        if handoff.params is None:
            self.kv.no_handoff(req, leg, handoff)
        else:
            req.plain_decode = False
            self.kv.handed_off(req, leg, handoff)
        self.lifecycle.fire(req, Input.LEG_OK)

    def _decode_answered(self, req: Request, leg: Leg, body: bytes) -> None:
        try:
            answer = wire.loads_answer(body)
        except wire.JsonError:
            answer = None
        if not isinstance(answer, dict):
            self._failed(req, leg, "bad_response")
            return
        self.record_end(leg, "ok")
        ctx = self.ctx
        normalise_answer(
            req.route, answer, ctx.model, pd=ctx.pd and not req.plain_decode, cached_tokens=req.pulled_cached_tokens,
        )
        self.lifecycle.fire(req, Input.LEG_OK, LegAnswer(answer))

    # ----------------------------------------------------------------- tails

    def read_tail(self, leg: Leg) -> None:
        """Read a finished stream's leg to the end of its body, dropping what comes (see :meth:`stream_done`)."""
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
        self.ctx.fleet.leg_ended(leg.engine)
        if self.slots.waiting[leg.phase]:
            self.slots.wake(leg.phase)

    # ------------------------------------------------------------------- ends

    def record_end(self, leg: Leg, outcome: LegOutcome, *, failed: bool = False) -> None:
        """Account for a leg's end: its outcome, its engine's load and health, the request's current leg."""
        ctx = self.ctx
        leg.outcome = outcome
        leg.ended = ctx.now
        if leg.timer is not None:
            leg.timer.cancel()
            leg.timer = None
        self.running.pop(leg.bid, None)
        engine = leg.engine
        ctx.fleet.leg_ended(engine)
        req = self.requests.active.get(leg.rid)
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
            self.slots.wake(leg.phase)

    def cancel(self, leg: Leg) -> None:
        """Stop the leg: close its connection; its outcome, if it has none yet, is ``cancelled``."""
        if leg.open:
            leg.open = False
            self.ctx.out.append(CancelLeg(leg.bid))
        if leg.outcome is None:
            self.record_end(leg, "cancelled")

    def fail_leg(self, leg: Leg, reason: LegOutcome) -> None:
        """The leg failed on our side of the engine (timeout, bad bytes, dropped)."""
        if leg.open:
            leg.open = False
            self.ctx.out.append(CancelLeg(leg.bid))
        self.record_end(leg, reason, failed=True)
        req = self.requests.active[leg.rid]
        if leg.orphan:
            self.requests.release_settled(req)
            return
        self.lifecycle.fire(req, Input.LEG_FAILED, LegFailure(reason, leg))

    def connection_lost(self, leg: Leg, event: LegFailed) -> None:
        """The adapter reports the leg's connection failed (:class:`~narwhal_core.events.LegFailed`)."""
        if leg.outcome is not None:
            leg.open = False  # a finished stream's connection broke: nothing is lost
            self.drop_tail(leg)
        elif event.reused and not leg.got_bytes and not leg.fresh_retry and self.may_resend(leg):
            # A pooled connection the engine had closed: try once more on a
            # fresh one; the engine never saw the request.
            leg.fresh_retry = True
            conn = self.requests.active[leg.rid].conn
            self.ctx.out.append(StartLeg(
                leg.bid, leg.engine.address, leg.data, None if conn is None else conn.handle,
                self.ctx.config.engine.connect_timeout_s, True,
            ))
        else:
            self._connection_failed(leg, event)

    def _connection_failed(self, leg: Leg, event: LegFailed) -> None:
        leg.open = False
        if event.reason == "local_error":
            # Narwhal's own shortage (file descriptors...): not the engine's fault.
            self.ctx.shortage(f"{leg.phase} leg")
            self.record_end(leg, "local_error")
        else:
            self.record_end(leg, "connect_failed" if event.reason != "dropped" else "dropped", failed=True)
        req = self.requests.active[leg.rid]
        if leg.orphan:
            self.requests.release_settled(req)
            return
        self.lifecycle.fire(req, Input.LEG_FAILED, LegFailure(event.reason, leg))

    def may_resend(self, leg: Leg) -> bool:
        """Whether a leg may go out again on a fresh connection: a decode leg not past its KV's ``start_by``."""
        if leg.phase != DECODE:
            return True
        req = self.requests.active.get(leg.rid)
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

    def _orphan_answered(self, req: Request, leg: Leg, status: int, body: bytes) -> None:
        if 200 <= status < 300:
            try:
                handoff = check_prefill_answer(body, leg.bid, self.health.kv_host_allowed)
            except PrefillAnswerError:
                self.record_end(leg, "bad_kv", failed=True)
            else:
                self.record_end(leg, "ok")
                if handoff.params is None:
                    self.kv.no_handoff(req, leg, handoff)  # nothing held: nothing to release
                else:
                    self.kv.handed_off(req, leg, handoff)
                    self.kv.release(req)
        else:
            self.record_end(leg, "refused" if 400 <= status < 500 else "http_error", failed=status >= 500)
        self.requests.release_settled(req)

    def cancel_orphans(self, req: Request) -> None:
        """Stop the request's orphaned prefills (shutdown, or a request failed closed)."""
        for leg in req.legs:
            if leg.orphan and leg.outcome is None:
                self.cancel(leg)

