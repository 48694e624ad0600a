"""Deciding a whole request head on the server side: accept it (a :data:`RequestHead`) or refuse it (:class:`Refused`).

Two readings, which must agree:

* :func:`read_clean_head`, the fast one, *only accepts*: a head it cannot
  prove :func:`decide_head` would accept with the same values gives
  ``None``. It leaves to :func:`decide_head` anything but CRLF line ends
  (bare CR, bare LF, obs-fold); request lines outside h11's grammar
  (``token SP VCHAR+ SP HTTP/d.d``) and versions other than 1.0/1.1;
  field values with control bytes other than HTAB; heads over the size or
  field-count limits; a missing (HTTP/1.1) or repeated ``Host``; any
  ``Transfer-Encoding`` but one ``chunked``, or one with
  ``Content-Length`` or on HTTP/1.0; any ``Content-Length`` but one of at
  most 20 digits within the body limit.
* :func:`decide_head` decides every head: the size checks, in the order
  the connection's incremental checks meet them (so a head split anywhere
  fails the same way), the strict rules of the server side (no bare CR or
  LF, no obs-fold), what the general reading (h11's rules,
  :func:`~.grammar.read_request_head`) refuses (400), the HTTP version
  (505), then the smuggling rules (RFC 9112 §6.3): Content-Length with
  Transfer-Encoding, a repeated or list-valued Content-Length,
  Transfer-Encoding on HTTP/1.0 (400), a body over the limit (413).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeAlias

from narwhal_core.http.grammar import (
    CONTENT_LENGTH_MAX_DIGITS,
    CR,
    REQUEST_LINE_RE,
    Headers,
    LineMemory,
    Malformed,
    comma_tokens,
    field_lines,
    known_line,
    lowercase_transfer_coding,
    read_request_head,
)

__all__ = ["HeadReading", "Refused", "RequestHead", "decide_head", "general_reading", "read_clean_head"]

#: Method, target, version, fields, and whether the client waits for 100 Continue; raises :class:`Malformed`.
HeadReading: TypeAlias = Callable[[bytes], "tuple[bytes, bytes, bytes, Headers, bool]"]

_CONTENT_LENGTH_FIELD: Final = b"\ncontent-length:"


#: An accepted request head, what the connection needs to read the body and answer: method, target,
#: fields, version (``"1.1"`` or ``"1.0"``), keep-alive, chunked, declared body size (0 when chunked or
#: absent), and whether the client waits for ``100 Continue`` (an HTTP/1.1 request whose Expect lists
#: 100-continue, RFC 9110 §10.1.1). A tuple: one is made for every request.
RequestHead: TypeAlias = tuple[str, str, Headers, str, bool, bool, int, bool]


def _keep_alive(connection: bytes, version: str) -> bool:
    """RFC 9112 §9.3: HTTP/1.1 stays open unless "close"; HTTP/1.0 only with "keep-alive"."""
    options = {option.strip() for option in connection.split(b",")}
    if version == "1.1":
        return b"close" not in options
    return b"keep-alive" in options and b"close" not in options


class Refused(Exception):
    """A request head refused, with the status it calls for (400, 413, 431 or 505)."""

    def __init__(
        self, message: str, *, status: int = 400, reason: str = "malformed",
        method: str | None = None, target: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        #: ``"malformed"`` or ``"too_large"``.
        self.reason = reason
        #: The request, when the head parsed (a 413): the router journals a refused completion request.
        self.method = method
        self.target = target


def read_clean_head(
    head: bytes, memory: LineMemory, max_line: int, max_header_bytes: int, max_headers: int, max_body: int
) -> RequestHead | None:
    """The fast reading of a head (request line, field lines, empty line); ``None`` when it cannot vouch for it.

    When it accepts, :func:`decide_head` would accept with the same
    values: the request line is matched here and ends in CRLF,
    :func:`~.grammar.field_lines` refuses bare CR, bare LF and obs-fold in
    the field lines, and the sizes and the field count are compared.
    """
    line_end = head.find(b"\n")
    if line_end > max_line + 1 or len(head) - line_end - 1 > max_header_bytes or head[line_end - 1] != CR:
        return None
    request_line = known_line(head[: line_end - 1], memory.request_lines, REQUEST_LINE_RE)
    if request_line is None:
        return None
    raw_method, raw_target, raw_version = request_line
    if raw_version == b"1.1":
        version = "1.1"
    elif raw_version == b"1.0":
        version = "1.0"
    else:
        return None  # 505, or 400 if a field is bad too
    parsed = field_lines(head, line_end + 1, memory.field_lines)
    if parsed is None or len(parsed[0]) > max_headers:
        return None

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
                return None  # merged or refused by decide_head
            content_length = value
        elif name == b"transfer-encoding":
            if chunked or value.lower() != b"chunked":
                return None
            chunked = True
            if value != b"chunked":
                fields = lowercase_transfer_coding(fields)
        elif name == b"connection":
            connection += b"," + value.lower()
        else:
            expect += b"," + value
    if hosts > 1 or (hosts == 0 and version == "1.1"):
        return None
    length = 0
    if chunked:
        if content_length is not None or version == "1.0":
            return None
    elif content_length is not None:
        if len(content_length) > CONTENT_LENGTH_MAX_DIGITS or not content_length.isdigit():
            return None
        length = int(content_length)
        if length > max_body:
            return None  # 413
    keep_alive = _keep_alive(connection, version) if connection else version == "1.1"
    continue_expected = bool(expect) and version == "1.1" and b"100-continue" in comma_tokens(expect)
    return (
        raw_method.decode("ascii"), raw_target.decode("latin-1"), tuple(fields), version,
        keep_alive, chunked, length, continue_expected,
    )


def general_reading(head: bytes) -> tuple[bytes, bytes, bytes, Headers, bool]:
    """The general reading of :func:`decide_head` (h11's rules, :func:`~.grammar.read_request_head`)."""
    raw_method, raw_target, raw_version, fields = read_request_head(head)
    expect = b",".join([value for name, value in fields if name == b"expect"])
    continue_expected = bool(expect) and raw_version == b"1.1" and b"100-continue" in comma_tokens(expect)
    return raw_method, raw_target, raw_version, tuple(fields), continue_expected


def decide_head(
    head: bytes, max_line: int, max_header_bytes: int, max_headers: int, max_body: int,
    read: HeadReading = general_reading,
) -> RequestHead:
    """Accept any request head, or raise :class:`Refused` with the status it calls for (see the module docstring).

    ``read`` is the general reading; the test oracle passes h11's own.
    """
    line_end = head.find(b"\n")
    if line_end > max_line + 1:
        raise Refused(f"request line longer than {max_line} bytes", status=431, reason="too_large")
    if len(head) - (line_end + 1) > max_header_bytes:
        raise Refused(f"header section larger than {max_header_bytes} bytes", status=431, reason="too_large")
    crlf = head.count(b"\r\n")
    if head.count(b"\n") != crlf or head.count(b"\r") != crlf:
        raise Refused("bare CR or LF in the request head")
    if crlf - 2 > max_headers:
        raise Refused(f"more than {max_headers} header fields", status=431, reason="too_large")
    if b"\n " in head or b"\n\t" in head:
        raise Refused("obsolete line folding in the request head")
    try:
        raw_method, raw_target, raw_version, headers, continue_expected = read(head)
    except Malformed as exc:
        raise Refused(f"malformed request head: {exc}") from None
    if raw_version == b"1.1":
        version = "1.1"
    elif raw_version == b"1.0":
        version = "1.0"
    else:
        raise Refused(f"HTTP/{raw_version.decode('ascii')} is not supported", status=505)

    content_length: bytes | None = None
    chunked = False
    connection = b""
    for name, value in headers:
        if name == b"content-length":
            content_length = value
        elif name == b"transfer-encoding":
            chunked = True  # the general reading accepts exactly one, equal to "chunked"
        elif name == b"connection":
            connection += b"," + value.lower()
    if chunked:
        if content_length is not None:
            raise Refused("both Content-Length and Transfer-Encoding")
        if version == "1.0":
            raise Refused("Transfer-Encoding in an HTTP/1.0 request")
    length = 0
    method = raw_method.decode("ascii")
    target = raw_target.decode("latin-1")
    if content_length is not None:
        # The general reading merges repeated or list-valued identical
        # lengths; a smuggling chain relies on two parsers disagreeing, so
        # refuse them.
        lowered = head.lower()
        if lowered.count(_CONTENT_LENGTH_FIELD) != 1:
            raise Refused("repeated Content-Length")
        start = lowered.find(_CONTENT_LENGTH_FIELD) + len(_CONTENT_LENGTH_FIELD)
        raw = head[start : head.find(b"\r\n", start)].strip(b" \t")
        if raw != content_length:
            raise Refused(f"malformed Content-Length: {raw!r}")
        length = int(content_length)
        if length > max_body:
            raise Refused(
                f"body of {length} bytes is over the {max_body}-byte limit",
                status=413, reason="too_large", method=method, target=target,
            )
    keep_alive = _keep_alive(connection, version) if connection else version == "1.1"
    return method, target, headers, version, keep_alive, chunked, length, continue_expected
