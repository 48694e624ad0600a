"""Per-tenant budgets (docs/operate.md, "Budgets"): the buckets' arithmetic, then a full router refusing with 429.

The buckets alone: over any window they admit at most ``rate × t +
capacity``, and the wait a refusal names is the true time until the
request fits. Through the router driver: each budget's 429 with its
headers, its ``rejected`` record and its metric reason; a request is
charged only once admission took it; a tenant's in-flight limit is given
back however its request ends.
"""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal_core.budgets import Bucket, Budgets, duration
from narwhal_core.policies import estimate_tokens
from narwhal_core.tenants import FairAdmission
from narwhal_core.tenants_config import TenantConfig, TenantsConfig

from .router_driver import COMPLETIONS, Driver, completion_body, make_config

TRUSTED = {"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)}

# ------------------------------------------------------------------ the buckets

arrivals = st.lists(
    st.tuples(st.floats(min_value=0.0, max_value=5.0), st.integers(min_value=1, max_value=40)),
    min_size=1, max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(min_value=0.1, max_value=50.0), capacity=st.floats(min_value=1.0, max_value=100.0),
       steps=arrivals)
def test_a_bucket_never_admits_more_than_rate_times_t_plus_capacity(
    rate: float, capacity: float, steps: list[tuple[float, int]]
) -> None:
    bucket = Bucket(rate, capacity, 0.0)
    now = 0.0
    admitted: list[tuple[float, int]] = []
    for gap, cost in steps:
        now += gap
        bucket.refill(now)
        if bucket.wait(cost) == 0.0:
            bucket.take(cost)
            admitted.append((now, cost))
    for i, (start, _) in enumerate(admitted):
        total = 0
        for end, cost in admitted[i:]:
            total += cost
            assert total <= rate * (end - start) + capacity + 1e-6


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(min_value=0.1, max_value=50.0), capacity=st.floats(min_value=1.0, max_value=100.0),
       steps=arrivals, cost=st.integers(min_value=1, max_value=100))
def test_the_wait_is_the_true_time_until_the_cost_fits(
    rate: float, capacity: float, steps: list[tuple[float, int]], cost: int
) -> None:
    bucket = Bucket(rate, capacity, 0.0)
    now = 0.0
    for gap, spent in steps:  # some history
        now += gap
        bucket.refill(now)
        if bucket.wait(spent) == 0.0:
            bucket.take(spent)
    bucket.refill(now)
    wait = bucket.wait(cost)
    if cost > capacity + 1e-9:
        assert wait == math.inf  # never fits
        return
    if wait == 0.0:
        assert bucket.level >= cost - 1e-9
        return
    early = Bucket(rate, capacity, 0.0)
    early.level, early.stamp = bucket.level, bucket.stamp
    early.refill(now + wait * (1 - 1e-6) - 1e-6)
    assert early.wait(cost) > 0.0  # a moment before, it does not fit
    bucket.refill(now + wait)
    assert bucket.wait(cost) == 0.0  # at the wait, it does


@pytest.mark.parametrize(("seconds", "text"), [
    (0.0, "0s"), (0.0004, "1ms"), (0.02, "20ms"), (0.999, "999ms"), (1.0, "1s"), (1.5, "1.5s"),
    (59.25, "59.25s"), (360.0, "6m0s"), (61.001, "1m1.001s"), (3600.0, "1h0m0s"),
])
def test_durations_are_written_as_openai_writes_its_reset_headers(seconds: float, text: str) -> None:
    assert duration(seconds) == text


def test_full_buckets_are_forgotten_so_many_clients_stay_bounded() -> None:
    budgets = Budgets(TenantsConfig(default_requests_per_s=1.0))
    for i in range(2000):
        now = i * 0.01
        assert budgets.check(f"client-{i}", 1, now) is None
        budgets.charge(f"client-{i}", 1)
    assert len(budgets) < 300  # those of the last ~second, not all 2000


def test_without_a_rate_admission_keeps_no_budgets() -> None:
    def admission(tenants: TenantsConfig) -> FairAdmission:
        return FairAdmission(max_inflight=1, queue_size=1, per_client_max_inflight=0, tenants=tenants)

    assert admission(TenantsConfig()).budgets is None
    assert admission(TenantsConfig(default_max_inflight=2)).budgets is None
    assert admission(TenantsConfig(tenant=(TenantConfig(name="a", requests_per_s=1.0),))).budgets is not None


# ------------------------------------------------------------------ the router


def driver(tenants: TenantsConfig, **admission: Any) -> Driver:
    config = make_config(ingress=TRUSTED, admission=admission)
    return Driver(attrs.evolve(config, tenants=tenants))


def post(d: Driver, client: str, prompt: str = "hello") -> Any:
    return d.post(COMPLETIONS, completion_body(prompt=prompt), [("X-Narwhal-Client", client)])


def cost_of(prompt: str) -> int:
    return estimate_tokens(len(json.dumps(completion_body(prompt=prompt)).encode()))


def headers_of(response: Any) -> dict[str, str]:
    return {n.decode(): v.decode() for n, v in response.headers}


def test_a_requests_budget_refuses_with_429_its_headers_and_record() -> None:
    d = driver(TenantsConfig(tenant=(TenantConfig(name="alice", requests_per_s=1.0),)))
    assert post(d, "bob").responses == []  # bob has no budget: admitted
    first = post(d, "alice")
    d.advance(0.25)
    refused = post(d, "alice")
    assert refused.last.status == 429
    error = refused.last.json()["error"]
    assert (error["type"], error["code"]) == ("rate_limit_error", "requests_budget")
    headers = headers_of(refused.last)
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "750"
    assert headers["x-ratelimit-limit-requests"] == "1"
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert headers["x-ratelimit-reset-requests"] == "750ms"
    assert "x-ratelimit-limit-tokens" not in headers and "x-should-retry" not in headers
    record = d.terminal(refused.last.rid)
    assert (record["terminal"], record["status"], record["client"]) == ("rejected", 429, "alice")
    assert record["error"]["code"] == "requests_budget"
    assert d.router.stats.tenant_rejected == {("alice", "default", "requests_budget"): 1}
    d.advance(0.75)  # exactly the Retry-After
    again = post(d, "alice")
    d.serve_until_done()
    assert first.last.status == 200 and again.last.status == 200
    d.check_invariants(final=True)


def test_a_prompt_tokens_budget_weighs_the_estimate_and_names_the_wait() -> None:
    per_min = 60.0 * 4  # 4 tokens a second
    d = driver(TenantsConfig(default_prompt_tokens_per_min=per_min))
    cost = cost_of("x" * 300)
    assert 2 * cost <= per_min < 3 * cost
    post(d, "carol", "x" * 300)
    post(d, "carol", "x" * 300)
    refused = post(d, "carol", "x" * 300)
    assert refused.last.status == 429 and refused.last.json()["error"]["code"] == "prompt_tokens_budget"
    headers = headers_of(refused.last)
    left = per_min - 2 * cost
    wait = (cost - left) / 4.0
    assert headers["retry-after-ms"] == str(math.ceil(wait * 1000))
    assert headers["retry-after"] == str(math.ceil(wait))
    assert headers["x-ratelimit-limit-tokens"] == "240"
    assert headers["x-ratelimit-remaining-tokens"] == str(math.floor(left))
    assert headers["x-ratelimit-reset-tokens"] == duration(2 * cost / 4.0)
    assert "x-ratelimit-limit-requests" not in headers
    assert d.terminal(refused.last.rid)["terminal"] == "rejected"
    assert d.router.stats.tenant_rejected == {("(unnamed)", "default", "prompt_tokens_budget"): 1}
    d.advance(wait)
    assert post(d, "carol", "x" * 300).responses == []  # fits now: admitted, waiting for its engine
    d.serve_until_done()
    assert [r["status"] for r in d.terminals()].count(200) == 3
    d.check_invariants(final=True)


def test_answers_to_a_tenant_with_a_budget_carry_the_rate_limit_headers() -> None:
    tenants = TenantsConfig(tenant=(TenantConfig(name="gina", requests_per_s=2.0, prompt_tokens_per_min=600.0),))
    d = driver(tenants)
    whole = post(d, "gina")
    streamed = d.post(COMPLETIONS, completion_body(prompt="hello", stream=True), [("X-Narwhal-Client", "gina")])
    plain = post(d, "hank")
    d.serve_until_done()
    cost = cost_of("hello")
    for response, left in ((whole.last, 1), (streamed.last, 0)):
        assert response.status == 200
        headers = headers_of(response)
        assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("2", str(left))
        assert headers["x-ratelimit-limit-tokens"] == "600"
        assert headers["x-ratelimit-reset-requests"] == duration((2 - left) / 2.0)
    assert headers_of(whole.last)["x-ratelimit-remaining-tokens"] == str(600 - cost)
    assert streamed.last.is_sse
    assert plain.last.status == 200 and not any(n.startswith(b"x-ratelimit") for n, _ in plain.last.headers)
    d.check_invariants(final=True)


def test_a_prompt_larger_than_the_whole_budget_is_told_not_to_retry() -> None:
    d = driver(TenantsConfig(default_prompt_tokens_per_min=100.0))
    refused = post(d, "dave", "y" * 1000)
    assert refused.last.status == 429
    error = refused.last.json()["error"]
    assert error["code"] == "prompt_over_budget" and "100 prompt tokens per minute" in error["message"]
    headers = headers_of(refused.last)
    assert headers["x-should-retry"] == "false" and "retry-after" not in headers and "retry-after-ms" not in headers
    assert headers["x-ratelimit-remaining-tokens"] == "100"  # nothing was charged
    assert d.terminal(refused.last.rid)["error"]["code"] == "prompt_over_budget"
    assert d.router.stats.tenant_rejected == {("(unnamed)", "default", "prompt_over_budget"): 1}


def test_a_request_admission_refuses_is_not_charged() -> None:
    d = driver(TenantsConfig(default_requests_per_s=1.0), max_inflight=1, queue_size=0)
    first = post(d, "alice")
    full = post(d, "bob")
    assert full.last.status == 503 and full.last.json()["error"]["code"] == "overloaded"
    d.serve_until_done()
    assert first.last.status == 200
    retried = post(d, "bob")  # at the same instant: bob's budget was not spent on the 503
    d.serve_until_done()
    assert retried.last.status == 200
    assert post(d, "bob").last.status == 429  # this one it was spent on
    assert d.router.stats.tenant_rejected == {
        ("(unnamed)", "default", "queue_full"): 1, ("(unnamed)", "default", "requests_budget"): 1,
    }


def _end_by_serving(d: Driver, client: Any) -> None:
    d.serve_until_done()


def _end_by_leaving(d: Driver, client: Any) -> None:
    client.leave()


def _end_by_deadline(d: Driver, client: Any) -> None:
    d.advance(d.config.admission.request_timeout_s + 0.1)


def _end_by_queue_timeout(d: Driver, client: Any) -> None:
    d.advance(d.config.admission.queue_timeout_s + 0.1)


@pytest.mark.parametrize("end", [_end_by_serving, _end_by_leaving, _end_by_deadline, _end_by_queue_timeout])
def test_a_tenants_inflight_limit_is_given_back_however_its_request_ends(end: Any) -> None:
    tenants = TenantsConfig(tenant=(TenantConfig(name="erin", max_inflight=1),))
    queued = end is _end_by_queue_timeout
    d = driver(tenants, max_inflight=1 if queued else 8, queue_timeout_s=2.0, request_timeout_s=5.0)
    if queued:
        post(d, "holder")  # holds the one slot: erin's request waits in the queue
    held = post(d, "erin")
    refused = post(d, "erin")
    assert refused.last.status == 429 and refused.last.json()["error"]["code"] == "rate_limited"
    assert headers_of(refused.last)["retry-after"] == "1"  # admission.retry_after_s
    assert post(d, "frank").responses == []  # another tenant is not limited by erin's
    end(d, held)
    assert d.router.admission.per_client.get("erin", 0) == 0
    if queued:
        d.serve_until_done()
    again = post(d, "erin")
    d.serve_until_done()
    assert again.last.status == 200
    assert d.router.stats.tenant_rejected[("erin", "default", "client_limit")] == 1
    d.check_invariants(final=True)
