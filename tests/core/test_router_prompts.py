"""Scenario tests: prefill answers without KV, and batch prompts (issue 21 items 2 and 3).

Driven like tests/core/test_router_scenarios.py: fake clients and engines,
raw HTTP on both sides, a manual clock, the driver's invariants at the end.
Expected values come from docs/operate.md ("Prefill answers without KV",
"Batch prompts").
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal_core.config import config_from_dict
from narwhal_core.errors import ConfigError

from .router_driver import (
    COMPLETIONS,
    MODEL,
    Driver,
    FakeClient,
    completion_body,
    decode_answer,
    http_response,
)

PROMPTS = ["The narwhal", "The beluga", "The bowhead"]


def error_of(client: FakeClient) -> dict[str, Any]:
    data = client.last.json()
    assert set(data) == {"error"}, data
    return data["error"]  # type: ignore[no-any-return]


def answer_prefill_null(d: Driver, bid: str, *, finish_reason: str = "stop", cached: int | None = 5) -> None:
    """A 200 prefill answer with ``kv_transfer_params: null`` (vLLM: the one token ended the sequence)."""
    leg = d.legs[bid]
    answer = decode_answer(leg.route, text="", completion_tokens=1, cached_tokens=cached)
    answer["choices"][0]["finish_reason"] = finish_reason
    assert answer["kv_transfer_params"] is None
    d.respond(bid, http_response(200, json.dumps(answer).encode()))


def journal_legs(d: Driver, rid: str) -> list[tuple[Any, ...]]:
    return [(leg["phase"], leg.get("prompt"), leg["outcome"]) for leg in d.terminal(rid)["legs"]]


# ---------------------------------------------------------------- null params


@pytest.mark.parametrize("stream", [False, True])
def test_null_kv_params_run_a_plain_decode_leg_never_retried(stream: bool) -> None:
    d = Driver(retry={"max_attempts": 3})
    client = d.post(COMPLETIONS, completion_body(stream=stream, min_tokens=0))
    prefill = d.leg("prefill")
    assert "min_tokens" not in prefill.body  # the client allowed an end of sequence at once
    answer_prefill_null(d, prefill.bid)
    decode = d.leg("decode")
    # The client's body as it is: no kv_transfer_params, so the engine recomputes the prompt.
    assert "kv_transfer_params" not in decode.body
    assert decode.body == {**completion_body(stream=stream, min_tokens=0), "model": MODEL}
    d.answer_decode(decode.bid, cached_tokens=11)
    d.advance(30)
    assert client.last.status == 200
    if not stream:
        # The decode engine computed the prompt itself: its cached_tokens is the true one.
        assert client.last.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 11}
    record = d.terminal(prefill.rid)
    assert record["terminal"] == "completed" and record["error"] is None
    legs = record["legs"]
    assert [(leg["phase"], leg["attempt"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, "ok"), ("decode", 1, "ok"),
    ]
    kv = legs[0]["kv"]
    assert (kv["outcome"], kv["method"], kv["owner"], kv["release_id"]) == ("none", "none", prefill.bid, None)
    assert "finish_reason stop" in kv["error"] and "recomputes the prompt" in kv["error"]
    assert legs[1]["kv"] is None
    # Nothing held, so nothing released and no warning (an end of sequence is ordinary).
    assert d.pending_controls("release") == [] and not [c for c in d.controls.values() if c.kind == "release"]
    assert not [log for log in d.logs if log.event == "prefill_without_kv"]
    d.check_invariants(final=True)


def test_null_kv_params_not_on_a_stop_warn_once_per_engine() -> None:
    d = Driver()
    engines = []
    for _ in range(4):  # two prefill engines, taken in turn: two requests each
        client = d.post(COMPLETIONS, completion_body())
        prefill = d.leg("prefill")
        engines.append(prefill.engine.url)
        answer_prefill_null(d, prefill.bid, finish_reason="length")
        d.answer_decode(d.leg("decode").bid)
        assert client.last.status == 200
    assert len(set(engines)) == 2
    warnings = [log for log in d.logs if log.event == "prefill_without_kv"]
    assert sorted(log.fields["engine"] for log in warnings) == sorted(set(engines)), warnings
    assert all(log.fields["finish_reason"] == "length" for log in warnings)
    d.check_invariants(final=True)


def test_min_tokens_becomes_one_on_the_prefill_leg() -> None:
    # With min_tokens >= 1 the prefill's one token may not end the sequence
    # (an engine refuses min_tokens above max_tokens: 1, not the client's 5).
    d = Driver()
    d.post(COMPLETIONS, completion_body(min_tokens=5, min_completion_tokens=3))
    prefill = d.leg("prefill")
    assert prefill.body["min_tokens"] == 1 and "min_completion_tokens" not in prefill.body
    assert list(prefill.body).index("min_tokens") == list(completion_body(min_tokens=5)).index("min_tokens")
    d.serve_until_done()
    decode = [leg for leg in d.legs.values() if leg.phase == "decode"][0]
    assert decode.body["min_tokens"] == 5 and decode.body["min_completion_tokens"] == 3
    d.check_invariants(final=True)


# -------------------------------------------------------------- batch prompts


def batch_legs(d: Driver) -> list[tuple[str, str]]:
    return [(leg.phase, leg.body["prompt"]) for leg in d.legs.values()]


def test_batch_non_streaming_one_pd_pair_per_prompt_merged_in_order() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(PROMPTS))  # type: ignore[arg-type]
    rid = d.leg().rid
    texts = []
    for i, prompt in enumerate(PROMPTS):
        # One prompt at a time: only its own leg is open.
        prefill = d.leg("prefill")
        assert prefill.body["prompt"] == prompt and prefill.body["max_tokens"] == 1
        d.answer_prefill(prefill.bid, cached_tokens=10 * i)
        decode = d.leg("decode")
        assert decode.body["prompt"] == prompt and decode.body["kv_transfer_params"]["remote_request_id"]
        texts.append(f"answer {i}")
        d.answer_decode(decode.bid, text=texts[-1], prompt_tokens=100 + i, completion_tokens=7 + i,
                        rid=str(i))
    assert client.last.status == 200
    answer = client.last.json()
    assert answer["id"] == "cmpl-0" and answer["object"] == "text_completion" and answer["model"] == MODEL
    assert [(c["index"], c["text"]) for c in answer["choices"]] == list(enumerate(texts))
    assert answer["usage"] == {
        "prompt_tokens": 303, "total_tokens": 303 + 24, "completion_tokens": 24,
        "prompt_tokens_details": {"cached_tokens": 0 + 10 + 20},  # the prefills' figures
    }
    assert batch_legs(d) == [(phase, p) for p in PROMPTS for phase in ("prefill", "decode")]
    record = d.terminal(rid)
    assert record["terminal"] == "completed" and record["usage"] == answer["usage"]
    assert journal_legs(d, rid) == [(phase, i, "ok") for i in range(3) for phase in ("prefill", "decode")]
    assert [leg["backend_id"] for leg in record["legs"]] == [
        f"{rid}-{p}{i}" for i in (1, 2, 3) for p in ("p", "d")
    ]
    assert all(leg["kv"]["outcome"] == "pulled" for leg in record["legs"] if leg["phase"] == "prefill")
    d.check_invariants(final=True)


def test_batch_streaming_relays_each_prompt_with_its_index_and_one_done() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(PROMPTS, stream=True,  # type: ignore[arg-type]
                                                 stream_options={"include_usage": True}))
    rid = d.leg().rid
    for prompt in PROMPTS:
        d.answer_prefill(d.leg("prefill").bid)
        decode = d.leg("decode")
        assert decode.body["prompt"] == prompt and decode.body["stream"] is True
        d.stream_rest(decode.bid)
    response = client.last
    assert response.status == 200 and response.is_sse and response.sse_problem() is None
    data = response.sse_data()
    assert data[-1] == b"[DONE]" and data.count(b"[DONE]") == 1
    events = [json.loads(p) for p in data[:-1]]
    text_events = [e for e in events if e["choices"]]
    # Every prompt's pieces, in prompt order, each with its prompt's index.
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in text_events] == [
        (i, f"w{k} ") for i in range(3) for k in range(3)
    ]
    # One usage event, last, summing the three legs (cached tokens: the prefills' 48 each).
    (usage_event,) = [e for e in events if not e["choices"]]
    assert events[-1] is usage_event
    assert usage_event["usage"] == {"prompt_tokens": 690, "total_tokens": 699, "completion_tokens": 9,
                                    "prompt_tokens_details": {"cached_tokens": 144}}
    assert len({e["id"] for e in events}) == 1
    record = d.terminal(rid)
    assert record["terminal"] == "completed" and record["usage"] == usage_event["usage"]
    assert journal_legs(d, rid) == [(phase, i, "ok") for i in range(3) for phase in ("prefill", "decode")]
    d.check_invariants(final=True)


@pytest.mark.parametrize("prompt", [[1, 2, 3], ["only one"], [[5, 6, 7]], "plain"])
def test_one_prompt_is_forwarded_as_it_is(prompt: Any) -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(prompt))
    prefill = d.leg("prefill")
    assert prefill.body["prompt"] == prompt
    d.serve_until_done()
    assert client.last.status == 200 and len(client.last.json()["choices"]) == 1
    assert all("prompt" not in leg for leg in d.terminal(prefill.rid)["legs"])
    d.check_invariants(final=True)


@pytest.mark.parametrize(("bound", "count", "words"), [(2, 3, "at most 2"), (1, 2, "batch prompts are off")])
def test_a_batch_over_the_bound_is_400_param_prompt_before_admission(bound: int, count: int, words: str) -> None:
    d = Driver(ingress={"max_batch_prompts": bound})
    client = d.post(COMPLETIONS, completion_body([[1, 2]] * count))  # type: ignore[arg-type]
    assert client.last.status == 400
    error = error_of(client)
    assert error["param"] == "prompt" and error["type"] == "invalid_request_error" and words in error["message"]
    assert d.legs == {}
    record = d.terminal(client.last.rid)  # type: ignore[arg-type]
    assert record["terminal"] == "invalid" and record["legs"] == []
    d.check_invariants(final=True)


@pytest.mark.parametrize("prompt", [[], ["a", [1, 2]], [[1], []], [["a"]], [1, "a"], [True, 2]])
def test_a_malformed_prompt_list_is_400_param_prompt(prompt: Any) -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(prompt))
    assert client.last.status == 400 and error_of(client)["param"] == "prompt"
    assert d.legs == {}
    d.check_invariants(final=True)


@pytest.mark.parametrize("bound", [0, 1025])
def test_the_bound_is_1_to_1024(bound: int) -> None:
    with pytest.raises(ConfigError, match="ingress.max_batch_prompts"):
        config_from_dict({
            "model": {"name": MODEL}, "engine": {"decode": ["http://127.0.0.1:9"]},
            "ingress": {"max_batch_prompts": bound},
        }, env={})


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_prompt_fails_the_whole_batch_and_releases_its_kv(stream: bool) -> None:
    d = Driver(retry={"max_attempts": 2})
    client = d.post(COMPLETIONS, completion_body(PROMPTS, stream=stream))  # type: ignore[arg-type]
    rid = d.leg().rid
    # Prompt 0 completes.
    d.answer_prefill(d.leg("prefill").bid)
    d.answer_decode(d.leg("decode").bid)
    # Prompt 1: prefilled, then its decode legs fail (5xx) on every attempt.
    for _ in range(2):
        d.answer_prefill(d.leg("prefill").bid)
        d.answer_status(d.leg("decode").bid, 503)
        d.complete_releases()
        d.advance(30)
    assert d.open_legs() == []
    response = client.last
    if stream:
        # Prompt 0's events went out; the stream ends with one error event, no [DONE].
        assert response.status == 200 and response.sse_problem() is None
        data = response.sse_data()
        assert b"[DONE]" not in data
        assert json.loads(data[-1])["error"]["code"] == "decode_failed"
        assert {json.loads(p)["choices"][0]["index"] for p in data[:-1] if json.loads(p).get("choices")} == {0}
    else:
        # No partial answer: the error envelope only.
        assert response.status == 502 and error_of(client)["code"] == "decode_failed"
    record = d.terminal(rid)
    assert record["terminal"] == "failed" and record["error"]["leg"] == "decode"
    assert journal_legs(d, rid) == [
        ("prefill", 0, "ok"), ("decode", 0, "ok"),
        ("prefill", 1, "ok"), ("decode", 1, "http_error"), ("prefill", 1, "ok"), ("decode", 1, "http_error"),
    ]
    # Prompt 0's KV was pulled; prompt 1's, never pulled, was given back when
    # its decode leg failed (how depends on engine.kv_release: docs/operate.md).
    kv = [leg["kv"]["outcome"] for leg in record["legs"] if leg["phase"] == "prefill"]
    assert kv[0] == "pulled" and all(k not in ("pulled", None) for k in kv[1:]), kv
    assert len([c for c in d.controls.values() if c.kind == "release"]) <= 2
    # Prompt 2 never started.
    assert all(leg.body["prompt"] != PROMPTS[2] for leg in d.legs.values())
    d.check_invariants(final=True)


def test_retries_count_per_prompt() -> None:
    # max_attempts bounds each prompt's attempts, not the batch's.
    d = Driver(retry={"max_attempts": 2})
    client = d.post(COMPLETIONS, completion_body(PROMPTS))  # type: ignore[arg-type]
    rid = d.leg().rid
    for _ in PROMPTS:
        d.answer_status(d.leg("prefill").bid, 503)
        d.advance(30)
        d.answer_prefill(d.leg("prefill").bid)
        d.answer_decode(d.leg("decode").bid)
    assert client.last.status == 200 and len(client.last.json()["choices"]) == 3
    assert journal_legs(d, rid) == [
        item for i in range(3) for item in (("prefill", i, "http_error"), ("prefill", i, "ok"), ("decode", i, "ok"))
    ]
    d.check_invariants(final=True)


def test_a_batch_whose_client_leaves_mid_way_is_cancelled_once() -> None:
    d = Driver()
    client = d.post(COMPLETIONS, completion_body(PROMPTS, stream=True))  # type: ignore[arg-type]
    rid = d.leg().rid
    d.answer_prefill(d.leg("prefill").bid)
    d.stream_rest(d.leg("decode").bid)
    d.answer_prefill(d.leg("prefill").bid)
    d.stream_next(d.leg("decode").bid)
    client.leave()
    d.complete_releases()
    d.advance(30)
    assert d.open_legs() == []
    record = d.terminal(rid)
    assert record["terminal"] == "cancelled" and record["status"] == 499
    assert [leg.get("prompt") for leg in record["legs"]] == [0, 0, 1, 1]
    d.check_invariants(final=True)


def test_a_prefill_answering_null_after_its_client_left_needs_no_release() -> None:
    # The prefill's answer was arriving when the client left: Narwhal reads it
    # to name the KV to release; a null answer names none, so nothing is sent.
    d = Driver()
    client = d.post(COMPLETIONS, completion_body())
    prefill = d.leg("prefill")
    answer = decode_answer(COMPLETIONS, text="", completion_tokens=1)
    answer["choices"][0]["finish_reason"] = "stop"
    raw = http_response(200, json.dumps(answer).encode())
    d.send_leg(prefill.bid, raw[:40])
    client.leave()
    d.send_leg(prefill.bid, raw[40:])
    d.advance(30)
    record = d.terminal(prefill.rid)
    assert record["terminal"] == "cancelled"
    assert [(leg["phase"], leg["outcome"], leg["kv"]["outcome"]) for leg in record["legs"]] == [
        ("prefill", "ok", "none"),
    ]
    assert not [c for c in d.controls.values() if c.kind == "release"]
    assert d.open_legs() == []
    d.check_invariants(final=True)


def test_a_batch_without_prefill_engines_gets_one_decode_leg_per_prompt() -> None:
    d = Driver(prefill=())
    client = d.post(COMPLETIONS, completion_body(PROMPTS[:2]))  # type: ignore[arg-type]
    rid = d.leg().rid
    for i, prompt in enumerate(PROMPTS[:2]):
        leg = d.leg("decode")
        assert leg.body["prompt"] == prompt and "kv_transfer_params" not in leg.body
        d.answer_decode(leg.bid, text=f"t{i}")
    assert [(c["index"], c["text"]) for c in client.last.json()["choices"]] == [(0, "t0"), (1, "t1")]
    assert journal_legs(d, rid) == [("decode", 0, "ok"), ("decode", 1, "ok")]
    d.check_invariants(final=True)
