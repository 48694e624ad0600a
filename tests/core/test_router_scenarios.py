"""Scenario tests of the router, one behaviour each, stepping time by hand (aioquic style).

Every test builds a :class:`~tests.core.router_driver.Driver` (a router with
fake clients, a fake fleet, a fake control executor and a manual clock),
plays one story through ``Router.receive`` / ``handle_deadline`` with raw
HTTP bytes on both sides, and checks what the client got, what the engines
were sent, the journal, and that the driver's invariants hold at the end
(one terminal record per rid, last; nothing emitted after it; capacity back
to zero; every KV settled). Expected values come from docs/contract.md, never from
the router's code.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal_core import CancelLeg, ClientStalled, FinishLeg, ShutdownComplete, StartLeg, WriteJournal, journal
from narwhal_core.journal import ErrorRecord, KvRecord, LegRecord, RoutingRecord, TerminalRecord
from narwhal_core.leg_bodies import PREFILL_KV_REQUEST
from narwhal_core.router import NOTHING_HELD

from .router_driver import (
    ALIAS,
    CHAT,
    COMPLETIONS,
    DECODE_URLS,
    MODEL,
    PREFILL_URLS,
    Driver,
    FakeClient,
    SentRequest,
    chat_body,
    completion_body,
    http_response,
    json_request,
    prefill_answer,
)

TRUSTED = {"auth": "trusted_header", "trusted_proxies": ("127.0.0.0/8",)}
#: A fixed backoff window: the retry starts between 0.5 s and 1.5 s later.
SLOW_BACKOFF = {"backoff_base_s": 1.0, "backoff_max_s": 1.0}


def assert_line_is_the_records_encoding(d: Any, rid: str) -> None:
    """The router writes a request's terminal line straight from its state: it must be, byte for
    byte, what the journal's record classes encode for the same values (one shape, docs/contract.md, "The journal")."""
    lines = [cmd.line for _, cmd in d.commands if type(cmd) is WriteJournal and cmd.terminal
             and json.loads(cmd.line)["rid"] == rid]
    assert len(lines) == 1, lines
    record = json.loads(lines[0])
    legs = tuple(
        LegRecord(**{**leg, "kv": None if leg["kv"] is None else KvRecord(**leg["kv"])}) for leg in record["legs"]
    )
    error = None if record["error"] is None else ErrorRecord(**record["error"])
    routing = None if record["routing"] is None else RoutingRecord(**record["routing"])
    rebuilt = TerminalRecord(**{**record, "legs": legs, "error": error, "stripped": tuple(record["stripped"]),
                                "routing": routing})
    assert journal.encode(rebuilt) == lines[0]
    # And the times agree with each other: received <= each leg's span <= ts.
    assert abs(record["duration_ms"] - (record["ts"] - record["received"]) * 1000) < 0.01, record
    assert record["ttft_ms"] is None or 0 <= record["ttft_ms"] <= record["duration_ms"], record
    for leg in record["legs"]:
        assert record["received"] - 1e-6 <= leg["started"], (leg, record)
        assert leg["started"] + leg["duration_ms"] / 1000 <= record["ts"] + 1e-6, (leg, record)


def finish(d: Driver) -> None:
    """Answer everything still pending, settle every release, and check the invariants."""
    d.serve_until_done()
    d.complete_releases()
    d.check_invariants(final=True)


def only_rid(client: FakeClient) -> str:
    rid = client.last.rid
    assert rid is not None
    return rid


def error_of(client: FakeClient) -> dict[str, Any]:
    response = client.last
    assert response.complete
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]  # type: ignore[no-any-return]


def new_starts(d: Driver, since: int) -> list[StartLeg]:
    return [cmd for _, cmd in d.commands[since:] if type(cmd) is StartLeg]


# ----------------------------------------------------------------- happy paths


def test_pd_non_stream_completion() -> None:
    d = Driver()
    client = d.post(
        COMPLETIONS,
        completion_body(request_id="mine", kv_transfer_params={"remote_host": "evil"}, min_tokens=4),
        headers=[("X-Request-Id", "client-42"), ("Authorization", "Bearer sk-secret"),
                 ("X-Narwhal-Client", "mallory")],
    )
    prefill = d.leg("prefill")
    rid = prefill.rid
    # docs/contract.md, "Prefill and decode legs": the prefill leg.
    assert prefill.bid == f"{rid}-p1"
    assert prefill.engine.url == PREFILL_URLS[0]
    assert (prefill.method, prefill.route) == ("POST", COMPLETIONS)
    assert prefill.headers[b"x-request-id"] == prefill.bid.encode()
    assert prefill.headers[b"host"] == b"10.0.0.1:8100"
    assert not {b"authorization", b"x-narwhal-client"} & prefill.headers.keys()
    assert list(prefill.body) == [
        "model", "prompt", "max_tokens", "temperature", "min_tokens", "stream", "kv_transfer_params",
    ]
    assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
    # The client asked for min_tokens >= 1: the prefill's one token may not end the sequence.
    assert prefill.body["min_tokens"] == 1
    assert prefill.body["kv_transfer_params"] == PREFILL_KV_REQUEST
    assert prefill.body["model"] == MODEL
    # Nothing else happens until the prefill answers.
    assert d.open_legs() == [prefill]
    kv = d.answer_prefill(prefill.bid, cached_tokens=48)
    assert FinishLeg(prefill.bid, True) in d.finished
    # docs/contract.md, "Prefill and decode legs": the decode leg carries the client body and the KV params verbatim.
    decode = d.leg("decode")
    assert decode.bid == f"{rid}-d1"
    assert decode.engine.url == DECODE_URLS[0]
    assert decode.body["kv_transfer_params"] == kv
    assert decode.body["max_tokens"] == 64 and decode.body["min_tokens"] == 4
    assert "request_id" not in decode.body
    d.answer_decode(decode.bid, cached_tokens=224)
    response = client.last
    assert response.complete and response.status == 200
    assert response.rid == rid
    answer = response.json()
    assert answer["object"] == "text_completion" and answer["model"] == MODEL
    assert "kv_transfer_params" not in answer
    assert answer["choices"][0]["text"].startswith("Narwhals")
    # docs/contract.md, "Responses and errors": cached_tokens comes from the prefill leg.
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    records = d.records(rid)
    assert [r["terminal"] for r in records] == [None, "completed"]
    assert records[0]["event"] == "admitted"
    record = records[-1]
    assert record["status"] == 200 and record["error"] is None and record["mode"] == "pd"
    assert record["client_rid"] == "client-42" and record["client"] == "anonymous"
    assert record["stripped"] == ["request_id", "kv_transfer_params"]
    assert [(leg["backend_id"], leg["outcome"], leg["status"]) for leg in record["legs"]] == [
        (f"{rid}-p1", "ok", 200), (f"{rid}-d1", "ok", 200),
    ]
    assert record["legs"][0]["kv"]["outcome"] == "pulled"
    assert record["legs"][0]["kv"]["owner"] == f"{rid}-p1-0"
    assert record["usage"]["completion_tokens"] == 17
    assert b"sk-secret" not in b"".join(cmd.line for _, cmd in d.commands if type(cmd) is WriteJournal)
    assert_line_is_the_records_encoding(d, rid)
    d.check_invariants(final=True)


def test_pd_stream_chat() -> None:
    d = Driver()
    client = d.post(CHAT, chat_body(stream=True, stream_options={"include_usage": True}))
    prefill = d.leg("prefill")
    assert prefill.body["stream"] is False and "stream_options" not in prefill.body
    d.answer_prefill(prefill.bid, cached_tokens=32)
    decode = d.leg("decode")
    assert decode.body["stream"] is True and decode.body["stream_options"] == {"include_usage": True}
    d.stream_head(decode.bid)
    assert client.responses == []  # nothing is sent before the first event
    d.advance(0.25)
    d.stream_next(decode.bid)
    response = client.last
    assert response.status == 200 and response.is_sse and not response.complete
    assert len(response.sse_data()) == 1
    d.stream_rest(decode.bid)
    assert response.complete and response.sse_problem() is None
    data = response.sse_data()
    assert data[-1] == b"[DONE]"
    chunks = [json.loads(x) for x in data[:-1]]
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks if c["choices"]) == "w0 w1 w2 "
    assert all(c["model"] == MODEL for c in chunks)
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    record = d.terminal(response.rid or "")
    assert record["terminal"] == "completed" and record["stream"] is True and record["status"] == 200
    assert record["ttft_ms"] == 250.0
    assert record["usage"]["completion_tokens"] == 3
    d.check_invariants(final=True)


def test_single_leg_mode_uses_the_decode_pool_only() -> None:
    d = Driver(prefill=())
    client = d.post(COMPLETIONS, completion_body())
    decode = d.leg()
    assert decode.phase == "decode" and decode.bid.endswith("-d1")
    assert "kv_transfer_params" not in decode.body and decode.body["max_tokens"] == 64
    d.answer_decode(decode.bid)
    assert client.last.status == 200
    records = d.records(only_rid(client))
    assert [r["mode"] for r in records] == ["single", "single"]
    assert [leg["phase"] for leg in records[-1]["legs"]] == ["decode"]
    d.check_invariants(final=True)


def test_pipelined_requests_on_one_connection_are_answered_in_order() -> None:
    d = Driver()
    client = d.connect()
    client.send(
        json_request(COMPLETIONS, completion_body(prompt="first"))
        + json_request(CHAT, chat_body("second"))
        + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        requests=[SentRequest("POST", COMPLETIONS, True), SentRequest("POST", CHAT, True),
                  SentRequest("GET", "/health", True)],
    )
    first = d.leg()
    assert first.body["prompt"] == "first"
    d.serve(first.bid)
    assert len(d.open_legs()) == 1  # the second waits for the first response
    d.serve(d.leg("decode").bid)
    second = d.leg()
    assert second.route == CHAT and second.rid != first.rid
    d.serve(second.bid)
    d.serve(d.leg("decode").bid)
    statuses = [(r.request, r.status) for r in client.responses]
    assert statuses == [(("POST", COMPLETIONS), 200), (("POST", CHAT), 200), (("GET", "/health"), 200)]
    assert client.responses[1].json()["object"] == "chat.completion"
    assert len({r.rid for r in client.responses}) == 3
    d.check_invariants(final=True)


# ------------------------------------------------ request rule rejections

REJECTIONS = [
    ("not-json", COMPLETIONS, b'{"prompt": ', 400, None, None),
    ("not-utf8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', 400, None, None),
    ("not-object", COMPLETIONS, b'["prompt"]', 400, None, None),
    ("model-type", COMPLETIONS, {"model": 7, "prompt": "x"}, 400, "model", None),
    ("stream-type", COMPLETIONS, {"prompt": "x", "stream": "yes"}, 400, "stream", None),
    ("n-bool", COMPLETIONS, {"prompt": "x", "n": True}, 400, "n", None),
    ("max-tokens-float", COMPLETIONS, {"prompt": "x", "max_tokens": 1.0}, 400, "max_tokens", None),
    ("prompt-type", COMPLETIONS, {"prompt": 5}, 400, "prompt", None),
    ("messages-type", CHAT, {"messages": [{"role": "user", "content": "x"}, 3]}, 400, "messages", None),
    ("no-prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    ("no-messages", CHAT, {"model": MODEL, "prompt": "x"}, 400, "messages", None),
    ("unknown-model", COMPLETIONS, {"model": "gpt-4o", "prompt": "x"}, 404, "model", "model_not_found"),
    ("n-2", CHAT, {"messages": [], "n": 2}, 400, "n", None),
    ("best-of-3", COMPLETIONS, {"prompt": "x", "best_of": 3}, 400, "best_of", None),
    ("audio", CHAT, {"messages": [], "audio": {"voice": "x"}}, 400, "audio", None),
    ("modalities", CHAT, {"messages": [], "modalities": ["text", "audio"]}, 400, "modalities", None),
    ("tools-type", CHAT, {"messages": [], "tools": {"type": "function"}}, 400, "tools", None),
    ("tool-kind", CHAT, {"messages": [], "tools": [{"type": "function"}, {"type": "web"}]}, 400,
     "tools[1].type", None),
]


@pytest.mark.parametrize(
    ("route", "body", "status", "param", "code"),
    [pytest.param(*case[1:], id=case[0]) for case in REJECTIONS],
)
def test_contract_rejection_writes_one_invalid_record_and_starts_no_leg(
    route: str, body: Any, status: int, param: str | None, code: str | None
) -> None:
    d = Driver()
    client = d.post(route, body)
    error = error_of(client)
    assert client.last.status == status
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    rid = only_rid(client)
    records = d.records(rid)
    assert len(records) == 1 and records[0]["terminal"] == "invalid" and records[0]["status"] == status
    assert records[0]["error"]["param"] == param and records[0]["legs"] == []
    assert d.started_legs() == [] and d.pending_controls("release") == []
    stats = d.router.statistics()
    assert (stats.requests, stats.inflight, stats.queued) == (0, 0, 0)
    d.check_invariants(final=True)


def test_alias_is_accepted_and_the_engines_see_the_configured_name() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(model=ALIAS))
    assert d.leg().body["model"] == MODEL
    finish(d)
    assert client.last.status == 200 and client.last.json()["model"] == MODEL


def test_unauthenticated_request_is_denied_whatever_its_body() -> None:
    d = Driver(ingress=TRUSTED)
    client = d.post(COMPLETIONS, b"not json at all")
    assert client.last.status == 401
    assert error_of(client)["type"] == "authentication_error"
    record = d.terminal(only_rid(client))
    assert record["terminal"] == "denied" and record["client"] is None
    assert d.started_legs() == []
    d.check_invariants(final=True)


# ----------------------------------------------------------------- admission


def test_requests_beyond_max_inflight_queue_then_run_in_order() -> None:
    d = Driver(admission={"max_inflight": 1, "queue_size": 2})
    first = d.post(COMPLETIONS, completion_body(prompt="a"))
    second = d.post(COMPLETIONS, completion_body(prompt="b"))
    stats = d.router.statistics()
    assert (stats.inflight, stats.queued, stats.requests) == (1, 1, 2)
    assert len(d.open_legs()) == 1 and d.leg().body["prompt"] == "a"
    # A queued request is not admitted yet: no progress record.
    assert [e.record["rid"] for e in d.journal] == [d.leg().rid]
    d.serve(d.leg().bid)
    d.serve(d.leg().bid)
    assert first.last.status == 200
    assert d.leg().body["prompt"] == "b"
    finish(d)
    assert second.last.status == 200
    assert [r["terminal"] for r in d.records(only_rid(second))] == [None, "completed"]


def test_queue_full_gets_503_overloaded_with_retry_after() -> None:
    d = Driver(admission={"max_inflight": 1, "queue_size": 1, "retry_after_s": 3})
    d.post(COMPLETIONS, completion_body())
    d.post(COMPLETIONS, completion_body())
    third = d.post(COMPLETIONS, completion_body())
    assert third.last.status == 503 and third.last.header(b"retry-after") == b"3"
    error = error_of(third)
    assert (error["type"], error["code"]) == ("server_error", "overloaded")
    record = d.terminal(only_rid(third))
    assert record["terminal"] == "rejected" and record["legs"] == []
    assert len(d.records(only_rid(third))) == 1
    finish(d)


def test_queue_timeout_gets_503() -> None:
    d = Driver(admission={"max_inflight": 1, "queue_timeout_s": 5.0})
    first = d.post(COMPLETIONS, completion_body())
    queued = d.post(COMPLETIONS, completion_body())
    d.advance(4.9)
    assert queued.responses == []
    d.advance(0.2)
    assert queued.last.status == 503 and queued.last.header(b"retry-after") == b"1"
    assert error_of(queued)["code"] == "overloaded"
    record = d.terminal(only_rid(queued))
    assert record["terminal"] == "rejected" and record["legs"] == []
    assert d.router.statistics().queued == 0
    assert first.responses == []
    finish(d)
    assert first.last.status == 200


def test_per_client_limit_gets_429_rate_limited() -> None:
    d = Driver(ingress=TRUSTED, admission={"per_client_max_inflight": 1})
    alice = [("X-Narwhal-Client", "alice")]
    first = d.post(COMPLETIONS, completion_body(), alice)
    second = d.post(COMPLETIONS, completion_body(), alice)
    bob = d.post(COMPLETIONS, completion_body(), [("X-Narwhal-Client", "bob")])
    assert second.last.status == 429 and second.last.header(b"retry-after") == b"1"
    error = error_of(second)
    assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limited")
    record = d.terminal(only_rid(second))
    assert (record["terminal"], record["client"], record["legs"]) == ("rejected", "alice", [])
    assert len(d.open_legs()) == 2  # alice's first and bob's
    finish(d)
    assert first.last.status == 200 and bob.last.status == 200
    assert d.terminal(only_rid(bob))["client"] == "bob"


# ------------------------------------------------------------------ retries


def test_prefill_5xx_is_retried_on_the_other_engine_after_backoff() -> None:
    d = Driver(retry=SLOW_BACKOFF)
    client = d.post(COMPLETIONS, completion_body())
    first = d.leg("prefill")
    d.answer_status(first.bid, 503)
    mark = len(d.commands)
    d.advance(0.45)
    assert new_starts(d, mark) == []  # still backing off
    d.advance(1.1)
    retry = d.leg("prefill")
    assert retry.bid == f"{first.rid}-p2" and retry.headers[b"x-request-id"] == retry.bid.encode()
    assert retry.engine != first.engine
    assert retry.body == first.body
    finish(d)
    assert client.last.status == 200
    legs = d.terminal(first.rid)["legs"]
    assert [(leg["backend_id"], leg["outcome"], leg["status"]) for leg in legs] == [
        (first.bid, "http_error", 503), (retry.bid, "ok", 200), (f"{first.rid}-d1", "ok", 200),
    ]


# (A null kv_transfer_params is not unusable: nothing to hand off, see
# tests/core/test_router_prompts.py.)
@pytest.mark.parametrize("answer", ["not-remote", "foreign-host", "bad-port"])
def test_prefill_without_usable_kv_is_retried_then_502_prefill_failed(answer: str) -> None:
    d = Driver(retry={"max_attempts": 3})
    client = d.post(COMPLETIONS, completion_body())
    rid = d.leg().rid
    for attempt in (1, 2, 3):
        leg = d.leg("prefill")
        assert leg.bid == f"{rid}-p{attempt}"
        if answer == "not-remote":
            d.answer_prefill(leg.bid, do_remote_prefill=False)
        elif answer == "foreign-host":
            d.answer_prefill(leg.bid, remote_host="203.0.113.9")
        else:
            d.answer_prefill(leg.bid, remote_port=0)
        assert d.open_legs("decode") == []  # never a silent fallback
        d.advance(5)
    assert client.last.status == 502
    error = error_of(client)
    assert (error["type"], error["code"]) == ("server_error", "prefill_failed")
    record = d.terminal(rid)
    assert record["terminal"] == "failed" and record["error"]["leg"] == "prefill"
    assert [leg["outcome"] for leg in record["legs"]] == ["bad_kv"] * 3
    assert all(leg["kv"] is None for leg in record["legs"])
    assert_line_is_the_records_encoding(d, rid)
    d.check_invariants(final=True)


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("status", [400, 413, 422])
def test_engine_4xx_is_the_clients_mistake_answered_400_journalled_invalid_never_retried(
    phase: str, status: int
) -> None:
    # The engine judged the request (a prompt longer than the context): the
    # client gets 400 with the engine's message and param; the record is
    # `invalid` (not `failed`) and names the leg and the engine.
    d = Driver()
    client = d.post(CHAT, chat_body())
    if phase == "decode":
        d.answer_prefill(d.leg("prefill").bid)
    leg = d.leg(phase)
    d.answer_status(leg.bid, status, json.dumps({
        "object": "error", "message": "This model's maximum context length is 8192 tokens.",
        "type": "BadRequestError", "param": "messages", "code": 400,
    }).encode())
    mark = len(d.commands)
    d.advance(30)
    assert new_starts(d, mark) == []
    assert client.last.status == 400
    error = error_of(client)
    assert error["message"] == "This model's maximum context length is 8192 tokens."
    assert error["param"] == "messages"
    assert error["type"] == "invalid_request_error"
    if phase == "decode":
        # The decode engine refused before pulling: the prefill KV is released.
        assert [c.cmd.key for c in d.pending_controls("release")] == [f"release-{leg.rid}-p1"]
        d.complete_releases()
    record = d.terminal(leg.rid)
    assert record["terminal"] == "invalid" and record["status"] == 400
    assert (record["error"]["leg"], record["error"]["engine"]) == (phase, leg.engine.url)
    assert record["error"]["param"] == "messages"
    assert record["legs"][-1]["outcome"] == "refused" and record["legs"][-1]["status"] == status
    assert len(record["legs"]) == (1 if phase == "prefill" else 2)
    if phase == "decode":
        assert record["legs"][0]["kv"]["outcome"] == "released"
    finish(d)


@pytest.mark.parametrize("status", [401, 403, 404, 408, 429])
def test_engine_4xx_that_is_not_about_the_request_fails_the_leg_and_is_retried(status: int) -> None:
    # A timeout, an overload, or a credential, route or model name of
    # Narwhal's own: not the client's mistake, so the leg is retried elsewhere.
    d = Driver(retry=SLOW_BACKOFF)
    client = d.post(COMPLETIONS, completion_body())
    first = d.leg("prefill")
    d.answer_status(first.bid, status)
    d.advance(2)
    retry = d.leg("prefill")
    assert retry.bid == f"{first.rid}-p2" and retry.engine != first.engine
    finish(d)
    assert client.last.status == 200
    legs = d.terminal(first.rid)["legs"]
    assert [(leg["outcome"], leg["status"]) for leg in legs] == [("http_error", status), ("ok", 200), ("ok", 200)]


@pytest.mark.parametrize("mode", ["decode_pull", "abort_endpoint", "decode_abort", "lease"])
def test_decode_failure_before_handoff_releases_kv_then_prefills_again(mode: str) -> None:
    d = Driver(engine={"kv_release": mode, "abort_path": "/v1/abort"}, retry=SLOW_BACKOFF)
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    kv = d.answer_prefill(prefill.bid)
    decode = d.leg("decode")
    d.answer_status(decode.bid, 500)
    releases = d.pending_controls("release")
    if mode == "abort_endpoint":
        (control,) = releases
        cmd = control.cmd
        # A control request naming the owner key, to the PREFILL engine that holds the KV.
        assert (cmd.method, cmd.target, cmd.engine) == ("POST", "/v1/abort", prefill.engine)
        # SGLang's AbortReq field (rid) and the simulator's (request_id).
        assert json.loads(cmd.body) == {"rid": kv["remote_request_id"], "request_id": kv["remote_request_id"]}
        assert dict(cmd.headers)[b"host"] == b"10.0.0.1:8100"
    elif mode == "decode_pull":
        (control,) = releases
        cmd = control.cmd
        # A whole one-token decode request carrying the KV, read to its end.
        assert not cmd.drop_after_send and cmd.engine.url in DECODE_URLS
        assert (cmd.method, cmd.target) == ("POST", COMPLETIONS)
        body = json.loads(cmd.body)
        assert body["kv_transfer_params"] == kv
        assert (body["max_tokens"], body["stream"], body["prompt"]) == (1, False, completion_body()["prompt"])
        assert dict(cmd.headers)[b"x-request-id"].decode().startswith(prefill.rid + "-d")
    elif mode == "decode_abort":
        (control,) = releases
        cmd = control.cmd
        assert cmd.drop_after_send and cmd.engine.url in DECODE_URLS
        assert control.parsed is not None
        method, target, headers, body = control.parsed
        assert (method, target) == ("POST", COMPLETIONS)
        assert body["kv_transfer_params"] == kv
        assert headers[b"x-request-id"].decode().startswith(prefill.rid + "-d")
    else:
        assert releases == []
    d.complete_releases()
    d.advance(1.5)
    again = d.leg("prefill")
    assert again.bid == f"{prefill.rid}-p2"
    finish(d)
    assert client.last.status == 200
    legs = d.terminal(prefill.rid)["legs"]
    first_kv = legs[0]["kv"]
    # decode_abort: nothing comes back to confirm the release.
    expected = {"lease": "held_until_lease", "decode_abort": "release_sent"}.get(mode, "released")
    assert (first_kv["outcome"], first_kv["owner"], first_kv["method"]) == (
        expected, kv["remote_request_id"], mode,
    )
    assert [leg["kv"]["outcome"] for leg in legs if leg["phase"] == "prefill"] == [expected, "pulled"]
    assert first_kv["error"] is None


@pytest.mark.parametrize(
    ("answer", "nothing_held"),
    [
        (b'{"request_id": "x", "released": false, "num_blocks": 0}', True),
        (b'{"request_id": "x", "released": true, "num_blocks": 4}', False),
        (b"", None),
        (b"not json", None),
        (b'{"released": 0}', None),
        (b'[false]', None),
    ],
    ids=["released-false", "released-true", "no-body", "not-json", "not-a-bool", "not-an-object"],
)
def test_an_abort_endpoint_that_held_nothing_is_journalled_so(answer: bytes, nothing_held: bool | None) -> None:
    # The decode engine pulled the KV, then failed before its response head:
    # the release finds nothing, and the engine says so. The journal must not
    # claim Narwhal freed blocks; it is still no leak. An answer that says
    # nothing either way (SGLang's 200 without a body) confirms only that the
    # abort was taken: release_sent (nothing_held None).
    d = Driver(engine={"kv_release": "abort_endpoint"}, retry=SLOW_BACKOFF)
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    kv = d.answer_prefill(prefill.bid)
    d.answer_status(d.leg("decode").bid, 500)
    (release,) = d.pending_controls("release")
    d.complete_control(release.cmd.key, status=200, body=answer)
    d.advance(1.5)
    finish(d)
    assert client.last.status == 200
    first_kv = d.terminal(prefill.rid)["legs"][0]["kv"]
    assert (first_kv["outcome"], first_kv["owner"], first_kv["method"]) == (
        "released" if nothing_held is not None else "release_sent", kv["remote_request_id"], "abort_endpoint",
    )
    if nothing_held is None:
        assert "did not say" in first_kv["error"]
    else:
        assert first_kv["error"] == (NOTHING_HELD if nothing_held else None)


def test_dropped_and_malformed_prefill_answers_are_retried() -> None:
    d = Driver(retry={"max_attempts": 3})
    client = d.post(COMPLETIONS, completion_body())
    d.drop(d.leg().bid)
    d.advance(1)
    d.answer_garbage(d.leg().bid)
    d.advance(1)
    finish(d)
    assert client.last.status == 200
    legs = d.terminal(only_rid(client))["legs"]
    assert [leg["outcome"] for leg in legs] == ["dropped", "bad_response", "ok", "ok"]


def test_connection_failures_on_every_attempt_give_503_engine_unavailable() -> None:
    d = Driver(retry={"max_attempts": 2})
    client = d.post(COMPLETIONS, completion_body())
    d.fail_leg(d.leg().bid, "connect_failed")
    d.advance(1)
    d.fail_leg(d.leg().bid, "connect_timeout")
    assert client.last.status == 503
    assert error_of(client)["code"] == "engine_unavailable"
    assert [leg["outcome"] for leg in d.terminal(only_rid(client))["legs"]] == ["connect_failed"] * 2
    d.check_invariants(final=True)


def test_stale_pooled_connection_is_retried_once_on_a_fresh_connection() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body())
    leg = d.leg()
    mark = len(d.commands)
    d.fail_leg(leg.bid, "dropped", reused=True)
    (restart,) = new_starts(d, mark)
    # The same leg (same backend ID, same engine, same bytes), on a new socket.
    assert restart.leg == leg.bid and restart.fresh_connection
    assert restart.engine == leg.engine
    assert CancelLeg(leg.bid) not in [cmd for _, cmd in d.commands[mark:]]
    finish(d)
    assert client.last.status == 200
    legs = d.terminal(leg.rid)["legs"]
    assert [(x["backend_id"], x["attempt"]) for x in legs] == [(leg.bid, 1), (f"{leg.rid}-d1", 1)]


def test_a_second_stale_failure_is_a_real_failure() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body())
    leg = d.leg()
    d.fail_leg(leg.bid, "dropped", reused=True)
    d.fail_leg(leg.bid, "dropped", reused=True)
    d.advance(1)
    assert d.leg("prefill").bid == f"{leg.rid}-p2"
    finish(d)
    assert client.last.status == 200


def test_a_pooled_connection_that_already_returned_bytes_is_not_resent() -> None:
    # The engine answered part of the head: it saw the request, so sending the
    # same backend ID again would give one KV two owners (docs/contract.md, "Prefill and decode legs").
    d = Driver()
    client = d.post(COMPLETIONS, completion_body())
    leg = d.leg()
    d.send_leg(leg.bid, b"HTTP/1.1 200 OK\r\ncontent-type: appl")
    mark = len(d.commands)
    d.fail_leg(leg.bid, "dropped", reused=True)
    assert [cmd.leg for cmd in new_starts(d, mark)] == []
    d.advance(1)
    retry = d.leg("prefill")
    assert retry.bid == f"{leg.rid}-p2" and not retry.fresh_connection
    finish(d)
    assert client.last.status == 200
    assert [x["outcome"] for x in d.terminal(leg.rid)["legs"]][:2] == ["dropped", "ok"]


# -------------------------------------------------------------- client gone


def _phase_queued(d: Driver) -> FakeClient:
    d.post(COMPLETIONS, completion_body(prompt="holder"))
    return d.post(COMPLETIONS, completion_body())


def _phase_prefill(d: Driver) -> FakeClient:
    return d.post(COMPLETIONS, completion_body())


def _phase_backoff(d: Driver) -> FakeClient:
    client = d.post(COMPLETIONS, completion_body())
    d.answer_prefill(d.leg("prefill").bid)
    d.answer_status(d.leg("decode").bid, 503)  # KV released, new prefill after backoff
    d.complete_releases()
    return client


def _phase_decode_wait(d: Driver) -> FakeClient:
    holder = d.post(COMPLETIONS, completion_body(prompt="holder"))
    d.answer_prefill(d.leg("prefill", rid=None).bid)
    assert holder.responses == []
    client = d.post(COMPLETIONS, completion_body())
    d.answer_prefill(d.open_legs("prefill")[0].bid)  # no decode slot: it waits, holding KV
    return client


def _phase_decode(d: Driver) -> FakeClient:
    client = d.post(COMPLETIONS, completion_body())
    d.answer_prefill(d.leg("prefill").bid)
    return client


def _phase_stream(d: Driver) -> FakeClient:
    client = d.post(CHAT, chat_body(stream=True))
    d.answer_prefill(d.leg("prefill").bid)
    decode = d.leg("decode")
    d.stream_next(decode.bid)
    d.stream_next(decode.bid)
    assert client.last.status == 200 and len(client.last.sse_data()) == 2
    return client


PHASES = {
    "queued": (_phase_queued, {"admission": {"max_inflight": 1}}, "none"),
    "prefill": (_phase_prefill, {}, "none"),
    "backoff": (_phase_backoff, {"retry": {"backoff_base_s": 5.0, "backoff_max_s": 5.0}}, "released"),
    "decode_wait": (
        _phase_decode_wait,
        {"engine": {"max_inflight_per_engine": 1}, "prefill": PREFILL_URLS[:1], "decode": DECODE_URLS[:1]},
        "released",
    ),
    "decode": (_phase_decode, {}, "released"),
    "mid_stream": (_phase_stream, {}, "pulled"),
}


@pytest.mark.parametrize("how", ["gone", "eof"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_client_gone_cancels_legs_releases_kv_and_frees_capacity(phase: str, how: str) -> None:
    setup, sections, kv_expected = PHASES[phase]
    d = Driver(**sections)
    client = setup(d)
    rid = d.issued[-1]  # the leaving client's request is the last one made
    running = [leg.bid for leg in d.open_legs(rid=rid)]
    mark = len(d.commands)
    if how == "gone":
        client.leave()
    else:
        client.eof()
    emitted = [cmd for _, cmd in d.commands[mark:]]
    for bid in running:
        assert CancelLeg(bid) in emitted, (
            f"{bid} not cancelled (docs/contract.md, 'Admission, capacity and retries': "
            "a client disconnect cancels the legs)"
        )
    releases = [c for c in d.pending_controls("release") if c.cmd.key.startswith(f"release-{rid}-")]
    # Unpulled KV is released at once (in "backoff" it was released when the decode leg failed).
    assert bool(releases) == (kv_expected == "released" and phase != "backoff")
    d.complete_releases()
    record = d.terminal(rid)
    assert (record["terminal"], record["status"]) == ("cancelled", 499)
    assert record["error"]["code"] == "client_disconnected"
    assert [leg["outcome"] for leg in record["legs"] if leg["backend_id"] in running] == ["cancelled"] * len(running)
    kv = [leg["kv"]["outcome"] for leg in record["legs"] if leg["kv"] is not None]
    assert kv == {"none": [], "released": ["released"], "pulled": ["pulled"]}[kv_expected]
    stats = d.router.statistics()
    assert (stats.queued, stats.requests) == (0, 1 if phase in ("queued", "decode_wait") else 0)
    finish(d)


def test_slot_waiter_that_left_while_its_kv_release_runs_is_not_woken() -> None:
    # A waits for a decode slot holding KV, its client leaves, the release is in
    # flight (RELEASING); then the decode leg that held the slot ends.
    d = Driver(prefill=PREFILL_URLS[:1], decode=DECODE_URLS[:1],
               engine={"max_inflight_per_engine": 1, "kv_release": "abort_endpoint"})
    holder = d.post(COMPLETIONS, completion_body(prompt="holder"))
    d.answer_prefill(d.leg("prefill").bid)
    busy = d.leg("decode")
    waiter = d.post(COMPLETIONS, completion_body(prompt="waiter"))
    d.answer_prefill(d.leg("prefill").bid)
    assert d.open_legs() == [busy]
    waiter.leave()
    assert len(d.pending_controls("release")) == 1
    d.answer_decode(busy.bid)  # frees the decode slot
    assert holder.last.status == 200
    d.complete_releases()
    record = d.terminal(d.issued[1])
    assert record["terminal"] == "cancelled"
    assert record["legs"][0]["kv"]["outcome"] == "released"
    finish(d)


# ----------------------------------------------------------------- timeouts


def test_prefill_leg_timeout_is_retried_then_504_engine_timeout() -> None:
    d = Driver(engine={"prefill_timeout_s": 10.0}, retry={"max_attempts": 2})
    client = d.post(COMPLETIONS, completion_body())
    first = d.leg()
    d.advance(9.9)
    assert first.open
    d.advance(0.2)
    assert first.state == "cancelled"
    d.advance(1)
    second = d.leg()
    assert second.bid.endswith("-p2")
    d.advance(10)
    assert second.state == "cancelled"
    assert client.last.status == 504
    assert error_of(client)["code"] == "engine_timeout"
    record = d.terminal(first.rid)
    assert [leg["outcome"] for leg in record["legs"]] == ["timeout", "timeout"]
    d.check_invariants(final=True)


def _stream_begun(**sections: Any) -> tuple[Driver, Any, Any]:
    """A streamed completion whose decode leg has sent its head and first event."""
    d = Driver(**sections)
    client = d.post(COMPLETIONS, completion_body(stream=True))
    d.answer_prefill(d.leg("prefill").bid)
    decode = d.leg("decode")
    d.stream_next(decode.bid)
    return d, client, decode


def test_stream_idle_timeout_after_first_bytes_ends_the_stream_with_one_error_event() -> None:
    d, client, decode = _stream_begun(engine={"stream_idle_timeout_s": 5.0})
    d.advance(4)
    d.stream_next(decode.bid)
    d.advance(4)  # 4 s since the last chunk: still fine
    assert decode.open and not client.last.complete
    d.advance(1.5)
    assert decode.state == "cancelled"
    response = client.last
    assert response.complete and response.status == 200 and response.sse_problem() is None
    data = response.sse_data()
    assert len(data) == 3 and b"[DONE]" not in data
    error = json.loads(data[-1])["error"]
    assert (error["type"], error["code"]) == ("server_error", "stream_idle_timeout")
    record = d.terminal(decode.rid)
    assert (record["terminal"], record["status"]) == ("failed", 200)
    assert record["error"]["code"] == "stream_idle_timeout"
    assert (record["error"]["leg"], record["error"]["engine"]) == ("decode", decode.engine.url)
    assert record["legs"][-1]["outcome"] == "timeout"
    assert record["legs"][0]["kv"]["outcome"] == "pulled"
    d.check_invariants(final=True)


def test_a_stream_held_back_for_a_stalled_client_is_not_timed_out() -> None:
    # The adapter stopped reading the engine because the client is not
    # reading: the engine's silence is not a stalled stream. Its idle limit
    # runs again, whole, once the client catches up.
    d, client, decode = _stream_begun(engine={"stream_idle_timeout_s": 5.0}, health={"unhealthy_after": 1})
    d.advance(1)
    d.feed(ClientStalled(client.handle, True))
    d.advance(60)  # twelve idle limits
    assert decode.open and not client.last.complete
    d.feed(ClientStalled(client.handle, False))
    d.advance(4.5)  # the limit runs from the catching up
    assert decode.open
    d.stream_next(decode.bid)
    d.stream_rest(decode.bid)
    record = d.terminal(decode.rid)
    assert (record["terminal"], record["status"], record["error"]) == ("completed", 200, None)
    assert [leg["outcome"] for leg in record["legs"]] == ["ok", "ok"]
    assert all(d.router.statistics().engine_healthy.values())
    d.check_invariants(final=True)


def test_a_stream_whose_client_caught_up_times_out_when_the_engine_is_silent() -> None:
    d, client, decode = _stream_begun(engine={"stream_idle_timeout_s": 5.0})
    d.feed(ClientStalled(client.handle, True))
    d.advance(10)
    d.feed(ClientStalled(client.handle, False))
    d.advance(5.5)
    assert decode.state == "cancelled"
    record = d.terminal(decode.rid)
    assert (record["terminal"], record["error"]["code"]) == ("failed", "stream_idle_timeout")
    assert record["legs"][-1]["outcome"] == "timeout"
    d.check_invariants(final=True)


def test_a_leg_started_for_a_stalled_client_waits_for_it() -> None:
    # A request the client pipelined behind an answer it is not reading: its
    # legs start held (the adapter does not read them), and get their whole
    # limit once the client catches up. (A lease longer than the test's 60 s:
    # the watch on an unrenewed hold, tested apart, would cut the decode leg.)
    d = Driver(engine={"prefill_timeout_s": 5.0, "decode_timeout_s": 5.0, "kv_release": "lease", "kv_lease_s": 120.0},
               retry={"max_attempts": 1})
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    d.feed(ClientStalled(client.handle, True))
    d.advance(30)
    assert prefill.open  # held since before its limit
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode")  # started while its client is stalled
    d.advance(30)
    assert decode.open
    d.feed(ClientStalled(client.handle, False))
    d.advance(4.5)
    assert decode.open
    d.advance(1)  # the whole limit since the client caught up, and the engine still silent
    assert decode.state == "cancelled"
    record = d.terminal(decode.rid)
    assert record["terminal"] == "failed"
    assert [leg["outcome"] for leg in record["legs"]] == ["ok", "timeout"]
    d.check_invariants(final=True)


def test_a_prefill_leg_left_running_after_its_stalled_client_left_gets_its_limit_back() -> None:
    # The client stalls, its prefill answer starts to arrive, then the client
    # leaves: the leg is read on (to release the KV it names), so nothing
    # holds it back any more and its limit runs again, whole.
    d = Driver(engine={"prefill_timeout_s": 5.0, "kv_release": "abort_endpoint"})
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    d.feed(ClientStalled(client.handle, True))
    d.advance(10)
    d.send_leg(prefill.bid, b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 900\r\n\r\n{")
    client.leave()
    assert prefill.open  # read on, for the KV its answer names
    d.advance(4.5)
    assert prefill.open
    d.advance(1)
    assert prefill.state == "cancelled"
    record = d.terminal(prefill.rid)
    assert record["terminal"] == "cancelled"
    assert [leg["outcome"] for leg in record["legs"]] == ["timeout"]
    d.check_invariants(final=True)


def test_whole_request_deadline_gives_504_request_timeout() -> None:
    d = Driver(admission={"request_timeout_s": 30.0}, engine={"prefill_timeout_s": 60.0})
    client = d.post(COMPLETIONS, completion_body())
    leg = d.leg()
    d.advance(29.9)
    assert client.responses == []
    d.advance(0.2)
    assert leg.state == "cancelled"
    assert client.last.status == 504
    assert error_of(client)["code"] == "request_timeout"
    record = d.terminal(leg.rid)
    assert record["terminal"] == "failed" and record["legs"][0]["outcome"] == "cancelled"
    d.check_invariants(final=True)


def test_slow_request_head_gets_408_after_the_header_timeout() -> None:
    # ingress.header_timeout_s: "Time a client has to send the whole request head."
    d = Driver(ingress={"header_timeout_s": 10.0, "body_timeout_s": 60.0})
    client = d.connect()
    client.send(b"POST /v1/completions HTTP/1.1\r\nHost: narwhal.test\r\n",
                requests=[SentRequest("POST", COMPLETIONS, complete=False, well_formed=False)])
    d.advance(10.5)
    assert client.closed_by_router
    assert client.last.status == 408


def test_half_sent_request_on_a_keepalive_connection_gets_408_on_time() -> None:
    # After a response the connection idles (keepalive_timeout_s); once bytes of
    # a next request arrive, the read timeouts apply from then on -- not later.
    d = Driver(ingress={"header_timeout_s": 10.0, "body_timeout_s": 20.0, "keepalive_timeout_s": 75.0})
    client = d.connect()
    client.request("GET", "/health")
    assert client.last.status == 200
    d.advance(1.0)
    data = json_request(COMPLETIONS, completion_body())
    client.send_incomplete(data[: len(data) // 2], "POST", COMPLETIONS)  # the head and half the body
    d.advance(19.5)  # within body_timeout_s of the head
    assert not client.closed_by_router
    d.advance(11.0)  # past header_timeout_s + body_timeout_s since the first byte
    assert client.closed_by_router and client.last.status == 408
    assert d.started_legs() == [] and d.router.statistics().requests == 0
    d.check_invariants(final=True)


def test_expect_100_continue_gets_100_then_the_answer() -> None:
    d = Driver()
    client = d.connect()
    data = json_request(COMPLETIONS, completion_body(), [("Expect", "100-continue")])
    split = data.index(b"\r\n\r\n") + 4
    info = SentRequest("POST", COMPLETIONS, complete=False)
    client.send(data[:split], requests=[info])
    assert client.raw.startswith(b"HTTP/1.1 100 Continue\r\n")
    assert d.started_legs() == []
    info.complete = True
    client.send(data[split:])
    finish(d)
    assert client.last.status == 200
    assert [r["terminal"] for r in d.records(only_rid(client))] == [None, "completed"]


# ------------------------------------------------------------------- health


def test_passive_failures_take_an_engine_out_and_probes_bring_it_back() -> None:
    d = Driver(auto_probe=None, health={"unhealthy_after": 2, "healthy_after": 2, "probe_interval_s": 5.0},
               retry={"backoff_base_s": 0.0, "backoff_max_s": 0.0})
    bad = PREFILL_URLS[0]
    failures = 0
    while failures < 2:
        client = d.post(COMPLETIONS, completion_body())
        leg = d.leg("prefill")
        if leg.engine.url == bad:
            d.answer_status(leg.bid, 500)
            failures += 1
            d.fire()  # the zero backoff retry
        finish(d)
        assert client.last.status == 200
    assert ("engine_down" in d.log_events())
    assert d.router.statistics().engine_healthy[(bad, "prefill")] is False
    for _ in range(4):
        d.post(COMPLETIONS, completion_body())
        assert d.leg("prefill").engine.url != bad
        finish(d)
    # Probes: every engine is probed; only successful probes bring it back.
    probed = 0
    while d.router.statistics().engine_healthy[(bad, "prefill")] is False:
        d.advance(5)
        for control in d.pending_controls("probe"):
            cmd = control.cmd
            assert (cmd.method, cmd.target) == ("GET", "/health")
            if cmd.engine.url == bad:
                probed += 1
            d.complete_control(cmd.key, status=200)
        assert probed <= 3
    assert probed == 2
    assert d.log_events().count("engine_up") == 1
    used = set()
    for _ in range(3):
        d.post(COMPLETIONS, completion_body())
        used.add(d.leg("prefill").engine.url)
        finish(d)
    assert bad in used


def test_local_connect_failures_are_not_charged_to_the_engine() -> None:
    # Out of file descriptors (or ports): Narwhal's shortage. The request ends
    # 503 with its own code after its retries, and no engine leaves rotation.
    d = Driver(auto_probe=None, health={"unhealthy_after": 1, "probe_interval_s": 5.0},
               retry={"max_attempts": 2, "backoff_base_s": 0.0, "backoff_max_s": 0.0})
    client = d.post(COMPLETIONS, completion_body())
    d.fail_leg(d.leg().bid, "local_error")
    d.fire()  # the zero backoff retry
    d.fail_leg(d.leg().bid, "local_error")
    assert client.last.status == 503
    assert client.last.header(b"retry-after") is not None
    error = error_of(client)
    assert error["code"] == "router_resources_exhausted"
    assert "file descriptors" in error["message"]
    record = d.terminal(only_rid(client))
    assert record["terminal"] == "failed" and record["error"]["code"] == "router_resources_exhausted"
    assert [leg["outcome"] for leg in record["legs"]] == ["local_error"] * 2
    assert "engine_down" not in d.log_events()
    # One log line for the two failures (at most one a second), counting them.
    shortages = [log for log in d.logs if log.event == "local_resources_exhausted"]
    assert [(c.fields["failed"], c.fields["count"]) for c in shortages] == [("prefill leg", 1)]
    assert all(d.router.statistics().engine_healthy.values())
    # Probes that fail for the same reason give no verdict either; a real
    # failure still does.
    d.advance(5)
    probes = d.pending_controls("probe")
    assert probes
    for control in probes:
        d.complete_control(control.cmd.key, status=None, error="ConnectError", local=True)
    assert all(d.router.statistics().engine_healthy.values())
    shortages = [log for log in d.logs if log.event == "local_resources_exhausted"]
    assert [(c.fields["failed"], c.fields["count"]) for c in shortages] == [("prefill leg", 1), ("health probe", 2)]
    d.advance(5)
    for control in d.pending_controls("probe"):
        d.complete_control(control.cmd.key, status=None, error="ConnectError")
    assert not any(d.router.statistics().engine_healthy.values())
    d.check_invariants(final=True)


def test_ready_is_503_when_every_engine_of_a_phase_is_down() -> None:
    d = Driver(auto_probe=None, health={"unhealthy_after": 1, "probe_interval_s": 5.0})
    client = d.connect()
    # Every engine is probed at start; until one of each phase answers, not ready.
    assert sorted(c.cmd.engine.url for c in d.pending_controls("probe")) == sorted(PREFILL_URLS + DECODE_URLS)
    client.request("GET", "/ready")
    assert client.last.status == 503
    assert client.last.json()["problems"] == ["no prefill engine has answered yet", "no decode engine has answered yet"]
    for control in d.pending_controls("probe"):
        d.complete_control(control.cmd.key, status=200)
    client.request("GET", "/ready")
    assert client.last.status == 200 and client.last.json()["ready"] is True
    d.advance(5)
    for control in d.pending_controls("probe"):
        ok = control.cmd.engine.url not in DECODE_URLS
        d.complete_control(control.cmd.key, status=200 if ok else None, error=None if ok else "ConnectError")
    client.request("GET", "/ready")
    assert client.last.status == 503
    assert client.last.json()["problems"] == ["no healthy decode engine"]
    assert not d.router.statistics().ready
    rejected = d.post(COMPLETIONS, completion_body())
    assert rejected.last.status == 503 and rejected.last.header(b"retry-after") is not None
    assert error_of(rejected)["code"] == "engine_unavailable"
    assert d.terminal(only_rid(rejected))["terminal"] == "rejected"
    assert d.started_legs() == []
    client.request("GET", "/health")
    assert client.last.status == 200  # liveness does not depend on the fleet
    d.check_invariants(final=True)


# ----------------------------------------------------------------- shutdown


def test_shutdown_lets_inflight_requests_finish_and_answers_new_ones_503() -> None:
    d = Driver()
    idle = d.connect()
    busy = d.post(COMPLETIONS, completion_body())
    leg = d.leg()
    d.shutdown()
    assert idle.closed_by_router and not busy.closed_by_router
    assert d.router.statistics().draining and not d.router.statistics().ready
    # A connection that arrives while draining is answered, not dropped unanswered.
    late = d.post(COMPLETIONS, completion_body(prompt="late"))
    assert late.last.status == 503 and error_of(late)["code"] == "shutting_down"
    assert late.closed_by_router
    assert d.terminal(only_rid(late))["terminal"] == "rejected"
    assert d.shutdown_complete == []
    d.serve(leg.bid)
    d.serve(d.leg().bid)
    assert busy.last.status == 200 and busy.last.header(b"connection") == b"close"
    assert busy.closed_by_router
    assert len(d.shutdown_complete) == 1
    kinds = [type(cmd) for _, cmd in d.commands]
    last_terminal = max(i for i, (_, cmd) in enumerate(d.commands) if type(cmd) is WriteJournal and cmd.terminal)
    assert kinds.index(ShutdownComplete) > last_terminal
    d.check_invariants(final=True)


def test_a_request_received_while_draining_gets_503_shutting_down() -> None:
    # The second request is in the router's hands (pipelined behind the first)
    # when shutdown begins: it must be answered and journaled, not dropped.
    d = Driver()
    client = d.connect()
    client.send(
        json_request(COMPLETIONS, completion_body(prompt="first"))
        + json_request(COMPLETIONS, completion_body(prompt="second")),
        requests=[SentRequest("POST", COMPLETIONS, True), SentRequest("POST", COMPLETIONS, True)],
    )
    d.shutdown()
    d.serve_until_done()
    statuses = [r.status for r in client.responses]
    assert statuses == [200, 503]
    assert error_of(client)["code"] == "shutting_down"
    assert client.last.header(b"retry-after") is not None
    assert d.terminal(only_rid(client))["terminal"] == "rejected"
    assert len(d.shutdown_complete) == 1
    d.check_invariants(final=True)


def _stream_begun_while_draining() -> tuple[Driver, Any, Any]:
    """A streamed completion whose decode leg answers (head only) after shutdown began."""
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(stream=True))
    d.answer_prefill(d.leg("prefill").bid)
    d.shutdown()
    decode = d.leg("decode")
    d.stream_head(decode.bid)
    return d, client, decode


def test_a_request_pipelined_behind_a_stream_begun_while_draining_gets_503() -> None:
    # Found by the state machine: a stream whose head went out after the
    # shutdown carried "connection: close", so a request the client pipelined
    # while the stream ran was never answered nor journaled. The head no longer
    # announces the close; the end of the stream decides, as for a stream begun
    # before the shutdown.
    d, client, decode = _stream_begun_while_draining()
    d.stream_next(decode.bid)
    stream = client.last
    assert stream.status == 200 and stream.header(b"connection") is None and not stream.complete
    client.post(COMPLETIONS, completion_body(prompt="pipelined"))
    d.stream_rest(decode.bid)
    d.serve_until_done()
    assert [r.status for r in client.responses] == [200, 503]
    assert stream.complete and stream.sse_problem() is None
    assert error_of(client)["code"] == "shutting_down"
    assert client.last.header(b"connection") == b"close" and client.closed_by_router
    assert d.terminal(client.last.rid)["terminal"] == "rejected"
    assert len(d.shutdown_complete) == 1
    d.check_invariants(final=True)


def test_a_stream_begun_while_draining_closes_its_connection_at_its_end() -> None:
    d, client, decode = _stream_begun_while_draining()
    d.stream_rest(decode.bid)
    assert client.last.complete and client.last.status == 200
    assert client.closed_by_router
    assert len(d.shutdown_complete) == 1
    d.check_invariants(final=True)


def test_grace_expiry_abandons_the_rest_with_terminal_records() -> None:
    d = Driver(shutdown={"grace_s": 15.0}, admission={"max_inflight": 3, "queue_timeout_s": 60.0})
    streaming = d.post(CHAT, chat_body(stream=True))
    d.answer_prefill(d.leg("prefill").bid)
    d.stream_next(d.leg("decode").bid)
    in_decode = d.post(COMPLETIONS, completion_body())
    d.answer_prefill(d.leg("prefill").bid)
    in_prefill = d.post(COMPLETIONS, completion_body())
    queued = d.post(COMPLETIONS, completion_body())
    rids = list(d.issued)
    d.shutdown()
    d.advance(14.9)
    assert d.terminals() == []
    d.advance(0.2)
    assert d.open_legs() == []
    for client in (in_decode, in_prefill, queued):
        assert client.last.status == 503 and error_of(client)["code"] == "shutting_down"
    stream = streaming.last
    assert stream.complete and stream.sse_problem() is None
    assert json.loads(stream.sse_data()[-1])["error"]["code"] == "shutting_down"
    # The decode request's KV is released before its record closes.
    d.complete_releases()
    for rid in rids:
        assert d.terminal(rid)["terminal"] == "failed"
    assert len(d.shutdown_complete) == 1
    d.check_invariants(final=True)


# ------------------------------------------------------- buffered memory


def test_unfinished_requests_past_max_buffered_bytes_get_503_and_the_rest_go_on() -> None:
    # Slow uploads hold their bytes in the codecs; past ingress.max_buffered_bytes
    # the connection that grows the total is refused and closed, so memory stays
    # bounded whatever the number of slow clients.
    d = Driver(ingress={"max_body_bytes": 4000, "max_buffered_bytes": 5000})
    big = json_request(COMPLETIONS, completion_body("x" * 3000))
    first, second, third = d.connect(), d.connect(), d.connect()
    first.send_incomplete(big[:-200], "POST", COMPLETIONS)
    held = d.router.statistics().buffered_bytes
    assert len(big) - 200 - 150 <= held <= len(big) - 200  # the body so far (its head is parsed out)
    second.send_incomplete(big[:2500], "POST", COMPLETIONS)  # past 5,000 in all
    assert second.last.status == 503 and not second.alive
    assert second.last.header(b"retry-after") is not None
    assert second.last.json()["error"]["code"] == "overloaded"
    record = d.terminal(second.last.rid)  # a completion request whose head was in: journalled
    assert (record["terminal"], record["status"], record["route"]) == ("rejected", 503, COMPLETIONS)
    assert d.router.statistics().buffered_bytes == held
    # Small requests still fit; the first upload completes and is served.
    third.post(COMPLETIONS, completion_body())
    first.send(big[-200:])
    d.serve_until_done()
    assert [c.last.status for c in (first, third)] == [200, 200]
    assert d.router.statistics().buffered_bytes == 0
    finish(d)


def test_a_push_mode_answer_to_an_orphaned_prefill_is_journalled_not_released() -> None:
    # docs/operate.md, "vLLM compatibility": a push answer's KV is never carried
    # by a decode request, a release included; its client left while the answer
    # arrived, so the record says where the blocks are: held until the lease.
    d = Driver()
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    answer = prefill_answer(prefill, transfer_mode="push")
    raw = http_response(200, json.dumps(answer).encode())
    d.send_leg(prefill.bid, raw[:40])
    client.leave()
    d.send_leg(prefill.bid, raw[40:])
    assert d.pending_controls("release") == []
    record = d.terminal(prefill.rid)
    assert record["terminal"] == "cancelled"
    (leg,) = record["legs"]
    assert leg["outcome"] == "bad_kv"
    kv = leg["kv"]
    assert (kv["outcome"], kv["method"], kv["owner"]) == ("held_until_lease", "lease", prefill.bid + "-0")
    assert "'push'" in kv["error"]
    d.check_invariants(final=True)
