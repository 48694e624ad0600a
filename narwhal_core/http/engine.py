"""The engine side of the HTTP/1.1 codec: :class:`EngineConnection` (sans-IO; Narwhal is the client).

One request/response exchange per object, driven like h11
(``send_request`` returns the bytes to write, ``receive_data`` buffers,
``next_event`` pulls): :class:`~.grammar.ResponseHead`, then
:class:`~.grammar.BodyData` pieces as they arrive (a decode leg is relayed
as it streams, ``docs/design.md``), then :class:`~.grammar.ResponseEnd`.
Legs use it, and so can any small request, a JSON POST or a GET, whatever
the answer's framing (``Content-Length``, chunked, or close-delimited; a
``Connection: close`` answer ends non-reusable).

It reads responses as h11 0.16 reads them -- h11 is the oracle it is
tested against byte for byte (``tests/core/http_reference.py``) --
including where h11 is lenient, since the two must agree on any bytes an
engine may send:

* heads end at the first empty line, CRLF or bare LF, and one that starts
  with an empty line or a byte below 0x21 is refused at once, as h11 does;
  when the status line (h11's grammar: any ``HTTP/d.d``, three digits, an
  optional reason) ends in CRLF and the field lines pass the fast reading
  (:func:`~.grammar.field_lines`), those are read by it; any other head --
  bare LF line ends (h11 accepts them), obs-fold (h11 unfolds it), values
  with control bytes, a repeated identical ``Content-Length`` (h11 merges
  it), ``gzip, chunked`` -- is read by the general reading
  (:func:`~.grammar.decode_fields`), the authority of this side; 101 and
  statuses below 100 are refused as h11 refuses them;
* the chunked decoder is h11's, laxer than the strict client-side decoder:
  a chunk line ends at the first CRLF, size of 1-20 hex digits, any
  extension (anything but LF after ``;``), optional trailing whitespace;
  CRLF after the data; trailer lines read like head lines (a lone LF ends
  an empty trailer section); h11's ``max_incomplete_event_size`` (431 ->
  ``too_large``) applies whenever the parser waits for data;
* body pieces may be cut differently from h11's (consecutive chunks come
  out as one :class:`~.grammar.BodyData`), which the protocol allows; the
  body limit still refuses at the same piece, after the same bytes.

The request writer produces byte for byte what h11 writes (request line,
``Host`` first, the fields in order, then ``content-length``). Status
lines, field lines, chunk sizes and the request parts a router sends on
every leg are remembered in the codec's :class:`~.grammar.LineMemory`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Final

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.http.grammar import (
    BODY_METHODS,
    CODEC_FIELDS,
    DEFAULT_ENGINE_MAX_BODY_BYTES,
    DEFAULT_ENGINE_MAX_HEADER_BYTES,
    H11_CHUNK_LINE_RE,
    HEAD_END_RE,
    MAX_CHECKED_REQUEST_PARTS,
    NEED_DATA,
    NO_BODY_STATUSES,
    OWS,
    TOKEN,
    BodyData,
    EngineEvent,
    Fields,
    LineMemory,
    Malformed,
    NeedData,
    ResponseEnd,
    ResponseHead,
    comma_tokens,
    keeping,
    only,
    decode_fields,
    encode_request_line,
    read_response_head,
    remember,
    split_lines,
)

__all__ = ["EngineConnection"]

#: What a client gets when an engine breaks HTTP.
_ERROR_STATUS: Final = 502
# Engine streams have no body limit; this bounds the bytes an adapter may
# hand over between two next_event() calls on such a connection.
_STREAM_BUFFER_BYTES: Final = 16 * 1024 * 1024

# h11's token and field-value rules as byte sets, for the request writer (no regex per field).
_VALUE: Final = keeping(bytes(b for b in range(256) if b not in b"\x00\n\r\x0b\x0c"))  # SP/HTAB inside only
_VCHARS: Final = keeping(bytes(range(0x21, 0x7F)))
# Request fields the writer looks at: Host goes first, Connection may close,
# the rest are the codec's to write.
_REQUEST_SPECIAL_FIELDS: Final = frozenset({b"host", b"connection", b"upgrade"} | CODEC_FIELDS)


def _request_line(method: str, target: str) -> tuple[bytes, bytes]:
    """The method and target as the request writer sends them; raises if h11 would refuse them."""
    raw_method, raw_target = encode_request_line(method, target)
    if (
        not raw_method
        or not only(raw_method, TOKEN)
        or not raw_target
        or not only(raw_target, _VCHARS)
    ):
        raise LocalProtocolError(f"cannot send this request: illegal method or target {method!r} {target!r}")
    return raw_method, raw_target


def encode_request(
    method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes, memory: LineMemory
) -> tuple[bytes, bool, bool]:
    """A whole request as bytes, whether it is a HEAD, and whether it asks to close; raises ``LocalProtocolError``.

    What :meth:`EngineConnection.send_request` writes: byte for byte what
    h11 would, with h11's rules on names and values. The fields a router
    sends on every leg are checked once, in ``memory``.
    """
    host = b""
    hosts = 0
    lines: list[bytes] = []
    close = False
    checked = memory.request_fields
    for name, value in headers:
        known = checked.get((name, value))
        if known is not None:
            # Checked before: the engine's Host, the content type, the
            # credential are the same on every leg.
            is_host, line = known
            if is_host:
                hosts += 1
                host = line
            else:
                lines.append(line)
            continue
        lowered = name.lower()
        if lowered in _REQUEST_SPECIAL_FIELDS:
            if lowered == b"host":
                hosts += 1
            elif lowered == b"connection":
                close = close or b"close" in comma_tokens(value)
            else:
                raise LocalProtocolError(f"{name!r} is not allowed; the codec frames the request")
        # h11's token and field-value rules.
        if (
            not name
            or not only(name, TOKEN)
            or (value and (not only(value, _VALUE) or value[0] in OWS or value[-1] in OWS))
        ):
            raise LocalProtocolError(f"cannot send this request: illegal header {name!r}: {value!r}")
        line = b"%s: %s\r\n" % (name, value)
        if lowered == b"host":
            host = line
        else:
            lines.append(line)
        if lowered != b"connection" and len(checked) < MAX_CHECKED_REQUEST_PARTS:
            checked[(name, value)] = (lowered == b"host", line)
    if not hosts:
        raise LocalProtocolError("an engine request needs a host header")
    if hosts > 1:
        raise LocalProtocolError("cannot send this request: more than one host header")
    lines_out = memory.request_lines_out
    raw = lines_out.get((method, target))
    if raw is None:
        raw = _request_line(method, target)
        if len(lines_out) < MAX_CHECKED_REQUEST_PARTS:
            lines_out[(method, target)] = raw
    raw_method, raw_target = raw
    if body or raw_method in BODY_METHODS:
        lines.append(b"content-length: %d\r\n" % len(body))
    # h11's layout: request line, Host first, the other fields in order.
    data = b"%s %s HTTP/1.1\r\n%s%s\r\n%s" % (raw_method, raw_target, host, b"".join(lines), body)
    return data, raw_method == b"HEAD", close


# ---------------------------------------------------------------------------
# EngineConnection
# ---------------------------------------------------------------------------


class _State(enum.Enum):
    NEW = "NEW"  # send_request() not called yet
    HEAD = "HEAD"  # waiting for the final response head
    BODY = "BODY"  # reading the body
    DONE = "DONE"  # ResponseEnd returned
    ERROR = "ERROR"  # next_event raised


class _AnswerFraming(enum.Enum):
    NONE = "no body"
    LENGTH = "content-length"
    CHUNKED = "chunked"
    CLOSE = "close-delimited"


class _AnswerChunk(enum.Enum):
    SIZE = "chunk size line"
    DATA = "chunk data"
    CRLF = "CRLF after chunk data"
    TRAILER = "trailer section"


_NEW: Final = _State.NEW
_HEAD: Final = _State.HEAD
_BODY: Final = _State.BODY
_DONE: Final = _State.DONE
_ERROR: Final = _State.ERROR
_LENGTH: Final = _AnswerFraming.LENGTH
_CHUNKED: Final = _AnswerFraming.CHUNKED
_CLOSE: Final = _AnswerFraming.CLOSE
_SIZE: Final = _AnswerChunk.SIZE
_DATA: Final = _AnswerChunk.DATA
_CRLF_AFTER_DATA: Final = _AnswerChunk.CRLF
_CHUNK_END: Final = b"\r\n"


class EngineConnection:
    """One request/response exchange with an engine (we are the client), on a fresh or pooled socket.

    Make a new one for every request, even on a reused socket:
    :meth:`send_request` once, then :meth:`receive_data` / :meth:`next_event`
    until :class:`~.grammar.ResponseEnd`, whose ``reusable`` says whether
    the socket may carry another request. Errors are ``RemoteProtocolError``
    with status 502 and ``reason`` ``"dropped"`` (EOF before the response
    was complete), ``"malformed"`` or ``"too_large"`` (head over
    ``max_header_bytes``, body over ``max_body_bytes``; ``None`` means
    unlimited, for streams). Responses that carry both ``Content-Length``
    and ``Transfer-Encoding`` are refused: a pooled socket must never be
    reused after a response whose end is ambiguous. Bytes handed to
    ``receive_data`` between two ``next_event`` calls are bounded by
    ``max_header_bytes + max_body_bytes`` (16 MiB in place of an unlimited
    body); past that they are dropped and ``next_event`` raises
    ``too_large``. ``memory`` is the codec's (one made alone gets its own).
    """

    __slots__ = (
        "_max_header_bytes",
        "_max_body",
        "_max_unparsed",
        "_buf",
        "_unparsed",
        "_scan",
        "_eof",
        "_overflow",
        "_state",
        "_error",
        "_end",
        "_head_request",
        "_request_close",
        "_keep_alive",
        "_framing",
        "_remaining",
        "_chunk",
        "_crlf_left",
        "_received",
        "_memory",
    )

    def __init__(
        self,
        *,
        max_header_bytes: int = DEFAULT_ENGINE_MAX_HEADER_BYTES,
        max_body_bytes: int | None = DEFAULT_ENGINE_MAX_BODY_BYTES,
        memory: LineMemory | None = None,
    ) -> None:
        if max_header_bytes < 0 or (max_body_bytes is not None and max_body_bytes < 0):
            raise ValueError("limits must not be negative")
        self._max_header_bytes = max_header_bytes
        self._max_body = max_body_bytes
        self._max_unparsed = max_header_bytes + (
            max_body_bytes if max_body_bytes is not None else _STREAM_BUFFER_BYTES
        )
        self._buf = bytearray()  # what h11's receive buffer would hold
        self._unparsed = 0  # bytes received since the parser last ran dry
        self._scan = 0  # where the search for the end of the head resumes
        self._eof = False
        self._overflow = False
        self._state = _NEW
        self._error: RemoteProtocolError | None = None
        self._end: ResponseEnd | None = None
        self._head_request = False
        self._request_close = False
        self._keep_alive = False
        self._framing = _AnswerFraming.NONE
        self._remaining = 0  # body bytes left: of the Content-Length, or of the current chunk
        self._chunk = _SIZE
        self._crlf_left = b""
        self._received = 0  # body bytes returned so far
        # The lines read and written before, shared with the other connections of one codec.
        self._memory = memory if memory is not None else LineMemory()

    # -- writing ------------------------------------------------------------

    def send_request(self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The whole request as bytes to write; call once.

        ``headers`` must include ``host`` and no framing or upgrade fields;
        the codec adds ``content-length`` (for a body, or always for POST,
        PUT and PATCH). A caller may pass ``connection: close``; the
        response then ends non-reusable.
        """
        if self._state is not _NEW:
            raise LocalProtocolError(f"send_request() in state {self._state.value}: one request per EngineConnection")
        data, self._head_request, self._request_close = encode_request(method, target, headers, body, self._memory)
        self._state = _HEAD
        return data

    # -- reading ------------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes from the engine; ``b""`` means the engine closed (EOF)."""
        if not data:
            self._eof = True
            return
        if self._eof:
            raise LocalProtocolError("receive_data() after EOF")
        state = self._state
        if self._overflow or state is _DONE or state is _ERROR:
            return
        if self._unparsed + len(data) > self._max_unparsed:
            self._overflow = True
            return
        self._unparsed += len(data)
        self._buf += data

    def next_event(self) -> EngineEvent:
        """The next response event or :data:`NEED_DATA`.

        Informational (1xx) responses are skipped. After
        :class:`ResponseEnd` the same value is returned again; bytes that
        were already buffered after the response make it non-reusable.
        """
        state = self._state
        if state is _BODY:
            framing = self._framing
            if framing is _LENGTH:
                return self._read_length()
            if framing is _CHUNKED:
                return self._read_chunked()
            if framing is _CLOSE:
                return self._read_until_close()
            return self._finish()
        if state is _HEAD:
            return self._read_head()
        if state is _DONE:
            assert self._end is not None
            return self._end
        if state is _ERROR:
            assert self._error is not None
            raise self._error.with_traceback(None)
        raise LocalProtocolError("next_event() before send_request()")

    def _fail(self, message: str, reason: str) -> RemoteProtocolError:
        error = RemoteProtocolError(message, status=_ERROR_STATUS, reason=reason)
        self._error = error
        self._state = _ERROR
        self._buf = bytearray()
        return error

    def _starved(self) -> NeedData | ResponseEnd:
        """What h11 does when it wants more bytes."""
        if len(self._buf) > self._max_header_bytes:
            # h11's max_incomplete_event_size: an unfinished head, chunk line or trailer section.
            raise self._fail(f"more than {self._max_header_bytes} bytes of an unfinished head", "too_large")
        self._unparsed = 0
        if self._overflow:
            raise self._fail("too many bytes buffered before parsing", "too_large")
        if not self._eof:
            return NEED_DATA
        if self._state is _BODY and self._framing is _CLOSE:
            # The one body whose end is the EOF (RFC 9112 §6.3 p8).
            return self._finish()
        raise self._fail("engine closed the connection before the response was complete", "dropped")

    def _finish(self) -> ResponseEnd:
        end = ResponseEnd(reusable=self._keep_alive and not self._eof and not self._overflow and not self._buf)
        self._end = end
        self._state = _DONE
        return end

    def _read_head(self) -> EngineEvent:
        buf = self._buf
        while True:
            # h11: a head starting with an empty line is refused at once...
            if buf[:1] == b"\n" or buf[:2] == b"\r\n":
                raise self._fail("empty line where a status line was expected", "malformed")
            match = HEAD_END_RE.search(buf, self._scan)
            if match is None:
                self._scan = max(0, len(buf) - 2)
                # ...and so is one that cannot start with "HTTP/".
                if buf and buf[0] < 0x21:
                    raise self._fail(f"not an HTTP response: {bytes(buf[:16])!r}", "malformed")
                starved = self._starved()
                assert starved is NEED_DATA
                return starved
            end = match.end()
            head = bytes(buf[:end])
            del buf[:end]
            self._scan = 0
            try:
                status, version, fields, special = read_response_head(head, self._memory)
            except Malformed as exc:
                raise self._fail(f"malformed response: {exc}", "malformed") from None
            if end > self._max_header_bytes:
                raise self._fail(f"response head larger than {self._max_header_bytes} bytes", "too_large")
            if status >= 200:
                return self._response_head(status, version, fields, special)

    def _response_head(self, status: int, version: bytes, fields: Fields, special: Fields) -> ResponseHead:
        length: int | None = None
        chunked = False
        close = False
        for name, value in special:
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = True
            elif name == b"connection" and b"close" in comma_tokens(value):
                close = True
        has_body = not self._head_request and status not in NO_BODY_STATUSES
        if chunked and length is not None:
            raise self._fail("both Content-Length and Transfer-Encoding", "malformed")
        max_body = self._max_body
        if has_body and length is not None and max_body is not None and length > max_body:
            raise self._fail(f"response body of {length} bytes is over {max_body}", "too_large")
        # h11's keep-alive rule, for the request we sent and for this response.
        self._keep_alive = not close and not self._request_close and version >= b"1.1"
        if not has_body:
            self._framing = _AnswerFraming.NONE
        elif chunked:
            self._framing = _CHUNKED
        elif length is not None:
            self._framing = _LENGTH
            self._remaining = length
        else:
            self._framing = _CLOSE
        self._state = _BODY
        return ResponseHead(status=status, headers=tuple(fields))

    def _over_limit(self, size: int) -> bool:
        max_body = self._max_body
        return max_body is not None and self._received + size > max_body

    def _body_too_large(self) -> RemoteProtocolError:
        return self._fail(f"response body over {self._max_body} bytes", "too_large")

    def _read_length(self) -> EngineEvent:
        # The head refused a Content-Length over the limit: no check here.
        remaining = self._remaining
        if not remaining:
            return self._finish()
        buf = self._buf
        size = len(buf)
        if not size:
            return self._starved()
        if size <= remaining:
            data = bytes(buf)
            buf.clear()
        else:
            size = remaining
            data = bytes(memoryview(buf)[:size])
            del buf[:size]
        self._remaining = remaining - size
        self._received += size
        return BodyData(data=data)

    def _read_until_close(self) -> EngineEvent:
        buf = self._buf
        if not buf:
            return self._starved()
        if self._over_limit(len(buf)):
            raise self._body_too_large()
        self._received += len(buf)
        data = bytes(buf)
        buf.clear()
        return BodyData(data=data)

    def _read_chunked(self) -> EngineEvent:
        # h11's ChunkedReader, one piece per chunk (or per part of a chunk
        # that has arrived), run until the buffer is dry; the pieces come out
        # as one BodyData. A step that would fail, or end the message, waits
        # for the next call when pieces are pending, so the pieces the
        # oracle would have returned first still come out first.
        buf = self._buf
        if self._chunk is _SIZE:
            # The usual read of a stream: exactly one whole chunk, its CRLF included.
            line_end = buf.find(b"\r\n")
            if line_end > 0:
                size = self._memory.chunk_sizes.get(bytes(buf[:line_end]), 0)
                start = line_end + 2
                if (
                    size > 0
                    and len(buf) == start + size + 2
                    and buf.endswith(_CHUNK_END)
                    and not self._over_limit(size)
                ):
                    self._received += size
                    data = bytes(buf[start : start + size])
                    buf.clear()
                    return BodyData(data=data)
        chunk_sizes = self._memory.chunk_sizes
        pos = 0
        spans: list[tuple[int, int]] = []
        while True:
            phase = self._chunk
            if phase is _DATA:
                size = min(self._remaining, len(buf) - pos)
                if not size:
                    break
                if self._over_limit(size):
                    if spans:
                        break
                    raise self._body_too_large()
                self._received += size
                spans.append((pos, pos + size))
                pos += size
                self._remaining -= size
                if self._remaining:
                    break
                if buf.startswith(_CHUNK_END, pos):
                    pos += 2  # the usual case: the CRLF came with the data
                    self._chunk = _SIZE
                else:
                    self._chunk = _CRLF_AFTER_DATA
                    self._crlf_left = _CHUNK_END
            elif phase is _SIZE:
                line_end = buf.find(b"\r\n", pos)
                if line_end == -1:
                    break
                line = bytes(buf[pos:line_end])
                size = chunk_sizes.get(line, -1)
                if size < 0:
                    match = H11_CHUNK_LINE_RE.fullmatch(line + _CHUNK_END)
                    if match is None:
                        if spans:
                            break
                        raise self._fail(f"malformed chunk size line {(line + _CHUNK_END)[:64]!r}", "malformed")
                    size = int(match.group(1), 16)
                    remember(chunk_sizes, line, size)
                if size == 0 and spans:
                    break
                pos = line_end + 2
                if size == 0:
                    self._chunk = _AnswerChunk.TRAILER
                else:
                    self._remaining = size
                    self._chunk = _DATA
            elif phase is _CRLF_AFTER_DATA:
                expected = self._crlf_left
                got = bytes(buf[pos : pos + len(expected)])
                if not got:
                    break
                if not expected.startswith(got):
                    if spans:
                        break
                    raise self._fail(f"chunk data followed by {got!r}, not CRLF", "malformed")
                pos += len(got)
                self._crlf_left = expected[len(got) :]
                if self._crlf_left:
                    break
                self._chunk = _SIZE
            else:
                return self._read_trailer(pos)
        if spans:
            view = memoryview(buf)
            if len(spans) == 1:
                start, stop = spans[0]
                data = bytes(view[start:stop])
            else:
                data = b"".join([view[start:stop] for start, stop in spans])
            view.release()
            del buf[:pos]
            return BodyData(data=data)
        del buf[:pos]
        return self._starved()

    def _read_trailer(self, pos: int) -> EngineEvent:
        # h11's maybe_extract_lines: a leading LF or CRLF is an empty section.
        buf = self._buf
        if buf[pos : pos + 1] == b"\n":
            end = pos + 1
        elif buf[pos : pos + 2] == b"\r\n":
            end = pos + 2
        else:
            match = HEAD_END_RE.search(buf, pos)
            if match is None:
                del buf[:pos]
                return self._starved()
            end = match.end()
            try:
                decode_fields(split_lines(bytes(buf[pos:end])))
            except Malformed as exc:
                raise self._fail(f"malformed trailer section: {exc}", "malformed") from None
        del buf[:end]
        return self._finish()


