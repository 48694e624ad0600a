"""HTTP/1.1 protocol objects for client and engine connections (sans-IO).

Two connection objects, driven like h11 (``receive_data`` buffers,
``next_event`` pulls, ``send_*`` returns the bytes to write):

* :class:`ServerConnection` -- one client connection; Narwhal is the server.
  It yields whole requests (:class:`HttpRequest`, body included), because
  every route of SPEC §2 needs the complete body before it can act.
* :class:`EngineConnection` -- one request/response exchange with an engine;
  Narwhal is the client. It yields :class:`ResponseHead`, :class:`BodyData`
  pieces and :class:`ResponseEnd`, so a decode leg can be relayed as it
  streams (SPEC §2.3).

Both are reached through a :class:`Codec` (:data:`H11_CODEC` is the reference
implementation, built on h11); a faster codec can satisfy the same
:class:`ServerCodec` / :class:`EngineCodec` protocols. No h11 type crosses
this interface, and only :class:`~narwhal_core.errors.RemoteProtocolError`
(the peer broke HTTP/1.1) and :class:`~narwhal_core.errors.LocalProtocolError`
(the caller asked for something HTTP/1.1 does not allow) escape it.

What the reference codec adds to h11 on the client-facing side, because a
router in front of a fleet must not be the weak link in a request-smuggling
chain (RFC 9112 §6.3, §11.2):

* ``Content-Length`` together with ``Transfer-Encoding`` is rejected (h11
  lets chunked win); so is a repeated or list-valued ``Content-Length``
  (h11 merges identical values), and ``Transfer-Encoding`` on HTTP/1.0.
* Obsolete line folding is rejected (h11 unfolds it); bare CR and bare LF
  anywhere in the head are rejected (h11 accepts LF-only line ends).
* The chunked body is decoded here, strictly: CRLF after every line and
  every chunk, at most 16 hex digits of size, well-formed extensions and
  trailer fields, no bare CR/LF, no folding. h11 accepts a bare LF at the
  end of the trailer section and a bare CR inside a chunk extension.
* Separate limits with their own statuses: request line (431), header
  section size and count (431), body (413, decided from ``Content-Length``
  or from each chunk size before the bytes are read), and a bound on all
  buffered bytes so pipelined data cannot grow without limit.
* HTTP versions other than 1.0 and 1.1 get 505; a request line that is too
  long gets 431 rather than 414, as SPEC §4 lists 431/400 for it.

h11 parses every request head (request line and field grammar, ``Host``
rules) and, on the engine side, the whole response. Responses to clients are
serialised here (so HTTP/1.0 keep-alive works, which h11 does not support),
with every header name and value validated before it is written.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Final, Literal, Protocol, TypeAlias

import attrs
import h11

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "NEED_DATA",
    "PAUSED",
    "Signal",
    "HttpRequest",
    "ContinueExpected",
    "ConnectionClosed",
    "ServerEvent",
    "ServerConnection",
    "ResponseHead",
    "BodyData",
    "ResponseEnd",
    "EngineEvent",
    "EngineConnection",
    "ServerCodec",
    "EngineCodec",
    "Codec",
    "H11Codec",
    "H11_CODEC",
    "DEFAULT_MAX_REQUEST_LINE_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_ENGINE_MAX_HEADER_BYTES",
    "DEFAULT_ENGINE_MAX_BODY_BYTES",
]


# ---------------------------------------------------------------------------
# Signals and event values
# ---------------------------------------------------------------------------


class Signal(enum.Enum):
    """The two non-event answers of ``next_event``."""

    #: Nothing complete is buffered: read more bytes and call ``receive_data``.
    NEED_DATA = "NEED_DATA"
    #: A request was returned and its response is not finished; later bytes wait.
    PAUSED = "PAUSED"

    def __repr__(self) -> str:
        return self.value

    __str__ = __repr__


NEED_DATA: Final = Signal.NEED_DATA
PAUSED: Final = Signal.PAUSED
NeedData: TypeAlias = Literal[Signal.NEED_DATA]
Paused: TypeAlias = Literal[Signal.PAUSED]

Headers: TypeAlias = tuple[tuple[bytes, bytes], ...]

DEFAULT_MAX_REQUEST_LINE_BYTES: Final = 8192
DEFAULT_MAX_HEADER_BYTES: Final = 16384
DEFAULT_MAX_HEADERS: Final = 100
DEFAULT_MAX_BODY_BYTES: Final = 4 * 1024 * 1024
DEFAULT_ENGINE_MAX_HEADER_BYTES: Final = 65536
DEFAULT_ENGINE_MAX_BODY_BYTES: Final = 64 * 1024 * 1024


def _first_value(headers: Headers, name: bytes) -> bytes | None:
    for field_name, value in headers:
        if field_name == name:
            return value
    return None


# The event values are built only by codecs, from bytes that were already
# validated, and sit on the hot path of every request: no attrs validators,
# and the four of every request are not frozen (a frozen attrs class sets
# each field through ``object.__setattr__``, three times the cost of a plain
# slotted ``__init__``). Treat them as values all the same.


@attrs.define(kw_only=True)
class HttpRequest:
    """A complete client request, body included."""

    #: Request method as sent, e.g. ``"POST"`` (methods are case-sensitive).
    method: str
    #: Raw request target, e.g. ``"/v1/completions?x=1"`` (latin-1 decoded).
    target: str
    #: Header fields in arrival order; names lowercased, values stripped of OWS.
    headers: Headers
    #: The whole body, de-chunked.
    body: bytes
    #: The client lets the connection carry another request after this one.
    keep_alive: bool
    #: ``"1.1"`` or ``"1.0"``.
    http_version: str

    def header(self, name: bytes) -> bytes | None:
        """The first value of the header ``name`` (lowercase), or ``None``."""
        return _first_value(self.headers, name)


@attrs.frozen(kw_only=True)
class ContinueExpected:
    """The head of a request that sent ``Expect: 100-continue``; its body is not read yet."""

    #: Request method as sent.
    method: str
    #: Raw request target (latin-1 decoded).
    target: str
    #: Header fields; names lowercased.
    headers: Headers
    #: Declared body size; ``None`` for a chunked body.
    content_length: int | None

    def header(self, name: bytes) -> bytes | None:
        """The first value of the header ``name`` (lowercase), or ``None``."""
        return _first_value(self.headers, name)


@attrs.frozen
class ConnectionClosed:
    """The client closed the connection cleanly, between requests."""


@attrs.define(kw_only=True)
class ResponseHead:
    """Status line and header fields of an engine's final response."""

    #: Status code, 200-599.
    status: int
    #: Header fields in arrival order; names lowercased.
    headers: Headers


@attrs.define(kw_only=True)
class BodyData:
    """A piece of an engine response body; the pieces concatenate to the body."""

    #: The bytes of this piece (never empty).
    data: bytes


@attrs.define(kw_only=True)
class ResponseEnd:
    """The engine response is complete."""

    #: The socket can carry another request (keep-alive, nothing left unread).
    reusable: bool


ServerEvent: TypeAlias = HttpRequest | ContinueExpected | ConnectionClosed | NeedData | Paused
EngineEvent: TypeAlias = ResponseHead | BodyData | ResponseEnd | NeedData

_CONNECTION_CLOSED: Final = ConnectionClosed()


# ---------------------------------------------------------------------------
# Grammar (RFC 9110 §5.6, RFC 9112 §7.1)
# ---------------------------------------------------------------------------

_TCHAR = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]"
_FIELD_VCHAR = rb"[\x21-\x7e\x80-\xff]"
_FIELD_VALUE = rb"(?:" + _FIELD_VCHAR + rb"(?:[\t\x20-\x7e\x80-\xff]*" + _FIELD_VCHAR + rb")?)?"
_QUOTED_STRING = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'

_TOKEN_RE: Final = re.compile(_TCHAR + rb"+")
_FIELD_LINE_RE: Final = re.compile(_TCHAR + rb"+:[ \t]*" + _FIELD_VALUE + rb"[ \t]*")
_CHUNK_LINE_RE: Final = re.compile(
    rb"([0-9A-Fa-f]{1,16})"
    rb"(?:[ \t]*;[ \t]*" + _TCHAR + rb"+(?:[ \t]*=[ \t]*(?:" + _TCHAR + rb"+|" + _QUOTED_STRING + rb"))?)*"
    # Trailing whitespace after the size is not in the grammar, but common
    # and harmless (h11 accepts it too).
    rb"[ \t]*"
)
# End of a head: the first empty line. A bare LF also ends it (so an LF-only
# client gets a prompt 400 instead of a timeout); validation rejects it.
_HEAD_END_RE: Final = re.compile(rb"\n\r?\n")
_IS_TCHAR: Final = tuple(_TOKEN_RE.fullmatch(bytes([b])) is not None for b in range(256))
# The same rules as byte sets, for checks without a regex: a token's bytes,
# and a field value's (HTAB, SP, VCHAR, obs-text; no OWS at either end).
_TOKEN_BYTES: Final = bytes(b for b in range(256) if _IS_TCHAR[b])
_FIELD_VALUE_BYTES: Final = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))
_OWS: Final = b" \t"

_CR: Final = 13
_LF: Final = 10
# A chunk-size line with extensions longer than this is refused (400): the
# extensions carry nothing Narwhal uses, and each line must be buffered whole.
_MAX_CHUNK_LINE_BYTES: Final = 4096
# Engine streams have no body limit; this bounds the bytes an adapter may
# hand over between two next_event() calls on such a connection.
_ENGINE_STREAM_BUFFER_BYTES: Final = 16 * 1024 * 1024
# Methods whose requests carry content, so Content-Length is always sent.
_BODY_METHODS: Final = frozenset({b"POST", b"PUT", b"PATCH"})


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES: Final[Mapping[int, bytes]] = {s: _status_line(s) for s in range(100, 600)}
_CONTINUE_RESPONSE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
# RFC 9110 §15.3.5, §15.4.5: these responses never carry content.
_NO_BODY_STATUSES: Final = frozenset({204, 304})
_CODEC_FIELDS: Final = frozenset({b"content-length", b"transfer-encoding"})


def _encode_request_line(method: str, target: str) -> tuple[bytes, bytes]:
    """An engine request's method and target as bytes; raises for non-ASCII text or ``CONNECT``."""
    try:
        raw_method = method.encode("ascii")
        raw_target = target.encode("ascii")
    except UnicodeEncodeError:
        raise LocalProtocolError(f"non-ASCII method or target: {method!r} {target!r}") from None
    if raw_method == b"CONNECT":
        raise LocalProtocolError("CONNECT is not supported")
    return raw_method, raw_target


def _encode_fields(headers: Sequence[tuple[bytes, bytes]]) -> tuple[list[bytes], bool]:
    """Validated ``name: value`` lines, and whether the caller asked to close."""
    lines: list[bytes] = []
    close = False
    for name, value in headers:
        if not name or name.translate(None, _TOKEN_BYTES):
            raise LocalProtocolError(f"illegal header name {name!r}")
        if value and (
            value.translate(None, _FIELD_VALUE_BYTES) or value[0] in _OWS or value[-1] in _OWS
        ):
            raise LocalProtocolError(f"illegal value for header {name!r}: {value!r}")
        lowered = name.lower()
        if lowered in _CODEC_FIELDS:
            raise LocalProtocolError(f"{name!r} is framing; the codec writes it")
        if lowered == b"connection":
            # The only connection option a caller may set is "close"; the
            # codec writes the header itself, once.
            if value.lower() != b"close":
                raise LocalProtocolError(f"connection: {value!r} is not allowed; only 'close'")
            close = True
            continue
        lines.append(b"%s: %s\r\n" % (name, value))
    return lines, close


# ---------------------------------------------------------------------------
# Client-facing side: ServerConnection
# ---------------------------------------------------------------------------


class _State(enum.Enum):
    """Where a client connection is; the names appear in error messages."""

    # Members are singletons: identity hashing is correct and skips Enum's
    # Python-level __hash__ on every table lookup.
    __hash__ = object.__hash__

    IDLE = "IDLE"  # reading a request head (or waiting for one)
    BODY = "BODY"  # reading a request body
    EXPECT = "EXPECT"  # ContinueExpected returned; no 100 sent yet
    CONTINUED = "CONTINUED"  # 100 Continue sent; reading the body
    WAITING = "WAITING"  # HttpRequest returned; no response started
    STREAMING = "STREAMING"  # a streamed response is being written
    FINISHED = "FINISHED"  # pseudo-state: the response ended (-> IDLE or CLOSING)
    CLOSING = "CLOSING"  # the last response was written; close the socket
    CLOSED = "CLOSED"  # the client closed between requests
    ERROR = "ERROR"  # next_event raised; only an error response may follow
    DEAD = "DEAD"  # send_failed(): nothing more can happen


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
_SERVER_SENDS: Final[Mapping[tuple[_State, _Send], _State]] = {
    (_State.EXPECT, _Send.CONTINUE): _State.CONTINUED,
    # A final answer to ContinueExpected: the body stays unread, so it closes.
    (_State.EXPECT, _Send.RESPONSE): _State.FINISHED,
    (_State.EXPECT, _Send.STREAM_START): _State.STREAMING,
    (_State.CONTINUED, _Send.RESPONSE): _State.FINISHED,
    (_State.CONTINUED, _Send.STREAM_START): _State.STREAMING,
    (_State.WAITING, _Send.RESPONSE): _State.FINISHED,
    (_State.WAITING, _Send.STREAM_START): _State.STREAMING,
    (_State.STREAMING, _Send.STREAM_DATA): _State.STREAMING,
    (_State.STREAMING, _Send.STREAM_END): _State.FINISHED,
    (_State.IDLE, _Send.ERROR_RESPONSE): _State.CLOSING,
    (_State.BODY, _Send.ERROR_RESPONSE): _State.CLOSING,
    (_State.EXPECT, _Send.ERROR_RESPONSE): _State.CLOSING,
    (_State.CONTINUED, _Send.ERROR_RESPONSE): _State.CLOSING,
    (_State.WAITING, _Send.ERROR_RESPONSE): _State.CLOSING,
    (_State.ERROR, _Send.ERROR_RESPONSE): _State.CLOSING,
}
_BODY_UNREAD: Final = frozenset({_State.EXPECT, _State.CONTINUED})
_ALWAYS_CLOSE: Final = frozenset({_State.CLOSING, _State.CLOSED, _State.ERROR, _State.DEAD})


class _Chunk(enum.Enum):
    SIZE = "chunk size line"
    DATA = "chunk data"
    DATA_END = "CRLF after chunk data"
    TRAILER = "trailer section"


class _Framing(enum.Enum):
    CHUNKED = "chunked"
    CLOSE = "close-delimited"
    NONE = "no body"


class ServerConnection:
    """One client connection (we are the server).

    Feed bytes with :meth:`receive_data` and pull events with
    :meth:`next_event`; write what the ``send_*`` methods return. After a
    response ends and :attr:`must_close` is false the next request cycle
    starts by itself, so pipelined requests come out in order.

    Limits (each a ``RemoteProtocolError`` with ``reason="too_large"``):

    * ``max_request_line_bytes`` -- request line without its CRLF: 431.
    * ``max_header_bytes`` -- header section after the request line, final
      empty line included (and, separately, a chunked body's trailer
      section): 431.
    * ``max_headers`` -- field lines in the head (or in the trailers): 431.
    * ``max_body_bytes`` -- decoded body: 413, from ``Content-Length`` before
      any body byte is read, or from each chunk size as it arrives.
    * All buffered, unparsed bytes are bounded by
      ``max_request_line_bytes + max_header_bytes + max_body_bytes + 4``;
      bytes past that are dropped (those that fit are kept, however the
      reads were split), and when parsing reaches the gap ``next_event``
      raises 400. This is what bounds pipelined data while a
      response is pending (an adapter should stop reading while
      :data:`PAUSED` anyway).

    A ``send_*`` call that raises :class:`LocalProtocolError` writes nothing
    and leaves the connection as it was, so the caller can still answer with
    :meth:`send_error_response`.
    """

    def __init__(
        self,
        *,
        max_request_line_bytes: int = DEFAULT_MAX_REQUEST_LINE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        for name, limit in (
            ("max_request_line_bytes", max_request_line_bytes),
            ("max_header_bytes", max_header_bytes),
            ("max_headers", max_headers),
            ("max_body_bytes", max_body_bytes),
        ):
            if limit < 0:
                raise ValueError(f"{name} must not be negative")
        self._max_line = max_request_line_bytes
        self._max_header_bytes = max_header_bytes
        self._max_headers = max_headers
        self._max_body = max_body_bytes
        self._max_buffered = max_request_line_bytes + max_header_bytes + max_body_bytes + 4
        self._buf = bytearray()
        self._scan = 0  # where the search for the end of the head resumes
        self._eof = False
        self._overflow = False
        self._state = _State.IDLE
        self._error: RemoteProtocolError | None = None
        self._reset_request()

    def _reset_request(self) -> None:
        self._close = False  # the current cycle ends with closing the socket
        self._method: str | None = None
        self._target = ""
        self._headers: Headers = ()
        self._version = "1.1"
        self._keep_alive = True
        self._content_length = 0
        self._chunked = False
        self._chunk_phase = _Chunk.SIZE
        self._chunk_left = 0
        self._trailer_bytes = 0
        self._trailer_count = 0
        self._body = bytearray()
        self._framing = _Framing.NONE

    # -- reading ------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the client; ``b""`` means the client closed (EOF).

        Never parses and never raises for the peer's sake; bytes past the
        buffer bound are dropped (see the class docstring).
        """
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("receive_data() after EOF")
        if self._overflow or self._state in _ALWAYS_CLOSE:
            return
        room = self._max_buffered - len(self._buf)
        if len(data) > room:
            # Keep what fits: a head that came in the same read as too much
            # body is still parsed (and gets its 413), whatever the split.
            self._overflow = True
            data = data[:room]
        self._buf += data

    def next_event(self) -> ServerEvent:
        """The next request event, :data:`NEED_DATA` or :data:`PAUSED`.

        Returns :class:`HttpRequest` once the whole body is in;
        :class:`ContinueExpected` first when an HTTP/1.1 request sent
        ``Expect: 100-continue`` (then call :meth:`send_continue` and keep
        calling, or answer at once and close); :class:`ConnectionClosed`
        when the client closed between requests (again on every later
        call); :data:`PAUSED` while a returned request's response is not
        finished, and after a closing response.

        Raises :class:`RemoteProtocolError`: 400 for malformed bytes
        (smuggling shapes included), 413 for a body over
        ``max_body_bytes``, 431 for a request line or header section over
        its limit, 505 for an HTTP version other than 1.0/1.1, and
        ``reason="dropped"`` (400) when EOF cuts a request. The connection
        is then dead: the same error is raised again on every call; send
        :meth:`send_error_response` and close.
        """
        state = self._state
        if state is _State.IDLE:
            return self._read_head()
        if state is _State.BODY or state is _State.EXPECT or state is _State.CONTINUED:
            return self._read_body()
        if state is _State.WAITING or state is _State.STREAMING or state is _State.CLOSING:
            return PAUSED
        if state is _State.CLOSED:
            return _CONNECTION_CLOSED
        if state is _State.ERROR:
            assert self._error is not None
            raise self._error.with_traceback(None)
        raise LocalProtocolError(f"next_event() in state {state.value}: the connection is dead")

    def _fail(self, message: str, *, status: int = 400, reason: str = "malformed") -> RemoteProtocolError:
        error = RemoteProtocolError(message, status=status, reason=reason)
        if self._target:
            # Its request line was in: say which request it was, so that the
            # router can journal a refused completion request.
            error.method = self._method
            error.target = self._target
        self._error = error
        self._state = _State.ERROR
        self._buf = bytearray()
        return error

    def _starved(self) -> NeedData:
        """NEED_DATA, unless no more data can come."""
        if self._overflow:
            raise self._fail(
                f"more than {self._max_buffered} bytes buffered (pipelined data)",
                reason="too_large",
            )
        if self._eof:
            raise self._fail("client closed the connection in the middle of a request", reason="dropped")
        return NEED_DATA

    def _read_head(self) -> ServerEvent:
        buf = self._buf
        # RFC 9112 §2.2: ignore empty lines before a request line.
        while buf[:2] == b"\r\n":
            del buf[:2]
        if not buf:
            if self._overflow:
                return self._starved()
            if self._eof:
                self._state = _State.CLOSED
                return _CONNECTION_CLOSED
            return NEED_DATA
        first = buf[0]
        if not _IS_TCHAR[first]:
            if first == _CR and len(buf) == 1:
                return self._starved()
            # Catches TLS handshakes and other non-HTTP bytes at once.
            raise self._fail(f"request line does not start with a method: {bytes(buf[:16])!r}")
        match = _HEAD_END_RE.search(buf, self._scan)
        if match is None:
            self._scan = max(0, len(buf) - 2)
            line_end = buf.find(b"\n", 0, self._max_line + 2)
            if line_end == -1:
                if len(buf) >= self._max_line + 2:
                    raise self._request_line_too_long()
            else:
                if not self._target:
                    self._peek_request_line(buf[:line_end])
                if len(buf) - (line_end + 1) > self._max_header_bytes:
                    raise self._header_section_too_large()
            return self._starved()
        end = match.end()
        head = bytes(buf[:end])
        del buf[:end]
        self._scan = 0
        return self._start_request(head)

    def _request_line_too_long(self) -> RemoteProtocolError:
        return self._fail(
            f"request line longer than {self._max_line} bytes", status=431, reason="too_large"
        )

    def _header_section_too_large(self) -> RemoteProtocolError:
        return self._fail(
            f"header section larger than {self._max_header_bytes} bytes", status=431, reason="too_large"
        )

    def _peek_request_line(self, line: bytes | bytearray) -> None:
        # The method and target of a request line, before the head is whole
        # (unchecked: the head's parse decides); see partial_target.
        parts = bytes(line).rstrip(b"\r").split(b" ")
        if len(parts) == 3 and parts[1] and _TOKEN_RE.fullmatch(parts[0]) and parts[2].startswith(b"HTTP/"):
            self._method = parts[0].decode("latin-1")
            self._target = parts[1].decode("latin-1")

    def _start_request(self, head: bytes) -> ServerEvent:
        # Size checks first, in the order the incremental checks above meet
        # them, so a head split anywhere fails the same way.
        line_end = head.find(b"\n")
        if not self._target:
            self._peek_request_line(head[: max(line_end, 0)])
        if line_end > self._max_line + 1:
            raise self._request_line_too_long()
        if len(head) - (line_end + 1) > self._max_header_bytes:
            raise self._header_section_too_large()
        crlf = head.count(b"\r\n")
        if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
            raise self._fail("bare CR or LF in the request head")
        if crlf - 2 > self._max_headers:
            raise self._fail(f"more than {self._max_headers} header fields", status=431, reason="too_large")
        if b"\n " in head or b"\n\t" in head:
            raise self._fail("obsolete line folding in the request head")

        parser = h11.Connection(h11.SERVER)
        parser.receive_data(head)
        try:
            event = parser.next_event()
        except h11.ProtocolError as exc:
            raise self._fail(f"malformed request head: {exc}") from None
        if type(event) is not h11.Request:  # pragma: no cover - a whole head always parses to one
            raise self._fail("malformed request head")

        if event.http_version == b"1.1":
            version = "1.1"
        elif event.http_version == b"1.0":
            version = "1.0"
        else:
            raise self._fail(f"HTTP/{event.http_version.decode('ascii')} is not supported", status=505)

        headers: Headers = tuple(event.headers)
        content_length: bytes | None = None
        chunked = False
        connection = b""
        for name, value in headers:
            if name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                # h11 accepts exactly one Transfer-Encoding, equal to "chunked".
                chunked = True
            elif name == b"connection":
                connection += b"," + value.lower()

        if chunked:
            if content_length is not None:
                raise self._fail("both Content-Length and Transfer-Encoding")
            if version == "1.0":
                raise self._fail("Transfer-Encoding in an HTTP/1.0 request")
        if content_length is not None:
            # h11 merges repeated or list-valued identical lengths; a
            # smuggling chain relies on two parsers disagreeing, so refuse.
            lowered = head.lower()
            if lowered.count(b"\ncontent-length:") != 1:
                raise self._fail("repeated Content-Length")
            start = lowered.find(b"\ncontent-length:") + len(b"\ncontent-length:")
            raw = head[start : head.find(b"\r\n", start)].strip(b" \t")
            if raw != content_length:
                raise self._fail(f"malformed Content-Length: {raw!r}")
            length = int(content_length)
            if length > self._max_body:
                error = self._fail(
                    f"body of {length} bytes is over the {self._max_body}-byte limit",
                    status=413,
                    reason="too_large",
                )
                # The head parsed: say which request it was, so the router can
                # journal a refused completion request (SPEC §5).
                error.method = event.method.decode("ascii")
                error.target = event.target.decode("latin-1")
                raise error
            self._content_length = length

        if connection:
            options = {option.strip() for option in connection.split(b",")}
            if version == "1.1":
                keep_alive = b"close" not in options
            else:
                keep_alive = b"keep-alive" in options and b"close" not in options
        else:
            keep_alive = version == "1.1"

        self._method = event.method.decode("ascii")
        self._target = event.target.decode("latin-1")
        self._headers = headers
        self._version = version
        self._keep_alive = keep_alive
        self._close = not keep_alive
        self._chunked = chunked
        if parser.they_are_waiting_for_100_continue:
            self._state = _State.EXPECT
            return ContinueExpected(
                method=self._method,
                target=self._target,
                headers=headers,
                content_length=None if chunked else self._content_length,
            )
        self._state = _State.BODY
        return self._read_body()

    def _read_body(self) -> HttpRequest | NeedData:
        if self._chunked:
            return self._read_chunked()
        buf = self._buf
        length = self._content_length
        if len(buf) < length:
            return self._starved()
        with memoryview(buf)[:length] as view:  # one copy, even for a large body
            body = bytes(view)
        del buf[:length]
        return self._request_complete(body)

    def _request_complete(self, body: bytes) -> HttpRequest:
        assert self._method is not None
        self._state = _State.WAITING
        self._body = bytearray()
        return HttpRequest(
            method=self._method,
            target=self._target,
            headers=self._headers,
            body=body,
            keep_alive=self._keep_alive,
            http_version=self._version,
        )

    def _take_line(self, limit: int, what: str, status: int) -> bytes | None:
        """One CRLF-terminated line (without the CRLF), or None if incomplete."""
        buf = self._buf
        end = buf.find(b"\n", 0, limit + 2)
        if end == -1:
            if len(buf) >= limit + 2:
                raise self._fail(f"{what} longer than {limit} bytes", status=status, reason="too_large")
            return None
        if end == 0 or buf[end - 1] != _CR:
            raise self._fail(f"bare LF in the {what}")
        line = bytes(buf[: end - 1])
        if b"\r" in line:
            raise self._fail(f"bare CR in the {what}")
        del buf[: end + 1]
        return line

    def _read_chunked(self) -> HttpRequest | NeedData:
        buf = self._buf
        while True:
            phase = self._chunk_phase
            if phase is _Chunk.DATA:
                if not buf:
                    return self._starved()
                piece = buf[: self._chunk_left]
                self._body += piece
                del buf[: len(piece)]
                self._chunk_left -= len(piece)
                if self._chunk_left:
                    return self._starved()
                self._chunk_phase = _Chunk.DATA_END
            elif phase is _Chunk.DATA_END:
                if buf[:2] == b"\r\n":
                    del buf[:2]
                    self._chunk_phase = _Chunk.SIZE
                elif len(buf) >= 2 or (buf and buf[0] != _CR):
                    raise self._fail("chunk data not followed by CRLF")
                else:
                    return self._starved()
            elif phase is _Chunk.SIZE:
                line = self._take_line(_MAX_CHUNK_LINE_BYTES, phase.value, 400)
                if line is None:
                    return self._starved()
                match = _CHUNK_LINE_RE.fullmatch(line)
                if match is None:
                    raise self._fail(f"malformed chunk size line: {line[:64]!r}")
                size = int(match.group(1), 16)
                if size == 0:
                    self._chunk_phase = _Chunk.TRAILER
                elif len(self._body) + size > self._max_body:
                    error = self._fail(
                        f"chunked body over the {self._max_body}-byte limit", status=413, reason="too_large"
                    )
                    error.method = self._method
                    error.target = self._target
                    raise error
                else:
                    self._chunk_left = size
                    self._chunk_phase = _Chunk.DATA
            else:
                line = self._take_line(self._max_header_bytes - self._trailer_bytes, phase.value, 431)
                if line is None:
                    return self._starved()
                if not line:
                    return self._request_complete(bytes(self._body))
                # Trailer fields are checked like header fields, then dropped:
                # nothing in Narwhal reads them.
                if line[0] == 0x20 or line[0] == 0x09:
                    raise self._fail("obsolete line folding in the trailer section")
                if _FIELD_LINE_RE.fullmatch(line) is None:
                    raise self._fail(f"malformed trailer field: {line[:64]!r}")
                self._trailer_bytes += len(line) + 2
                self._trailer_count += 1
                if self._trailer_count > self._max_headers:
                    raise self._fail(
                        f"more than {self._max_headers} trailer fields", status=431, reason="too_large"
                    )

    # -- writing ------------------------------------------------------------

    def _transition(self, action: _Send) -> _State:
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
            self._state = _State.CLOSING
            self._buf = bytearray()
        else:
            self._reset_request()
            self._state = _State.IDLE

    def send_continue(self) -> bytes:
        """``100 Continue`` for the request just returned as :class:`ContinueExpected`."""
        self._state = self._transition(_Send.CONTINUE)
        return _CONTINUE_RESPONSE

    def send_response(self, status: int, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """A complete response (status 200-599); returns the bytes to write.

        The codec writes ``content-length`` (callers never pass framing
        headers) and ``connection: close`` when the connection will close;
        a caller may pass ``connection: close`` itself to close after this
        response. The body is left out for ``HEAD``; 204 and 304 must have
        none.
        """
        self._transition(_Send.RESPONSE)
        lines, close = self._response_lines(status, headers)
        if status in _NO_BODY_STATUSES:
            if body:
                raise LocalProtocolError(f"a {status} response has no body")
        else:
            lines.append(b"content-length: %d\r\n" % len(body))
        close = close or self._close or self._state in _BODY_UNREAD
        lines.append(self._connection_field(close))
        lines.append(b"\r\n")
        if body and self._method != "HEAD":
            lines.append(body)
        self._close = close
        self._finish_response()
        return b"".join(lines)

    def _response_lines(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> tuple[list[bytes], bool]:
        if not 200 <= status <= 599:
            raise LocalProtocolError(f"status {status} is not a final status (200-599)")
        lines, close = _encode_fields(headers)
        lines.insert(0, _STATUS_LINES[status])
        return lines, close

    def send_stream_start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The head of a streamed response: chunked for HTTP/1.1, close-delimited for 1.0."""
        self._transition(_Send.STREAM_START)
        if status in _NO_BODY_STATUSES:
            raise LocalProtocolError(f"a {status} response has no body to stream; use send_response()")
        lines, close = self._response_lines(status, headers)
        close = close or self._close or self._state in _BODY_UNREAD
        if self._version == "1.1":
            # Also for HEAD: the head is the one a GET would get (RFC 9110 §9.3.2).
            lines.append(b"transfer-encoding: chunked\r\n")
            framing = _Framing.CHUNKED
        else:
            framing = _Framing.CLOSE
        if self._method == "HEAD":
            framing = _Framing.NONE
        elif framing is _Framing.CLOSE:
            close = True
        lines.append(self._connection_field(close))
        lines.append(b"\r\n")
        self._close = close
        self._framing = framing
        self._state = _State.STREAMING
        return b"".join(lines)

    def send_stream_data(self, data: bytes) -> bytes:
        """One piece of a streamed body (``b""`` for an empty piece)."""
        self._transition(_Send.STREAM_DATA)
        if not data or self._framing is _Framing.NONE:
            return b""
        if self._framing is _Framing.CHUNKED:
            return b"".join((b"%x\r\n" % len(data), data, b"\r\n"))
        return bytes(data)

    def send_stream_end(self) -> bytes:
        """The end of a streamed body."""
        self._transition(_Send.STREAM_END)
        out = b"0\r\n\r\n" if self._framing is _Framing.CHUNKED else b""
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
        lines, _ = self._response_lines(status, headers)
        if status in _NO_BODY_STATUSES:
            if body:
                raise LocalProtocolError(f"a {status} response has no body")
        else:
            lines.append(b"content-length: %d\r\n" % len(body))
        lines.append(b"connection: close\r\n\r\n")
        if body and self._method != "HEAD":
            lines.append(body)
        self._close = True
        self._finish_response()
        return b"".join(lines)

    def send_failed(self) -> None:
        """The I/O side could not write our bytes: the connection is dead."""
        self._state = _State.DEAD
        self._close = True
        self._buf = bytearray()

    @property
    def must_close(self) -> bool:
        """True when, after the current response, the socket must be closed."""
        return self._close or self._state in _ALWAYS_CLOSE

    @property
    def in_response(self) -> bool:
        """A response has started and is not finished."""
        return self._state is _State.STREAMING

    @property
    def has_partial_request(self) -> bool:
        """Bytes of a request that has not been returned whole are buffered.

        Lets an adapter tell an idle keep-alive connection (idle timeout)
        from a client that is sending a request (header and body timeouts).
        """
        state = self._state
        if state is _State.BODY or state is _State.EXPECT or state is _State.CONTINUED:
            return True
        return bool(self._buf) and (state is _State.IDLE or state is _State.WAITING or state is _State.STREAMING)

    @property
    def reading_body(self) -> bool:
        """The current request's head is parsed and its body is not complete.

        Lets the router switch a slow client from the header timeout to the
        body timeout.
        """
        state = self._state
        return state is _State.BODY or state is _State.EXPECT or state is _State.CONTINUED

    @property
    def buffered_bytes(self) -> int:
        """Bytes this connection holds of requests not yet returned (head, body so far, pipelined)."""
        return len(self._buf) + len(self._body)

    @property
    def partial_target(self) -> str | None:
        """The target of the request being read (not yet returned whole), once its request line is in."""
        state = self._state
        if state is _State.IDLE or state is _State.ERROR or self.reading_body:
            return self._target or None
        return None


# ---------------------------------------------------------------------------
# Engine side: EngineConnection
# ---------------------------------------------------------------------------


class _EngineState(enum.Enum):
    NEW = "NEW"  # send_request() not called yet
    HEAD = "HEAD"  # waiting for the final response head
    BODY = "BODY"  # reading the body
    DONE = "DONE"  # ResponseEnd returned
    ERROR = "ERROR"  # next_event raised


_ENGINE_ERROR_STATUS: Final = 502  # what a client gets when an engine breaks HTTP


class EngineConnection:
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
            if lowered in _CODEC_FIELDS or lowered == b"upgrade":
                raise LocalProtocolError(f"{name!r} is not allowed; the codec frames the request")
            if lowered == b"host":
                has_host = True
        if not has_host:
            raise LocalProtocolError("an engine request needs a host header")
        raw_method, raw_target = _encode_request_line(method, target)
        fields = list(headers)
        if body or raw_method in _BODY_METHODS:
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
        has_body = not self._head_request and status not in _NO_BODY_STATUSES
        if chunked and length is not None:
            raise self._fail("both Content-Length and Transfer-Encoding", "malformed")
        if has_body and length is not None and self._max_body is not None and length > self._max_body:
            raise self._fail(f"response body of {length} bytes is over {self._max_body}", "too_large")
        self._close_delimited = has_body and not chunked and length is None
        self._state = _EngineState.BODY
        return ResponseHead(status=status, headers=headers)


# ---------------------------------------------------------------------------
# Codec protocols
# ---------------------------------------------------------------------------


class ServerCodec(Protocol):
    """What a client connection offers an adapter (see :class:`ServerConnection`)."""

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
    """What an engine exchange offers an adapter (see :class:`EngineConnection`)."""

    def send_request(self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The whole request as bytes to write."""

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the engine; ``b""`` means EOF."""

    def next_event(self) -> EngineEvent:
        """The next response event or NEED_DATA."""


class Codec(Protocol):
    """A source of HTTP/1.1 connection objects; adapters depend on this, not on h11."""

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


@attrs.frozen
class H11Codec:
    """The reference codec: h11 parsing plus the checks listed in the module docstring."""

    def server_connection(
        self,
        *,
        max_request_line_bytes: int = DEFAULT_MAX_REQUEST_LINE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> ServerConnection:
        """A new :class:`ServerConnection`."""
        return ServerConnection(
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
    ) -> EngineConnection:
        """A new :class:`EngineConnection`."""
        return EngineConnection(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes)


H11_CODEC: Final[Codec] = H11Codec()
