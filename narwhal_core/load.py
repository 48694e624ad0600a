"""The load engines report: each engine's ``/metrics``, scraped every ``routing.metrics_interval_s``.

Narwhal knows what it has in flight on each engine (:class:`~.fleet.EngineState`'s
``outstanding`` and ``queued_tokens``), but not what other routers, other
Narwhal processes or other clients send there, nor how full the engine's
KV cache is. Each engine's ``/metrics`` says that (:mod:`.engine_metrics`),
so :class:`LoadReports` asks every engine for it, one scrape at a time per
engine: the next is sent ``metrics_interval_s`` after the last one's answer.
The figures are kept on the engine with the time they arrived
(``reported`` and ``reported_at``) until a failed scrape finds them older
than :func:`stale_after`: then they are dropped, and the engine is routed
on Narwhal's own view alone until its figures come back.

A scrape is not a health probe: an engine that serves no ``/metrics``
(a 404, an engine started without it) or answers it slowly stays in
rotation, and Narwhal logs it once (``engine_metrics_unavailable``), and
once more when the figures come back (``engine_metrics_available``). An
engine's ``vllm:cache_config_info`` says how many tokens of KV it holds:
the prefix index of that engine is bounded by it from then on
(docs/configure.md, ``[routing]``). A prefill engine that does not say it
(no such sample, no ``/metrics``, or scraping off) is bounded by
``routing.kv_capacity_tokens``, and Narwhal logs that once per engine
(``kv_capacity_assumed``: the bound, why, and the key that sets it;
docs/operate.md, "Engine load").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .engine_metrics import EngineLoad, MetricsError, parse_engine_metrics
from .events import ControlDone, StartControl
from .ids import PREFILL

if TYPE_CHECKING:
    from .context import Context
    from .fleet import EngineState
    from .timers import Timer

__all__ = ["LoadReports", "METRICS_PATH", "METRICS_BODY_LIMIT", "stale_after"]

#: Where engines serve their metrics (vLLM's OpenAI server: ``vllm/entrypoints/openai/api_server.py``,
#: ``mount_metrics``).
METRICS_PATH: Final = "/metrics"
#: Most bytes of an engine's ``/metrics`` read: vLLM's, with its histograms, is some tens of KB per engine core.
METRICS_BODY_LIMIT: Final = 1 << 20


def stale_after(interval: float, timeout: float) -> float:
    """How old reported figures may grow before they are dropped: three scrapes missed, each allowed its timeout."""
    return 3 * (interval + timeout)


class LoadReports:
    """Scrapes every engine's ``/metrics`` and keeps what they report (docs/operate.md, "Engine load")."""

    __slots__ = ("ctx", "interval", "timeout", "max_age", "scrapes", "seq", "next_scrape", "unavailable",
                 "capacity_learned", "capacity_assumed")

    def __init__(self, ctx: Context) -> None:
        self.ctx: Final = ctx
        routing = ctx.config.routing
        #: Seconds between an answer and the next scrape of that engine (0: never scraped).
        self.interval: Final = routing.metrics_interval_s
        self.timeout: Final = ctx.config.health.probe_timeout_s
        self.max_age: Final = stale_after(self.interval, self.timeout)
        #: Scrapes in flight, by control key.
        self.scrapes: dict[str, EngineState] = {}
        self.seq = 0
        #: Each engine's next scrape (cancelled when shutdown begins).
        self.next_scrape: dict[EngineState, Timer] = {}
        #: Engines whose last scrape failed (logged once until one succeeds).
        self.unavailable: set[EngineState] = set()
        #: The capacity each engine reported, in tokens, once known (the routing policy sizes its index by it).
        self.capacity_learned: dict[EngineState, int] = {}
        #: Prefill engines whose index is bounded by ``routing.kv_capacity_tokens``, as logged (``None``: the
        #: policy keeps no prefix index, nothing to log).
        self.capacity_assumed: set[EngineState] | None = set() if ctx.fleet.policy.keyed else None

    def scrape_all(self) -> None:
        """Scrape every engine at once (at start), unless scraping is off."""
        if self.interval > 0:
            for engine in self.ctx.fleet.all():
                self.scrape(engine)
        else:
            for engine in self.ctx.fleet.all():
                self.assume_capacity(engine, "routing.metrics_interval_s = 0: engines' /metrics are not read")

    def forget(self, engine: EngineState) -> None:
        """``engine`` left the fleet: what was learned or logged of its capacity goes with it."""
        self.capacity_learned.pop(engine, None)
        if self.capacity_assumed is not None:
            self.capacity_assumed.discard(engine)

    def assume_capacity(self, engine: EngineState, reason: str) -> None:
        """Log, once, that ``engine``'s prefix index is bounded by ``routing.kv_capacity_tokens`` (and why)."""
        assumed = self.capacity_assumed
        if assumed is None or engine.phase != PREFILL or engine in assumed or engine in self.capacity_learned:
            return
        assumed.add(engine)
        self.ctx.log(
            "kv_capacity_assumed", engine=engine.url, kv_capacity_tokens=self.ctx.config.routing.kv_capacity_tokens,
            reason=reason,
            fix="set routing.kv_capacity_tokens to the engine's KV cache size in tokens (vLLM logs it at start: "
            "'GPU KV cache size: N tokens'), or let the engine report vllm:cache_config_info on /metrics",
        )  # fmt: skip

    def scrape(self, engine: EngineState) -> None:
        """Ask ``engine`` for its ``/metrics``."""
        ctx = self.ctx
        self.next_scrape.pop(engine, None)
        self.seq += 1
        key = f"metrics-{self.seq}"
        self.scrapes[key] = engine
        ctx.out.append(StartControl(
            key, engine.address, "GET", METRICS_PATH,
            ((b"host", engine.address.authority), *ctx.auth_header), b"", self.timeout,
            body_limit=METRICS_BODY_LIMIT,
        ))

    def stop(self) -> None:
        """Shutdown began: no more scrapes."""
        for timer in self.next_scrape.values():
            timer.cancel()
        self.next_scrape.clear()

    def done(self, event: ControlDone) -> bool:
        """Take a scrape's answer; ``False`` if ``event`` answers no scrape of ours."""
        engine = self.scrapes.pop(event.key, None)
        if engine is None:
            return False
        ctx = self.ctx
        load = None
        if event.status is not None and 200 <= event.status < 300:
            try:
                load = parse_engine_metrics(event.body)
            except MetricsError:
                load = None  # more than it reads at all (the scrape's body limit keeps it from happening)
            if load is not None and load.waiting is None and load.running is None and load.kv_usage is None:
                load = None  # answered, but with none of the figures: not a vLLM-shaped /metrics
        if load is not None:
            self._reported(engine, load)
            if not ctx.draining and not engine.draining:
                self.next_scrape[engine] = ctx.timers.arm(ctx.now + self.interval, self.scrape, engine)
            return True
        if engine.reported is not None and ctx.now - engine.reported_at > self.max_age:
            # Too old to route on: Narwhal's own view alone, until the figures come back.
            engine.reported = None
            engine.foreign = engine.foreign_tokens = 0
            engine.kv_usage = 0.0
        if engine not in self.unavailable:
            self.unavailable.add(engine)
            reason = event.error or (f"HTTP {event.status}" if event.status is not None else "no answer")
            if event.status is not None and 200 <= event.status < 300:
                reason = "no vllm: load figures in the answer"
            ctx.log("engine_metrics_unavailable", level="warning", engine=engine.url, phase=engine.phase,
                    reason=reason)
            self.assume_capacity(engine, f"no figures from its /metrics ({reason})")
        if not ctx.draining and not engine.draining:
            self.next_scrape[engine] = ctx.timers.arm(ctx.now + self.interval, self.scrape, engine)
        return True

    def _reported(self, engine: EngineState, load: EngineLoad) -> None:
        ctx = self.ctx
        engine.reported = load
        engine.reported_at = ctx.now
        # What the engine runs or queues beyond Narwhal's own legs: other routers' requests (docs/operate.md).
        seen = (load.waiting or 0) + (load.running or 0)
        engine.foreign = max(0, seen - engine.outstanding)
        engine.foreign_tokens = round(engine.foreign * ctx.fleet.mean_prompt_tokens)
        engine.kv_usage = load.kv_usage or 0.0
        if engine in self.unavailable:
            self.unavailable.discard(engine)
            ctx.log("engine_metrics_available", engine=engine.url, phase=engine.phase)
        capacity = load.kv_capacity_tokens
        if capacity is None:
            self.assume_capacity(engine, "its /metrics has no vllm:cache_config_info with num_gpu_blocks")
        elif self.capacity_learned.get(engine) != capacity:
            self.capacity_learned[engine] = capacity
            ctx.fleet.policy.capacity(engine, capacity)

