"""What both sides of the HTTP/1.1 codec share: events, limits, grammar, field encoding and reading.

The events are what :meth:`next_event` returns on either side; the grammar
is RFC 9110 §5.6 and RFC 9112 in two strengths:

* the **strict** rules the server side applies to clients (a router in
  front of a fleet must not be the weak link in a request-smuggling chain;
  :mod:`.server`): tokens, field values without control bytes, chunk lines
  with well-formed extensions;
* the **lenient** rules h11 0.16 applies (``h11/_abnf.py``), which decide
  what an engine's response means (:mod:`.engine`) and, after the strict
  checks, what a request head says. h11 itself runs only in the tests
  (``tests/core/http_reference.py``), as the oracle both sides are compared
  with byte for byte.

Heads are read in two ways that must agree: a fast reading
(:func:`field_lines`) that only *accepts* -- CRLF line ends, a token, a
colon, a value of HTAB, SP, VCHAR and obs-text -- and remembers the lines
it read in a :class:`LineMemory`; and the general reading
(:func:`decode_fields`, :func:`read_request_head`), which decides every
other head exactly as h11 would, and raises :class:`Malformed` where h11
raises.

The event values are built only by the codec, from bytes already
validated, and sit on the hot path of every request: no attrs validators,
and the four of every request are not frozen (a frozen attrs class sets
each field through ``object.__setattr__``, three times the cost of a plain
slotted ``__init__``). Treat them as values all the same.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from types import MappingProxyType
from typing import Final, Literal, TypeAlias, TypeVar

import attrs

from narwhal_core.errors import LocalProtocolError

__all__ = [
    "NEED_DATA",
    "PAUSED",
    "Signal",
    "Headers",
    "HttpRequest",
    "ContinueExpected",
    "ConnectionClosed",
    "ServerEvent",
    "ResponseHead",
    "BodyData",
    "ResponseEnd",
    "EngineEvent",
    "LineMemory",
    "DEFAULT_MAX_REQUEST_LINE_BYTES",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_MAX_HEADERS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_ENGINE_MAX_HEADER_BYTES",
    "DEFAULT_ENGINE_MAX_BODY_BYTES",
]


# ---------------------------------------------------------------------------
# Signals and events
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

#: Header fields in arrival order: (lowercase name, value).
Headers: TypeAlias = tuple[tuple[bytes, bytes], ...]
Fields: TypeAlias = list[tuple[bytes, bytes]]

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

CONNECTION_CLOSED: Final = ConnectionClosed()


# ---------------------------------------------------------------------------
# The strict grammar (RFC 9110 §5.6, RFC 9112 §7.1): what clients may send
# ---------------------------------------------------------------------------

_TCHAR = rb"[-!#$%&'*+.^_`|~0-9A-Za-z]"
_FIELD_VCHAR = rb"[\x21-\x7e\x80-\xff]"
_FIELD_VALUE = rb"(?:" + _FIELD_VCHAR + rb"(?:[\t\x20-\x7e\x80-\xff]*" + _FIELD_VCHAR + rb")?)?"
_QUOTED_STRING = rb'"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*"'

TOKEN_RE: Final = re.compile(_TCHAR + rb"+")
FIELD_LINE_RE: Final = re.compile(_TCHAR + rb"+:[ \t]*" + _FIELD_VALUE + rb"[ \t]*")
CHUNK_LINE_RE: Final = re.compile(
    rb"([0-9A-Fa-f]{1,16})"
    rb"(?:[ \t]*;[ \t]*" + _TCHAR + rb"+(?:[ \t]*=[ \t]*(?:" + _TCHAR + rb"+|" + _QUOTED_STRING + rb"))?)*"
    # Trailing whitespace after the size is not in the grammar, but common
    # and harmless (h11 accepts it too).
    rb"[ \t]*"
)
#: End of a head: the first empty line. A bare LF also ends it (so an
#: LF-only client gets a prompt 400 instead of a timeout; the server side
#: then refuses it, the engine side reads it as h11 does).
HEAD_END_RE: Final = re.compile(rb"\n\r?\n")
IS_TCHAR: Final = tuple(TOKEN_RE.fullmatch(bytes([b])) is not None for b in range(256))
# The same rules as byte sets, for checks without a regex: a token's bytes,
# and a field value's (HTAB, SP, VCHAR, obs-text; no OWS at either end).
TOKEN_BYTES: Final = bytes(b for b in range(256) if IS_TCHAR[b])
FIELD_VALUE_BYTES: Final = b"\t" + bytes(range(0x20, 0x7F)) + bytes(range(0x80, 0x100))


def keeping(allowed: bytes) -> bytes:
    """A ``bytes.translate`` table that keeps each byte of ``allowed`` and changes every other one (:func:`only`)."""
    return bytes(b if b in allowed else allowed[0] for b in range(256))


def only(data: bytes, table: bytes) -> bool:
    """Whether every byte of ``data`` is one ``table`` (made by :func:`keeping`) keeps.

    One pass through a 256-byte table: a quarter of the time of
    ``data.translate(None, allowed)``, which builds its table from the
    allowed bytes on every call (benchmarks/README.md).
    """
    return data.translate(table) == data


TOKEN: Final = keeping(TOKEN_BYTES)
FIELD_VALUE: Final = keeping(FIELD_VALUE_BYTES)
OWS: Final = b" \t"
CR: Final = 13

# ---------------------------------------------------------------------------
# The lenient grammar h11 0.16 applies (``h11/_abnf.py``)
# ---------------------------------------------------------------------------

_H11_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_H11_FIELD_VCHAR = rb"[^\x00\s]"  # every byte but NUL and whitespace
_H11_FIELD_VALUE = rb"(?:" + _H11_FIELD_VCHAR + rb"+(?:[ \t]+" + _H11_FIELD_VCHAR + rb"+)*)?"
H11_FIELD_LINE_RE: Final = re.compile(rb"(" + _H11_TOKEN + rb"):[ \t]*(" + _H11_FIELD_VALUE + rb")[ \t]*")
REQUEST_LINE_RE: Final = re.compile(rb"(" + _H11_TOKEN + rb") ([\x21-\x7e]+) HTTP/([0-9]\.[0-9])")
STATUS_LINE_RE: Final = re.compile(
    rb"HTTP/([0-9]\.[0-9]) ([0-9]{3})(?: (?:[ \t]|" + _H11_FIELD_VCHAR + rb")*)?"
)
H11_CHUNK_LINE_RE: Final = re.compile(rb"([0-9A-Fa-f]{1,20})(?:;.*)?[ \t]*\r\n")
_DIGITS_RE: Final = re.compile(rb"[0-9]+")
#: h11's bound on a Content-Length; more digits are refused, not read as a number.
CONTENT_LENGTH_MAX_DIGITS: Final = 20

# ---------------------------------------------------------------------------
# Status lines and request encoding
# ---------------------------------------------------------------------------


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode("ascii")
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


STATUS_LINES: Final[Mapping[int, bytes]] = MappingProxyType({s: _status_line(s) for s in range(100, 600)})
CONTINUE_RESPONSE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
#: RFC 9110 §15.3.5, §15.4.5: these responses never carry content.
NO_BODY_STATUSES: Final = frozenset({204, 304})
#: The framing fields: the codec writes them, callers never do.
CODEC_FIELDS: Final = frozenset({b"content-length", b"transfer-encoding"})
#: Methods whose requests carry content, so Content-Length is always sent.
BODY_METHODS: Final = frozenset({b"POST", b"PUT", b"PATCH"})
#: Fields that decide framing, keep-alive, the Host rule or 100-continue.
SPECIAL_FIELDS: Final = frozenset({b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"})
#: Fields never kept in a :class:`LineMemory`: they carry credentials.
SECRET_FIELDS: Final = frozenset({b"authorization", b"proxy-authorization", b"cookie", b"x-api-key"})


def encode_request_line(method: str, target: str) -> tuple[bytes, bytes]:
    """An engine request's method and target as bytes; raises for non-ASCII text or ``CONNECT``."""
    try:
        raw_method = method.encode("ascii")
        raw_target = target.encode("ascii")
    except UnicodeEncodeError:
        raise LocalProtocolError(f"non-ASCII method or target: {method!r} {target!r}") from None
    if raw_method == b"CONNECT":
        raise LocalProtocolError("CONNECT is not supported")
    return raw_method, raw_target


def encode_fields(headers: Sequence[tuple[bytes, bytes]]) -> tuple[list[bytes], bool]:
    """Validated ``name: value`` lines of a response, and whether the caller asked to close."""
    lines: list[bytes] = []
    close = False
    for name, value in headers:
        if not name or not only(name, TOKEN):
            raise LocalProtocolError(f"illegal header name {name!r}")
        if value and (
            not only(value, FIELD_VALUE) or value[0] in OWS or value[-1] in OWS
        ):
            raise LocalProtocolError(f"illegal value for header {name!r}: {value!r}")
        lowered = name.lower()
        if lowered in CODEC_FIELDS:
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


def comma_tokens(value: bytes) -> list[bytes]:
    """The items of a comma-separated field value: lowercased, stripped, non-empty (h11's rule)."""
    return [item for item in (part.strip() for part in value.lower().split(b",")) if item]


# ---------------------------------------------------------------------------
# What a codec remembers
# ---------------------------------------------------------------------------

_T = TypeVar("_T")
#: Entries per table of a :class:`LineMemory` (a full table is emptied).
MAX_REMEMBERED_LINES: Final = 1024
#: Lines longer than this are never remembered.
MAX_REMEMBERED_LINE_BYTES: Final = 256
#: Entries per table of the request writer (filled, then never evicted).
MAX_CHECKED_REQUEST_PARTS: Final = 256


class LineMemory:
    """Lines a codec has read or written before, with what they gave.

    Clients and engines send the same lines again and again, and a router
    sends the same fields on every leg: each is parsed or checked once.
    One memory belongs to one codec instance (``Codec()``) and is shared by
    the connections it makes; nothing is shared between instances. Every
    table is bounded: the read-side tables hold at most
    :data:`MAX_REMEMBERED_LINES` lines of at most
    :data:`MAX_REMEMBERED_LINE_BYTES` bytes each and are emptied when full
    (at most about 1 MiB in all); the request writer's two tables hold at
    most :data:`MAX_CHECKED_REQUEST_PARTS` entries and keep the first ones
    (a leg's X-Request-Id is new every time; the fields that repeat come
    first). Lines that carry credentials are never kept.
    """

    __slots__ = ("field_lines", "request_lines", "status_lines", "chunk_sizes", "request_fields", "request_lines_out")

    def __init__(self) -> None:
        #: A field line -> its (lowercase name, value).
        self.field_lines: dict[bytes, tuple[bytes, bytes]] = {}
        #: A request line -> its (method, target, version).
        self.request_lines: dict[bytes, tuple[bytes, ...]] = {}
        #: A status line -> its (version, status).
        self.status_lines: dict[bytes, tuple[bytes, ...]] = {}
        #: An engine's chunk-size line -> the size.
        self.chunk_sizes: dict[bytes, int] = {}
        #: A request field (name, value) the writer checked -> (is it Host, the line written).
        self.request_fields: dict[tuple[bytes, bytes], tuple[bool, bytes]] = {}
        #: A (method, target) the writer checked -> their bytes.
        self.request_lines_out: dict[tuple[str, str], tuple[bytes, bytes]] = {}


def remember(known: dict[bytes, _T], line: bytes, value: _T) -> None:
    """Keep what ``line`` gave in ``known``, within the bounds of :class:`LineMemory`."""
    if len(line) <= MAX_REMEMBERED_LINE_BYTES:
        if len(known) >= MAX_REMEMBERED_LINES:
            known.clear()
        known[line] = value


def known_line(
    line: bytes, known: dict[bytes, tuple[bytes, ...]], grammar: re.Pattern[bytes]
) -> tuple[bytes, ...] | None:
    """The groups of ``grammar`` matching all of ``line``, or None; remembered in ``known``."""
    groups = known.get(line)
    if groups is None:
        match = grammar.fullmatch(line)
        if match is None:
            return None
        groups = match.groups()
        remember(known, line, groups)
    return groups


# ---------------------------------------------------------------------------
# Reading field lines
# ---------------------------------------------------------------------------


def field_lines(head: bytes, start: int, known: dict[bytes, tuple[bytes, bytes]]) -> tuple[Fields, Fields] | None:
    """The fields of ``head[start:]`` (field lines, then the empty line), and the special ones; None if unsure.

    The fast reading: accepts only what h11 accepts with the same values:
    CRLF line ends and nothing else (no bare CR or LF, no obs-fold: a line
    starting with whitespace is no token), a token, a colon, then a value
    of HTAB, SP, VCHAR and obs-text (h11 also accepts the other control
    bytes but NUL), bounded by optional whitespace, which is stripped. The
    name is lowercased. Anything else is left to the general reading.
    Which fields may repeat is the caller's to check. Lines read are
    remembered in ``known`` (a :attr:`LineMemory.field_lines`).
    """
    if not head.endswith(b"\r\n\r\n"):
        return None
    fields: Fields = []
    special: Fields = []
    if len(head) - start > 2:
        for line in head[start:-4].split(b"\r\n"):
            field = known.get(line)
            if field is None:
                colon = line.find(b":")
                if colon < 1:
                    return None
                name = line[:colon]
                value = line[colon + 1 :].strip(OWS)
                if not only(name, TOKEN) or not only(value, FIELD_VALUE):
                    return None
                field = (name.lower(), value)
                if field[0] not in SECRET_FIELDS:
                    remember(known, line, field)
            fields.append(field)
            if field[0] in SPECIAL_FIELDS:
                special.append(field)
    return fields, special


def lowercase_transfer_coding(fields: Fields) -> Fields:
    """``fields`` with the Transfer-Encoding value lowercased, as h11 stores it."""
    return [(name, value.lower() if name == b"transfer-encoding" else value) for name, value in fields]


class Malformed(Exception):
    """Raised by the general reading where h11 raises; the caller turns it into a ``RemoteProtocolError``."""


def split_lines(block: bytes) -> list[bytes]:
    """h11's ``maybe_extract_lines`` on a block that ends with its empty line: LF-split, one CR stripped."""
    lines = block.split(b"\n")
    for i, line in enumerate(lines):
        if line.endswith(b"\r"):
            lines[i] = line[:-1]
    del lines[-2:]
    return lines


def decode_fields(lines: Sequence[bytes]) -> Fields:
    """The general reading of field lines, h11's: obs-fold unfolded, each line matched, then normalised.

    Returns ``(lowercase name, value)`` pairs as h11 stores them: a
    ``Content-Length`` list collapsed to its one value, repeats of the same
    length dropped, ``Transfer-Encoding`` lowercased.
    """
    unfolded: list[bytes] = []
    for line in lines:
        if line[:1] in (b" ", b"\t"):
            if not unfolded:
                raise Malformed("continuation line at start of the fields")
            unfolded[-1] = unfolded[-1] + b" " + line.lstrip(OWS)
        else:
            unfolded.append(line)
    fields: Fields = []
    seen_length: bytes | None = None
    saw_chunked = False
    for line in unfolded:
        match = H11_FIELD_LINE_RE.fullmatch(line)
        if match is None:
            raise Malformed(f"illegal field line {line[:64]!r}")
        name = match.group(1).lower()
        value = match.group(2)
        if name == b"content-length":
            lengths = {part.strip() for part in value.split(b",")}
            if len(lengths) != 1:
                raise Malformed("conflicting Content-Length values")
            value = lengths.pop()
            if _DIGITS_RE.fullmatch(value) is None or len(value) > CONTENT_LENGTH_MAX_DIGITS:
                raise Malformed(f"bad Content-Length {value!r}")
            if seen_length is not None:
                if value != seen_length:
                    raise Malformed("conflicting Content-Length fields")
                continue
            seen_length = value
        elif name == b"transfer-encoding":
            value = value.lower()
            if saw_chunked or value != b"chunked":
                raise Malformed("only one Transfer-Encoding: chunked is supported")
            saw_chunked = True
        fields.append((name, value))
    return fields


def read_request_head(head: bytes) -> tuple[bytes, bytes, bytes, Fields]:
    """Method, target, HTTP version and fields of a whole request head, read as h11 reads one.

    The general reading of a request head; raises :class:`Malformed`
    where h11 refuses the head: a request line outside its grammar, a field
    line outside :func:`decode_fields`'s, no ``Host`` in an HTTP/1.1
    request or more than one in any (RFC 9112 §3.2).
    """
    lines = split_lines(head)
    match = REQUEST_LINE_RE.fullmatch(lines[0]) if lines else None
    if match is None:
        raise Malformed(f"illegal request line {lines[0][:64] if lines else b''!r}")
    method, target, version = match.groups()
    fields = decode_fields(lines[1:])
    hosts = sum(1 for name, _ in fields if name == b"host")
    if hosts == 0 and version == b"1.1":
        raise Malformed("missing mandatory Host header")
    if hosts > 1:
        raise Malformed("more than one Host header")
    return method, target, version, fields


def _fast_fields(head: bytes, start: int, memory: LineMemory) -> tuple[Fields, Fields] | None:
    """What :func:`decode_fields` gives for ``head[start:]``, via :func:`field_lines`; None when unsure.

    Returns all fields and the special ones.
    """
    parsed = field_lines(head, start, memory.field_lines)
    if parsed is None:
        return None
    fields, special = parsed
    saw_length = saw_chunked = False
    lowercase = False
    for name, value in special:
        if name == b"content-length":
            # Lists, repeats and signs go to the general reading; h11 caps the digits.
            if saw_length or len(value) > CONTENT_LENGTH_MAX_DIGITS or not value.isdigit():
                return None
            saw_length = True
        elif name == b"transfer-encoding":
            # Repeats, and codings other than chunked, go to the general reading.
            if saw_chunked or value.lower() != b"chunked":
                return None
            saw_chunked = True
            lowercase = value != b"chunked"
    if lowercase:
        fields = lowercase_transfer_coding(fields)
        return fields, [field for field in fields if field[0] in SPECIAL_FIELDS]
    return fields, special


def read_response_head(head: bytes, memory: LineMemory) -> tuple[int, bytes, Fields, Fields]:
    """Status, HTTP version, fields and special fields of one whole response head, as h11 reads it; raises :class:`Malformed`."""
    # Fast path: a CRLF status line, then field lines field_lines accepts
    # (CRLF-only and unfolded, where h11 reads them the same way).
    line_end = head.find(b"\n")
    if head[line_end - 1] == CR:
        status_line = known_line(head[: line_end - 1], memory.status_lines, STATUS_LINE_RE)
        if status_line is not None:
            parsed = _fast_fields(head, line_end + 1, memory)
            if parsed is not None:
                raw_version, raw_status = status_line
                status = int(raw_status)
                if status >= 100 and status != 101:
                    return status, raw_version, parsed[0], parsed[1]
    lines = split_lines(head)
    match = STATUS_LINE_RE.fullmatch(lines[0])
    if match is None:
        raise Malformed(f"illegal status line {lines[0][:64]!r}")
    status = int(match.group(2))
    fields = decode_fields(lines[1:])
    if status < 100:
        raise Malformed(f"status {status} is not an HTTP status")
    if status == 101:
        # h11: a protocol switch nobody asked for (RFC 9110 §15.2.2).
        raise Malformed("101 Switching Protocols without an Upgrade request")
    return status, match.group(1), fields, [field for field in fields if field[0] in SPECIAL_FIELDS]
