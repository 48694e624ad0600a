"""The codec: a cheap factory of connections sharing one bounded memory, and the protocols adapters see.

``Codec()`` makes the client-facing :class:`~.server.ServerConnection` and
the engine-side :class:`~.engine.EngineConnection` objects of one router;
they share the codec's :class:`~.grammar.LineMemory` (lines read and written
before), and nothing is shared between two codecs. The router depends only
on the protocols below, so a test can run it on another codec (the h11
oracle, ``tests/core/http_reference.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from narwhal_core.http.engine import EngineConnection
from narwhal_core.http.grammar import (
    DEFAULT_ENGINE_MAX_BODY_BYTES,
    DEFAULT_ENGINE_MAX_HEADER_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_REQUEST_LINE_BYTES,
    EngineEvent,
    LineMemory,
    ServerEvent,
)
from narwhal_core.http.server import ServerConnection

__all__ = ["Codec", "CodecLike", "EngineCodec", "ServerCodec"]


class ServerCodec(Protocol):
    """What a client connection offers (see :class:`~.server.ServerConnection`)."""

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the client; ``b""`` means EOF."""

    def next_event(self) -> ServerEvent:
        """The next request event, NEED_DATA or PAUSED."""

    def send_continue(self) -> bytes:
        """``100 Continue`` for a ContinueExpected."""

    def send_response(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """A complete response."""

    def send_stream_start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The head of a streamed response."""

    def send_stream_data(self, data: bytes) -> bytes:
        """A piece of a streamed body."""

    def send_stream_end(self) -> bytes:
        """The end of a streamed body."""

    def send_error_response(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """A complete response after which the connection closes."""

    def send_failed(self) -> None:
        """Our bytes could not be written; the connection is dead."""

    @property
    def must_close(self) -> bool:
        """Close the socket after the current response."""

    @property
    def in_response(self) -> bool:
        """A response has started and is not finished."""

    @property
    def has_partial_request(self) -> bool:
        """Bytes of a not-yet-returned request are buffered."""

    @property
    def reading_body(self) -> bool:
        """The current request's head is parsed and its body is not complete."""

    @property
    def buffered_bytes(self) -> int:
        """Bytes held of requests not yet returned."""

    @property
    def partial_target(self) -> str | None:
        """The target of the request being read (not yet returned whole), once its request line is in."""


class EngineCodec(Protocol):
    """What an engine exchange offers (see :class:`~.engine.EngineConnection`)."""

    def send_request(self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The whole request as bytes to write."""

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the engine; ``b""`` means EOF."""

    def next_event(self) -> EngineEvent:
        """The next response event or NEED_DATA."""


class CodecLike(Protocol):
    """A source of HTTP/1.1 connection objects: what the router depends on."""

    def server_connection(
        self,
        *,
        max_request_line_bytes: int = ...,
        max_header_bytes: int = ...,
        max_headers: int = ...,
        max_body_bytes: int = ...,
    ) -> ServerCodec:
        """A new client connection."""

    def engine_connection(
        self,
        *,
        max_header_bytes: int = ...,
        max_body_bytes: int | None = ...,
    ) -> EngineCodec:
        """A new engine exchange."""


class Codec:
    """Narwhal's HTTP/1.1 codec. Construct one per router (cheap: a few empty tables)."""

    __slots__ = ("memory",)

    def __init__(self) -> None:
        #: What the connections of this codec have read and written before (bounded).
        self.memory = LineMemory()

    def server_connection(
        self,
        *,
        max_request_line_bytes: int = DEFAULT_MAX_REQUEST_LINE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> ServerConnection:
        """A new client connection."""
        return ServerConnection(
            max_request_line_bytes=max_request_line_bytes,
            max_header_bytes=max_header_bytes,
            max_headers=max_headers,
            max_body_bytes=max_body_bytes,
            memory=self.memory,
        )

    def engine_connection(
        self,
        *,
        max_header_bytes: int = DEFAULT_ENGINE_MAX_HEADER_BYTES,
        max_body_bytes: int | None = DEFAULT_ENGINE_MAX_BODY_BYTES,
    ) -> EngineConnection:
        """A new engine exchange."""
        return EngineConnection(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes, memory=self.memory)
