"""Replicas share nothing but the fleet (docs/operate.md, "Several routers in front of one fleet").

Three routers, each with its own journal, in front of the same simulated
prefill and decode engines, as replicas of a Deployment would be. Each
router draws its request IDs from a prefix of its own, chosen at random
when it starts (narwhal_runtime/app.py): the IDs never collide, and every
ID an engine sees — a leg's, a KV release's owner — belongs to exactly one
router, the one whose journal accounts for it. Here every decode leg fails,
so every request's KV must be released by the router that made it.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx

from narwhal_sim.testing import SimThread

from ..harness import MODEL, RouterThread, make_config
from ..helpers import poll, read_journal

REPLICAS = 3
REQUESTS = 4
RID = re.compile(r"([0-9a-f]{10})([0-9a-f]{10})")


def test_three_replicas_never_share_an_id_and_release_only_their_own_kv(tmp_path: Path) -> None:
    with ExitStack() as stack:
        prefill = stack.enter_context(SimThread(role="prefill", speed=0))
        # Every decode leg fails: the KV each prefill left behind must be released.
        decode = stack.enter_context(SimThread(role="decode", speed=0, faults={"error_rate": 1.0}))
        routers = [
            stack.enter_context(RouterThread(make_config(
                tmp_path / f"journal{i}.jsonl", prefill=(prefill.url,), decode=(decode.url,),
                engine={"kv_release": "abort_endpoint"}, retry={"max_attempts": 1},
                health={"unhealthy_after": 100},  # failing decode legs must not take the engine out
            ), "trio" if i % 2 else "asyncio"))
            for i in range(REPLICAS)
        ]

        def send(router: RouterThread) -> list[int]:
            with httpx.Client(base_url=router.url, timeout=20) as client:
                return [client.post("/v1/completions", json={"model": MODEL, "prompt": f"hello {n}",
                                                             "max_tokens": 4}).status_code
                        for n in range(REQUESTS)]

        with ThreadPoolExecutor(REPLICAS) as pool:
            statuses = list(pool.map(send, routers))
        assert all(code >= 500 for codes in statuses for code in codes), statuses
        # Every prefill's KV was released (none expired, none left held).
        stats = poll(lambda: (s := prefill.stats())["kv_held"] == 0 and s["kv_released"] == REPLICAS * REQUESTS and s,
                     what="every KV released")
        assert stats["kv_expired"] == 0
        released = [json.loads(r["body"])["request_id"] for r in prefill.requests("/abort_request")]

    journals = [read_journal(tmp_path / f"journal{i}.jsonl") for i in range(REPLICAS)]
    prefixes = []
    for records in journals:
        terminal = [r for r in records if r["terminal"] is not None]
        assert len(terminal) == REQUESTS
        found = {RID.fullmatch(r["rid"]).group(1) for r in terminal}  # type: ignore[union-attr]
        assert len(found) == 1, found  # one prefix per router
        prefixes.append(found.pop())
    assert len(set(prefixes)) == REPLICAS  # and no two routers share one
    rids = [r["rid"] for records in journals for r in records if r["terminal"] is not None]
    assert len(rids) == len(set(rids)) == REPLICAS * REQUESTS

    # Each release names a KV owner of exactly one router: the one whose journal says it released it.
    assert len(released) == len(set(released)) == REPLICAS * REQUESTS
    # (The engine names a KV owner after the leg's backend ID, "cmpl-<backend ID>-0-<suffix>", vLLM's shape.)
    for prefix, records in zip(prefixes, journals):
        own = {leg["kv"]["owner"] for r in records if r["terminal"] is not None
               for leg in r["legs"] if leg["phase"] == "prefill" and leg["kv"] is not None}
        assert len(own) == REQUESTS and all(leg_kv_is_released(r) for r in records if r["terminal"] is not None)
        assert all(owner.startswith(f"cmpl-{prefix}") for owner in own), own
        assert {owner for owner in released if owner.startswith(f"cmpl-{prefix}")} == own


def leg_kv_is_released(record: dict[str, object]) -> bool:
    return all(leg["kv"]["outcome"] == "released" for leg in record["legs"]  # type: ignore[attr-defined]
               if leg["phase"] == "prefill")
