"""A prefill engine's KV events as they reach the router: the routing policy's index learns from them.

Only the ``kv`` policy (docs/routing.md, "Precise KV routing") reads the
events; every other policy ignores them. The adapters' subscribers deliver
:class:`~narwhal_core.events.KvEventsReceived` batches in order and
:class:`~narwhal_core.events.KvStreamChanged` when a stream comes up or goes
down; this part hands both to the policy, logs what an operator needs to see
(a stream lost, a batch that could not be used), and arms the timer that
ends a lost stream's grace on time, traffic or not.
"""

from __future__ import annotations

from typing import Final

from .context import Context
from .events import KvEventsReceived, KvStreamChanged
from .ids import PREFILL

__all__ = ["KvEventFeed"]


class KvEventFeed:
    """Hands each prefill engine's KV events and stream changes to the fleet's routing policy."""

    __slots__ = ("ctx",)

    def __init__(self, ctx: Context) -> None:
        self.ctx: Final = ctx

    def events(self, event: KvEventsReceived) -> None:
        """A prefill engine's KV events, in order: the policy's index learns what it holds."""
        ctx = self.ctx
        fleet = ctx.fleet
        if fleet.find(PREFILL, event.url) is None:
            return  # not (or no longer) a prefill engine of this fleet
        problem = fleet.policy.kv_events(event.url, event.events, ctx.now)
        if problem is not None:
            ctx.log("kv_events_unusable", level="warning", engine=event.url, problem=problem)

    def stream(self, event: KvStreamChanged) -> None:
        """A prefill engine's KV-event stream came up or went down: logged once per change."""
        ctx = self.ctx
        fleet = ctx.fleet
        if fleet.find(PREFILL, event.url) is None:
            return
        if not fleet.policy.kv_stream(event.url, event.live, event.reason, ctx.now):
            return
        if event.live:
            ctx.log("kv_events_live", engine=event.url, reason=event.reason)
        else:
            stale_s = ctx.config.routing.kv_events_stale_s
            ctx.log("kv_events_lost", level="warning", engine=event.url, reason=event.reason,
                    fallback_after_s=stale_s)
            # The fallback is found when the engine is next weighed; this finds (and logs) it on time.
            ctx.timers.arm(ctx.now + stale_s, self._stale_due, event.url)

    def live(self) -> dict[str, bool]:
        """Whether each prefill engine is weighed from its KV events now (empty unless the policy is ``kv``)."""
        fleet = self.ctx.fleet
        return fleet.policy.kv_live([e.url for e in fleet.engines[PREFILL]], self.ctx.now)

    def _stale_due(self, url: str) -> None:
        """A lost stream's grace is over: unless it came back, its engine falls back now (``kv_events_stale``)."""
        fleet = self.ctx.fleet
        if fleet.find(PREFILL, url) is not None:
            fleet.policy.kv_stale_due(url, self.ctx.now)
