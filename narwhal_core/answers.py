"""Engine answers: a leg's bytes read, a stream relayed, the whole answer judged.

:class:`Answers` reads what an engine sends on a leg through the leg's
codec, relays a streamed answer to the client as it comes (rewritten by
:class:`~narwhal_core.relay.SseRelay`), judges the whole answer and returns
the leg's verdict (:mod:`~narwhal_core.verdicts`), which the router hands to
the lifecycle (``LEG_OK``, ``LEG_REFUSED``, ``LEG_FAILED``). After a
stream's ``[DONE]`` the connection is read to the end of the engine's body
(:meth:`~narwhal_core.legs.Legs.read_tail`), so that it can go back to the
pool. An orphaned prefill's answer (its client went away) names the KV to
release.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from . import wire
from .errors import NarwhalError, RemoteProtocolError
from .events import FinishLeg
from .http import NEED_DATA, BodyData, ResponseEnd, ResponseHead
from .ids import DECODE, PREFILL
from .journal import LegOutcome
from .leg_bodies import PrefillAnswerError, engine_error, normalise_answer
from .relay import SseRelay
from .states import LegEnded, State
from .verdicts import LegAnswer, LegFailure, LegRefusal, Verdict

if TYPE_CHECKING:
    from .context import Context
    from .health import Health
    from .kv import KvLedger
    from .inflight import Leg, Request
    from .legs import Legs
    from .requests import Requests

__all__ = ["Answers"]

_REDACTED: Final = b"[redacted]"
# An engine's 4xx that is not a verdict on the client's request: a timeout or
# overload (another engine may take it), a credential, route or model name of
# Narwhal's own. These fail the leg like a 5xx; any other 4xx is the client's
# mistake (see Lifecycle.refused).
_NOT_THE_CLIENTS: Final = frozenset({401, 403, 404, 408, 429})


class Answers:
    """What the engines answer on the legs: read, relayed, judged; each leg's verdict returned."""

    __slots__ = ("ctx", "active", "legs", "requests", "kv", "health", "protocol")

    def __init__(self, ctx: Context, legs: Legs, requests: Requests, kv: KvLedger, health: Health) -> None:
        self.ctx: Final = ctx
        self.legs: Final = legs
        self.requests: Final = requests
        #: The requests not yet terminal, by rid.
        self.active: Final = requests.active
        self.kv: Final = kv
        self.health: Final = health
        #: How a prefill answer is judged is the engine protocol's (docs/design.md, "Engine protocols").
        self.protocol: Final = ctx.protocol

    def data(self, leg: Leg, data: bytes) -> Verdict | None:
        """Bytes of the leg's answer arrived (empty: the engine closed its side): the leg's verdict, if it has one.

        The lifecycle acts on the verdict (:meth:`~narwhal_core.lifecycle.Lifecycle.judged`);
        a stream whose ``[DONE]`` came is then read to its end (:meth:`~narwhal_core.legs.Legs.read_tail`).
        """
        if data:
            leg.got_bytes = True  # the engine saw the request: never re-send it
        codec = leg.codec
        codec.receive_data(data)
        if leg.outcome is not None:
            self.legs.read_tail(leg)
            return None
        req = self.active[leg.rid]
        while leg.open:
            try:
                event = codec.next_event()
            except RemoteProtocolError as exc:
                return self.legs.fail_leg(leg, "dropped" if exc.reason == "dropped" else "bad_response")
            if event is NEED_DATA:
                break
            kind = type(event)
            if kind is BodyData:
                if leg.streaming:
                    verdict = self.relay(req, leg, event.data)  # type: ignore[union-attr]
                    if verdict is not None:
                        return verdict  # [DONE] came (what follows is dropped), or the stream broke
                else:
                    leg.body.append(event.data)  # type: ignore[union-attr]
            elif kind is ResponseHead:
                self._head(req, leg, event.status)  # type: ignore[union-attr]
            elif kind is ResponseEnd:
                leg.open = False
                self.ctx.out.append(FinishLeg(leg.bid, event.reusable))  # type: ignore[union-attr]
                return self.answered(req, leg)
        return LegEnded.RELAYED if leg.first_bytes else None

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
                route=req.route, model=ctx.model, pd=_pd(req),
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

    def relay(self, req: Request, leg: Leg, data: bytes) -> Verdict | None:
        """Relay a streamed answer's bytes to the client, rewritten (:class:`~narwhal_core.relay.SseRelay`).

        Returns the leg's verdict once its outcome is settled (``[DONE]``
        came, or the stream broke), else ``None``.
        """
        relay = req.relay
        assert relay is not None
        try:
            out = relay.feed(data)
        except NarwhalError:
            if relay.good_before_error and self.requests.stream_out(req, relay.good_before_error):
                leg.first_bytes = True
            return self.legs.fail_leg(leg, "bad_response")
        # (limit(phase, True), read directly: this runs once per relayed chunk)
        self.legs.set_deadline(leg, self.ctx.now + self.ctx.config.engine.stream_idle_timeout_s)
        kv = req.kv
        if kv is not None and relay.events and relay.error is None:
            # The first data event: the decode engine sampled a token, so it had the KV.
            self.kv.pulled(req, kv)
        if out and self.requests.stream_out(req, out):
            leg.first_bytes = True  # FIRST_BYTES is due (the lifecycle fires it with the verdict)
        if relay.done and leg.outcome is None:
            return self.stream_done(req, leg)
        return None

    def stream_done(self, req: Request, leg: Leg) -> Verdict:
        """``data: [DONE]`` is relayed: the client's answer is complete (``LEG_OK``).

        Its chunked body ends now and the request is ``completed``, whenever
        the engine's body ends (a client such as the openai SDK closes as
        soon as it reads ``[DONE]``). The leg is done too; its connection is
        still read, what comes is dropped, and it goes back to the pool if
        the body ends cleanly within the stream idle limit, else it is
        closed (:meth:`~narwhal_core.legs.Legs.read_tail`).
        """
        # The leg's outcome is settled; it stays in legs.running (fed LegData
        # and LegFailed) and counts against its engine until its body ends.
        ctx = self.ctx
        leg.outcome = "ok"
        leg.ended = ctx.now
        leg.held = False
        ctx.fleet.record_success(leg.engine, probe=False)
        if req.leg is leg:
            req.leg = None
        self.legs.set_deadline(leg, ctx.now + ctx.config.engine.stream_idle_timeout_s)
        if req.state is State.STREAMING or req.state is State.DECODE:
            return LegEnded.OK
        return LegEnded.RELAYED

    def answered(self, req: Request, leg: Leg) -> Verdict:
        """The leg's whole answer is in: judge it, account for the leg's end (once, here); the verdict it amounts to."""
        status = leg.status or 0
        body = b"".join(leg.body)
        leg.body = []
        secret = self.ctx.secret
        if secret is not None and secret in body:
            # An engine quoting the credential it was sent must not hand it on.
            body = body.replace(secret, _REDACTED)
        if leg.orphan:
            outcome, failed, verdict = self._orphan_answered(req, leg, status, body)
        elif not 200 <= status < 300:
            if 400 <= status < 500 and status not in _NOT_THE_CLIENTS:
                outcome, failed, verdict = "refused", False, LegRefusal(engine_error(status, body), leg)
            else:
                outcome, failed, verdict = "http_error", True, LegFailure("http_error", leg)
        elif leg.phase == PREFILL:
            outcome, failed, verdict = self._prefill_answered(req, leg, body)
        elif leg.streaming:
            relay = req.relay
            assert relay is not None
            if relay.done or (relay.events and relay.error is not None):
                outcome, failed, verdict = "ok", False, LegEnded.OK
            else:
                outcome, failed, verdict = "bad_response", True, LegFailure("bad_response", leg)
        else:
            outcome, failed, verdict = self._decode_answered(req, leg, body)
        self.legs.account_end(leg, outcome, failed=failed)
        return verdict

    def _prefill_answered(self, req: Request, leg: Leg, body: bytes) -> _Judged:
        try:
            handoff = self.protocol.check_prefill_answer(
                body, leg.bid, self.health.kv_host_allowed,
                require_request_id=self.ctx.stats.kv_connector.get(leg.engine.url) == 2,
            )
        except PrefillAnswerError as exc:
            return "bad_kv", True, LegFailure("bad_kv", leg, exc)
        if handoff.params is not None:
            self.kv.note_connector(leg.engine.url, handoff.params)
            mode = self.protocol.refused_mode(handoff.params)
            if mode is not None:
                # Refused at once, never retried, the engine not charged: another engine of the
                # fleet would answer the same (docs/operate.md, "vLLM compatibility").
                self.kv.refuse_mode(leg, handoff, mode)
                return "bad_kv", False, LegFailure("bad_kv", leg, self.protocol.mode_error(mode), True)
        if handoff.params is None:
            self.kv.no_handoff(req, leg, handoff)
        else:
            req.plain_decode = False
            self.kv.handed_off(req, leg, handoff)
        return "ok", False, LegEnded.OK

    def _decode_answered(self, req: Request, leg: Leg, body: bytes) -> _Judged:
        try:
            answer = wire.loads_answer(body)
        except wire.JsonError:
            answer = None
        if not isinstance(answer, dict):
            return "bad_response", True, LegFailure("bad_response", leg)
        normalise_answer(
            req.route, answer, self.ctx.model, pd=_pd(req), cached_tokens=req.pulled_cached_tokens,
        )
        return "ok", False, LegAnswer(answer)

    def _orphan_answered(self, req: Request, leg: Leg, status: int, body: bytes) -> _Judged:
        # An orphaned prefill's answer: the KV it names is released; one of its request's releases is settled.
        if not 200 <= status < 300:
            return ("refused" if 400 <= status < 500 else "http_error"), status >= 500, LegEnded.SETTLED
        try:
            handoff = self.protocol.check_prefill_answer(body, leg.bid, self.health.kv_host_allowed)
        except PrefillAnswerError:
            return "bad_kv", True, LegEnded.SETTLED
        mode = None if handoff.params is None else self.protocol.refused_mode(handoff.params)
        if mode is not None:
            self.kv.refuse_mode(leg, handoff, mode)  # never carried by a decode request: held, journalled
            return "bad_kv", False, LegEnded.SETTLED
        if handoff.params is None:
            self.kv.no_handoff(req, leg, handoff)  # nothing held: nothing to release
        else:
            self.kv.handed_off(req, leg, handoff)
            self.kv.release(req)
        return "ok", False, LegEnded.SETTLED


#: What judging a whole answer comes to: the leg's outcome, whether its engine is charged a failure, the verdict.
_Judged = tuple[LegOutcome, bool, Verdict]


def _pd(req: Request) -> bool:
    """Whether the request's decode leg pulled a prefill's KV (its usage then counts the prefill's cached tokens)."""
    plan = req.plan
    return plan is not None and plan.pd and not req.plain_decode
