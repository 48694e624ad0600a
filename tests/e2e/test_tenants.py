"""Tenants end to end (docs/operate.md, "Tenants"): a full admission queue served by band, then by share; budgets.

A real router on each runtime in front of simulated engines, clients named
by the trusted header. ``admission.max_inflight = 1``: a first request is
held on the prefill engine (the simulator's ``delay_s``) while the others
queue, one after another in a known order; then its client leaves, which
frees the slot, and the queue drains. The order the prefill engine received
the prompts in (the simulator's own record) is the order of admission.

A budget of one request a second, read by the ``openai`` package: its
``RateLimitError`` carries the 429's headers, and with one retry it waits
the ``retry-after-ms`` the router sent and then succeeds.
"""

from __future__ import annotations

import json
import time

import openai

from narwhal_core.tenants_config import TenantConfig

from ..helpers import COMPLETIONS, MODEL, completion_records, journal_terminal, poll, read_journal
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


def test_the_openai_client_reads_a_budgets_429_and_waits_its_retry_after(start_router, fleet, journal_path) -> None:
    router = start_router(tenants={"default_requests_per_s": 1.0})
    url = router.url + "/v1"
    started = time.monotonic()
    with openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=10) as client:
        client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=2)
        try:
            client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=2)
        except openai.RateLimitError as caught:
            error = caught
        else:
            raise AssertionError("a second request within the second was admitted")
    assert error.status_code == 429 and error.code == "requests_budget" and error.type == "rate_limit_error"
    headers = error.response.headers
    assert headers["retry-after"] == "1" and 0 < int(headers["retry-after-ms"]) <= 1000
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-remaining-requests"]) == ("1", "0")
    assert headers["x-ratelimit-reset-requests"].endswith("ms")
    record = journal_terminal(journal_path, error.request_id)
    assert (record["terminal"], record["status"], record["error"]["code"]) == ("rejected", 429, "requests_budget")
    with openai.OpenAI(base_url=url, api_key="x", max_retries=1, timeout=10) as client:
        raw = client.completions.with_raw_response.create(model=MODEL, prompt="The narwhal", max_tokens=2)
    # Refused once more, it waited out the budget's second (counted from the first request) and was admitted.
    assert raw.status_code == 200 and time.monotonic() - started >= 1.0
    assert raw.headers["x-ratelimit-remaining-requests"] == "0"  # a success tells the budget too
    terminals = [r["terminal"] for r in read_journal(journal_path) if r.get("terminal")]
    assert sorted(terminals) == ["completed", "completed", "rejected", "rejected"]
    assert len(completion_records(fleet.prefill)) == 2  # the engines saw only the admitted two
    metrics = http.get(router.url + "/metrics", timeout=10).text
    assert 'narwhal_tenant_rejected_total{band="default",reason="requests_budget",tenant="(unnamed)"} 2.0' in metrics
