"""What a simulated SGLang engine reads from a completion request and the OpenAI bodies it answers.

The PD fields are SGLang's (``python/sglang/srt/managers/io_struct.py``,
``GenerateReqInput``: ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``,
``rid``; the OpenAI requests carry the same names). Errors are SGLang's flat
``ErrorResponse`` (``object: "error"``, ``message``, ``type``, ``param``, ``code``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import attrs
import orjson

from narwhal_sim.config import SimConfig
from narwhal_sim.http1 import HttpRequest
from narwhal_sim.sglang_rooms import RoomFailed

__all__ = ["SglangJob", "parse_job", "whole_body", "stream_chunks", "error_body"]

#: Output tokens when a request names no limit.
DEFAULT_MAX_TOKENS = 16

_TYPES = {400: "BadRequestError", 404: "NotFoundError", 500: "InternalServerError"}


def error_body(status: int, message: str) -> bytes:
    """SGLang's flat error envelope."""
    kind = _TYPES.get(status, "InternalServerError" if status >= 500 else "BadRequestError")
    return orjson.dumps({"object": "error", "message": message, "type": kind, "param": None, "code": status})


@attrs.frozen(kw_only=True)
class SglangJob:
    """One completion request as a SGLang engine reads it."""

    #: ``/v1/chat/completions`` (else ``/v1/completions``).
    chat: bool
    #: SGLang's request ID: the body's ``rid``, else a fresh one (as the tokenizer manager makes).
    rid: str
    #: The PD fields the router added; ``None`` when absent.
    bootstrap_host: str | None
    bootstrap_port: int | None
    room: int | None
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    model: str


def _optional_int(data: dict[str, Any], name: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise RoomFailed(f"{name} must be a non-negative integer, got {value!r}", status=400)
    return value


def _prompt_tokens(data: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = data.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RoomFailed("messages must be a non-empty array", status=400)
        text = "".join(str(m.get("content", "")) if isinstance(m, dict) else "" for m in messages)
    else:
        prompt = data.get("prompt")
        if not isinstance(prompt, str | list):
            raise RoomFailed("prompt must be a string or an array", status=400)
        text = prompt if isinstance(prompt, str) else "".join(map(str, prompt))
    return max(1, len(text) // 4)


def parse_job(request: HttpRequest, *, chat: bool, config: SimConfig) -> SglangJob:
    """The request's job; ``RoomFailed`` (400) for a body SGLang would refuse."""
    try:
        data = orjson.loads(request.body)
    except orjson.JSONDecodeError:
        raise RoomFailed("the body is not valid JSON", status=400) from None
    if not isinstance(data, dict):
        raise RoomFailed("the body must be a JSON object", status=400)
    host = data.get("bootstrap_host")
    if host is not None and not isinstance(host, str):
        raise RoomFailed("bootstrap_host must be a string (one request, not a batch)", status=400)
    rid = data.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise RoomFailed("rid must be a string", status=400)
    limit = _optional_int(data, "max_completion_tokens")
    if limit is None:
        limit = _optional_int(data, "max_tokens")
    options = data.get("stream_options")
    return SglangJob(
        chat=chat,
        rid=rid or uuid.uuid4().hex,
        bootstrap_host=host,
        bootstrap_port=_optional_int(data, "bootstrap_port"),
        room=_optional_int(data, "bootstrap_room"),
        prompt_tokens=_prompt_tokens(data, chat),
        max_tokens=max(1, DEFAULT_MAX_TOKENS if limit is None else limit),
        stream=data.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        model=str(data.get("model") or config.model),
    )


def _token(seed: int, room: int | None, index: int) -> str:
    return f" t{(seed * 7919 + (room or 0) * 31 + index) % 997}"


def _usage(job: SglangJob, tokens: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": job.prompt_tokens, "completion_tokens": tokens,
            "total_tokens": job.prompt_tokens + tokens, "prompt_tokens_details": None}  # fmt: skip


def whole_body(job: SglangJob, tokens: int, cached: int, *, seed: int) -> bytes:
    """The whole answer: ``tokens`` tokens, ``finish_reason: "length"``."""
    text = "".join(_token(seed, job.room, i) for i in range(tokens))
    choice: dict[str, Any]
    if job.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None,
                                          "tool_calls": None},
                  "logprobs": None, "finish_reason": "length", "matched_stop": None}  # fmt: skip
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "matched_stop": None}
    body = {"id": job.rid, "object": "chat.completion" if job.chat else "text_completion",
            "created": int(time.time()), "model": job.model, "choices": [choice],
            "usage": _usage(job, tokens, cached)}  # fmt: skip
    return orjson.dumps(body)


def stream_chunks(job: SglangJob, tokens: int, cached: int, *, seed: int) -> Iterator[bytes]:
    """The answer as server-sent events, one token an event, then usage (when asked) and ``[DONE]``."""
    created = int(time.time())
    kind = "chat.completion.chunk" if job.chat else "text_completion"

    def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body = {"id": job.rid, "object": kind, "created": created, "model": job.model, "choices": choices,
                "usage": usage}  # fmt: skip
        return b"data: " + orjson.dumps(body) + b"\n\n"

    if job.chat:
        yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])  # fmt: skip
    for i in range(tokens):
        last = i == tokens - 1
        finish = "length" if last else None
        piece = _token(seed, job.room, i)
        if job.chat:
            yield event([{"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish}])
        else:
            yield event([{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}])
    if job.include_usage:
        yield event([], _usage(job, tokens, cached))
    yield b"data: [DONE]\n\n"
