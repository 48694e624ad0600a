"""The router's answers to what the adapters report: a second shutdown, and an exception it raised.

* A second :class:`ShutdownRequested` (a second signal) cancels every request
  still running at once: 503 ``shutting_down`` (a begun stream's last event),
  ``failed`` records that blame no engine, ``ShutdownComplete`` at once.
* :meth:`Router.contain_failure` (the adapter caught an exception from
  ``receive``) ends the request the event concerned — 500 ``internal_error``,
  its slot freed, one terminal record, its connection closed — and leaves the
  others running; a connection with no request yet gets a 500 and is closed.
"""

from __future__ import annotations

import json

from narwhal_core import ClientData, LegData

from .router_driver import COMPLETIONS, Driver, completion_body
from .test_router_scenarios import error_of, only_rid


def test_a_second_shutdown_cancels_what_is_left_at_once() -> None:
    d = Driver()
    whole = d.post(COMPLETIONS, completion_body(prompt="whole"))
    d.answer_prefill(d.leg("prefill", only_rid_of_leg(d, 0)).bid)
    stream = d.post(COMPLETIONS, completion_body(prompt="streamed", stream=True))
    stream_prefill = [leg for leg in d.open_legs("prefill")][0]
    d.answer_prefill(stream_prefill.bid)
    stream_decode = d.leg("decode", stream_prefill.rid)
    d.stream_head(stream_decode.bid)
    d.stream_next(stream_decode.bid)
    queued_before = d.router.statistics()
    assert queued_before.requests == 2, queued_before

    d.shutdown()
    assert d.shutdown_complete == [] and d.router.statistics().requests == 2
    d.shutdown()  # the second signal
    assert len(d.shutdown_complete) == 1
    stats = d.router.statistics()
    assert stats.requests == 0 and stats.inflight == 0 and stats.legs == 0, stats

    assert whole.last.status == 503 and error_of(whole)["code"] == "shutting_down"
    assert whole.closed_by_router
    text = bytes(stream.last.body).decode()
    last = [e for e in text.split("\n\n") if e.strip()][-1]
    assert json.loads(last.split("data: ", 1)[1])["error"]["code"] == "shutting_down", text
    assert stream.closed_by_router
    for client, status in ((whole, 503), (stream, 200)):
        record = d.terminal(only_rid(client))
        assert record["terminal"] == "failed" and record["status"] == status, record
        assert record["error"]["code"] == "shutting_down", record
        assert record["error"]["leg"] is None and record["error"]["engine"] is None, record
        assert record["legs"][-1]["outcome"] == "cancelled", record["legs"]
    d.shutdown()  # a third changes nothing
    assert len(d.shutdown_complete) == 1


def only_rid_of_leg(d: Driver, index: int) -> str:
    return d.open_legs()[index].rid


def test_contain_failure_ends_only_the_request_of_the_event() -> None:
    d = Driver()
    bystander = d.post(COMPLETIONS, completion_body(prompt="bystander"))
    faulty = d.post(COMPLETIONS, completion_body(prompt="faulty"))
    legs = {leg.rid: leg for leg in d.open_legs("prefill")}
    assert len(legs) == 2
    faulty_leg = next(leg for leg in legs.values() if leg.body.get("prompt") == "faulty")

    d.router.contain_failure(LegData(faulty_leg.bid, b"HTTP/1.1 200 OK\r\n"), "RuntimeError: boom", "Traceback...")
    d.drain()
    assert faulty.last.status == 500, faulty.last
    error = error_of(faulty)
    assert (error["type"], error["code"]) == ("server_error", "internal_error"), error
    assert faulty.closed_by_router
    record = d.terminal(only_rid(faulty))
    assert record["terminal"] == "failed" and record["status"] == 500, record
    assert record["error"]["code"] == "internal_error", record
    assert [leg["outcome"] for leg in record["legs"]] == ["cancelled"], record["legs"]
    logs = [log for log in d.logs if log.event == "internal_error"]
    assert len(logs) == 1 and logs[0].fields["rid"] == only_rid(faulty), logs
    assert logs[0].fields["problem"] == "RuntimeError: boom" and logs[0].fields["traceback"] == "Traceback..."
    assert logs[0].fields["during"] == "LegData"
    assert d.router.statistics().inflight == 1  # the faulty request's slot is free

    # The other request is untouched and completes.
    d.serve_until_done()
    assert bystander.last.status == 200
    assert d.terminal(only_rid(bystander))["terminal"] == "completed"


def test_contain_failure_on_a_connection_without_a_request_answers_500_and_closes() -> None:
    d = Driver()
    client = d.connect()
    d.router.contain_failure(ClientData(client.handle, b"GET /hea"), "RuntimeError: boom")
    d.drain()
    assert client.last.status == 500 and error_of(client)["code"] == "internal_error"
    assert client.closed_by_router
    assert d.terminals() == []
    logs = [log for log in d.logs if log.event == "internal_error"]
    assert len(logs) == 1 and logs[0].fields["rid"] is None and "traceback" not in logs[0].fields, logs
