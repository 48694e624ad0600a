"""Engine health: the probes, and the verdicts of legs and probes on engines (docs/operate.md).

(docs/operate.md, "Engine health and rotation".) :class:`Health` sends the
health probes and turns their answers and the legs' outcomes into verdicts
on the engines of the :class:`~narwhal_core.fleet.Fleet`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from .config import is_ip_address
from .events import ControlDone, StartControl
from .fleet import HealthChange
from .ids import PREFILL
from .states import WAKE

if TYPE_CHECKING:
    from .context import Context
    from .fleet import EngineState
    from .timers import Timer

__all__ = ["Health"]


class Health:
    """Health probes and the verdicts of legs and probes on engines (docs/operate.md).

    Every engine is probed at start (``/ready`` waits for the answers), then
    every ``health.probe_interval_s`` until shutdown begins. A probe's answer,
    like a leg's outcome, counts for or against its engine
    (:meth:`Fleet.record_success`, :meth:`engine_failed`); an engine coming
    back into rotation queues the follow-up that wakes a request waiting for
    a slot of its phase (docs/design.md, "Follow-up work").
    """

    __slots__ = ("ctx", "probes", "probe_seq", "next_probe")

    def __init__(self, ctx: Context) -> None:
        self.ctx: Final = ctx
        #: Probes in flight, by control key.
        self.probes: dict[str, EngineState] = {}
        self.probe_seq = 0
        #: Each engine's next probe (cancelled when shutdown begins).
        self.next_probe: dict[EngineState, Timer] = {}

    def probe_all(self) -> None:
        """Probe every engine at once."""
        for engine in self.ctx.fleet.all():
            self.probe(engine)

    def probe(self, engine: EngineState) -> None:
        """Send one health probe to ``engine``."""
        ctx = self.ctx
        self.probe_seq += 1
        key = f"probe-{self.probe_seq}"
        h = ctx.config.health
        self.probes[key] = engine
        ctx.out.append(StartControl(
            key, engine.address, "GET", h.probe_path,
            ((b"host", engine.address.authority), *ctx.auth_header), b"", h.probe_timeout_s,
            # A prefill engine's name is resolved at every probe: its addresses
            # may name its KV side channel (docs/configure.md, engine.kv_hosts).
            resolve=engine.phase == PREFILL and not is_ip_address(engine.address.host),
        ))

    def stop_probing(self) -> None:
        """Shutdown began: no more probes (the engines' health no longer matters)."""
        for timer in self.next_probe.values():
            timer.cancel()
        self.next_probe.clear()

    def probe_done(self, event: ControlDone) -> bool:
        """Take a probe's answer; ``False`` if ``event`` answers no probe of ours."""
        engine = self.probes.pop(event.key, None)
        if engine is None:
            return False
        ctx = self.ctx
        ok = event.error is None and (event.status is None or 200 <= event.status < 300)
        first = not engine.probed
        engine.probed = True
        if event.local:
            change = None  # Narwhal's own shortage: no verdict on the engine
            ctx.shortage("health probe")
        elif ok and event.status is not None:
            change = ctx.fleet.record_success(engine, probe=True)
        else:
            reason = event.error if event.status is None else f"HTTP {event.status}"
            if first and not engine.answered:
                ctx.log("engine_not_answering", level="warning", engine=engine.url, phase=engine.phase,
                        reason=reason or "no answer")
            change = self.engine_failed(engine, reason or "no answer")
        if not ctx.draining and not engine.draining:  # (a draining engine is probed no more)
            self.next_probe[engine] = ctx.timers.arm(ctx.now + ctx.config.health.probe_interval_s, self.probe, engine)
        if change == "up":
            ctx.log("engine_up", engine=engine.url, phase=engine.phase)
            ctx.followups.append(WAKE[engine.phase])
        return True

    def engine_failed(self, engine: EngineState, reason: str | None = None) -> HealthChange:
        """Charge a failure to ``engine``; log it leaving rotation."""
        change = self.ctx.fleet.record_failure(engine)
        if change == "down":
            self.ctx.log("engine_down", engine=engine.url, phase=engine.phase, failures=engine.failures,
                         reason=reason or "failed")
        return change

    def kv_host_allowed(self, host: str) -> bool:
        """The SSRF guard on a prefill answer's ``remote_host``; a refused value is logged once, with the fix."""
        fleet = self.ctx.fleet
        if fleet.kv_host_allowed(host):
            return True
        if fleet.first_refusal(host):
            self.ctx.log(
                "kv_host_refused", level="warning", remote_host=host[:200],
                fix="if this is a prefill engine's KV side channel host (VLLM_NIXL_SIDE_CHANNEL_HOST), "
                    "add it, or its network in CIDR form, to engine.kv_hosts",
            )
        return False
