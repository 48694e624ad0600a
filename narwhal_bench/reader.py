"""Reading one answer: HTTP/1.1 response bytes in, token arrival times out.

:class:`ResponseReader` is fed the bytes of one response as they arrive,
each read with the time it arrived (``feed(data, now)``); it never reads a
clock or a socket, so the socket client and the virtual fleet share it. It
parses the HTTP framing with httptools (chunked or ``Content-Length``), splits
an SSE body into events, and records the time of every event that carries
output (text, chat content, reasoning or tool-call arguments).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import httptools
import orjson

__all__ = ["ResponseReader", "request_bytes"]


def request_bytes(host: str, target: str, body: bytes, *, api_key: str | None = None,
                  keep_alive: bool = True, extra: tuple[tuple[str, str], ...] = ()) -> bytes:  # fmt: skip
    """One ``POST`` with a JSON body."""
    lines = [f"POST {target} HTTP/1.1", f"Host: {host}", "Content-Type: application/json",
             "Accept: text/event-stream, application/json", f"Content-Length: {len(body)}"]  # fmt: skip
    if api_key:
        lines.append(f"Authorization: Bearer {api_key}")
    if not keep_alive:
        lines.append("Connection: close")
    lines.extend(f"{k}: {v}" for k, v in extra)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class ResponseReader:
    """The state of one response being read."""

    __slots__ = (
        "_parser", "status", "complete", "keep_alive", "is_sse", "_buffer", "_body", "token_times",
        "error", "cached_tokens", "_now", "_content_type", "_header", "_done_event", "completion_tokens",
        "done_at", "stamps",
    )  # fmt: skip

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.complete = False
        self.keep_alive = False
        self.is_sse = False
        self._buffer = b""
        self._body: list[bytes] = []
        #: Arrival time of every output token seen.
        self.token_times: list[float] = []
        self.error: str | None = None
        self.cached_tokens: int | None = None
        self.completion_tokens: int | None = None
        self._now = 0.0
        self._content_type = b""
        self._header = b""
        self._done_event = False
        #: When the read that completed the response arrived.
        self.done_at: float | None = None
        #: Times for the next output events, oldest first, when the sender knows them
        #: better than the read time (the virtual fleet); an event takes the read time
        #: when this is empty.
        self.stamps: deque[float] = deque()

    def feed(self, data: bytes, now: float) -> None:
        """Bytes of the response as read at ``now``; raises ``ValueError`` on bad HTTP."""
        self._now = now
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # pragma: no cover - never asked for
            raise ValueError("unexpected protocol upgrade") from None
        except httptools.HttpParserError as exc:
            raise ValueError(f"bad HTTP response: {exc}") from None

    def eof(self) -> None:
        """The connection closed: a response without a length ends here."""
        if not self.complete and self.status:
            try:
                self._parser.feed_data(b"")
            except httptools.HttpParserError:
                pass

    # httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self._content_type = value.lower()

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        self.is_sse = self._content_type.startswith(b"text/event-stream")

    def on_body(self, body: bytes) -> None:
        if not self.is_sse:
            self._body.append(body)
            return
        data = self._buffer + body if self._buffer else body
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        events = data.split(b"\n\n")
        self._buffer = events.pop()
        for event in events:
            self._event(event)

    def on_message_complete(self) -> None:
        self.complete = True
        self.done_at = self._now
        if self.is_sse:
            if self._buffer.strip():
                self._event(self._buffer)
                self._buffer = b""
            if self.status == 200 and not self._done_event and self.error is None:
                self.error = "stream ended without [DONE]"
            return
        body = b"".join(self._body)
        self._body = []
        try:
            data = orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            data = None
        if self.status != 200:
            message = None
            if isinstance(data, dict) and isinstance(data.get("error"), dict):
                message = data["error"].get("message")
            self.error = f"HTTP {self.status}: {message or body[:200].decode('utf-8', 'replace')}"
            return
        if not isinstance(data, dict):
            self.error = "answer is not a JSON object"
            return
        usage = data.get("usage")
        count = self._usage(usage)
        # A whole answer: every token arrives now.
        if count is None:
            count = 1 if _has_output(data) else 0
        self.token_times.extend([self._now] * count)

    # SSE

    def _event(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self._done_event = True
                continue
            try:
                data = orjson.loads(payload)
            except orjson.JSONDecodeError:
                self.error = "malformed SSE event"
                continue
            if not isinstance(data, dict):
                continue
            if "error" in data:
                err = data["error"]
                self.error = "stream error: " + str(err.get("message") if isinstance(err, dict) else err)
                continue
            if data.get("usage"):
                self._usage(data["usage"])
            if _has_output(data):
                self.token_times.append(self.stamps.popleft() if self.stamps else self._now)

    def _usage(self, usage: Any) -> int | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and type(details.get("cached_tokens")) is int:
            self.cached_tokens = details["cached_tokens"]
        tokens = usage.get("completion_tokens")
        if type(tokens) is int:
            self.completion_tokens = tokens
            return tokens
        return None


def _has_output(data: dict[str, Any]) -> bool:
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    choice = choices[0]
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    for key in ("delta", "message"):
        part = choice.get(key)
        if isinstance(part, dict):
            if part.get("content") or part.get("reasoning_content") or part.get("reasoning"):
                return True
            calls = part.get("tool_calls")
            if isinstance(calls, list):
                for call in calls:
                    fn = call.get("function") if isinstance(call, dict) else None
                    if isinstance(fn, dict) and fn.get("arguments"):
                        return True
    return False
