"""The reading half of a client connection (sans-IO): :class:`RequestReader`, the base of :class:`~.server.ServerConnection`.

Driven like h11: ``receive_data`` buffers, ``next_event`` pulls whole
requests (:class:`~.grammar.HttpRequest`, body included, because every
route of ``docs/contract.md`` needs the complete body before it can act).
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

Within those rules a request head means what h11 says it means; whole
heads are decided by :mod:`.request_head`.
"""

from __future__ import annotations

import enum
from typing import Final

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.http.grammar import (
    CHUNK_LINE_RE,
    CONNECTION_CLOSED,
    CR,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_REQUEST_LINE_BYTES,
    FIELD_LINE_RE,
    HEAD_END_RE,
    IS_TCHAR,
    NEED_DATA,
    PAUSED,
    TOKEN_RE,
    ContinueExpected,
    Headers,
    HttpRequest,
    LineMemory,
    NeedData,
    ServerEvent,
)
from narwhal_core.http.request_head import Refused, RequestHead, decide_head, general_reading, read_clean_head

__all__ = ["ALWAYS_CLOSE", "RequestReader", "ClientState"]

# A chunk-size line with extensions longer than this is refused (400): the
# extensions carry nothing Narwhal uses, and each line must be buffered whole.
_MAX_CHUNK_LINE_BYTES: Final = 4096


class ClientState(enum.Enum):
    """Where a client connection is (reading and writing); the names appear in error messages."""

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


ALWAYS_CLOSE: Final = frozenset({ClientState.CLOSING, ClientState.CLOSED, ClientState.ERROR, ClientState.DEAD})


class _RequestChunk(enum.Enum):
    SIZE = "chunk size line"
    DATA = "chunk data"
    DATA_END = "CRLF after chunk data"
    TRAILER = "trailer section"


class RequestReader:
    """The reading half of one client connection; use :class:`~.server.ServerConnection`, which adds the writing.

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
      :data:`~.grammar.PAUSED` anyway).

    ``memory`` is the codec's (a connection made alone gets its own).
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
        self._state = ClientState.IDLE
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
        self._chunk_phase = _RequestChunk.SIZE
        self._chunk_left = 0
        self._trailer_bytes = 0
        self._trailer_count = 0
        self._body = bytearray()

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
        if self._overflow or self._state in ALWAYS_CLOSE:
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
        if state is ClientState.IDLE:
            return self._read_head()
        if state is ClientState.BODY or state is ClientState.EXPECT or state is ClientState.CONTINUED:
            return self._read_body()
        if state is ClientState.WAITING or state is ClientState.STREAMING or state is ClientState.CLOSING:
            return PAUSED
        if state is ClientState.CLOSED:
            return CONNECTION_CLOSED
        if state is ClientState.ERROR:
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
        self._state = ClientState.ERROR
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
                self._state = ClientState.CLOSED
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
        """A whole head: the fast reading if it vouches for it, else :meth:`_decide_request`."""
        accepted = read_clean_head(
            head, self._memory, self._max_line, self._max_header_bytes, self._max_headers, self._max_body
        )
        if accepted is None:
            accepted = self._decide_request(head)
        return self._begin_request(accepted)

    def _decide_request(self, head: bytes) -> RequestHead:
        """Any whole head accepted, or refused with the status it calls for (:func:`~.request_head.decide_head`)."""
        if not self._target:
            self._peek_request_line(head[: max(head.find(b"\n"), 0)])
        try:
            return decide_head(
                head, self._max_line, self._max_header_bytes, self._max_headers, self._max_body,
                self._read_request_head,
            )
        except Refused as refused:
            error = self._fail(refused.message, status=refused.status, reason=refused.reason)
            if refused.method is not None:
                # The head parsed: say which request it was, so the router can
                # journal a refused completion request (docs/operate.md).
                error.method = refused.method
                error.target = refused.target
            raise error from None

    def _read_request_head(self, head: bytes) -> tuple[bytes, bytes, bytes, Headers, bool]:
        """The general reading of a head (h11's rules); the test oracle replaces it with h11 itself."""
        return general_reading(head)

    def _begin_request(self, accepted: RequestHead) -> ServerEvent:
        """Start reading the body of an accepted head (after :class:`~.grammar.ContinueExpected`, if asked for)."""
        method, target, headers, version, keep_alive, chunked, length, continue_expected = accepted
        self._method = method
        self._target = target
        self._headers = headers
        self._version = version
        self._keep_alive = keep_alive
        self._close = not keep_alive
        self._chunked = chunked
        self._content_length = length
        if continue_expected:
            self._state = ClientState.EXPECT
            return ContinueExpected(
                method=method, target=target, headers=headers, content_length=None if chunked else length
            )
        self._state = ClientState.BODY
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
        self._state = ClientState.WAITING
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
            if phase is _RequestChunk.DATA:
                if not buf:
                    return self._starved()
                piece = buf[: self._chunk_left]
                self._body += piece
                del buf[: len(piece)]
                self._chunk_left -= len(piece)
                if self._chunk_left:
                    return self._starved()
                self._chunk_phase = _RequestChunk.DATA_END
            elif phase is _RequestChunk.DATA_END:
                if buf[:2] == b"\r\n":
                    del buf[:2]
                    self._chunk_phase = _RequestChunk.SIZE
                elif len(buf) >= 2 or (buf and buf[0] != CR):
                    raise self._fail("chunk data not followed by CRLF")
                else:
                    return self._starved()
            elif phase is _RequestChunk.SIZE:
                line = self._take_line(_MAX_CHUNK_LINE_BYTES, phase.value, 400)
                if line is None:
                    return self._starved()
                match = CHUNK_LINE_RE.fullmatch(line)
                if match is None:
                    raise self._fail(f"malformed chunk size line: {line[:64]!r}")
                size = int(match.group(1), 16)
                if size == 0:
                    self._chunk_phase = _RequestChunk.TRAILER
                elif len(self._body) + size > self._max_body:
                    error = self._fail(
                        f"chunked body over the {self._max_body}-byte limit", status=413, reason="too_large"
                    )
                    error.method = self._method
                    error.target = self._target
                    raise error
                else:
                    self._chunk_left = size
                    self._chunk_phase = _RequestChunk.DATA
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

    @property
    def has_partial_request(self) -> bool:
        """Bytes of a request that has not been returned whole are buffered.

        Lets an adapter tell an idle keep-alive connection (idle timeout)
        from a client that is sending a request (header and body timeouts).
        """
        state = self._state
        if state is ClientState.BODY or state is ClientState.EXPECT or state is ClientState.CONTINUED:
            return True
        return bool(self._buf) and (state is ClientState.IDLE or state is ClientState.WAITING or state is ClientState.STREAMING)

    @property
    def reading_body(self) -> bool:
        """The current request's head is parsed and its body is not complete.

        Lets the router switch a slow client from the header timeout to the
        body timeout.
        """
        state = self._state
        return state is ClientState.BODY or state is ClientState.EXPECT or state is ClientState.CONTINUED

    @property
    def buffered_bytes(self) -> int:
        """Bytes this connection holds of requests not yet returned (head, body so far, pipelined)."""
        return len(self._buf) + len(self._body)

    @property
    def partial_target(self) -> str | None:
        """The target of the request being read (not yet returned whole), once its request line is in."""
        state = self._state
        if state is ClientState.IDLE or state is ClientState.ERROR or self.reading_body:
            return self._target or None
        return None
