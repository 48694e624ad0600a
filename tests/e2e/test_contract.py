"""docs/contract.md, "Request rules", end to end: every rejection of the request contract, and that none
reaches an engine.

One test per rule and per field type. Each checks the status, the OpenAI
envelope (``type``, ``param``, ``code``, the message), the ``x-request-id``
of the answer, the one ``invalid`` terminal record it leaves in the journal,
and that no completion request reached any engine (the engines' request
records are compared before and after).
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ..helpers import (
    CHAT,
    COMPLETIONS,
    MODEL,
    completion_records,
    each_route,
    journal_terminal,
    rid_of,
)
from .support import BASE_BODY, http



def _reject(
    router: Any,
    fleet: Any,
    journal_path: Any,
    route: str,
    content: bytes,
    *,
    status: int = 400,
    param: str | None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    """POST ``content``; check the rejection, its journal record and the silence of the engines."""
    case = f"{route} {content[:200]!r}"
    before = completion_records(fleet)
    answer = http.post(
        router.url + route, content=content,
        headers={"content-type": "application/json", **(headers or {})}, timeout=10,
    )
    assert answer.status_code == status, (case, answer.text)
    assert answer.headers["content-type"].startswith("application/json"), case
    body = answer.json()
    assert body == {"error": {
        "message": body["error"]["message"], "type": "invalid_request_error", "param": param, "code": code,
    }}, (case, body)
    message = body["error"]["message"]
    assert isinstance(message, str) and message, case
    rid = rid_of(answer)
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "invalid", (case, record)
    assert record["status"] == status, case
    assert record["route"] == route, case
    assert record["legs"] == [], case
    assert record["error"]["param"] == param and record["error"]["code"] == code, (case, record)
    assert record["error"]["type"] == "invalid_request_error", case
    assert record["error"]["message"] == message, case
    stats = router.wait_idle()
    assert stats.inflight == 0 and stats.legs == 0, case
    assert completion_records(fleet) == before, f"a rejected request reached an engine: {case}"
    return body["error"]  # type: ignore[no-any-return]


def _body(route: str, **fields: Any) -> bytes:
    body = dict(BASE_BODY[route])
    for key, value in fields.items():
        if value is _ABSENT:
            body.pop(key, None)
        else:
            body[key] = value
    return json.dumps(body).encode()


_ABSENT = object()


# 1. Not JSON (or not UTF-8) -> 400, param null.


@each_route
def test_invalid_json_is_400_with_null_param(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for content in (b'{"prompt": "hi"', b"", b"{'prompt': 'hi'}", b'{"prompt": "hi"} trailing',
                    b'{"max_tokens": NaN}', b'{"prompt": "hi",}', b'{"prompt": "\\ud800"}'):
        _reject(router, fleet, journal_path, route, content, param=None)


@each_route
def test_body_that_is_not_utf8_is_400_with_null_param(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for content in (b'{"prompt": "caf\xe9", "messages": [{"role": "user", "content": "caf\xe9"}]}',
                    b'\xff\xfe{\x00}\x00'):
        _reject(router, fleet, journal_path, route, content, param=None)


# 2. Not a JSON object -> 400, param null.


@each_route
def test_body_that_is_not_an_object_is_400_with_null_param(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for content in (b"[]", b'[{"prompt": "hi"}]', b'"hello"', b"42", b"null", b"true"):
        _reject(router, fleet, journal_path, route, content, param=None)


# 3. Field types, in the order of docs/contract.md, "Request rules".

_BAD_VALUES: dict[str, list[Any]] = {
    "model": [5, True, ["x"], {"name": MODEL}],
    "stream": ["true", 1, 0, [True]],
    "n": [True, 1.0, "1", 1.5, [1]],
    "best_of": [False, 1.0, "2", {"n": 1}],
    "max_tokens": [True, False, 1.0, 16.5, "16", [16], 1e3],
    "prompt": [5, True, {"text": "hi"}, 1.5],
    "messages": ["hi", {"role": "user", "content": "hi"}, [1], ["hi"],
                 [{"role": "user", "content": "hi"}, None], [[{"role": "user", "content": "hi"}]]],
}
_MESSAGES = {
    "model": "model must be a string",
    "stream": "stream must be a boolean",
    "n": "n must be an integer",
    "best_of": "best_of must be an integer",
    "max_tokens": "max_tokens must be an integer",
    "prompt": "prompt must be",
    "messages": "messages must be",
}


@each_route
@pytest.mark.parametrize("field", list(_BAD_VALUES))
def test_field_of_wrong_type_is_400_naming_the_field(start_router, fleet, journal_path, route, field) -> None:
    """A validated field of the wrong type: 400, ``param`` = the field, ``"<field> must be ..."``."""
    router = start_router()
    for value in _BAD_VALUES[field]:
        error = _reject(router, fleet, journal_path, route, _body(route, **{field: value}), param=field)
        if field in ("n", "best_of", "max_tokens"):
            # The example of docs/contract.md, "Request rules": "max_tokens must be an integer".
            assert error["message"] == _MESSAGES[field], (value, error)
        else:
            assert error["message"].startswith(_MESSAGES[field]), (value, error)


@each_route
def test_null_validated_fields_pass(start_router, fleet, journal_path, route) -> None:
    """Absent or ``null`` fields pass the type checks."""
    router = start_router()
    fields = {"model": None, "stream": None, "n": None, "best_of": None, "max_tokens": None}
    if route == COMPLETIONS:
        fields["messages"] = None
    else:
        fields["prompt"] = None
    answer = http.post(router.url + route, json={**BASE_BODY[route], **fields}, timeout=10)
    assert answer.status_code == 200, answer.text
    assert journal_terminal(journal_path, rid_of(answer))["terminal"] == "completed"


def test_field_types_are_checked_in_the_seed_table_order(start_router, fleet, journal_path) -> None:
    """Several wrong fields: the first in the table of docs/contract.md decides, whatever the body's key order."""
    router = start_router()
    cases = [
        ({"max_tokens": "x", "model": 5}, "model"),
        ({"stream": "yes", "model": 5}, "model"),
        ({"n": "x", "stream": "yes"}, "stream"),
        ({"best_of": "x", "n": "x"}, "n"),
        ({"max_tokens": "x", "best_of": "x"}, "best_of"),
        ({"prompt": 5, "max_tokens": "x"}, "max_tokens"),
        ({"messages": 5, "prompt": 5}, "prompt"),
        ({"messages": 5, "prompt": 5, "max_tokens": 1.5, "best_of": True, "n": "1", "stream": 1, "model": 1},
         "model"),
    ]
    for fields, param in cases:
        _reject(router, fleet, journal_path, COMPLETIONS, json.dumps({"prompt": "hi", **fields}).encode(),
                param=param)


# 4. Nothing to prefill.


def test_completion_without_prompt_is_400_param_prompt(start_router, fleet, journal_path) -> None:
    router = start_router()
    for fields in ({}, {"prompt": None}, {"messages": [{"role": "user", "content": "hi"}]}):
        _reject(router, fleet, journal_path, COMPLETIONS, json.dumps({"max_tokens": 4, **fields}).encode(),
                param="prompt")


def test_chat_without_messages_is_400_param_messages(start_router, fleet, journal_path) -> None:
    router = start_router()
    for fields in ({}, {"messages": None}, {"prompt": "hi"}):
        _reject(router, fleet, journal_path, CHAT, json.dumps({"max_tokens": 4, **fields}).encode(),
                param="messages")


def test_types_are_checked_before_the_prompt_is_required(start_router, fleet, journal_path) -> None:
    router = start_router()
    _reject(router, fleet, journal_path, CHAT, b'{"max_tokens": "8"}', param="max_tokens")
    _reject(router, fleet, journal_path, COMPLETIONS, b'{"stream": "no"}', param="stream")


# 5. The model.


@each_route
def test_unknown_model_is_404_model_not_found(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for model in ("gpt-4o", MODEL.lower(), "", "llama-3.1-8b ", "x" * 5000):
        error = _reject(router, fleet, journal_path, route, _body(route, model=model), status=404, param="model",
                        code="model_not_found")
        assert error["type"] == "invalid_request_error"
        assert len(error["message"]) < 1000, "the message must not echo an unbounded model name"


def test_model_is_checked_after_types_and_prompt(start_router, fleet, journal_path) -> None:
    router = start_router()
    _reject(router, fleet, journal_path, COMPLETIONS, b'{"model": "gpt-4o", "n": "2", "prompt": "x"}', param="n")
    _reject(router, fleet, journal_path, COMPLETIONS, b'{"model": "gpt-4o", "max_tokens": 4}', param="prompt")


# 6. Sampling width.


@each_route
def test_sampling_width_over_one_is_400(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    cases = [({"n": 2}, "n"), ({"best_of": 3}, "best_of"), ({"n": 2, "best_of": 2}, "n"),
             ({"n": 1, "best_of": 2}, "best_of"), ({"n": 10**30}, "n")]
    for fields, param in cases:
        error = _reject(router, fleet, journal_path, route, _body(route, **fields), param=param)
        assert param in error["message"], error


def test_model_is_checked_before_sampling_width(start_router, fleet, journal_path) -> None:
    router = start_router()
    _reject(router, fleet, journal_path, COMPLETIONS, _body(COMPLETIONS, model="gpt-4o", n=2), status=404,
            param="model", code="model_not_found")


@each_route
def test_sampling_width_of_one_passes(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    answer = http.post(router.url + route, json={**BASE_BODY[route], "n": 1, "best_of": 1, "max_tokens": 2},
                        timeout=10)
    assert answer.status_code == 200, answer.text


# 7. Output and tool restrictions.

_FUNCTION_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


@each_route
def test_audio_is_400(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for audio in ({"voice": "alloy", "format": "wav"}, True, "wav", {}, False):
        _reject(router, fleet, journal_path, route, _body(route, audio=audio), param="audio")


@each_route
def test_modalities_other_than_text_is_400(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for modalities in (["text", "audio"], ["audio"], [], "text", ["TEXT"], ["text", "text"]):
        _reject(router, fleet, journal_path, route, _body(route, modalities=modalities), param="modalities")


@each_route
def test_tools_not_an_array_of_objects_is_400(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    for tools in ("get_weather", {"type": "function"}, [1], [_FUNCTION_TOOL, "x"], 5):
        _reject(router, fleet, journal_path, route, _body(route, tools=tools), param="tools")


@each_route
def test_tool_type_other_than_function_is_400_with_index(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    cases = [
        ([{"type": "retrieval"}], "tools[0].type"),
        ([_FUNCTION_TOOL, {"type": "code_interpreter"}], "tools[1].type"),
        ([_FUNCTION_TOOL, _FUNCTION_TOOL, {"function": {"name": "f"}}], "tools[2].type"),
        ([{"type": None, "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "Function", "function": {"name": "f"}}], "tools[0].type"),
        ([{"type": "retrieval"}, {"type": "file_search"}], "tools[0].type"),
    ]
    for tools, param in cases:
        _reject(router, fleet, journal_path, route, _body(route, tools=tools), param=param)


def test_restrictions_are_checked_in_order(start_router, fleet, journal_path) -> None:
    router = start_router()
    cases = [
        ({"n": 2, "audio": {"voice": "alloy"}}, "n"),
        ({"audio": {"voice": "alloy"}, "modalities": ["audio"]}, "audio"),
        ({"modalities": ["audio"], "tools": [{"type": "retrieval"}]}, "modalities"),
        ({"tools": [{"type": "retrieval"}], "best_of": 2}, "best_of"),
    ]
    for fields, param in cases:
        _reject(router, fleet, journal_path, CHAT, _body(CHAT, **fields), param=param)


@each_route
def test_allowed_output_and_tools_pass(start_router, fleet, journal_path, route) -> None:
    """``audio: null``, ``modalities: ["text"]`` and function tools are accepted."""
    router = start_router()
    body = {**BASE_BODY[route], "audio": None, "modalities": ["text"], "tools": [_FUNCTION_TOOL], "max_tokens": 2}
    answer = http.post(router.url + route, json=body, timeout=10)
    assert answer.status_code == 200, answer.text


@each_route
def test_streaming_requests_get_the_same_validation(start_router, fleet, journal_path, route) -> None:
    """docs/contract.md, "Responses and errors": a ``stream: true`` request is validated and restricted like
    any other."""
    router = start_router()
    _reject(router, fleet, journal_path, route, _body(route, stream=True, audio={"voice": "alloy"}), param="audio")
    _reject(router, fleet, journal_path, route, _body(route, stream=True, n=2), param="n")
    _reject(router, fleet, journal_path, route, _body(route, stream=True, max_tokens="9"), param="max_tokens")
    _reject(router, fleet, journal_path, route, _body(route, stream=True, model="gpt-4o"), status=404,
            param="model", code="model_not_found")
