"""Fault matrix, prefill rows: 5xx, dropped connection, slow past ``engine.prefill_timeout_s``,
an answer without KV params (docs/contract.md, "Prefill and decode legs", "Admission, capacity and retries").

With one prefill engine every attempt fails and the client gets the router's
error; with two, the leg is retried on the other engine with a new attempt
and backend ID (``-p2``) and the request completes. A failed prefill leg
never leaves KV behind: nothing to release, nothing may expire.
"""

from __future__ import annotations

import pytest

from ..helpers import assert_envelope, journal_terminal, rid_of
from .support import assert_backend_ids, assert_failed, assert_idle, assert_kv_settled, post, sim_requests, wait_kv

#: Prefill faults: (sim faults, the leg outcome the journal names, leg status, extra engine config).
PREFILL_FAULTS = {
    "5xx": ({"error_rate": 1.0, "error_status": 503}, "http_error", 503, {}),
    "drop": ({"drop_rate": 1.0}, "dropped", None, {}),
    # 1.5 s of engine delay against a 0.25 s leg timeout: slow by a wide margin.
    "timeout": ({"delay_s": 1.5}, "timeout", None, {"prefill_timeout_s": 0.25}),
}
# (A prefill answer with kv_transfer_params null is not a fault: nothing to
# hand off, the decode leg recomputes; tests/e2e/test_prefill_without_kv.py.)
#: What the client gets once every attempt failed.
GIVE_UP = {
    "5xx": (502, "prefill_failed"),
    "drop": (502, "prefill_failed"),
    "timeout": (504, "engine_timeout"),
}

FAULTS = pytest.mark.parametrize("fault", list(PREFILL_FAULTS))


@FAULTS
def test_prefill_fault_fails_after_every_attempt(start_router, make_fleet, journal_path, fault) -> None:
    faults, outcome, leg_status, engine = PREFILL_FAULTS[fault]
    fleet = make_fleet(prefill=[faults], decode=[{}])
    (prefill,), (decode,) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet, engine=engine, retry={"max_attempts": 2})

    answer = post(router)

    status, code = GIVE_UP[fault]
    assert_envelope(answer, status, type="server_error", code=code)
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code=code, leg="prefill", engine=prefill.url, status=status)
    assert [(leg["phase"], leg["attempt"], leg["engine"], leg["outcome"], leg["status"]) for leg in record["legs"]] == [
        ("prefill", 1, prefill.url, outcome, leg_status),
        ("prefill", 2, prefill.url, outcome, leg_status),
    ]
    assert all(leg["kv"] is None for leg in record["legs"]), record["legs"]
    assert_backend_ids(record)
    # Each attempt reached the engine under its own backend ID; no decode leg was tried.
    assert [r["request_id"] for r in sim_requests(prefill)] == [f"{rid}-p1", f"{rid}-p2"]
    assert sim_requests(decode) == []
    assert_idle(router)
    if fault == "timeout":
        # The engine finishes its delay after the router hung up: it must not hold KV for it.
        wait_kv(prefill, lambda s: s["client_gone"] == 2, timeout=5)
    assert_kv_settled(fleet.prefill, None)


@FAULTS
def test_prefill_fault_retried_on_the_other_engine(start_router, make_fleet, journal_path, fault) -> None:
    faults, outcome, leg_status, engine = PREFILL_FAULTS[fault]
    fleet = make_fleet(prefill=[faults, {}], decode=[{}, {}])
    bad, good = fleet.prefill
    router = start_router(fleet_=fleet, engine=engine)

    answer = post(router)

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"]
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed" and record["status"] == 200 and record["error"] is None
    legs = record["legs"]
    # A fresh router starts its rotation at the first engine: the faulty one.
    assert [(leg["phase"], leg["attempt"], leg["engine"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, bad.url, outcome),
        ("prefill", 2, good.url, "ok"),
        ("decode", 1, legs[2]["engine"], "ok"),
    ], legs
    assert legs[0]["status"] == leg_status and legs[0]["kv"] is None
    assert legs[1]["kv"]["outcome"] == "pulled" and legs[1]["kv"]["engine"] == good.url
    assert legs[1]["kv"]["owner"].startswith(f"cmpl-{rid}-p2-")  # the engine's ID: cmpl-<X-Request-Id>-0-<8 hex>
    assert_backend_ids(record)
    # The retry is a new attempt with a new backend ID, on the other engine.
    assert [r["request_id"] for r in sim_requests(bad)] == [f"{rid}-p1"]
    assert [r["request_id"] for r in sim_requests(good)] == [f"{rid}-p2"]
    assert_idle(router)
    if fault == "timeout":
        wait_kv(bad, lambda s: s["client_gone"] == 1, timeout=5)
    assert_kv_settled(fleet.prefill, None)
    assert good.stats()["kv_pulled"] == 1


def test_prefill_4xx_is_relayed_and_never_retried(start_router, make_fleet, journal_path) -> None:
    fleet = make_fleet(prefill=[{"error_rate": 1.0, "error_status": 400}, {}], decode=[{}, {}])
    bad, good = fleet.prefill
    router = start_router(fleet_=fleet)

    answer = post(router)

    # The engine's 4xx, in the OpenAI envelope: the client's mistake, 400,
    # journalled `invalid` naming the leg and engine (issue 20).
    assert answer.status_code == 400, answer.text
    data = answer.json()
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    assert data["error"]["message"] == "injected fault", data
    assert data["error"]["type"] == "invalid_request_error", data
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code=data["error"]["code"], leg="prefill", engine=bad.url, status=400, terminal="invalid")
    assert [(leg["phase"], leg["attempt"], leg["outcome"], leg["status"]) for leg in record["legs"]] == [
        ("prefill", 1, "refused", 400),
    ]
    assert [r["request_id"] for r in sim_requests(bad)] == [f"{rid}-p1"]
    assert sim_requests(good) == [] and all(sim_requests(d) == [] for d in fleet.decode)
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)
