"""Batch prompts on ``/v1/completions`` (issue 21 item 3; docs/operate.md, "Batch prompts").

A list of prompts (strings, or token-ID lists) is served by one prefill and
decode pair per prompt -- the simulator, like vLLM's PD path, serves one
prompt per request -- and the answers are merged in prompt order with
``index`` set as OpenAI does, streamed or not. The ``openai`` package is the
client; both runtimes run every test.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from ..helpers import MODEL, journal_terminal, rid_of

PROMPTS = ["The narwhal", "A beluga sings", "Bowhead whales live two centuries"]
TOKEN_PROMPTS = [[101, 2023, 2003], [7, 8, 9, 10], [42]]


@pytest.fixture
def client(start_router) -> Iterator[openai.OpenAI]:
    router = start_router()
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        yield client


def _decode_prompts(fleet) -> list[object]:
    return [json.loads(r["body"])["prompt"] for d in fleet.decode for r in d.requests("/v1/completions")]


@pytest.mark.parametrize("prompts", [PROMPTS, TOKEN_PROMPTS], ids=["text", "token_ids"])
def test_batch_answers_in_prompt_order(client, fleet, journal_path, prompts) -> None:
    # Each prompt alone first: the simulator's text is a function of the prompt.
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=4) for p in prompts]
    for sim in fleet.all():
        sim.reset()

    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=4)

    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 12 and batch.usage.total_tokens == batch.usage.prompt_tokens + 12
    # One PD pair per prompt, in prompt order, each engine request one prompt.
    assert _decode_prompts(fleet) == prompts
    record = journal_terminal(journal_path, batch._request_id)
    assert record["terminal"] == "completed" and record["status"] == 200
    assert [(leg["phase"], leg["prompt"], leg["outcome"]) for leg in record["legs"]] == [
        (phase, i, "ok") for i in range(3) for phase in ("prefill", "decode")
    ]
    assert all(leg["kv"]["outcome"] == "pulled" for leg in record["legs"] if leg["phase"] == "prefill")
    assert record["usage"]["completion_tokens"] == 12


def test_batch_streamed_in_prompt_order_with_one_done(client, fleet, journal_path) -> None:
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5).choices[0].text for p in PROMPTS]

    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=5, stream=True, stream_options={"include_usage": True}
    )
    texts = ["", "", ""]
    order = []
    usage = []
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            order.append(choice.index)
        if chunk.usage is not None:
            usage.append(chunk.usage)
    assert texts == alone
    assert order == sorted(order)  # prompt 0's events, then prompt 1's, then prompt 2's
    assert len(usage) == 1 and usage[0].completion_tokens == 15
    record = journal_terminal(journal_path, stream.response.headers["x-request-id"])
    assert record["terminal"] == "completed" and record["stream"] is True
    assert [leg["prompt"] for leg in record["legs"]] == [0, 0, 1, 1, 2, 2]
    assert record["usage"]["completion_tokens"] == 15


def test_batch_stream_raw_has_one_done_last(start_router) -> None:
    router = start_router()
    with httpx.stream("POST", router.url + "/v1/completions", timeout=10, json={
        "model": MODEL, "prompt": PROMPTS[:2], "max_tokens": 3, "stream": True,
    }) as response:
        body = response.read()
    assert response.status_code == 200
    data = [line[6:] for line in body.decode().split("\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]" and data.count("[DONE]") == 1
    indexes = [json.loads(d)["choices"][0]["index"] for d in data[:-1]]
    assert indexes == sorted(indexes) and set(indexes) == {0, 1}
    assert len({json.loads(d)["id"] for d in data[:-1]}) == 1


@pytest.mark.parametrize(("bound", "count"), [(2, 3), (1, 2)])
def test_batch_over_the_bound_is_400_param_prompt(start_router, fleet, journal_path, bound, count) -> None:
    router = start_router(ingress={"max_batch_prompts": bound})
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as sdk:
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.completions.create(model=MODEL, prompt=PROMPTS[:count], max_tokens=2)
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "prompt" and error["type"] == "invalid_request_error"
    record = journal_terminal(journal_path, caught.value.response.headers["x-request-id"])
    assert record["terminal"] == "invalid" and record["legs"] == []
    # Refused before admission: no engine saw it.
    assert all(sim.requests("/v1/completions") == [] for sim in fleet.all())


def test_one_prompt_lists_are_not_batches(start_router, fleet, journal_path) -> None:
    router = start_router(ingress={"max_batch_prompts": 1})
    for prompt in (["one"], [[1, 2, 3]], [5, 6, 7]):
        answer = httpx.post(router.url + "/v1/completions", timeout=10,
                            json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        assert len(answer.json()["choices"]) == 1
        record = journal_terminal(journal_path, rid_of(answer))
        assert all("prompt" not in leg for leg in record["legs"])
