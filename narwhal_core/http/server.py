"""The client-facing side of the HTTP/1.1 codec: :class:`ServerConnection` (sans-IO; Narwhal is the server).

Driven like h11: ``receive_data`` buffers, ``next_event`` pulls,
``send_*`` returns the bytes to write. It yields whole requests
(:class:`~.grammar.HttpRequest`, body included), because every route of
``docs/contract.md`` needs the complete body before it can act. Only
:class:`~narwhal_core.errors.RemoteProtocolError` (the client broke
HTTP/1.1) and :class:`~narwhal_core.errors.LocalProtocolError` (the caller
asked for something HTTP/1.1 does not allow) escape it.

A router in front of a fleet must not be the weak link in a
request-smuggling chain (RFC 9112 §6.3, §11.2), so it is stricter than h11
(the oracle it is tested against, ``tests/core/http_reference.py``):

* ``Content-Length`` together with ``Transfer-Encoding`` is refused (h11
  lets chunked win); so is a repeated or list-valued ``Content-Length``
  (h11 merges identical values), and ``Transfer-Encoding`` on HTTP/1.0.
* Obsolete line folding is refused (h11 unfolds it); bare CR and bare LF
  anywhere in the head are refused (h11 accepts LF-only line ends).
* The chunked body is decoded strictly: CRLF after every line and every
  chunk, at most 16 hex digits of size, well-formed extensions and trailer
  fields, no bare CR/LF, no folding. h11 accepts a bare LF at the end of
  the trailer section and a bare CR inside a chunk extension.
* Separate limits with their own statuses: request line (431), header
  section size and count (431), body (413, decided from ``Content-Length``
  or from each chunk size before the bytes are read), and a bound on all
  buffered bytes so pipelined data cannot grow without limit.
* HTTP versions other than 1.0 and 1.1 get 505; a request line that is too
  long gets 431 rather than 414 (``docs/contract.md``).

Within those rules a request head means what h11 says it means. Each head
is read first by the fast reading (:meth:`ServerConnection._start_request`,
which only accepts, remembering the lines it read in the codec's
:class:`~.grammar.LineMemory`), and when it cannot vouch for a head, by
:meth:`ServerConnection._decide_request` (the checks above and h11's rules,
:func:`~.grammar.read_request_head`). Responses are serialised here (so
HTTP/1.0 keep-alive works, which h11 does not support), with every header
name and value validated before it is written.

The class is over the usual size: its reading (buffering, limits, head,
body, strict chunked decoder) and its writing share one state table and
read best together.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Final

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.http.grammar import (
    CHUNK_LINE_RE,
    CONNECTION_CLOSED,
    CONTENT_LENGTH_MAX_DIGITS,
    CONTINUE_RESPONSE,
    CR,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_REQUEST_LINE_BYTES,
    FIELD_LINE_RE,
    HEAD_END_RE,
    IS_TCHAR,
    NEED_DATA,
    NO_BODY_STATUSES,
    PAUSED,
    REQUEST_LINE_RE,
    STATUS_LINES,
    TOKEN_RE,
    ContinueExpected,
    Headers,
    HttpRequest,
    LineMemory,
    Malformed,
    NeedData,
    ServerEvent,
    comma_tokens,
    encode_fields,
    field_lines,
    known_line,
    lowercase_transfer_coding,
    read_request_head,
)

__all__ = ["ServerConnection"]

# A chunk-size line with extensions longer than this is refused (400): the
# extensions carry nothing Narwhal uses, and each line must be buffered whole.
_MAX_CHUNK_LINE_BYTES: Final = 4096


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
    :meth:`send_error_response`. ``memory`` is the codec's (a connection
    made alone gets its own).
    """

    def __init__(
        self,
        *,
        max_request_line_bytes: int = DEFAULT_MAX_REQUEST_LINE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        memory: LineMemory | None = None,
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
        # The lines read before, shared with the other connections of one codec.
        self._memory = memory if memory is not None else LineMemory()
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
            return CONNECTION_CLOSED
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
                return CONNECTION_CLOSED
            return NEED_DATA
        first = buf[0]
        if not IS_TCHAR[first]:
            if first == CR and len(buf) == 1:
                return self._starved()
            # Catches TLS handshakes and other non-HTTP bytes at once.
            raise self._fail(f"request line does not start with a method: {bytes(buf[:16])!r}")
        match = HEAD_END_RE.search(buf, self._scan)
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
        if len(parts) == 3 and parts[1] and TOKEN_RE.fullmatch(parts[0]) and parts[2].startswith(b"HTTP/"):
            self._method = parts[0].decode("latin-1")
            self._target = parts[1].decode("latin-1")

    # -- a request head -------------------------------------------------------

    def _start_request(self, head: bytes) -> ServerEvent:
        """Decide a whole request head: the fast reading if it can vouch for it, else :meth:`_decide_request`.

        The fast reading only accepts. A head that the checks of
        :meth:`_decide_request` would refuse, or that it cannot vouch for,
        is decided there instead, with its status (400/413/431/505). Those
        checks hold for a head accepted here: the request line is matched
        below and ends in CRLF, :func:`~.grammar.field_lines` refuses bare
        CR, bare LF and obs-fold in the field lines, and the sizes and the
        field count are compared.
        """
        line_end = head.find(b"\n")
        if (
            line_end > self._max_line + 1
            or len(head) - line_end - 1 > self._max_header_bytes
            or head[line_end - 1] != CR
        ):
            return self._decide_request(head)
        memory = self._memory
        request_line = known_line(head[: line_end - 1], memory.request_lines, REQUEST_LINE_RE)
        if request_line is None:
            return self._decide_request(head)
        raw_method, raw_target, raw_version = request_line
        if raw_version == b"1.1":
            version = "1.1"
        elif raw_version == b"1.0":
            version = "1.0"
        else:
            return self._decide_request(head)  # 505, or 400 if a field is bad too
        parsed = field_lines(head, line_end + 1, memory.field_lines)
        if parsed is None or len(parsed[0]) > self._max_headers:
            return self._decide_request(head)

        fields, special = parsed
        hosts = 0
        content_length: bytes | None = None
        chunked = False
        connection = b""
        expect = b""
        for name, value in special:
            if name == b"host":
                hosts += 1
            elif name == b"content-length":
                if content_length is not None:
                    return self._decide_request(head)  # merged or refused there
                content_length = value
            elif name == b"transfer-encoding":
                if chunked or value.lower() != b"chunked":
                    return self._decide_request(head)
                chunked = True
                if value != b"chunked":
                    fields = lowercase_transfer_coding(fields)
            elif name == b"connection":
                connection += b"," + value.lower()
            else:
                expect += b"," + value
        # The Host rule (RFC 9112 §3.2), and the smuggling rules (RFC 9112 §6.3).
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            return self._decide_request(head)
        length = 0
        if chunked:
            if content_length is not None or version == "1.0":
                return self._decide_request(head)
        elif content_length is not None:
            if len(content_length) > CONTENT_LENGTH_MAX_DIGITS or not content_length.isdigit():
                return self._decide_request(head)
            length = int(content_length)
            if length > self._max_body:
                return self._decide_request(head)  # 413
        # An HTTP/1.1 request whose Expect lists 100-continue (RFC 9110 §10.1.1).
        continue_expected = bool(expect) and version == "1.1" and b"100-continue" in comma_tokens(expect)
        return self._begin_request(
            raw_method.decode("ascii"), raw_target.decode("latin-1"), tuple(fields), version,
            connection, chunked, length, continue_expected,
        )

    def _decide_request(self, head: bytes) -> ServerEvent:
        """Decide any request head: accept it, or refuse it with the status it calls for.

        Size checks first, in the order the incremental checks of
        :meth:`_read_head` meet them, so a head split anywhere fails the
        same way; then what the general reading refuses (400), the HTTP
        version (505), and the smuggling rules on top of it: Content-Length
        with Transfer-Encoding, a repeated or list-valued Content-Length,
        Transfer-Encoding on HTTP/1.0 (400), a body over the limit (413).
        """
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
        try:
            raw_method, raw_target, raw_version, headers, continue_expected = self._read_request_head(head)
        except Malformed as exc:
            raise self._fail(f"malformed request head: {exc}") from None
        if raw_version == b"1.1":
            version = "1.1"
        elif raw_version == b"1.0":
            version = "1.0"
        else:
            raise self._fail(f"HTTP/{raw_version.decode('ascii')} is not supported", status=505)

        content_length: bytes | None = None
        chunked = False
        connection = b""
        for name, value in headers:
            if name == b"content-length":
                content_length = value
            elif name == b"transfer-encoding":
                # The general reading accepts exactly one Transfer-Encoding, equal to "chunked".
                chunked = True
            elif name == b"connection":
                connection += b"," + value.lower()
        if chunked:
            if content_length is not None:
                raise self._fail("both Content-Length and Transfer-Encoding")
            if version == "1.0":
                raise self._fail("Transfer-Encoding in an HTTP/1.0 request")
        length = 0
        if content_length is not None:
            # The general reading merges repeated or list-valued identical
            # lengths; a smuggling chain relies on two parsers disagreeing,
            # so refuse.
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
                # journal a refused completion request (docs/operate.md).
                error.method = raw_method.decode("ascii")
                error.target = raw_target.decode("latin-1")
                raise error
        return self._begin_request(
            raw_method.decode("ascii"), raw_target.decode("latin-1"), headers, version,
            connection, chunked, length, continue_expected,
        )

    def _read_request_head(self, head: bytes) -> tuple[bytes, bytes, bytes, Headers, bool]:
        """Method, target, version, fields and whether 100-continue is expected; raises :class:`Malformed`.

        The general reading (:func:`~.grammar.read_request_head`), h11's
        rules; the test oracle (``tests/core/http_reference.py``) replaces
        this one method with h11 itself.
        """
        raw_method, raw_target, raw_version, fields = read_request_head(head)
        expect = b",".join([value for name, value in fields if name == b"expect"])
        continue_expected = bool(expect) and raw_version == b"1.1" and b"100-continue" in comma_tokens(expect)
        return raw_method, raw_target, raw_version, tuple(fields), continue_expected

    def _begin_request(
        self, method: str, target: str, headers: Headers, version: str,
        connection: bytes, chunked: bool, length: int, continue_expected: bool,
    ) -> ServerEvent:
        """Start reading the body of an accepted head (after :class:`ContinueExpected`, if asked for)."""
        if connection:
            options = {option.strip() for option in connection.split(b",")}
            if version == "1.1":
                keep_alive = b"close" not in options
            else:
                keep_alive = b"keep-alive" in options and b"close" not in options
        else:
            keep_alive = version == "1.1"
        self._method = method
        self._target = target
        self._headers = headers
        self._version = version
        self._keep_alive = keep_alive
        self._close = not keep_alive
        self._chunked = chunked
        self._content_length = length
        if continue_expected:
            self._state = _State.EXPECT
            return ContinueExpected(
                method=method, target=target, headers=headers, content_length=None if chunked else length
            )
        self._state = _State.BODY
        return self._read_body()

    # -- a request body ---------------------------------------------------------

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
        if end == 0 or buf[end - 1] != CR:
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
                elif len(buf) >= 2 or (buf and buf[0] != CR):
                    raise self._fail("chunk data not followed by CRLF")
                else:
                    return self._starved()
            elif phase is _Chunk.SIZE:
                line = self._take_line(_MAX_CHUNK_LINE_BYTES, phase.value, 400)
                if line is None:
                    return self._starved()
                match = CHUNK_LINE_RE.fullmatch(line)
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
                if FIELD_LINE_RE.fullmatch(line) is None:
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
        lines, close = self._response_lines(status, headers)
        if status in NO_BODY_STATUSES:
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
        lines, close = encode_fields(headers)
        lines.insert(0, STATUS_LINES[status])
        return lines, close

    def send_stream_start(self, status: int, headers: Sequence[tuple[bytes, bytes]]) -> bytes:
        """The head of a streamed response: chunked for HTTP/1.1, close-delimited for 1.0."""
        self._transition(_Send.STREAM_START)
        if status in NO_BODY_STATUSES:
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
        if status in NO_BODY_STATUSES:
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


