"""The ``openai`` Python package as a real client of the router (a real client, end to end)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from ..helpers import MODEL, journal_terminal

MESSAGES = [{"role": "user", "content": "What is a narwhal's tusk?"}]


@pytest.fixture
def client(start_router) -> Iterator[openai.OpenAI]:
    router = start_router()
    with openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10) as client:
        yield client


def test_completion(client, journal_path) -> None:
    completion = client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=5)
    assert completion.object == "text_completion"
    assert completion.model == MODEL
    assert completion.choices[0].text
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    record = journal_terminal(journal_path, completion._request_id)
    assert record["terminal"] == "completed" and record["route"] == "/v1/completions"


def test_completion_with_raw_response(client, journal_path) -> None:
    raw = client.completions.with_raw_response.create(model="llama-3.1-8b", prompt="Tusk", max_tokens=2)
    assert raw.status_code == 200
    rid = raw.headers["x-request-id"]
    completion = raw.parse()
    assert completion._request_id == rid and completion.model == MODEL
    assert journal_terminal(journal_path, rid)["terminal"] == "completed"


def test_chat_completion(client, journal_path) -> None:
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6)
    assert chat.object == "chat.completion"
    assert chat.model == MODEL
    message = chat.choices[0].message
    assert message.role == "assistant" and message.content
    record = journal_terminal(journal_path, chat._request_id)
    assert record["terminal"] == "completed" and record["usage"]["completion_tokens"] == 6


def test_chat_tool_call_has_null_content(client) -> None:
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required",
                                          max_tokens=4)
    message = chat.choices[0].message
    assert message.content is None
    assert message.tool_calls and message.tool_calls[0].function.name == "lookup"


def test_streaming_completion(client, journal_path) -> None:
    stream = client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=5, stream=True,
                                       stream_options={"include_usage": True})
    rid = stream.response.headers["x-request-id"]
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = client.completions.create(model=MODEL, prompt="The narwhal", max_tokens=5)
    assert text == whole.choices[0].text
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 5
    assert all(c.model == MODEL for c in chunks)
    assert journal_terminal(journal_path, rid)["terminal"] == "completed"


def test_streaming_chat(client, journal_path) -> None:
    with client.chat.completions.create(model="llama-3.1-8b", messages=MESSAGES, max_tokens=5, stream=True) as stream:
        rid = stream.response.headers["x-request-id"]
        chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert journal_terminal(journal_path, rid)["terminal"] == "completed"


@pytest.mark.parametrize("field", ["n", "best_of"])
def test_sampling_width_is_a_bad_request_error(client, journal_path, field) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **{field: 2})
    error = caught.value
    assert error.status_code == 400
    assert error.param == field
    assert error.type == "invalid_request_error"
    assert journal_terminal(journal_path, error.request_id)["terminal"] == "invalid"


def test_chat_n_is_a_bad_request_error(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    assert caught.value.param == "n"


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_wrong_model_is_not_found(client, journal_path, route) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        if route == "completions":
            client.completions.create(model="gpt-4o", prompt="hi")
        else:
            client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    error = caught.value
    assert error.status_code == 404
    assert error.code == "model_not_found" and error.param == "model"
    record = journal_terminal(journal_path, error.request_id)
    assert record["terminal"] == "invalid" and record["error"]["code"] == "model_not_found"


def test_models_list(client) -> None:
    ids = [model.id for model in client.models.list()]
    assert ids == [MODEL, "llama-3.1-8b"]


def test_bad_api_key_is_an_authentication_error(start_router, api_keys, journal_path) -> None:
    router = start_router(ingress={"auth": "api_keys", "api_keys_file": str(api_keys.path)})
    with openai.OpenAI(base_url=router.url + "/v1", api_key="not-a-key", max_retries=0, timeout=10) as bad:
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.completions.create(model=MODEL, prompt="hi")
    assert caught.value.status_code == 401 and caught.value.type == "authentication_error"
    assert journal_terminal(journal_path, caught.value.request_id)["terminal"] == "denied"
    key = api_keys.keys["team-b"]
    with openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=10) as good:
        completion = good.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert journal_terminal(journal_path, completion._request_id)["client"] == "team-b"
