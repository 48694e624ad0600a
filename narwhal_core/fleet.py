"""Engines and admission: who may run, where, and when.

:class:`Fleet` keeps each engine's health and outstanding legs and makes the
engine choice (:meth:`Fleet.choose`, where routing policies plug in).
:class:`Admission` keeps the global in-flight limit, the bounded queue and
per-client limits (docs/configure.md, ``[admission]``). Both are plain
bookkeeping: the router decides what to do with their answers. The health
probes and the verdicts on engines are :mod:`~narwhal_core.health`'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence
from typing import Final, Literal

from .config import EngineAddress, is_loopback_host, normalize_host
from .engine_metrics import EngineLoad
from .ids import DECODE, PREFILL, Phase
from .policies import LeastLoaded, Plan, Policy

__all__ = ["EngineState", "Fleet", "Admission", "AdmitDecision", "HealthChange"]

HealthChange = Literal["down", "up"] | None

#: Refused ``remote_host`` values remembered (each is logged once); past this, new ones are not logged.
MAX_REFUSED_KV_HOSTS: Final = 1000


class EngineState:
    """One engine of one phase, as the router sees it.

    A plain class rather than an attrs one: the compiled build makes it a
    native class, whose fields the fleet, the policies and the legs read
    and write without a dictionary look-up (docs/design.md, "The compiled
    build"). The fields, and what each means:

    * ``address``, ``phase``: where it is and the phase it serves;
      ``url``, the address's base URL (read per leg and per record).
    * ``index``: its position in its phase's list (the configured order,
      engines found later after; used for ties).
    * ``healthy``: in rotation, legs may be sent to it.
    * ``outstanding``: legs now running on it; ``queued_tokens``, the
      estimated prompt tokens of the prefill legs now running on it
      (docs/configure.md, "Routing policies").
    * ``failures``: consecutive failures, active (probes) and passive
      (legs) alike; ``successes``, consecutive successful probes while out
      of rotation.
    * ``total_legs``, ``total_failures``: legs sent to it, and legs that
      failed on it, since start.
    * ``answered``: it has answered, a successful probe or leg since start
      (``/ready`` waits for one per phase); ``probed``, its first health
      probe has finished, whatever the outcome.
    * ``addresses``: what its host name resolved to at the last probe (a
      prefill engine's KV side channel may be named by any of them).
    * ``reported``, ``reported_at``: what its ``/metrics`` said last
      (:mod:`.load`; ``None``: nothing, or too long ago), and when; from
      that report (0 without one), ``foreign`` (the requests it runs or
      queues beyond Narwhal's legs there), ``foreign_tokens`` (their
      estimated prompt tokens) and ``kv_usage`` (the fraction of its KV
      cache in use).
    * ``joining``: found at run time and not yet in rotation, its first
      successful probe brings it in (docs/operate.md, "Engines that come
      and go"); ``draining``, gone from discovery (or removed by hand), out
      of rotation for good, forgotten once nothing uses it.
    """

    address: EngineAddress
    phase: Phase
    url: str
    index: int
    healthy: bool
    outstanding: int
    queued_tokens: int
    failures: int
    successes: int
    total_legs: int
    total_failures: int
    answered: bool
    probed: bool
    addresses: frozenset[str]
    reported: EngineLoad | None
    reported_at: float
    foreign: int
    foreign_tokens: int
    kv_usage: float
    joining: bool
    draining: bool

    def __init__(
        self, address: EngineAddress, phase: Phase, index: int, *, healthy: bool = True, joining: bool = False
    ) -> None:
        self.address = address
        self.phase = phase
        self.url = address.url
        self.index = index
        self.healthy = healthy
        self.outstanding = 0
        self.queued_tokens = 0
        self.failures = 0
        self.successes = 0
        self.total_legs = 0
        self.total_failures = 0
        self.answered = False
        self.probed = False
        self.addresses = frozenset()
        self.reported = None
        self.reported_at = 0.0
        self.foreign = 0
        self.foreign_tokens = 0
        self.kv_usage = 0.0
        self.joining = joining
        self.draining = False

    def __repr__(self) -> str:
        return f"EngineState({self.phase} {self.url}, {self.state}, outstanding={self.outstanding})"

    @property
    def state(self) -> str:
        """What ``GET /admin/engines`` says of it: joining, in rotation, out of rotation or draining."""
        if self.draining:
            return "draining"
        if self.joining:
            return "joining"
        return "in rotation" if self.healthy else "out of rotation"


class Fleet:
    """Health and load of every engine; the engine choice among those in rotation, by the routing policy."""

    def __init__(
        self,
        prefill: Sequence[EngineAddress],
        decode: Sequence[EngineAddress],
        *,
        max_inflight_per_engine: int,
        unhealthy_after: int,
        healthy_after: int,
        kv_host_allowed: Callable[[str], bool] | None = None,
        policy: Policy | None = None,
        pd: bool | None = None,
    ) -> None:
        self.engines: dict[Phase, list[EngineState]] = {
            PREFILL: [EngineState(address=a, phase=PREFILL, index=i) for i, a in enumerate(prefill)],
            DECODE: [EngineState(address=a, phase=DECODE, index=i) for i, a in enumerate(decode)],
        }
        self._max = max_inflight_per_engine
        self._unhealthy_after = unhealthy_after
        self._healthy_after = healthy_after
        self._turn: dict[Phase, int] = {PREFILL: 0, DECODE: 0}
        #: The routing policy that picks among the candidates (``routing.policy``; :mod:`narwhal_core.routing`).
        self.policy: Final[Policy] = policy if policy is not None else LeastLoaded()
        #: Prompt tokens of a prefill leg, a running mean (what a request Narwhal did not send may cost).
        self.mean_prompt_tokens = 0.0
        #: What the configuration allows as a prefill answer's ``remote_host``
        #: (``EngineConfig.kv_host_allowed``); by default, the prefill hosts as written.
        self._kv_static: Callable[[str], bool] = (
            kv_host_allowed if kv_host_allowed is not None else self._prefill_host
        )
        #: Every address the prefill engines' names resolved to, and whether one is loopback.
        self._kv_addresses: frozenset[str] = frozenset()
        self._kv_loopback = False
        #: ``remote_host`` values refused so far (each is logged once).
        self._kv_refused: set[str] = set()
        #: Prefill engines are configured or may be discovered (else single-leg mode).
        self._pd = bool(prefill) if pd is None else pd
        #: Engines were added at run time (docs/operate.md, "Engines that come and go").
        self._dynamic = False

    @property
    def pd(self) -> bool:
        """Whether prefill engines are configured (else single-leg mode: docs/configure.md, `[engine]`)."""
        return self._pd

    def all(self) -> list[EngineState]:
        """Every engine, prefill first."""
        return self.engines[PREFILL] + self.engines[DECODE]

    def has_answered(self, phase: Phase) -> bool:
        """Whether an engine of ``phase`` is in rotation and has answered since start."""
        for e in self.engines[phase]:
            if e.healthy and e.answered:
                return True
        return False

    def all_probed(self) -> bool:
        """Whether every engine's first health probe has finished."""
        return all(e.probed for e in self.all())

    # ------------------------------------------------------- engines that come and go

    def find(self, phase: Phase, url: str) -> EngineState | None:
        """The engine of ``phase`` at ``url`` (draining or not), if the fleet has it."""
        for e in self.engines[phase]:
            if e.url == url:
                return e
        return None

    def add(self, phase: Phase, address: EngineAddress) -> EngineState:
        """A new engine of ``phase``: out of rotation until its first successful probe."""
        engines = self.engines[phase]
        engine = EngineState(address=address, phase=phase, index=len(engines), healthy=False, joining=True)
        engines.append(engine)
        self._dynamic = True
        if phase == PREFILL:
            self._kv_hosts_changed()
        return engine

    def drain(self, engine: EngineState) -> None:
        """``engine`` leaves for good: no new legs or releases go to it; what runs there finishes."""
        engine.draining = True
        engine.joining = False
        engine.healthy = False
        self.policy.forget(engine)

    def rejoin(self, engine: EngineState) -> None:
        """A draining engine was found again: it joins as a new one would, at its next successful probe."""
        engine.draining = False
        engine.joining = True
        engine.successes = 0

    def remove(self, engine: EngineState) -> None:
        """Forget a drained engine that nothing uses any more; the others keep their state (and identity)."""
        engines = self.engines[engine.phase]
        engines.remove(engine)
        for position, e in enumerate(engines):
            e.index = position
        self._turn[engine.phase] = 0
        if engine.phase == PREFILL:
            self._kv_hosts_changed()

    # ---------------------------------------------------------- KV side channel

    def _prefill_host(self, host: str) -> bool:
        return host in {e.address.host for e in self.engines[PREFILL]}

    def resolved(self, address: EngineAddress, addresses: Collection[str]) -> bool:
        """The adapter resolved the host of the prefill engine at ``address``; whether anything changed.

        The addresses replace those of the last resolution (a pod's address
        changes when it is rescheduled). Entries that are not IP addresses
        are ignored; an IPv6 zone (``%eth0``) is dropped.
        """
        normal = set()
        for text in addresses:
            host = normalize_host(text.partition("%")[0])
            if host is not None:
                normal.add(host)
        found = frozenset(normal)
        changed = False
        for e in self.engines[PREFILL]:
            if e.address == address and e.addresses != found:
                e.addresses = found
                changed = True
        if changed:
            self._kv_hosts_changed()
        return changed

    def _kv_hosts_changed(self) -> None:
        """The prefill engines or their addresses changed: what their KV side channels may be named by."""
        everything: set[str] = set()
        for e in self.engines[PREFILL]:
            everything |= e.addresses
            if e.joining or e.draining or self._dynamic:
                # Found at run time: its host is the fleet's to allow, as a configured one is the config's.
                everything.add(e.address.host)
        self._kv_addresses = frozenset(everything)
        self._kv_loopback = any(is_loopback_host(h) for h in everything)

    def kv_host_allowed(self, host: str) -> bool:
        """Whether a prefill answer's ``remote_host`` names a host of this fleet.

        As configured (a prefill engine's host, a ``kv_hosts`` entry or
        network, loopback as one host), or one of the addresses a prefill
        engine's name resolved to at its last probe.
        """
        if self._kv_static(host):
            return True
        if not self._kv_addresses:
            return False
        if host in self._kv_addresses:
            return True
        normal = normalize_host(host)
        if normal is None:
            return False
        return normal in self._kv_addresses or (self._kv_loopback and is_loopback_host(normal))

    def first_refusal(self, host: str) -> bool:
        """Whether ``host`` is refused for the first time (so worth a log line); remembers it."""
        refused = self._kv_refused
        if host in refused or len(refused) >= MAX_REFUSED_KV_HOSTS:
            return False
        refused.add(host)
        return True

    # ------------------------------------------------------------------- legs

    def has_healthy(self, phase: Phase) -> bool:
        """Whether any engine of ``phase`` is in rotation."""
        for e in self.engines[phase]:  # (a loop, not any(): this runs for every request)
            if e.healthy:
                return True
        return False

    def has_room(self, phase: Phase) -> bool:
        """Whether an engine of ``phase`` in rotation has a free slot (:meth:`choose` would find one)."""
        limit = self._max
        for e in self.engines[phase]:
            if e.healthy and e.outstanding < limit:
                return True
        return False

    def choose(
        self, phase: Phase, avoid: Collection[EngineState] = (), *, request_key: str | None = None,
        now: float = 0.0, plan: Plan | None = None,
    ) -> EngineState | None:  # fmt: skip
        """THE ENGINE CHOICE: the engine of ``phase`` a request's next leg (or KV release) goes to.

        Every leg and every decode-side release is sent where this says, so
        this is the one seam where the routing policy plugs in. The
        candidates are the engines of ``phase`` in rotation with a free
        slot, in turn order; engines in ``avoid`` (those the request already
        failed on) are candidates only when no other engine can take the
        leg. The policy (:mod:`narwhal_core.routing`) picks among them, from
        the request's ``plan`` and the engines' load; the turn then moves
        past the engine chosen, so ties rotate. (``request_key`` names the
        request and ``now`` is the event's time; no policy reads them yet.)
        ``None``: no engine in rotation has a free slot.
        """
        engines = self.engines[phase]
        count = len(engines)
        if count == 0:
            return None
        start = self._turn[phase]
        limit = self._max
        candidates = []
        failed_on = []
        for e in (engines[start:] + engines[:start]) if start else engines:
            if e.healthy and e.outstanding < limit:
                if avoid and e in avoid:
                    failed_on.append(e)
                else:
                    candidates.append(e)
        if not candidates:
            if not failed_on:
                return None
            candidates = failed_on
        best = candidates[0] if len(candidates) == 1 else self.policy.pick(phase, candidates, plan)
        self._turn[phase] = (best.index + 1) % count
        return best

    def candidates(self, phase: Phase) -> list[EngineState]:
        """The engines of ``phase`` that could take a leg now (in rotation, a free slot), in turn order."""
        engines = self.engines[phase]
        start = self._turn[phase]
        limit = self._max
        return [e for e in engines[start:] + engines[:start] if e.healthy and e.outstanding < limit]

    def leg_started(self, engine: EngineState, tokens: int = 0) -> None:
        """A leg now runs on ``engine``; a prefill leg adds its prompt's estimated ``tokens`` to its queue."""
        engine.outstanding += 1
        engine.total_legs += 1
        if tokens:
            engine.queued_tokens += tokens
            # A running mean of prompt lengths (1/16 weight each, the first taken whole): what another
            # router's request there may cost.
            mean = self.mean_prompt_tokens
            self.mean_prompt_tokens = mean + (tokens - mean) / 16 if mean else float(tokens)

    def leg_ended(self, engine: EngineState, tokens: int = 0) -> None:
        """A leg on ``engine`` is over (``tokens``: what its start added)."""
        engine.outstanding -= 1
        engine.queued_tokens -= tokens

    def record_failure(self, engine: EngineState) -> HealthChange:
        """Charge a failure (failed leg or probe) to ``engine``; ``"down"`` if it leaves rotation."""
        engine.failures += 1
        engine.total_failures += 1
        engine.successes = 0
        if engine.healthy and engine.failures >= self._unhealthy_after:
            engine.healthy = False
            self.policy.forget(engine)
            return "down"
        return None

    def record_success(self, engine: EngineState, *, probe: bool) -> HealthChange:
        """A leg or probe on ``engine`` succeeded; ``"up"`` if it returns to rotation.

        Only probes bring an engine back: no legs are sent to an engine out of rotation.
        """
        engine.failures = 0
        engine.answered = True
        if engine.healthy or not probe or engine.draining:
            return None
        if engine.joining:
            engine.joining = False
            engine.healthy = True
            engine.successes = 0
            return "up"
        engine.successes += 1
        if engine.successes >= self._healthy_after:
            engine.healthy = True
            engine.successes = 0
            return "up"
        return None


AdmitDecision = Literal["admitted", "queued", "client_limit", "fleet_full"]


class Admission:
    """The global in-flight limit, the bounded FIFO queue and per-client limits."""

    def __init__(self, *, max_inflight: int, queue_size: int, per_client_max_inflight: int) -> None:
        self.max_inflight: Final = max_inflight
        self.queue_size: Final = queue_size
        self.per_client_max: Final = per_client_max_inflight
        #: Requests holding a global slot.
        self.inflight = 0
        #: Requests waiting for a slot, oldest first.
        self.queue: deque[str] = deque()
        #: Admitted or queued requests per client.
        self.per_client: dict[str, int] = {}

    def offer(self, rid: str, client: str) -> AdmitDecision:
        """Admit ``rid``, queue it, or say why not (nothing is reserved on refusal)."""
        held = self.per_client.get(client, 0)
        if self.per_client_max and held >= self.per_client_max:
            return "client_limit"
        if self.inflight < self.max_inflight and not self.queue:
            decision: AdmitDecision = "admitted"
            self.inflight += 1
        elif len(self.queue) < self.queue_size:
            decision = "queued"
            self.queue.append(rid)
        else:
            return "fleet_full"
        self.per_client[client] = held + 1
        return decision

    def next_from_queue(self) -> str | None:
        """Move the oldest queued request into a free slot, if there is one."""
        if self.queue and self.inflight < self.max_inflight:
            self.inflight += 1
            return self.queue.popleft()
        return None

    def leave_queue(self, rid: str, client: str) -> None:
        """A queued request gives up (timeout, client gone)."""
        self.queue.remove(rid)
        self._drop_client(client)

    def queue_wait_over(self, rid: str, client: str) -> None:
        """A queued request waited ``admission.queue_timeout_s`` for nothing."""
        self.leave_queue(rid, client)

    def release(self, client: str) -> None:
        """An admitted request no longer holds its slot."""
        self.inflight -= 1
        self._drop_client(client)

    def _drop_client(self, client: str) -> None:
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]
