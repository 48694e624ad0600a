"""``routing.disaggregation = "required"`` over real sockets (docs/routing.md, "Required disaggregation").

A fleet whose only prefill engine is stopped answers the ``openai`` client
503 ``no_prefill_engine`` with ``Retry-After``, journals it, counts it in
``/metrics`` and sends nothing to the decode engine.
"""

from __future__ import annotations

import httpx as http
import openai

from ..helpers import MODEL, completion_records, journal_terminal, poll


def test_a_stopped_prefill_pool_is_refused_loudly(start_router, fleet, journal_path) -> None:
    router = start_router(
        routing={"disaggregation": "required"}, health={"probe_interval_s": 0.05, "unhealthy_after": 1},
    )
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        assert client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=3).choices[0].text
        (prefill,) = fleet.prefill
        prefill.stop()
        ready = poll(lambda: (a := http.get(router.url + "/ready", timeout=10)).status_code == 503 and a,
                     timeout=10, what="/ready 503 once the prefill engine is down")
        assert ready.json()["problems"] == ["no healthy prefill engine"]
        before = completion_records(fleet.decode)
        try:
            client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=3)
        except openai.InternalServerError as exc:
            refused = exc
        else:
            raise AssertionError("a completion without a prefill engine was served")
    assert refused.status_code == 503 and refused.code == "no_prefill_engine" and refused.type == "server_error"
    assert refused.response.headers["retry-after"] == "1"
    assert refused.body["message"].startswith("No prefill engine is healthy, and this router requires disaggregation")
    assert completion_records(fleet.decode) == before  # the decode engine never saw it
    record = journal_terminal(journal_path, refused.response.headers["x-request-id"])
    assert (record["terminal"], record["status"], record["error"]["code"]) == ("rejected", 503, "no_prefill_engine")
    metrics = http.get(router.url + "/metrics", timeout=10).text
    assert 'narwhal_no_prefill_engine_total{reason="none_healthy"} 1.0' in metrics.splitlines()
