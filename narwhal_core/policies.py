"""The routing policies: how a leg's engine is picked among the candidates (docs/configure.md, "Routing policies").

A :class:`Policy` picks one engine among those :meth:`~narwhal_core.fleet.Fleet.choose`
offers and learns from what was sent where; a :class:`Plan` is what
admission decided for one request (:mod:`narwhal_core.routing`). This
module holds the policies that need no tokenizer (``round_robin``,
``least_loaded``, ``prefix``); ``kv`` builds on :class:`Prefix` in
:mod:`narwhal_core.kv_policy`, and :mod:`narwhal_core.routing` names them
all. A policy never reads a clock or draws a random number.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol

from .contract import CHAT
from .ids import PREFILL, Phase
from .journal import routing_json
from .prefix import BYTES_PER_TOKEN, PrefixIndex, block_hashes, blocks_to_tokens, prompt_key, tokens_to_blocks

if TYPE_CHECKING:
    from .config import RoutingConfig
    from .contract import Route
    from .events import PromptTokenized
    from .fleet import EngineState
    from .kv_events import KvEvent
    from .kv_policy import HeadProbe, PromptTokenizer

__all__ = [
    "BYTES_PER_TOKEN", "MAX_CANDIDATES", "KV_NEARLY_FULL", "APPROXIMATE", "RECENT_LEGS", "estimate_tokens", "Clock",
    "StoppedClock", "Plan", "Policy", "RoundRobin", "LeastLoaded", "Prefix",
]
#: Most prefill candidates a journal ``routing`` record lists (docs/operate.md, "The journal").
MAX_CANDIDATES: Final = 8
#: A decode engine that reported its KV cache this full is chosen last: new sequences there would be
#: preempted, or wait for blocks (vLLM's scheduler, ``vllm/v1/core/sched/scheduler.py``).
KV_NEARLY_FULL: Final = 0.9
#: The journal's name of the index :class:`Prefix` keeps (docs/operate.md, "The journal").
APPROXIMATE: Final = "approximate"
#: How many prefill legs :class:`Prefix`'s recent work per engine spans: each leg sent weighs
#: ``1 - 1/RECENT_LEGS`` of the one before (docs/configure.md, "Routing policies").
RECENT_LEGS: Final = 128
_RECENT_DECAY: Final = 1.0 - 1.0 / RECENT_LEGS


def estimate_tokens(size: int) -> int:
    """A prompt's tokens estimated from its size in bytes (at least 1)."""
    return size // BYTES_PER_TOKEN or 1


class Clock(Protocol):
    """Where a policy that ages what it knows reads the time: the event being handled's (the router's context)."""

    @property
    def now(self) -> float:
        """The time of the event being handled."""
        ...


class StoppedClock:
    """A clock that reads what it was set to (a policy's until the router binds its own; tests)."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now = now


class Plan:
    """How one request is routed: decided once, at admission (the journal's ``routing`` record).

    A plain slotted class made once per request on the hot path; treat it as a value.
    """

    __slots__ = ("pd", "reason", "tokens", "hashes", "candidates", "indexes", "weighed_tokens")

    def __init__(
        self, pd: bool, reason: str, tokens: int, hashes: Sequence[int] | None = None,
        candidates: tuple[tuple[str, int, int], ...] = (),
    ) -> None:  # fmt: skip
        #: Disaggregated (a prefill leg, then a decode leg) or ``single`` (one decode leg).
        self.pd = pd
        #: Why, as one fixed word (docs/configure.md, "Disaggregation per request").
        self.reason = reason
        #: The prompt's estimated tokens: what a prefill leg of it adds to its engine's queue.
        self.tokens = tokens
        #: The chained hashes of the prompt's blocks, when a prefix index needs them.
        self.hashes = hashes
        #: The prefill engines weighed: (URL, uncached tokens, queued tokens), at most :data:`MAX_CANDIDATES`.
        self.candidates = candidates
        #: With a policy of two indexes (``kv``): the index that weighed each candidate, in the same order.
        self.indexes: tuple[str, ...] | None = None
        #: The tokens of the prompt the candidates were weighed for: this one's, or a batch's first
        #: (:meth:`~narwhal_core.routing.Routing.replan` keeps the admission's weighing).
        self.weighed_tokens = tokens

    def to_json(self, policy: str, prefill: str | None, decode: str | None) -> dict[str, Any]:
        """The journal's ``routing`` object, with the engines the request's legs last went to."""
        candidates = self.candidates
        indexes = self.indexes
        if indexes is not None:
            tokens = self.weighed_tokens  # (a batch's later prompt has tokens of its own, not weighed)
            return routing_json(policy, "pd" if self.pd else "single", self.reason, prefill, decode, [
                {"engine": url, "uncached_tokens": uncached, "queued_tokens": queued,
                 "matched_tokens": tokens - uncached, "index": index}
                for (url, uncached, queued), index in zip(candidates, indexes)
            ], index=indexes[0] if indexes else None)
        return routing_json(policy, "pd" if self.pd else "single", self.reason, prefill, decode, [
            {"engine": url, "uncached_tokens": uncached, "queued_tokens": queued}
            for url, uncached, queued in candidates
        ] if candidates else [])


class Policy:
    """What a routing policy does: pick a leg's engine among candidates, and learn from what was sent.

    ``candidates`` is never empty: the engines of ``phase`` in rotation,
    with a free slot, and not failed on by this request (unless none is
    left), in turn order. The first of equally good candidates is the one
    to pick: that is what makes ties take turns.
    """

    #: Its name in ``routing.policy`` and in the journal.
    name: ClassVar[str] = ""
    #: Whether it keys prompts (:meth:`key`): admission then hashes each prompt once.
    keyed: ClassVar[bool] = False
    #: Queued tokens one uncached prompt token counts as, when candidates are weighed (``prefix``: ``routing.miss_cost``).
    miss_cost: float = 1.0
    #: Whether it weighs engines from more than one index (:meth:`index_name`; the journal names it).
    names_index: ClassVar[bool] = False
    #: Whether its key asks the runtime's tokenizer for the prompt's token ids (``kv``): a large prompt's
    #: are then computed off the event loop first (docs/routing.md, "Tokenizing off the event loop").
    tokenizes: ClassVar[bool] = False

    __slots__ = ()

    @classmethod
    def from_config(cls, config: RoutingConfig, tokenizer: PromptTokenizer | None = None) -> Policy:
        """A fresh policy of this kind for ``config`` (its state belongs to one router).

        ``tokenizer``: the runtime's, for a policy keyed by token ids (the others ignore it).
        """
        return cls()

    def prompt_tokenizer(self) -> PromptTokenizer | None:
        """The tokenizer its keys ask for token ids (only a policy that :attr:`tokenizes` has one)."""
        return None

    def bind(self, clock: Clock, log: Callable[..., None] | None = None) -> None:
        """The router that owns this policy: the time of each event is read from ``clock``; ``log`` writes a line."""

    def index_name(self, engine: EngineState, plan: Plan) -> str:
        """Which index weighs ``plan`` on ``engine`` (only when :attr:`names_index`)."""
        return APPROXIMATE

    def kv_events(self, url: str, events: Sequence[KvEvent], now: float) -> str | None:
        """KV events of the engine at ``url`` (docs/routing.md, "KV events"); a problem to log once, if any.

        A policy that keeps no index of them ignores them.
        """
        return None

    def kv_stream(self, url: str, live: bool, reason: str, now: float) -> bool:
        """The KV-event stream of the engine at ``url`` came up or went down; whether that changed its state."""
        return False

    def kv_live(self, urls: Sequence[str], now: float) -> dict[str, bool]:
        """Whether each engine of ``urls`` is weighed from its KV events at ``now`` (empty: no policy of events).

        Asking may find an engine's stream stale, which the policy logs then.
        """
        return {}

    def kv_stale_due(self, url: str, now: float) -> None:
        """A lost stream's grace (``routing.kv_events_stale_s``) is over at ``now``: find whether it fell back."""

    def probe_head(
        self, body: dict[str, Any], route: Route, candidates: Sequence[EngineState]
    ) -> HeadProbe | None:
        """What a large prompt's head settles, for its plan (``kv``); ``None``: tokenize it whole, off the loop, first.

        Only asked of a policy that :attr:`tokenizes`; ``candidates``: the
        prefill engines it would be weighed on.
        """
        return None

    def pick(self, phase: Phase, candidates: Sequence[EngineState], plan: Plan | None) -> EngineState:
        """The engine of ``candidates`` the leg goes to."""
        raise NotImplementedError

    def key(
        self, body: dict[str, Any], route: Route, tokenized: PromptTokenized | None = None,
        probe: HeadProbe | None = None,
    ) -> tuple[Sequence[int], int]:  # fmt: skip
        """A keyed policy's hashes of the prompt's blocks, and its tokens (only when :attr:`keyed`).

        ``tokenized``: the prompt's token ids computed off the event loop (a
        policy that :attr:`tokenizes` uses them instead of calling its
        tokenizer); ``probe``: what :meth:`probe_head` found of this prompt.
        """
        raise NotImplementedError

    def uncached(self, engine: EngineState, plan: Plan) -> int:
        """The prompt's tokens a prefill on ``engine`` is expected to compute (all of them: nothing is known cached)."""
        return plan.tokens

    def sent(self, engine: EngineState, plan: Plan) -> None:
        """A prefill leg of ``plan``'s prompt was sent to ``engine`` (a prefix index learns from it)."""

    def forget(self, engine: EngineState) -> None:
        """``engine`` left rotation: whatever it held may be gone when it comes back."""

    def drop(self, engine: EngineState) -> None:
        """``engine`` left the fleet for good (docs/operate.md, "Engines that come and go"): keep nothing of it."""
        self.forget(engine)

    def capacity(self, engine: EngineState, tokens: int) -> None:
        """``engine`` reported that its KV cache holds ``tokens`` (a prefix index is bounded by it)."""


class RoundRobin(Policy):
    """``round_robin``: each leg to the next engine of its phase in turn."""

    name: ClassVar[str] = "round_robin"
    __slots__ = ()

    def pick(self, phase: Phase, candidates: Sequence[EngineState], plan: Plan | None) -> EngineState:
        return candidates[0]


class LeastLoaded(Policy):
    """``least_loaded``: prefill legs by the prompt tokens queued on each engine, decode legs by sequences running.

    A prefill engine's work is the prompt tokens of the prefill legs Narwhal
    has running there, plus what the engine itself reported beyond them
    (:mod:`.load`: requests other routers sent there, at Narwhal's mean
    prompt length); legs running break a tie. A decode engine's load is the
    sequences it runs for Narwhal plus those it reported beyond them; one
    whose KV cache it reported nearly full (:data:`KV_NEARLY_FULL`) comes
    last, and the fuller cache loses a tie.
    """

    name: ClassVar[str] = "least_loaded"
    __slots__ = ()

    def pick(self, phase: Phase, candidates: Sequence[EngineState], plan: Plan | None) -> EngineState:
        best = candidates[0]
        if phase == PREFILL:
            tokens, legs = best.queued_tokens + best.foreign_tokens, best.outstanding
            for e in candidates:
                t = e.queued_tokens + e.foreign_tokens
                if t < tokens or (t == tokens and e.outstanding < legs):
                    best, tokens, legs = e, t, e.outstanding
            return best
        key = (best.kv_usage >= KV_NEARLY_FULL, best.outstanding + best.foreign, best.kv_usage)
        for e in candidates:
            k = (e.kv_usage >= KV_NEARLY_FULL, e.outstanding + e.foreign, e.kv_usage)
            if k < key:
                best, key = e, k
        return best


class Prefix(LeastLoaded):
    """``prefix``: a prefill leg to the engine with the least expected time to first token.

    Narwhal keeps a :class:`~narwhal_core.prefix.PrefixIndex` per prefill
    engine of the prompts it sent there, bounded by ``kv_capacity_tokens``
    (least recently used out, as the engine evicts). A prefill engine's
    cost for a prompt is its queued prompt tokens + ``miss_cost`` x the
    prompt's tokens it does not hold: with ``miss_cost`` 1, its expected
    TTFT times ``prefill_tokens_per_s`` (the same for every engine). A miss
    is charged more than its own compute because it costs the fleet again
    later: the copy it makes displaces other prompts from that engine's
    cache, and the holder's copy goes unused, so the fleet's caches hold
    fewer distinct prefixes (benchmarks/README.md, "Weighing a miss").
    Still, a hit saves its blocks once while every request queued behind it
    waits: past a point the queue on a hot prefix's engine outweighs the
    hit, and the prefix spreads to other engines (docs/configure.md,
    "Routing policies"). Engines of equal cost and legs running go by their
    recent work: the uncached tokens of the last :data:`RECENT_LEGS` or so
    prefill legs sent there, older ones weighing less. A prompt that no
    engine holds, on an idle fleet, then goes to the engine that computed
    least lately, not the next in turn; with prompts that come back (a
    conversation's next turn) to where they were first sent, turn order
    alone piles them on whichever engines chance gave them
    (benchmarks/README.md, "Defaults that win"). Decode legs go by load, as
    with ``least_loaded``.
    """

    name: ClassVar[str] = "prefix"
    keyed: ClassVar[bool] = True
    __slots__ = ("default_capacity", "capacities", "indexes", "miss_cost", "recent", "sends")

    def __init__(self, capacity_tokens: int, miss_cost: float = 1.0) -> None:
        #: An engine's index bound, in blocks of the index, until it reports its own (``kv_capacity_tokens``).
        self.default_capacity: Final = tokens_to_blocks(capacity_tokens)
        #: The bounds engines reported (``vllm:cache_config_info``, :mod:`.load`), by URL.
        self.capacities: Final[dict[str, int]] = {}
        #: The index of each prefill engine Narwhal sent a prompt to, by URL.
        self.indexes: Final[dict[str, PrefixIndex]] = {}
        #: Queued tokens one uncached prompt token counts as (``routing.miss_cost``).
        self.miss_cost = miss_cost
        #: Each prefill engine's recent work, by URL: its uncached tokens as of the :attr:`sends`-th leg.
        self.recent: Final[dict[str, tuple[float, int]]] = {}
        #: Prefill legs sent so far (the clock recent work decays by).
        self.sends = 0

    def recent_work(self, url: str) -> float:
        """The uncached tokens of the prefill legs recently sent to ``url``, each older leg weighing less."""
        work = self.recent.get(url)
        if work is None:
            return 0.0
        tokens, at = work
        return tokens * _RECENT_DECAY ** (self.sends - at)

    @classmethod
    def from_config(cls, config: RoutingConfig, tokenizer: PromptTokenizer | None = None) -> Policy:
        return cls(config.kv_capacity_tokens, config.miss_cost)

    def key(
        self, body: dict[str, Any], route: Route, tokenized: PromptTokenized | None = None,
        probe: HeadProbe | None = None,
    ) -> tuple[Sequence[int], int]:  # fmt: skip
        key = prompt_key(body, route == CHAT)
        return block_hashes(key), len(key) // BYTES_PER_TOKEN or 1

    def uncached(self, engine: EngineState, plan: Plan) -> int:
        hashes = plan.hashes
        index = self.indexes.get(engine.url)
        if not hashes or index is None:
            return plan.tokens
        return max(0, plan.tokens - blocks_to_tokens(index.matched_blocks(hashes)))

    def pick(self, phase: Phase, candidates: Sequence[EngineState], plan: Plan | None) -> EngineState:
        if phase != PREFILL or plan is None or plan.hashes is None:
            return LeastLoaded.pick(self, phase, candidates, plan)
        w = self.miss_cost
        best = candidates[0]
        cost, legs = best.queued_tokens + best.foreign_tokens + w * self.uncached(best, plan), best.outstanding
        for e in candidates:
            if e is best:
                continue  # (the first: no tie with itself to break)
            c = e.queued_tokens + e.foreign_tokens + w * self.uncached(e, plan)
            if c < cost or (c == cost and (e.outstanding < legs or (
                e.outstanding == legs and self.recent_work(e.url) < self.recent_work(best.url)
            ))):  # fmt: skip
                best, cost, legs = e, c, e.outstanding
        return best

    def sent(self, engine: EngineState, plan: Plan) -> None:
        self.sends += 1
        self.recent[engine.url] = (self.recent_work(engine.url) + self.uncached(engine, plan), self.sends)
        hashes = plan.hashes
        if not hashes:
            return
        index = self.indexes.get(engine.url)
        if index is None:
            index = self.indexes[engine.url] = PrefixIndex(self.capacities.get(engine.url, self.default_capacity))
        index.insert(hashes)

    def forget(self, engine: EngineState) -> None:
        index = self.indexes.get(engine.url)
        if index is not None:
            index.clear()

    def drop(self, engine: EngineState) -> None:
        self.indexes.pop(engine.url, None)
        self.capacities.pop(engine.url, None)
        self.recent.pop(engine.url, None)

    def capacity(self, engine: EngineState, tokens: int) -> None:
        blocks = tokens_to_blocks(tokens)
        self.capacities[engine.url] = blocks
        index = self.indexes.get(engine.url)
        if index is not None:
            index.resize(blocks)
