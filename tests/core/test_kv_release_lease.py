"""KV releases that say only what was confirmed, and KV leases (docs/operate.md, "KV release in operation", "KV leases").

Scenario tests on the pure router with the injected clock of
:mod:`tests.core.router_driver`: each release method's request and the
journal outcome each possible answer gives; a prefilled request that waits
for a decode engine goes before new prefills; a request whose KV's lease
runs short before a decode engine has room is prefilled again (or fails
503), and no decode request -- leg, fresh-connection restart or release --
ever carries KV late in its lease (``Driver._lease_problems``, checked by
``finish`` here and by the Hypothesis state machine).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal_core.kv import HOLD_UNREAD, REAPER_STUCK
from narwhal_core.router import LEASE_SHORT
from tests.core.router_driver import (
    COMPLETIONS,
    DECODE_URLS,
    PREFILL_URLS,
    Driver,
    completion_body,
    decode_answer,
    http_response,
    prefill_answer,
)

ONE_EACH: dict[str, Any] = {"prefill": PREFILL_URLS[:1], "decode": DECODE_URLS[:1]}


def finish(d: Driver) -> None:
    d.serve_until_done()
    for control in d.pending_controls():
        d.complete_control(control.cmd.key, status=200)
    d.advance(1000)
    d.check_invariants(final=True)


def failed_decode(d: Driver, **prefill: Any) -> tuple[str, dict[str, Any]]:
    """A request whose decode leg fails with 500 before the handoff (retries off): its rid and KV params."""
    d.post(COMPLETIONS, completion_body())
    leg = d.leg("prefill")
    kv = d.answer_prefill(leg.bid, **prefill)
    d.answer_status(d.leg("decode").bid, 500)
    return leg.rid, kv


def first_kv(d: Driver, rid: str) -> dict[str, Any]:
    kv = d.terminal(rid)["legs"][0]["kv"]
    assert kv is not None
    return kv  # type: ignore[no-any-return]


# ------------------------------------------------------------- decode_pull


def test_decode_pull_is_the_default_and_a_whole_one_token_decode_request() -> None:
    d = Driver(retry={"max_attempts": 1})
    assert d.config.engine.kv_release == "decode_pull"
    body = completion_body(stream=True, stream_options={"include_usage": True}, min_tokens=8,
                           logprobs=5, echo=True, n=1)
    d.post(COMPLETIONS, body)
    prefill = d.leg("prefill")
    kv = d.answer_prefill(prefill.bid)
    d.answer_status(d.leg("decode").bid, 500)
    (release,) = d.pending_controls("release")
    cmd = release.cmd
    assert not cmd.drop_after_send and cmd.engine.url in DECODE_URLS
    assert (cmd.method, cmd.target) == ("POST", COMPLETIONS)
    headers = dict(cmd.headers)
    assert headers[b"x-request-id"] == f"{prefill.rid}-d2".encode()  # the next decode attempt number
    sent = json.loads(cmd.body)
    # The prompt and sampling as the client sent them; one token, whole, the KV verbatim;
    # nothing that would lengthen the answer or be refused with max_tokens 1.
    assert sent == {
        "model": body["model"], "prompt": body["prompt"], "max_tokens": 1, "temperature": 0.7,
        "stream": False, "kv_transfer_params": kv,
    }
    d.complete_control(cmd.key, status=200, body=d.release_answer(release))
    record = d.terminal(prefill.rid)
    assert record["legs"][0]["kv"] == {
        "outcome": "released", "owner": kv["remote_request_id"], "engine": prefill.engine.url,
        "method": "decode_pull", "error": None, "release_id": f"{prefill.rid}-d2",
    }
    finish(d)


@pytest.mark.parametrize(
    ("status", "error", "body", "outcome", "why"),
    [
        (200, None, "answer", "released", None),
        (500, None, b'{"error": {"message": "boom"}}', "release_sent", "the decode engine answered 500"),
        (400, None, b'{"error": {"message": "bad"}}', "release_sent", "the decode engine answered 400"),
        (200, None, b"", "release_sent", "the decode engine's answer was empty"),
        (200, None, "abort", "release_sent", "the decode engine finished the release with 'abort'"),
        (200, None, b'{"error": {"message": "x"}}', "release_sent", "the decode engine answered an error"),
        (None, "timeout", b"", "release_sent", "timeout"),
        (None, "connection reset", b"", "release_sent", "connection reset"),
        (None, "connection refused", b"", "held_until_lease", "connection refused"),
        (None, "connect timeout", b"", "held_until_lease", "connect timeout"),
        (None, "DNS failure: Name or service not known", b"", "held_until_lease",
         "DNS failure: Name or service not known"),
    ],
    ids=["2xx", "500", "400", "empty", "aborted", "error-object", "timeout", "reset", "refused",
         "connect-timeout", "dns"],
)
def test_decode_pull_journals_released_only_when_the_answer_confirms_it(
    status: int | None, error: str | None, body: Any, outcome: str, why: str | None,
) -> None:
    d = Driver(retry={"max_attempts": 1})
    rid, _ = failed_decode(d)
    (release,) = d.pending_controls("release")
    if body == "answer":
        body = d.release_answer(release)
    elif body == "abort":
        answer = decode_answer(COMPLETIONS, completion_tokens=0)
        answer["choices"][0]["finish_reason"] = "abort"
        body = json.dumps(answer).encode()
    d.complete_control(release.cmd.key, status=status, error=error, body=body)
    kv = first_kv(d, rid)
    assert (kv["outcome"], kv["method"], kv["error"]) == (outcome, "decode_pull", why)
    finish(d)


def test_decode_pull_for_params_without_remote_request_id_reuses_the_prefill_legs_id() -> None:
    # vLLM's NIXL connector before version 2: the decode engine names the KV to
    # the prefill engine by its own request ID, so the release must be sent with
    # the prefill leg's X-Request-Id (docs/operate.md, "vLLM compatibility").
    d = Driver(retry={"max_attempts": 1})
    d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    answer = prefill_answer(prefill, remote_block_ids=[1, 2, 3, 4])  # version 1: flat block IDs...
    del answer["kv_transfer_params"]["remote_request_id"]  # ...and no remote_request_id
    d.respond(prefill.bid, http_response(200, json.dumps(answer).encode()))
    d.answer_status(d.leg("decode").bid, 500)
    (release,) = d.pending_controls("release")
    assert dict(release.cmd.headers)[b"x-request-id"] == prefill.bid.encode()
    d.complete_releases()
    kv_record = first_kv(d, prefill.rid)
    assert (kv_record["outcome"], kv_record["release_id"]) == ("released", prefill.bid)
    finish(d)


def test_decode_pull_with_no_healthy_decode_engine_is_held_until_lease() -> None:
    d = Driver(**ONE_EACH, retry={"max_attempts": 1}, health={"unhealthy_after": 1})
    rid, _ = failed_decode(d)  # the only decode engine fails: out of rotation
    assert d.pending_controls("release") == []
    kv = first_kv(d, rid)
    assert (kv["outcome"], kv["method"], kv["error"]) == ("held_until_lease", "decode_pull", "no healthy decode engine")
    finish(d)


# ------------------------------------------------------ the other methods


@pytest.mark.parametrize(
    ("status", "error", "body", "outcome", "why"),
    [
        (200, None, b'{"request_id": "x", "released": true, "num_blocks": 15}', "released", None),
        (200, None, b"", "release_sent", "the engine took the abort and did not say whether it freed anything"),
        (404, None, b'{"detail": "Not Found"}', "held_until_lease",
         'release answered 404: the engine has no /abort_request (vLLM has none: use kv_release = "decode_pull")'),
        (500, None, b"", "held_until_lease", "release answered 500"),
        (None, "connection refused", b"", "held_until_lease", "connection refused"),
        (None, "timeout", b"", "release_sent", "timeout"),
    ],
    ids=["simulator-confirms", "sglang-200", "vllm-404", "500", "refused", "timeout"],
)
def test_abort_endpoint_journals_what_the_answer_confirms(
    status: int | None, error: str | None, body: bytes, outcome: str, why: str | None,
) -> None:
    d = Driver(engine={"kv_release": "abort_endpoint"}, retry={"max_attempts": 1})
    rid, kv_params = failed_decode(d)
    (release,) = d.pending_controls("release")
    assert json.loads(release.cmd.body) == {"rid": kv_params["remote_request_id"],
                                            "request_id": kv_params["remote_request_id"]}
    d.complete_control(release.cmd.key, status=status, error=error, body=body)
    kv = first_kv(d, rid)
    assert (kv["outcome"], kv["method"], kv["error"]) == (outcome, "abort_endpoint", why)
    finish(d)


@pytest.mark.parametrize(
    ("error", "outcome"), [(None, "release_sent"), ("connection refused", "held_until_lease")],
    ids=["written", "refused"],
)
def test_decode_abort_never_claims_released(error: str | None, outcome: str) -> None:
    d = Driver(engine={"kv_release": "decode_abort"}, retry={"max_attempts": 1})
    rid, _ = failed_decode(d)
    (release,) = d.pending_controls("release")
    assert release.cmd.drop_after_send
    d.complete_control(release.cmd.key, status=None, error=error)
    kv = first_kv(d, rid)
    assert (kv["outcome"], kv["method"], kv["error"]) == (outcome, "decode_abort", error)
    finish(d)


@pytest.mark.parametrize("lease_era", [True, False], ids=["lease-era-answer", "older-answer"])
def test_lease_release_says_when_the_engines_reaper_may_keep_the_kv(lease_era: bool) -> None:
    """vLLM issue 58222: a lease-era reaper stops at the first unexpired entry; the record says so for such answers."""
    d = Driver(engine={"kv_release": "lease"}, retry={"max_attempts": 1}, **ONE_EACH)
    era = {"dcp_size": 1, "pp_size": 1, "remote_num_tokens": 230, "remote_blocks_expiry_time": None,
           "transfer_mode": "pull"} if lease_era else {}  # fmt: skip
    rid, _ = failed_decode(d, **era)
    finish(d)
    kv = first_kv(d, rid)
    assert (kv["outcome"], kv["method"]) == ("held_until_lease", "lease")
    assert kv["error"] == (REAPER_STUCK if lease_era else None)


def test_shutdown_before_a_release_is_confirmed_says_release_sent() -> None:
    d = Driver(retry={"max_attempts": 1}, shutdown={"grace_s": 2.0})
    rid, _ = failed_decode(d)
    assert len(d.pending_controls("release")) == 1
    d.shutdown()
    d.advance(2.5)
    kv = first_kv(d, rid)
    assert (kv["outcome"], kv["method"], kv["error"]) == (
        "release_sent", "decode_pull", "shutdown before the release was confirmed",
    )


# ------------------------------------------------------------------ leases


def busy_decode(d: Driver) -> str:
    """A request that takes the only decode slot; its decode leg's ID."""
    d.post(COMPLETIONS, completion_body(prompt="holder"))
    d.answer_prefill(d.leg("prefill").bid)
    return d.leg("decode").bid


def test_a_prefilled_request_waiting_for_decode_goes_before_new_prefills() -> None:
    d = Driver(**ONE_EACH, engine={"max_inflight_per_engine": 1})
    holder = busy_decode(d)
    waiter = d.post(COMPLETIONS, completion_body(prompt="waiter"))
    d.answer_prefill(d.leg("prefill").bid)  # prefilled at t=0: waits for the decode slot
    newcomer = d.post(COMPLETIONS, completion_body(prompt="newcomer"))
    # The prefill engine is idle, but a new prefill would only make more KV
    # that waits (its lease running): it waits behind the prefilled request.
    assert [leg.bid for leg in d.open_legs()] == [holder]
    assert d.router.statistics().inflight == 3
    d.advance(5)
    assert [leg.bid for leg in d.open_legs()] == [holder]
    d.answer_decode(holder)
    # The decode slot goes to the waiter; then, no prefilled request waiting, the newcomer's prefill starts.
    started = [leg.phase + ":" + leg.rid for leg in d.open_legs()]
    assert started == [f"decode:{d.issued[1]}", f"prefill:{d.issued[2]}"]
    finish(d)
    assert waiter.last.status == 200 and newcomer.last.status == 200


def test_kv_whose_lease_runs_short_before_a_decode_slot_frees_is_prefilled_again() -> None:
    d = Driver(**ONE_EACH, engine={"max_inflight_per_engine": 1, "kv_lease_s": 30.0})
    holder = busy_decode(d)
    client = d.post(COMPLETIONS, completion_body(prompt="waiter"))
    first = d.leg("prefill")
    first_kv_params = d.answer_prefill(first.bid)
    rid = first.rid
    d.advance(19.999)
    assert d.open_legs() == [d.legs[holder]]  # still waiting, a third of the lease left
    d.advance(0.002)
    # At two thirds of the lease: no decode leg may carry that KV any more. Prefilled again.
    again = d.leg("prefill")
    assert again.bid == f"{rid}-p2"
    (log,) = [log for log in d.logs if log.event == "kv_lease_short"]
    assert log.fields["rid"] == rid and log.fields["then"] == "prefill again"
    d.answer_prefill(again.bid)
    d.answer_decode(holder)
    decode = d.leg("decode", rid=rid)
    assert decode.body["kv_transfer_params"]["remote_request_id"] == f"{rid}-p2-0"
    d.answer_decode(decode.bid)
    assert client.last.status == 200
    legs = d.terminal(rid)["legs"]
    assert [(leg["phase"], leg["attempt"]) for leg in legs] == [("prefill", 1), ("prefill", 2), ("decode", 1)]
    assert legs[0]["kv"] == {
        "outcome": "held_until_lease", "owner": first_kv_params["remote_request_id"],
        "engine": first.engine.url, "method": "lease", "error": LEASE_SHORT + ": no decode engine had room in time",
        "release_id": None,
    }
    assert legs[1]["kv"]["outcome"] == "pulled"
    assert d.pending_controls("release") == []  # nothing carried the stale KV
    finish(d)


def test_kv_whose_lease_runs_short_with_no_attempt_left_fails_503() -> None:
    d = Driver(**ONE_EACH, engine={"max_inflight_per_engine": 1, "kv_lease_s": 9.0}, retry={"max_attempts": 1})
    holder = busy_decode(d)
    client = d.post(COMPLETIONS, completion_body(prompt="waiter"))
    d.answer_prefill(d.leg("prefill").bid)
    d.advance(6.001)
    response = client.last
    assert response.status == 503
    assert response.header(b"retry-after") == b"1"
    assert response.json()["error"]["code"] == "kv_lease_expired"
    record = d.terminal(d.issued[1])
    assert (record["terminal"], record["status"]) == ("failed", 503)
    assert record["legs"][0]["kv"]["outcome"] == "held_until_lease"
    d.answer_decode(holder)
    finish(d)


def test_under_abort_endpoint_kv_whose_lease_runs_short_is_still_aborted_on_its_prefill_engine() -> None:
    d = Driver(**ONE_EACH, engine={"max_inflight_per_engine": 1, "kv_release": "abort_endpoint"})
    holder = busy_decode(d)
    d.post(COMPLETIONS, completion_body(prompt="waiter"))
    first = d.leg("prefill")
    d.answer_prefill(first.bid)
    d.advance(20.001)
    (release,) = d.pending_controls("release")
    assert release.cmd.engine == first.engine  # the prefill engine frees it, no decode request involved
    d.complete_releases()
    d.answer_decode(holder)
    finish(d)
    assert first_kv(d, first.rid)["outcome"] == "released"


def test_a_decode_leg_failing_late_in_the_lease_sends_no_decode_release() -> None:
    d = Driver(retry={"max_attempts": 1}, engine={"decode_timeout_s": 100.0})
    d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode")
    d.advance(25)  # the decode engine has taken the request (it renews the lease on vLLM)...
    d.answer_status(decode.bid, 500)  # ...and fails it late in the lease
    assert d.pending_controls("release") == []
    kv = first_kv(d, prefill.rid)
    assert (kv["outcome"], kv["method"], kv["error"]) == ("held_until_lease", "lease", LEASE_SHORT)
    finish(d)


def test_a_stale_pooled_connection_late_in_the_lease_is_not_retried_with_that_kv() -> None:
    d = Driver(retry={"max_attempts": 2, "backoff_base_s": 0.5})
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    d.answer_prefill(prefill.bid)
    decode = d.leg("decode")
    d.advance(21)
    d.fail_leg(decode.bid, "dropped", reused=True)
    # Not re-sent on a fresh connection with KV two thirds into its lease: prefilled again instead.
    assert [leg for leg in d.started_legs(prefill.rid) if leg.bid == decode.bid] == [decode]
    d.advance(5)
    assert d.leg("prefill").bid == f"{prefill.rid}-p2"
    finish(d)
    assert client.last.status == 200


# ------------------------------------------------- holds nothing renews

#: Keys of a prefill answer from vLLM with KV leases (docs/simulator.md, "vLLM versions").
LEASE_ERA = {"transfer_mode": "pull", "remote_blocks_expiry_time": None}


def unread_decode(d: Driver, *, stream: bool = False, **prefill: Any) -> tuple[Any, str, str]:
    """A request whose decode leg the engine has not answered yet (it may queue it): client, rid, decode leg."""
    client = d.post(COMPLETIONS, completion_body(stream=stream))
    leg = d.leg("prefill")
    d.answer_prefill(leg.bid, **prefill)
    return client, leg.rid, d.leg("decode").bid


@pytest.mark.parametrize("stream", [False, True])
def test_a_decode_leg_that_has_not_read_unrenewed_kv_as_its_hold_ends_is_cancelled_and_prefilled_again(
    stream: bool,
) -> None:
    # Before vLLM's KV leases nothing renews the prefill's hold while the decode
    # engine queues the request: a read after it finds freed blocks and answers
    # normally (vLLM issue 21570). At 95 % of kv_lease_s (28.5 s of 30) the leg
    # that shows no token yet is cancelled, which aborts it on the engine.
    d = Driver(**ONE_EACH, engine={"decode_timeout_s": 100.0})
    _, rid, decode = unread_decode(d, stream=stream)
    if stream:
        d.stream_head(decode)  # vLLM sends a stream's head before the request reaches its engine
    d.advance(28.499)
    assert d.legs[decode].open and [leg.phase for leg in d.open_legs()] == ["decode"]
    d.advance(0.002)
    assert d.legs[decode].state == "cancelled"
    again = d.leg("prefill")
    assert again.bid == f"{rid}-p2"
    (log,) = [log for log in d.logs if log.event == "kv_lease_short"]
    assert (log.fields["waited"], log.fields["then"]) == ("decode_engine", "prefill again")
    d.answer_prefill(again.bid)
    d.answer_decode(d.leg("decode", rid=rid).bid)
    legs = d.terminal(rid)["legs"]
    assert [(leg["phase"], leg["attempt"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, "ok"), ("decode", 1, "cancelled"), ("prefill", 2, "ok"), ("decode", 2, "ok"),
    ]
    assert (legs[0]["kv"]["outcome"], legs[0]["kv"]["error"]) == ("held_until_lease", LEASE_SHORT + HOLD_UNREAD)
    assert legs[2]["kv"]["outcome"] == "pulled"
    assert d.terminal(rid)["terminal"] == "completed"
    finish(d)


def test_a_streamed_decode_leg_that_sent_a_token_has_read_the_kv_and_runs_on() -> None:
    d = Driver(**ONE_EACH, engine={"decode_timeout_s": 100.0})
    _, rid, decode = unread_decode(d, stream=True)
    d.stream_next(decode)
    d.stream_next(decode)  # the head and a first token: the engine read the KV
    d.advance(40)
    assert d.legs[decode].open
    d.answer_decode(decode)
    assert [leg["outcome"] for leg in d.terminal(rid)["legs"]] == ["ok", "ok"]
    finish(d)


@pytest.mark.parametrize(
    ("keys", "cut"), [(LEASE_ERA, False), ({**LEASE_ERA, "tp_size": None}, True)], ids=["renewed", "no-tp_size"],
)
def test_kv_a_lease_era_decode_engine_renews_is_not_watched(keys: dict[str, Any], cut: bool) -> None:
    # vLLM with KV leases renews the hold by its heartbeat while the decode
    # request waits, when the params carry tp_size (docs/operate.md, "KV leases").
    d = Driver(**ONE_EACH, engine={"decode_timeout_s": 100.0})
    _, rid, decode = unread_decode(d, **keys)
    d.advance(40)
    assert (d.legs[decode].state == "cancelled") is cut
    if cut:
        d.answer_prefill(d.leg("prefill").bid, **keys)
        decode = d.leg("decode", rid=rid).bid
    d.answer_decode(decode)
    assert d.terminal(rid)["terminal"] == "completed"
    finish(d)


def test_an_unread_decode_leg_with_no_attempt_left_fails_503() -> None:
    d = Driver(**ONE_EACH, engine={"decode_timeout_s": 100.0, "kv_lease_s": 10.0}, retry={"max_attempts": 1})
    client, rid, decode = unread_decode(d)
    d.advance(9.501)
    assert d.legs[decode].state == "cancelled"
    response = client.last
    assert response.status == 503 and response.json()["error"]["code"] == "kv_lease_expired"
    assert "read" in response.json()["error"]["message"]
    record = d.terminal(rid)
    assert (record["terminal"], record["status"]) == ("failed", 503)
    assert record["legs"][0]["kv"]["error"] == LEASE_SHORT + HOLD_UNREAD
    finish(d)
