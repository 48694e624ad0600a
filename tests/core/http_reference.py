"""The test oracle of the HTTP/1.1 codec (``narwhal_core.http``): h11, with the codec's own strictness on top.

The product codec is compared with these byte for byte (``test_http.py``,
``tests/security/test_fuzz.py``, ``tests/security/test_hostile_http.py``),
and the router driver may run the router on it (``router_driver.py``):

* :class:`ReferenceServerConnection` is the product's
  :class:`~narwhal_core.http.server.ServerConnection` with every request
  head decided by its general checks (the strict rules of
  ``narwhal_core/http/request_head.py``) and *read by h11*: neither the
  fast reading nor the codec's own h11-faithful reading runs. Buffering,
  limits, the strict chunked decoder, the state table and the response
  serialiser are the product's.
* :class:`ReferenceEngineConnection` reads engine responses with h11
  itself, and writes requests with h11 (the product writes them alone).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

import attrs
import h11

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.http import (
    DEFAULT_ENGINE_MAX_BODY_BYTES,
    DEFAULT_ENGINE_MAX_HEADER_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_REQUEST_LINE_BYTES,
    NEED_DATA,
    BodyData,
    EngineEvent,
    Headers,
    ResponseEnd,
    ResponseHead,
    ServerConnection,
    ServerEvent,
)
from narwhal_core.http.grammar import BODY_METHODS, CODEC_FIELDS, NO_BODY_STATUSES, Malformed, encode_request_line

__all__ = ["REFERENCE_CODEC", "ReferenceCodec", "ReferenceEngineConnection", "ReferenceServerConnection"]

# Engine streams have no body limit; this bounds the bytes an adapter may
# hand over between two next_event() calls on such a connection (as the product).
_ENGINE_STREAM_BUFFER_BYTES: Final = 16 * 1024 * 1024


class ReferenceServerConnection(ServerConnection):
    """The product's server connection with every request head read by h11 (see the module docstring)."""

    def _start_request(self, head: bytes) -> ServerEvent:
        return self._begin_request(self._decide_request(head))

    def _read_request_head(self, head: bytes) -> tuple[bytes, bytes, bytes, Headers, bool]:
        parser = h11.Connection(h11.SERVER)
        parser.receive_data(head)
        try:
            event = parser.next_event()
        except h11.ProtocolError as exc:
            raise Malformed(str(exc)) from None
        if type(event) is not h11.Request:  # pragma: no cover - a whole head always parses to one
            raise Malformed("not a request head")
        return (
            event.method, event.target, event.http_version, tuple(event.headers),
            parser.they_are_waiting_for_100_continue,
        )


class _EngineState(enum.Enum):
    NEW = "NEW"  # send_request() not called yet
    HEAD = "HEAD"  # waiting for the final response head
    BODY = "BODY"  # reading the body
    DONE = "DONE"  # ResponseEnd returned
    ERROR = "ERROR"  # next_event raised


_ENGINE_ERROR_STATUS: Final = 502  # what a client gets when an engine breaks HTTP


class ReferenceEngineConnection:
    """One request/response exchange with an engine (we are the client) on a fresh or pooled socket.

    A new EngineConnection is created for every request, even on a reused
    socket. h11 does the parsing; errors are ``RemoteProtocolError`` with
    status 502 and ``reason`` ``"dropped"`` (EOF before the response was
    complete), ``"malformed"`` or ``"too_large"`` (head over
    ``max_header_bytes``, body over ``max_body_bytes``; ``None`` means
    unlimited, for streams). Responses that carry both ``Content-Length``
    and ``Transfer-Encoding`` are refused: a pooled socket must never be
    reused after a response whose end is ambiguous. Bytes handed to
    ``receive_data`` between two ``next_event`` calls are bounded by
    ``max_header_bytes + max_body_bytes`` (16 MiB in place of an unlimited
    body); past that they are dropped and ``next_event`` raises
    ``too_large``.
    """

    def __init__(
        self,
        *,
        max_header_bytes: int = DEFAULT_ENGINE_MAX_HEADER_BYTES,
        max_body_bytes: int | None = DEFAULT_ENGINE_MAX_BODY_BYTES,
    ) -> None:
        if max_header_bytes < 0 or (max_body_bytes is not None and max_body_bytes < 0):
            raise ValueError("limits must not be negative")
        self._h11 = h11.Connection(h11.CLIENT, max_incomplete_event_size=max_header_bytes)
        self._max_body = max_body_bytes
        # h11 holds at most max_header_bytes when it asks for data; this
        # bounds what may pile up on top of that before it parses again.
        self._max_unparsed = max_header_bytes + (
            max_body_bytes if max_body_bytes is not None else _ENGINE_STREAM_BUFFER_BYTES
        )
        self._max_header_bytes = max_header_bytes
        self._unparsed = 0
        self._fed = 0  # bytes handed to h11 so far
        self._head_start = 0  # offset in that stream where the current head began
        self._eof = False
        self._overflow = False
        self._state = _EngineState.NEW
        self._error: RemoteProtocolError | None = None
        self._end: ResponseEnd | None = None
        self._head_request = False
        self._close_delimited = False
        self._received = 0

    def send_request(self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The whole request as bytes to write; call once.

        ``headers`` must include ``host`` and no framing or upgrade fields;
        the codec adds ``content-length`` (for a body, or always for POST,
        PUT and PATCH).
        """
        if self._state is not _EngineState.NEW:
            raise LocalProtocolError(f"send_request() in state {self._state.value}: one request per EngineConnection")
        has_host = False
        for name, _ in headers:
            lowered = name.lower()
            if lowered in CODEC_FIELDS or lowered == b"upgrade":
                raise LocalProtocolError(f"{name!r} is not allowed; the codec frames the request")
            if lowered == b"host":
                has_host = True
        if not has_host:
            raise LocalProtocolError("an engine request needs a host header")
        raw_method, raw_target = encode_request_line(method, target)
        fields = list(headers)
        if body or raw_method in BODY_METHODS:
            fields.append((b"content-length", b"%d" % len(body)))
        try:
            out = [self._h11.send(h11.Request(method=raw_method, target=raw_target, headers=fields))]
            if body:
                out.append(self._h11.send(h11.Data(data=body)))
            out.append(self._h11.send(h11.EndOfMessage()))
        except h11.ProtocolError as exc:
            raise LocalProtocolError(f"cannot send this request: {exc}") from None
        self._head_request = raw_method == b"HEAD"
        self._state = _EngineState.HEAD
        return b"".join(out)

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the engine; ``b""`` means the engine closed (EOF)."""
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("receive_data() after EOF")
        if self._overflow or self._state is _EngineState.DONE or self._state is _EngineState.ERROR:
            return
        if self._unparsed + len(data) > self._max_unparsed:
            self._overflow = True
            return
        self._unparsed += len(data)
        self._fed += len(data)
        self._h11.receive_data(data)

    def _fail(self, message: str, reason: str) -> RemoteProtocolError:
        error = RemoteProtocolError(message, status=_ENGINE_ERROR_STATUS, reason=reason)
        self._error = error
        self._state = _EngineState.ERROR
        return error

    def next_event(self) -> EngineEvent:
        """The next response event or :data:`NEED_DATA`.

        Informational (1xx) responses are skipped. After
        :class:`ResponseEnd` the same value is returned again; bytes that
        were already buffered after the response make it non-reusable.
        """
        state = self._state
        if state is _EngineState.DONE:
            assert self._end is not None
            return self._end
        if state is _EngineState.ERROR:
            assert self._error is not None
            raise self._error.with_traceback(None)
        if state is _EngineState.NEW:
            raise LocalProtocolError("next_event() before send_request()")
        conn = self._h11
        while True:
            try:
                event = conn.next_event()
            except h11.ProtocolError as exc:
                if exc.error_status_hint == 431:
                    raise self._fail("response head too large", "too_large") from None
                raise self._fail(f"malformed response: {exc}", "malformed") from None
            if type(event) is h11.Data:
                self._received += len(event.data)
                if self._max_body is not None and self._received > self._max_body:
                    raise self._fail(f"response body over {self._max_body} bytes", "too_large")
                if event.data:
                    return BodyData(data=bytes(event.data))
            elif event is h11.NEED_DATA:
                self._unparsed = 0
                if self._overflow:
                    raise self._fail("too many bytes buffered before parsing", "too_large")
                if not self._eof:
                    return NEED_DATA
                if self._state is _EngineState.BODY and self._close_delimited:
                    # The one body whose end is the EOF (RFC 9112 §6.3 p8).
                    conn.receive_data(b"")
                    continue
                raise self._fail("engine closed the connection before the response was complete", "dropped")
            elif type(event) is h11.Response:
                self._check_head_size()
                return self._response_head(event)
            elif type(event) is h11.EndOfMessage:
                reusable = (
                    conn.our_state is h11.DONE
                    and conn.their_state is h11.DONE
                    and not self._eof
                    and not self._overflow
                    and not conn.trailing_data[0]
                )
                self._end = ResponseEnd(reusable=reusable)
                self._state = _EngineState.DONE
                return self._end
            elif type(event) is h11.InformationalResponse:
                self._check_head_size()
            else:  # pragma: no cover - h11 gives nothing else here
                raise self._fail(f"unexpected {event!r}", "malformed")

    def _check_head_size(self) -> None:
        # h11 only limits a head that is still incomplete; one that arrived
        # whole in a single read must obey the same limit.
        end = self._fed - len(self._h11.trailing_data[0])
        size, self._head_start = end - self._head_start, end
        if size > self._max_header_bytes:
            raise self._fail(f"response head larger than {self._max_header_bytes} bytes", "too_large")

    def _response_head(self, event: h11.Response) -> ResponseHead:
        headers: Headers = tuple(event.headers)
        length: int | None = None
        chunked = False
        for name, value in headers:
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = True
        status = event.status_code
        has_body = not self._head_request and status not in NO_BODY_STATUSES
        if chunked and length is not None:
            raise self._fail("both Content-Length and Transfer-Encoding", "malformed")
        if has_body and length is not None and self._max_body is not None and length > self._max_body:
            raise self._fail(f"response body of {length} bytes is over {self._max_body}", "too_large")
        self._close_delimited = has_body and not chunked and length is None
        self._state = _EngineState.BODY
        return ResponseHead(status=status, headers=headers)


@attrs.frozen
class ReferenceCodec:
    """The oracle codec: h11 reading, the product's strictness and serialiser."""

    def server_connection(
        self,
        *,
        max_request_line_bytes: int = DEFAULT_MAX_REQUEST_LINE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> ReferenceServerConnection:
        """A new :class:`ReferenceServerConnection`."""
        return ReferenceServerConnection(
            max_request_line_bytes=max_request_line_bytes,
            max_header_bytes=max_header_bytes,
            max_headers=max_headers,
            max_body_bytes=max_body_bytes,
        )

    def engine_connection(
        self,
        *,
        max_header_bytes: int = DEFAULT_ENGINE_MAX_HEADER_BYTES,
        max_body_bytes: int | None = DEFAULT_ENGINE_MAX_BODY_BYTES,
    ) -> ReferenceEngineConnection:
        """A new :class:`ReferenceEngineConnection`."""
        return ReferenceEngineConnection(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes)


#: The oracle holds no state: one instance serves every test.
REFERENCE_CODEC: Final = ReferenceCodec()
