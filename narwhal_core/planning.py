"""The PD legs (SPEC §3) and what comes back from them (SPEC §2.3).

Pure functions from values to values: the prefill and decode bodies built
from the accepted client body, the check of the prefill answer's
``kv_transfer_params``, and the normalisation of the decode answer (whole or
as a stream of Server-Sent Events) before it reaches the client.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

import attrs

from . import wire
from .contract import CHAT, Route
from .errors import NarwhalError

__all__ = [
    "PREFILL_KV_REQUEST",
    "prefill_body",
    "decode_body",
    "KvHandoff",
    "PrefillAnswerError",
    "check_prefill_answer",
    "normalise_answer",
    "engine_error",
    "release_found_nothing",
    "SseRelay",
]

#: What the prefill leg asks of the engine: compute KV for a remote decode.
PREFILL_KV_REQUEST: Final[dict[str, Any]] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_DROPPED_FOR_PREFILL: Final = frozenset({"min_tokens", "min_completion_tokens", "stream_options"})
_INTERNAL_ANSWER_FIELDS: Final = ("kv_transfer_params",)
_MAX_ENGINE_MESSAGE: Final = 1000


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one token, no stream, KV kept for a remote decode.

    Edits, and only these (SPEC §3.1): ``max_tokens`` = 1 (and
    ``max_completion_tokens`` = 1 where the client sent it), ``stream`` =
    false, ``min_tokens``/``min_completion_tokens``/``stream_options`` removed,
    ``kv_transfer_params`` added last. Every other key keeps its value and its
    position; ``max_tokens`` and ``stream`` are appended when absent.
    """
    out: dict[str, Any] = {}
    for key, value in body.items():
        if key in _DROPPED_FOR_PREFILL:
            continue
        if key == "max_tokens" or key == "max_completion_tokens":
            value = 1
        elif key == "stream":
            value = False
        out[key] = value
    if "max_tokens" not in out:
        out["max_tokens"] = 1
    if "stream" not in out:
        out["stream"] = False
    out["kv_transfer_params"] = dict(PREFILL_KV_REQUEST)
    return out


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The decode leg's body: the client's body plus the prefill's KV params verbatim (SPEC §3.3)."""
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    return out


@attrs.define(kw_only=True)
class KvHandoff:
    """What a successful prefill leg hands to the decode leg (a value; not frozen, see AcceptedRequest)."""

    #: The prefill answer's ``kv_transfer_params``, passed on verbatim.
    params: dict[str, Any]
    #: The engine's name for the KV: its ``remote_request_id`` (engines may
    #: suffix the ID they were sent), else the leg's backend ID.
    owner: str
    #: ``usage.prompt_tokens_details.cached_tokens`` of the prefill answer.
    cached_tokens: int | None


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


def check_prefill_answer(
    body: bytes, backend_id: str, kv_host_allowed: Callable[[str], bool]
) -> KvHandoff:
    """Validate a 2xx prefill answer (SPEC §3.2); raise :class:`PrefillAnswerError` if unusable.

    ``remote_host`` must name a host of the configured fleet (``kv_host_allowed``),
    so a forged answer cannot point a decode engine elsewhere.
    """
    try:
        # Exact decoding: the KV params go on to the decode leg verbatim.
        answer = wire.loads(body)
    except wire.JsonError as exc:
        raise PrefillAnswerError(f"prefill answer is not JSON: {exc}") from None
    if not isinstance(answer, dict):
        raise PrefillAnswerError("prefill answer is not a JSON object")
    params = answer.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise PrefillAnswerError("prefill answer carries no kv_transfer_params")
    if params.get("do_remote_prefill") is not True:
        raise PrefillAnswerError("kv_transfer_params.do_remote_prefill is not true")
    engine_id = params.get("remote_engine_id")
    if not isinstance(engine_id, str) or not engine_id:
        raise PrefillAnswerError("kv_transfer_params.remote_engine_id is missing")
    blocks = params.get("remote_block_ids")
    if not isinstance(blocks, list):
        raise PrefillAnswerError("kv_transfer_params.remote_block_ids is not a list")
    host = params.get("remote_host")
    if not isinstance(host, str) or not host:
        raise PrefillAnswerError("kv_transfer_params.remote_host is missing")
    if not kv_host_allowed(host):
        raise PrefillAnswerError("kv_transfer_params.remote_host is not an engine of this fleet")
    port = params.get("remote_port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise PrefillAnswerError("kv_transfer_params.remote_port is not a port number")
    owner = params.get("remote_request_id")
    if not isinstance(owner, str) or not owner:
        owner = backend_id
    return KvHandoff(params=params, owner=owner, cached_tokens=_cached_tokens(answer))


def _normalise_usage(usage: Any, cached_tokens: int | None) -> None:
    # SPEC §2.3: a decode engine counts the transferred KV as cached; the
    # prefill leg's figure is the one that means something.
    if not isinstance(usage, dict):
        return
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        details["cached_tokens"] = cached_tokens
    elif cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}


def _normalise_message(message: Any) -> None:
    # Seed: content is null when the message carries only reasoning or tool calls.
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
    """Make a decode leg's answer object the client's answer (SPEC §2.3), in place."""
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


def engine_error(status: int, body: bytes) -> NarwhalError:
    """An engine's 4xx answer as an error for the client, in the OpenAI envelope (SPEC §2.3).

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
            etype = value[:100]
        value = inner.get("param")
        if isinstance(value, str):
            param = value[:200]
        value = inner.get("code")
        if isinstance(value, str):
            code = value[:100]
    if message is None:
        message = f"The engine refused the request with status {status}."
    return NarwhalError(message, status=status, type=etype, param=param, code=code)


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
    """

    __slots__ = (
        "route", "model", "pd", "cached_tokens", "redact", "max_event_bytes", "_buffer", "_lines", "_event_size",
        "done", "error", "usage", "events", "good_before_error",
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
            return b"data: [DONE]\n\n"
        fixed = self._payload(payload)
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
            return b"".join(line + b"\n" for line in others) + b"data: [DONE]\n\n"
        fixed = self._payload(payload)
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
            return None
        usage = obj.get("usage")
        if obj.get("model", self.model) == self.model and "kv_transfer_params" not in obj and usage is None:
            return None
        if "model" in obj:
            obj["model"] = self.model
        obj.pop("kv_transfer_params", None)
        if isinstance(usage, dict):
            if self.pd:
                _normalise_usage(usage, self.cached_tokens)
            self.usage = usage
        return obj
