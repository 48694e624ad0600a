"""The simulator's wire shapes: OpenAI requests and answers as vLLM writes them, and §3's KV params.

Pure functions and values: the only module that knows JSON field names.
Answers follow vLLM's OpenAI server: error envelopes carry the error class
name as ``type`` and the HTTP status as ``code``; chat messages carry
``reasoning_content`` and ``tool_calls``; every non-streaming answer has
``kv_transfer_params`` (``null`` unless it is a prefill leg's answer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from narwhal_sim.model import Prompt, PromptError

if TYPE_CHECKING:
    from narwhal_sim.tokens import Tokenizer

__all__ = [
    "ApiError",
    "error_body",
    "KvParams",
    "CompletionJob",
    "parse_completion",
    "usage",
    "completion_body",
    "chat_body",
    "StreamFormat",
    "DONE_EVENT",
    "DEFAULT_MAX_TOKENS",
]

#: Output length when the request names neither ``max_tokens`` nor ``max_completion_tokens``.
DEFAULT_MAX_TOKENS = 16

DONE_EVENT = b"data: [DONE]\n\n"

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_body(
    status: int, message: str, *, param: str | None = None, type: str | None = None, flat: bool = False
) -> bytes:
    """The error envelope as vLLM fills it: ``type`` names the error class, ``code`` is the HTTP status.

    vLLM 0.10.1 and later nest it (``{"error": {...}}``, ``ErrorResponse``/``ErrorInfo``); earlier
    releases answered the flat ``{"object": "error", "message", "type", "param", "code"}``
    (``flat=True``; docs/simulator.md, "vLLM versions").
    """
    kind = type or _ERROR_TYPES.get(status, "ServerError" if status >= 500 else "BadRequestError")
    if flat:
        return orjson.dumps({"object": "error", "message": message, "type": kind, "param": param, "code": status})
    return orjson.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})


class ApiError(Exception):
    """An answer in the error envelope; raised while handling a request."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self, *, flat: bool = False) -> bytes:
        """The envelope bytes (``flat``: the shape of vLLM before 0.10.1)."""
        return error_body(self.status, self.message, param=self.param, flat=flat)


class KvParams:
    """``kv_transfer_params`` of a request (docs/simulator.md, "The PD protocol"), read the way vLLM's NIXL connector reads them.

    ``mode`` is ``"prefill"`` for ``do_remote_decode: true`` (hold KV for a
    remote decode), ``"decode"`` for ``do_remote_prefill: true`` with every
    field a pull needs, ``"invalid"`` for ``do_remote_prefill: true`` with a
    field missing (vLLM then warns and recomputes), else ``None``.
    """

    __slots__ = (
        "mode",
        "remote_engine_id",
        "remote_request_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "tp_size",
        "missing",
    )

    def __init__(self, data: dict[str, Any], *, require_request_id: bool = True, push: bool = False) -> None:
        self.remote_engine_id = data.get("remote_engine_id")
        self.remote_request_id = data.get("remote_request_id")
        self.remote_block_ids = data.get("remote_block_ids")
        self.remote_host = data.get("remote_host")
        self.remote_port = data.get("remote_port")
        self.tp_size = data.get("tp_size")
        #: The first field a decode engine needs that is absent or of the wrong type.
        self.missing: str | None = None
        decode = data.get("do_remote_decode") is True
        prefill = data.get("do_remote_prefill") is True
        if decode and prefill:
            raise ApiError(
                400,
                "kv_transfer_params cannot set both do_remote_decode and do_remote_prefill",
                param="kv_transfer_params",
            )
        self.mode: str | None
        if decode:
            self.mode = "prefill"
        elif prefill:
            checks = (
                ("remote_engine_id", isinstance(self.remote_engine_id, str)),
                ("remote_request_id", not require_request_id or isinstance(self.remote_request_id, str)),
                ("remote_host", isinstance(self.remote_host, str)),
                ("remote_port", type(self.remote_port) is int),
                # Push (nixl/push_scheduler.py, update_state_after_alloc, 0316d25a): the decode engine
                # registers blocks of its own, and reads tp_size (a KeyError without it), not remote_block_ids.
                ("tp_size", not push or type(self.tp_size) is int),
                ("remote_block_ids", push or block_ids_ok(self.remote_block_ids)),
            )
            self.missing = next((name for name, ok in checks if not ok), None)
            self.mode = "decode" if self.missing is None else "invalid"
        else:
            self.mode = None

    @classmethod
    def parse(cls, value: Any, *, require_request_id: bool = True, push: bool = False) -> KvParams | None:
        """``None`` for an absent or ``null`` field; 400 when it is not an object.

        ``require_request_id``: the connector reads ``remote_request_id`` (NIXL connector version 2).
        """
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ApiError(400, "kv_transfer_params must be an object", param="kv_transfer_params")
        return cls(value, require_request_id=require_request_id, push=push)

    @property
    def flat_block_ids(self) -> list[int]:
        """``remote_block_ids`` as one list (one list per KV-cache group is flattened)."""
        return flat_block_ids(self.remote_block_ids)


def block_ids_ok(value: Any) -> bool:
    """A list of block ids, or a list of such lists (one per KV-cache group)."""
    if not isinstance(value, list):
        return False
    if value and isinstance(value[0], list):
        return all(isinstance(group, list) and all(type(b) is int for b in group) for group in value)
    return all(type(b) is int for b in value)


def flat_block_ids(value: Any) -> list[int]:
    """Block ids of a flat or per-group ``remote_block_ids`` as one list."""
    if not isinstance(value, list):
        return []
    if value and isinstance(value[0], list):
        return [b for group in value for b in group]
    return list(value)


class CompletionJob:
    """A validated completion request: what the engine must compute and how to answer."""

    __slots__ = ("chat", "prompt", "max_tokens", "stream", "include_usage", "kv", "tool_name", "min_tokens")

    def __init__(
        self,
        *,
        chat: bool,
        prompt: Prompt,
        max_tokens: int,
        stream: bool,
        include_usage: bool,
        kv: KvParams | None,
        tool_name: str | None,
        min_tokens: int = 0,
    ) -> None:
        self.min_tokens = min_tokens
        self.chat = chat
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.stream = stream
        self.include_usage = include_usage
        self.kv = kv
        self.tool_name = tool_name


def _int_field(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int:
        raise ApiError(400, f"{name} must be an integer", param=name)
    return value


def _bool_field(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and type(value) is not bool:
        raise ApiError(400, f"{name} must be a boolean", param=name)
    return value


def _truncation(body: dict[str, Any], max_model_len: int) -> int:
    """``truncate_prompt_tokens``: keep the prompt's last N tokens (-1: ``max_model_len``; 0: keep all).

    vLLM truncates a prompt on the left to this many tokens before it runs
    (``OpenAIServing._normalize_prompt_text_to_input`` and
    ``_normalize_prompt_tokens_to_input``, ``vllm/entrypoints/openai/serving_engine.py``).
    """
    value = _int_field(body, "truncate_prompt_tokens")
    if value is None:
        return 0
    if value < -1:
        raise ApiError(400, "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens")
    if value == -1:
        return max_model_len
    if value > max_model_len:
        raise ApiError(400, f"truncate_prompt_tokens value ({value}) is greater than max_model_len "
                            f"({max_model_len}). Please, select a smaller truncation size.",
                       param="truncate_prompt_tokens")  # fmt: skip
    return value


def parse_completion(
    body: bytes,
    *,
    chat: bool,
    served_model: str,
    max_model_len: int,
    tokenizer: Tokenizer | None = None,
    require_request_id: bool = True,
    push: bool = False,
) -> CompletionJob:
    """Validate a ``/v1/completions`` or ``/v1/chat/completions`` body; :class:`ApiError` when bad."""
    data = _json_object(body)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "model must be a string", param="model")
    stream = data.get("stream")
    if stream is not None and type(stream) is not bool:
        raise ApiError(400, "stream must be a boolean", param="stream")
    max_tokens = _int_field(data, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _int_field(data, "max_tokens")
    else:
        _int_field(data, "max_tokens")
    for name in ("n", "best_of"):
        width = _int_field(data, name)
        if width is not None and width != 1:
            raise ApiError(400, f"the simulator serves {name}=1 only", param=name)

    if model is not None and model != served_model:
        raise ApiError(404, f"The model `{model}` does not exist.", param="model")

    field = "messages" if chat else "prompt"
    if data.get(field) is None:
        raise ApiError(400, f"{field} is required", param=field)
    prompt, tool_name = _prompt(data, chat, tokenizer, _truncation(data, max_model_len))
    max_tokens = _output_tokens(max_tokens, prompt.num_tokens, max_model_len)

    min_tokens = _int_field(data, "min_tokens")
    options = data.get("stream_options")
    include_usage = isinstance(options, dict) and options.get("include_usage") is True
    return CompletionJob(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        stream=bool(stream),
        include_usage=include_usage,
        kv=KvParams.parse(data.get("kv_transfer_params"), require_request_id=require_request_id, push=push),
        tool_name=tool_name,
        min_tokens=min_tokens or 0,
    )


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        raise ApiError(400, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise ApiError(400, "request body must be a JSON object")
    return data


def _prompt(data: dict[str, Any], chat: bool, tokenizer: Tokenizer | None,
            truncate: int) -> tuple[Prompt, str | None]:  # fmt: skip
    """The request's prompt, and the tool a chat request forces (if any)."""
    tool_name = None
    try:
        if chat:
            prompt = Prompt.from_chat_body(data, tokenizer, truncate=truncate)
            tool_name = _forced_tool(data.get("tools"), data.get("tool_choice"))
        else:
            add_special_tokens = _bool_field(data, "add_special_tokens")
            prompt = Prompt.from_completion(data["prompt"], tokenizer, truncate=truncate,
                                            add_special_tokens=add_special_tokens is not False)  # fmt: skip
    except PromptError as exc:
        raise ApiError(400, str(exc), param=exc.param) from None
    return prompt, tool_name


def _output_tokens(max_tokens: int | None, prompt_tokens: int, max_model_len: int) -> int:
    """The tokens to generate (the default when unset), within the context length."""
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    elif max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"messages, {max_tokens} in the completion). Please reduce the length of the "
            "messages or completion.",
            param="max_tokens",
        )
    return max_tokens


def _forced_tool(tools: Any, choice: Any) -> str | None:
    """The function a chat answer must call: ``tool_choice`` ``"required"`` or a named function."""
    if choice == "required":
        if not isinstance(tools, list) or not tools:
            raise ApiError(400, 'tool_choice "required" needs at least one tool', param="tool_choice")
        return _tool_name(tools[0])
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise ApiError(400, "tool_choice must name a function", param="tool_choice")
        return name
    return None


def _tool_name(tool: Any) -> str:
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ApiError(400, "tools[0].function.name must be a string", param="tools")
    return name


# --------------------------------------------------------------------------- answers


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, *, details: bool = True) -> dict[str, Any]:
    """OpenAI ``usage``; ``prompt_tokens_details.cached_tokens`` with ``details``, else ``prompt_tokens_details: null``.

    vLLM fills the details only with ``--enable-prompt-tokens-details``; without, a whole answer
    has the key with ``null`` and a streamed usage chunk leaves it out (:meth:`StreamFormat.events`).
    """
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens} if details else None,
    }


def completion_body(
    *,
    response_id: str,
    created: int,
    model: str,
    text: str,
    usage: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    finish_reason: str = "length",
) -> dict[str, Any]:
    """A non-streaming ``text_completion``."""
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
        ],
        "usage": usage,
        "kv_transfer_params": kv_transfer_params,
    }


def tool_call_id(digest: str) -> str:
    """vLLM-style tool-call id, derived from the prompt so answers stay deterministic."""
    return f"chatcmpl-tool-{digest[:24]}"


def tool_arguments(tokens: list[str]) -> list[str]:
    """The generated text as JSON arguments ``{"text": ...}``, split one piece per token."""
    pieces = [orjson.dumps(t).decode()[1:-1] for t in tokens]
    pieces[0] = '{"text": "' + pieces[0]
    pieces[-1] = pieces[-1] + '"}'
    return pieces


def chat_body(
    *,
    response_id: str,
    created: int,
    model: str,
    tokens: list[str],
    mode: str,
    tool_name: str | None,
    digest: str,
    usage: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
    finish_reason: str = "length",
) -> dict[str, Any]:
    """A non-streaming ``chat.completion``; ``mode`` is ``text``, ``reasoning`` or ``tool``."""
    text = "".join(tokens)
    message: dict[str, Any] = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": []}
    if mode == "reasoning":
        message["content"] = ""
        message["reasoning_content"] = text
    elif mode == "tool":
        message["content"] = ""
        message["tool_calls"] = [
            {
                "id": tool_call_id(digest),
                "type": "function",
                "function": {"name": tool_name, "arguments": "".join(tool_arguments(tokens))},
            }
        ]
        finish_reason = "tool_calls"
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": usage,
        "kv_transfer_params": kv_transfer_params,
    }


class StreamFormat:
    """Builds the SSE events of one streamed answer, one event per output token.

    Completions: one ``text_completion`` chunk per token. Chat: a first
    chunk with ``delta.role``, then one ``chat.completion.chunk`` per token
    (``content``, ``reasoning_content`` or tool-call ``arguments``). The
    last token's chunk carries ``finish_reason``; with
    ``stream_options.include_usage`` a chunk with empty ``choices`` and
    ``usage`` follows; ``data: [DONE]`` ends the stream.
    """

    __slots__ = ("_head", "chat", "mode", "tool_name", "digest", "finish_reason")

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        chat: bool,
        mode: str,
        tool_name: str | None,
        digest: str,
        finish_reason: str = "length",
    ) -> None:
        self.finish_reason = finish_reason
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = orjson.dumps({"id": response_id, "object": kind, "created": created, "model": model})
        # Every chunk shares the envelope; only ``choices``/``usage`` differ.
        self._head = b"data: " + head[:-1] + b","
        self.chat = chat
        self.mode = mode
        self.tool_name = tool_name
        self.digest = digest

    def events(self, tokens: list[str], usage: dict[str, Any] | None) -> list[bytes]:
        """Every event of the stream; token ``i`` is event ``first_token_event() + i``."""
        out: list[bytes] = []
        last = len(tokens) - 1
        if not self.chat:
            for i, token in enumerate(tokens):
                out.append(self._choice({"index": 0, "text": token, "logprobs": None,
                                         **_finish(i == last, self.finish_reason)}))
        else:
            out.append(self._delta({"role": "assistant", "content": ""}, None))
            if self.mode == "tool":
                call = {
                    "index": 0,
                    "id": tool_call_id(self.digest),
                    "type": "function",
                    "function": {"name": self.tool_name, "arguments": ""},
                }
                out.append(self._delta({"tool_calls": [call]}, None))
                for i, piece in enumerate(tool_arguments(tokens)):
                    delta = {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
                    out.append(self._delta(delta, "tool_calls" if i == last else None))
            else:
                key = "reasoning_content" if self.mode == "reasoning" else "content"
                for i, token in enumerate(tokens):
                    out.append(self._delta({key: token}, self.finish_reason if i == last else None))
        if usage is not None:
            if usage.get("prompt_tokens_details", 0) is None:
                # vLLM writes stream chunks with exclude_none: no details, no key.
                usage = {k: v for k, v in usage.items() if v is not None}
            out.append(self._head + b'"choices":[],"usage":' + orjson.dumps(usage) + b"}\n\n")
        out.append(DONE_EVENT)
        return out

    def first_token_event(self) -> int:
        """Index of the event that carries the first token."""
        if not self.chat:
            return 0
        return 2 if self.mode == "tool" else 1

    def _delta(self, delta: dict[str, Any], finish_reason: str | None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if finish_reason is not None:
            choice["stop_reason"] = None
        return self._choice(choice)

    def _choice(self, choice: dict[str, Any]) -> bytes:
        return self._head + b'"choices":[' + orjson.dumps(choice) + b"]}\n\n"


def _finish(last: bool, reason: str) -> dict[str, Any]:
    return {"finish_reason": reason if last else None, "stop_reason": None}
