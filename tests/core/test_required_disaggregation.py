"""``routing.disaggregation = "required"`` (docs/routing.md, "Required disaggregation").

With the switch on, a request that would run without a prefill leg is
answered 503 ``no_prefill_engine`` instead, journalled and counted; with it
off (the default), a fleet whose prefill pool is gone answers as it always
has (503 ``engine_unavailable``).
"""

from __future__ import annotations

from typing import Any

import pytest

from narwhal_core import EnginesChanged
from narwhal_core.config import parse_engine_url
from narwhal_runtime.metrics import render

from .router_driver import COMPLETIONS, PREFILL_URLS, ClientResponse, Driver, FakeClient, completion_body

REQUIRED = {"disaggregation": "required"}


def changed(phase: str, *urls: str) -> EnginesChanged:
    return EnginesChanged(phase, tuple(parse_engine_url(u, key="test") for u in urls), "dns")


def error_of(answer: ClientResponse) -> dict[str, Any]:
    data = answer.json()
    assert set(data) == {"error"}, data
    return data["error"]  # type: ignore[no-any-return]


def get(d: Driver, path: str) -> ClientResponse:
    client: FakeClient = d.connect()
    client.request("GET", path)
    return client.last


def refusals_metric(d: Driver) -> list[str]:
    return [line for line in get(d, "/metrics").body.decode().splitlines()
            if line.startswith("narwhal_no_prefill_engine_total")]


@pytest.mark.parametrize("required", [True, False], ids=["required", "optional"])
def test_a_fleet_without_prefill_engines_refuses_and_serves_again_when_they_are_back(required: bool) -> None:
    d = Driver(routing=REQUIRED if required else None, render_metrics=render)
    d.feed(changed("prefill"))  # discovery found none: the pool drains (nothing runs there) and is forgotten
    d.advance(1)
    assert d.router.fleet.engines["prefill"] == []
    client = d.post(COMPLETIONS, completion_body())
    answer = client.last
    assert answer.status == 503 and answer.header(b"retry-after") == b"1"
    error = error_of(answer)
    rid = answer.rid
    assert rid is not None
    record = d.terminal(rid)
    assert (record["terminal"], record["status"], record["legs"]) == ("rejected", 503, [])
    assert record["error"]["code"] == error["code"] and record["error"]["message"] == error["message"]
    assert d.started_legs() == []  # no decode engine was asked to do the prefill
    ready = get(d, "/ready")
    assert ready.status == 503 and ready.json()["problems"] == ["no healthy prefill engine"]
    if required:
        assert (error["type"], error["code"]) == ("server_error", "no_prefill_engine")
        assert error["message"].startswith("The fleet has no prefill engine, and this router requires "
                                           'disaggregation (routing.disaggregation = "required")')
        assert d.router.stats.prefill_refusals == {"none_in_fleet": 1}
        assert refusals_metric(d) == ['narwhal_no_prefill_engine_total{reason="none_in_fleet"} 1.0']
    else:  # as before the switch existed
        assert (error["code"], error["message"]) == ("engine_unavailable", "No healthy prefill engine is available.")
        assert not d.router.stats.prefill_refusals and refusals_metric(d) == []
    d.feed(changed("prefill", *PREFILL_URLS))  # back: each joins at its first probe (answered 200 at once)
    served = d.post(COMPLETIONS, completion_body())
    d.serve_until_done()
    d.complete_releases()
    assert served.last.status == 200
    assert [leg.phase for leg in d.started_legs(served.last.rid)] == ["prefill", "decode"]
    d.check_invariants(final=True)


def test_no_healthy_prefill_engine_is_told_apart_from_none_in_the_fleet() -> None:
    d = Driver(auto_probe=None, health={"unhealthy_after": 1}, routing=REQUIRED)
    for control in d.pending_controls("probe"):
        prefill = control.cmd.engine.url in PREFILL_URLS
        d.complete_control(control.cmd.key, status=None if prefill else 200, error="ConnectError" if prefill else None)
    client = d.post(COMPLETIONS, completion_body())
    assert client.last.status == 503
    error = error_of(client.last)
    assert error["code"] == "no_prefill_engine" and error["message"].startswith("No prefill engine is healthy, ")
    assert d.router.stats.prefill_refusals == {"none_healthy": 1}


def test_a_queued_request_fails_when_the_pool_went_and_a_prefilled_one_keeps_its_decode_leg() -> None:
    d = Driver(routing=REQUIRED, admission={"max_inflight": 1, "queue_size": 1})
    first = d.post(COMPLETIONS, completion_body())
    second = d.post(COMPLETIONS, completion_body())  # queued behind the first
    prefill = d.leg("prefill")
    d.feed(changed("prefill"))  # the pool goes while the first request's prefill leg runs on it
    d.answer_prefill(prefill.bid)
    d.answer_decode(d.leg("decode").bid)  # the first request, prefilled, is decoded as always...
    assert first.last.status == 200
    assert second.last.status == 503  # ...and the second, admitted then, finds no prefill engine
    rid = second.last.rid
    assert rid is not None
    record = d.terminal(rid)
    assert (record["terminal"], record["status"], record["error"]["code"]) == ("failed", 503, "no_prefill_engine")
    assert second.last.header(b"retry-after") == b"1"
    assert [leg.rid for leg in d.started_legs()] == [prefill.rid, prefill.rid]
    assert d.router.stats.prefill_refusals == {"none_in_fleet": 1}
    d.complete_releases()
    d.advance(1)
    d.check_invariants(final=True)
