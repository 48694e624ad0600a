"""Tests of the HTTP/1.1 codec (``narwhal_core.http``), client-facing and engine-facing.

Every test that takes the ``codec`` fixture runs against both the codec
(id ``fast``) and its oracle (id ``h11``, ``http_reference.py``: h11 with
the codec's strictness on top). The differential tests at the end compare
the two directly.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import TypedDict, Unpack

import attrs
import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from narwhal_core.errors import LocalProtocolError, RemoteProtocolError
from narwhal_core.http import (
    NEED_DATA,
    PAUSED,
    BodyData,
    Codec,
    CodecLike,
    ConnectionClosed,
    ContinueExpected,
    EngineCodec,
    EngineConnection,
    EngineEvent,
    HttpRequest,
    ResponseEnd,
    ResponseHead,
    ServerCodec,
    ServerConnection,
    ServerEvent,
)
from narwhal_core.http import grammar

from ..corebuild import examples
from .http_reference import REFERENCE_CODEC, ReferenceEngineConnection, ReferenceServerConnection

FAST = settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ = settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])

class Limits(TypedDict, total=False):
    max_request_line_bytes: int
    max_header_bytes: int
    max_headers: int
    max_body_bytes: int


#: Every test that takes ``codec`` runs against the oracle (h11) and the codec.
#: The codec under test; one instance, so that its line memory is exercised across the tests.
CODEC: CodecLike = Codec()
CODECS: dict[str, CodecLike] = {"h11": REFERENCE_CODEC, "fast": CODEC}


@pytest.fixture(scope="module", params=sorted(CODECS))
def codec(request: pytest.FixtureRequest) -> CodecLike:
    return CODECS[request.param]


SMALL_LIMITS: Limits = {
    "max_request_line_bytes": 64,
    "max_header_bytes": 256,
    "max_headers": 8,
    "max_body_bytes": 512,
}


# ---------------------------------------------------------------------------
# Helpers: a tiny adapter around each connection
# ---------------------------------------------------------------------------


@attrs.frozen
class Failed:
    """A RemoteProtocolError, recorded as a comparable value."""

    status: int
    reason: str


def echo_response(conn: ServerCodec, request: HttpRequest) -> bytes:
    return conn.send_response(
        200, [(b"x-echo", f"{request.method} {request.target}".encode("latin-1"))], request.body
    )


def pump_server(
    conn: ServerCodec,
    log: list[object],
    out: bytearray,
    respond: Callable[[ServerCodec, HttpRequest], bytes] = echo_response,
) -> bool:
    """Drain events, answering each request at once; False once nothing more will come."""
    while True:
        try:
            event = conn.next_event()
        except RemoteProtocolError as exc:
            log.append(Failed(exc.status, exc.reason))
            return False
        if event is NEED_DATA:
            return True
        if event is PAUSED:
            assert conn.must_close  # we always answer at once, so only a closing connection pauses
            return False
        log.append(event)
        if isinstance(event, ContinueExpected):
            out += conn.send_continue()
        elif isinstance(event, ConnectionClosed):
            return False
        else:
            assert isinstance(event, HttpRequest)
            out += respond(conn, event)


def run_server(
    codec: CodecLike, pieces: Sequence[bytes], *, eof: bool = True, **limits: Unpack[Limits]
) -> tuple[list[object], bytes]:
    conn = codec.server_connection(**limits)
    log: list[object] = []
    out = bytearray()
    for piece in pieces:
        conn.receive_data(piece)
        if not pump_server(conn, log, out):
            return log, bytes(out)
    if eof:
        conn.receive_data(b"")
        pump_server(conn, log, out)
    return log, bytes(out)


def one_request(codec: CodecLike, raw: bytes, **limits: Unpack[Limits]) -> HttpRequest:
    conn = codec.server_connection(**limits)
    conn.receive_data(raw)
    event = conn.next_event()
    assert isinstance(event, HttpRequest), event
    return event


def server_error(codec: CodecLike, raw: bytes, *, eof: bool = False, **limits: Unpack[Limits]) -> RemoteProtocolError:
    conn = codec.server_connection(**limits)
    conn.receive_data(raw)
    if eof:
        conn.receive_data(b"")
    with pytest.raises(RemoteProtocolError) as info:
        for _ in range(10):
            conn.next_event()
    return info.value


def bytewise_error(codec: CodecLike, raw: bytes, **limits: Unpack[Limits]) -> RemoteProtocolError:
    conn = codec.server_connection(**limits)
    with pytest.raises(RemoteProtocolError) as info:
        for i in range(len(raw)):
            conn.receive_data(raw[i : i + 1])
            while conn.next_event() not in (NEED_DATA, PAUSED):
                pass
        conn.receive_data(b"")
        conn.next_event()
    return info.value


def engine_events(
    codec: CodecLike, pieces: Sequence[bytes], *, method: str = "POST", eof: bool = True, **limits: int | None
) -> list[object]:
    conn = codec.engine_connection(**limits)  # type: ignore[arg-type]
    conn.send_request(method, "/v1/completions", [(b"host", b"engine:8100")], b"{}" if method == "POST" else b"")
    log: list[object] = []
    feed = list(pieces) + ([b""] if eof else [])
    for piece in feed:
        conn.receive_data(piece)
        while True:
            try:
                event = conn.next_event()
            except RemoteProtocolError as exc:
                log.append(Failed(exc.status, exc.reason))
                return log
            if event is NEED_DATA:
                break
            log.append(event)
            if isinstance(event, ResponseEnd):
                return log
    return log


def coalesce(events: Sequence[object]) -> list[object]:
    """Join adjacent BodyData pieces: how a body is cut into pieces is not part of the contract."""
    out: list[object] = []
    for event in events:
        if isinstance(event, BodyData) and out and isinstance(out[-1], BodyData):
            out[-1] = BodyData(data=out[-1].data + event.data)
        else:
            out.append(event)
    return out


def split_at(data: bytes, cuts: Sequence[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c for c in cuts if 0 <= c <= len(data))})
    return [data[a:b] for a, b in zip(points, points[1:], strict=False)]


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


POST = b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
GET = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"


# ---------------------------------------------------------------------------
# Module hygiene and the codec protocols
# ---------------------------------------------------------------------------


def test_codecs_satisfy_protocols() -> None:
    reference: CodecLike = REFERENCE_CODEC
    fast: CodecLike = CODEC
    server: ServerCodec = reference.server_connection(max_body_bytes=10)
    engine: EngineCodec = reference.engine_connection(max_body_bytes=None)
    assert isinstance(server, ReferenceServerConnection)
    assert isinstance(engine, ReferenceEngineConnection)
    assert server.next_event() is NEED_DATA
    server = fast.server_connection(max_body_bytes=10)
    engine = fast.engine_connection(max_body_bytes=None)
    assert isinstance(server, ServerConnection)
    assert isinstance(engine, EngineConnection)
    assert server.next_event() is NEED_DATA


def test_signals_are_distinct_and_readable() -> None:
    assert len({NEED_DATA, PAUSED}) == 2
    assert repr(NEED_DATA) == "NEED_DATA"
    assert repr(PAUSED) == "PAUSED"
    assert str(PAUSED) == "PAUSED"


def test_request_header_lookup(codec: CodecLike) -> None:
    # The event values are plain slotted classes, not frozen ones (see the
    # comment above HttpRequest): immutable by contract, not by enforcement.
    request = one_request(codec, POST)
    assert request.header(b"content-type") == b"application/json"
    assert request.header(b"missing") is None


# ---------------------------------------------------------------------------
# ReferenceServerConnection: requests
# ---------------------------------------------------------------------------


def test_post_request(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(POST)
    request = conn.next_event()
    assert request == HttpRequest(
        method="POST",
        target="/v1/completions",
        headers=((b"host", b"router"), (b"content-type", b"application/json"), (b"content-length", b"2")),
        body=b"{}",
        keep_alive=True,
        http_version="1.1",
    )
    assert conn.next_event() is PAUSED
    assert not conn.must_close
    assert not conn.in_response


def test_need_data_until_complete(codec: CodecLike) -> None:
    conn = codec.server_connection()
    for i in range(len(POST) - 1):
        conn.receive_data(POST[i : i + 1])
        assert conn.next_event() is NEED_DATA
    conn.receive_data(POST[-1:])
    assert isinstance(conn.next_event(), HttpRequest)


def test_header_values_stripped_names_lowercased_target_raw(codec: CodecLike) -> None:
    request = one_request(
        codec,
        b"GET /a%20b?x=1&y=%C3%A9 HTTP/1.1\r\nHOST:   router  \r\nX-Thing:\tv1 v2\t\r\nx-thing: v3\r\n\r\n"
    )
    assert request.target == "/a%20b?x=1&y=%C3%A9"
    assert request.headers == ((b"host", b"router"), (b"x-thing", b"v1 v2"), (b"x-thing", b"v3"))
    assert request.header(b"x-thing") == b"v1 v2"
    assert request.body == b""


def test_keep_alive_cycles(codec: CodecLike) -> None:
    conn = codec.server_connection()
    for i in range(3):
        conn.receive_data(POST)
        request = conn.next_event()
        assert isinstance(request, HttpRequest)
        assert conn.next_event() is PAUSED
        out = conn.send_response(200, [(b"content-type", b"application/json")], b'{"i": %d}' % i)
        assert out == b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 8\r\n\r\n{"i": %d}' % i
        assert not conn.must_close
        assert conn.next_event() is NEED_DATA
    conn.receive_data(b"")
    assert conn.next_event() == ConnectionClosed()
    assert conn.next_event() == ConnectionClosed()


def test_pipelined_requests_come_out_in_order_after_each_response(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(POST + GET)
    first = conn.next_event()
    assert isinstance(first, HttpRequest) and first.method == "POST"
    assert conn.next_event() is PAUSED
    assert conn.next_event() is PAUSED
    conn.send_response(200, [], b"one")
    second = conn.next_event()
    assert isinstance(second, HttpRequest) and second.method == "GET" and second.target == "/health"
    assert conn.next_event() is PAUSED
    conn.send_response(200, [], b"two")
    assert conn.next_event() is NEED_DATA


def test_pipelined_request_waits_for_a_streamed_response(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET + GET)
    assert isinstance(conn.next_event(), HttpRequest)
    conn.send_stream_start(200, [(b"content-type", b"text/event-stream")])
    assert conn.in_response
    assert conn.next_event() is PAUSED
    conn.send_stream_data(b"data: 1\n\n")
    assert conn.next_event() is PAUSED
    conn.send_stream_end()
    assert not conn.in_response
    assert isinstance(conn.next_event(), HttpRequest)


def test_http10_closes_by_default(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"GET /v1/models HTTP/1.0\r\n\r\n")
    request = conn.next_event()
    assert isinstance(request, HttpRequest)
    assert request.http_version == "1.0"
    assert not request.keep_alive
    assert conn.must_close
    out = conn.send_response(200, [], b"ok")
    assert out == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok"
    assert conn.next_event() is PAUSED


def test_http10_keep_alive(codec: CodecLike) -> None:
    conn = codec.server_connection()
    raw = b"GET /health HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n"
    conn.receive_data(raw + raw)
    request = conn.next_event()
    assert isinstance(request, HttpRequest) and request.keep_alive
    assert not conn.must_close
    out = conn.send_response(200, [], b"ok")
    assert out == b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: keep-alive\r\n\r\nok"
    assert isinstance(conn.next_event(), HttpRequest)


def test_http10_stream_is_close_delimited(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert isinstance(conn.next_event(), HttpRequest)
    head = conn.send_stream_start(200, [(b"content-type", b"text/event-stream")])
    assert head == b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n"
    assert conn.must_close
    assert conn.send_stream_data(b"data: x\n\n") == b"data: x\n\n"
    assert conn.send_stream_end() == b""
    assert conn.next_event() is PAUSED


def test_connection_close_request(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"GET / HTTP/1.1\r\nHost: a\r\nConnection: keep-alive, Close\r\n\r\n" + GET)
    request = conn.next_event()
    assert isinstance(request, HttpRequest) and not request.keep_alive
    assert conn.must_close
    out = conn.send_response(404, [], b"")
    assert out == b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    # The pipelined request behind a closing one is never served.
    assert conn.next_event() is PAUSED


def test_has_partial_request(codec: CodecLike) -> None:
    conn = codec.server_connection()
    assert not conn.has_partial_request
    conn.receive_data(POST[:10])
    assert conn.has_partial_request
    assert conn.next_event() is NEED_DATA
    assert conn.has_partial_request
    conn.receive_data(POST[10:-1])
    assert conn.next_event() is NEED_DATA
    assert conn.has_partial_request  # the head is parsed; the body is not complete
    conn.receive_data(POST[-1:] + GET[:3])
    assert isinstance(conn.next_event(), HttpRequest)
    assert conn.has_partial_request  # pipelined bytes
    conn.send_response(200, [], b"")
    conn.receive_data(GET[3:])
    assert isinstance(conn.next_event(), HttpRequest)
    assert not conn.has_partial_request
    conn.send_response(200, [], b"")
    assert not conn.has_partial_request
    conn.receive_data(EXPECT_HEAD)
    assert isinstance(conn.next_event(), ContinueExpected)
    assert conn.has_partial_request


def test_leading_empty_lines_are_ignored(codec: CodecLike) -> None:
    request = one_request(codec, b"\r\n\r\n" + GET)
    assert request.target == "/health"
    log, _ = run_server(codec, [b"\r\n", b"\r", b"\n"])
    assert log == [ConnectionClosed()]


def test_chunked_request_body(codec: CodecLike) -> None:
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\r\n"
        b"5;name=value;q=\"a \\\"b\\\"\"\r\nhello\r\n"
        b"1 \r\n \r\n"
        b"6\r\nworld!\r\n"
        b"0\r\nX-Checksum: abc\r\n\r\n"
    )
    request = one_request(codec, raw + GET)
    assert request.body == b"hello world!"
    assert request.header(b"transfer-encoding") == b"chunked"
    log, _ = run_server(codec, bytewise(raw + GET))
    assert [type(e) for e in log] == [HttpRequest, HttpRequest, ConnectionClosed]
    assert isinstance(log[0], HttpRequest) and log[0].body == b"hello world!"


def test_empty_chunked_body(codec: CodecLike) -> None:
    assert one_request(codec, b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n").body == b""


def test_head_response_has_no_body(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"HEAD /health HTTP/1.1\r\nHost: a\r\n\r\n")
    assert isinstance(conn.next_event(), HttpRequest)
    assert conn.send_response(200, [], b"hello") == b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"
    conn.receive_data(b"HEAD /health HTTP/1.1\r\nHost: a\r\n\r\n")
    assert isinstance(conn.next_event(), HttpRequest)
    assert conn.send_stream_start(200, []) == b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    assert conn.send_stream_data(b"abc") == b""
    assert conn.send_stream_end() == b""
    assert not conn.must_close


def test_no_content_responses(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET)
    conn.next_event()
    with pytest.raises(LocalProtocolError):
        conn.send_response(204, [], b"x")
    with pytest.raises(LocalProtocolError):
        conn.send_stream_start(304, [])
    assert conn.send_response(204, [], b"") == b"HTTP/1.1 204 No Content\r\n\r\n"


def test_unknown_status_gets_empty_reason(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET)
    conn.next_event()
    assert conn.send_response(299, [], b"").startswith(b"HTTP/1.1 299 \r\n")


# -- Expect: 100-continue ---------------------------------------------------

EXPECT_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n"


def test_expect_continue_accepted(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(EXPECT_HEAD)
    event = conn.next_event()
    assert event == ContinueExpected(
        method="POST",
        target="/v1/completions",
        headers=((b"host", b"a"), (b"expect", b"100-continue"), (b"content-length", b"5")),
        content_length=5,
    )
    assert event.header(b"expect") == b"100-continue"
    assert conn.send_continue() == b"HTTP/1.1 100 Continue\r\n\r\n"
    with pytest.raises(LocalProtocolError):
        conn.send_continue()
    assert conn.next_event() is NEED_DATA
    conn.receive_data(b"hello")
    request = conn.next_event()
    assert isinstance(request, HttpRequest) and request.body == b"hello"
    assert not conn.must_close
    conn.send_response(200, [], b"")
    assert conn.next_event() is NEED_DATA


def test_expect_continue_answered_at_once_closes(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(EXPECT_HEAD)
    assert isinstance(conn.next_event(), ContinueExpected)
    assert not conn.must_close
    out = conn.send_response(401, [(b"www-authenticate", b"Bearer")], b"no")
    assert out == (
        b"HTTP/1.1 401 Unauthorized\r\nwww-authenticate: Bearer\r\ncontent-length: 2\r\nconnection: close\r\n\r\nno"
    )
    assert conn.must_close
    conn.receive_data(b"hello")
    assert conn.next_event() is PAUSED


def test_expect_continue_once_per_request_even_when_body_is_there(codec: CodecLike) -> None:
    log, out = run_server(codec, [EXPECT_HEAD + b"hello" + EXPECT_HEAD + b"world"])
    assert [type(e) for e in log] == [ContinueExpected, HttpRequest, ContinueExpected, HttpRequest, ConnectionClosed]
    assert out.count(b"100 Continue") == 2


def test_expect_continue_chunked_and_http10(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\nTransfer-Encoding: chunked\r\n\r\n")
    event = conn.next_event()
    assert isinstance(event, ContinueExpected) and event.content_length is None
    # HTTP/1.0 expectations are ignored (RFC 9110 §10.1.1).
    request = one_request(codec, b"POST / HTTP/1.0\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx")
    assert request.body == b"x"


def test_expect_continue_over_limit_is_413_before_continue(codec: CodecLike) -> None:
    error = server_error(codec, EXPECT_HEAD.replace(b"Content-Length: 5", b"Content-Length: 600"), **SMALL_LIMITS)
    assert (error.status, error.reason) == (413, "too_large")


def test_continue_only_after_continue_expected(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(POST)
    conn.next_event()
    with pytest.raises(LocalProtocolError):
        conn.send_continue()


# -- EOF --------------------------------------------------------------------


def test_eof_between_requests(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"")
    assert conn.next_event() == ConnectionClosed()
    assert conn.must_close
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"more")


def test_eof_after_request_while_responding(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(POST)
    conn.receive_data(b"")
    assert isinstance(conn.next_event(), HttpRequest)
    assert conn.next_event() is PAUSED
    conn.send_response(200, [], b"")
    assert conn.next_event() == ConnectionClosed()


@pytest.mark.parametrize(
    "raw",
    [
        b"G",
        b"GET / HTTP/1.1\r\nHost: a\r\n",
        b"\r",
        POST[:-1],
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel",
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n",
        EXPECT_HEAD + b"hel",
    ],
)
def test_eof_mid_request_is_dropped(codec: CodecLike, raw: bytes) -> None:
    error = server_error(codec, raw, eof=True)
    assert (error.status, error.reason) == (400, "dropped")


# -- Errors -----------------------------------------------------------------

CHUNKED = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"

SMUGGLING = {
    "cl-and-te": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-and-cl": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "duplicate-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "conflicting-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "list-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5, 5\r\n\r\nhello",
    "conflicting-list-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5,6\r\n\r\nhello!",
    "signed-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: +5\r\n\r\nhello",
    "hex-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 0x5\r\n\r\nhello",
    "te-gzip": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\n\r\n",
    "te-gzip-chunked": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "te-chunked-twice": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, chunked\r\n\r\n0\r\n\r\n",
    "te-two-fields": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "te-identity": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\n",
    "te-http10": b"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-space-before-colon": b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "cl-space-before-colon": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length : 5\r\n\r\nhello",
    "obs-fold": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n",
    "obs-fold-tab": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n\tc\r\n\r\n",
    "obs-fold-cl": b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n 5\r\n\r\nhello",
    "fold-before-first-field": b"GET / HTTP/1.1\r\n Host: a\r\n\r\n",
    "bare-cr-in-value": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\rc\r\n\r\n",
    "bare-cr-line-end": b"GET / HTTP/1.1\r\nHost: a\rX-A: b\r\n\r\n",
    "bare-cr-request-line": b"GET /\r HTTP/1.1\r\nHost: a\r\n\r\n",
    "bare-lf-everywhere": b"GET / HTTP/1.1\nHost: a\n\n",
    "bare-lf-one-line": b"GET / HTTP/1.1\r\nHost: a\nX-A: b\r\n\r\n",
    "bare-lf-end": b"GET / HTTP/1.1\r\nHost: a\r\n\n",
    "leading-bare-lf": b"\nGET / HTTP/1.1\r\nHost: a\r\n\r\n",
    "nul-in-value": b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x00c\r\n\r\n",
    "duplicate-host": b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    "missing-host": b"GET / HTTP/1.1\r\n\r\n",
    "bad-method": b"G(T / HTTP/1.1\r\nHost: a\r\n\r\n",
    "double-space": b"GET  / HTTP/1.1\r\nHost: a\r\n\r\n",
    "no-version": b"GET /\r\nHost: a\r\n\r\n",
    "tls-hello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
    "chunk-size-hex-prefix": CHUNKED + b"0x5\r\nhello\r\n0\r\n\r\n",
    "chunk-size-negative": CHUNKED + b"-5\r\nhello\r\n0\r\n\r\n",
    "chunk-size-empty": CHUNKED + b"\r\nhello\r\n0\r\n\r\n",
    "chunk-size-17-digits": CHUNKED + b"00000000000000005\r\nhello\r\n0\r\n\r\n",
    "chunk-size-two-numbers": CHUNKED + b"5 5\r\nhello\r\n0\r\n\r\n",
    "chunk-data-too-long": CHUNKED + b"5\r\nhelloX\r\n0\r\n\r\n",
    "chunk-data-no-crlf": CHUNKED + b"5\r\nhello0\r\n\r\n",
    "chunk-data-bare-lf": CHUNKED + b"5\r\nhello\n0\r\n\r\n",
    "chunk-line-bare-lf": CHUNKED + b"5\nhello\r\n0\r\n\r\n",
    "chunk-ext-bare-cr": CHUNKED + b"5;a\rb\r\nhello\r\n0\r\n\r\n",
    "chunk-ext-malformed": CHUNKED + b"5;=x\r\nhello\r\n0\r\n\r\n",
    "chunk-ext-unterminated-quote": CHUNKED + b'5;a="b\r\nhello\r\n0\r\n\r\n',
    "last-chunk-bare-lf-end": CHUNKED + b"0\r\n\n",
    "trailer-obs-fold": CHUNKED + b"0\r\nX-A: b\r\n c\r\n\r\n",
    "trailer-bare-lf": CHUNKED + b"0\r\nX-A: b\n\r\n",
    "trailer-malformed": CHUNKED + b"0\r\nnot a field\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(SMUGGLING))
def test_malformed_and_smuggling_shapes_are_400(codec: CodecLike, name: str) -> None:
    raw = SMUGGLING[name]
    for error in (server_error(codec, raw), bytewise_error(codec, raw), server_error(codec, raw, eof=True)):
        assert (error.status, error.reason) == (400, "malformed"), (name, error)


def test_unsupported_http_versions_are_505(codec: CodecLike) -> None:
    for raw in (b"GET / HTTP/1.2\r\nHost: a\r\n\r\n", b"GET / HTTP/2.0\r\nHost: a\r\n\r\n", b"GET / HTTP/0.9\r\n\r\n"):
        assert server_error(codec, raw).status == 505


def test_body_over_limit_from_content_length_is_413_without_the_body(codec: CodecLike) -> None:
    error = server_error(codec, b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 513\r\n\r\n", **SMALL_LIMITS)
    assert (error.status, error.reason) == (413, "too_large")
    assert one_request(codec, b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 512\r\n\r\n" + b"x" * 512, **SMALL_LIMITS)


def test_chunked_body_over_limit_is_413_from_the_chunk_size(codec: CodecLike) -> None:
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    error = server_error(codec, head + b"200\r\n" + b"x" * 512 + b"\r\n1\r\n", **SMALL_LIMITS)
    assert (error.status, error.reason) == (413, "too_large")
    error = server_error(codec, head + b"fffffffffffffff\r\n", **SMALL_LIMITS)
    assert error.status == 413
    ok = head + b"100\r\n" + b"x" * 256 + b"\r\n100\r\n" + b"y" * 256 + b"\r\n0\r\n\r\n"
    assert len(one_request(codec, ok, **SMALL_LIMITS).body) == 512


def test_request_line_limit_is_431(codec: CodecLike) -> None:
    limit = SMALL_LIMITS["max_request_line_bytes"]
    line = b"GET /" + b"a" * (limit - len(b"GET / HTTP/1.1")) + b" HTTP/1.1"
    assert len(line) == limit
    assert one_request(codec, line + b"\r\nHost: a\r\n\r\n", **SMALL_LIMITS).method == "GET"
    too_long = b"GET /a" + line[5:] + b"\r\nHost: a\r\n\r\n"
    for error in (
        server_error(codec, too_long, **SMALL_LIMITS),
        bytewise_error(codec, too_long, **SMALL_LIMITS),
        # Refused before the line ends:
        server_error(codec, b"GET /" + b"a" * 200, **SMALL_LIMITS),
    ):
        assert (error.status, error.reason) == (431, "too_large")


def test_header_section_limit_is_431(codec: CodecLike) -> None:
    limit = SMALL_LIMITS["max_header_bytes"]
    fields = b"Host: a\r\n"
    filler = b"X-Fill: " + b"f" * (limit - len(fields) - len(b"X-Fill: \r\n\r\n")) + b"\r\n"
    head = b"GET / HTTP/1.1\r\n" + fields + filler + b"\r\n"
    assert len(head) - len(b"GET / HTTP/1.1\r\n") == limit
    assert one_request(codec, head, **SMALL_LIMITS)
    too_big = head.replace(b"X-Fill: ", b"X-Fill: f")
    for error in (
        server_error(codec, too_big, **SMALL_LIMITS),
        bytewise_error(codec, too_big, **SMALL_LIMITS),
        server_error(codec, b"GET / HTTP/1.1\r\nX: " + b"x" * 400, **SMALL_LIMITS),
    ):
        assert (error.status, error.reason) == (431, "too_large")


def test_header_count_limit_is_431(codec: CodecLike) -> None:
    fields = b"".join(b"X-%d: v\r\n" % i for i in range(7))
    assert one_request(codec, b"GET / HTTP/1.1\r\nHost: a\r\n" + fields + b"\r\n", **SMALL_LIMITS)
    error = server_error(codec, b"GET / HTTP/1.1\r\nHost: a\r\n" + fields + b"X-8: v\r\n\r\n", **SMALL_LIMITS)
    assert (error.status, error.reason) == (431, "too_large")


def test_trailer_limits_are_431(codec: CodecLike) -> None:
    head = b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n"
    many = b"".join(b"X-%d: v\r\n" % i for i in range(9))
    assert server_error(codec, head + many + b"\r\n", **SMALL_LIMITS).status == 431
    assert server_error(codec, head + b"X: " + b"v" * 300 + b"\r\n\r\n", **SMALL_LIMITS).status == 431


def test_error_is_sticky_and_error_response_closes(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(SMUGGLING["cl-and-te"])
    with pytest.raises(RemoteProtocolError) as first:
        conn.next_event()
    with pytest.raises(RemoteProtocolError) as second:
        conn.next_event()
    assert first.value is second.value
    assert conn.must_close
    with pytest.raises(LocalProtocolError):
        conn.send_response(400, [], b"")
    out = conn.send_error_response(400, [(b"content-type", b"application/json")], first.value.body())
    assert out.startswith(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: ")
    assert b"\r\nconnection: close\r\n\r\n{" in out
    assert conn.must_close
    assert conn.next_event() is PAUSED
    with pytest.raises(LocalProtocolError):
        conn.send_error_response(400, [], b"")


def test_error_response_before_a_request_and_instead_of_a_response(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(b"POST / HTTP/1.1\r\nHo")
    assert conn.next_event() is NEED_DATA
    out = conn.send_error_response(408, [], b"slow")
    assert out == b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 4\r\nconnection: close\r\n\r\nslow"
    assert conn.must_close

    conn = codec.server_connection()
    conn.receive_data(b"HEAD / HTTP/1.1\r\nHost: a\r\n\r\n")
    conn.next_event()
    assert conn.send_error_response(503, [], b"busy") == (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\nconnection: close\r\n\r\n"
    )


def test_no_error_response_in_the_middle_of_a_stream(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET)
    conn.next_event()
    conn.send_stream_start(200, [])
    with pytest.raises(LocalProtocolError, match="STREAMING"):
        conn.send_error_response(500, [], b"")
    assert conn.in_response
    assert conn.send_stream_data(b"x") == b"1\r\nx\r\n"
    assert conn.send_stream_data(b"") == b""
    assert conn.send_stream_end() == b"0\r\n\r\n"


@pytest.mark.parametrize(
    "action",
    [
        lambda c: c.send_response(200, [], b""),
        lambda c: c.send_stream_start(200, []),
        lambda c: c.send_stream_data(b"x"),
        lambda c: c.send_stream_end(),
        lambda c: c.send_continue(),
    ],
)
def test_sends_out_of_order_fail_closed(codec: CodecLike, action: Callable[[ServerCodec], bytes]) -> None:
    conn = codec.server_connection()
    with pytest.raises(LocalProtocolError, match="IDLE"):
        action(conn)
    # Nothing changed: the connection still works.
    conn.receive_data(GET)
    assert isinstance(conn.next_event(), HttpRequest)


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (200, [(b"content-length", b"3")]),
        (200, [(b"Transfer-Encoding", b"chunked")]),
        (200, [(b"x-a", b"b\r\nset-cookie: evil")]),
        (200, [(b"x-a", b"b\nc")]),
        (200, [(b"x-a", b" leading")]),
        (200, [(b"x-a", b"nul\x00")]),
        (200, [(b"bad name", b"v")]),
        (200, [(b"", b"v")]),
        (200, [(b"connection", b"keep-alive")]),
        (100, []),
        (199, []),
        (600, []),
    ],
)
def test_invalid_responses_are_refused_without_side_effects(
    codec: CodecLike, status: int, headers: list[tuple[bytes, bytes]]
) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET)
    conn.next_event()
    with pytest.raises(LocalProtocolError):
        conn.send_response(status, headers, b"abc")
    with pytest.raises(LocalProtocolError):
        conn.send_stream_start(status, headers)
    assert conn.send_error_response(500, [], b"") == (
        b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    )


def test_caller_can_ask_to_close(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET)
    conn.next_event()
    out = conn.send_response(200, [(b"Connection", b"close"), (b"x-request-id", b"r1")], b"")
    assert out == b"HTTP/1.1 200 OK\r\nx-request-id: r1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    assert conn.must_close


def test_send_failed_kills_the_connection(codec: CodecLike) -> None:
    conn = codec.server_connection()
    conn.receive_data(GET + GET)
    conn.next_event()
    conn.send_stream_start(200, [])
    conn.send_failed()
    assert conn.must_close
    assert not conn.in_response
    with pytest.raises(LocalProtocolError):
        conn.send_stream_data(b"x")
    with pytest.raises(LocalProtocolError):
        conn.send_error_response(500, [], b"")
    with pytest.raises(LocalProtocolError):
        conn.next_event()


def test_pipelined_data_is_bounded(codec: CodecLike) -> None:
    conn = codec.server_connection(**SMALL_LIMITS)
    conn.receive_data(GET)
    assert isinstance(conn.next_event(), HttpRequest)
    bound = 64 + 256 + 512 + 4
    for _ in range(100):
        conn.receive_data(GET)
        assert len(conn._buf) <= bound
        assert conn.next_event() is PAUSED
    served = 1
    with pytest.raises(RemoteProtocolError) as info:
        while True:
            conn.send_response(200, [], b"")
            event = conn.next_event()
            assert isinstance(event, HttpRequest)
            served += 1
    assert (info.value.status, info.value.reason) == (400, "too_large")
    assert served == 1 + bound // len(GET)


def test_pipelined_requests_within_the_bound_are_served(codec: CodecLike) -> None:
    raws = [b"POST /%d HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n" % i + b"x" * 100 for i in range(5)]
    log, _ = run_server(codec, [b"".join(raws)], **SMALL_LIMITS)
    assert [e.target for e in log if isinstance(e, HttpRequest)] == [f"/{i}" for i in range(5)]


# ---------------------------------------------------------------------------
# Hypothesis: generated request streams
# ---------------------------------------------------------------------------

RESERVED = {b"host", b"content-length", b"transfer-encoding", b"connection", b"expect"}
names = (
    st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCXYZ0123456789-_.!#", min_size=1, max_size=12)
    .map(str.encode)
    .filter(lambda n: n.lower() not in RESERVED)
)
values = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E) | st.just("\t"), max_size=24).map(
    lambda s: s.strip(" \t").encode()
)
header_lists = st.lists(st.tuples(names, values), max_size=6)
targets = st.from_regex(r"/[A-Za-z0-9._~%!$&'()*+,;=:@/-]{0,30}(\?[A-Za-z0-9=&]{0,10})?", fullmatch=True)
methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])


@attrs.frozen
class RequestSpec:
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    body: bytes
    version: str
    chunk_sizes: list[int] | None
    expect: bool
    close: bool

    def expected_fields(self) -> list[tuple[bytes, bytes]]:
        return [(n.lower(), v) for n, v in self.headers]


@st.composite
def request_specs(draw: st.DrawFn, *, last: bool = False) -> RequestSpec:
    version = draw(st.sampled_from(["1.1", "1.1", "1.1", "1.0"]))
    body = draw(st.binary(max_size=200))
    chunk_sizes = None
    if version == "1.1" and draw(st.booleans()):
        cuts = draw(st.lists(st.integers(0, len(body)), max_size=4))
        points = sorted({0, len(body), *cuts})
        chunk_sizes = [b - a for a, b in zip(points, points[1:], strict=False)]
    return RequestSpec(
        method=draw(methods),
        target=draw(targets),
        headers=draw(header_lists),
        body=body,
        version=version,
        chunk_sizes=chunk_sizes,
        expect=version == "1.1" and draw(st.booleans()),
        close=last and draw(st.booleans()),
    )


def serialize_request(spec: RequestSpec) -> bytes:
    lines = [f"{spec.method} {spec.target} HTTP/{spec.version}".encode(), b"Host: router.example"]
    lines += [n + b": " + v for n, v in spec.headers]
    if spec.version == "1.0":
        lines.append(b"Connection: close" if spec.close else b"Connection: keep-alive")
    elif spec.close:
        lines.append(b"Connection: close")
    if spec.expect:
        lines.append(b"Expect: 100-continue")
    if spec.chunk_sizes is None:
        if spec.body or spec.method in ("POST", "PUT"):
            lines.append(b"Content-Length: %d" % len(spec.body))
        payload = spec.body
    else:
        lines.append(b"Transfer-Encoding: chunked")
        parts, pos = [], 0
        for i, size in enumerate(spec.chunk_sizes):
            ext = b";i=%d" % i if i % 2 else b""
            parts.append(b"%X%s\r\n%s\r\n" % (size, ext, spec.body[pos : pos + size]))
            pos += size
        parts.append(b"0\r\nX-Trailer: done\r\n\r\n" if len(spec.chunk_sizes) % 2 else b"0\r\n\r\n")
        payload = b"".join(parts)
    return b"\r\n".join(lines) + b"\r\n\r\n" + payload


request_streams = st.tuples(st.lists(request_specs(), max_size=2), request_specs(last=True)).map(
    lambda t: [*t[0], t[1]]
)


def check_served(specs: list[RequestSpec], log: list[object]) -> None:
    requests = [e for e in log if isinstance(e, HttpRequest)]
    assert len(requests) == len(specs)
    for spec, request in zip(specs, requests, strict=True):
        assert request.method == spec.method
        assert request.target == spec.target
        assert request.body == spec.body
        assert request.http_version == spec.version
        assert request.keep_alive is not spec.close
        assert [(n, v) for n, v in request.headers if n not in RESERVED] == spec.expected_fields()
        assert request.header(b"host") == b"router.example"


@FAST
@given(request_streams, st.data())
def test_server_split_anywhere_gives_the_same_events(
    codec: CodecLike, specs: list[RequestSpec], data: st.DataObject
) -> None:
    stream = b"".join(serialize_request(s) for s in specs)
    whole_log, whole_out = run_server(codec, [stream])
    check_served(specs, whole_log)
    assert whole_log[-1] == ConnectionClosed() or specs[-1].close
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=8))
    assert run_server(codec, split_at(stream, cuts)) == (whole_log, whole_out)


@settings(max_examples=examples(15), deadline=None)
@given(request_streams)
def test_server_byte_at_a_time_gives_the_same_events(codec: CodecLike, specs: list[RequestSpec]) -> None:
    stream = b"".join(serialize_request(s) for s in specs)
    assert run_server(codec, bytewise(stream)) == run_server(codec, [stream])


# ---------------------------------------------------------------------------
# ReferenceEngineConnection
# ---------------------------------------------------------------------------


def test_engine_request_bytes(codec: CodecLike) -> None:
    conn = codec.engine_connection()
    out = conn.send_request(
        "POST", "/v1/completions", [(b"host", b"e:8100"), (b"x-request-id", b"r-p1")], b'{"a":1}'
    )
    assert out == (
        b"POST /v1/completions HTTP/1.1\r\nhost: e:8100\r\nx-request-id: r-p1\r\ncontent-length: 7\r\n\r\n"
        b'{"a":1}'
    )
    assert codec.engine_connection().send_request("GET", "/health", [(b"host", b"e")], b"") == (
        b"GET /health HTTP/1.1\r\nhost: e\r\n\r\n"
    )
    assert b"content-length: 0\r\n" in codec.engine_connection().send_request("POST", "/abort", [(b"host", b"e")], b"")


@pytest.mark.parametrize(
    ("method", "target", "headers"),
    [
        ("POST", "/", []),
        ("POST", "/", [(b"host", b"e"), (b"content-length", b"2")]),
        ("POST", "/", [(b"host", b"e"), (b"Transfer-Encoding", b"chunked")]),
        ("POST", "/", [(b"host", b"e"), (b"upgrade", b"h2c")]),
        ("POST", "/", [(b"host", b"e"), (b"x", b"a\r\nb: c")]),
        ("POST", "/", [(b"host", b"e"), (b"x", b"a ")]),
        ("POST", "/", [(b"host", b"e"), (b"x", b"\ta")]),
        ("POST", "/", [(b"host", b"e"), (b"x", b"a\x00")]),
        ("POST", "/", [(b"host", b"e"), (b"host", b"e")]),
        ("POST", "/é", [(b"host", b"e")]),
        ("POST", "/a b", [(b"host", b"e")]),
        ("P OST", "/", [(b"host", b"e")]),
        ("CONNECT", "e:443", [(b"host", b"e")]),
    ],
)
def test_engine_request_refused(codec: CodecLike, method: str, target: str, headers: list[tuple[bytes, bytes]]) -> None:
    with pytest.raises(LocalProtocolError):
        codec.engine_connection().send_request(method, target, headers, b"{}")


def test_engine_one_request_per_connection(codec: CodecLike) -> None:
    conn = codec.engine_connection()
    with pytest.raises(LocalProtocolError):
        conn.next_event()
    conn.send_request("GET", "/", [(b"host", b"e")], b"")
    with pytest.raises(LocalProtocolError):
        conn.send_request("GET", "/", [(b"host", b"e")], b"")


def test_engine_content_length_response(codec: CodecLike) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"
    assert engine_events(codec, [raw], eof=False) == [
        ResponseHead(status=200, headers=((b"content-type", b"application/json"), (b"content-length", b"11"))),
        BodyData(data=b'{"ok":true}'),
        ResponseEnd(reusable=True),
    ]


def test_engine_chunked_stream(codec: CodecLike) -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"b\r\ndata: one\n\n\r\nb\r\ndata: two\n\n\r\n0\r\n\r\n"
    )
    events = engine_events(codec, split_at(raw, [len(raw) - 30, len(raw) - 10]), eof=False)
    assert isinstance(events[0], ResponseHead) and events[0].status == 200
    assert events[-1] == ResponseEnd(reusable=True)
    pieces = [e.data for e in events if isinstance(e, BodyData)]
    assert len(pieces) >= 2
    assert b"".join(pieces) == b"data: one\n\ndata: two\n\n"


def test_engine_close_delimited_response(codec: CodecLike) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end"
    events = engine_events(codec, [raw])
    assert coalesce(events[1:]) == [BodyData(data=b"until the end"), ResponseEnd(reusable=False)]
    assert engine_events(codec, [b"HTTP/1.0 200 OK\r\n\r\n"]) == [
        ResponseHead(status=200, headers=()),
        ResponseEnd(reusable=False),
    ]


def test_engine_informational_responses_are_skipped(codec: CodecLike) -> None:
    raw = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
    )
    assert engine_events(codec, bytewise(raw), eof=False) == [
        ResponseHead(status=201, headers=((b"content-length", b"0"),)),
        ResponseEnd(reusable=True),
    ]


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"HTTP/1.1 200 OK\r\nContent-Le",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcde\r\n",
        b"HTTP/1.1 100 Continue\r\n\r\n",
    ],
)
def test_engine_eof_before_the_end_is_dropped(codec: CodecLike, raw: bytes) -> None:
    assert engine_events(codec, [raw])[-1] == Failed(502, "dropped")


@pytest.mark.parametrize(
    "raw",
    [
        b"HTTP/1.1 2OO OK\r\n\r\n",
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\n\r\n",
    ],
)
def test_engine_malformed_response(codec: CodecLike, raw: bytes) -> None:
    assert engine_events(codec, [raw], eof=False)[-1] == Failed(502, "malformed")


def test_engine_limits(codec: CodecLike) -> None:
    big = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 100
    assert engine_events(codec, [big], max_body_bytes=99) == [Failed(502, "too_large")]
    assert engine_events(codec, [big], max_body_bytes=100, eof=False)[-1] == ResponseEnd(reusable=True)
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"10\r\n" + b"x" * 16 + b"\r\n" * 8
    assert engine_events(codec, [chunked], max_body_bytes=10)[-1] == Failed(502, "too_large")
    closing = b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 100
    assert engine_events(codec, [closing], max_body_bytes=50)[-1] == Failed(502, "too_large")
    assert engine_events(codec, [closing], max_body_bytes=None)[-1] == ResponseEnd(reusable=False)
    head = b"HTTP/1.1 200 OK\r\nX: " + b"x" * 200 + b"\r\n\r\n"
    assert engine_events(codec, [head], max_header_bytes=100, eof=False) == [Failed(502, "too_large")]
    # A body limit does not apply to responses that cannot have a body.
    not_modified = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 100\r\n\r\n"
    assert engine_events(codec, [not_modified], max_body_bytes=1, eof=False)[-1] == ResponseEnd(reusable=True)


def test_engine_head_request(codec: CodecLike) -> None:
    raw = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n"
    assert engine_events(codec, [raw], method="HEAD", eof=False) == [
        ResponseHead(status=200, headers=((b"content-length", b"1000"),)),
        ResponseEnd(reusable=True),
    ]


def test_engine_reusable_flag(codec: CodecLike) -> None:
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    assert engine_events(codec, [ok], eof=False)[-1] == ResponseEnd(reusable=True)
    closing = b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"
    assert engine_events(codec, [closing], eof=False)[-1] == ResponseEnd(reusable=False)
    assert engine_events(codec, [ok + b"HTTP/1.1 200 OK\r\n"], eof=False)[-1] == ResponseEnd(reusable=False)
    assert engine_events(codec, [b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok"], eof=False)[-1] == ResponseEnd(
        reusable=False
    )
    # EOF already seen when the end is parsed: the engine closed the socket.
    conn = codec.engine_connection()
    conn.send_request("GET", "/", [(b"host", b"e")], b"")
    conn.receive_data(ok)
    conn.receive_data(b"")
    events = [conn.next_event() for _ in range(3)]
    assert events[-1] == ResponseEnd(reusable=False)
    # After the end, the same value again; later bytes are ignored.
    assert conn.next_event() == ResponseEnd(reusable=False)


def test_engine_error_is_sticky_and_eof_is_final(codec: CodecLike) -> None:
    conn = codec.engine_connection()
    conn.send_request("GET", "/", [(b"host", b"e")], b"")
    conn.receive_data(b"garbage\r\n\r\n")
    with pytest.raises(RemoteProtocolError) as first:
        conn.next_event()
    with pytest.raises(RemoteProtocolError) as second:
        conn.next_event()
    assert first.value is second.value
    conn = codec.engine_connection()
    conn.receive_data(b"")
    with pytest.raises(LocalProtocolError):
        conn.receive_data(b"x")


@attrs.frozen
class ResponseSpec:
    interim: list[int]
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    framing: str  # "cl", "chunked" or "close"
    keep_alive: bool


@st.composite
def response_specs(draw: st.DrawFn) -> ResponseSpec:
    framing = draw(st.sampled_from(["cl", "chunked", "close"]))
    return ResponseSpec(
        interim=draw(st.lists(st.sampled_from([100, 102, 103]), max_size=2)),
        status=draw(st.sampled_from([200, 201, 400, 404, 429, 500, 503])),
        headers=draw(header_lists),
        body=draw(st.binary(max_size=300)),
        framing=framing,
        keep_alive=framing != "close" and draw(st.booleans()),
    )


def serialize_response(spec: ResponseSpec, cuts: Sequence[int] = ()) -> bytes:
    out = [b"HTTP/1.1 %d Informational\r\nX-Hint: %d\r\n\r\n" % (s, s) for s in spec.interim]
    lines = [b"HTTP/1.1 %d Whatever" % spec.status] + [n + b": " + v for n, v in spec.headers]
    if not spec.keep_alive:
        lines.append(b"Connection: close")
    if spec.framing == "cl":
        lines.append(b"Content-Length: %d" % len(spec.body))
        payload = spec.body
    elif spec.framing == "chunked":
        lines.append(b"Transfer-Encoding: chunked")
        pieces = split_at(spec.body, cuts)
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"
    else:
        payload = spec.body
    out.append(b"\r\n".join(lines) + b"\r\n\r\n" + payload)
    return b"".join(out)


def check_response(spec: ResponseSpec, events: list[object]) -> None:
    events = coalesce(events)
    head = events[0]
    assert isinstance(head, ResponseHead)
    assert head.status == spec.status
    assert [(n, v) for n, v in head.headers if n not in RESERVED] == [(n.lower(), v) for n, v in spec.headers]
    body = b"".join(e.data for e in events if isinstance(e, BodyData))
    assert body == spec.body
    assert events[-1] == ResponseEnd(reusable=spec.keep_alive)


@FAST
@given(response_specs(), st.data())
def test_engine_split_anywhere_gives_the_same_events(codec: CodecLike, spec: ResponseSpec, data: st.DataObject) -> None:
    raw = serialize_response(spec, data.draw(st.lists(st.integers(0, len(spec.body)), max_size=4)))
    whole = engine_events(codec, [raw])
    check_response(spec, whole)
    cuts = data.draw(st.lists(st.integers(0, len(raw)), max_size=8))
    assert coalesce(engine_events(codec, split_at(raw, cuts))) == coalesce(whole)


@settings(max_examples=examples(15), deadline=None)
@given(response_specs())
def test_engine_byte_at_a_time_gives_the_same_events(codec: CodecLike, spec: ResponseSpec) -> None:
    raw = serialize_response(spec, [len(spec.body) // 2])
    assert coalesce(engine_events(codec, bytewise(raw))) == coalesce(engine_events(codec, [raw]))


# ---------------------------------------------------------------------------
# Round trips between the two sides
# ---------------------------------------------------------------------------


@FAST
@given(
    st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
    targets,
    header_lists,
    st.binary(max_size=300),
)
def test_engine_request_parses_back_on_the_server(
    codec: CodecLike,
    method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    raw = codec.engine_connection().send_request(method, target, [(b"Host", b"engine:8100"), *headers], body)
    request = one_request(codec, raw)
    assert (request.method, request.target, request.body) == (method, target, body)
    assert request.keep_alive and request.http_version == "1.1"
    expected = [(b"host", b"engine:8100"), *[(n.lower(), v) for n, v in headers]]
    if body or method in ("POST", "PUT", "PATCH"):
        expected.append((b"content-length", str(len(body)).encode()))
    assert list(request.headers) == expected


@FAST
@given(
    st.sampled_from(["GET", "POST", "HEAD"]),
    st.integers(200, 599),
    header_lists,
    st.binary(max_size=300),
)
def test_server_response_parses_back_on_the_engine(
    codec: CodecLike,
    method: str, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    if status in (204, 304):
        body = b""
    server = codec.server_connection()
    engine = codec.engine_connection()
    server.receive_data(engine.send_request(method, "/x", [(b"host", b"router")], b""))
    assert isinstance(server.next_event(), HttpRequest)
    engine.receive_data(server.send_response(status, headers, body))
    raw_events = [engine.next_event() for _ in range(3)]
    events = coalesce([e for e in raw_events if e is not NEED_DATA])
    head = events[0]
    assert isinstance(head, ResponseHead) and head.status == status
    expected = [(n.lower(), v) for n, v in headers]
    if status not in (204, 304):
        expected.append((b"content-length", str(len(body)).encode()))
    assert list(head.headers) == expected
    wire_body = b"".join(e.data for e in events if isinstance(e, BodyData))
    assert wire_body == (b"" if method == "HEAD" else body)
    assert events[-1] == ResponseEnd(reusable=True)


@FAST
@given(st.lists(st.binary(max_size=100), max_size=6), st.sampled_from(["1.1", "1.0"]))
def test_streamed_response_parses_back_on_the_engine(codec: CodecLike, pieces: list[bytes], version: str) -> None:
    server = codec.server_connection()
    server.receive_data(f"POST /v1/completions HTTP/{version}\r\nHost: a\r\nContent-Length: 0\r\n\r\n".encode())
    assert isinstance(server.next_event(), HttpRequest)
    wire = server.send_stream_start(200, [(b"content-type", b"text/event-stream")])
    wire += b"".join(server.send_stream_data(p) for p in pieces) + server.send_stream_end()
    assert server.must_close is (version == "1.0")
    events = engine_events(codec, [wire], eof=server.must_close)
    assert b"".join(e.data for e in events if isinstance(e, BodyData)) == b"".join(pieces)
    assert events[-1] == ResponseEnd(reusable=version == "1.1")


# ---------------------------------------------------------------------------
# Arbitrary bytes: only our errors, bounded buffers
# ---------------------------------------------------------------------------


def feed_server_checked(codec: CodecLike, pieces: Sequence[bytes]) -> None:
    conn = codec.server_connection(**SMALL_LIMITS)
    assert isinstance(conn, ServerConnection)  # the oracle too: it is a ServerConnection
    bound = conn._max_buffered
    log: list[object] = []
    out = bytearray()
    for piece in [*pieces, b""]:
        conn.receive_data(piece)
        assert len(conn._buf) <= bound
        if not pump_server(conn, log, out):
            break
        assert len(conn._buf) <= bound
    for event in log:
        assert isinstance(event, HttpRequest | ContinueExpected | ConnectionClosed | Failed)


@FUZZ
@given(st.binary(max_size=1500), st.data())
def test_server_arbitrary_bytes(codec: CodecLike, blob: bytes, data: st.DataObject) -> None:
    feed_server_checked(codec, split_at(blob, data.draw(st.lists(st.integers(0, len(blob)), max_size=10))))


@FUZZ
@given(request_streams, st.data())
def test_server_mutated_requests(codec: CodecLike, specs: list[RequestSpec], data: st.DataObject) -> None:
    stream = bytearray(b"".join(serialize_request(s) for s in specs))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(stream)))
        action = data.draw(st.sampled_from(["flip", "insert", "delete"]))
        byte = data.draw(st.sampled_from([0, 9, 10, 13, 32, 44, 48, 58, 59, 70, 255]))
        if action == "insert" or pos == len(stream):
            stream[pos:pos] = bytes([byte])
        elif action == "flip":
            stream[pos] = byte
        else:
            del stream[pos]
    raw = bytes(stream)
    feed_server_checked(codec, split_at(raw, data.draw(st.lists(st.integers(0, len(raw)), max_size=10))))


def engine_buffered(conn: EngineCodec) -> int:
    """Bytes an engine connection holds unparsed."""
    if isinstance(conn, ReferenceEngineConnection):
        return len(conn._h11.trailing_data[0])
    assert isinstance(conn, EngineConnection)
    return len(conn._buf)


def feed_engine_checked(codec: CodecLike, pieces: Sequence[bytes], **limits: int | None) -> None:
    conn = codec.engine_connection(**limits)  # type: ignore[arg-type]
    assert isinstance(conn, ReferenceEngineConnection | EngineConnection)
    conn.send_request("POST", "/v1/completions", [(b"host", b"e")], b"{}")
    bound = conn._max_unparsed + (limits.get("max_header_bytes") or 0)
    try:
        for piece in [*pieces, b""]:
            conn.receive_data(piece)
            assert engine_buffered(conn) <= bound
            while True:
                event = conn.next_event()
                assert engine_buffered(conn) <= bound
                if event is NEED_DATA or isinstance(event, ResponseEnd):
                    break
                assert isinstance(event, ResponseHead | BodyData)
    except RemoteProtocolError as exc:
        assert exc.status == 502 and exc.reason in ("malformed", "too_large", "dropped")


@FUZZ
@given(st.binary(max_size=1500), st.data())
def test_engine_arbitrary_bytes(codec: CodecLike, blob: bytes, data: st.DataObject) -> None:
    pieces = split_at(blob, data.draw(st.lists(st.integers(0, len(blob)), max_size=10)))
    feed_engine_checked(codec, pieces, max_header_bytes=256, max_body_bytes=512)


@FUZZ
@given(response_specs(), st.data())
def test_engine_mutated_responses(codec: CodecLike, spec: ResponseSpec, data: st.DataObject) -> None:
    stream = bytearray(serialize_response(spec, [len(spec.body) // 3]))
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(stream) - 1))
        stream[pos] = data.draw(st.sampled_from([0, 10, 13, 32, 48, 58, 59, 70, 255]))
    raw = bytes(stream)
    pieces = split_at(raw, data.draw(st.lists(st.integers(0, len(raw)), max_size=10)))
    feed_engine_checked(codec, pieces, max_header_bytes=256, max_body_bytes=None)


# ---------------------------------------------------------------------------
# The fast codec against the reference
# ---------------------------------------------------------------------------
#
# Every test above runs against both codecs. These tests compare them
# directly, on heads chosen where a fast parser (llhttp, or a line rule
# narrower than h11's) is known to read differently from h11, and on
# generated, mutated and HTTP-shaped byte streams, cut anywhere.


def server_outcome(codec: CodecLike, raw: bytes, **limits: Unpack[Limits]) -> tuple[list[object], bytes]:
    return run_server(codec, [raw], **limits)


def assert_plain_bytes(events: Sequence[object]) -> None:
    """Equality alone would let a bytearray pass for bytes."""
    for event in events:
        if isinstance(event, HttpRequest | ContinueExpected | ResponseHead):
            assert all(type(name) is bytes and type(value) is bytes for name, value in event.headers)
        if isinstance(event, HttpRequest | BodyData):
            assert type(event.body if isinstance(event, HttpRequest) else event.data) is bytes


def assert_same_server(*splits: Sequence[bytes], **limits: Unpack[Limits]) -> None:
    """For each way of cutting the stream, the fast codec gives the reference's events and bytes."""
    for pieces in splits:
        fast = run_server(CODEC, pieces, **limits)
        assert fast == run_server(REFERENCE_CODEC, pieces, **limits)
        assert_plain_bytes(fast[0])


def assert_same_engine(*splits: Sequence[bytes], method: str, eof: bool, **limits: int | None) -> None:
    # Body pieces may be cut differently; whether a response is reusable
    # depends on what is buffered when its end is parsed, so each cut is
    # compared with the same cut.
    for pieces in splits:
        reference = coalesce(engine_events(REFERENCE_CODEC, pieces, method=method, eof=eof, **limits))
        fast = engine_events(CODEC, pieces, method=method, eof=eof, **limits)
        assert coalesce(fast) == reference
        assert_plain_bytes(fast)


#: Request heads on which a fast parser could disagree with the reference
#: (llhttp, left to itself, does): each must give the outcome noted, from both codecs.
TRICKY_REQUEST_HEADS: dict[str, tuple[bytes, object]] = {
    "unknown-method": (b"FOO /x HTTP/1.1\r\nHost: a\r\n\r\n", "FOO"),
    "lowercase-method": (b"get /x HTTP/1.1\r\nHost: a\r\n\r\n", "get"),
    "connect-authority": (b"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n\r\n", "CONNECT"),
    "target-not-a-url": (b"GET /{a}|^`\\ HTTP/1.1\r\nHost: a\r\n\r\n", "GET"),
    "target-asterisk": (b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n", "OPTIONS"),
    "control-char-in-value": (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x01c\r\n\r\n", "GET"),
    "del-in-value": (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: b\x7f\r\n\r\n", "GET"),
    "empty-value": (b"GET / HTTP/1.1\r\nHost: a\r\nX-A:\r\nX-B:  \r\n\r\n", "GET"),
    "upgrade": (b"GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n", "GET"),
    "http10-without-host": (b"GET / HTTP/1.0\r\n\r\n", "GET"),
    "cl-20-digits": (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 00000000000000000002\r\n\r\nhi", "POST"),
    "expect-in-a-list": (
        b"POST / HTTP/1.1\r\nHost: a\r\nExpect: foo, 100-Continue\r\nContent-Length: 1\r\n\r\nx",
        "POST",
    ),
    "missing-host": (b"GET / HTTP/1.1\r\n\r\n", Failed(400, "malformed")),
    "two-hosts": (b"GET / HTTP/1.0\r\nHost: a\r\nHost: a\r\n\r\n", Failed(400, "malformed")),
    "cl-21-digits": (
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 000000000000000000002\r\n\r\nhi",
        Failed(400, "malformed"),
    ),
    "cl-past-2-64": (
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 99999999999999999999\r\n\r\n",
        Failed(413, "too_large"),
    ),
    "cl-repeated-same": (
        b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx",
        Failed(400, "malformed"),
    ),
    "te-gzip-chunked": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        Failed(400, "malformed"),
    ),
    "te-with-upgrade": (
        b"GET / HTTP/1.1\r\nHost: a\r\nConnection: upgrade\r\nUpgrade: x\r\nTransfer-Encoding: gzip\r\n\r\n",
        Failed(400, "malformed"),
    ),
    "version-1.2-with-cl-and-te": (
        b"POST / HTTP/1.2\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
        Failed(505, "malformed"),
    ),
    "version-1.2-with-bad-field": (b"GET / HTTP/1.2\r\nX A: b\r\n\r\n", Failed(400, "malformed")),
    "version-2.0-two-hosts": (b"GET / HTTP/2.0\r\nHost: a\r\nHost: b\r\n\r\n", Failed(400, "malformed")),
    "nul-in-value": (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: \x00\r\n\r\n", Failed(400, "malformed")),
    "bare-lf-after-version": (b"GET / HTTP/1.10\nHost: a\r\n\r\n", Failed(400, "malformed")),
    "http10-keep-alive-and-close": (
        b"GET / HTTP/1.0\r\nConnection: keep-alive\r\nConnection: close\r\n\r\nGET / HTTP/1.0\r\n\r\n",
        "GET",
    ),
    "vertical-tab-in-value": (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: a\x0bb\r\n\r\n", Failed(400, "malformed")),
    "te-repeated-first-uppercase": (
        b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: CHUNKED\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        Failed(400, "malformed"),
    ),
    "obs-text-value": (b"GET / HTTP/1.1\r\nHost: a\r\nX-A: caf\xc3\xa9\r\n\r\n", "GET"),
}


@pytest.mark.parametrize("name", sorted(TRICKY_REQUEST_HEADS))
def test_fast_codec_agrees_on_tricky_heads(name: str) -> None:
    raw, expected = TRICKY_REQUEST_HEADS[name]
    reference = server_outcome(REFERENCE_CODEC, raw)
    first = reference[0][0]
    if isinstance(expected, Failed):
        assert first == expected
    else:
        assert isinstance(first, HttpRequest | ContinueExpected) and first.method == expected
    assert_same_server([raw], bytewise(raw))


def test_fast_codec_strips_and_normalises_like_h11() -> None:
    raw = b"POST / HTTP/1.1\r\nHost: a \t\r\nX-A: b  c\t \r\nTransfer-Encoding: CHUNKED\r\n\r\n0\r\n\r\n"
    request = one_request(CODEC, raw)
    assert request.headers == ((b"host", b"a"), (b"x-a", b"b  c"), (b"transfer-encoding", b"chunked"))
    assert request == one_request(REFERENCE_CODEC, raw)


#: Engine responses on which a fast parser could disagree with h11 (the
#: reference reads engine responses with h11, lenient where h11 is lenient).
TRICKY_RESPONSES: dict[str, bytes] = {
    "bare-lf-head": b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
    "mixed-line-ends": b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\nok",
    "obs-fold": b"HTTP/1.1 200 OK\r\nX-A: b\r\n c\r\nContent-Length: 2\r\n\r\nok",
    "obs-fold-first": b"HTTP/1.1 200 OK\r\n X-A: b\r\n\r\n",
    "no-reason": b"HTTP/1.1 200\r\nContent-Length: 2\r\n\r\nok",
    "empty-reason": b"HTTP/1.1 200 \r\nContent-Length: 2\r\n\r\nok",
    "control-in-reason": b"HTTP/1.1 200 O\x01K\r\nContent-Length: 2\r\n\r\nok",
    "http-2.0": b"HTTP/2.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "http-0.9": b"HTTP/0.9 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "status-999": b"HTTP/1.1 999 Odd\r\nContent-Length: 2\r\n\r\nok",
    "status-099": b"HTTP/1.1 099 Odd\r\n\r\n",
    "status-101": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\nConnection: upgrade\r\n\r\n",
    "control-in-value": b"HTTP/1.1 200 OK\r\nX-A: \x01\r\nContent-Length: 2\r\n\r\nok",
    "cl-repeated-same": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\nok",
    "cl-list-same": b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok",
    "cl-21-digits": b"HTTP/1.1 200 OK\r\nContent-Length: 000000000000000000002\r\n\r\nok",
    "te-uppercase": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: Chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "te-gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
    "te-twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "te-and-cl-on-204": b"HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n",
    "chunk-ext-anything": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2;\x00\r=\"\r\nok\r\n0\r\n\r\n",
    "chunk-size-ows": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2 \t\r\nok\r\n0\r\n\r\n",
    "chunk-size-20-digits": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"00000000000000000002\r\nok\r\n0\r\n\r\n"
    ),
    "chunk-size-21-digits": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"000000000000000000002\r\nok\r\n0\r\n\r\n"
    ),
    "chunk-line-bare-lf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\nok\r\n0\r\n\r\n",
    "chunk-data-bare-lf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\n0\r\n\r\n",
    "last-chunk-bare-lf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\n",
    "trailer-bare-lf": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-A: b\n\n",
    "trailer-obs-fold": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nX-A: b\r\n c\r\n\r\n",
    "trailer-bad-cl": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nContent-Length: x\r\n\r\n",
    "trailer-te-gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0\r\nTransfer-Encoding: gzip\r\n\r\n",
    "status-line-bare-lf": b"HTTP/1.1 200 OK\nContent-Length: 2\r\n\r\nok",
    "status-4-digits-bare-lf": b"HTTP/1.1 2000\nContent-Length: 2\r\n\r\nok",
    "nul-in-reason-bare-lf": b"HTTP/1.1 200 OK\x00\nContent-Length: 2\r\n\r\nok",
    "te-gzip-chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
    "leading-empty-line": b"\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "leading-space": b" HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
    "lone-cr-first": b"\r",
    "te-repeated-first-uppercase": (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: CHUNKED\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
    ),
    "cl-and-te": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "obs-text-value": b"HTTP/1.1 200 OK\r\nX-A: caf\xc3\xa9 \t\r\nContent-Length: 2\r\n\r\nok",
    "control-inside-value": b"HTTP/1.1 200 OK\r\nX-A: a\x01b\r\nContent-Length: 2\r\n\r\nok",
}


@pytest.mark.parametrize("name", sorted(TRICKY_RESPONSES))
@pytest.mark.parametrize("eof", [False, True])
def test_fast_engine_agrees_on_tricky_responses(name: str, eof: bool) -> None:
    raw = TRICKY_RESPONSES[name]
    for method in ("POST", "HEAD"):
        assert_same_engine([raw], bytewise(raw), method=method, eof=eof)


def test_fast_codec_remembers_lines_read_but_never_credentials() -> None:
    codec = Codec()
    known = codec.memory.field_lines
    raw = (
        b"POST / HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer sk-line-memo-secret\r\n"
        b"Cookie: session=s3cr3t\r\nX-A:  b \r\nContent-Length: 1\r\n\r\nx"
    )
    reference = one_request(REFERENCE_CODEC, raw)
    for _ in range(2):  # read, then read again from what was remembered
        assert one_request(codec, raw) == reference
    assert known[b"X-A:  b "] == (b"x-a", b"b")
    assert b"Host: a" in known and b"Content-Length: 1" in known
    assert not any(b"s3cr3t" in line or b"sk-line-memo-secret" in line for line in known)
    engine = codec.engine_connection()
    engine.send_request("GET", "/x", [(b"host", b"e")], b"")
    engine.receive_data(b"HTTP/1.1 200 OK\r\nSet-Cookie: id=x\r\nContent-Length: 0\r\n\r\n")
    head = engine.next_event()
    assert isinstance(head, ResponseHead) and head.headers == ((b"set-cookie", b"id=x"), (b"content-length", b"0"))
    assert b"HTTP/1.1 200 OK" in codec.memory.status_lines


def test_each_codec_has_its_own_memory() -> None:
    # No process-global state: what one codec (one router) read is not another's.
    first, second = Codec(), Codec()
    one_request(first, POST)
    assert b"Host: router" in first.memory.field_lines
    assert not second.memory.field_lines and not second.memory.request_lines
    # A connection made alone gets a memory of its own.
    alone = ServerConnection()
    alone.receive_data(GET)
    assert isinstance(alone.next_event(), HttpRequest)
    assert not second.memory.request_lines


def test_fast_codec_memory_of_lines_is_bounded() -> None:
    codec = Codec()
    known = codec.memory.field_lines
    limit = grammar.MAX_REMEMBERED_LINES
    long_value = b"v" * grammar.MAX_REMEMBERED_LINE_BYTES
    for i in range(limit + 50):
        raw = b"GET / HTTP/1.1\r\nHost: a\r\nX-Seq: %d\r\nX-Long: %s\r\n\r\n" % (i, long_value)
        assert one_request(codec, raw).headers[1] == (b"x-seq", b"%d" % i)
        assert 0 < len(known) <= limit
        assert not any(line.startswith(b"X-Long") for line in known)
    assert b"X-Seq: %d" % (limit + 49) in known
    engine = codec.engine_connection()
    for i in range(grammar.MAX_CHECKED_REQUEST_PARTS + 10):
        engine = codec.engine_connection()
        engine.send_request("POST", f"/v1/{i}", [(b"host", b"e"), (b"x-request-id", b"%d" % i)], b"{}")
    assert len(codec.memory.request_fields) == grammar.MAX_CHECKED_REQUEST_PARTS
    assert len(codec.memory.request_lines_out) == grammar.MAX_CHECKED_REQUEST_PARTS


@FUZZ
@given(allowed=st.binary(min_size=1, max_size=256), draw=st.data())
def test_only_tells_what_the_deletion_table_tells(allowed: bytes, draw: st.DataObject) -> None:
    """``only`` (one pass through a 256-byte table) agrees with ``translate(None, allowed)`` on every byte string."""
    inside = st.binary(max_size=40).map(lambda raw: bytes(allowed[b % len(allowed)] for b in raw))
    data = draw.draw(st.one_of(inside, st.binary(max_size=40), inside.map(lambda raw: raw + b"\x00")))
    assert grammar.only(data, grammar.keeping(allowed)) == (not data.translate(None, allowed))
    for table, named in ((grammar.TOKEN, grammar.TOKEN_BYTES), (grammar.FIELD_VALUE, grammar.FIELD_VALUE_BYTES)):
        assert grammar.only(data, table) == (not data.translate(None, named))


def test_the_codec_never_consults_h11(monkeypatch: pytest.MonkeyPatch) -> None:
    """h11 is the oracle only: neither the fast nor the general reading of the codec uses it."""

    def no_h11(*args: object, **kwargs: object) -> None:
        raise AssertionError("h11 consulted")

    monkeypatch.setattr(h11, "Connection", no_h11)
    server = CODEC.server_connection()
    server.receive_data(POST + b"GET /x HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert isinstance(server.next_event(), HttpRequest)
    server.send_response(200, [], b"{}")
    assert isinstance(server.next_event(), HttpRequest)
    server.send_response(200, [], b"{}")
    # Heads the fast reading leaves to the general one: a repeated length, a version to refuse.
    for odd, status in ((b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\nx", 400),
                        (b"GET / HTTP/1.2\r\nHost: a\r\n\r\n", 505)):
        conn = CODEC.server_connection()
        conn.receive_data(odd)
        with pytest.raises(RemoteProtocolError) as refused:
            conn.next_event()
        assert refused.value.status == status
    engine = CODEC.engine_connection()
    engine.send_request("POST", "/v1/completions", [(b"host", b"e")], b"{}")
    engine.receive_data(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
    assert [type(engine.next_event()) for _ in range(3)] == [ResponseHead, BodyData, ResponseEnd]
    engine = CODEC.engine_connection()
    engine.send_request("GET", "/health", [(b"host", b"e")], b"")
    engine.receive_data(b"HTTP/1.0 200 OK\nX-A: a\n b\nContent-Length: 2\nContent-Length: 2\n\nok")
    assert [type(engine.next_event()) for _ in range(3)] == [ResponseHead, BodyData, ResponseEnd]
    reference = ReferenceServerConnection()
    reference.receive_data(POST)
    with pytest.raises(AssertionError, match="h11 consulted"):
        reference.next_event()


def test_the_shipped_core_does_not_import_h11() -> None:
    code = "import sys, narwhal_core, narwhal_core.http; assert 'h11' not in sys.modules, 'h11 imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_control_requests_through_the_engine_connection() -> None:
    """A health probe or a KV-release POST: a small request, any response framing."""
    answers = {
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok": (200, b"ok", True),
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok": (200, b"ok", False),
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\n\r\nbusy": (503, b"busy", False),
        b"HTTP/1.0 200 OK\r\n\r\n{}": (200, b"{}", False),
        b"HTTP/1.1 204 No Content\r\n\r\n": (204, b"", True),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n": (200, b"{}", True),
    }
    for raw, (status, body, reusable) in answers.items():
        for method, payload in (("POST", b'{"remote_block_ids": [1]}'), ("GET", b"")):
            conn = EngineConnection(max_body_bytes=1024)
            request = conn.send_request(method, "/x", [(b"host", b"e:8000"), (b"content-type", b"application/json")],
                                        payload)
            assert request.endswith(b"\r\n\r\n" + payload)
            events = engine_events_for(conn, [raw, b""])
            assert isinstance(events[0], ResponseHead) and events[0].status == status
            assert b"".join(e.data for e in events if isinstance(e, BodyData)) == body
            # EOF came after the answer: a connection it ended is not reusable.
            assert events[-1] == ResponseEnd(reusable=False)
            conn = EngineConnection(max_body_bytes=1024)
            conn.send_request(method, "/x", [(b"host", b"e:8000")], payload)
            events = engine_events_for(conn, [raw])
            if not reusable and b"Content-Length" not in raw and b"chunked" not in raw and status != 204:
                assert events[-1] is NEED_DATA  # close-delimited: the end is the EOF
            else:
                assert events[-1] == ResponseEnd(reusable=reusable)


def engine_events_for(conn: EngineConnection, pieces: Sequence[bytes]) -> list[object]:
    """Every event after all of ``pieces`` arrived, up to NEED_DATA or the end."""
    for piece in pieces:
        conn.receive_data(piece)
    events: list[object] = []
    while not events or not (events[-1] is NEED_DATA or isinstance(events[-1], ResponseEnd)):
        events.append(conn.next_event())
    return events


# -- generated streams ------------------------------------------------------

REQUEST_LINES = [
    b"GET / HTTP/1.1", b"POST /v1/completions HTTP/1.1", b"PUT /x?y=1 HTTP/1.0", b"HEAD / HTTP/1.1",
    b"FOO / HTTP/1.1", b"get / HTTP/1.1", b"CONNECT a:443 HTTP/1.1", b"OPTIONS * HTTP/1.1", b"GET /{}|^ HTTP/1.1",
    b"GET / HTTP/1.2", b"GET / HTTP/2.0", b"GET / HTTP/0.9", b"GET / HTTP/1.", b"GET  / HTTP/1.1", b"GET /",
    b"GET /\x80 HTTP/1.1", b"G\x00T / HTTP/1.1",
]
#: Field lines that every parser reads alike, and ones that tell parsers apart.
PLAIN_REQUEST_FIELDS = [
    b"Content-Type: application/json", b"Accept: */*", b"X-Request-Id: r1", b"Authorization: Bearer k",
    b"Connection: keep-alive", b"Connection: close", b"Expect: 100-continue",
]
#: Odd, but the reference accepts them (mostly: a few depend on the framing).
ODD_VALID_REQUEST_FIELDS = [
    b"Content-Length:  0 ", b"Content-Length: 000", b"Content-Length: 00000000000000000000",
    b"Transfer-Encoding: Chunked ", b"Expect: foo, 100-Continue", b"Expect: 100-continue-x", b"Expect: 100-continue, x",
    b"Expect:", b"Connection: Upgrade", b"Connection: keep-alive, Close", b"Connection: closed", b"Connection: ,close,",
    b"Connection: CLOSE", b"Upgrade: h2c", b"X-A: b\x01c", b"X-A: \x7f", b"X-A: \x80\xff", b"X-A:", b"X-A:   ",
    b"X-A: a  b \t", b"X-A:\tb", b"x-a:b", b"X-A: " + b"v" * 200,
]
#: Refused by the reference.
ODD_INVALID_REQUEST_FIELDS = [
    b"Host: b", b"Host:", b"host:a \t", b"Content-Length: 2", b"Content-Length: 5, 5", b"Content-Length: 5,6",
    b"Content-Length: 000000000000000000005", b"Content-Length: 99999999999999999999", b"Content-Length: 600",
    b"Content-Length: +5", b"Content-Length:", b"Content-Length : 5", b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding: chunked, chunked", b"Transfer-Encoding: gzip", b"Transfer-Encoding:",
    b"X-A : b", b"X A: b", b": b", b"X-A", b"X-A: b\x00", b"X-A: \x0b", b"X-A: b\rc", b" X-A: b", b"\tc",
    b"X-\x80: b", b"X-A: " + b"v" * 300,
]
odd_request_fields = st.one_of(
    st.sampled_from(ODD_VALID_REQUEST_FIELDS), st.sampled_from(ODD_VALID_REQUEST_FIELDS),
    st.sampled_from(ODD_INVALID_REQUEST_FIELDS),
)
CHUNKED_BODIES = [
    b"", b"hello", b"0\r\n\r\n", b"5\r\nhello\r\n0\r\n\r\n", b"5;a=b\r\nhello\r\n0\r\n\r\n",
    b"5 \r\nhello\r\n0\r\n\r\n", b"5;a\x00\r\nhello\r\n0\r\n\r\n", b"0000000000000005\r\nhello\r\n0\r\n\r\n",
    b"00000000000000005\r\nhello\r\n0\r\n\r\n",
    b"5\nhello\r\n0\r\n\r\n", b"5\r\nhello\n0\r\n\r\n", b"0\r\n\n", b"0\r\nX: y\r\n\r\n", b"0\r\nX: y\n\r\n",
    b"0\r\n X: y\r\n\r\n", b"200\r\n" + b"x" * 512 + b"\r\n0\r\n\r\n", b"fffffffffffffff\r\n",
]


@st.composite
def odd_requests(draw: st.DrawFn) -> bytes:
    """A request with consistent framing and zero to two odd parts, so that most reach the field parsers."""
    line = draw(st.one_of(st.sampled_from(REQUEST_LINES[:9]), st.sampled_from(REQUEST_LINES)))
    fields = draw(st.lists(st.sampled_from(PLAIN_REQUEST_FIELDS), max_size=3))
    framing = draw(st.sampled_from(["none", "length", "chunked"]))
    body = b""
    if framing == "length":
        body = draw(st.binary(max_size=8))
        fields.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        fields.append(b"Transfer-Encoding: chunked")
        body = draw(st.sampled_from(CHUNKED_BODIES))
    if draw(st.integers(0, 9)):
        fields.insert(draw(st.integers(0, len(fields))), b"Host: a")
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        fields.insert(draw(st.integers(0, len(fields))), draw(odd_request_fields))
    lines = [line, *fields]
    if draw(st.integers(0, 19)) == 0:  # one odd line end somewhere
        eol = draw(st.sampled_from([b"\n", b"\r", b"\r\r\n"]))
        i = draw(st.integers(0, len(lines)))
        return b"\r\n".join(lines[:i]) + eol + b"\r\n".join(lines[i:]) + b"\r\n\r\n" + body
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


http_bytes = st.sampled_from(
    [b"\r\n", b"\n", b"\r", b" ", b"\t", b":", b";", b",", b"0", b"5", b"a", b"\x00", b"\x01", b"\x7f", b"\x80",
     b"\r\n\r\n", b"Host: a\r\n", b"Content-Length: 5\r\n", b"Transfer-Encoding: chunked\r\n", b"HTTP/1.1", b"GET / "]
)


@st.composite
def mutated(draw: st.DrawFn, raw: bytes) -> bytes:
    stream = bytearray(raw)
    for _ in range(draw(st.integers(0, 3))):
        pos = draw(st.integers(0, len(stream)))
        action = draw(st.sampled_from(["insert", "replace", "delete"]))
        if action == "insert" or pos == len(stream):
            stream[pos:pos] = draw(http_bytes)
        elif action == "replace":
            stream[pos] = draw(st.integers(0, 255))
        else:
            del stream[pos : pos + draw(st.integers(1, 4))]
    return bytes(stream)


def cut(data: st.DataObject, raw: bytes) -> list[bytes]:
    return split_at(raw, data.draw(st.lists(st.integers(0, len(raw)), max_size=8)))


DIFF = settings(max_examples=examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])


@DIFF
@given(st.lists(odd_requests(), min_size=1, max_size=3), st.booleans(), st.data())
def test_differential_odd_requests(requests: list[bytes], small: bool, data: st.DataObject) -> None:
    raw = b"".join(requests)
    limits: Limits = SMALL_LIMITS if small else {}
    assert_same_server(cut(data, raw), cut(data, raw), **limits)
    assert_same_server([raw], bytewise(raw), **limits)


@DIFF
@given(request_streams, st.booleans(), st.data())
def test_differential_mutated_request_streams(specs: list[RequestSpec], small: bool, data: st.DataObject) -> None:
    raw = data.draw(mutated(b"".join(serialize_request(s) for s in specs)))
    limits: Limits = SMALL_LIMITS if small else {}
    assert_same_server(cut(data, raw), cut(data, raw), **limits)


@DIFF
@given(st.lists(http_bytes, max_size=40).map(b"".join), st.data())
def test_differential_http_shaped_bytes_to_the_server(raw: bytes, data: st.DataObject) -> None:
    assert_same_server(cut(data, raw), bytewise(raw), **SMALL_LIMITS)


STATUS_LINES = [
    b"HTTP/1.1 200 OK", b"HTTP/1.1 200 OK", b"HTTP/1.0 200 OK", b"HTTP/1.1 200", b"HTTP/1.1 200 ", b"HTTP/2.0 200 OK",
    b"HTTP/1.1 404 Not Found", b"HTTP/1.1 999 X", b"HTTP/1.1 099 X", b"HTTP/1.1 101 Switching", b"HTTP/1.1 204 No",
    b"HTTP/1.1 304 NM", b"HTTP/1.1 2OO OK", b"HTTP/1.1 200 O\x01K", b"http/1.1 200 OK", b"HTTP/1.1  200 OK",
    b"HTTP/1.1 100 Continue", b"HTTP/1.1 103 Early Hints",
]
PLAIN_RESPONSE_FIELDS = [
    b"Content-Type: application/json", b"Server: uvicorn", b"Connection: close", b"Connection: keep-alive",
]
ODD_VALID_RESPONSE_FIELDS = [
    b"Content-Length: 5, 5", b"Content-Length:  005 ", b"Transfer-Encoding: CHUNKED", b"Connection: Upgrade",
    b"Connection: keep-alive, Close", b"Connection: closed", b"Connection: CLOSE", b"X-A: b\x01c", b"X-A: \x7f",
    b"X-A:", b"X-A: a  b \t", b" c", b"\tc", b"Upgrade: h2c", b"Host: a", b"Host: b", b"X-B: " + b"v" * 200,
]
ODD_INVALID_RESPONSE_FIELDS = [
    b"Content-Length: 5,6", b"Content-Length: 000000000000000000005", b"Content-Length: 99999999999999999999",
    b"Content-Length: 600", b"Content-Length: x", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked", b"X-A : b", b": b", b"X-A", b"X-A: \x00", b"X-B: " + b"v" * 300,
]
odd_response_fields = st.one_of(
    st.sampled_from(ODD_VALID_RESPONSE_FIELDS), st.sampled_from(ODD_VALID_RESPONSE_FIELDS),
    st.sampled_from(ODD_INVALID_RESPONSE_FIELDS),
)


@st.composite
def odd_responses(draw: st.DrawFn) -> bytes:
    """Interim heads, then a final head with consistent framing and zero to two odd parts."""

    def head(status_line: bytes, fields: list[bytes]) -> bytes:
        lines = [status_line, *fields]
        for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
            lines.insert(draw(st.integers(1, len(lines))), draw(odd_response_fields))
        eols = [draw(st.sampled_from([b"\r\n"] * 15 + [b"\n", b"\r"])) for _ in lines]
        return b"".join(line + eol for line, eol in zip(lines, eols, strict=True)) + b"\r\n"

    interim = [
        head(draw(st.sampled_from([b"HTTP/1.1 100 Continue", b"HTTP/1.1 103 Early Hints"])), [])
        for _ in range(draw(st.sampled_from([0, 0, 0, 1])))
    ]
    fields = draw(st.lists(st.sampled_from(PLAIN_RESPONSE_FIELDS), max_size=3))
    framing = draw(st.sampled_from(["close", "length", "chunked"]))
    if framing == "length":
        body = draw(st.binary(max_size=8))
        fields.append(b"Content-Length: %d" % len(body))
    elif framing == "chunked":
        fields.append(b"Transfer-Encoding: chunked")
        body = draw(st.sampled_from(CHUNKED_BODIES))
    else:
        body = draw(st.binary(max_size=8))
    final = head(draw(st.one_of(st.sampled_from(STATUS_LINES[:7]), st.sampled_from(STATUS_LINES))), fields)
    return b"".join(interim) + final + body


@DIFF
@given(odd_responses(), st.sampled_from(["POST", "HEAD"]), st.booleans(), st.booleans(), st.data())
def test_differential_odd_responses(raw: bytes, method: str, eof: bool, small: bool, data: st.DataObject) -> None:
    limits: dict[str, int | None] = {"max_header_bytes": 256, "max_body_bytes": 512} if small else {}
    assert_same_engine(cut(data, raw), bytewise(raw), method=method, eof=eof, **limits)


@DIFF
@given(response_specs(), st.sampled_from(["POST", "GET", "HEAD"]), st.booleans(), st.data())
def test_differential_mutated_responses(spec: ResponseSpec, method: str, eof: bool, data: st.DataObject) -> None:
    raw = data.draw(mutated(serialize_response(spec, [len(spec.body) // 3, len(spec.body) // 2])))
    limits = data.draw(
        st.sampled_from([{}, {"max_header_bytes": 256, "max_body_bytes": 200}, {"max_body_bytes": None}])
    )
    assert_same_engine(cut(data, raw), cut(data, raw), method=method, eof=eof, **limits)


@DIFF
@given(st.lists(http_bytes | st.sampled_from([b"HTTP/1.1 200 OK\r\n", b"0\r\n"]), max_size=40).map(b"".join), st.data())
def test_differential_http_shaped_bytes_to_the_engine(raw: bytes, data: st.DataObject) -> None:
    assert_same_engine(cut(data, raw), bytewise(raw), method="POST", eof=data.draw(st.booleans()), max_header_bytes=64)


def test_differential_body_limit_cuts_at_the_same_piece() -> None:
    # Four chunks in one read: the fast codec joins them, but must stop
    # before the chunk that crosses the limit, as the reference does.
    chunks = b"".join(b"%x\r\n%s\r\n" % (n, b"x" * n) for n in (10, 10, 10, 10)) + b"0\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks
    for limit in (0, 9, 10, 25, 30, 39, 40):
        reference = coalesce(engine_events(REFERENCE_CODEC, [raw], max_body_bytes=limit))
        assert coalesce(engine_events(CODEC, [raw], max_body_bytes=limit)) == reference


ONE_CHUNK_READS: dict[str, list[bytes]] = {
    # (A chunk-size line is remembered the first time: later reads of the
    # same size take the fast codec's one-whole-chunk path.)
    "same-size": [b"b\r\ndata: one\n\n\r\n"] * 4,
    "sizes": [b"5\r\nhello\r\n", b"A\r\n0123456789\r\n", b"5\r\nworld\r\n", b"a\r\n0123456789\r\n"],
    "extension": [b"5;x=1\r\nhello\r\n"] * 2,
    "no-crlf-after-data": [b"5\r\nhello\r\n", b"5\r\nhelloXY"],
    "lf-after-data": [b"5\r\nhello\r\n", b"5\r\nhello\n\n"],
    "short": [b"5\r\nhello\r\n", b"5\r\nhell\r\n"],
    "long": [b"5\r\nhello\r\n", b"5\r\nhello!\r\n"],
}


@pytest.mark.parametrize("name", sorted(ONE_CHUNK_READS))
@pytest.mark.parametrize("limit", [None, 12, 15])
def test_differential_one_whole_chunk_per_read(name: str, limit: int | None) -> None:
    # How an engine streams: each read holds one whole chunk. Both codecs
    # must give the same events, piece for piece, and fail on the same read.
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    pieces = [head, *ONE_CHUNK_READS[name], b"0\r\n\r\n"]
    reference = engine_events(REFERENCE_CODEC, pieces, eof=False, max_body_bytes=limit)
    assert engine_events(CODEC, pieces, eof=False, max_body_bytes=limit) == reference


def test_differential_size_limits_at_the_boundary() -> None:
    for size in range(250, 262):
        pad = b"x" * (size - len(b"HTTP/1.1 200 OK\r\nX: \r\nContent-Length: 2\r\n\r\n"))
        head = b"HTTP/1.1 200 OK\r\nX: " + pad + b"\r\nContent-Length: 2\r\n\r\n"
        assert len(head) == size
        for raw in (head + b"ok", b"HTTP/1.1 100 Continue\r\n\r\n" + head + b"ok"):
            assert_same_engine([raw], bytewise(raw), method="GET", eof=False, max_header_bytes=256)
        chunk_line = b"2;" + b"e" * (size - 4) + b"\r\n"
        raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk_line + b"ok\r\n0\r\n\r\n"
        assert_same_engine([raw], bytewise(raw), method="GET", eof=False, max_header_bytes=256)
    for size in range(60, 70):
        line = b"GET /" + b"a" * (size - len(b"GET / HTTP/1.1")) + b" HTTP/1.1"
        raw = line + b"\r\nHost: a\r\n\r\n"
        assert_same_server([raw], bytewise(raw), **SMALL_LIMITS)
    for size in range(250, 262):
        fields = b"Host: a\r\nX: " + b"x" * (size - len(b"Host: a\r\nX: \r\n\r\n")) + b"\r\n\r\n"
        assert_same_server([b"GET / HTTP/1.1\r\n" + fields], **SMALL_LIMITS)


@st.composite
def engine_requests(draw: st.DrawFn, *, odd: bool) -> tuple[str, str, list[tuple[bytes, bytes]], bytes]:
    """Engine requests: well-formed ones, or (``odd``) ones with parts the codecs must refuse alike."""
    names = [b"x-request-id", b"Connection", b"content-type", b"Authorization", b"Expect", b"X-Y"]
    values = [b"e:8100", b"close", b"keep-alive, Close", b"a b", b"closed", b"x,close", b"CLOSE", b"\x01\x80", b""]
    methods = ["GET", "POST", "HEAD", "PUT", "PATCH", "DELETE", "FOO"]
    targets = ["/", "/v1/completions", "*", "/{|}"]
    name = st.sampled_from(names)
    value = st.sampled_from(values)
    if odd:
        names = [b"Content-Length", b"transfer-encoding", b"Upgrade", b"x a", b"", b"x:", b"\x80", b"Host"]
        values = [b" a", b"a\t", b"\x00", b"\x7f", b"a\r\nb: c", b"\x0b"]
        name |= st.sampled_from(names) | st.binary(max_size=2)
        value |= st.sampled_from(values) | st.binary(max_size=2)
        methods += ["G T", "", "CONNECT", "é"]
        targets += ["/a b", "/é", "", "/\x7f"]
    headers = draw(st.lists(st.tuples(name, value), max_size=4))
    if not odd or draw(st.booleans()):
        headers.insert(draw(st.integers(0, len(headers))), (draw(st.sampled_from([b"host", b"HOST"])), b"e"))
    return draw(st.sampled_from(methods)), draw(st.sampled_from(targets)), headers, draw(st.binary(max_size=8))


@DIFF
@given(engine_requests(odd=False) | engine_requests(odd=True))
def test_differential_engine_request_bytes(request: tuple[str, str, list[tuple[bytes, bytes]], bytes]) -> None:
    method, target, headers, body = request
    outcomes = []
    for codec in (REFERENCE_CODEC, CODEC):
        conn = codec.engine_connection()
        try:
            outcomes.append(conn.send_request(method, target, headers, body))
        except LocalProtocolError:
            outcomes.append(None)
            # Nothing changed: a valid request can still be sent.
            conn.send_request("GET", "/", [(b"host", b"e")], b"")
    assert outcomes[0] == outcomes[1]
    if outcomes[0] is not None:
        # Same keep-alive decision: a response with nothing odd is reusable iff the request allows it.
        ends = [
            engine_events_after(codec, method, target, headers, body) for codec in (REFERENCE_CODEC, CODEC)
        ]
        assert ends[0] == ends[1]


def engine_events_after(
    codec: CodecLike, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes
) -> list[object]:
    conn = codec.engine_connection()
    conn.send_request(method, target, headers, body)
    conn.receive_data(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    return [conn.next_event() for _ in range(4)]


# Static check that the public event unions are what adapters dispatch on.
_SERVER_EVENT_TYPES: tuple[type, ...] = (HttpRequest, ContinueExpected, ConnectionClosed)
_ENGINE_EVENT_TYPES: tuple[type, ...] = (ResponseHead, BodyData, ResponseEnd)


def _narrowing_compiles(server: ServerEvent, engine: EngineEvent) -> None:  # pragma: no cover - for mypy
    if server is NEED_DATA or server is PAUSED:
        return
    assert isinstance(server, _SERVER_EVENT_TYPES)
    if engine is NEED_DATA:
        return
    assert isinstance(engine, _ENGINE_EVENT_TYPES)
