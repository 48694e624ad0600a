"""The request path's records (issue 20, items 1-3), on the sans-IO router.

* A stream is complete once ``data: [DONE]`` is relayed: the client's body
  ends then and the record is ``completed``, whatever the engine's body does
  afterwards (ends cleanly: the connection is reused; breaks or stalls: it is
  closed). A client that leaves before ``[DONE]`` is still ``cancelled``.
* A request refused for a half-sent body (408) has its terminal record.
* ``max_tokens``/``max_completion_tokens`` below 1 cost no engine traffic.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal_core import FinishLeg, StartLeg

from .router_driver import (
    CHAT,
    COMPLETIONS,
    LAST_CHUNK,
    Driver,
    chat_body,
    chunk,
    completion_body,
    stream_events,
)


def _streamed_to_done(route: str = COMPLETIONS, **sections: Any) -> tuple[Driver, Any, Any]:
    """A streamed request whose decode engine sent every event and ``[DONE]``, but not the body's end."""
    d = Driver(**sections)
    body = completion_body(stream=True) if route == COMPLETIONS else chat_body(stream=True)
    client = d.post(route, body)
    d.answer_prefill(d.leg("prefill").bid)
    decode = d.leg("decode")
    while d.stream_next(decode.bid):
        pass
    return d, client, decode


def _finished(d: Driver, bid: str) -> list[FinishLeg]:
    return [cmd for cmd in d.finished if cmd.leg == bid]


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT])
def test_done_ends_the_clients_body_and_the_record_is_completed_before_the_engine_ends(route: str) -> None:
    d, client, decode = _streamed_to_done(route)
    response = client.last
    assert response.complete and response.status == 200 and response.sse_problem() is None
    assert response.sse_data()[-1] == b"[DONE]"
    record = d.terminal(decode.rid)
    assert (record["terminal"], record["status"], record["error"]) == ("completed", 200, None)
    assert record["usage"]["completion_tokens"] == 3
    assert [leg["outcome"] for leg in record["legs"]] == ["ok", "ok"]
    # The openai SDK closes as soon as it has read [DONE]: nothing changes.
    client.eof()
    assert d.terminal(decode.rid) == record
    # The engine's body ends later: the connection goes back to the pool.
    assert decode.open and _finished(d, decode.bid) == []
    d.advance(0.05)
    d.send_leg(decode.bid, LAST_CHUNK)
    assert [cmd.reusable for cmd in _finished(d, decode.bid)] == [True]
    d.check_invariants(final=True)


def test_engine_bytes_after_done_are_dropped_and_a_broken_tail_closes_the_connection() -> None:
    d, client, decode = _streamed_to_done()
    sent = bytes(client.raw)
    # More events after [DONE], then garbage where the next chunk should be.
    d.send_leg(decode.bid, chunk(b'data: {"late": true}\n\n'))
    assert bytes(client.raw) == sent
    d.send_leg(decode.bid, b"zz\r\n")
    assert decode.bid in d.cancelled and _finished(d, decode.bid) == []
    assert d.terminal(decode.rid)["terminal"] == "completed"
    d.check_invariants(final=True)


def test_events_in_the_same_read_after_done_are_not_relayed() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(stream=True))
    d.answer_prefill(d.leg("prefill").bid)
    decode = d.leg("decode")
    d.stream_head(decode.bid)
    events = stream_events(COMPLETIONS)
    late = b'data: {"id": "s-1", "object": "text_completion", "choices": []}\n\n'
    d.send_leg(decode.bid, chunk(b"".join(events) + late + b"data: not json\n\n") + LAST_CHUNK)
    data = client.last.sse_data()
    assert data[-1] == b"[DONE]" and len(data) == len(events)
    assert d.terminal(decode.rid)["terminal"] == "completed"
    assert [cmd.reusable for cmd in _finished(d, decode.bid)] == [True]
    d.check_invariants(final=True)


@pytest.mark.parametrize("how", ["eof", "reset"])
def test_an_engine_that_closes_after_done_costs_nothing(how: str) -> None:
    d, client, decode = _streamed_to_done()
    if how == "eof":
        d.drop(decode.bid)
    else:
        d.fail_leg(decode.bid, "dropped")
    assert _finished(d, decode.bid) == []
    record = d.terminal(decode.rid)
    assert record["terminal"] == "completed" and record["legs"][-1]["outcome"] == "ok"
    assert d.router.statistics().legs == 0
    d.check_invariants(final=True)


def test_an_engine_that_never_ends_its_body_after_done_is_closed_after_the_idle_limit() -> None:
    d, client, decode = _streamed_to_done(engine={"stream_idle_timeout_s": 5.0})
    assert d.terminal(decode.rid)["terminal"] == "completed"
    d.advance(4.9)
    assert decode.open and decode.bid not in d.cancelled
    assert d.router.statistics().engine_outstanding[(decode.engine.url, "decode")] == 1
    d.advance(0.2)
    assert decode.bid in d.cancelled
    assert d.router.statistics().engine_outstanding[(decode.engine.url, "decode")] == 0
    assert d.terminal(decode.rid)["terminal"] == "completed"
    d.check_invariants(final=True)


def test_a_client_that_leaves_before_done_is_cancelled() -> None:
    # The last content event came, [DONE] did not: the answer is not complete.
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(stream=True))
    d.answer_prefill(d.leg("prefill").bid)
    decode = d.leg("decode")
    events = stream_events(COMPLETIONS)
    for _ in events[:-1]:
        d.stream_next(decode.bid)
    client.eof()
    assert decode.bid in d.cancelled
    record = d.terminal(decode.rid)
    assert (record["terminal"], record["status"]) == ("cancelled", 499)
    d.check_invariants(final=True)


# ------------------------------------------------------------------ 408


def test_a_completion_request_whose_body_is_too_slow_gets_408_and_its_record() -> None:
    d = Driver(ingress={"body_timeout_s": 2.0})
    client = d.connect()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{\"prompt\":")
    client.send_incomplete(head, "POST", COMPLETIONS)
    d.advance(2.5)
    response = client.last
    assert response.status == 408 and response.rid is not None
    assert json.loads(response.body)["error"]["type"] == "invalid_request_error"
    record = d.terminal(response.rid)
    assert (record["terminal"], record["status"], record["route"]) == ("invalid", 408, COMPLETIONS)
    assert record["error"]["code"] == "request_timeout"
    d.check_invariants(final=True)


def test_a_slow_request_on_another_route_gets_408_and_no_record() -> None:
    d = Driver(ingress={"body_timeout_s": 2.0})
    client = d.connect()
    client.send_incomplete(b"POST /v1/embeddings HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\n{", "POST",
                           "/v1/embeddings")
    d.advance(2.5)
    assert client.last.status == 408
    assert d.terminals() == []
    d.check_invariants(final=True)


# ------------------------------------------------------------- max_tokens


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("value", [0, -1])
def test_an_output_length_below_one_is_refused_before_admission(field: str, value: int) -> None:
    d = Driver()
    client = d.post(CHAT, chat_body(**{field: value}))
    assert client.last.status == 400
    error = json.loads(client.last.body)["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert [cmd for _, cmd in d.commands if type(cmd) is StartLeg] == []
    record = d.terminal(client.last.rid or "")
    assert (record["terminal"], record["status"], record["legs"]) == ("invalid", 400, [])
    d.check_invariants(final=True)


def test_the_prefill_leg_overrides_both_output_lengths() -> None:
    d = Driver()
    d.post(CHAT, chat_body(max_tokens=50, max_completion_tokens=40))
    prefill = d.leg("prefill")
    assert (prefill.body["max_tokens"], prefill.body["max_completion_tokens"]) == (1, 1)
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode")
    assert (decode.body["max_tokens"], decode.body["max_completion_tokens"]) == (50, 40)
    d.serve_until_done()
    d.check_invariants(final=True)

