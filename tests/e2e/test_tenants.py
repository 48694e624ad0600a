"""Tenants end to end (docs/operate.md, "Tenants"): a full admission queue served by band, then by share.

A real router on each runtime in front of simulated engines, clients named
by the trusted header. ``admission.max_inflight = 1``: a first request is
held on the prefill engine (the simulator's ``delay_s``) while the others
queue, one after another in a known order; then its client leaves, which
frees the slot, and the queue drains. The order the prefill engine received
the prompts in (the simulator's own record) is the order of admission.
"""

from __future__ import annotations

import json

from narwhal_core.tenants_config import TenantConfig

from ..helpers import COMPLETIONS, MODEL, completion_records, poll
from .support import RawClient, http, request_bytes

TENANTS = {
    "bands": ("high", "low"),
    "tenant": (TenantConfig(name="alice", band="high"), TenantConfig(name="carol", weight=2.0)),
}
#: (client, prompt) in arrival order; FIFO would admit them so.
ARRIVALS = [("bob", "b1"), ("bob", "b2"), ("bob", "b3"), ("carol", "c1"), ("carol", "c2"), ("alice", "a1")]


def _post(router, client: str, prompt: str) -> RawClient:
    raw = RawClient(router.address, timeout=15.0)
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4}).encode()
    raw.send(request_bytes("POST", COMPLETIONS, body, headers=[
        ("content-type", "application/json"), ("x-narwhal-client", client),
    ]))
    return raw


def test_a_full_queue_is_admitted_by_band_then_share(start_router, fleet) -> None:
    router = start_router(
        ingress={"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)},
        admission={"max_inflight": 1, "queue_timeout_s": 30.0},
        tenants=TENANTS,
    )
    prefill = fleet.prefill[0]
    prefill.set_faults(delay_s=30.0)  # the first request holds the one slot until its client leaves
    holder = _post(router, "zed", "first")
    poll(lambda: completion_records(fleet), what="the first prefill leg")
    waiting = []
    for n, (client, prompt) in enumerate(ARRIVALS, start=1):
        waiting.append(_post(router, client, prompt))
        poll(lambda n=n: router.statistics().queued == n, what=f"{n} requests queued")
    prefill.set_faults()
    holder.reset()  # its client leaves: cancelled, the slot is free
    answers = [raw.read_response() for raw in waiting]
    assert [a.status for a in answers] == [200] * len(ARRIVALS), [a.body for a in answers]
    prompts = [json.loads(r["body"])["prompt"] for r in completion_records([prefill])]
    # alice's band first; then bob (weight 1) and carol (weight 2) by their shares of prompt tokens.
    assert prompts == ["first", "a1", "b1", "c1", "c2", "b2", "b3"]
    for raw in waiting:
        raw.close()
    metrics = http.get(router.url + "/metrics", timeout=10).text
    assert 'narwhal_tenant_admitted_total{band="high",tenant="alice"} 1.0' in metrics
    assert 'narwhal_tenant_queued_total{band="low",tenant="carol"} 2.0' in metrics
    assert 'narwhal_tenant_queue_wait_seconds_count{band="low",tenant="(unnamed)"} 3.0' in metrics
    assert "narwhal_tenant_prompt_tokens_admitted_total" in metrics
