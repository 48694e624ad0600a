"""HTTP/1.1 behaviour: keep-alive, pipelining, chunked bodies, and robustness against bad clients."""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Iterator

import httpx
import pytest

from narwhal_sim.testing import SimThread

from .helpers import connect, exchange, http_request, is_closed, json_request, read_until_closed, reader


@pytest.fixture(scope="module")
def sim() -> Iterator[SimThread]:
    with SimThread("mixed", speed=0, keep_alive_s=0.5, read_timeout_s=0.5, max_body_bytes=10_000) as s:
        yield s


def alive(sim: SimThread) -> bool:
    return httpx.get(sim.url + "/health", timeout=5).status_code == 200


def test_keep_alive_with_bodies_and_streams(sim: SimThread) -> None:
    with connect(sim.port) as sock:
        rd = reader(sock)
        for i in range(3):
            sock.sendall(json_request("/v1/completions", {"prompt": f"p{i}", "max_tokens": 2}, {"X-Request-Id": f"k{i}"}))
            (answer,) = rd.read()
            assert answer.status == 200 and answer.headers["x-request-id"] == f"k{i}"
            assert int(answer.headers["content-length"]) == len(answer.body)
        sock.sendall(json_request("/v1/completions", {"prompt": "s", "max_tokens": 3, "stream": True}))
        (stream,) = rd.read()
        assert stream.headers["transfer-encoding"] == "chunked"
        assert stream.body.decode().endswith("data: [DONE]\n\n")
        sock.sendall(http_request("GET", "/health"))
        (health,) = rd.read()
        assert health.status == 200
    assert sim.stats()["connections"] <= 1


def test_pipelined_requests_answer_in_order(sim: SimThread) -> None:
    data = b"".join(
        json_request("/v1/completions", {"prompt": "x", "max_tokens": 1}, {"X-Request-Id": f"pipe-{i}"})
        for i in range(5)
    )
    answers = exchange(sim.port, data, count=5)
    assert [a.headers["x-request-id"] for a in answers] == [f"pipe-{i}" for i in range(5)]


def test_chunked_request_body(sim: SimThread) -> None:
    body = json.dumps({"prompt": "chunked", "max_tokens": 2}).encode()
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (5, body[:5], len(body) - 5, body[5:])
    (answer,) = exchange(sim.port, head + chunks)
    assert answer.status == 200 and json.loads(answer.body)["usage"]["completion_tokens"] == 2


def test_connection_close_and_http10(sim: SimThread) -> None:
    with connect(sim.port) as sock:
        sock.sendall(http_request("GET", "/health", headers={"Connection": "close"}))
        data = read_until_closed(sock)
        assert data.startswith(b"HTTP/1.1 200") and b"connection: close" in data
    with connect(sim.port) as sock:
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")
    with connect(sim.port) as sock:
        body = json.dumps({"prompt": "old", "max_tokens": 2, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        data = read_until_closed(sock)
        assert b"transfer-encoding" not in data and data.endswith(b"data: [DONE]\n\n")


def test_expect_100_continue(sim: SimThread) -> None:
    with connect(sim.port) as sock:
        body = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                     % len(body))  # fmt: skip
        sock.settimeout(5)
        assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(body)
        (answer,) = reader(sock).read()
        assert answer.status == 200


def test_garbage_gets_400_and_close(sim: SimThread) -> None:
    for junk in (b"\x00\x01\x02garbage\r\n\r\n", b"GET / HTTP/9.9\r\n\r\n", b"POST /x HTTP/1.1\r\nContent-Length: zz\r\n\r\n"):
        with connect(sim.port) as sock:
            sock.sendall(junk)
            data = read_until_closed(sock)
            assert data.startswith(b"HTTP/1.1 400"), data
    assert sim.stats()["bad_requests"] >= 3
    assert alive(sim)


def test_limits(sim: SimThread) -> None:
    big = json_request("/v1/completions", {"prompt": "x" * 20_000})
    with connect(sim.port) as sock:
        sock.sendall(big)
        assert read_until_closed(sock).startswith(b"HTTP/1.1 413")
    with connect(sim.port) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70_000 + b"\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 431")
    assert alive(sim)


def test_resets_do_not_stop_the_server(sim: SimThread) -> None:
    for payload in (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"pro", b"GET /hea"):
        sock = connect(sim.port)
        sock.sendall(payload)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # RST
    assert alive(sim)


def test_slowloris_is_cut_off_while_others_are_served(sim: SimThread) -> None:
    with connect(sim.port) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        started = time.monotonic()
        for _ in range(3):
            slow.sendall(b"X-Drip: 1\r\n")
            assert alive(sim)
        assert is_closed(slow, within=3.0)
        assert time.monotonic() - started < 3.0


def test_idle_keep_alive_connections_close(sim: SimThread) -> None:
    with connect(sim.port) as sock:
        sock.sendall(http_request("GET", "/health"))
        reader(sock).read()
        assert is_closed(sock, within=3.0)


def test_many_bad_connections_at_once(sim: SimThread) -> None:
    socks = [connect(sim.port) for _ in range(50)]
    for i, sock in enumerate(socks):
        sock.sendall(b"\xff" * (i + 1) if i % 2 else b"GET /health HTTP/1.1\r\nHost")
    for sock in socks[::3]:
        sock.close()
    assert alive(sim)
    for sock in socks:
        sock.close()
    assert alive(sim)


def test_client_leaving_mid_stream_frees_the_slot() -> None:
    with SimThread("mixed", speed=5) as sim:
        sock = connect(sim.port)
        sock.sendall(json_request("/v1/completions", {"prompt": "x", "max_tokens": 500, "stream": True}))
        sock.settimeout(5)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        assert sim.stats()["running"] == 1
        sock.close()
        stats = sim.wait_for(lambda s: s["running"] == 0)
        assert stats["client_gone"] == 1 and stats["free_blocks"] == stats["total_blocks"]
        assert sim.requests("/v1/completions")[0]["outcome"] == "client_gone"
