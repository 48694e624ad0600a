"""The PD legs and what comes back from them.

The rules are docs/contract.md, "Prefill and decode legs" and "Responses
and errors".

Pure functions from values to values: the prefill and decode bodies built
from the accepted client body, the check of the prefill answer's
``kv_transfer_params``, the normalisation of a whole decode answer before it
reaches the client, engine errors and release verdicts. A streamed answer is
relayed by :class:`~narwhal_core.relay.SseRelay` (``relay``), which uses the
normalisations defined here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Final

import attrs

from . import wire
from .contract import CHAT, Route
from .errors import NarwhalError

__all__ = [
    "PREFILL_KV_REQUEST",
    "NO_KV_STOPPED",
    "NO_KV_OTHER",
    "prefill_body",
    "decode_body",
    "KvHandoff",
    "PrefillAnswerError",
    "check_prefill_answer",
    "unsupported_transfer_mode",
    "PULL_MODES",
    "transfer_mode_error",
    "normalise_answer",
    "engine_error",
    "openai_error_type",
    "release_found_nothing",
    "release_said",
    "release_body",
    "release_unconfirmed",
    "merge_usage",
    "merge_answers",
    "normalise_usage",
]


def _prefill_kv_request() -> dict[str, Any]:
    """A new copy of :data:`PREFILL_KV_REQUEST` (a dict display: far cheaper per leg than copying the proxy)."""
    return {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


#: What the prefill leg asks of the engine: compute KV for a remote decode.
PREFILL_KV_REQUEST: Final[Mapping[str, Any]] = MappingProxyType(_prefill_kv_request())

_DROPPED_FOR_PREFILL: Final = frozenset({"min_completion_tokens", "stream_options"})
_INTERNAL_ANSWER_FIELDS: Final = ("kv_transfer_params",)
#: The journal's reason for a prefill answer with ``kv_transfer_params: null``.
NO_KV_STOPPED: Final = (
    "the prefill answer carried no kv_transfer_params: its one token ended the sequence "
    "(finish_reason stop), so the engine holds no KV; the decode leg recomputes the prompt"
)
NO_KV_OTHER: Final = (
    "the prefill answer carried no kv_transfer_params (finish_reason {}): the engine holds no KV "
    "for it; the decode leg recomputes the prompt"
)
_MAX_ENGINE_MESSAGE: Final = 1000


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, no stream, KV kept for a remote decode.

    Edits, and only these (docs/contract.md, "Prefill and decode legs"): ``max_tokens`` = 1 (and
    ``max_completion_tokens`` = 1 where the client sent it), ``stream`` =
    false, ``min_completion_tokens``/``stream_options`` removed,
    ``kv_transfer_params`` added last. ``min_tokens`` becomes 1 when the
    client asked for at least one token, and is removed otherwise: the one
    token the prefill samples may then be an end of sequence only when the
    client allowed it (an engine refuses ``min_tokens`` above ``max_tokens``,
    so the client's own value cannot be sent; docs/operate.md, "Prefill
    answers without KV"). Every other key keeps its value and its position;
    ``max_tokens`` and ``stream`` are appended when absent.
    """
    out = _one_token_body(body, _DROPPED_FOR_PREFILL, keep_min_tokens=True)
    out["kv_transfer_params"] = _prefill_kv_request()
    return out


def _one_token_body(body: dict[str, Any], dropped: frozenset[str], *, keep_min_tokens: bool) -> dict[str, Any]:
    """``body`` asking for one whole-answer token: the rewrite both one-token legs share.

    ``max_tokens``/``max_completion_tokens`` = 1, ``stream`` = false, the
    keys in ``dropped`` and ``kv_transfer_params`` removed; with
    ``keep_min_tokens`` a ``min_tokens`` of at least one becomes 1 (any
    other value is removed). Every other key keeps its value and position;
    ``max_tokens`` and ``stream`` are appended when absent.
    """
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in dropped or key == "kv_transfer_params":
            continue
        if key == "min_tokens" and keep_min_tokens:
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                continue
            value = 1
        elif key == "max_tokens" or key == "max_completion_tokens":
            value = 1
        elif key == "stream":
            value = False
        out[key] = value
    if "max_tokens" not in out:
        out["max_tokens"] = 1
    if "stream" not in out:
        out["stream"] = False
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The decode leg's body: the client's body plus the prefill's KV params verbatim.

    (docs/contract.md, "Prefill and decode legs".)

    Without params (the prefill handed off none) it is the client's body as
    it is: a plain request, which recomputes the prompt.
    """
    out = dict(body)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = kv_transfer_params
    return out


@attrs.define(kw_only=True)
class KvHandoff:
    """What a successful prefill leg hands to the decode leg (a value; not frozen, see AcceptedRequest)."""

    #: The prefill answer's ``kv_transfer_params``, passed on verbatim;
    #: ``None`` when the answer carried none (``null``): nothing to hand off,
    #: the decode leg runs as a plain request and recomputes the prompt.
    params: dict[str, Any] | None
    #: The engine's name for the KV: its ``remote_request_id`` (engines may
    #: suffix the ID they were sent), else the leg's backend ID.
    owner: str
    #: ``usage.prompt_tokens_details.cached_tokens`` of the prefill answer.
    cached_tokens: int | None
    #: When ``params`` is ``None``: why, for the journal.
    reason: str | None = None
    #: When ``params`` is ``None``: the prefill answer's ``finish_reason``.
    finish_reason: str | None = None
    #: Every decode request carrying this KV goes with the prefill leg's ``X-Request-Id``:
    #: vLLM's push mode pairs the two engines' requests by it (docs/operate.md, "vLLM compatibility").
    shared_id: bool = False


class PrefillAnswerError(NarwhalError):
    """A prefill answer without usable ``kv_transfer_params``: a failed prefill leg."""

    status = 502
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, code="prefill_failed")


def _cached_tokens(answer: dict[str, Any]) -> int | None:
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


def _finish_reason(answer: dict[str, Any]) -> str | None:
    choices = answer.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = choices[0].get("finish_reason")
        if isinstance(reason, str):
            return reason[:40]
    return None


#: Keys only NIXL connectors of version 2 and later send (docs/operate.md, "vLLM compatibility"):
#: an answer with one of them and no ``remote_request_id`` is incomplete, not connector 1.
_CONNECTOR_2_KEYS: Final = ("transfer_mode", "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time")


def _block_ids_ok(blocks: list[Any]) -> bool:
    # A list of block ids, or one list of them per KV-cache group (vLLM's HMA connectors).
    if blocks and isinstance(blocks[0], list):
        return all(
            isinstance(group, list) and all(isinstance(b, int) and not isinstance(b, bool) for b in group)
            for group in blocks
        )
    return all(isinstance(b, int) and not isinstance(b, bool) for b in blocks)


#: The KV transfer modes the pull protocol drives: the decode engine pulls the blocks (vLLM's
#: NIXL ``transfer_mode: "pull"``; absent before the KV lease: pull is all there was).
PULL_MODES: Final = frozenset({"pull"})


def check_prefill_answer(
    body: bytes, backend_id: str, kv_host_allowed: Callable[[str], bool], *, require_request_id: bool = False,
    modes: frozenset[str] = PULL_MODES,
) -> KvHandoff:
    """Validate a 2xx prefill answer; raise :class:`PrefillAnswerError` if unusable.

    The rules: docs/contract.md, "Prefill and decode legs".

    ``remote_host`` must name a host of the configured fleet (``kv_host_allowed``),
    so a forged answer cannot point a decode engine elsewhere.

    ``kv_transfer_params`` ``null`` (or absent) is not an error: vLLM's NIXL
    connector hands off nothing when the one-token prefill ended on an end of
    sequence or a stop token (``FINISHED_STOPPED``, connectors before the KV
    lease) and then holds no blocks. The handoff returned has ``params``
    ``None`` and the reason; the decode leg runs without KV (docs/operate.md,
    "Prefill answers without KV").

    Params the decode engine cannot use are refused, never forwarded: a vLLM
    decode engine may die on a missing key (docs/operate.md, "vLLM
    compatibility"). ``remote_request_id`` may be absent only from a connector
    1 engine: not when the params carry a later connector's keys, a block list
    per KV-cache group, or ``require_request_id`` (the engine sent it before).
    Every field that is kept goes on verbatim. Params in a transfer mode
    not in ``modes`` (:func:`unsupported_transfer_mode`) are returned
    unchecked: the caller refuses them.
    """
    try:
        # Exact decoding: the KV params go on to the decode leg verbatim.
        answer = wire.loads(body)
    except wire.JsonError as exc:
        raise PrefillAnswerError(f"prefill answer is not JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise PrefillAnswerError("prefill answer is not a JSON object")
    params = answer.get("kv_transfer_params")
    if params is None:
        finish = _finish_reason(answer)
        return KvHandoff(
            params=None, owner=backend_id, cached_tokens=_cached_tokens(answer), finish_reason=finish,
            reason=NO_KV_STOPPED if finish == "stop" else NO_KV_OTHER.format(finish),
        )
    if not isinstance(params, dict):
        raise PrefillAnswerError("prefill answer's kv_transfer_params is not an object")
    if unsupported_transfer_mode(params, modes) is not None:
        # Refused whatever else it holds (answers.py) and never forwarded: only its owner matters.
        owner = params.get("remote_request_id")
        return KvHandoff(
            params=params, owner=owner if isinstance(owner, str) and owner else backend_id,
            cached_tokens=_cached_tokens(answer),
        )
    if params.get("do_remote_prefill") is not True:
        raise PrefillAnswerError("kv_transfer_params.do_remote_prefill is not true")
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise PrefillAnswerError("kv_transfer_params.remote_engine_id is missing")
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list):
        raise PrefillAnswerError("kv_transfer_params.remote_block_ids is not a list")
    if not _block_ids_ok(blocks):
        raise PrefillAnswerError("kv_transfer_params.remote_block_ids is not a list of block ids (or one per group)")
    host = params.get("remote_host")
    if not isinstance(host, str) or not host:
        raise PrefillAnswerError("kv_transfer_params.remote_host is missing")
    if not kv_host_allowed(host):
        raise PrefillAnswerError("kv_transfer_params.remote_host is not an engine of this fleet")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise PrefillAnswerError("kv_transfer_params.remote_port is not a port number")
    owner = params.get("remote_request_id")
    if "remote_request_id" in params or require_request_id:
        if not isinstance(owner, str) or not owner:
            raise PrefillAnswerError("kv_transfer_params.remote_request_id is missing or not a string")
    elif (blocks and isinstance(blocks[0], list)) or any(key in params for key in _CONNECTOR_2_KEYS):
        raise PrefillAnswerError("kv_transfer_params.remote_request_id is missing")
    if not isinstance(owner, str) or not owner:
        owner = backend_id  # connector 1: the engine names its blocks by the leg's own request ID
    return KvHandoff(params=params, owner=owner, cached_tokens=_cached_tokens(answer))


def unsupported_transfer_mode(params: dict[str, Any], modes: frozenset[str] = PULL_MODES) -> str | None:
    """The prefill answer's ``transfer_mode`` if it is not one of ``modes``, else ``None``.

    vLLM's push scheduler answers ``transfer_mode: "push"``: its prefill
    engine writes the KV into blocks a decode engine registered, which only a
    decode leg built for push arranges (``engine.protocol = "vllm-nixl-push"``;
    docs/operate.md, "vLLM compatibility"). The value is cut to 40
    characters (it goes into the log and the error).
    """
    mode = params.get("transfer_mode", "pull")
    if mode in modes:
        return None
    return mode[:40] if isinstance(mode, str) else wire.dumps(mode)[:40].decode("utf-8", "replace")


def transfer_mode_error(mode: str) -> NarwhalError:
    """The 502 a request gets when its prefill answer's KV ``transfer_mode`` is not one Narwhal drives."""
    return NarwhalError(
        f"The prefill engine answered kv_transfer_params.transfer_mode {mode!r}; Narwhal drives only the "
        "'pull' mode (run the NIXL connector in pull mode on every engine).",
        status=502, code="unsupported_kv_transfer_mode",
    )


def normalise_usage(usage: Any, cached_tokens: int | None) -> None:
    """Set a PD answer's ``cached_tokens`` to the prefill leg's figure, in place (whole or streamed answers).

    docs/contract.md, "Responses and errors": a decode engine counts the
    transferred KV as cached; the prefill leg's figure is the one that means
    something. A prefill engine that did not report it (vLLM without
    --enable-prompt-tokens-details) counts as 0 cached tokens, never null
    (docs/operate.md, "vLLM compatibility").
    """
    if not isinstance(usage, dict):
        return
    cached = 0 if cached_tokens is None else cached_tokens
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        details["cached_tokens"] = cached
    else:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}


def _normalise_message(message: Any) -> None:
    # content is null when the message carries only reasoning or tool calls (docs/contract.md, "Responses and errors").
    if not isinstance(message, dict) or message.get("content") not in ("", None):
        return
    if message.get("tool_calls") or message.get("reasoning_content") or message.get("reasoning"):
        message["content"] = None


def normalise_answer(
    route: Route,
    answer: dict[str, Any],
    model: str,
    *,
    pd: bool,
    cached_tokens: int | None,
) -> dict[str, Any]:
    """Make a decode leg's answer object the client's answer (docs/contract.md, "Responses and errors"), in place."""
    answer["object"] = "chat.completion" if route == CHAT else "text_completion"
    answer["model"] = model
    for key in _INTERNAL_ANSWER_FIELDS:
        answer.pop(key, None)
    choices = answer.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                choice.pop("kv_transfer_params", None)
                if route == CHAT:
                    _normalise_message(choice.get("message"))
    if pd:
        normalise_usage(answer.get("usage"), cached_tokens)
    return answer


#: vLLM names an error by its exception class (``BadRequestError``...); OpenAI's ``type`` is one of
#: a few snake_case words (docs/operate.md, "vLLM compatibility").
_OPENAI_ERROR_TYPES: Final = MappingProxyType({
    "BadRequestError": "invalid_request_error",
    "NotFoundError": "invalid_request_error",
    "UnprocessableEntityError": "invalid_request_error",
    "NotImplementedError": "invalid_request_error",
    "AuthenticationError": "authentication_error",
    "PermissionDeniedError": "permission_error",
    "RateLimitError": "rate_limit_error",
    "InternalServerError": "server_error",
    "ServiceUnavailableError": "server_error",
})


def openai_error_type(value: str) -> str:
    """An engine error's ``type`` as OpenAI names it: vLLM's class names mapped, others kept."""
    return _OPENAI_ERROR_TYPES.get(value, value)


def engine_error(status: int, body: bytes) -> NarwhalError:
    """An engine's 4xx answer as an error for the client, in the OpenAI envelope.

    (docs/contract.md, "Responses and errors".)

    vLLM answers either with the envelope or with a flat error object
    (``{"object": "error", "message": ...}``); both become the envelope with
    the engine's status. A body that is neither keeps only the status.
    """
    message = None
    etype = "invalid_request_error"
    param = None
    code = None
    try:
        data = wire.loads_answer(body)
    except wire.JsonError:
        data = None
    if isinstance(data, dict):
        nested = data.get("error")
        inner: dict[str, Any] = nested if isinstance(nested, dict) else data
        text = inner.get("message")
        if isinstance(text, str):
            message = text[:_MAX_ENGINE_MESSAGE]
        value = inner.get("type")
        if isinstance(value, str):
            etype = openai_error_type(value[:100])
        value = inner.get("param")
        if isinstance(value, str):
            param = value[:200]
        value = inner.get("code")
        if isinstance(value, str):
            code = value[:100]
    if message is None:
        message = f"The engine refused the request with status {status}."
    return NarwhalError(message, status=status, type=etype, param=param, code=code)


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def merge_usage(first: Any, second: Any) -> dict[str, Any] | None:
    """Two prompts' usage objects as one: token counts summed (docs/operate.md, "Batch prompts").

    A count is summed when both sides give an integer; ``cached_tokens``
    becomes ``None`` when either side does not know it. The second
    object's other keys are kept. A side that is not an object counts as
    absent.
    """
    if not isinstance(first, dict):
        return dict(second) if isinstance(second, dict) else None
    if not isinstance(second, dict):
        return dict(first)
    out = dict(second)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        a, b = _int(first.get(key)), _int(second.get(key))
        if a is not None and b is not None:
            out[key] = a + b
    a_details, b_details = first.get("prompt_tokens_details"), second.get("prompt_tokens_details")
    if isinstance(a_details, dict) or isinstance(b_details, dict):
        details = dict(b_details) if isinstance(b_details, dict) else {}
        a = _int(a_details.get("cached_tokens")) if isinstance(a_details, dict) else None
        b = _int(details.get("cached_tokens"))
        details["cached_tokens"] = a + b if a is not None and b is not None else None
        out["prompt_tokens_details"] = details
    return out


def merge_answers(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """A batch's normalised answers, in prompt order, as one answer (docs/operate.md, "Batch prompts").

    The first answer's ``id``, ``created`` and other fields; every answer's
    choices in prompt order, ``index`` set as OpenAI does (prompt index
    times ``n``, plus the choice's own index; ``n`` is always 1 here); the
    usage summed (:func:`merge_usage`).
    """
    out = answers[0]
    choices: list[Any] = []
    usage: Any = None
    for position, answer in enumerate(answers):
        listed = answer.get("choices")
        if isinstance(listed, list):
            for choice in listed:
                if isinstance(choice, dict):
                    choice["index"] = position + (_int(choice.get("index")) or 0)
                choices.append(choice)
        usage = merge_usage(usage, answer.get("usage")) if position else answer.get("usage")
    out["choices"] = choices
    if usage is not None or "usage" in out:
        out["usage"] = usage
    return out


def release_found_nothing(body: bytes) -> bool:
    """An abort endpoint's answer says the engine held no KV for the owner.

    The engine simulator (and any engine following its convention) answers
    ``{"request_id": ..., "released": false, ...}`` when the blocks were
    already gone: pulled by a decode engine (one whose leg then failed),
    freed at the decode engine's word (its request ended before the pull),
    or freed by the lease. Any other answer -- no body, not JSON, no
    ``released`` field -- says nothing either way.
    """
    try:
        answer = wire.loads(body)
    except wire.JsonError:
        return False
    return isinstance(answer, dict) and answer.get("released") is False


def release_said(body: bytes) -> bool | None:
    """What an abort endpoint's answer says it did: its ``released`` field, or ``None`` if it says nothing.

    The engine simulator answers ``{"request_id": ..., "released": true|false,
    ...}``: ``false`` when the blocks were already gone (see
    :func:`release_found_nothing`). SGLang's ``/abort_request`` answers 200
    with no body: it took the abort and says nothing of the blocks.
    """
    try:
        answer = wire.loads(body)
    except wire.JsonError:
        return None
    said = answer.get("released") if isinstance(answer, dict) else None
    return said if isinstance(said, bool) else None


#: Removed from a ``decode_pull`` release: they would only make its answer
#: longer (``echo``, log probabilities, several choices) or refuse it
#: (``min_tokens`` above one token). None of them changes the prompt.
_DROPPED_FOR_RELEASE: Final = frozenset({
    "min_tokens", "min_completion_tokens", "stream_options", "echo", "logprobs", "top_logprobs",
    "prompt_logprobs", "n", "best_of", "use_beam_search",
})


def release_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """A ``decode_pull`` release: the client's body as a one-token, whole-answer decode leg.

    The decode engine admits it, pulls the prefill's KV (which frees the
    prefill engine's blocks, docs/operate.md "KV release in operation") and
    answers with one token that nobody reads. ``max_tokens`` (and
    ``max_completion_tokens`` where sent) = 1, ``stream`` = false, the keys
    of ``_DROPPED_FOR_RELEASE`` removed, the prefill's ``kv_transfer_params``
    verbatim; the prompt is untouched (the KV is the prompt's).
    """
    out = _one_token_body(body, _DROPPED_FOR_RELEASE, keep_min_tokens=False)
    out["kv_transfer_params"] = kv_transfer_params
    return out


def release_unconfirmed(status: int, body: bytes) -> str | None:
    """Why a ``decode_pull`` release's answer does not confirm the pull, or ``None`` when it does.

    A whole (non-streamed) 2xx answer comes once the decode engine has run
    the request, its KV pulled. An error object in it, or a choice that
    finished with ``error`` or ``abort``, says the run did not go through.
    """
    if not 200 <= status < 300:
        return f"the decode engine answered {status}"
    if not body.strip():
        return "the decode engine's answer was empty"
    try:
        answer = wire.loads_answer(body)
    except wire.JsonError:
        return None  # (an answer longer than the part read: its 2xx head came after the run)
    if not isinstance(answer, dict):
        return "the decode engine's answer is not a JSON object"
    if answer.get("error") is not None:
        return "the decode engine answered an error"
    choices = answer.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict) and choice.get("finish_reason") in ("error", "abort"):
                return f"the decode engine finished the release with {choice['finish_reason']!r}"
    return None
