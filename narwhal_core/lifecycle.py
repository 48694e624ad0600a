"""One request's lifecycle: a table of (state, input) -> handler, and the handlers (like h2's state machine).

``TRANSITIONS[(state, input)]`` is the :class:`Lifecycle` method that handles
the input in that state and the states it may leave the request in. Each
handler is a typed callable taking the request and the input's data (one of
the frozen :class:`LegAnswer`, :class:`LegRefusal`, :class:`LegFailure`, or
``None`` for an input that carries none) and returning the request's next
state. A pair that is not in the table fails closed: :meth:`Lifecycle.fire`
raises :class:`~narwhal_core.errors.TransitionError` naming both, after
ending the request with a terminal record so that nothing is lost; so does
a handler that returns a state its row does not allow.

States::

    QUEUED ──ADMIT──▶ PREFILL ──LEG_OK──▶ DECODE ──FIRST_BYTES──▶ STREAMING
       │    ╲            │  ▲                │  ▲                     │
       │   ADMIT   LEG_FAILED│WAKE     LEG_FAILED│WAKE               LEG_OK / LEG_FAILED
       │      ╲          ▼  │                ▼  │                     ▼
       │  TOKENIZING  PREFILL_WAIT        DECODE_WAIT               RELEASING ──RELEASED──▶ DONE
       │   (TOKENIZED ──▶ the first leg, as ADMIT)
       └──────────── any of CLIENT_GONE, DEADLINE, ABANDON, QUEUE_TIMEOUT ──▶ RELEASING / DONE

``RELEASING``: the client has its answer (or is gone) and KV releases are
still in flight; the terminal record waits for their outcome.
(docs/design.md, "A request's life", has the table as states x inputs.)
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from .contract import CHAT
from .errors import NarwhalError, TransitionError
from .events import PromptTokenized, TokenizePrompt
from .ids import DECODE, PREFILL, Phase
from .leg_bodies import merge_answers
from .states import FollowUp, Input, LegEnded, State
from .verdicts import InputData, LegAnswer, LegFailure, LegRefusal, Verdict

if TYPE_CHECKING:
    from .context import Context
    from .inflight import Kv, Leg, Request
    from .kv import KvLedger
    from .kv_policy import HeadProbe
    from .legs import Legs
    from .requests import Requests
    from .routing import Routing
    from .slots import SlotQueue

__all__ = ["State", "Input", "LegAnswer", "LegRefusal", "LegFailure", "Lifecycle", "TRANSITIONS"]

_CLIENT_GONE_STATUS: Final = 499
# Why a leg failed -> (status, code) once retries are exhausted, per phase.
_GIVE_UP: Final[Mapping[str, tuple[int, str]]] = MappingProxyType({
    "timeout": (504, "engine_timeout"),
    "connect_failed": (503, "engine_unavailable"),
    "connect_timeout": (503, "engine_unavailable"),
    "local_error": (503, "router_resources_exhausted"),
})


#: The input each leg verdict that carries data amounts to (:meth:`Lifecycle.judged`).
_VERDICT_INPUT: Final[Mapping[type, Input]] = MappingProxyType({
    LegFailure: Input.LEG_FAILED, LegAnswer: Input.LEG_OK, LegRefusal: Input.LEG_REFUSED,
})

#: A row's handler: the :class:`Lifecycle` method, unbound.
Handler = Callable[["Lifecycle", "Request", Any], State]


class Lifecycle:
    """The handlers of the lifecycle table, and :meth:`fire`, which runs the row of an input."""

    __slots__ = ("ctx", "requests", "legs", "kv", "slots")

    def __init__(self, ctx: Context, requests: Requests, legs: Legs, kv: KvLedger, slots: SlotQueue) -> None:
        self.ctx: Final = ctx
        self.requests: Final = requests
        self.legs: Final = legs
        self.kv: Final = kv
        self.slots: Final = slots

    def fire(self, req: Request, event: Input, data: InputData = None) -> None:
        """Run the request's row for ``event``: its handler, then the state it returned (checked)."""
        row = TRANSITIONS.get((req.state, event))
        if row is None:
            state = req.state
            if state is State.DONE:
                return
            self.fail_closed(req, f"no transition for {state.value} on {event.value}")
            raise TransitionError(f"request {req.rid}: no transition for state {state.value} on input {event.value}")
        handler, allowed = row
        new_state = handler(self, req, data)
        if new_state not in allowed:
            name = handler.__name__
            self.fail_closed(req, f"{name} left {req.state.value} for {new_state.value} on {event.value}")
            raise TransitionError(
                f"request {req.rid}: {name} moved {req.state.value} to {new_state.value} on {event.value}"
            )
        if req.state is not State.DONE:
            req.state = new_state
        if new_state is State.RELEASING and req.pending_releases == 0:
            self.fire(req, Input.RELEASED)

    def judged(self, leg: Leg, verdict: Verdict) -> None:
        """Act on a leg's verdict (:mod:`~narwhal_core.answers`, :mod:`~narwhal_core.legs`).

        ``FIRST_BYTES`` first when the leg's stream just sent the client its
        first bytes: a failure after them ends the stream (docs/contract.md).
        """
        req = self.requests.active[leg.rid]
        if leg.first_bytes:
            leg.first_bytes = False
            self.fire(req, Input.FIRST_BYTES)
        if verdict is LegEnded.OK:
            self.fire(req, Input.LEG_OK)
        elif verdict is LegEnded.SETTLED:
            self.release_settled(req)
        elif verdict is not LegEnded.RELAYED:
            self.fire(req, _VERDICT_INPUT[type(verdict)], verdict)

    def release_settled(self, req: Request) -> None:
        """One of the request's KV releases (or orphaned prefills) is settled; the last one ends it."""
        req.pending_releases -= 1
        if req.pending_releases == 0 and req.state is State.RELEASING:
            self.fire(req, Input.RELEASED)

    def fail_closed(self, req: Request, why: str) -> None:
        """The lifecycle went wrong for ``req``: log it, and end the request with a 500 (:meth:`abort`)."""
        self.ctx.log("internal_error", rid=req.rid, problem=why)
        self.abort(req)

    def abort(self, req: Request) -> None:
        """End a request whose state cannot be trusted: 500 ``internal_error``, its record written at once.

        Fail closed: stop everything the request holds, answer its client
        500 internal_error if it has no answer yet (a stream gets its error
        event), free its slot and journal it. Its unpulled KV is left to the
        engine's lease: the request's state cannot be trusted to release it.
        """
        requests = self.requests
        if req.leg is not None:
            self.legs.cancel(req.leg)
        self.legs.cancel_orphans(req)
        error = NarwhalError("Internal router error.", status=500, code="internal_error")
        if not req.answered:
            if req.state is State.QUEUED:
                self.ctx.admission.leave_queue(req.rid, req.client)
            requests.decide_end(req, "failed", error, sent=req.bytes_sent)
            requests.answer_internal_error(req)
            self.mark_answered(req)
        elif req.terminal is None:
            requests.decide_end(req, "failed", error)
        req.pending_releases = 0
        req.state = State.DONE
        requests.write_record(req)

    # ---------------------------------------------------- stopping and failing

    def mark_answered(self, req: Request) -> State:
        """The client has its answer (or is gone): free the slot; the record waits for KV.

        The freed admission slot and a decode backlog that may be gone are
        follow-up work for other requests (docs/design.md, "Follow-up work").
        """
        req.answered = True
        req.waiting_for_slot = False
        followups = self.ctx.followups
        if req.admitted:
            req.admitted = False
            admission = self.ctx.admission
            admission.release(req.client)
            if admission.queue:
                followups.append(FollowUp.ADMIT)
        req.conn = None
        self.requests.disarm(req, "deadline", "queue", "wake", "lease")
        if self.slots.waiting[PREFILL]:
            followups.append(FollowUp.WAKE_PREFILLS)  # it may have been the last one waiting for a decode engine
        return State.RELEASING

    def stop_request(self, req: Request) -> None:
        """Stop whatever the request is doing and release its unpulled KV."""
        if req.leg is not None:
            self.legs.cancel(req.leg)
        self.kv.release(req)

    def fail_request(self, req: Request, error: NarwhalError, *, leg: Leg | None = None) -> State:
        """Stop the request, answer its client ``error`` and free its slot; the record waits for KV."""
        self.stop_request(req)
        requests = self.requests
        requests.decide_end(req, "failed", error, leg=leg, sent=req.bytes_sent)
        requests.answer_error(req, retry_after=error.status == 503)
        return self.mark_answered(req)

    # -------------------------------------------------------- starting legs

    def start_phase(self, req: Request, phase: Phase) -> State:
        """Start the request's ``phase`` leg on the engine the fleet chooses, or wait for a slot."""
        ctx = self.ctx
        if phase == DECODE:
            kv = req.kv
            if kv is not None and ctx.now >= kv.start_by:
                return self._lease_ran_short(req, kv)  # never decode from KV whose lease may be gone
            engine = ctx.fleet.choose(phase, req.failed_on[phase], request_key=req.rid, now=ctx.now, plan=req.plan)
        elif ctx.pd and self.slots.decode_backlog():
            engine = None  # prefilled requests waiting for a decode engine go first (docs/operate.md, "KV leases")
        else:
            engine = ctx.fleet.choose(phase, req.failed_on[phase], request_key=req.rid, now=ctx.now, plan=req.plan)
        if engine is None:
            if ctx.fleet.has_healthy(phase):
                self.slots.wait(req, phase)
                if phase == PREFILL:
                    return State.PREFILL_WAIT
                if req.kv is not None:
                    self.requests.arm(req, "lease", req.kv.start_by)
                return State.DECODE_WAIT
            return self.fail_request(req, ctx.no_engine(phase))
        req.waiting_for_slot = False
        if phase == DECODE:
            kv = req.kv
            if kv is not None and kv.hold_ends != math.inf:
                self.requests.arm(req, "lease", kv.hold_ends)  # nothing renews it: watch its hold (hold_ending)
            elif "lease" in req.timers:
                self.requests.disarm(req, "lease")
        self.legs.start(req, phase, engine)
        return State.PREFILL if phase == PREFILL else State.DECODE

    def _lease_ran_short(self, req: Request, kv: Kv, *, read: bool = False) -> State:
        """No decode engine had room before the KV's ``start_by``: prefill again (a new attempt), or fail 503.

        Never decode from KV whose lease may have run out (docs/operate.md, "KV leases").
        ``read``: a decode leg had started but not read it by its ``hold_ends``.
        """
        ctx = self.ctx
        req.waiting_for_slot = False
        self.requests.disarm(req, "lease")
        retry = req.attempts[PREFILL] < ctx.config.retry.max_attempts
        ctx.log(
            "kv_lease_short", level="warning", rid=req.rid, engine=kv.engine.url, owner=kv.handoff.owner,
            kv_lease_s=ctx.config.engine.kv_lease_s, waited="decode_engine" if read else "decode_slot",
            then="prefill again" if retry else "fail 503",
        )
        self.kv.release_before_lease_ends(req, read=read)
        if retry:
            return self.start_phase(req, PREFILL)
        return self.fail_request(req, NarwhalError(
            "No decode engine read the prefilled KV before its lease ran short; try again later." if read else
            "No decode engine had room before the prefilled KV's lease ran short; try again later.",
            status=503, code="kv_lease_expired",
        ))

    def hold_ending(self, req: Request, _: None) -> State:
        """KV_HOLD_ENDING: the decode leg has not read KV nothing renews: cancel it (the engine may be
        queueing it; a late read finds freed blocks), prefill again or 503 (docs/operate.md, "KV leases")."""
        kv = req.kv
        assert kv is not None  # (only while the KV is unread)
        if req.leg is not None:
            self.legs.cancel(req.leg)
        return self._lease_ran_short(req, kv, read=True)

    # ------------------------------------------- handlers: each returns the next state

    def begin(self, req: Request, _: None) -> State:
        """ADMIT: the request has its slot; journal its progress and start its first leg.

        A prompt too large to tokenize on the event loop is weighed from its
        head when that settles it (the head look's probe goes to the plan),
        else tokenized first (:func:`_tokenize`): its plan, progress record
        and first leg wait for ``TOKENIZED``.
        """
        req.admitted = True
        tokenize, probe = _head_look(self.ctx.routing, req)
        if tokenize:
            return _tokenize(self.ctx, req)
        plan = req.plan = self.ctx.routing.plan(req.accepted.body, req.route, req.size, probe=probe)
        self.requests.journal_admitted(req)
        return self.start_phase(req, PREFILL if plan.pd else DECODE)

    def tokenized(self, req: Request, event: PromptTokenized) -> State:
        """TOKENIZED: the prompt's token ids are here (or the tokenizer failed): route by them, start the leg."""
        req.tokenizing = None
        routing = self.ctx.routing
        plan = req.plan
        if plan is None:  # the first prompt: admission goes on where begin left it
            plan = req.plan = routing.plan(req.accepted.body, req.route, req.size, event)
            self.requests.journal_admitted(req)
        else:  # a batch's next prompt
            plan = req.plan = routing.replan(plan, req.accepted.body, req.route, event)
        return self.start_phase(req, PREFILL if plan.pd else DECODE)

    def resume(self, req: Request, _: None) -> State:
        """WAKE: a retry's backoff ended, or an engine slot freed up."""
        return self.start_phase(req, req.retry_phase)

    def prefill_ok(self, req: Request, _: None) -> State:
        """LEG_OK in PREFILL: the KV's lease runs from now; the decode leg goes next."""
        kv = req.kv
        if kv is not None:
            self.kv.start_lease(kv)
        return self.start_phase(req, DECODE)

    def first_bytes(self, req: Request, _: None) -> State:
        """FIRST_BYTES: the answer streams; the decode leg can no longer be retried."""
        return State.STREAMING

    def decode_ok(self, req: Request, data: LegAnswer | None) -> State:
        """LEG_OK in DECODE or STREAMING: the prompt is answered; the next one of a batch, or the client's answer."""
        kv = req.kv
        if kv is not None:
            kv.outcome, kv.method = "pulled", "decode"
            req.kv = None
        answer = None if data is None else data.answer
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
        if req.stream:
            self.requests.end_stream(req)
        else:
            assert answer is not None
            self.requests.answer(req, answer)
        return self.mark_answered(req)

    def _next_prompt(self, req: Request) -> State:
        """The current batch prompt is answered: the next one gets its own legs (docs/operate.md, "Batch prompts")."""
        assert req.prompts is not None
        req.prompt += 1
        req.accepted.body["prompt"] = req.prompts[req.prompt]
        req.prompt_base = dict(req.attempts)
        req.plain_decode = False
        req.pulled_cached_tokens = None
        plan = req.plan
        assert plan is not None
        if plan.hashes is not None:
            tokenize, probe = _head_look(self.ctx.routing, req)
            if tokenize:
                return _tokenize(self.ctx, req)
            plan = req.plan = self.ctx.routing.replan(plan, req.accepted.body, req.route, probe=probe)
        return self.start_phase(req, PREFILL if plan.pd else DECODE)

    def refused(self, req: Request, refusal: LegRefusal) -> State:
        """LEG_REFUSED: the client's mistake, answered 400, never retried elsewhere (docs/operate.md).

        The engine judged the request itself bad (a bad temperature, a
        prompt longer than the context...): answered 400 with the engine's
        message and param, journalled ``invalid`` with the leg and engine.
        """
        error = refusal.error
        self.stop_request(req)  # releases the prefilled KV no decode leg pulled
        self.requests.decide_end(req, "invalid", NarwhalError(
            error.message, status=400, type="invalid_request_error", param=error.param, code=error.code,
        ), leg=refusal.leg, sent=req.bytes_sent)  # (sent: a batch's earlier prompts streamed already)
        self.requests.answer_error(req)
        return self.mark_answered(req)

    def retry_or_fail(self, req: Request, failure: LegFailure) -> State:
        """LEG_FAILED before the first byte: retry after a backoff while attempts and engines last, else fail."""
        leg = failure.leg
        if failure.final and failure.error is not None:
            return self.fail_request(req, failure.error, leg=leg)
        phase = leg.phase
        if phase == DECODE:
            self.kv.release(req)  # the decode leg failed before the handoff
        ctx = self.ctx
        plan = req.plan
        retry_phase: Phase = PREFILL if (plan is not None and plan.pd) or phase == PREFILL else DECODE
        r = ctx.config.retry
        fleet = ctx.fleet
        # (Attempts count per prompt of a batch: prompt_base is what earlier prompts used.)
        if req.attempts[retry_phase] - req.prompt_base[retry_phase] < r.max_attempts and fleet.has_healthy(
            retry_phase
        ) and (
            retry_phase == DECODE or fleet.has_healthy(DECODE)
        ):
            req.retry_phase = retry_phase
            attempt = req.attempts[retry_phase]
            self.requests.arm(req, "wake", ctx.now + _backoff(leg.bid, attempt, r.backoff_base_s, r.backoff_max_s))
            return State.PREFILL_WAIT if retry_phase == PREFILL else State.DECODE_WAIT
        return self.fail_request(req, _gave_up(req, failure), leg=leg)

    def fail_stream(self, req: Request, failure: LegFailure) -> State:
        """LEG_FAILED while STREAMING: the stream ends with one error event (docs/contract.md)."""
        reason = failure.reason
        code = {"timeout": "stream_idle_timeout", "dropped": "engine_disconnected"}.get(reason, "bad_engine_response")
        status = 504 if reason == "timeout" else 502
        message = {
            "timeout": "The decode engine stopped sending the stream.",
            "dropped": "The decode engine closed the connection mid-stream.",
        }.get(reason, "The decode engine sent an invalid stream.")
        return self.fail_request(req, NarwhalError(message, status=status, code=code), leg=failure.leg)

    def cancel(self, req: Request, _: None) -> State:
        """CLIENT_GONE: stop, and record the request ``cancelled`` (499)."""
        if req.state is State.QUEUED:
            self.ctx.admission.leave_queue(req.rid, req.client)
        leg = req.leg
        if (
            leg is not None and leg.phase == PREFILL and leg.open and leg.got_bytes
            and self.ctx.config.engine.kv_release != "lease"
        ):
            # The prefill's answer is already arriving: the engine has done the
            # work and holds the KV, so cancelling saves nothing and would strand
            # the KV until its lease. Read the answer (its timeout bounds the
            # wait) and release the KV it names. Otherwise the leg is cancelled.
            self.legs.orphan(req, leg)
        self.stop_request(req)
        req.answered = True
        self.requests.decide_end(req, "cancelled", NarwhalError(
            "The client closed the connection.", status=_CLIENT_GONE_STATUS, type="client_error",
            code="client_disconnected",
        ), status=_CLIENT_GONE_STATUS)
        return self.mark_answered(req)

    def expire(self, req: Request, _: None) -> State:
        """DEADLINE: the request did not finish in ``admission.request_timeout_s``: 504."""
        if req.state is State.QUEUED:
            self.ctx.admission.leave_queue(req.rid, req.client)
        leg = req.leg
        self.stop_request(req)
        return self.fail_request(req, NarwhalError(
            "The request did not finish within the router's deadline.", status=504, code="request_timeout"
        ), leg=leg)

    def abandon(self, req: Request, _: None) -> State:
        """ABANDON: shutdown's grace ran out: 503 ``shutting_down``."""
        if req.state is State.QUEUED:
            self.ctx.admission.leave_queue(req.rid, req.client)
        self.stop_request(req)
        return self.fail_request(req, NarwhalError(
            "Narwhal shut down before the request finished.", status=503, code="shutting_down"
        ))

    def queue_timeout(self, req: Request, _: None) -> State:
        """QUEUE_TIMEOUT: no slot came in ``admission.queue_timeout_s``: 503 ``overloaded``."""
        self.ctx.admission.queue_wait_over(req.rid, req.client)
        self.requests.decide_end(req, "rejected", NarwhalError(
            "The fleet is at capacity; the request waited too long for a slot.", status=503, code="overloaded"
        ))
        self.requests.answer_error(req, retry_after=True)
        return self.mark_answered(req)

    def released(self, req: Request, _: None) -> State:
        """RELEASED: every KV release is settled: the terminal record."""
        self.requests.write_record(req)
        return State.DONE

    def abandon_releases(self, req: Request, _: None) -> State:
        """ABANDON while RELEASING: the releases are recorded as they stand; the terminal record."""
        self.legs.cancel_orphans(req)
        self.kv.abandon(req.legs)
        req.pending_releases = 0
        self.requests.write_record(req)
        return State.DONE

    def ignore(self, req: Request, _: None) -> State:
        """The client went, or the deadline passed, while KV releases settle: nothing changes."""
        return req.state


def _head_look(routing: Routing, req: Request) -> tuple[bool, HeadProbe | None]:
    """Before the current prompt's plan: tokenize it whole first (off the loop), or what its head settled.

    Only a prompt of more than ``routing.tokenize_inline_max_bytes`` is
    looked at (docs/routing.md, "Tokenizing only what can hit"): any
    other is ``(False, None)``, planned at once.
    """
    limit = routing.inline_max
    if limit is None or _prompt_bytes(req) <= limit:
        return False, None
    probe = routing.probe_head(req.accepted.body, req.route)
    return probe is None, probe


def _tokenize(ctx: Context, req: Request) -> State:
    """Ask the runtime for the current prompt's token ids, off the event loop (docs/routing.md).

    The key names the request and the prompt (a batch's prompts are
    tokenized one by one), so an answer that comes after the request
    ended or moved on is told apart and ignored.
    """
    key = req.tokenizing = f"{req.rid}:{req.prompt}"
    ctx.out.append(TokenizePrompt(key, dict(req.accepted.body), req.route == CHAT))
    return State.TOKENIZING


def _prompt_bytes(req: Request) -> int:
    """What tokenizing the current prompt costs, in bytes: the body's size; a batch prompt's own text.

    (A token-id prompt of a batch is used as given: nothing to tokenize.)
    """
    prompts = req.prompts
    if prompts is None:
        return req.size
    prompt = prompts[req.prompt]
    return len(prompt.encode("utf-8", "surrogatepass")) if isinstance(prompt, str) else 0


def _gave_up(req: Request, failure: LegFailure) -> NarwhalError:
    """The error a request fails with once its legs' retries are exhausted."""
    reason, phase, error = failure.reason, failure.leg.phase, failure.error
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
        message = f"The {phase} leg failed ({reason}) after {req.attempts[phase] - req.prompt_base[phase]} attempt(s)."
    return NarwhalError(message, status=status, code=code)


def _backoff(seed: str, attempt: int, base: float, cap: float) -> float:
    """Exponential backoff with jitter in [0.5, 1.5) drawn from a hash of the leg's ID (no randomness)."""
    jitter = 0.5 + (zlib.crc32(seed.encode()) & 0xFFFF) / 65536.0
    return float(min(cap, base * 2.0 ** (attempt - 1)) * jitter)


S = State
I = Input
L = Lifecycle
_END: Final = frozenset({S.RELEASING, S.DONE})
_LIVE: Final = (S.TOKENIZING, S.PREFILL, S.PREFILL_WAIT, S.DECODE, S.DECODE_WAIT, S.STREAMING)
#: Where a request goes when its first leg starts (or waits for an engine slot).
_FIRST_LEG: Final = frozenset({S.PREFILL, S.DECODE, S.PREFILL_WAIT, S.DECODE_WAIT})
#: Where a batch request goes when one prompt is answered and the next begins (its prompt tokenized first, maybe).
_NEXT_PROMPT: Final = _FIRST_LEG | {S.TOKENIZING}

TRANSITIONS: Final[Mapping[tuple[State, Input], tuple[Handler, frozenset[State]]]] = MappingProxyType({
    # (TOKENIZING: a large prompt's token ids are computed off the event loop first; docs/routing.md.)
    (S.QUEUED, I.ADMIT): (L.begin, _FIRST_LEG | {S.TOKENIZING} | _END),
    (S.QUEUED, I.QUEUE_TIMEOUT): (L.queue_timeout, _END),
    (S.QUEUED, I.CLIENT_GONE): (L.cancel, _END),
    (S.QUEUED, I.DEADLINE): (L.expire, _END),
    (S.QUEUED, I.ABANDON): (L.abandon, _END),
    (S.TOKENIZING, I.TOKENIZED): (L.tokenized, _FIRST_LEG | _END),
    (S.PREFILL, I.LEG_OK): (L.prefill_ok, frozenset({S.DECODE, S.DECODE_WAIT}) | _END),
    (S.PREFILL, I.LEG_REFUSED): (L.refused, _END),
    (S.PREFILL, I.LEG_FAILED): (L.retry_or_fail, frozenset({S.PREFILL_WAIT}) | _END),
    (S.PREFILL_WAIT, I.WAKE): (L.resume, frozenset({S.PREFILL, S.PREFILL_WAIT}) | _END),
    # (A batch prompt's answer starts the next prompt's legs: docs/operate.md, "Batch prompts".)
    (S.DECODE, I.LEG_OK): (L.decode_ok, _NEXT_PROMPT | _END),
    (S.DECODE, I.LEG_REFUSED): (L.refused, _END),
    (S.DECODE, I.LEG_FAILED): (L.retry_or_fail, frozenset({S.PREFILL_WAIT, S.DECODE_WAIT}) | _END),
    (S.DECODE, I.FIRST_BYTES): (L.first_bytes, frozenset({S.STREAMING})),
    (S.DECODE, I.KV_HOLD_ENDING): (L.hold_ending, frozenset({S.PREFILL, S.PREFILL_WAIT}) | _END),
    # (PREFILL/PREFILL_WAIT: the KV's lease ran short before a decode engine had room: prefilled again.)
    (S.DECODE_WAIT, I.WAKE): (L.resume, frozenset({S.DECODE, S.DECODE_WAIT, S.PREFILL, S.PREFILL_WAIT}) | _END),
    (S.STREAMING, I.LEG_OK): (L.decode_ok, _NEXT_PROMPT | _END),
    (S.STREAMING, I.LEG_FAILED): (L.fail_stream, _END),
    (S.RELEASING, I.RELEASED): (L.released, frozenset({S.DONE})),
    (S.RELEASING, I.CLIENT_GONE): (L.ignore, frozenset({S.RELEASING})),
    (S.RELEASING, I.DEADLINE): (L.ignore, frozenset({S.RELEASING})),
    (S.RELEASING, I.ABANDON): (L.abandon_releases, frozenset({S.DONE})),
    # Every live state: the client leaving, the request's deadline, a shutdown's abandon.
    **{(state, I.CLIENT_GONE): (L.cancel, _END) for state in _LIVE},
    **{(state, I.DEADLINE): (L.expire, _END) for state in _LIVE},
    **{(state, I.ABANDON): (L.abandon, _END) for state in _LIVE},
})
