"""Routing: which engine each leg goes to, and whether a request is disaggregated at all.

Two decisions, both pure functions of the request, the fleet's state as
Narwhal knows it and the configuration (docs/configure.md, ``[routing]``):

* at admission, the request's :class:`Plan` (:meth:`Routing.plan`): ``pd``
  (a prefill leg, then a decode leg pulling its KV) or ``single`` (the whole
  request on one decode engine), why, and what the choice weighed — the
  journal's ``routing`` record (docs/operate.md, "The journal");
* for every leg, the engine: :meth:`~narwhal_core.fleet.Fleet.choose` keeps
  the engines in rotation with a free slot (and those the request has not
  failed on), in turn order, and the configured :class:`Policy` picks one.

A policy never reads a clock or draws a random number, so the same traffic
is routed the same way every time; ties go to the first candidate in turn
order, and the turn moves past each engine chosen, so equal engines share
the load instead of one taking it all.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from .ids import PREFILL
from .kv_policy import KvEventsPolicy
from .policies import (
    APPROXIMATE, BYTES_PER_TOKEN, KV_NEARLY_FULL, MAX_CANDIDATES, Clock, LeastLoaded, Plan, Policy, Prefix,
    RoundRobin, StoppedClock, estimate_tokens,
)

if TYPE_CHECKING:
    from .config import RoutingConfig
    from .contract import Route
    from .events import PromptTokenized
    from .fleet import Fleet
    from .kv_policy import HeadProbe, PromptTokenizer

__all__ = [
    "BYTES_PER_TOKEN", "MAX_CANDIDATES", "KV_NEARLY_FULL", "APPROXIMATE", "estimate_tokens", "Clock", "StoppedClock",
    "Plan", "Policy", "RoundRobin", "LeastLoaded", "Prefix", "KvEventsPolicy", "POLICIES", "make_policy", "Routing",
]

#: ``routing.policy`` -> the policy's class.
POLICIES: Final[Mapping[str, type[Policy]]] = MappingProxyType({
    "least_loaded": LeastLoaded,
    "round_robin": RoundRobin,
    "prefix": Prefix,
    "kv": KvEventsPolicy,
})


def make_policy(config: RoutingConfig, tokenizer: PromptTokenizer | None = None) -> Policy:
    """The policy ``config`` names, fresh (a policy's state belongs to one router).

    ``tokenizer`` is the runtime's (``Router(..., tokenizer=...)``): ``kv`` needs one.
    """
    return POLICIES[config.policy].from_config(config, tokenizer)


class Routing:
    """The plan of each request at admission: ``pd`` or ``single``, and why (docs/configure.md, ``[routing]``).

    With ``mode = "always"`` or ``"never"`` and a policy that keeps no
    prefix index, the plan is fixed and costs one small object: nothing is
    hashed or weighed. Otherwise the prefill candidates are weighed once
    here, and the journal's record lists them.
    """

    __slots__ = ("config", "fleet", "policy", "name", "fixed", "reason", "weigh", "inline_max")

    def __init__(self, config: RoutingConfig, fleet: Fleet) -> None:
        self.config: Final = config
        self.fleet: Final = fleet
        self.policy: Final = fleet.policy
        #: ``routing.policy``, as the journal names it.
        self.name: Final = config.policy
        #: The mode every request gets, when it is not decided per request (``None``: ``auto``).
        self.fixed: Final[bool | None] = (
            False if not fleet.pd or config.mode == "never" else True if config.mode == "always" else None
        )
        self.reason: Final = "configured" if fleet.pd else "no_prefill_engines"
        #: Whether admission weighs the prefill candidates (``auto``, or a policy with a prefix index).
        self.weigh: Final = self.fixed is None or (self.fixed and self.policy.keyed)
        #: Prompts of more bytes than this are tokenized off the event loop first (``None``: no prompt is
        #: tokenized; docs/routing.md, "Tokenizing off the event loop").
        self.inline_max: Final[int | None] = (
            config.tokenize_inline_max_bytes if self.weigh and self.policy.tokenizes else None
        )

    def probe_head(self, body: dict[str, Any], route: Route) -> HeadProbe | None:
        """A prompt larger than :attr:`inline_max`: what its head settles, or ``None``: tokenize it whole off the loop.

        (docs/routing.md, "Tokenizing only what can hit".) The probe found
        is the caller's to pass to :meth:`plan` or :meth:`replan` of the
        same prompt, at once (``probe=``): the request is then weighed from
        its head, without the whole prompt's ids.
        """
        return self.policy.probe_head(body, route, self.fleet.candidates(PREFILL))

    def plan(
        self, body: dict[str, Any], route: Route, size: int, tokenized: PromptTokenized | None = None,
        probe: HeadProbe | None = None,
    ) -> Plan:  # fmt: skip
        """The plan of a request just admitted.

        ``size``: its body's bytes; ``tokenized``: its token ids, if
        computed; ``probe``: what :meth:`probe_head` found of its prompt.
        """
        if not self.weigh:
            return Plan(bool(self.fixed), self.reason, size // BYTES_PER_TOKEN or 1)
        return self._weighed(body, route, size, tokenized, probe)

    def _weighed(
        self, body: dict[str, Any], route: Route, size: int, tokenized: PromptTokenized | None,
        probe: HeadProbe | None,
    ) -> Plan:  # fmt: skip
        """Weigh the prefill candidates: the policy's best one, and the mode ``auto`` decides from it."""
        policy = self.policy
        hashes = None
        tokens = estimate_tokens(size)
        if policy.keyed:
            hashes, tokens = policy.key(body, route, tokenized, probe)
        plan = Plan(True, "configured", tokens, hashes)
        fleet = self.fleet
        weighed = [(e, policy.uncached(e, plan), e.queued_tokens + e.foreign_tokens) for e in fleet.candidates(PREFILL)]
        if weighed:
            best = policy.pick(PREFILL, [e for e, _, _ in weighed], plan)
            w = policy.miss_cost
            weighed.sort(key=lambda c: (c[0] is not best, w * c[1] + c[2]))
            plan.candidates = tuple((e.url, uncached, queued) for e, uncached, queued in weighed[:MAX_CANDIDATES])
            if policy.names_index:
                plan.indexes = tuple(policy.index_name(e, plan) for e, _, _ in weighed[:MAX_CANDIDATES])
        if self.fixed is None:
            plan.pd, plan.reason = self.decide(plan)
        return plan

    def replan(
        self, plan: Plan, body: dict[str, Any], route: Route, tokenized: PromptTokenized | None = None,
        probe: HeadProbe | None = None,
    ) -> Plan:  # fmt: skip
        """The next prompt of a batch: the request's mode, with this prompt's own hashes and tokens.

        The candidates stay those weighed at admission, with the tokens of
        the prompt they were weighed for (the journal's ``routing`` record
        describes the admission: docs/operate.md, "The journal").
        """
        hashes, tokens = self.policy.key(body, route, tokenized, probe)
        replanned = Plan(plan.pd, plan.reason, tokens, hashes, plan.candidates)
        replanned.indexes = plan.indexes
        replanned.weighed_tokens = plan.weighed_tokens
        return replanned

    def decide(self, plan: Plan) -> tuple[bool, str]:
        """``auto``: ``pd`` or ``single``, from the best prefill candidate.

        (docs/configure.md, "Disaggregation per request".)

        Single when the prompt's uncached tokens there are fewer than
        ``disaggregate_min_uncached_tokens`` (``short_prompt``), or when the
        queue there would make the client wait longer than computing the
        whole prompt on a decode engine adds (``prefill_queue``); else
        disaggregated (``long_prompt``). Single too when no prefill engine
        has a free slot now (``prefill_queue``, with no candidates).
        """
        if not plan.candidates:
            return False, "prefill_queue"
        _, uncached, queued = plan.candidates[0]
        config = self.config
        if uncached < config.disaggregate_min_uncached_tokens:
            return False, "short_prompt"
        rate = config.prefill_tokens_per_s
        if queued / rate > plan.tokens / rate:
            return False, "prefill_queue"
        return True, "long_prompt"
