"""The fast HTTP/1.1 codec behind the codec protocols of :mod:`.http1`.

:data:`FAST_CODEC` gives the same events, the same errors (status and
``reason``) and the same response bytes as the reference codec
:data:`~narwhal_core.http1.H11_CODEC`, for any bytes however they are
split; ``tests/core/test_http1.py`` runs every codec test against both and
compares them on generated and mutated byte streams. Only what costs time
is done differently:

* A head's lines are read without h11's per-line regexes and event
  machinery. Field lines are split on CRLF and each is checked with bytes
  operations against a rule narrower than h11's (:func:`_field_lines`);
  request and status lines are matched with h11's own grammar (RFC 9112
  §3, §4). Lines read before are remembered with what they gave (bounded;
  lines carrying credentials are never kept), since clients and engines
  send the same lines again and again.
* Bodies (``Content-Length``, chunked, close-delimited) are framed here in
  Python, on one buffer, without per-chunk event objects.

**Client side** (:class:`FastServerConnection`). It extends
:class:`~narwhal_core.http1.ServerConnection` and replaces only the h11
parse of a request head: buffering, the head-size limits, the strict
chunked decoder, the state table and the response serialiser are the
reference's own code. The fast path *only accepts*: a head it cannot prove
the reference would accept with the same values is handed to the reference
parse, which refuses it with its own status (400/413/431/505) or, rarely,
accepts it. What the fast path leaves to the reference:

* anything but CRLF line ends: bare CR, bare LF and obsolete line folding
  (a field line starting with whitespace is not a token);
* request lines that are not h11's ``token SP VCHAR+ SP HTTP/d.d``, and
  versions other than 1.0/1.1, for which the reference decides between 400
  and 505;
* field values holding control bytes other than HTAB (h11 accepts all but
  NUL; the fast rule accepts HTAB, SP, VCHAR and obs-text only), and heads
  over the size or field-count limits;
* ``Host``: one is required for HTTP/1.1 and two are refused (h11's rule);
* ``Transfer-Encoding``: anything but exactly one field equal to
  ``chunked`` (any case, stored lowercased as h11 does), or one together
  with ``Content-Length``, or on HTTP/1.0;
* ``Content-Length``: anything but a single field of at most 20 digits
  within ``max_body_bytes`` (the reference merges lists and repeats, or
  answers 413).

**Engine side** (:class:`FastEngineConnection`) is written here in full,
and follows h11 0.16 -- the reference's engine-side parser -- rule for
rule, including where h11 is lenient, since the two must agree on any
bytes an engine may send:

* heads end at the first empty line, CRLF or bare LF, and one that starts
  with an empty line or a byte below 0x21 is refused at once, as h11 does;
  when the status line (h11's grammar: any ``HTTP/d.d``, three digits, an
  optional reason) ends in CRLF and the field lines pass the fast rule
  above, those are read by it; any other head -- bare LF line ends (h11
  accepts them), obs-fold (h11 unfolds it), values with control bytes, a
  repeated identical ``Content-Length`` (h11 merges it), ``gzip, chunked``
  -- is read by the h11-faithful Python reader (:func:`_decode_fields`),
  which is the semantic authority of this side; 101 and statuses below 100
  are refused as h11 refuses them;
* the chunked decoder is h11's, laxer than the strict client-side decoder:
  a chunk line ends at the first CRLF, size of 1-20 hex digits, any
  extension (anything but LF after ``;``), optional trailing whitespace;
  CRLF after the data; trailer lines read like head lines (a lone LF ends
  an empty trailer section); h11's ``max_incomplete_event_size`` (431 ->
  ``too_large``) applies whenever the parser waits for data;
* body pieces may be cut differently (consecutive chunks come out as one
  :class:`~narwhal_core.http1.BodyData`), which the protocol allows; the
  body limit still refuses at the same piece, after the same bytes.

The response serialiser and request writer produce byte-for-byte what the
reference writes (h11's request layout: ``Host`` first, then the fields in
order, then ``content-length``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from typing import Final, TypeVar

import attrs

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.http1 import (
    _BODY_METHODS,
    _CODEC_FIELDS,
    _ENGINE_ERROR_STATUS,
    _ENGINE_STREAM_BUFFER_BYTES,
    _FIELD_VALUE_BYTES,
    _HEAD_END_RE,
    _NO_BODY_STATUSES,
    _OWS,
    _TOKEN_BYTES,
    DEFAULT_ENGINE_MAX_BODY_BYTES,
    DEFAULT_ENGINE_MAX_HEADER_BYTES,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_REQUEST_LINE_BYTES,
    NEED_DATA,
    BodyData,
    Codec,
    ContinueExpected,
    EngineEvent,
    NeedData,
    ResponseEnd,
    ResponseHead,
    ServerConnection,
    ServerEvent,
    _encode_request_line,
    _EngineState,
    _State,
)

__all__ = [
    "FastServerConnection",
    "FastEngineConnection",
    "FastCodec",
    "FAST_CODEC",
]

Fields = list[tuple[bytes, bytes]]


# ---------------------------------------------------------------------------
# h11's grammar (h11 0.16, ``_abnf.py``), which the reference applies
# ---------------------------------------------------------------------------

_H11_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_H11_FIELD_VCHAR = rb"[^\x00\s]"  # h11 accepts every byte but NUL and whitespace
_H11_FIELD_VALUE = rb"(?:" + _H11_FIELD_VCHAR + rb"+(?:[ \t]+" + _H11_FIELD_VCHAR + rb"+)*)?"
_H11_FIELD_LINE_RE: Final = re.compile(rb"(" + _H11_TOKEN + rb"):[ \t]*(" + _H11_FIELD_VALUE + rb")[ \t]*")
_REQUEST_LINE_RE: Final = re.compile(rb"(" + _H11_TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])")
_STATUS_LINE_RE: Final = re.compile(
    rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|" + _H11_FIELD_VCHAR + rb")*)?"
)
_CHUNK_HEADER_RE: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_DIGITS_RE: Final = re.compile(rb"[0-9]+")
_CONTENT_LENGTH_MAX_DIGITS: Final = 20  # h11's bound; more is refused, not read as a number

# The same rules as byte sets, for the request writer (no regex per field);
# h11's token bytes are RFC 9110's tchar, http1's _TOKEN_BYTES.
_VALUE_BYTES: Final = bytes(b for b in range(256) if b not in b"\x00\n\r\x0b\x0c")  # SP/HTAB inside only
_VCHARS: Final = bytes(range(0x21, 0x7F))
# Request fields the writer looks at: Host goes first, Connection may close,
# the rest are the codec's to write (the reference's rule).
_REQUEST_SPECIAL_FIELDS: Final = frozenset({b"host", b"connection", b"upgrade"} | _CODEC_FIELDS)
# Request fields that passed the writer's checks, as the line it wrote for
# them: the fields a router sends on every leg are checked once. Filled up
# to a bound and never evicted (a leg's X-Request-Id is new every time; the
# fields that repeat arrive first).
_CHECKED_FIELDS: Final[dict[tuple[bytes, bytes], tuple[bool, bytes]]] = {}
_MAX_CHECKED_FIELDS: Final = 256
# The same for (method, target) pairs: their checked bytes.
_CHECKED_REQUEST_LINES: Final[dict[tuple[str, str], tuple[bytes, bytes]]] = {}


def _request_line(method: str, target: str) -> tuple[bytes, bytes]:
    """The method and target as the request writer sends them; raises if h11 would refuse them."""
    raw_method, raw_target = _encode_request_line(method, target)
    if (
        not raw_method
        or raw_method.translate(None, _TOKEN_BYTES)
        or not raw_target
        or raw_target.translate(None, _VCHARS)
    ):
        raise LocalProtocolError(f"cannot send this request: illegal method or target {method!r} {target!r}")
    return raw_method, raw_target


# ---------------------------------------------------------------------------
# Field lines
# ---------------------------------------------------------------------------

_CR: Final = 13
# Fields that decide framing, keep-alive, the Host rule or 100-continue.
_SPECIAL_FIELDS: Final = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"})
# Field lines read before, with the field each gave: a line reads the same
# every time, and engines and clients send the same lines again and again.
# Bounded by count and by line length, emptied when full; lines that carry a
# credential are never kept.
_KNOWN_LINES: Final[dict[bytes, tuple[bytes, bytes]]] = {}
_MAX_KNOWN_LINES: Final = 1024
_MAX_KNOWN_LINE_BYTES: Final = 256
_T = TypeVar("_T")
_SECRET_FIELDS: Final = frozenset({b"authorization", b"proxy-authorization", b"cookie", b"x-api-key"})


def _remember(known: dict[bytes, _T], line: bytes, value: _T) -> None:
    """Keep what ``line`` gave in ``known``, within the bounds above."""
    if len(line) <= _MAX_KNOWN_LINE_BYTES:
        if len(known) >= _MAX_KNOWN_LINES:
            known.clear()
        known[line] = value


# Request and status lines matched before, with their groups (the same
# few lines come again and again), bounded as the field lines are.
_KNOWN_REQUEST_LINES: Final[dict[bytes, tuple[bytes, ...]]] = {}
_KNOWN_STATUS_LINES: Final[dict[bytes, tuple[bytes, ...]]] = {}


def _known_line(
    line: bytes, known: dict[bytes, tuple[bytes, ...]], grammar: re.Pattern[bytes]
) -> tuple[bytes, ...] | None:
    """The groups of ``grammar`` matching all of ``line``, or None; remembered in ``known``."""
    groups = known.get(line)
    if groups is None:
        match = grammar.fullmatch(line)
        if match is None:
            return None
        groups = match.groups()
        _remember(known, line, groups)
    return groups


def _field_lines(head: bytes, start: int) -> tuple[Fields, Fields] | None:
    """The fields of ``head[start:]`` (field lines, then the empty line), and the special ones; None if unsure.

    Accepts only what h11 accepts with the same values: CRLF line ends and
    nothing else (no bare CR or LF, no obs-fold: a line starting with
    whitespace is no token), a token, a colon, then a value of HTAB, SP,
    VCHAR and obs-text (h11 also accepts the other control bytes but NUL),
    bounded by optional whitespace, which is stripped. The name is
    lowercased. Anything else is left to the caller's reference reading.
    Which fields may repeat is the caller's to check.
    """
    if not head.endswith(b"\r\n\r\n"):
        return None
    fields: Fields = []
    special: Fields = []
    if len(head) - start > 2:
        known = _KNOWN_LINES
        for line in head[start:-4].split(b"\r\n"):
            field = known.get(line)
            if field is None:
                colon = line.find(b":")
                if colon < 1:
                    return None
                name = line[:colon]
                value = line[colon + 1 :].strip(_OWS)
                if name.translate(None, _TOKEN_BYTES) or value.translate(None, _FIELD_VALUE_BYTES):
                    return None
                field = (name.lower(), value)
                if field[0] not in _SECRET_FIELDS:
                    _remember(known, line, field)
            fields.append(field)
            if field[0] in _SPECIAL_FIELDS:
                special.append(field)
    return fields, special


def _lowercase_transfer_coding(fields: Fields) -> Fields:
    # h11 stores the one Transfer-Encoding value lowercased.
    return [(name, value.lower() if name == b"transfer-encoding" else value) for name, value in fields]


def _comma_tokens(value: bytes) -> list[bytes]:
    """h11's ``get_comma_header`` for one value: lowercased, stripped, non-empty items."""
    return [item for item in (part.strip() for part in value.lower().split(b",")) if item]


# ---------------------------------------------------------------------------
# Client-facing side
# ---------------------------------------------------------------------------


class FastServerConnection(ServerConnection):
    """A :class:`~narwhal_core.http1.ServerConnection` whose request heads are read by the fast path.

    Same constructor, limits, events, errors and bytes as the reference;
    see the module docstring for what is different inside.
    """

    def _start_request(self, head: bytes) -> ServerEvent:
        # Only accepts. A head that the shared checks refuse, or that this
        # path cannot vouch for, is decided by the reference parse instead,
        # which answers with its own status (400/413/431/505). The shared
        # checks hold for a head accepted here: the request line is matched
        # below and ends in CRLF, _field_lines refuses bare CR, bare LF and
        # obs-fold in the field lines, and the sizes and the field count are
        # compared.
        line_end = head.find(b"\n")
        if (
            line_end > self._max_line + 1
            or len(head) - line_end - 1 > self._max_header_bytes
            or head[line_end - 1] != _CR
        ):
            return super()._start_request(head)
        request_line = _known_line(head[: line_end - 1], _KNOWN_REQUEST_LINES, _REQUEST_LINE_RE)
        if request_line is None:
            return super()._start_request(head)
        raw_method, raw_target, raw_version = request_line
        if raw_version == b"1.1":
            version = "1.1"
        elif raw_version == b"1.0":
            version = "1.0"
        else:
            return super()._start_request(head)  # 505, or 400 if a field is bad too
        parsed = _field_lines(head, line_end + 1)
        if parsed is None or len(parsed[0]) > self._max_headers:
            return super()._start_request(head)

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
                    return super()._start_request(head)  # the reference merges or refuses repeats
                content_length = value
            elif name == b"transfer-encoding":
                if chunked or value.lower() != b"chunked":
                    return super()._start_request(head)
                chunked = True
                if value != b"chunked":
                    fields = _lowercase_transfer_coding(fields)
            elif name == b"connection":
                connection += b"," + value.lower()
            else:
                expect += b"," + value
        # h11's Host rule, and the reference's smuggling rules (RFC 9112 §6.3).
        if hosts > 1 or (hosts == 0 and version == "1.1"):
            return super()._start_request(head)
        length = 0
        if chunked:
            if content_length is not None or version == "1.0":
                return super()._start_request(head)
        elif content_length is not None:
            if len(content_length) > _CONTENT_LENGTH_MAX_DIGITS or not content_length.isdigit():
                return super()._start_request(head)
            length = int(content_length)
            if length > self._max_body:
                return super()._start_request(head)  # 413

        if connection:
            options = {option.strip() for option in connection.split(b",")}
            if version == "1.1":
                keep_alive = b"close" not in options
            else:
                keep_alive = b"keep-alive" in options and b"close" not in options
        else:
            keep_alive = version == "1.1"

        self._method = method = raw_method.decode("ascii")
        self._target = target = raw_target.decode("latin-1")
        self._headers = headers = tuple(fields)
        self._version = version
        self._keep_alive = keep_alive
        self._close = not keep_alive
        self._chunked = chunked
        self._content_length = length
        # h11's rule: an HTTP/1.1 request whose Expect lists 100-continue.
        if expect and version == "1.1" and b"100-continue" in _comma_tokens(expect):
            self._state = _State.EXPECT
            return ContinueExpected(
                method=method, target=target, headers=headers, content_length=None if chunked else length
            )
        self._state = _State.BODY
        return self._read_body()


# ---------------------------------------------------------------------------
# Engine side: h11's reading rules
# ---------------------------------------------------------------------------


class _Malformed(Exception):
    """Raised by the h11-faithful readers; becomes ``RemoteProtocolError(reason="malformed")``."""


def _split_lines(block: bytes) -> list[bytes]:
    """h11's ``maybe_extract_lines`` on a block that ends with its empty line: LF-split, one CR stripped."""
    lines = block.split(b"\n")
    for i, line in enumerate(lines):
        if line.endswith(b"\r"):
            lines[i] = line[:-1]
    del lines[-2:]
    return lines


def _decode_fields(lines: Sequence[bytes]) -> Fields:
    """h11's reading of field lines: obs-fold unfolded, each line matched, then normalised.

    Returns ``(lowercase name, value)`` pairs as h11 stores them: a
    ``Content-Length`` list collapsed to its one value, repeats of the same
    length dropped, ``Transfer-Encoding`` lowercased.
    """
    unfolded: list[bytes] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            if not unfolded:
                raise _Malformed("continuation line at start of the fields")
            unfolded[-1] = unfolded[-1] + b" " + line.lstrip(_OWS)
        else:
            unfolded.append(line)
    fields: Fields = []
    seen_length: bytes | None = None
    saw_chunked = False
    for line in unfolded:
        match = _H11_FIELD_LINE_RE.fullmatch(line)
        if match is None:
            raise _Malformed(f"illegal field line {line[:64]!r}")
        name = match.group(1).lower()
        value = match.group(2)
        if name == b"content-length":
            lengths = {part.strip() for part in value.split(b",")}
            if len(lengths) != 1:
                raise _Malformed("conflicting Content-Length values")
            value = lengths.pop()
            if _DIGITS_RE.fullmatch(value) is None or len(value) > _CONTENT_LENGTH_MAX_DIGITS:
                raise _Malformed(f"bad Content-Length {value!r}")
            if seen_length is not None:
                if value != seen_length:
                    raise _Malformed("conflicting Content-Length fields")
                continue
            seen_length = value
        elif name == b"transfer-encoding":
            value = value.lower()
            if saw_chunked or value != b"chunked":
                raise _Malformed("only one Transfer-Encoding: chunked is supported")
            saw_chunked = True
        fields.append((name, value))
    return fields


def _fast_fields(head: bytes, start: int) -> tuple[Fields, Fields] | None:
    """What :func:`_decode_fields` gives for ``head[start:]``, via :func:`_field_lines`; None when unsure.

    Returns all fields and the special ones.
    """
    parsed = _field_lines(head, start)
    if parsed is None:
        return None
    fields, special = parsed
    saw_length = saw_chunked = False
    lowercase = False
    for name, value in special:
        if name == b"content-length":
            # Lists, repeats and signs go to the reference; h11 caps the digits.
            if saw_length or len(value) > _CONTENT_LENGTH_MAX_DIGITS or not value.isdigit():
                return None
            saw_length = True
        elif name == b"transfer-encoding":
            # Repeats, and codings other than chunked, go to the reference.
            if saw_chunked or value.lower() != b"chunked":
                return None
            saw_chunked = True
            lowercase = value != b"chunked"
    if lowercase:
        fields = _lowercase_transfer_coding(fields)
        return fields, [field for field in fields if field[0] in _SPECIAL_FIELDS]
    return fields, special


def _parse_response_head(head: bytes) -> tuple[int, bytes, Fields, Fields]:
    """Status, HTTP version, fields and special fields of one response head, as h11 reads it."""
    # Fast path: a CRLF status line, then field lines _field_lines accepts
    # (CRLF-only and unfolded, where h11 reads them the same way).
    line_end = head.find(b"\n")
    if head[line_end - 1] == _CR:
        status_line = _known_line(head[: line_end - 1], _KNOWN_STATUS_LINES, _STATUS_LINE_RE)
        if status_line is not None:
            parsed = _fast_fields(head, line_end + 1)
            if parsed is not None:
                raw_version, raw_status = status_line
                status = int(raw_status)
                if status >= 100 and status != 101:
                    return status, raw_version, parsed[0], parsed[1]
    lines = _split_lines(head)
    match = _STATUS_LINE_RE.fullmatch(lines[0])
    if match is None:
        raise _Malformed(f"illegal status line {lines[0][:64]!r}")
    status = int(match.group(2))
    fields = _decode_fields(lines[1:])
    if status < 100:
        raise _Malformed(f"status {status} is not an HTTP status")
    if status == 101:
        # h11: a protocol switch nobody asked for (RFC 9110 §15.2.2).
        raise _Malformed("101 Switching Protocols without an Upgrade request")
    return status, match.group(1), fields, [field for field in fields if field[0] in _SPECIAL_FIELDS]


# ---------------------------------------------------------------------------
# Engine side: FastEngineConnection
# ---------------------------------------------------------------------------


class _Framing(enum.Enum):
    NONE = "no body"
    LENGTH = "content-length"
    CHUNKED = "chunked"
    CLOSE = "close-delimited"


class _Chunk(enum.Enum):
    SIZE = "chunk size line"
    DATA = "chunk data"
    CRLF = "CRLF after chunk data"
    TRAILER = "trailer section"


_NEW: Final = _EngineState.NEW
_HEAD: Final = _EngineState.HEAD
_BODY: Final = _EngineState.BODY
_DONE: Final = _EngineState.DONE
_ERROR: Final = _EngineState.ERROR
_LENGTH: Final = _Framing.LENGTH
_CHUNKED: Final = _Framing.CHUNKED
_CLOSE: Final = _Framing.CLOSE
_SIZE: Final = _Chunk.SIZE
_DATA: Final = _Chunk.DATA
_CRLF_AFTER_DATA: Final = _Chunk.CRLF
_CHUNK_END: Final = b"\r\n"
# Chunk-size lines read before (engines send a few sizes again and again),
# bounded as the field lines are.
_KNOWN_CHUNK_SIZES: Final[dict[bytes, int]] = {}


class FastEngineConnection:
    """One request/response exchange with an engine, behaving as :class:`~narwhal_core.http1.EngineConnection`.

    Same constructor, limits, events and errors (status 502, ``reason``
    ``"dropped"``, ``"malformed"`` or ``"too_large"``); body pieces may be
    cut differently. See the module docstring.
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
    )

    def __init__(
        self,
        *,
        max_header_bytes: int = DEFAULT_ENGINE_MAX_HEADER_BYTES,
        max_body_bytes: int | None = DEFAULT_ENGINE_MAX_BODY_BYTES,
    ) -> None:
        if max_header_bytes < 0 or (max_body_bytes is not None and max_body_bytes < 0):
            raise ValueError("limits must not be negative")
        self._max_header_bytes = max_header_bytes
        self._max_body = max_body_bytes
        self._max_unparsed = max_header_bytes + (
            max_body_bytes if max_body_bytes is not None else _ENGINE_STREAM_BUFFER_BYTES
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
        self._framing = _Framing.NONE
        self._remaining = 0  # body bytes left: of the Content-Length, or of the current chunk
        self._chunk = _SIZE
        self._crlf_left = b""
        self._received = 0  # body bytes returned so far

    # -- writing ------------------------------------------------------------

    def send_request(self, method: str, target: str, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> bytes:
        """The whole request as bytes to write; call once.

        ``headers`` must include ``host`` and no framing or upgrade fields;
        the codec adds ``content-length`` (for a body, or always for POST,
        PUT and PATCH).
        """
        if self._state is not _NEW:
            raise LocalProtocolError(f"send_request() in state {self._state.value}: one request per EngineConnection")
        host = b""
        hosts = 0
        lines: list[bytes] = []
        close = False
        checked = _CHECKED_FIELDS
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
                    close = close or b"close" in _comma_tokens(value)
                else:
                    raise LocalProtocolError(f"{name!r} is not allowed; the codec frames the request")
            # h11's token and field-value rules.
            if (
                not name
                or name.translate(None, _TOKEN_BYTES)
                or (value and (value.translate(None, _VALUE_BYTES) or value[0] in _OWS or value[-1] in _OWS))
            ):
                raise LocalProtocolError(f"cannot send this request: illegal header {name!r}: {value!r}")
            line = b"%s: %s\r\n" % (name, value)
            if lowered == b"host":
                host = line
            else:
                lines.append(line)
            if lowered != b"connection" and len(checked) < _MAX_CHECKED_FIELDS:
                checked[(name, value)] = (lowered == b"host", line)
        if not hosts:
            raise LocalProtocolError("an engine request needs a host header")
        if hosts > 1:
            raise LocalProtocolError("cannot send this request: more than one host header")
        raw = _CHECKED_REQUEST_LINES.get((method, target))
        if raw is None:
            raw = _request_line(method, target)
            if len(_CHECKED_REQUEST_LINES) < _MAX_CHECKED_FIELDS:
                _CHECKED_REQUEST_LINES[(method, target)] = raw
        raw_method, raw_target = raw
        if body or raw_method in _BODY_METHODS:
            lines.append(b"content-length: %d\r\n" % len(body))
        self._head_request = raw_method == b"HEAD"
        self._request_close = close
        self._state = _HEAD
        # h11's layout: request line, Host first, the other fields in order.
        return b"%s %s HTTP/1.1\r\n%s%s\r\n%s" % (raw_method, raw_target, host, b"".join(lines), body)

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
        error = RemoteProtocolError(message, status=_ENGINE_ERROR_STATUS, reason=reason)
        self._error = error
        self._state = _ERROR
        self._buf = bytearray()
        return error

    def _starved(self) -> NeedData | ResponseEnd:
        """What the reference does when h11 wants more bytes."""
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
            match = _HEAD_END_RE.search(buf, self._scan)
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
                status, version, fields, special = _parse_response_head(head)
            except _Malformed as exc:
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
            elif name == b"connection" and b"close" in _comma_tokens(value):
                close = True
        has_body = not self._head_request and status not in _NO_BODY_STATUSES
        if chunked and length is not None:
            raise self._fail("both Content-Length and Transfer-Encoding", "malformed")
        max_body = self._max_body
        if has_body and length is not None and max_body is not None and length > max_body:
            raise self._fail(f"response body of {length} bytes is over {max_body}", "too_large")
        # h11's keep-alive rule, for the request we sent and for this response.
        self._keep_alive = not close and not self._request_close and version >= b"1.1"
        if not has_body:
            self._framing = _Framing.NONE
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
        # reference would have returned first still come out first.
        buf = self._buf
        if self._chunk is _SIZE:
            # The usual read of a stream: exactly one whole chunk, its CRLF included.
            line_end = buf.find(b"\r\n")
            if line_end > 0:
                size = _KNOWN_CHUNK_SIZES.get(bytes(buf[:line_end]), 0)
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
                size = _KNOWN_CHUNK_SIZES.get(line, -1)
                if size < 0:
                    match = _CHUNK_HEADER_RE.fullmatch(line + _CHUNK_END)
                    if match is None:
                        if spans:
                            break
                        raise self._fail(f"malformed chunk size line {(line + _CHUNK_END)[:64]!r}", "malformed")
                    size = int(match.group(1), 16)
                    _remember(_KNOWN_CHUNK_SIZES, line, size)
                if size == 0 and spans:
                    break
                pos = line_end + 2
                if size == 0:
                    self._chunk = _Chunk.TRAILER
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
            match = _HEAD_END_RE.search(buf, pos)
            if match is None:
                del buf[:pos]
                return self._starved()
            end = match.end()
            try:
                _decode_fields(_split_lines(bytes(buf[pos:end])))
            except _Malformed as exc:
                raise self._fail(f"malformed trailer section: {exc}", "malformed") from None
        del buf[:end]
        return self._finish()


# ---------------------------------------------------------------------------
# The codec
# ---------------------------------------------------------------------------


@attrs.frozen
class FastCodec:
    """The fast codec; behaves exactly as :data:`~narwhal_core.http1.H11_CODEC`."""

    def server_connection(
        self,
        *,
        max_request_line_bytes: int = DEFAULT_MAX_REQUEST_LINE_BYTES,
        max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
        max_headers: int = DEFAULT_MAX_HEADERS,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> FastServerConnection:
        """A new :class:`FastServerConnection`."""
        return FastServerConnection(
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
    ) -> FastEngineConnection:
        """A new :class:`FastEngineConnection`."""
        return FastEngineConnection(max_header_bytes=max_header_bytes, max_body_bytes=max_body_bytes)


FAST_CODEC: Final[Codec] = FastCodec()
