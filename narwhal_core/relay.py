"""The decode leg's streamed answer, relayed to the client event by event.

The rules are docs/contract.md, "Responses and errors" (what a relayed
event may carry) and docs/operate.md, "Batch prompts" (one client stream
made of several prompts' streams). The whole-answer counterparts
(:func:`~narwhal_core.leg_bodies.normalise_answer`,
:func:`~narwhal_core.leg_bodies.merge_answers`) are in ``leg_bodies``; this
module holds only the stateful splitter, which runs for every streamed
chunk (compiled, it is an extension type declared in ``relay.pxd``).
"""

from __future__ import annotations

from typing import Any

from . import wire
from .contract import Route
from .errors import NarwhalError
from .leg_bodies import merge_usage, normalise_usage, openai_error_type

__all__ = ["SseRelay"]


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
    in ``relay.pxd``.)

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
            if isinstance(etype, str) and (renamed := openai_error_type(etype)) != etype:
                # vLLM's class name (BadRequestError) becomes OpenAI's type; message and param stay.
                error["type"] = renamed
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
                normalise_usage(usage, self.cached_tokens)
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
                        position = choice.get("index")
                        choice["index"] = index + (
                            position if isinstance(position, int) and not isinstance(position, bool) else 0
                        )
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
