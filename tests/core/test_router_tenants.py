"""A full router with ``[tenants]`` (docs/operate.md, "Tenants"): the queue by band, then share; the header.

Admission is held full (``max_inflight = 1``) by a first request; the others
queue, and the order in which their prefill legs start is the order the
queue admitted them. Without ``[tenants]`` the same arrivals run first come,
first served (the oracle the fair order is told from).
"""

from __future__ import annotations

from typing import Any

import attrs

from narwhal_core.tenants_config import TenantConfig, TenantsConfig

from .router_driver import COMPLETIONS, Driver, completion_body, make_config

TRUSTED = {"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)}

TENANTS = TenantsConfig(
    bands=("high", "low"),
    tenant=(
        TenantConfig(name="alice", band="high"),
        TenantConfig(name="dave", band="high"),
        TenantConfig(name="carol", weight=2.0),
    ),
)


def driver(tenants: TenantsConfig | None = TENANTS, **admission: Any) -> Driver:
    config = make_config(ingress=TRUSTED, admission={"max_inflight": 1, **admission})
    return Driver(attrs.evolve(config, tenants=tenants))


def post(d: Driver, client: str, prompt: str, priority: str | None = None) -> Any:
    headers = [("X-Narwhal-Client", client)]
    if priority is not None:
        headers.append(("X-Narwhal-Priority", priority))
    return d.post(COMPLETIONS, completion_body(prompt=prompt), headers)


def admission_order(d: Driver) -> list[str]:
    """Serve every request to its end; the prompts in the order their first leg started."""
    started: list[str] = []
    for _ in range(100):
        legs = d.open_legs()
        if not legs:
            return started
        leg = legs[0]
        if leg.phase == "prefill":
            started.append(leg.body["prompt"])
        d.serve(leg.bid)
    raise AssertionError("legs keep coming")


def test_a_full_queue_admits_by_band_then_by_share() -> None:
    arrivals = [("zed", "first"), ("bob", "b1"), ("bob", "b2"), ("bob", "b3"), ("carol", "c1"),
                ("carol", "c2"), ("alice", "a1")]
    fifo = driver(tenants=None)
    for client, prompt in arrivals:
        post(fifo, client, prompt)
    assert admission_order(fifo) == ["first", "b1", "b2", "b3", "c1", "c2", "a1"]

    d = driver()
    for client, prompt in arrivals:
        post(d, client, prompt)
    assert d.router.statistics().queued == 6
    # alice's band first; then bob (weight 1) and carol (weight 2) by share of the prompt
    # tokens admitted: carol twice bob's while both wait (equal prompts).
    assert admission_order(d) == ["first", "a1", "b1", "c1", "c2", "b2", "b3"]
    assert all(r["terminal"] == "completed" for r in d.terminals())
    stats = d.router.stats
    assert stats.tenant_admitted == {("(unnamed)", "low"): 4, ("carol", "low"): 2, ("alice", "high"): 1}
    assert stats.tenant_queued == {("(unnamed)", "low"): 3, ("carol", "low"): 2, ("alice", "high"): 1}
    tokens = stats.tenant_prompt_tokens
    assert tokens[("carol", "low")] == 2 * tokens[("alice", "high")] > 0
    assert stats.tenant_wait_seconds[("carol", "low")].count == 2
    d.check_invariants(final=True)


def test_the_queue_timeout_still_holds() -> None:
    d = driver(queue_timeout_s=5.0)
    first = post(d, "alice", "first")
    queued = post(d, "bob", "waits")
    d.advance(4.9)
    assert queued.responses == []
    d.advance(0.2)
    assert queued.last.status == 503 and queued.last.json()["error"]["code"] == "overloaded"
    assert d.terminal(queued.last.rid)["terminal"] == "rejected"
    stats = d.router.stats
    assert stats.tenant_rejected == {("(unnamed)", "low", "queue_timeout"): 1}
    wait = stats.tenant_wait_seconds[("(unnamed)", "low")]
    assert wait.count == 1 and 5.0 <= wait.total <= 5.1
    assert d.router.statistics().queued == 0
    assert admission_order(d) == ["first"] and first.last.status == 200
    d.check_invariants(final=True)


def test_the_priority_header_lowers_a_band_and_never_raises_one() -> None:
    d = driver()
    post(d, "zed", "first")
    post(d, "alice", "alice-lowered", priority="low")  # alice is high: lowered to low
    post(d, "bob", "bob-asks-high", priority="high")  # bob is low: stays low (not an error)
    post(d, "dave", "dave")  # high
    # FIFO would be alice, bob, dave; the header ignored, alice first; bob raised, bob first.
    assert admission_order(d) == ["first", "dave", "alice-lowered", "bob-asks-high"]
    assert all(r["status"] == 200 for r in d.terminals())
    assert d.router.stats.tenant_queued[("alice", "low")] == 1


def test_a_priority_naming_no_band_is_a_400_with_its_record() -> None:
    d = driver()
    refused = post(d, "alice", "x", priority="urgent")
    assert refused.last.status == 400
    error = refused.last.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "invalid_priority", None)
    assert "high, low" in error["message"]
    record = d.terminal(refused.last.rid)
    assert (record["terminal"], record["status"], record["client"]) == ("invalid", 400, "alice")
    assert d.open_legs() == [] and d.router.statistics().requests == 0
    assert not d.router.stats.tenant_admitted  # it never reached admission
    # Without [tenants] the header means nothing.
    plain = driver(tenants=None)
    ignored = post(plain, "alice", "x", priority="urgent")
    assert admission_order(plain) == ["x"] and ignored.last.status == 200


def test_refusals_are_counted_by_tenant_band_and_reason() -> None:
    d = driver(queue_size=1, per_client_max_inflight=1)
    post(d, "alice", "first")
    assert post(d, "alice", "again").last.status == 429
    post(d, "bob", "queued")
    assert post(d, "carol", "no-room").last.status == 503
    assert d.router.stats.tenant_rejected == {
        ("alice", "high", "client_limit"): 1, ("carol", "low", "queue_full"): 1,
    }
    assert admission_order(d) == ["first", "queued"]
    d.check_invariants(final=True)
