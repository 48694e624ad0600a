"""Fair admission among tenants (docs/operate.md, "Tenants"): bands first, then weighted shares of prompt tokens.

With ``[tenants]`` configured, the router's admission is a
:class:`FairAdmission`: the same global in-flight limit, queue bound and
per-client limits as :class:`~narwhal_core.fleet.Admission`, but the
requests that wait are held in a :class:`FairQueue` instead of a FIFO
deque. Without ``[tenants]`` none of this runs: admission is the plain
deque.

The queue is strict between bands (a waiting request of a higher band is
always admitted first) and, within a band, start-time fair queueing over
each request's cost, its estimated prompt tokens:

* each tenant of a band has a finish tag ``F``; the band has a virtual time ``V``;
* a tenant's first waiting request starts at ``S = max(V, F)``;
* the band admits the tenant whose first request has the smallest ``S``
  (ties: the one that arrived first); then ``V = S`` and ``F = S + cost / weight``;
* when the band's queue empties, ``V`` becomes the largest ``F`` and the tags are forgotten.

So while a tenant waits, any other tenant of its band is admitted at most
``weight_other / weight_own × C + C`` prompt tokens ahead of its first
request, ``C`` the largest cost of one request (docs/operate.md, "Tenants").

Each tenant's budget is checked before its request takes a slot or a place
in the queue: its in-flight limit (its own, or the per-client one) and, if
it has one, its rates (:mod:`~narwhal_core.budgets`).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Final

from .budgets import BudgetRefusal, Budgets
from .policies import StoppedClock
from .stats import Histogram, Stats

if TYPE_CHECKING:
    from .fleet import AdmitDecision
    from .policies import Clock
    from .tenants_config import TenantsConfig

__all__ = ["FairQueue", "FairAdmission", "Waiter"]


class Waiter:
    """One request in the fair queue."""

    __slots__ = ("rid", "client", "band", "cost", "seq", "queued_at")

    def __init__(self, rid: str, client: str, band: int, cost: int, seq: int, queued_at: float) -> None:
        self.rid: Final = rid
        #: Its tenant: the client identity authentication gave it.
        self.client: Final = client
        #: Its band's position, 0 the highest.
        self.band: Final = band
        #: Its estimated prompt tokens.
        self.cost: Final = cost
        #: Its place in arrival order (ties between start tags go to the earlier).
        self.seq: Final = seq
        self.queued_at: Final = queued_at


class _Tenant:
    """One tenant's line within one band, and its finish tag."""

    __slots__ = ("waiting", "weight", "finish", "entry")

    def __init__(self, weight: float) -> None:
        self.waiting: deque[Waiter] = deque()
        self.weight = weight
        self.finish = 0.0
        #: The token of its live entry in the band's heap (-1: none; its first waiter is then not in the heap).
        self.entry = -1


class _Band:
    """One band's tenants, its heap of their first waiters' start tags, and its virtual time."""

    __slots__ = ("tenants", "heap", "vtime", "count", "prune_at")

    def __init__(self) -> None:
        self.tenants: dict[str, _Tenant] = {}
        #: (start tag, arrival, token, tenant): a tenant's first waiter; an entry whose token is not its tenant's is stale.
        self.heap: list[tuple[float, int, int, str]] = []
        self.vtime = 0.0
        self.count = 0
        self.prune_at = 64


class FairQueue:
    """Waiting requests by band, then by weighted fair share of their cost (start-time fair queueing)."""

    def __init__(self, bands: int) -> None:
        self._bands: Final = tuple(_Band() for _ in range(bands))
        self._where: dict[str, Waiter] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, rid: object) -> bool:
        return rid in self._where

    def push(self, rid: str, client: str, band: int, weight: float, cost: int, now: float) -> None:
        """Queue ``rid`` of tenant ``client`` in ``band`` (0 the highest), with its ``weight`` and ``cost``."""
        self._seq += 1
        waiter = Waiter(rid, client, band, cost, self._seq, now)
        line = self._bands[band]
        tenant = line.tenants.get(client)
        if tenant is None:
            tenant = line.tenants[client] = _Tenant(weight)
        tenant.weight = weight
        tenant.waiting.append(waiter)
        if tenant.entry < 0:
            self._enter(line, tenant, client, max(line.vtime, tenant.finish))
        line.count += 1
        self._where[rid] = waiter

    def pop(self) -> Waiter | None:
        """The request to admit next: of the highest band that has one, the smallest start tag."""
        for line in self._bands:
            if line.count:
                break
        else:
            return None
        heap = line.heap
        while True:
            start, _, token, client = heapq.heappop(heap)
            tenant = line.tenants.get(client)
            if tenant is not None and tenant.entry == token:
                break
        waiter = tenant.waiting.popleft()
        line.vtime = start
        tenant.finish = start + waiter.cost / tenant.weight
        tenant.entry = -1
        if tenant.waiting:
            self._enter(line, tenant, client, tenant.finish)
        self._left(line, waiter)
        return waiter

    def remove(self, rid: str) -> Waiter:
        """Take ``rid`` out of the queue (its wait is over without admission)."""
        waiter = self._where[rid]
        line = self._bands[waiter.band]
        tenant = line.tenants[waiter.client]
        tenant.waiting.remove(waiter)
        if not tenant.waiting:
            tenant.entry = -1  # its heap entry is stale now
        self._left(line, waiter)
        return waiter

    def _enter(self, line: _Band, tenant: _Tenant, client: str, start: float) -> None:
        self._seq += 1
        tenant.entry = self._seq
        heapq.heappush(line.heap, (start, tenant.waiting[0].seq, self._seq, client))

    def _left(self, line: _Band, waiter: Waiter) -> None:
        del self._where[waiter.rid]
        line.count -= 1
        tenants = line.tenants
        if not line.count:
            # The band's busy period is over: its virtual time moves past every tag, which are forgotten.
            line.vtime = max([line.vtime, *(t.finish for t in tenants.values())])
            tenants.clear()
            line.heap.clear()
        elif len(tenants) > line.prune_at:
            # A tenant with nothing waiting whose finish tag the band's time has passed starts at V anyway.
            vtime = line.vtime
            for name in [n for n, t in tenants.items() if not t.waiting and t.finish <= vtime]:
                del tenants[name]
            line.prune_at = 2 * len(tenants) + 64


class FairAdmission:
    """The global in-flight limit, a :class:`FairQueue` and per-client limits, with each tenant's figures."""

    def __init__(
        self, *, max_inflight: int, queue_size: int, per_client_max_inflight: int, tenants: TenantsConfig,
    ) -> None:  # fmt: skip
        self.max_inflight: Final = max_inflight
        self.queue_size: Final = queue_size
        self.per_client_max: Final = per_client_max_inflight
        self.tenants: Final = tenants
        #: Each tenant's rate budget; ``None``: no tenant has one.
        self.budgets: Final = Budgets(tenants) if tenants.rated else None
        #: Named client -> its own in-flight limit (0: unlimited); the other clients': ``unnamed_max``.
        self._client_max: Final = {
            name: per_client_max_inflight if b.max_inflight is None else b.max_inflight
            for name, b in tenants.budgets.items()
        }
        inflight = tenants.default_budget.max_inflight
        self.unnamed_max: Final = per_client_max_inflight if inflight is None else inflight
        #: Requests holding a global slot.
        self.inflight = 0
        #: Requests waiting for a slot.
        self.queue: Final = FairQueue(len(tenants.bands))
        #: Admitted or queued requests per client.
        self.per_client: dict[str, int] = {}
        self._clock: Clock = StoppedClock()
        self._stats = Stats()

    def bind(self, clock: Clock, stats: Stats) -> None:
        """The router that owns this admission: the time of each event is read from ``clock``; figures go to ``stats``."""
        self._clock = clock
        self._stats = stats

    def offer(
        self, rid: str, client: str, cost: int = 1, band: int = 0, weight: float = 1.0
    ) -> AdmitDecision | BudgetRefusal:
        """Admit ``rid`` (``cost``: its estimated prompt tokens), queue it in ``band``, or say why not."""
        stats = self._stats
        key = (self.tenants.label(client), self.tenants.bands[band])
        held = self.per_client.get(client, 0)
        limit = self._client_max.get(client, self.unnamed_max)
        if limit and held >= limit:
            stats.tenant_rejected[(*key, "client_limit")] += 1
            return "client_limit"
        budgets = self.budgets
        if budgets is not None:
            refusal = budgets.check(client, cost, self._clock.now)
            if refusal is not None:
                stats.tenant_rejected[(*key, refusal.reason)] += 1
                return refusal
        queue = self.queue
        if self.inflight < self.max_inflight and not queue:
            decision: AdmitDecision = "admitted"
            self.inflight += 1
            stats.tenant_admitted[key] += 1
            stats.tenant_prompt_tokens[key] += cost
        elif len(queue) < self.queue_size:
            decision = "queued"
            queue.push(rid, client, band, weight, cost, self._clock.now)
            stats.tenant_queued[key] += 1
        else:
            stats.tenant_rejected[(*key, "queue_full")] += 1
            return "fleet_full"
        if budgets is not None:
            budgets.charge(client, cost)
        self.per_client[client] = held + 1
        return decision

    def next_from_queue(self) -> str | None:
        """Move the next queued request (by band, then share) into a free slot, if there is one."""
        if self.queue and self.inflight < self.max_inflight:
            waiter = self.queue.pop()
            assert waiter is not None
            self.inflight += 1
            key = self._waited(waiter)
            stats = self._stats
            stats.tenant_admitted[key] += 1
            stats.tenant_prompt_tokens[key] += waiter.cost
            return waiter.rid
        return None

    def leave_queue(self, rid: str, client: str) -> None:
        """A queued request gives up (timeout, client gone)."""
        self._waited(self.queue.remove(rid))
        self._drop_client(client)

    def queue_wait_over(self, rid: str, client: str) -> None:
        """A queued request waited ``admission.queue_timeout_s`` for nothing: refused."""
        waiter = self.queue.remove(rid)
        self._stats.tenant_rejected[(*self._waited(waiter), "queue_timeout")] += 1
        self._drop_client(client)

    def release(self, client: str) -> None:
        """An admitted request no longer holds its slot."""
        self.inflight -= 1
        self._drop_client(client)

    def _waited(self, waiter: Waiter) -> tuple[str, str]:
        """Observe how long ``waiter`` waited; its metrics' (tenant, band)."""
        key = (self.tenants.label(waiter.client), self.tenants.bands[waiter.band])
        hists = self._stats.tenant_wait_seconds
        hist = hists.get(key)
        if hist is None:
            hist = hists[key] = Histogram()
        hist.observe(self._clock.now - waiter.queued_at)
        return key

    def _drop_client(self, client: str) -> None:
        left = self.per_client[client] - 1
        if left:
            self.per_client[client] = left
        else:
            del self.per_client[client]
