"""OpenAI routes and answer shapes, as vLLM writes them, over real sockets."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal_sim.testing import SimThread

from ..helpers import MODEL
from .helpers import PROMPT, sse_values


@pytest.fixture(scope="module")
def sim() -> Iterator[SimThread]:
    with SimThread("mixed", speed=0, seed=11) as s:
        yield s


def post(client: httpx.Client, sim: SimThread, path: str, body: dict[str, Any], rid: str | None = None) -> httpx.Response:
    headers = {"X-Request-Id": rid} if rid else {}
    return client.post(sim.url + path, json=body, headers=headers)


def test_completion_shape(client: httpx.Client, sim: SimThread) -> None:
    answer = post(client, sim, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 5}, "r-1")
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert answer.headers["x-request-id"] == "r-1"
    body = answer.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage", "kv_transfer_params"]
    assert body["id"] == "cmpl-r-1"
    assert body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    assert body["model"] == MODEL
    assert body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    assert choice == {
        "index": 0,
        "text": choice["text"],
        "logprobs": None,
        "finish_reason": "length",
        "stop_reason": None,
    }
    assert len(choice["text"].split()) == 5
    assert body["usage"] == {
        "prompt_tokens": 50,
        "total_tokens": 55,
        "completion_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"]},
    }


def test_output_is_deterministic_and_seeded(client: httpx.Client, sim: SimThread) -> None:
    body = {"prompt": "a fixed prompt", "max_tokens": 12}
    first = post(client, sim, "/v1/completions", body).json()["choices"][0]["text"]
    again = post(client, sim, "/v1/completions", body).json()["choices"][0]["text"]
    other = post(client, sim, "/v1/completions", {**body, "prompt": "another prompt"}).json()
    assert first == again
    assert other["choices"][0]["text"] != first
    with SimThread("mixed", speed=0, seed=12) as reseeded:
        assert post(client, reseeded, "/v1/completions", body).json()["choices"][0]["text"] != first
    with SimThread("mixed", speed=0, seed=11) as same_seed:
        assert post(client, same_seed, "/v1/completions", body).json()["choices"][0]["text"] == first


def test_max_tokens_decides_length(client: httpx.Client, sim: SimThread) -> None:
    default = post(client, sim, "/v1/completions", {"prompt": "p"}).json()
    assert default["usage"]["completion_tokens"] == 16
    assert len(default["choices"][0]["text"].split()) == 16
    mct = post(client, sim, "/v1/chat/completions",
               {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}).json()  # fmt: skip
    assert mct["usage"]["completion_tokens"] == 3
    both = post(client, sim, "/v1/completions", {"prompt": "p", "max_tokens": 9, "max_completion_tokens": 4}).json()
    assert both["usage"]["completion_tokens"] == 4


def test_chat_shape(client: httpx.Client, sim: SimThread) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    answer = post(client, sim, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}, "c-1")
    body = answer.json()
    assert answer.status_code == 200
    assert body["id"] == "chatcmpl-c-1"
    assert body["object"] == "chat.completion"
    assert body["kv_transfer_params"] is None
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["role"] == "assistant"
    assert message["reasoning_content"] is None and message["tool_calls"] == []
    assert len(message["content"].split()) == 4
    assert body["usage"]["completion_tokens"] == 4


def test_chat_tool_choice_required_answers_a_tool_call(client: httpx.Client, sim: SimThread) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 3}  # fmt: skip
    choice = post(client, sim, "/v1/chat/completions", body).json()["choices"][0]
    message = choice["message"]
    assert message["content"] == ""
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    assert len(json.loads(call["function"]["arguments"])["text"].split()) == 3
    assert choice["finish_reason"] == "tool_calls"
    named = {**body, "tool_choice": {"type": "function", "function": {"name": "other"}}}
    assert post(client, sim, "/v1/chat/completions", named).json()["choices"][0]["message"]["tool_calls"][0][
        "function"
    ]["name"] == "other"
    auto = {**body, "tool_choice": "auto"}
    assert post(client, sim, "/v1/chat/completions", auto).json()["choices"][0]["message"]["tool_calls"] == []


def test_reasoning_only_switch(client: httpx.Client, sim: SimThread) -> None:
    body = {"messages": [{"role": "user", "content": "think"}], "max_tokens": 3}
    sim.set_faults(reasoning_only=True)
    try:
        message = post(client, sim, "/v1/chat/completions", body).json()["choices"][0]["message"]
        assert message["content"] == ""
        assert len(message["reasoning_content"].split()) == 3
        with client.stream("POST", sim.url + "/v1/chat/completions", json={**body, "stream": True}) as r:
            chunks = sse_values(r.read().decode())
        deltas = [c["choices"][0]["delta"] for c in chunks[1:-1]]
        assert all(set(d) == {"reasoning_content"} for d in deltas) and len(deltas) == 3
    finally:
        sim.set_faults()
    assert post(client, sim, "/v1/chat/completions", body).json()["choices"][0]["message"]["reasoning_content"] is None


def test_completion_stream(client: httpx.Client, sim: SimThread) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", sim.url + "/v1/completions", json=body, headers={"X-Request-Id": "s-1"}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["transfer-encoding"] == "chunked"
        text = r.read().decode()
    events = sse_values(text)
    assert events[-1] == "[DONE]"
    tokens, usage_chunk = events[:4], events[4]
    for i, chunk in enumerate(tokens):
        assert chunk["id"] == "cmpl-s-1" and chunk["object"] == "text_completion" and chunk["model"] == MODEL
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] == ("length" if i == 3 else None)
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == 4
    streamed = "".join(c["choices"][0]["text"] for c in tokens)
    whole = post(client, sim, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4}).json()
    assert streamed == whole["choices"][0]["text"]


def test_chat_stream_without_usage(client: httpx.Client, sim: SimThread) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    with client.stream("POST", sim.url + "/v1/chat/completions", json=body) as r:
        events = sse_values(r.read().decode())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 1 + 3  # role chunk, then one per token
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:]] == [None, None, "length"]
    assert all("usage" not in c for c in chunks)


def test_chat_stream_tool_call(client: httpx.Client, sim: SimThread) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": "required",
            "max_tokens": 3, "stream": True}  # fmt: skip
    with client.stream("POST", sim.url + "/v1/chat/completions", json=body) as r:
        chunks = sse_values(r.read().decode())[:-1]
    header = chunks[1]["choices"][0]["delta"]["tool_calls"][0]
    assert header["function"]["name"] == "f"
    pieces = [c["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] for c in chunks[2:]]
    assert len(pieces) == 3
    assert len(json.loads("".join(pieces))["text"].split()) == 3
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_wrong_model_is_404_in_envelope(client: httpx.Client, sim: SimThread) -> None:
    answer = post(client, sim, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "NotFoundError" and error["param"] == "model" and error["code"] == 404
    assert "gpt-4" in error["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": MODEL}, "prompt"),
        ("/v1/chat/completions", {"model": MODEL}, "messages"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "n": 2}, "n"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 200_000}, "max_tokens"),
        ("/v1/chat/completions", {"messages": ["not an object"]}, "messages"),
        ("/v1/completions", {"prompt": "x", "kv_transfer_params": "no"}, "kv_transfer_params"),
    ],
)
def test_bad_requests_are_400_in_envelope(
    client: httpx.Client, sim: SimThread, path: str, body: dict[str, Any], param: str
) -> None:
    answer = post(client, sim, path, body)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError" and error["code"] == 400


def test_invalid_json_is_400(client: httpx.Client, sim: SimThread) -> None:
    for content in (b"{not json", b"[1, 2]", b"\xff\xfe"):
        answer = client.post(sim.url + "/v1/completions", content=content)
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "BadRequestError"


def test_health_models_and_unknown_routes(client: httpx.Client, sim: SimThread) -> None:
    health = client.get(sim.url + "/health")
    assert health.status_code == 200 and health.content == b""
    models = client.get(sim.url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["object"] == "model"
    missing = client.get(sim.url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404
    wrong_method = client.get(sim.url + "/v1/completions")
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
