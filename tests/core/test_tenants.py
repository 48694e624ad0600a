"""Property tests of the fair admission queue (docs/operate.md, "Tenants").

:class:`~narwhal_core.tenants.FairQueue` alone, walked by Hypothesis through
arrivals, admissions and departures (a queue timeout, a client gone):

* every waiter leaves exactly once, admitted or removed, and the queue's
  length is always what is left;
* band order: every admission is of the highest band that has a waiter;
* no tenant above its share while another waits: over any stretch in which
  two tenants of a band both wait throughout, the prompt tokens admitted to
  each, over its weight, differ by at most ``C_f / w_f + C_g / w_g`` (their
  largest costs);
* bounded wait: while a request is first in its tenant's line, the other
  tenants of its band are admitted at most ``w_g / w_f x C + C`` tokens each
  ahead of it -- the bound docs/operate.md states, checked here for every
  tenant, so for the lowest weight too.
"""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal_core.tenants import FairQueue

from ..corebuild import examples

SETTINGS = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])

TENANTS = ("a", "b", "c", "d")
WEIGHTS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 8.0])
COST = st.integers(min_value=1, max_value=2000)

#: One step: an arrival (tenant, band, cost), an admission, or a departure (the n-th waiter, modulo).
STEP = st.one_of(
    st.tuples(st.just("push"), st.sampled_from(TENANTS), st.integers(0, 2), COST),
    st.tuples(st.just("pop")),
    st.tuples(st.just("remove"), st.integers(0, 10_000)),
)


@SETTINGS
@given(steps=st.lists(STEP, max_size=200), weights=st.tuples(*(WEIGHTS for _ in TENANTS)))
def test_every_waiter_leaves_once_and_bands_are_served_in_order(steps: list[tuple], weights: tuple) -> None:
    queue = FairQueue(3)
    weight = dict(zip(TENANTS, weights))
    waiting: dict[str, int] = {}  # rid -> band
    left: list[str] = []
    for n, step in enumerate(steps):
        if step[0] == "push":
            _, tenant, band, cost = step
            rid = f"r{n}"
            queue.push(rid, tenant, band, weight[tenant], cost, now=float(n))
            waiting[rid] = band
        elif step[0] == "pop":
            waiter = queue.pop()
            if not waiting:
                assert waiter is None
                continue
            assert waiter is not None
            assert waiter.band == min(waiting.values()), "a lower band was admitted while a higher one waited"
            del waiting[waiter.rid]
            left.append(waiter.rid)
        elif waiting:
            rid = sorted(waiting)[step[1] % len(waiting)]
            assert queue.remove(rid).rid == rid
            del waiting[rid]
            left.append(rid)
        assert len(queue) == len(waiting)
    while waiting:  # what is left is admitted, band by band
        waiter = queue.pop()
        assert waiter is not None and waiter.band == min(waiting.values())
        del waiting[waiter.rid]
        left.append(waiter.rid)
    assert queue.pop() is None and len(queue) == 0
    pushed = [f"r{n}" for n, step in enumerate(steps) if step[0] == "push"]
    assert sorted(left) == sorted(pushed) and len(set(left)) == len(left)


#: Steps within one band: an arrival (tenant, cost) or an admission.
BAND_STEP = st.one_of(st.tuples(st.sampled_from(TENANTS), COST), st.just(None))


def _walk(steps: list[tuple[str, int] | None], weights: tuple[float, ...]) -> None:
    """Run one band's queue; check the share and the wait bounds at every admission."""
    queue = FairQueue(1)
    weight = dict(zip(TENANTS, weights))
    largest = defaultdict(int)
    for step in steps:
        if step is not None:
            largest[step[0]] = max(largest[step[0]], step[1])
    biggest = max(largest.values(), default=0)
    lines: dict[str, list[tuple[str, int]]] = defaultdict(list)  # tenant -> its waiting (rid, cost), in order
    admitted: dict[str, int] = defaultdict(int)  # tokens admitted so far, by tenant
    since: dict[str, dict[str, int]] = {}  # a waiting tenant -> everyone's tokens when it began to wait
    head_since: dict[str, dict[str, int]] = {}  # a tenant's first waiter -> everyone's tokens when it became first
    for n, step in enumerate(steps):
        if step is not None:
            tenant, cost = step
            rid = f"r{n}"
            if not lines[tenant]:
                since[tenant] = dict(admitted)
                head_since[rid] = dict(admitted)
            lines[tenant].append((rid, cost))
            queue.push(rid, tenant, 0, weight[tenant], cost, now=float(n))
            continue
        waiter = queue.pop()
        if waiter is None:
            assert not any(lines.values())
            continue
        line = lines[waiter.client]
        assert line[0][0] == waiter.rid, "a tenant's own requests are admitted in arrival order"
        line.pop(0)
        for tenant, waiting in lines.items():  # the head of every other waiting tenant: its wait is bounded
            if waiting and tenant != waiter.client:
                start = head_since[waiting[0][0]]
                ahead = admitted[waiter.client] + waiter.cost - start.get(waiter.client, 0)
                bound = weight[waiter.client] / weight[tenant] * biggest + biggest
                assert ahead <= bound + 1e-6, (tenant, waiter.client, ahead, bound)
        admitted[waiter.client] += waiter.cost
        if line:
            head_since[line[0][0]] = dict(admitted)
        for f in since:  # two tenants that have both waited throughout: neither above its share
            for g in since:
                if f == g:
                    continue
                begin = since[f] if sum(since[f].values()) >= sum(since[g].values()) else since[g]
                share_f = (admitted[f] - begin.get(f, 0)) / weight[f]
                share_g = (admitted[g] - begin.get(g, 0)) / weight[g]
                assert share_f - share_g <= largest[f] / weight[f] + largest[g] / weight[g] + 1e-6, (f, g)
        if not line:
            del since[waiter.client]


@SETTINGS
@given(steps=st.lists(BAND_STEP, max_size=300), weights=st.tuples(*(WEIGHTS for _ in TENANTS)))
def test_no_tenant_above_its_share_and_every_wait_bounded(
    steps: list[tuple[str, int] | None], weights: tuple[float, ...]
) -> None:
    _walk(steps, weights)


@SETTINGS
@given(
    backlog=st.lists(st.tuples(st.sampled_from(TENANTS), COST), min_size=40, max_size=200),
    weights=st.tuples(*(WEIGHTS for _ in TENANTS)),
)
def test_shares_and_bounds_hold_with_every_tenant_backlogged(
    backlog: list[tuple[str, int]], weights: tuple[float, ...]
) -> None:
    # Everyone arrives first, then the queue drains: the case the weights are for.
    _walk([*backlog, *([None] * len(backlog))], weights)


def test_weights_split_the_tokens_admitted_while_both_wait() -> None:
    queue = FairQueue(1)
    for n in range(60):
        queue.push(f"a{n}", "a", 0, 3.0, 100, now=0.0)
        queue.push(f"b{n}", "b", 0, 1.0, 100, now=0.0)
    first = [queue.pop() for _ in range(40)]
    by_tenant = [w.client for w in first if w is not None]
    assert by_tenant.count("a") == 30 and by_tenant.count("b") == 10


def test_cost_counts_not_the_number_of_requests() -> None:
    # Equal weights: one tenant's long prompts are admitted as many tokens as the other's short ones.
    queue = FairQueue(1)
    for n in range(10):
        queue.push(f"long{n}", "long", 0, 1.0, 1000, now=0.0)
    for n in range(100):
        queue.push(f"short{n}", "short", 0, 1.0, 100, now=0.0)
    order = [queue.pop() for _ in range(22)]
    assert [w.client for w in order if w is not None].count("short") == 20


def test_an_idle_band_forgets_past_use() -> None:
    # When the band's queue empties, the next busy period starts every tenant level (start-time fair queueing).
    queue = FairQueue(1)
    queue.push("big", "a", 0, 1.0, 10_000, now=0.0)
    assert queue.pop() is not None and len(queue) == 0
    queue.push("a1", "a", 0, 1.0, 10, now=1.0)
    queue.push("b1", "b", 0, 1.0, 10, now=1.0)
    assert [queue.pop().rid, queue.pop().rid] == ["a1", "b1"]  # type: ignore[union-attr]
