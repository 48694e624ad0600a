"""HTTP/1.1 at the ingress, over raw sockets (docs/contract.md, "Request rules", "Admission, capacity and retries").

Keep-alive and pipelining, ``Expect: 100-continue``, chunked request
bodies, 413 for a body over ``ingress.max_body_bytes`` and 431 for an
oversized head — each answer in the OpenAI envelope with ``x-request-id``,
and nothing sent to the engines for what is refused.
"""

from __future__ import annotations

import json

import pytest

from ..helpers import CHAT, COMPLETIONS, MODEL, RID_RE, completion_records, journal_terminal
from .support import RawClient, Response, chunked, request_bytes

JSON = ("content-type", "application/json")


def _completion(prompt: str = "hi", **fields: object) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": 3, **fields}).encode()


def _check_ok(response: Response, journal_path, *, terminal: str = "completed") -> str:
    assert response.status == 200, (response.status, response.body[:300])
    rid = response.header("x-request-id")
    assert rid and RID_RE.match(rid)
    assert journal_terminal(journal_path, rid)["terminal"] == terminal
    return rid


def _check_error(response: Response, status: int) -> dict:
    assert response.status == status, (response.status, response.body[:300])
    assert (response.header("content-type") or "").startswith("application/json")
    rid = response.header("x-request-id")
    assert rid and RID_RE.match(rid), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    return error


def test_keep_alive_serves_several_requests_on_one_connection(start_router, journal_path) -> None:
    router = start_router()
    rids = []
    with RawClient(router.address) as conn:
        for i in range(3):
            conn.send(request_bytes("POST", COMPLETIONS, _completion(f"keep alive {i}"), headers=[JSON]))
            response = conn.read_response()
            assert response.header("connection") != "close"
            rids.append(_check_ok(response, journal_path))
            assert response.json()["model"] == MODEL
        conn.send(request_bytes("POST", CHAT, json.dumps(
            {"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode(), headers=[JSON]))
        stream = conn.read_response()
        rids.append(_check_ok(stream, journal_path))
        assert stream.body.endswith(b"data: [DONE]\n\n")
        conn.send(request_bytes("POST", COMPLETIONS, b"{", headers=[JSON]))
        _check_error(conn.read_response(), 400)
        conn.send(request_bytes("GET", "/health"))
        assert conn.read_response().status == 200
        conn.send(request_bytes("POST", COMPLETIONS, _completion("after all that"), headers=[JSON]))
        rids.append(_check_ok(conn.read_response(), journal_path))
    assert len(set(rids)) == len(rids)


def test_pipelined_requests_are_answered_in_order(start_router, journal_path) -> None:
    router = start_router()
    with RawClient(router.address) as conn:
        conn.send(
            request_bytes("POST", COMPLETIONS, _completion("first"), headers=[JSON])
            + request_bytes("GET", "/nope")
            + request_bytes("POST", COMPLETIONS, _completion("third", stream=True), headers=[JSON])
        )
        first, second, third = conn.read_response(), conn.read_response(), conn.read_response()
    _check_ok(first, journal_path)
    assert first.json()["object"] == "text_completion"
    _check_error(second, 404)
    _check_ok(third, journal_path)
    assert third.body.endswith(b"data: [DONE]\n\n")


def test_expect_100_continue(start_router, journal_path) -> None:
    router = start_router()
    body = _completion("continue")
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, None, headers=[
            JSON, ("content-length", str(len(body))), ("expect", "100-continue")]))
        interim = conn.read_response()
        assert interim.status == 100
        conn.send(body)
        _check_ok(conn.read_response(), journal_path)
        # The connection stays usable.
        conn.send(request_bytes("POST", COMPLETIONS, _completion("again"), headers=[JSON]))
        _check_ok(conn.read_response(), journal_path)


@pytest.mark.parametrize("route", [COMPLETIONS, CHAT], ids=["completions", "chat"])
def test_chunked_request_body(start_router, fleet, journal_path, route) -> None:
    router = start_router()
    if route == COMPLETIONS:
        body = _completion("a chunked prompt")
    else:
        body = json.dumps({"messages": [{"role": "user", "content": "chunked"}], "max_tokens": 3}).encode()
    pieces = [body[:5], body[5:6], body[6:20], body[20:]]
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", route, chunked(*pieces), headers=[JSON, ("transfer-encoding", "chunked")]))
        response = conn.read_response()
        _check_ok(response, journal_path)
        # Then a Content-Length request on the same connection.
        conn.send(request_bytes("POST", route, body, headers=[JSON]))
        _check_ok(conn.read_response(), journal_path)
    sent = json.loads(body)
    for leg in completion_records(fleet.prefill)[:1] + completion_records(fleet.decode)[:1]:
        got = json.loads(leg["body"])
        assert {k: got[k] for k in sent if k != "max_tokens"} == {k: v for k, v in sent.items() if k != "max_tokens"}


def test_expect_100_continue_with_the_body_sent_at_once(start_router, journal_path) -> None:
    """A client may send the body without waiting for ``100 Continue`` (RFC 9110 §10.1.1)."""
    router = start_router()
    body = _completion("eager")
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, body, headers=[JSON, ("expect", "100-continue")]))
        response = conn.read_response()
        if response.status == 100:
            response = conn.read_response()
        _check_ok(response, journal_path)
        conn.send(request_bytes("POST", COMPLETIONS, _completion("next"), headers=[JSON]))
        _check_ok(conn.read_response(), journal_path)


def test_chunked_body_with_expect_100_continue(start_router, journal_path) -> None:
    router = start_router()
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, None, headers=[
            JSON, ("transfer-encoding", "chunked"), ("expect", "100-continue")]))
        assert conn.read_response().status == 100
        body = _completion("chunked continue")
        conn.send(chunked(body[:10], body[10:]))
        _check_ok(conn.read_response(), journal_path)


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_body_over_max_body_bytes_is_413(start_router, fleet, framing) -> None:
    router = start_router(ingress={"max_body_bytes": 1024})
    body = _completion("x" * 2000)
    assert len(body) > 1024
    with RawClient(router.address) as conn:
        if framing == "content-length":
            conn.send(request_bytes("POST", COMPLETIONS, body, headers=[JSON]))
        else:
            conn.send(request_bytes("POST", COMPLETIONS, chunked(body[:600], body[600:]),
                                    headers=[JSON, ("transfer-encoding", "chunked")]))
        _check_error(conn.read_response(), 413)
    router.wait_idle()
    assert completion_records(fleet) == []


def test_body_at_max_body_bytes_is_accepted(start_router, journal_path) -> None:
    router = start_router(ingress={"max_body_bytes": 1024})
    prefix = _completion("")
    body = _completion("y" * (1024 - len(prefix)))
    assert len(body) == 1024
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, body, headers=[JSON]))
        _check_ok(conn.read_response(), journal_path)


def test_body_over_the_limit_with_expect_is_413_without_100(start_router, fleet) -> None:
    router = start_router(ingress={"max_body_bytes": 1024})
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, None, headers=[
            JSON, ("content-length", "5000"), ("expect", "100-continue")]))
        _check_error(conn.read_response(), 413)
    assert completion_records(fleet) == []


def test_oversized_body_request_is_journaled(start_router, fleet, journal_path) -> None:
    """docs/contract.md, "The journal": every request to a completion route gets exactly one terminal record —
    a 413 one too."""
    router = start_router(ingress={"max_body_bytes": 1024})
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, _completion("z" * 2000), headers=[JSON]))
        response = conn.read_response()
    _check_error(response, 413)
    record = journal_terminal(journal_path, response.header("x-request-id"), timeout=2)
    assert record["status"] == 413 and record["route"] == COMPLETIONS
    # A refused HTTP request is the client's mistake (docs/operate.md, the terminal table): ``invalid``.
    assert record["terminal"] == "invalid", record
    assert record["error"]["code"] == "body_too_large" and record["error"]["leg"] is None, record


@pytest.mark.parametrize("shape", ["one-big-header", "many-headers", "long-request-line"])
def test_oversized_head_is_431(start_router, fleet, shape) -> None:
    router = start_router()
    target = COMPLETIONS
    headers = [JSON]
    if shape == "one-big-header":
        headers.append(("x-padding", "p" * 20000))
    elif shape == "many-headers":
        headers += [(f"x-pad-{i}", "v" * 10) for i in range(200)]
    else:
        target = COMPLETIONS + "?" + "q" * 10000
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", target, _completion(), headers=headers))
        response = conn.read_response()
        # docs/contract.md, "Admission, capacity and retries": header size -> 431; an over-long request line
        # -> 431 too (docs/operate.md: over ``ingress.max_request_line_bytes``).
        _check_error(response, 431)
        assert conn.peer_closed(), "the connection stays open after a 431"
    router.wait_idle()
    assert completion_records(fleet) == []


def test_head_at_a_normal_size_with_a_big_header_still_works(start_router, journal_path) -> None:
    router = start_router()
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, _completion(), headers=[JSON, ("x-padding", "p" * 8000)]))
        _check_ok(conn.read_response(), journal_path)


def test_connection_close_is_honoured(start_router, journal_path) -> None:
    router = start_router()
    with RawClient(router.address) as conn:
        conn.send(request_bytes("POST", COMPLETIONS, _completion(), headers=[JSON, ("connection", "close")]))
        _check_ok(conn.read_response(), journal_path)
        assert conn.peer_closed()


def test_an_error_answer_mid_upload_reaches_the_client(start_router, journal_path) -> None:
    """Lingering close: the client still uploading when Narwhal answers 413 reads the answer.

    Closing a socket with unread bytes resets the connection, and the client
    would lose the 413 it has not read yet; Narwhal shuts its side, drops
    what the client still sends for a while, then closes.
    """
    import socket

    router = start_router(ingress={"max_body_bytes": 1000})
    sock = socket.create_connection(router.address, timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: narwhal.test\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 400000\r\n\r\n")
        sock.sendall(b"x" * 400_000)  # the router answered 413 after the head; it keeps reading
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["code"] == "body_too_large"
