"""Fault matrix, decode rows (docs/contract.md, "Prefill and decode legs", "Admission, capacity and retries").

* Before the handoff (5xx, dropped connection, 4xx, the whole-request
  deadline): the prefill engine still owns the KV, so the router must release
  it by ``engine.kv_release`` — each test runs under all four modes and
  checks the journal's ``legs[i].kv`` against the prefill engine's counters.
* After the first byte reached the client (dropped or stalled stream): no
  retry; the stream ends with ONE ``data: {"error": ...}`` event and the
  journal names the decode leg and engine; the KV was pulled.

The fleets have two decode engines: the first (where a fresh router sends its
first decode leg) carries the fault, the second is healthy — so a
``decode_pull`` or ``decode_abort`` release, which is itself a decode request, lands on an
engine that can act on it, and a retry has somewhere to go.
"""

from __future__ import annotations

import httpx
import pytest

from ..helpers import COMPLETIONS, assert_envelope, each_route, journal_terminal, poll, rid_of
from .support import (
    StreamClient,
    assert_backend_ids,
    assert_completed_stream,
    assert_error_stream,
    assert_failed,
    assert_idle,
    assert_kv_settled,
    assert_unpulled_kv,
    each_kv_mode,
    post,
    sim_requests,
    wait_sim_finished,
)


#: Decode faults that strike before the handoff: (sim faults, leg outcome, leg status).
BEFORE_HANDOFF = {
    "5xx": ({"error_rate": 1.0, "error_status": 503}, "http_error", 503),
    "drop": ({"drop_rate": 1.0}, "dropped", None),
}


def _check_release_request(record: dict, leg: dict, mode: str, decode_engines: list) -> None:
    """Under decode_abort (decode_pull) the release is a decode request that its engine turned into a KV release (pull)."""
    if mode not in ("decode_abort", "decode_pull"):
        return
    release_id = leg["kv"]["release_id"]

    def settled() -> list[dict]:
        # decode_abort is fire-and-forget: the router journals once the bytes
        # are sent; the engine settles the KV a moment later.
        seen = [r for d in decode_engines for r in sim_requests(d) if r["request_id"] == release_id]
        return seen if seen and seen[0]["kv"]["outcome"] != "pending" else []

    seen = poll(settled, what=f"the engine settled the release {release_id}")
    assert len(seen) == 1, (release_id, [sim_requests(d) for d in decode_engines])
    assert seen[0]["kv"]["outcome"] == ("pulled" if mode == "decode_pull" else "released"), seen[0]


@each_kv_mode
@pytest.mark.parametrize("fault", list(BEFORE_HANDOFF))
def test_decode_fault_before_handoff_releases_kv(start_router, make_fleet, journal_path, mode, fault) -> None:
    faults, outcome, leg_status = BEFORE_HANDOFF[fault]
    fleet = make_fleet(prefill=[{}], decode=[faults, {}], mode=mode)
    (prefill,), (bad, _good) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode}, retry={"max_attempts": 1})

    answer = post(router)

    assert_envelope(answer, 502, type="server_error", code="decode_failed")
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code="decode_failed", leg="decode", engine=bad.url, status=502)
    legs = record["legs"]
    assert [(leg["phase"], leg["attempt"], leg["engine"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, prefill.url, "ok"),
        ("decode", 1, bad.url, outcome),
    ], legs
    assert legs[1]["status"] == leg_status
    assert_backend_ids(record)
    assert_unpulled_kv(record, legs[0], mode)
    _check_release_request(record, legs[0], mode, fleet.decode)
    assert_idle(router)
    assert_kv_settled(fleet.prefill, mode, unpulled=1)
    # (decode_pull: the release is itself a pull.)
    assert prefill.stats()["kv_pulled"] == (1 if mode == "decode_pull" else 0)


@each_kv_mode
def test_decode_5xx_retried_with_new_legs(start_router, make_fleet, journal_path, mode) -> None:
    fleet = make_fleet(prefill=[{}, {}], decode=[{"error_rate": 1.0}, {}], mode=mode)
    p0, p1 = fleet.prefill
    bad, good = fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode})

    answer = post(router)

    assert answer.status_code == 200, answer.text
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed" and record["error"] is None
    legs = record["legs"]
    # The failed decode leg's KV is released and the prompt prefilled again on the
    # other prefill engine; the new decode attempt avoids the engine that failed.
    # (Under decode_abort and decode_pull the release took decode attempt 2: the retry is -d3.)
    retry_attempt = 3 if mode in ("decode_abort", "decode_pull") else 2
    assert [(leg["phase"], leg["attempt"], leg["engine"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, p0.url, "ok"),
        ("decode", 1, bad.url, "http_error"),
        ("prefill", 2, p1.url, "ok"),
        ("decode", retry_attempt, good.url, "ok"),
    ], legs
    assert_backend_ids(record)
    assert_unpulled_kv(record, legs[0], mode)
    _check_release_request(record, legs[0], mode, fleet.decode)
    assert legs[2]["kv"]["outcome"] == "pulled" and legs[2]["kv"]["method"] == "decode"
    assert [r["request_id"] for r in sim_requests(p0)] == [f"{rid}-p1"]
    assert [r["request_id"] for r in sim_requests(p1)] == [f"{rid}-p2"]
    assert [r["request_id"] for r in sim_requests(bad)] == [f"{rid}-d1"]
    assert f"{rid}-d{retry_attempt}" in [r["request_id"] for r in sim_requests(good)]
    assert_idle(router)
    assert_kv_settled(fleet.prefill, mode, unpulled=1)
    assert p1.stats()["kv_pulled"] == 1


@each_kv_mode
def test_decode_4xx_is_relayed_never_retried_and_releases_kv(start_router, make_fleet, journal_path, mode) -> None:
    fleet = make_fleet(prefill=[{}, {}], decode=[{"error_rate": 1.0, "error_status": 422}, {}], mode=mode)
    bad, good = fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode})

    answer = post(router)

    # The engine judged the request: the client's mistake, 400 with the
    # engine's message, journalled `invalid` naming the leg (issue 20).
    assert answer.status_code == 400, answer.text
    data = answer.json()
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}, data
    assert data["error"]["message"] == "injected fault"
    assert data["error"]["type"] == "invalid_request_error"
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code=data["error"]["code"], leg="decode", engine=bad.url, status=400, terminal="invalid")
    legs = record["legs"]
    assert [(leg["phase"], leg["attempt"], leg["outcome"], leg["status"]) for leg in legs] == [
        ("prefill", 1, "ok", 200),
        ("decode", 1, "refused", 422),
    ], legs
    assert_unpulled_kv(record, legs[0], mode)
    _check_release_request(record, legs[0], mode, fleet.decode)
    # Never retried: no second prefill, and the healthy decode engine saw at most the release.
    assert sum(len(sim_requests(p)) for p in fleet.prefill) == 1
    assert [r["request_id"] for r in sim_requests(good)] == (
        [legs[0]["kv"]["release_id"]] if mode in ("decode_abort", "decode_pull") else []
    )
    assert_idle(router)
    assert_kv_settled(fleet.prefill, mode, unpulled=1)


@each_kv_mode
def test_request_deadline_in_decode_releases_kv(start_router, make_fleet, journal_path, mode) -> None:
    # The decode engine waits 2 s before it pulls; the whole-request deadline is 0.4 s.
    fleet = make_fleet(prefill=[{}], decode=[{"delay_s": 2.0}, {}], mode=mode)
    (prefill,), (slow, _) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode}, admission={"request_timeout_s": 0.4})

    answer = post(router)

    assert_envelope(answer, 504, type="server_error", code="request_timeout")
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code="request_timeout", leg="decode", engine=slow.url, status=504)
    legs = record["legs"]
    assert [(leg["phase"], leg["outcome"]) for leg in legs] == [("prefill", "ok"), ("decode", "cancelled")], legs
    assert_unpulled_kv(record, legs[0], mode)
    assert_idle(router)
    # The slow decode engine's own abort (it sees the router hang up) may free the KV too.
    assert_kv_settled(fleet.prefill, mode, unpulled=1, expire=False)
    assert prefill.stats()["kv_pulled"] == (1 if mode == "decode_pull" else 0)  # (decode_pull's release pulls)


# ------------------------------------------------------------ after the first byte


@each_route
def test_decode_drop_mid_stream_ends_with_one_error_event(start_router, make_fleet, journal_path, route) -> None:
    fleet = make_fleet(prefill=[{}, {}], decode=[{"drop_after_chunks": 3}, {}])
    (prefill, _), (bad, good) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet)

    stream = StreamClient(router, route, max_tokens=8)
    try:
        assert stream.status == 200
        rid = stream.rid
        text = stream.read_all()
    finally:
        stream.close()

    chunks, error = assert_error_stream(text)
    assert chunks, "the first chunks must have reached the client before the failure"
    assert error["code"] == "engine_disconnected", error
    record = journal_terminal(journal_path, rid)
    # The client got a 200 head: the journal keeps that status and names the failing leg.
    assert_failed(record, code="engine_disconnected", leg="decode", engine=bad.url, status=200)
    legs = record["legs"]
    assert [(leg["phase"], leg["attempt"], leg["engine"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, prefill.url, "ok"),
        ("decode", 1, bad.url, "dropped"),
    ], legs
    assert legs[0]["kv"]["outcome"] == "pulled"
    # Bytes reached the client: never retried, though a healthy decode engine was there.
    assert sim_requests(good) == []
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)


@each_route
def test_decode_stall_mid_stream_hits_the_idle_timeout(start_router, make_fleet, journal_path, route) -> None:
    fleet = make_fleet(prefill=[{}, {}], decode=[{"stall_after_chunks": 3}, {}])
    (prefill, _), (bad, good) = fleet.prefill, fleet.decode
    # The engine stalls for good; the router allows 0.3 s between chunks.
    router = start_router(fleet_=fleet, engine={"stream_idle_timeout_s": 0.3})

    # 3 s is ten times the idle timeout: a stream still open then will stay open.
    stream = StreamClient(router, route, max_tokens=8, timeout=3.0)
    try:
        assert stream.status == 200
        rid = stream.rid
        try:
            text = stream.read_all()
        except httpx.ReadTimeout:
            pytest.fail(f"stream still open 3 s after the engine stalled (stream_idle_timeout_s = 0.3); "
                        f"got so far: {stream.text!r}")
    finally:
        stream.close()

    chunks, error = assert_error_stream(text)
    assert len(chunks) == 3, chunks
    assert error["code"] == "stream_idle_timeout", error
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code="stream_idle_timeout", leg="decode", engine=bad.url, status=200)
    legs = record["legs"]
    assert [(leg["phase"], leg["engine"], leg["outcome"]) for leg in legs] == [
        ("prefill", prefill.url, "ok"),
        ("decode", bad.url, "timeout"),
    ], legs
    assert legs[0]["kv"]["outcome"] == "pulled"
    assert sim_requests(good) == []
    assert_idle(router)
    # The router hung up on the stalled engine.
    wait_sim_finished(bad, legs[1]["backend_id"])
    assert_kv_settled(fleet.prefill, None)


@each_route
def test_decode_malformed_stream_event_is_never_relayed(start_router, make_fleet, journal_path, route) -> None:
    """An engine event that is not JSON must not reach the client (docs/contract.md, "Responses and errors").

    On the completions route it is the stream's first event: the leg fails
    before any byte reached the client (502). On the chat route a role chunk
    went first: the stream ends with one error event.
    """
    fleet = make_fleet(prefill=[{}], decode=[{"malformed_json_rate": 1.0}])
    (decode,) = fleet.decode
    router = start_router(fleet_=fleet, retry={"max_attempts": 1})

    answer = post(router, route, stream=True, max_tokens=4)

    rid = rid_of(answer)
    if route == COMPLETIONS:
        assert_envelope(answer, 502, type="server_error", code="decode_failed")
    else:
        assert answer.status_code == 200, answer.text
        chunks, error = assert_error_stream(answer.text)  # every event relayed is JSON
        assert error["code"] == "bad_engine_response", error
    record = journal_terminal(journal_path, rid)
    assert_failed(record, code=("decode_failed" if route == COMPLETIONS else "bad_engine_response"),
                  leg="decode", engine=decode.url, status=(502 if route == COMPLETIONS else 200))
    assert record["legs"][-1]["outcome"] == "bad_response", record["legs"]
    assert_idle(router)


def test_healthy_stream_still_completes(start_router, make_fleet, journal_path) -> None:
    """The control row: the same fleet without faults streams to ``[DONE]``."""
    fleet = make_fleet(prefill=[{}], decode=[{}, {}])
    router = start_router(fleet_=fleet)
    stream = StreamClient(router, COMPLETIONS, max_tokens=8)
    try:
        text = stream.read_all()
        rid = stream.rid
    finally:
        stream.close()
    assert len(assert_completed_stream(text)) >= 8
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed" and record["status"] == 200
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)
