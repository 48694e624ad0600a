"""What one request in flight holds: its client connection, its engine legs, its prefilled KV.

These are the mutable values the core's parts pass one another
(docs/design.md, "The parts of the core"): :class:`Request` (a completion
request from admission to its terminal record), :class:`Conn` (a client
connection), :class:`Leg` (one engine request of a completion request) and
:class:`Kv` (one prefill's handoff and what became of it). They import no
part, so that every part can name them.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, Any

from .ids import DECODE, PREFILL, Phase
from .states import State

if TYPE_CHECKING:
    from .contract import AcceptedRequest, Route
    from .fleet import EngineState
    from .http import EngineCodec, ServerCodec
    from .journal import ErrorRecord, LegOutcome, Terminal
    from .leg_bodies import KvHandoff
    from .policies import Plan
    from .relay import SseRelay
    from .timers import Timer
    from .tracecontext import TraceContext

__all__ = ["Request", "Conn", "Leg", "Kv"]


class Request:
    """One completion request, from admission to its terminal record."""

    __slots__ = (
        "rid", "conn", "route", "client", "client_rid", "received", "stream", "accepted", "state", "attempts",
        "failed_on", "leg", "legs", "kv", "pending_releases", "admitted", "answered", "bytes_sent",
        "first_byte", "relay", "retry_phase", "pulled_cached_tokens", "waiting_for_slot", "terminal",
        "status", "error", "usage", "timers", "plain_decode", "prompts", "prompt", "answers", "prompt_base",
        "size", "plan", "trace", "tokenizing", "rate_headers",
    )

    def __init__(
        self, rid: str, conn: Conn | None, route: Route, client: str, client_rid: str | None,
        received: float, stream: bool, accepted: AcceptedRequest, size: int = 0,
        trace: TraceContext | None = None,
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
        self.failed_on: dict[str, list[Any]] = {PREFILL: [], DECODE: []}
        self.leg: Leg | None = None
        self.legs: list[Leg] = []
        self.kv: Kv | None = None
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
        #: The request body's size in bytes (the routing estimates tokens from it).
        self.size = size
        #: With a tenant's rate budget, the OpenAI rate-limit headers its answer carries (docs/operate.md, "Budgets").
        self.rate_headers: tuple[tuple[bytes, bytes], ...] = ()
        #: How it is routed, decided at admission (:meth:`narwhal_core.routing.Routing.plan`).
        self.plan: Plan | None = None
        if self.prompts is not None:
            accepted.body["prompt"] = self.prompts[0]
        #: The W3C trace its legs carry on (``None``: no traceparent, tracing off; docs/contract.md).
        self.trace = trace
        #: The key of the :class:`~narwhal_core.events.TokenizePrompt` it waits for (state ``TOKENIZING``).
        self.tokenizing: str | None = None


class Conn:
    """One client connection."""

    __slots__ = (
        "handle", "codec", "peer_host", "rid", "read_deadline", "timer", "armed", "closed", "reading",
        "body_phase", "buffered", "stalled",
    )

    def __init__(self, handle: Hashable, codec: ServerCodec, peer_host: str) -> None:
        self.handle = handle
        self.codec = codec
        self.peer_host = peer_host
        #: The request being answered (``None``: between requests).
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
        #: The adapter holds back the legs feeding it: it is not reading
        #: (:class:`~narwhal_core.events.ClientStalled`).
        self.stalled = False


class Leg:
    """One engine request of a completion request (a leg of its terminal record)."""

    __slots__ = (
        "bid", "phase", "attempt", "engine", "codec", "rid", "started", "data", "deadline", "timer", "armed",
        "status", "body", "outcome", "ended", "kv", "open", "streaming", "got_bytes", "fresh_retry", "orphan",
        "held", "prompt", "tokens", "request_id", "first_bytes",
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
        #: A prefill leg: its prompt's estimated tokens, counted in its engine's queue while it runs.
        self.tokens = 0
        #: The ``X-Request-Id`` sent when it is not ``bid``: a decode leg carrying
        #: connector-1 KV is sent the prefill leg's (see Kv.decode_request_id).
        self.request_id: str | None = None
        #: Its stream's first bytes just went to the client: ``FIRST_BYTES`` is due with its verdict.
        self.first_bytes = False


class Kv:
    """One prefill's handoff and what became of it (the ``kv`` of the leg's record)."""

    __slots__ = ("handoff", "engine", "leg", "outcome", "method", "error", "release_id", "start_by", "hold_ends")

    def __init__(self, handoff: KvHandoff, engine: EngineState, leg: str) -> None:
        self.handoff = handoff
        self.engine = engine
        self.leg = leg
        self.outcome: str | None = None
        self.method: str | None = None
        self.error: str | None = None
        self.release_id: str | None = None
        #: No decode request (leg or release) carries this KV from then on:
        #: its lease may run out before it gets there (see Legs.may_resend).
        self.start_by = math.inf
        #: When nothing renews the KV's hold: a decode leg that has not read
        #: it by then is cancelled (Lifecycle.hold_ending); ``inf`` otherwise.
        self.hold_ends = math.inf

    def decode_request_id(self) -> str | None:
        """The ``X-Request-Id`` every decode request carrying this KV needs; ``None``: its own backend ID.

        Params without ``remote_request_id`` (vLLM's NIXL connector version 1,
        before 0.14): the decode engine names the blocks to free by its own
        request ID, which the prefill engine knows only when both legs were
        sent the same ``X-Request-Id`` (docs/operate.md, "vLLM compatibility").
        vLLM's push mode (``KvHandoff.shared_id``) pairs the prefill engine's
        request with the decode engine's registration by that ID too.
        """
        handoff = self.handoff
        params = handoff.params
        if params is None or (isinstance(params.get("remote_request_id"), str) and not handoff.shared_id):
            return None
        return self.leg
