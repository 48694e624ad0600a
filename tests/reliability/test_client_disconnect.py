"""Fault matrix: the client disconnects in each phase (docs/contract.md, "Admission,
capacity and retries": a client disconnect cancels the legs, releases capacity and KV, journals
``terminal: "cancelled"``).

The client is a raw socket that sends its request and closes. Engine delays,
a full decode engine and a stalled stream hold the request in the phase under
test; the test waits until the router's statistics (and the engines) show it
there before closing. Where a prefill leg left KV that no decode leg pulled
(between the legs, during the decode leg) the test runs under each
``engine.kv_release`` mode and checks the journal against the engines.
"""

from __future__ import annotations

import threading

from ..helpers import only_terminals, poll, wait_for_terminals
from .support import (
    CompletionClient,
    assert_idle,
    assert_kv_settled,
    assert_unpulled_kv,
    each_kv_mode,
    post,
    sim_requests,
    wait_kv,
    wait_sim_finished,
)



def _assert_cancelled(record: dict) -> None:
    assert record["terminal"] == "cancelled", record
    assert record["status"] == 499, record
    assert record["error"]["code"] == "client_disconnected", record


def _phases(record: dict) -> list[tuple[str, str]]:
    return [(leg["phase"], leg["outcome"]) for leg in record["legs"]]


def test_disconnect_while_queued(start_router, make_fleet, journal_path) -> None:
    fleet = make_fleet(prefill=[{"delay_s": 1.5}], decode=[{}])
    router = start_router(fleet_=fleet, admission={"max_inflight": 1, "queue_size": 4})
    answers: list = []
    holder = threading.Thread(target=lambda: answers.append(post(router)))
    holder.start()
    poll(lambda: router.statistics().inflight == 1, what="first request admitted")

    queued = CompletionClient(router)
    poll(lambda: router.statistics().queued == 1, what="second request queued")
    queued.close()
    poll(lambda: router.statistics().queued == 0, what="queue place given back")

    holder.join(10)
    assert answers and answers[0].status_code == 200, answers
    records = only_terminals(journal_path, 2)
    gone = [r for r in records.values() if r["terminal"] == "cancelled"]
    assert len(gone) == 1, records
    _assert_cancelled(gone[0])
    assert gone[0]["legs"] == []
    assert records[answers[0].headers["x-request-id"]]["terminal"] == "completed"
    assert_idle(router)
    assert_kv_settled(fleet.prefill, None)
    assert len(sim_requests(fleet.prefill[0])) == 1  # the cancelled request never reached an engine


def test_disconnect_during_prefill(start_router, make_fleet, journal_path) -> None:
    fleet = make_fleet(prefill=[{"delay_s": 1.5}], decode=[{}])
    (prefill,), (decode,) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet)

    client = CompletionClient(router)
    poll(lambda: len(sim_requests(prefill)) == 1 and router.statistics().legs == 1, what="prefill leg running")
    client.close()

    (record,) = only_terminals(journal_path, 1).values()
    _assert_cancelled(record)
    assert _phases(record) == [("prefill", "cancelled")]
    assert record["legs"][0]["kv"] is None
    assert_idle(router)
    # The router hung up on the prefill engine, which therefore holds nothing for it.
    wait_kv(prefill, lambda s: s["client_gone"] == 1, timeout=5)
    assert_kv_settled(fleet.prefill, None)
    assert sim_requests(decode) == []


@each_kv_mode
def test_disconnect_between_legs_releases_kv(start_router, make_fleet, journal_path, mode) -> None:
    # One decode slot, taken by a stream that stalls: the second request's prefill
    # finishes and its decode leg waits for the slot — between the legs.
    fleet = make_fleet(prefill=[{}], decode=[{"stall_after_chunks": 2}], mode=mode)
    (prefill,), (_decode,) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode, "max_inflight_per_engine": 1})

    holder = CompletionClient(router, stream=True, max_tokens=8)
    holder.read_until(b"data: ")
    waiting = CompletionClient(router)
    poll(lambda: prefill.stats()["kv_held"] == 1, what="second prefill done")
    poll(lambda: (lambda s: s.requests == 2 and s.legs == 1)(router.statistics()), what="decode leg waiting")
    waiting.close()
    wait_for_terminals(journal_path, 1)
    holder.close()
    records = only_terminals(journal_path, 2)

    (between,) = [r for r in records.values() if not r["stream"]]
    _assert_cancelled(between)
    assert _phases(between) == [("prefill", "ok")]
    assert_unpulled_kv(between, between["legs"][0], mode)
    (streaming,) = [r for r in records.values() if r["stream"]]
    _assert_cancelled(streaming)
    assert _phases(streaming) == [("prefill", "ok"), ("decode", "cancelled")]
    assert streaming["legs"][0]["kv"]["outcome"] == "pulled"
    assert_idle(router)
    assert_kv_settled(fleet.prefill, mode, unpulled=1)
    assert prefill.stats()["kv_pulled"] == (2 if mode == "decode_pull" else 1)  # (decode_pull's release pulls)


@each_kv_mode
def test_disconnect_during_decode_releases_kv(start_router, make_fleet, journal_path, mode) -> None:
    # The decode engine waits 1.5 s before it pulls: the KV is still the prefill engine's.
    fleet = make_fleet(prefill=[{}], decode=[{"delay_s": 1.5}, {}], mode=mode)
    (prefill,), (slow, _) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet, engine={"kv_release": mode})

    client = CompletionClient(router)
    poll(lambda: len(sim_requests(slow)) == 1 and router.statistics().legs == 1, what="decode leg running")
    client.close()

    (record,) = only_terminals(journal_path, 1).values()
    _assert_cancelled(record)
    assert _phases(record) == [("prefill", "ok"), ("decode", "cancelled")]
    assert record["legs"][1]["engine"] == slow.url
    assert_unpulled_kv(record, record["legs"][0], mode)
    assert_idle(router)
    # The slow decode engine's own abort may free the KV as well (vLLM does): under lease it may not expire.
    assert_kv_settled(fleet.prefill, mode, unpulled=1, expire=False)
    assert prefill.stats()["kv_pulled"] == (1 if mode == "decode_pull" else 0)  # (decode_pull's release pulls)


def test_disconnect_mid_stream(start_router, make_fleet, journal_path) -> None:
    fleet = make_fleet(prefill=[{}], decode=[{"stall_after_chunks": 3}])
    (_prefill,), (decode,) = fleet.prefill, fleet.decode
    router = start_router(fleet_=fleet)

    client = CompletionClient(router, stream=True, max_tokens=8)
    client.read_until(b"data: ", count=2)  # two chunks reached the client
    client.close()

    (record,) = only_terminals(journal_path, 1).values()
    _assert_cancelled(record)
    assert _phases(record) == [("prefill", "ok"), ("decode", "cancelled")]
    assert record["legs"][0]["kv"]["outcome"] == "pulled"
    assert_idle(router)
    # The router hung up on the stalled engine.
    wait_sim_finished(decode, record["legs"][1]["backend_id"])
    assert_kv_settled(fleet.prefill, None)
