"""A 2xx prefill answer with ``kv_transfer_params: null`` (issue 21 item 2; docs/operate.md,
"Prefill answers without KV").

vLLM's NIXL connector hands off nothing when the one-token prefill ended the
sequence; the engine then holds no KV. Narwhal runs the decode leg as a plain
request (no ``kv_transfer_params``: the decode engine recomputes the prompt),
journals the prefill leg's KV as ``none`` with the reason, and never retries
or answers 502. The simulator answers ``null`` with its ``omit_kv_params``
fault.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet
from ..helpers import MODEL, journal_terminal, rid_of
from .support import sse_chunks

NULL_PARAMS = {"omit_kv_params_rate": 1.0}


@pytest.fixture
def null_fleet():
    with SimThread(role="prefill", speed=0, faults=NULL_PARAMS) as prefill, SimThread(
        role="decode", speed=0
    ) as decode:
        yield Fleet(prefill=[prefill], decode=[decode])


def _completion_bodies(sim: SimThread) -> list[dict]:
    return [json.loads(r["body"]) for r in sim.requests("/v1/completions")]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_null_params_decode_recomputes_and_completes(start_router, null_fleet, journal_path, stream) -> None:
    (prefill,), (decode,) = null_fleet.prefill, null_fleet.decode
    router = start_router(fleet_=null_fleet, retry={"max_attempts": 3})
    body = {"model": MODEL, "prompt": "The narwhal is a whale", "max_tokens": 5, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    answer = httpx.post(router.url + "/v1/completions", json=body, timeout=10)

    assert answer.status_code == 200, answer.text
    if stream:
        chunks = sse_chunks(answer)
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
    else:
        data = answer.json()
        assert data["choices"][0]["text"] and "kv_transfer_params" not in data
        usage = data["usage"]
    assert usage["completion_tokens"] == 5
    record = journal_terminal(journal_path, rid_of(answer))
    assert record["terminal"] == "completed" and record["status"] == 200 and record["error"] is None
    legs = record["legs"]
    # One prefill (never retried: the same prompt would end the same way) and one plain decode.
    assert [(leg["phase"], leg["attempt"], leg["outcome"]) for leg in legs] == [
        ("prefill", 1, "ok"), ("decode", 1, "ok"),
    ]
    kv = legs[0]["kv"]
    assert kv["outcome"] == "none" and kv["method"] == "none" and kv["engine"] == prefill.url
    assert "no kv_transfer_params" in kv["error"] and "recomputes the prompt" in kv["error"]
    assert legs[1]["kv"] is None
    # The decode leg carried no kv_transfer_params: the engine computed the prompt itself.
    (sent,) = _completion_bodies(decode)
    assert "kv_transfer_params" not in sent and sent["prompt"] == body["prompt"]
    assert decode.stats()["kv_pulls"] == 0
    assert len(_completion_bodies(prefill)) == 1
    # Nothing held anywhere.
    assert prefill.stats()["kv_held"] == 0
    router.wait_idle()


def test_null_params_with_the_openai_client(start_router, null_fleet, journal_path, router_log) -> None:
    router = start_router(fleet_=null_fleet)
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        first = client.completions.create(model=MODEL, prompt="Tusk", max_tokens=3)
        second = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tusk?"}], max_tokens=3
        )
    assert first.choices[0].text and second.choices[0].message.content
    for rid in (first._request_id, second._request_id):
        record = journal_terminal(journal_path, rid)
        assert record["terminal"] == "completed"
        assert record["legs"][0]["kv"]["outcome"] == "none"
    # The sim's answer ends on "length", not on an end of sequence: an engine
    # answering like that may lack its KV connector. Said once, not per request.
    warnings = [line for line in router_log.events() if line.get("event") == "prefill_without_kv"]
    assert len(warnings) == 1, warnings
    assert warnings[0]["engine"] == null_fleet.prefill[0].url and "kv-transfer-config" in warnings[0]["fix"]


FAMILIES = ("0.9", "0.11", "0.14", "0.18", "lease", "0.28")


@pytest.mark.parametrize("min_tokens", [None, 1, 4], ids=["no_min_tokens", "min_tokens_1", "min_tokens_4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_ending_on_eos_per_vllm_version(start_router, journal_path, family, min_tokens) -> None:
    # The simulator's prefill samples an end of sequence as its one token
    # unless min_tokens >= 1 forbids it. Connectors before the lease then hand
    # off nothing (kv_transfer_params null: the decode leg recomputes); the
    # lease-era connector holds the KV on a stop too. With min_tokens >= 1 the
    # prefill leg carries min_tokens: 1, so the token is never the end.
    with SimThread(role="prefill", speed=0, vllm_version=family, faults={"eos_rate": 1.0}) as prefill, SimThread(
        role="decode", speed=0, vllm_version=family
    ) as decode:
        router = start_router(fleet_=Fleet(prefill=[prefill], decode=[decode]))
        body = {"model": MODEL, "prompt": "The narwhal", "max_tokens": 4}
        if min_tokens is not None:
            body["min_tokens"] = min_tokens
        answer = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
        assert answer.status_code == 200, answer.text
        record = journal_terminal(journal_path, rid_of(answer))
        assert record["terminal"] == "completed"
        assert [(leg["phase"], leg["outcome"]) for leg in record["legs"]] == [("prefill", "ok"), ("decode", "ok")]
        (sent_prefill,) = _completion_bodies(prefill)
        assert sent_prefill.get("min_tokens") == (None if min_tokens is None else 1)
        (sent_decode,) = _completion_bodies(decode)
        assert sent_decode.get("min_tokens") == min_tokens  # the client's own value, on the decode leg
        kv = record["legs"][0]["kv"]
        if min_tokens is None and family not in ("lease", "0.28"):
            assert kv["outcome"] == "none" and "finish_reason stop" in kv["error"]
            assert "kv_transfer_params" not in sent_decode
            assert decode.stats()["kv_pulls"] == 0
            router.wait_idle()
            assert prefill.stats()["kv_held"] == 0 and prefill.stats()["kv_held_total"] == 0  # never held
        else:
            assert kv["outcome"] == "pulled"
            assert sent_decode["kv_transfer_params"]["remote_engine_id"]
            assert decode.stats()["kv_pulls"] == 1
            router.wait_idle()
