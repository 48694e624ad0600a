"""The PD legs and what comes back from them.

The rules are docs/contract.md, "Prefill and decode legs" and "Responses
and errors".

Pure functions from values to values: the prefill and decode bodies built
from the accepted client body, the check of the prefill answer's
``kv_transfer_params``, and the normalisation of the decode answer (whole or
as a stream of Server-Sent Events) before it reaches the client.
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
    "normalise_answer",
    "engine_error",
    "openai_error_type",
    "release_found_nothing",
    "release_said",
    "release_body",
    "release_unconfirmed",
    "merge_usage",
    "merge_answers",
    "SseRelay",
]

#: What the prefill leg asks of the engine: compute KV for a remote decode.
PREFILL_KV_REQUEST: Final[Mapping[str, Any]] = MappingProxyType({
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
})

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
    out["kv_transfer_params"] = dict(PREFILL_KV_REQUEST)
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


def check_prefill_answer(
    body: bytes, backend_id: str, kv_host_allowed: Callable[[str], bool], *, require_request_id: bool = False
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
    Every field that is kept goes on verbatim.
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


def _normalise_usage(usage: Any, cached_tokens: int | None) -> None:
    # docs/contract.md, "Responses and errors": a decode engine counts the transferred KV as cached; the
    # prefill leg's figure is the one that means something. A prefill engine
    # that did not report it (vLLM without --enable-prompt-tokens-details)
    # counts as 0 cached tokens, never null (docs/operate.md, "vLLM compatibility").
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
        _normalise_usage(answer.get("usage"), cached_tokens)
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


class SseRelay:
    """Splits a decode leg's SSE byte stream into events and normalises each one.

    Lines may end in LF, CRLF or CR; events are separated by blank lines
    (runs of them count as one) and are re-emitted with LF endings, so the
    output does not depend on how the engine's bytes were split. Every
    ``data:`` payload is parsed (an event that is not a JSON object fails the
    leg: it is never relayed) and re-encoded only when it carries something
    to fix (usage, internal fields, another model name); other lines of the
    event (``id:``, ``event:``, comments) are kept. ``feed`` returns the
    bytes to relay now. (A plain class: compiled, an extension type declared
    in ``planning.pxd``.)

    For one prompt of a batch (:meth:`batch`), every event is rewritten: its
    choices' ``index`` is the prompt's, its ``id`` the batch's first; a
    usage-only event is held back and summed, and ``[DONE]`` is relayed only
    after the last prompt, preceded by one event with the summed usage
    (docs/operate.md, "Batch prompts").
    """

    __slots__ = (
        "route", "model", "pd", "cached_tokens", "redact", "max_event_bytes", "_buffer", "_lines", "_event_size",
        "done", "error", "usage", "events", "good_before_error",
        "index", "last", "response_id", "prior_usage", "_held", "_drop",
    )

    def __init__(
        self, route: Route, model: str, pd: bool, cached_tokens: int | None, redact: bytes | None = None,
        max_event_bytes: int = 1 << 20,
    ) -> None:  # fmt: skip
        self.route = route
        self.model = model
        self.pd = pd
        self.cached_tokens = cached_tokens
        #: A secret (the engine credential) to scrub from every event.
        self.redact = redact
        self.max_event_bytes = max_event_bytes
        self._buffer = b""
        self._lines: list[bytes] = []
        self._event_size = 0
        #: The engine's ``data: [DONE]`` was seen.
        self.done = False
        #: An engine error event relayed to the client, if any.
        self.error: dict[str, Any] | None = None
        #: The last usage object seen (for the journal).
        self.usage: dict[str, Any] | None = None
        #: Number of events relayed.
        self.events = 0
        #: When :meth:`feed` raised: the good events it had before the bad one.
        self.good_before_error = b""
        #: A batch prompt's index (``None``: not part of a batch; see :meth:`batch`).
        self.index: int | None = None
        #: The batch's last prompt: its ``[DONE]`` ends the client's stream.
        self.last = True
        #: The ``id`` every event of the batch carries (the first one seen).
        self.response_id: Any = None
        #: The usage of the batch's earlier prompts, summed.
        self.prior_usage: dict[str, Any] | None = None
        #: The usage-only event held back (a batch's), to send summed before ``[DONE]``.
        self._held: dict[str, Any] | None = None
        #: The event just parsed is not relayed.
        self._drop = False

    def batch(self, index: int, last: bool, prior_usage: dict[str, Any] | None, response_id: Any) -> None:
        """Relay prompt ``index`` of a batch (``last``: the final one) after the earlier prompts'."""
        self.index = index
        self.last = last
        self.prior_usage = prior_usage
        self.usage = prior_usage
        self.response_id = response_id

    def feed(self, data: bytes) -> bytes:
        """Take engine bytes; return complete, normalised events to send to the client."""
        if self.done:
            return b""
        if (
            not self._buffer
            and not self._lines
            and len(data) > 2
            and data.find(b"\n") == len(data) - 2
            and data.endswith(b"\n\n")
            and b"\r" not in data
        ):
            # The usual read while tokens trickle in: one whole event of one line.
            line = data[:-2]
            self._check_size(len(line))
            self._event_size = 0
            try:
                fixed = self._one_line(line)
            except NarwhalError:
                self.good_before_error = b""
                raise
            return data if fixed is None else fixed
        buf = self._buffer + data if self._buffer else data
        if b"\r" in buf:
            # A CR at the very end may be the first half of a CRLF: keep it back.
            tail = b"\r" if buf.endswith(b"\r") else b""
            if tail:
                buf = buf[:-1]
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n") + tail
        end = buf.rfind(b"\n")
        if end < 0:
            self._buffer = buf
            self._check_size(len(buf))
            return b""
        self._buffer = buf[end + 1 :]
        out = []
        lines = self._lines
        try:
            for line in buf[:end].split(b"\n"):
                if line:
                    lines.append(line)
                    self._check_size(len(line))
                elif lines:
                    out.append(self._event(lines))
                    lines.clear()
                    self._event_size = 0
                    if self.done:
                        # Nothing after [DONE] is relayed: the stream is over.
                        self._buffer = b""
                        return b"".join(out)
            self._check_size(len(self._buffer))
        except NarwhalError:
            # The events before the bad one are relayed all the same, however
            # the engine's bytes happened to be split into reads.
            self.good_before_error = b"".join(out)
            raise
        return b"".join(out)

    def _one_line(self, line: bytes) -> bytes | None:
        # A whole event of one line: None to relay the engine's bytes as they
        # are, else the bytes to relay instead.
        secret = self.redact
        if not line.startswith(b"data:") or (secret is not None and secret in line):
            return self._event([line])
        self.events += 1
        payload = line[5:].lstrip(b" ")
        if payload == b"[DONE]":
            self.done = True
            return b"data: [DONE]\n\n" if self.index is None else self._batch_done(b"")
        fixed = self._payload(payload)
        if self._drop:
            self._drop = False
            return b""
        return None if fixed is None else b"data: " + wire.dumps(fixed) + b"\n\n"

    def _check_size(self, more: int) -> None:
        self._event_size += more
        if self._event_size > self.max_event_bytes:
            raise NarwhalError("stream event too large", status=502, code="bad_engine_response")

    def _event(self, lines: list[bytes]) -> bytes:
        self.events += 1
        secret = self.redact
        if secret is not None and any(secret in line for line in lines):
            lines = [line.replace(secret, b"[redacted]") for line in lines]
        data = [line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:")]
        if not data:
            return b"\n".join(lines) + b"\n\n"  # comments, retry: hints and the like
        payload = data[0] if len(data) == 1 else b"\n".join(data)
        others = [line for line in lines if not line.startswith(b"data:")]
        if payload == b"[DONE]":
            self.done = True
            prefix = b"".join(line + b"\n" for line in others)
            return prefix + b"data: [DONE]\n\n" if self.index is None else self._batch_done(prefix)
        fixed = self._payload(payload)
        if self._drop:
            self._drop = False
            return b""
        if fixed is None:
            return b"\n".join(lines) + b"\n\n"  # relay the engine's bytes
        return b"".join(line + b"\n" for line in others) + b"data: " + wire.dumps(fixed) + b"\n\n"

    def _payload(self, payload: bytes) -> dict[str, Any] | None:
        # One event's data: None when the engine's bytes go out as they are
        # (nothing to fix, or an error event), else the object fixed in place.
        try:
            obj = wire.loads_answer(payload)
        except wire.JsonError:
            # Never relay what the engine garbled: the leg has failed.
            raise NarwhalError("the engine sent an event that is not JSON", status=502,
                               code="bad_engine_response") from None
        if not isinstance(obj, dict):
            raise NarwhalError("the engine sent an event that is not a JSON object", status=502,
                               code="bad_engine_response")
        error = obj.get("error")
        if isinstance(error, dict):
            self.error = error
            etype = error.get("type")
            if isinstance(etype, str) and etype in _OPENAI_ERROR_TYPES:
                # vLLM's class name (BadRequestError) becomes OpenAI's type; message and param stay.
                error["type"] = _OPENAI_ERROR_TYPES[etype]
                return obj
            return None
        usage = obj.get("usage")
        index = self.index
        if (
            obj.get("model", self.model) == self.model and "kv_transfer_params" not in obj and usage is None
            and index is None
        ):
            return None
        if "model" in obj:
            obj["model"] = self.model
        obj.pop("kv_transfer_params", None)
        if isinstance(usage, dict):
            if self.pd:
                _normalise_usage(usage, self.cached_tokens)
            self.usage = usage if index is None else merge_usage(self.prior_usage, usage)
        if index is not None:
            if "id" in obj:
                if self.response_id is None:
                    self.response_id = obj["id"]
                else:
                    obj["id"] = self.response_id
            choices = obj.get("choices")
            if isinstance(choices, list):
                if not choices and isinstance(usage, dict):
                    # A usage-only event: held back, sent summed before the last [DONE].
                    self._held = obj
                    self._drop = True
                    return obj
                for choice in choices:
                    if isinstance(choice, dict):
                        choice["index"] = index + (_int(choice.get("index")) or 0)
        return obj

    def _batch_done(self, prefix: bytes) -> bytes:
        # A batch prompt's [DONE]: dropped but for the last prompt's, which
        # follows one usage event with the whole batch's usage (when the
        # engines sent usage at all).
        if not self.last:
            return b""
        out = b""
        held = self._held
        if held is not None and self.usage is not None:
            held["usage"] = self.usage
            out = b"data: " + wire.dumps(held) + b"\n\n"
        return out + prefix + b"data: [DONE]\n\n"
