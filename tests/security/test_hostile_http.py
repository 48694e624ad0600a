"""Hostile HTTP/1.1 over real sockets: smuggling shapes, oversized parts, slow clients, resets.

Each shape gets the right 4xx in the OpenAI envelope (or a closed
connection) on its own connection, the bytes after it are never served as a
request (a "smuggled" completion request follows every smuggling shape and
must leave no trace at the engines or in the journal), other connections go
on as if nothing happened, and a normal request on a new connection is
served afterwards.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from narwhal_sim.testing import SimThread

from ..harness import Fleet
from ..helpers import (
    COMPLETIONS,
    assert_envelope,
    assert_journal_consistent,
    body_for,
    completion_records,
    journal_terminal,
    poll,
    read_journal,
)
from .support import Closed, RawClient, Response, assert_still_serves, json_post

#: A whole, valid completion request that must never be served when it follows a hostile one.
SMUGGLED = json_post(COMPLETIONS, body_for(COMPLETIONS, "smuggled", max_tokens=1), [("x-request-id", "smuggled")])
BODY = json.dumps(body_for(COMPLETIONS, max_tokens=1)).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"


def _chunked(body: bytes) -> bytes:
    return b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


def _post(*lines: bytes, body: bytes = b"", head: bytes = HEAD) -> bytes:
    return head + b"".join(line + b"\r\n" for line in lines) + b"\r\n" + body


def _cl(n: int | str) -> bytes:
    return b"content-length: %s" % str(n).encode()


TE = b"transfer-encoding: chunked"
N = len(BODY)

#: (id, bytes, status): request smuggling and framing ambiguity (RFC 9112 §6.3, §11.2).
SMUGGLING: list[tuple[str, bytes, int]] = [
    ("cl+te", _post(_cl(N), TE, body=_chunked(BODY)), 400),
    ("te+cl", _post(TE, _cl(N), body=_chunked(BODY)), 400),
    ("cl+te-zero-chunk", _post(_cl(5), TE, body=b"0\r\n\r\n"), 400),
    ("te-on-http10", _post(TE, body=_chunked(BODY), head=HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")), 400),
    ("te-space-before-colon", _post(b"transfer-encoding : chunked", body=_chunked(BODY)), 400),
    ("te-vertical-tab", _post(b"transfer-encoding: \x0bchunked", body=_chunked(BODY)), 400),
    ("te-list", _post(b"transfer-encoding: chunked, identity", body=_chunked(BODY)), 400),
    ("te-unknown", _post(b"transfer-encoding: xchunked", body=_chunked(BODY)), 400),
    ("te-twice", _post(TE, TE, body=_chunked(BODY)), 400),
    ("te-identity+cl", _post(_cl(N), b"transfer-encoding: identity", body=BODY), 400),
    ("cl-twice-same", _post(_cl(N), _cl(N), body=BODY), 400),
    ("cl-twice-conflicting", _post(_cl(N), _cl(N + 5), body=BODY + b"XXXXX"), 400),
    ("cl-list", _post(f"content-length: {N}, {N}".encode(), body=BODY), 400),
    ("cl-plus-sign", _post(_cl(f"+{N}"), body=BODY), 400),
    ("cl-negative", _post(_cl(-1), body=BODY), 400),
    ("cl-hex", _post(_cl(hex(N)), body=BODY), 400),
    ("cl-inner-space", _post(_cl(f"{N} 0"), body=BODY), 400),
    ("cl-empty", _post(b"content-length: ", body=BODY), 400),
    ("obs-fold", _post(_cl(N), b"x-folded: a", b" b", body=BODY), 400),
    ("obs-fold-tab", _post(_cl(N), b"x-folded: a", b"\tb", body=BODY), 400),
    ("obs-fold-cl", _post(b"content-length:", f" {N}".encode(), body=BODY), 400),
    ("obs-fold-te", _post(_cl(N), b"transfer-encoding:", b" chunked", body=BODY), 400),
    ("bare-lf-everywhere", _post(_cl(N), body=BODY).replace(b"\r\n", b"\n"), 400),
    ("bare-lf-one-line", HEAD + _cl(N) + b"\nx-a: b\r\n\r\n" + BODY, 400),
    ("bare-lf-before-cl", HEAD.replace(b"host: 127.0.0.1\r\n", b"host: 127.0.0.1\n") + _cl(N) + b"\r\n\r\n" + BODY, 400),
    ("bare-cr-in-value", _post(_cl(N), b"x-a: a\rb", body=BODY), 400),
    ("bare-cr-line-end", HEAD + b"x-a: a\r" + _cl(N) + b"\r\n\r\n" + BODY, 400),
    ("nul-in-value", _post(_cl(N), b"x-a: a\x00b", body=BODY), 400),
    ("space-in-name", _post(_cl(N), b"x a: b", body=BODY), 400),
    ("chunk-size-bare-lf", _post(TE, body=b"%x\n%s\r\n0\r\n\r\n" % (N, BODY)), 400),
    ("chunk-data-without-crlf", _post(TE, body=b"%x\r\n%sXX0\r\n\r\n" % (N, BODY)), 400),
    ("chunk-size-17-digits", _post(TE, body=b"1" + b"0" * 16 + b"\r\n" + BODY), 400),
    ("chunk-size-negative", _post(TE, body=b"-5\r\nhello\r\n0\r\n\r\n"), 400),
    ("chunk-size-0x", _post(TE, body=b"0x%x\r\n%s\r\n0\r\n\r\n" % (N, BODY)), 400),
    ("chunk-ext-bare-cr", _post(TE, body=b"%x;a=b\rc\r\n%s\r\n0\r\n\r\n" % (N, BODY)), 400),
    ("chunk-trailer-bare-lf", _post(TE, body=b"%x\r\n%s\r\n0\r\nx-t: y\n\r\n" % (N, BODY)), 400),
    ("chunk-trailer-fold", _post(TE, body=b"%x\r\n%s\r\n0\r\nx-t: y\r\n z\r\n\r\n" % (N, BODY)), 400),
    ("two-hosts", _post(b"host: elsewhere", _cl(N), body=BODY), 400),
    ("double-space-request-line", HEAD.replace(b"POST ", b"POST  ") + _cl(N) + b"\r\n\r\n" + BODY, 400),
    ("lowercase-version", HEAD.replace(b"HTTP/1.1", b"http/1.1") + _cl(N) + b"\r\n\r\n" + BODY, 400),
    ("leading-nul", b"\x00" + _post(_cl(N), body=BODY), 400),
    ("tls-client-hello", bytes.fromhex("160301020001000200fc0303") + b"\x00" * 40, 400),
    ("http2-preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505),
]


def _single_error(responses: list[Response], status: int) -> Response:
    assert len(responses) == 1, [(r.status, r.body[:80]) for r in responses]
    response = responses[0]
    assert_envelope(response, status, type="invalid_request_error")
    assert response.header("connection") == "close"
    assert response.header("x-request-id")
    return response


def _assert_nothing_smuggled(fleet: Fleet, journal_path: Any) -> None:
    assert not any(r.get("client_rid") == "smuggled" for r in read_journal(journal_path))
    for record in completion_records(fleet.all()):
        assert "smuggled" not in record["body"], record


def _bystander(router: Any) -> RawClient:
    """A keep-alive connection that is served before and after the hostile one."""
    client = RawClient(router.address)
    client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)))
    assert client.read_response().status == 200
    return client


def _still_fine(bystander: RawClient, router: Any, journal_path: Any) -> None:
    bystander.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)))
    assert bystander.read_response().status == 200
    bystander.close()
    assert_still_serves(router.address, journal_path)
    router.wait_idle()
    assert_journal_consistent(journal_path)


@pytest.mark.parametrize(("data", "status"), [(d, s) for _, d, s in SMUGGLING], ids=[i for i, _, _ in SMUGGLING])
def test_smuggling_shape_is_refused_and_what_follows_is_never_served(
    start_router, fleet, journal_path, data, status
) -> None:
    router = start_router()
    bystander = _bystander(router)
    with RawClient(router.address) as client:
        client.send(data + SMUGGLED)
        responses = client.read_all(timeout=5)
    response = _single_error(responses, status)
    if status == 400:
        assert response.json()["error"]["code"] == "bad_http_request"
    router.wait_idle()
    _assert_nothing_smuggled(fleet, journal_path)
    _still_fine(bystander, router, journal_path)


# ------------------------------------------------------------- sizes


LIMITS = {"max_body_bytes": 65536}

#: (id, bytes, status, code): every limit with its own status (docs/contract.md, "Admission, capacity and retries").
OVERSIZED: list[tuple[str, bytes, int, str]] = [
    ("request-line", b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nhost: x\r\n\r\n", 431, "headers_too_large"),
    ("request-line-unterminated", b"GET /" + b"a" * 20000, 431, "headers_too_large"),
    ("header-section", _post(b"x-big: " + b"b" * 17000, _cl(N), body=BODY), 431, "headers_too_large"),
    ("header-section-unterminated", HEAD + b"x-big: " + b"b" * 40000, 431, "headers_too_large"),
    ("too-many-headers", _post(*[b"x-h%d: v" % i for i in range(101)], _cl(N), body=BODY), 431, "headers_too_large"),
    ("body-content-length", _post(_cl(65537)), 413, "body_too_large"),
    ("body-content-length-huge", _post(_cl(10**15)), 413, "body_too_large"),
    ("body-chunk-size", _post(TE, body=b"10001\r\n"), 413, "body_too_large"),
    ("body-chunks-add-up", _post(TE, body=(b"8000\r\n" + b"x" * 0x8000 + b"\r\n") * 2 + b"1\r\n"), 413,
     "body_too_large"),
    ("body-expect-continue", _post(_cl(65537), b"expect: 100-continue"), 413, "body_too_large"),
    ("trailer-section", _post(TE, body=b"0\r\n" + b"x-t: " + b"t" * 17000 + b"\r\n\r\n"), 431, "headers_too_large"),
]


@pytest.mark.parametrize(
    ("data", "status", "code"), [(d, s, c) for _, d, s, c in OVERSIZED], ids=[i for i, *_ in OVERSIZED]
)
def test_oversized_parts_get_their_status_before_the_rest_is_read(
    start_router, fleet, journal_path, data, status, code
) -> None:
    router = start_router(ingress=LIMITS)
    bystander = _bystander(router)
    with RawClient(router.address) as client:
        # No body follows a head over the limit: the answer must not wait for it.
        client.send(data)
        started = time.monotonic()
        responses = client.read_all(timeout=5)
    assert time.monotonic() - started < 2.0
    response = _single_error(responses, status)
    assert response.json()["error"]["code"] == code
    router.wait_idle()
    assert len(completion_records(fleet.all())) == 2  # the bystander's two legs, nothing else
    _still_fine(bystander, router, journal_path)


def test_body_at_the_limit_is_accepted(start_router, fleet, journal_path) -> None:
    router = start_router(ingress=LIMITS)
    padding = 65536 - len(json.dumps({**body_for(COMPLETIONS, max_tokens=1), "pad": ""}).encode())
    body = json.dumps({**body_for(COMPLETIONS, max_tokens=1), "pad": "p" * padding}).encode()
    assert len(body) == 65536
    with RawClient(router.address) as client:
        client.send(json_post(COMPLETIONS, body))
        assert client.read_response().status == 200


def _codecs() -> dict[str, Any]:
    from narwhal_core.http import Codec

    from tests.core.http_reference import REFERENCE_CODEC

    return {"h11": REFERENCE_CODEC, "fast": Codec()}


@pytest.mark.parametrize("codec", list(_codecs()))
def test_every_codec_refuses_every_shape_the_same_way(codec: str) -> None:
    """The same shapes in the core, against every client-facing codec, whole and byte by byte."""
    from narwhal_core.errors import RemoteProtocolError
    from narwhal_core.http import NEED_DATA, HttpRequest

    def outcome(pieces: list[bytes]) -> tuple[list[str], int | None]:
        conn = _codecs()[codec].server_connection(**{**LIMITS})
        targets: list[str] = []
        for piece in [*pieces, b""]:
            conn.receive_data(piece)
            while True:
                try:
                    event = conn.next_event()
                except RemoteProtocolError as exc:
                    return targets, exc.status
                if isinstance(event, HttpRequest):
                    targets.append(event.target)
                    conn.send_response(200, [], b"")
                    continue
                if event is not NEED_DATA:
                    return targets, None
                break
        return targets, None

    for name, data, status in [*SMUGGLING, *((i, d, s) for i, d, s, _ in OVERSIZED)]:
        whole = outcome([data + SMUGGLED])
        assert whole == ([], status), (name, whole)
        assert outcome([bytes([b]) for b in data + SMUGGLED]) == whole, name


# ------------------------------------------------------------ slow clients


SLOW = {"header_timeout_s": 0.5, "body_timeout_s": 0.5}


def _trickle(client: RawClient, data: bytes, interval: float, stop_after: float) -> tuple[float, bytes]:
    """Send ``data`` one byte at a time; return (seconds until the router cut us off, what it sent)."""
    started = time.monotonic()
    client.sock.settimeout(interval)
    received = b""
    for byte in data:
        if not client.send(bytes([byte])):
            break
        try:
            chunk = client.sock.recv(65536)
        except (TimeoutError, OSError) as exc:
            if isinstance(exc, ConnectionResetError):
                break
            chunk = None
        if chunk is not None:
            received += chunk
            if not chunk:
                break
            try:
                received += client.wait_closed(2.0)
            except TimeoutError:
                pass
            break
        if time.monotonic() - started > stop_after:
            raise AssertionError(f"a client trickling one byte per {interval} s was not cut off in {stop_after} s")
    return time.monotonic() - started, received


def _served_meanwhile(router: Any, stop: threading.Event, results: list[int]) -> threading.Thread:
    def run() -> None:
        while not stop.is_set():
            with RawClient(router.address) as client:
                client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)))
                results.append(client.read_response().status)
            time.sleep(0.02)

    thread = threading.Thread(target=run, name="meanwhile", daemon=True)
    thread.start()
    return thread


def _assert_timed_out(received: bytes) -> None:
    # 408 in the envelope, or (if the router closed first) nothing at all.
    if received:
        assert received.startswith(b"HTTP/1.1 408 "), received[:200]
        assert b'"code":"request_timeout"' in received and b"connection: close" in received


@pytest.mark.parametrize("interval", [1.0, 0.25], ids=["1-byte-per-s", "4-bytes-per-s"])
@pytest.mark.parametrize("part", ["head", "body"])
def test_slowloris_is_cut_off_while_other_clients_are_served(
    start_router, fleet, journal_path, part, interval
) -> None:
    router = start_router(ingress=SLOW)
    stop, results = threading.Event(), []
    others = _served_meanwhile(router, stop, results)
    try:
        with RawClient(router.address) as slow:
            if part == "head":
                elapsed, received = _trickle(slow, _post(_cl(N), body=BODY), interval=interval, stop_after=4.5)
            else:
                slow.send(_post(_cl(N)))
                elapsed, received = _trickle(slow, BODY, interval=interval, stop_after=4.5)
    finally:
        stop.set()
        others.join(10)
    # header_timeout_s + body_timeout_s (1 s) at most, plus slack for a busy machine.
    assert elapsed < 3.0, elapsed
    _assert_timed_out(received)
    assert len(results) >= 3 and set(results) == {200}, results
    assert_still_serves(router.address, journal_path)
    assert_journal_consistent(journal_path)


def test_slow_head_is_cut_off_by_the_header_timeout(start_router, fleet, journal_path) -> None:
    """``ingress.header_timeout_s`` is the time for the whole head, whatever ``body_timeout_s`` says."""
    router = start_router(ingress={"header_timeout_s": 0.5, "body_timeout_s": 3.0})
    with RawClient(router.address) as slow:
        elapsed, received = _trickle(slow, _post(_cl(N), body=BODY), interval=0.25, stop_after=5.0)
    _assert_timed_out(received)
    # 0.5 s and slack for a busy machine; header_timeout_s + body_timeout_s would be 3.5 s.
    assert elapsed < 2.0, f"a slow head was cut off after {elapsed:.2f} s, header_timeout_s is 0.5 s"
    assert_still_serves(router.address, journal_path)


def test_slowloris_on_a_kept_alive_connection_is_cut_off(start_router, journal_path) -> None:
    """The next request on a kept-alive connection gets the header/body timeouts, not the idle one."""
    with SimThread(role="prefill", speed=0) as prefill, SimThread(
        role="decode", speed=0, faults={"delay_s": 1.2}
    ) as decode:
        router = start_router(
            fleet_=Fleet(prefill=[prefill], decode=[decode]), ingress={**SLOW, "keepalive_timeout_s": 30.0}
        )
        with RawClient(router.address) as client:
            # A first request that outlives header_timeout_s + body_timeout_s...
            client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)))
            assert client.read_response().status == 200
            # ...then the next one, one byte at a time.
            elapsed, received = _trickle(client, _post(_cl(N), body=BODY), interval=0.25, stop_after=4.5)
        _assert_timed_out(received)
        assert elapsed < 3.0, elapsed
        assert_still_serves(router.address, journal_path)


def test_idle_connection_without_a_byte_is_closed(start_router, journal_path) -> None:
    router = start_router(ingress=SLOW)
    with RawClient(router.address) as idle:
        started = time.monotonic()
        received = idle.wait_closed(4.5)
    assert time.monotonic() - started < 3.0
    _assert_timed_out(received)
    assert_still_serves(router.address, journal_path)


# ----------------------------------------------------------- pipelining


def test_pipelined_garbage_after_a_valid_request(start_router, fleet, journal_path) -> None:
    router = start_router()
    refused = []
    for garbage in (b"GARBAGE GARBAGE\r\n\r\n", bytes.fromhex("160301020001"), _post(_cl(2), _cl(3), body=b"{}")):
        with RawClient(router.address) as client:
            client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)) + garbage + SMUGGLED)
            responses = client.read_all(timeout=5)
        assert [r.status for r in responses] == [200, 400], [(r.status, r.body[:80]) for r in responses]
        assert responses[0].json()["object"] == "text_completion"
        assert_envelope(responses[1], 400, type="invalid_request_error", code="bad_http_request")
        journal_terminal(journal_path, responses[0].header("x-request-id"))
        refused.append(responses[1].header("x-request-id"))
    router.wait_idle()
    _assert_nothing_smuggled(fleet, journal_path)
    terminals = assert_journal_consistent(journal_path)
    # The valid requests, and the malformed one whose request line named a
    # completion route (an answer there that names a rid has its record).
    assert len(terminals) == 4
    assert (terminals[refused[2]]["terminal"], terminals[refused[2]]["status"]) == ("invalid", 400)
    assert refused[0] not in terminals and refused[1] not in terminals
    assert_still_serves(router.address, journal_path)


def test_pipelined_valid_requests_are_answered_in_order(start_router, journal_path) -> None:
    router = start_router()
    requests = [json_post(COMPLETIONS, body_for(COMPLETIONS, f"prompt {i}", max_tokens=1)) for i in range(3)]
    with RawClient(router.address) as client:
        client.send(b"".join(requests) + b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        statuses = [client.read_response().status for _ in range(4)]
        assert statuses == [200, 200, 200, 200]
        client.send(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        assert [r.status for r in client.read_all(timeout=5)] == [200]
    assert len(assert_journal_consistent(journal_path)) == 3


def test_half_a_request_then_eof_after_a_valid_one(start_router, journal_path) -> None:
    router = start_router()
    with RawClient(router.address) as client:
        client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)) + _post(_cl(N), body=BODY[:5]))
        assert client.read_response().status == 200
        client.sock.shutdown(1)  # SHUT_WR: the rest of the second request never comes
        assert client.read_all(timeout=5) == []
    # A half-close while a request runs counts as the client leaving (docs/contract.md, "Admission, capacity
    # and retries"): one terminal record.
    with RawClient(router.address) as client:
        client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)))
        client.sock.shutdown(1)
        assert [r.status for r in client.read_all(timeout=5)] in ([], [200])
    router.wait_idle()
    terminals = assert_journal_consistent(journal_path)
    assert len(terminals) == 2
    assert {r["terminal"] for r in terminals.values()} <= {"completed", "cancelled"}
    assert_still_serves(router.address, journal_path)


# ---------------------------------------------------------------- resets


@pytest.mark.parametrize("where", ["head", "body", "in-flight"])
def test_reset_mid_request_affects_no_other_connection(start_router, journal_path, where) -> None:
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=0) as decode:
        router = start_router(fleet_=Fleet(prefill=[prefill], decode=[decode]))
        bystander = _bystander(router)
        request = json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1))
        with RawClient(router.address) as client:
            if where == "head":
                client.send(request[:20])
            elif where == "body":
                client.send(request[:-5])
            else:
                # The decode engine answers this one after 0.4 s: the reset comes while its leg runs.
                decode.set_faults(delay_s=0.4)
                client.send(request)
                poll_for = time.monotonic() + 5
                while not completion_records([decode]) and time.monotonic() < poll_for:
                    time.sleep(0.01)
                assert completion_records([decode]), "the decode leg never started"
            time.sleep(0.05)
            client.reset()
        router.wait_idle()
        decode.set_faults()  # the bystander's requests are answered at once
        terminals = assert_journal_consistent(journal_path)
        if where == "in-flight":
            cancelled = [r for r in terminals.values() if r["terminal"] == "cancelled"]
            assert len(cancelled) == 1, terminals
            assert cancelled[0]["status"] == 499
            kv = cancelled[0]["legs"][0]["kv"]
            assert kv is not None and kv["outcome"] in ("pulled", "released"), cancelled[0]
        else:
            assert all(r["terminal"] == "completed" for r in terminals.values())
        _still_fine(bystander, router, journal_path)


def test_reset_mid_stream_affects_no_other_connection(start_router, journal_path) -> None:
    with SimThread(role="prefill", speed=0) as prefill, SimThread(role="decode", speed=1.0) as decode:
        router = start_router(fleet_=Fleet(prefill=[prefill], decode=[decode]))
        bystander = _bystander(router)
        with RawClient(router.address) as client:
            client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=400, stream=True)))
            client._take_until(b"\r\n\r\n")  # the stream's head
            client._take_until(b"data: ")  # its first event
            client.reset()
        # The bystander is served while the stream is being torn down.
        bystander.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1)))
        assert bystander.read_response().status == 200
        router.wait_idle()
        terminals = assert_journal_consistent(journal_path)
        streams = [r for r in terminals.values() if r["stream"]]
        assert len(streams) == 1 and streams[0]["terminal"] == "cancelled", streams
        assert streams[0]["status"] == 499 and streams[0]["legs"][0]["kv"]["outcome"] == "pulled"
        _still_fine(bystander, router, journal_path)


def test_many_resets_at_once_leave_the_router_idle(start_router, journal_path) -> None:
    router = start_router()
    request = json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=1))
    for i in range(30):
        client = RawClient(router.address)
        client.send(request[: (i * 37) % len(request)])
        client.reset()
    router.wait_idle()
    poll(lambda: router.statistics().connections == 0, timeout=5, what="every reset connection forgotten")
    assert_still_serves(router.address, journal_path)
    assert read_journal(journal_path) and len(assert_journal_consistent(journal_path)) == 1


def test_connection_flood_is_bounded_and_cleared_by_the_timeouts(start_router, journal_path) -> None:
    """Idle sockets beyond ``ingress.max_connections`` never become router connections; the
    header timeout frees the slots, and a normal client is served again soon after.

    (While the flood holds every slot a new client may wait in the listen backlog -- trio --
    or be refused at once -- asyncio resets connections beyond twice the limit; both are bounded.)
    """
    router = start_router(ingress={**SLOW, "max_connections": 8})
    flood = [RawClient(router.address) for _ in range(24)]
    try:
        time.sleep(0.2)
        assert router.statistics().connections <= 8
        started = time.monotonic()

        def served() -> bool:
            try:
                assert_still_serves(router.address, journal_path)
            except (Closed, ConnectionError, OSError):
                return False
            return True

        poll(served, timeout=9.0, interval=0.1, what="a normal request served during the flood")
        # Each wave of 8 idle sockets holds its slots for header_timeout_s + body_timeout_s at most.
        assert time.monotonic() - started < 9.0
        assert router.statistics().connections <= 8
    finally:
        for client in flood:
            client.close()
    poll(lambda: router.statistics().connections == 0, timeout=5, what="the flood forgotten")


def test_a_client_that_never_reads_cannot_keep_its_connection(start_router, journal_path, monkeypatch) -> None:
    """Pipelined requests whose answers are never read fill the socket buffers; the connection must
    still end within its timeouts and free its slot (here the only one) for the next client."""
    import socket

    # ingress.send_timeout_s (30 s by default): how long a client may leave our bytes unread.
    router = start_router(ingress={**SLOW, "keepalive_timeout_s": 1.0, "max_connections": 1, "send_timeout_s": 1.0})
    reader = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect(router.address)
    reader.settimeout(0.2)
    burst = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" * 1000
    started = time.monotonic()
    try:
        while time.monotonic() - started < 2.0:
            try:
                reader.send(burst)
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                break  # the router already dropped us: fine

        def served() -> bool:
            try:
                assert_still_serves(router.address, journal_path, timeout=1.0)
            except (Closed, OSError, TimeoutError):
                return False
            return True

        poll(served, timeout=10.0, interval=0.1, what="the next client served after the non-reader's timeouts")
    finally:
        reader.close()
