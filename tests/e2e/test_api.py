"""docs/contract.md, "Request rules" and "Responses and errors", end to end: both completion routes, whole and
streamed, and the other routes.

Router and simulated engines on real loopback sockets. The answers are
checked for their OpenAI shapes, SSE framing and usage (``cached_tokens``
from the prefill leg), every response for its ``x-request-id``, and the
journal for what each request left.
"""

from __future__ import annotations

import re

import httpx
import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet
from ..helpers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    assert_envelope,
    completion_records,
    each_route,
    journal_terminal,
    poll,
    read_journal,
    rid_of,
)
from .support import BASE_BODY, http, sse_chunks, streamed_text


#: A prompt of several full 16-token blocks, so a second request hits the prefill engine's prefix cache.
LONG_PROMPT = "Narwhals are medium-sized toothed whales that live all year in the Arctic. " * 6


def _body(route: str, text: str, **fields: object) -> dict[str, object]:
    if route == COMPLETIONS:
        return {"model": MODEL, "prompt": text, **fields}
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **fields}


def _answer_text(route: str, answer: dict) -> str:
    choice = answer["choices"][0]
    return choice["text"] if route == COMPLETIONS else choice["message"]["content"]


# ------------------------------------------------------------------ whole answers


@each_route
def test_whole_answer_through_both_legs(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    answer = http.post(router.url + route, json=_body(route, "Hello there", max_tokens=5), timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("application/json")
    body = answer.json()
    assert body["object"] == ("text_completion" if route == COMPLETIONS else "chat.completion")
    assert body["model"] == MODEL
    assert "kv_transfer_params" not in body
    assert all("kv_transfer_params" not in c for c in body["choices"])
    if route == CHAT:
        message = body["choices"][0]["message"]
        assert message["role"] == "assistant" and isinstance(message["content"], str) and message["content"]
    else:
        assert isinstance(body["choices"][0]["text"], str) and body["choices"][0]["text"]
    assert body["usage"]["completion_tokens"] == 5
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed" and record["status"] == 200 and record["error"] is None
    assert record["mode"] == "pd" and record["route"] == route and record["stream"] is False
    assert [leg["phase"] for leg in record["legs"]] == ["prefill", "decode"]
    assert record["usage"] == body["usage"]
    # One prefill and one decode request reached the engines.
    assert [r["path"] for r in completion_records(fleet.prefill)] == [route]
    assert [r["path"] for r in completion_records(fleet.decode)] == [route]


@each_route
def test_whole_answer_with_alias_and_without_model(start_router, fleet, route) -> None:
    """``model`` in responses is the configured public name, whatever name (or none) the client used."""
    router = start_router()
    for model in ("llama-3.1-8b", None):
        body = _body(route, "Hello", max_tokens=2)
        if model is None:
            del body["model"]
        else:
            body["model"] = model
        answer = http.post(router.url + route, json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == MODEL


@each_route
def test_usage_cached_tokens_come_from_the_prefill_leg(start_router, fleet, journal_path, route) -> None:
    """docs/contract.md, "Responses and errors": the decode engine counts the transferred KV as cached; the
    client sees the prefill's figure."""
    router = start_router()
    prefill = fleet.prefill[0]
    figures = []
    for _ in range(2):  # the second time the prefill engine's prefix cache hits
        before = prefill.stats()["cached_tokens"]
        answer = http.post(router.url + route, json=_body(route, LONG_PROMPT, max_tokens=3), timeout=10)
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        cached_by_prefill = prefill.stats()["cached_tokens"] - before
        assert usage["prompt_tokens_details"]["cached_tokens"] == cached_by_prefill, usage
        # The decode engine reported every prompt token as cached; that figure must not leak.
        assert usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
        assert journal_terminal(journal_path, rid_of(answer))["usage"] == usage
        figures.append(cached_by_prefill)
    assert figures[0] == 0 and figures[1] > 0, figures


# ----------------------------------------------------------------------- streams


@each_route
def test_stream_is_sse_relayed_from_the_decode_leg(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    with httpx.Client(timeout=10, verify=False) as client:
        whole = client.post(router.url + route, json=_body(route, "Stream me", max_tokens=6))
        streamed = client.post(router.url + route, json=_body(route, "Stream me", max_tokens=6, stream=True))
    chunks = sse_chunks(streamed)
    assert streamed.headers.get("cache-control") == "no-cache"
    expected_object = "text_completion" if route == COMPLETIONS else "chat.completion.chunk"
    assert all(c["object"] == expected_object for c in chunks), chunks
    assert all(c["model"] == MODEL for c in chunks)
    assert all("kv_transfer_params" not in c for c in chunks)
    assert not any("usage" in c and c["usage"] for c in chunks), "usage without stream_options.include_usage"
    # The same deterministic text as the whole answer, and the last chunk says why it ended.
    assert streamed_text(chunks, chat=route == CHAT) == _answer_text(route, whole.json())
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    rid = rid_of(streamed)
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed" and record["stream"] is True and record["status"] == 200
    assert record["ttft_ms"] is not None
    # The prefill leg is never streamed; the decode leg keeps the client's stream setting.
    prefill_body = completion_records(fleet.prefill)[-1]["body"]
    decode_body = completion_records(fleet.decode)[-1]["body"]
    assert '"stream":false' in prefill_body.replace(" ", "")
    assert '"stream":true' in decode_body.replace(" ", "")


@each_route
def test_stream_usage_chunk_takes_cached_tokens_from_prefill(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    prefill = fleet.prefill[0]
    body = _body(route, LONG_PROMPT, max_tokens=4, stream=True, stream_options={"include_usage": True})
    figures = []
    for _ in range(2):
        before = prefill.stats()["cached_tokens"]
        answer = http.post(router.url + route, json=body, timeout=10)
        chunks = sse_chunks(answer)
        usage_chunks = [c for c in chunks if c.get("usage")]
        assert len(usage_chunks) == 1, chunks
        assert usage_chunks[0]["choices"] == []
        assert chunks[-1] is usage_chunks[0], "the usage chunk comes last, before [DONE]"
        usage = usage_chunks[0]["usage"]
        assert usage["completion_tokens"] == 4
        cached = prefill.stats()["cached_tokens"] - before
        assert usage["prompt_tokens_details"]["cached_tokens"] == cached, usage
        assert cached < usage["prompt_tokens"]
        assert journal_terminal(journal_path, rid_of(answer))["usage"] == usage
        figures.append(cached)
    assert figures[0] == 0 and figures[1] > 0


def test_stream_is_relayed_as_it_arrives(start_router, fleet, journal_path) -> None:
    """SSE events reach the client while the decode engine is still generating (no buffering)."""
    with SimThread(role="decode", speed=1) as slow_decode:
        router = start_router(fleet_=Fleet(prefill=fleet.prefill, decode=[slow_decode]))
        body = _body(CHAT, "Slowly now", max_tokens=120, stream=True)  # ~0.85 s of decoding
        with httpx.Client(timeout=30, verify=False) as client, client.stream("POST", router.url + CHAT,
                                                                            json=body) as answer:
            assert answer.status_code == 200
            assert answer.headers["content-type"].startswith("text/event-stream")
            lines = answer.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            running = slow_decode.stats()["running"]
            rest = [line for line in lines if line.startswith("data: ")]
        assert first != "data: [DONE]"
        assert running == 1, "the first event arrived only after the decode engine had finished"
        assert rest[-1] == "data: [DONE]" and len(rest) >= 120
        assert journal_terminal(journal_path, answer.headers["x-request-id"])["terminal"] == "completed"


# ----------------------------------------------------------- chat content: null


def test_tool_call_only_message_has_null_content(start_router, fleet) -> None:
    router = start_router()
    body = {
        "messages": [{"role": "user", "content": "Weather in Qaanaaq?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
        "max_tokens": 4,
    }
    answer = http.post(router.url + CHAT, json=body, timeout=10)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    assert choice["message"]["tool_calls"], choice
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert "content" in choice["message"] and choice["message"]["content"] is None, choice


def test_reasoning_only_message_has_null_content(start_router, fleet) -> None:
    router = start_router()
    for engine in fleet.all():
        engine.set_faults(reasoning_only=True)
    answer = http.post(router.url + CHAT, json={**BASE_BODY[CHAT], "max_tokens": 4}, timeout=10)
    assert answer.status_code == 200, answer.text
    message = answer.json()["choices"][0]["message"]
    assert message.get("reasoning_content"), message
    assert "content" in message and message["content"] is None, message


def test_text_message_keeps_its_content(start_router, fleet) -> None:
    router = start_router()
    answer = http.post(router.url + CHAT, json={**BASE_BODY[CHAT], "max_tokens": 4}, timeout=10)
    message = answer.json()["choices"][0]["message"]
    assert isinstance(message["content"], str) and message["content"]


# ------------------------------------------------------------------- other routes


def test_models_lists_the_model_and_its_aliases(start_router) -> None:
    router = start_router()
    answer = http.get(router.url + "/v1/models", timeout=10)
    assert answer.status_code == 200
    rid_of(answer)
    body = answer.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == [MODEL, "llama-3.1-8b"]
    assert all(m["object"] == "model" for m in body["data"])


def test_health_is_200_while_serving(start_router) -> None:
    router = start_router()
    answer = http.get(router.url + "/health", timeout=10)
    assert answer.status_code == 200
    rid_of(answer)


def test_ready_follows_engine_health(start_router, fleet, journal_path) -> None:
    """``/ready`` is 200 with healthy engines, 503 when every engine of one phase is down, 200 again after."""
    router = start_router(health={"probe_interval_s": 0.05, "unhealthy_after": 2, "healthy_after": 1})
    url = router.url + "/ready"
    assert http.get(url, timeout=10).status_code == 200
    for phase, engines in (("prefill", fleet.prefill), ("decode", fleet.decode)):
        for engine in engines:
            engine.set_faults(unhealthy=True)
        down = poll(lambda: (a := http.get(url, timeout=10)).status_code == 503 and a, timeout=10,
                    what=f"/ready 503 with the {phase} engines down")
        rid_of(down)
        assert any(phase in p for p in down.json()["problems"]), down.json()
        # A completion now gets 503 in the envelope (journal: rejected), and no engine sees it.
        before = completion_records(fleet)
        refused = http.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS], timeout=10)
        assert_envelope(refused, 503, type="server_error", code="engine_unavailable")
        assert journal_terminal(journal_path, rid_of(refused))["terminal"] == "rejected"
        assert completion_records(fleet) == before
        for engine in engines:
            engine.set_faults(unhealthy=False)
        poll(lambda: http.get(url, timeout=10).status_code == 200, timeout=10, what="/ready 200 again")


def test_metrics_is_prometheus_text(start_router) -> None:
    router = start_router()
    assert http.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS], timeout=10).status_code == 200
    assert http.post(router.url + COMPLETIONS, content=b"{", timeout=10).status_code == 400
    router.wait_idle()
    answer = http.get(router.url + "/metrics", timeout=10)
    assert answer.status_code == 200
    rid_of(answer)
    assert answer.headers["content-type"].startswith("text/plain")
    text = answer.text
    assert "# TYPE narwhal_requests_total counter" in text
    samples = [line for line in text.splitlines() if line.startswith("narwhal_requests_total{")]
    assert any('terminal="completed"' in s and re.search(r" 1(\.0)?$", s) for s in samples), samples
    assert any('terminal="invalid"' in s for s in samples), samples
    # The labelled counters: one of each family's samples per label tuple, with its count.
    counters = {line.rpartition(" ")[0]: float(line.rpartition(" ")[2]) for line in text.splitlines()
                if line.startswith(("narwhal_legs_total{", "narwhal_kv_outcomes_total{", "narwhal_journal_records_total{"))}
    assert counters == {
        'narwhal_legs_total{outcome="ok",phase="prefill"}': 1.0,
        'narwhal_legs_total{outcome="ok",phase="decode"}': 1.0,
        'narwhal_kv_outcomes_total{method="decode",outcome="pulled"}': 1.0,
        'narwhal_journal_records_total{kind="progress"}': 1.0,
        'narwhal_journal_records_total{kind="terminal"}': 2.0,
    }, counters
    for line in text.splitlines():  # every line is a comment or "name{labels} value"
        assert not line or line.startswith("#") or re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*(\{.*\})? \S+", line), line


@pytest.mark.parametrize("path", ["/", "/v1/embeddings", "/v1/completions/extra", "/v2/completions", "/healthz"])
def test_unknown_path_is_404_in_the_envelope(start_router, fleet, path) -> None:
    router = start_router()
    for method in ("GET", "POST"):
        answer = http.request(method, router.url + path, json=BASE_BODY[COMPLETIONS], timeout=10)
        assert_envelope(answer, 404, type="invalid_request_error")
        rid_of(answer)
    assert completion_records(fleet) == []


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", COMPLETIONS), ("PUT", CHAT), ("DELETE", COMPLETIONS), ("POST", "/v1/models"), ("POST", "/health"),
     ("PUT", "/ready"), ("DELETE", "/metrics")],
)
def test_wrong_method_is_405_in_the_envelope(start_router, fleet, method, path) -> None:
    router = start_router()
    answer = http.request(method, router.url + path, timeout=10)
    assert_envelope(answer, 405, type="invalid_request_error")
    rid_of(answer)
    assert completion_records(fleet) == []


def test_every_response_carries_a_distinct_request_id(start_router, journal_path, api_keys) -> None:
    """docs/contract.md, "Request rules": ``x-request-id`` on every response; for completion requests it is
    the journal's rid."""
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(api_keys.path)})
    auth = {"authorization": "Bearer " + api_keys.keys["team-a"]}
    with httpx.Client(timeout=10, verify=False) as client:
        journaled = {
            "success": client.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS], headers=auth),
            "stream": client.post(router.url + CHAT, json={**BASE_BODY[CHAT], "stream": True}, headers=auth),
            "400": client.post(router.url + COMPLETIONS, json={"prompt": "x", "n": 2}, headers=auth),
            "404-model": client.post(router.url + CHAT, json={**BASE_BODY[CHAT], "model": "x"}, headers=auth),
            "401": client.post(router.url + COMPLETIONS, json=BASE_BODY[COMPLETIONS]),
        }
        others = {
            "404-path": client.get(router.url + "/nope", headers=auth),
            "405": client.get(router.url + COMPLETIONS, headers=auth),
            "health": client.get(router.url + "/health"),
            "ready": client.get(router.url + "/ready"),
            "metrics": client.get(router.url + "/metrics"),
            "models": client.get(router.url + "/v1/models", headers=auth),
        }
    expected = {"success": (200, "completed"), "stream": (200, "completed"), "400": (400, "invalid"),
                "404-model": (404, "invalid"), "401": (401, "denied")}
    rids = []
    for name, answer in journaled.items():
        status, terminal = expected[name]
        assert answer.status_code == status, (name, answer.text)
        rid = rid_of(answer)
        record = journal_terminal(journal_path, rid)
        assert record["rid"] == rid and record["terminal"] == terminal, (name, record)
        rids.append(rid)
    statuses = {"404-path": 404, "405": 405, "health": 200, "ready": 200, "metrics": 200, "models": 200}
    for name, answer in others.items():
        assert answer.status_code == statuses[name], (name, answer.status_code, answer.text)
        rids.append(rid_of(answer))
    assert len(set(rids)) == len(rids), rids


# --------------------------------------------------------------------- single leg


def test_single_leg_mode_without_prefill_engines(start_router, journal_path) -> None:
    """docs/contract.md, "Prefill and decode legs": no prefill engines: the decode pool serves whole requests,
    one leg, ``mode: "single"``."""
    with SimThread(role="decode", speed=0) as decode:
        router = start_router(fleet_=Fleet(prefill=[], decode=[decode]))
        assert http.get(router.url + "/ready", timeout=10).status_code == 200
        whole = http.post(router.url + COMPLETIONS, json={"prompt": "Solo", "max_tokens": 3}, timeout=10)
        assert whole.status_code == 200, whole.text
        assert whole.json()["object"] == "text_completion" and whole.json()["choices"][0]["text"]
        stream = http.post(router.url + CHAT, json={**BASE_BODY[CHAT], "stream": True, "max_tokens": 3}, timeout=10)
        assert sse_chunks(stream)
        for answer, route in ((whole, COMPLETIONS), (stream, CHAT)):
            rid = rid_of(answer)
            record = journal_terminal(journal_path, rid)
            assert record["mode"] == "single" and record["terminal"] == "completed", record
            assert [leg["phase"] for leg in record["legs"]] == ["decode"], record["legs"]
            assert record["legs"][0]["kv"] is None
            received = [r for r in completion_records([decode]) if r["request_id"] == record["legs"][0]["backend_id"]]
            assert len(received) == 1 and received[0]["path"] == route
            assert "kv_transfer_params" not in received[0]["body"]
        progress = [r for r in read_journal(journal_path) if r["terminal"] is None]
        assert progress and all(r["mode"] == "single" for r in progress)

