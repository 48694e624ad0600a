"""The smallest end-to-end check: one PD completion through a real router."""

from __future__ import annotations

import httpx

from ..helpers import terminals_by_rid, wait_for_terminals


def test_completion_through_both_legs(start_router, journal_path, runtime, fleet) -> None:
    router = start_router()
    assert router.loop_library == runtime
    answer = httpx.post(router.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=10)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "text_completion" and body["choices"][0]["text"]
    rid = answer.headers["x-request-id"]
    records = wait_for_terminals(journal_path, 1)
    terminal = terminals_by_rid(records)[rid]
    assert terminal["terminal"] == "completed"
    assert [leg["phase"] for leg in terminal["legs"]] == ["prefill", "decode"]
    assert terminal["legs"][0]["kv"]["outcome"] == "pulled"
    assert fleet.prefill[0].stats()["kv_pulled"] == 1
    stats = router.wait_idle()
    assert stats.inflight == 0 and stats.legs == 0
