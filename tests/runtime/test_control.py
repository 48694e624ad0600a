"""A control request's bytes and its answer (narwhal_runtime/control.py), with the core's codec."""

from __future__ import annotations

import errno
import socket

import pytest

from narwhal_core import CONTROL_BODY_LIMIT, ControlDone, StartControl
from narwhal_core.config import parse_engine_url
from narwhal_core.events import EngineResolved
from narwhal_runtime.control import ControlExchange, ControlRefused

ENGINE = parse_engine_url("http://10.0.0.5:8100", key="engine.prefill")
SECRET = b"Bearer ek-0123456789abcdef"


def probe(**changes: object) -> StartControl:
    fields: dict[str, object] = dict(
        key="probe-1", engine=ENGINE, method="GET", target="/health",
        headers=((b"host", ENGINE.authority), (b"authorization", SECRET)), body=b"", timeout=2.0,
    )
    fields.update(changes)
    return StartControl(**fields)  # type: ignore[arg-type]


def release() -> StartControl:
    return probe(
        key="release-1", method="POST", target="/abort_request", body=b'{"rid":"x","request_id":"x"}',
        headers=((b"host", ENGINE.authority), (b"content-type", b"application/json"), (b"authorization", SECRET)),
    )


def answer(exchange: ControlExchange, *chunks: bytes) -> ControlDone | None:
    exchange.request()
    done = None
    for chunk in chunks:
        assert done is None, "answered before the last chunk"
        done = exchange.receive_data(chunk)
    return done


# ------------------------------------------------------------------ the request


def test_a_probe_is_a_get_with_its_headers_host_first_and_no_body() -> None:
    data = ControlExchange(probe()).request()
    assert data == (
        b"GET /health HTTP/1.1\r\nhost: 10.0.0.5:8100\r\nauthorization: " + SECRET + b"\r\n"
        b"accept-encoding: identity\r\nconnection: close\r\n\r\n"
    )


def test_a_release_carries_its_json_body_with_its_length() -> None:
    data = ControlExchange(release()).request()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"POST /abort_request HTTP/1.1\r\nhost: 10.0.0.5:8100\r\n")
    assert b"\r\ncontent-type: application/json\r\n" in head
    assert b"\r\nauthorization: " + SECRET + b"\r\n" in head
    assert head.endswith(b"\r\ncontent-length: 28")
    assert body == b'{"rid":"x","request_id":"x"}'


def test_decode_abort_writes_the_routers_raw_request_and_hangs_up() -> None:
    raw = b"POST /v1/completions HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n\r\n{}"
    exchange = ControlExchange(probe(drop_after_send=True, data=raw, headers=(), method="POST"))
    assert exchange.hang_up
    assert exchange.request() == raw
    assert exchange.sent() == ControlDone("probe-1", None)


def test_a_header_the_codec_refuses_is_named_without_its_value() -> None:
    bad = b"Bearer ek-secret\r\nx-injected: 1"
    exchange = ControlExchange(probe(headers=((b"host", ENGINE.authority), (b"authorization", bad))))
    with pytest.raises(ControlRefused) as caught:
        exchange.request()
    assert b"ek-secret".decode() not in str(caught.value)
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    done = exchange.failed(caught.value)
    assert done.status is None and done.error is not None and "ek-secret" not in done.error


def test_resolved_addresses_are_fed_each_once_in_order() -> None:
    infos = [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 8100)),
        (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("fd00::5", 8100, 0, 0)),
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.5", 8100)),
    ]
    assert ControlExchange(probe()).resolved(infos) == EngineResolved(ENGINE, ("10.0.0.5", "fd00::5"))


# ------------------------------------------------------------------ the answer


def test_an_answer_with_a_length_arrives_in_pieces() -> None:
    exchange = ControlExchange(release())
    done = answer(exchange, b"HTTP/1.1 200 OK\r\ncontent-", b"length: 18\r\n\r\n{\"released\":", b" true}")
    assert done == ControlDone("release-1", 200, None, False, b'{"released": true}')


def test_a_chunked_answer_and_an_informational_one_before_it() -> None:
    exchange = ControlExchange(probe())
    done = answer(
        exchange,
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        b"2\r\nok\r\n0\r\n\r\n",
    )
    assert done == ControlDone("probe-1", 200, None, False, b"ok")


def test_an_answer_without_length_ends_with_the_connection() -> None:
    exchange = ControlExchange(probe())
    assert answer(exchange, b"HTTP/1.1 503 Service Unavailable\r\n\r\nbusy", b"") == ControlDone(
        "probe-1", 503, None, False, b"busy"
    )


def test_an_answer_without_body_is_done_at_its_head() -> None:
    exchange = ControlExchange(probe())
    assert answer(exchange, b"HTTP/1.1 204 No Content\r\n\r\n") == ControlDone("probe-1", 204, None, False, b"")


def test_only_the_start_of_a_long_body_is_read() -> None:
    exchange = ControlExchange(probe())
    big = b"x" * (3 * CONTROL_BODY_LIMIT)
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(big)
    done = answer(exchange, head + big[:1000], big[1000:])
    assert done == ControlDone("probe-1", 200, None, False, big[:CONTROL_BODY_LIMIT])


def test_a_close_before_the_answer_is_complete_says_so() -> None:
    exchange = ControlExchange(probe())
    done = answer(exchange, b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", b"")
    assert done is not None and (done.status, done.local) == (None, False)
    assert done.error == "engine closed the connection before the response was complete"
    exchange = ControlExchange(probe())
    assert answer(exchange, b"") == done


def test_a_malformed_answer_says_so_briefly() -> None:
    exchange = ControlExchange(probe())
    done = answer(exchange, b"SSH-2.0-OpenSSH_9.6\r\n" + b"x" * 500 + b"\r\n\r\n")
    assert done is not None and done.status is None
    assert done.error is not None and done.error.startswith("malformed response") and len(done.error) <= 200


# ------------------------------------------------------------------ failures


def test_a_timeout_before_the_connection_opened_means_nothing_was_sent() -> None:
    exchange = ControlExchange(release())
    assert exchange.timed_out() == ControlDone("release-1", None, "connect timeout")
    exchange.connected()
    assert exchange.timed_out() == ControlDone("release-1", None, "timeout")


def test_socket_failures_are_described_and_local_shortages_flagged() -> None:
    exchange = ControlExchange(probe())
    refused = OSError("all attempts to connect to 10.0.0.5:8100 failed")
    refused.__cause__ = ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")
    assert exchange.failed(refused) == ControlDone("probe-1", None, "connection refused", False)
    dns = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    assert exchange.failed(dns) == ControlDone("probe-1", None, "DNS failure: Name or service not known", False)
    assert exchange.failed(ConnectionResetError(errno.ECONNRESET, "reset")).error == "connection reset"
    shortage = exchange.failed(OSError(errno.EMFILE, "Too many open files"))
    assert shortage == ControlDone("probe-1", None, "connection failed: Too many open files", True)


def test_a_cancelled_request_says_so() -> None:
    assert ControlExchange(probe()).cancelled() == ControlDone("probe-1", None, "cancelled")
