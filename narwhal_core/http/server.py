"""The client-facing side of the HTTP/1.1 codec: :class:`ServerConnection` (sans-IO; Narwhal is the server).

Driven like h11: ``receive_data`` buffers, ``next_event`` pulls (the
reading half, :class:`~.request_reader.RequestReader`, strict where a
router must be), ``send_*`` returns the bytes to write. Only
:class:`~narwhal_core.errors.RemoteProtocolError` (the client broke
HTTP/1.1) and :class:`~narwhal_core.errors.LocalProtocolError` (the caller
asked for something HTTP/1.1 does not allow) escape it. Responses are
serialised here (so HTTP/1.0 keep-alive works, which h11 does not
support), with every header name and value validated before it is
written; what may be sent when is one table, :data:`_SERVER_SENDS`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Final

from narwhal_core.errors import LocalProtocolError
from narwhal_core.http.grammar import CONTINUE_RESPONSE, NO_BODY_STATUSES, STATUS_LINES, encode_fields
from narwhal_core.http.request_reader import ALWAYS_CLOSE, ClientState, RequestReader

__all__ = ["ServerConnection"]


class _Send(enum.Enum):
    """What a caller can ask a ServerConnection to write."""

    # Members are singletons: identity hashing is correct and skips Enum's
    # Python-level __hash__ on every table lookup.
    __hash__ = object.__hash__

    CONTINUE = "send_continue"
    RESPONSE = "send_response"
    STREAM_START = "send_stream_start"
    STREAM_DATA = "send_stream_data"
    STREAM_END = "send_stream_end"
    ERROR_RESPONSE = "send_error_response"


#: Every legal (state, send) pair and the state it leads to; anything else
#: raises LocalProtocolError naming both, and changes nothing.
_SERVER_SENDS: Final[Mapping[tuple[ClientState, _Send], ClientState]] = MappingProxyType({
    (ClientState.EXPECT, _Send.CONTINUE): ClientState.CONTINUED,
    # A final answer to ContinueExpected: the body stays unread, so it closes.
    (ClientState.EXPECT, _Send.RESPONSE): ClientState.FINISHED,
    (ClientState.EXPECT, _Send.STREAM_START): ClientState.STREAMING,
    (ClientState.CONTINUED, _Send.RESPONSE): ClientState.FINISHED,
    (ClientState.CONTINUED, _Send.STREAM_START): ClientState.STREAMING,
    (ClientState.WAITING, _Send.RESPONSE): ClientState.FINISHED,
    (ClientState.WAITING, _Send.STREAM_START): ClientState.STREAMING,
    (ClientState.STREAMING, _Send.STREAM_DATA): ClientState.STREAMING,
    (ClientState.STREAMING, _Send.STREAM_END): ClientState.FINISHED,
    (ClientState.IDLE, _Send.ERROR_RESPONSE): ClientState.CLOSING,
    (ClientState.BODY, _Send.ERROR_RESPONSE): ClientState.CLOSING,
    (ClientState.EXPECT, _Send.ERROR_RESPONSE): ClientState.CLOSING,
    (ClientState.CONTINUED, _Send.ERROR_RESPONSE): ClientState.CLOSING,
    (ClientState.WAITING, _Send.ERROR_RESPONSE): ClientState.CLOSING,
    (ClientState.ERROR, _Send.ERROR_RESPONSE): ClientState.CLOSING,
})
_BODY_UNREAD: Final = frozenset({ClientState.EXPECT, ClientState.CONTINUED})
class _ResponseFraming(enum.Enum):
    CHUNKED = "chunked"
    CLOSE = "close-delimited"
    NONE = "no body"


class ServerConnection(RequestReader):
    """One client connection (we are the server).

    Feed bytes with :meth:`receive_data` and pull events with
    :meth:`next_event` (see :class:`~.request_reader.RequestReader` for the
    limits); write what the ``send_*`` methods return. After a response
    ends and :attr:`must_close` is false the next request cycle starts by
    itself, so pipelined requests come out in order.

    A ``send_*`` call that raises :class:`LocalProtocolError` writes nothing
    and leaves the connection as it was, so the caller can still answer with
    :meth:`send_error_response`. ``_framing`` is set by
    :meth:`send_stream_start`, before anything reads it.
    """

    # -- writing ------------------------------------------------------------

    def _transition(self, action: _Send) -> ClientState:
        """The state ``action`` leads to; raises (changing nothing) if it is illegal here."""
        target = _SERVER_SENDS.get((self._state, action))
        if target is None:
            raise LocalProtocolError(f"{action.value}() is not allowed in state {self._state.value}")
        return target

    def _connection_field(self, close: bool) -> bytes:
        if close:
            return b"connection: close\r\n"
        if self._version == "1.0":
            # HTTP/1.0 closes by default; keeping it open must be said.
            return b"connection: keep-alive\r\n"
        return b""

    def _finish_response(self) -> None:
        if self._close:
            self._state = ClientState.CLOSING
            self._buf = bytearray()
        else:
            self._reset_request()
            self._state = ClientState.IDLE

    def send_continue(self) -> bytes:
        """``100 Continue`` for the request just returned as :class:`ContinueExpected`."""
        self._state = self._transition(_Send.CONTINUE)
        return CONTINUE_RESPONSE

    def send_response(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """A complete response (status 200-599); returns the bytes to write.

        The codec writes ``content-length`` (callers never pass framing
        headers) and ``connection: close`` when the connection will close;
        a caller may pass ``connection: close`` itself to close after this
        response. The body is left out for ``HEAD``; 204 and 304 must have
        none.
        """
        self._transition(_Send.RESPONSE)
        lines, close = self._response_lines(status, headers, body)
        close = close or self._close or self._state in _BODY_UNREAD
        lines.append(self._connection_field(close))
        lines.append(b"\r\n")
        if body and self._method != "HEAD":
            lines.append(body)
        self._close = close
        self._finish_response()
        return b"".join(lines)

    def _response_lines(
        self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes | None
    ) -> tuple[list[bytes], bool]:
        """A response's status and field lines, and whether they ask to close.

        A whole response (``body`` given) gets its ``content-length`` last; a
        streamed one (``None``) is framed by its caller.
        """
        if not 200 <= status <= 599:
            raise LocalProtocolError(f"status {status} is not a final status (200-599)")
        lines, close = encode_fields(headers)
        lines.insert(0, STATUS_LINES[status])
        if body is None:
            pass
        elif status in NO_BODY_STATUSES:
            if body:
                raise LocalProtocolError(f"a {status} response has no body")
        else:
            lines.append(b"content-length: %d\r\n" % len(body))
        return lines, close

    def send_stream_start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The head of a streamed response: chunked for HTTP/1.1, close-delimited for 1.0."""
        self._transition(_Send.STREAM_START)
        if status in NO_BODY_STATUSES:
            raise LocalProtocolError(f"a {status} response has no body to stream; use send_response()")
        lines, close = self._response_lines(status, headers, None)
        close = close or self._close or self._state in _BODY_UNREAD
        if self._version == "1.1":
            # Also for HEAD: the head is the one a GET would get (RFC 9110 §9.3.2).
            lines.append(b"transfer-encoding: chunked\r\n")
            framing = _ResponseFraming.CHUNKED
        else:
            framing = _ResponseFraming.CLOSE
        if self._method == "HEAD":
            framing = _ResponseFraming.NONE
        elif framing is _ResponseFraming.CLOSE:
            close = True
        lines.append(self._connection_field(close))
        lines.append(b"\r\n")
        self._close = close
        self._framing = framing
        self._state = ClientState.STREAMING
        return b"".join(lines)

    def send_stream_data(self, data: bytes) -> bytes:
        """One piece of a streamed body (``b""`` for an empty piece)."""
        self._transition(_Send.STREAM_DATA)
        if not data or self._framing is _ResponseFraming.NONE:
            return b""
        if self._framing is _ResponseFraming.CHUNKED:
            return b"".join((b"%x\r\n" % len(data), data, b"\r\n"))
        return bytes(data)

    def send_stream_end(self) -> bytes:
        """The end of a streamed body."""
        self._transition(_Send.STREAM_END)
        out = b"0\r\n\r\n" if self._framing is _ResponseFraming.CHUNKED else b""
        self._finish_response()
        return out

    def send_error_response(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """A complete response after which the connection closes; returns the bytes to write.

        Usable whenever no response has started: after :meth:`next_event`
        raised, before a request was fully read, or instead of the normal
        response. Always adds ``connection: close`` and makes
        :attr:`must_close` true.
        """
        self._transition(_Send.ERROR_RESPONSE)
        lines, _ = self._response_lines(status, headers, body)
        lines.append(b"connection: close\r\n\r\n")
        if body and self._method != "HEAD":
            lines.append(body)
        self._close = True
        self._finish_response()
        return b"".join(lines)

    def send_failed(self) -> None:
        """The I/O side could not write our bytes: the connection is dead."""
        self._state = ClientState.DEAD
        self._close = True
        self._buf = bytearray()

    @property
    def must_close(self) -> bool:
        """True when, after the current response, the socket must be closed."""
        return self._close or self._state in ALWAYS_CLOSE

    @property
    def in_response(self) -> bool:
        """A response has started and is not finished."""
        return self._state is ClientState.STREAMING
