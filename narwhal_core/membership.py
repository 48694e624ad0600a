"""Engines that come and go: discovery's sets and the admin API's changes, applied to the fleet.

(docs/operate.md, "Engines that come and go".) An engine new to the fleet
*joins*: it is probed at once and scraped, and comes into rotation at its
first successful probe, not before. An engine that leaves is *drained*: it
stops being a candidate for legs and KV releases at once, its health probes
and ``/metrics`` scrapes stop and the routing policy forgets what it knew of
it (:meth:`~narwhal_core.routing.Policy.forget`); the legs running there
finish as they would have, and the KV it holds for Narwhal's requests is
released as always (the KV ledger's records still name it). Once nothing
refers to it any more (no leg, no KV held or being released) it is
forgotten. :class:`~narwhal_core.fleet.EngineState`
objects of the engines that stay are never replaced.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from .config import EngineAddress
from .events import EnginesChanged
from .fleet_change import FleetChanged
from .ids import PREFILL, Phase

if TYPE_CHECKING:
    from .context import Context
    from .fleet import EngineState
    from .health import Health
    from .kv import KvLedger
    from .load import LoadReports
    from .inflight import Request
    from .timers import Timer

__all__ = ["Membership", "SWEEP_S"]

#: How often a draining engine is checked for what still refers to it.
SWEEP_S: Final = 0.25


class Membership:
    """Adds, drains and forgets engines; see the module docstring."""

    __slots__ = ("ctx", "health", "load", "kv", "active", "sweeping")

    def __init__(
        self, ctx: Context, health: Health, load: LoadReports, kv: KvLedger, active: Mapping[str, Request]
    ) -> None:
        self.ctx: Final = ctx
        self.health: Final = health
        self.load: Final = load
        self.kv: Final = kv
        #: The requests not yet terminal, by rid (read only: the KV they hold).
        self.active: Final = active
        #: The sweep's timer, while an engine drains.
        self.sweeping: Timer | None = None

    def discovered(self, event: EnginesChanged) -> None:
        """Discovery's whole new set of one phase: add what is new, drain what is gone."""
        if self.ctx.draining:
            return  # shutting down: the fleet no longer matters
        phase: Phase = PREFILL if event.phase == PREFILL else "decode"
        wanted = {a.url: a for a in event.engines}
        for engine in list(self.ctx.fleet.engines[phase]):
            if engine.url not in wanted and not engine.draining:
                self.drain(engine, event.source)
        for address in wanted.values():
            self.add(phase, address, event.source)

    def add(self, phase: Phase, address: EngineAddress, source: str) -> EngineState | None:
        """Add the engine at ``address`` (a draining one rejoins); ``None``: it is already there."""
        ctx = self.ctx
        fleet = ctx.fleet
        engine = fleet.find(phase, address.url)
        if engine is not None and not engine.draining:
            return None
        if engine is None:
            engine = fleet.add(phase, address)
        else:
            fleet.rejoin(engine)
        ctx.log("engine_added", engine=engine.url, phase=phase, source=source)
        self.changed(phase)
        self.health.probe(engine)
        if self.load.interval > 0:
            self.load.scrape(engine)
        else:
            self.load.assume_capacity(engine, "routing.metrics_interval_s = 0: engines' /metrics are not read")
        return engine

    def changed(self, phase: Phase) -> None:
        """Tell the runtime the engines of ``phase`` now (:class:`~narwhal_core.fleet_change.FleetChanged`)."""
        engines = tuple(e.address for e in self.ctx.fleet.engines[phase])
        self.ctx.out.append(FleetChanged(phase=phase, engines=engines))

    def drain(self, engine: EngineState, source: str) -> None:
        """Take ``engine`` out for good: no new legs or releases; forgotten once nothing uses it."""
        ctx = self.ctx
        ctx.fleet.drain(engine)
        timer = self.health.next_probe.pop(engine, None)
        if timer is not None:
            timer.cancel()
        timer = self.load.next_scrape.pop(engine, None)
        if timer is not None:
            timer.cancel()
        ctx.log("engine_draining", engine=engine.url, phase=engine.phase, source=source,
                outstanding=engine.outstanding, kv_held=self.kv_held(engine))
        if self.sweeping is None:
            self.sweep(None)

    def kv_held(self, engine: EngineState) -> int:
        """Narwhal's requests whose prefilled KV ``engine`` holds, not yet pulled or settled."""
        if engine.phase != PREFILL:
            return 0
        held = 0
        for req in self.active.values():
            if req.kv is not None and req.kv.engine is engine:
                held += 1
        for _, kv in self.kv.releases.values():
            if kv.engine is engine:
                held += 1
        return held

    def in_use(self, engine: EngineState) -> bool:
        """Whether anything still refers to ``engine``: a leg, or KV held there or being released.

        (A probe or scrape still in flight does not count: its answer finds
        the engine draining and arms nothing more.)
        """
        return engine.outstanding > 0 or self.kv_held(engine) > 0

    def sweep(self, _: object) -> None:
        """Forget the draining engines nothing uses; look again later while some are left."""
        ctx = self.ctx
        fleet = ctx.fleet
        self.sweeping = None
        left = False
        for engine in [e for e in fleet.all() if e.draining]:
            if self.in_use(engine):
                left = True
                continue
            fleet.remove(engine)
            self.load.unavailable.discard(engine)
            self.load.forget(engine)
            fleet.policy.drop(engine)
            ctx.log("engine_removed", engine=engine.url, phase=engine.phase)
            self.changed(engine.phase)
        if left:
            self.sweeping = ctx.timers.arm(ctx.now + SWEEP_S, self.sweep, self)
