"""Micro-benchmark of the HTTP/1.1 codec (``narwhal_core.http``) beside its h11 oracle.

Pure CPU, no sockets. Each scenario is what the router does once per request
(``docs/design.md``: one client exchange and two engine exchanges per PD
request):

* ``server cycle (keep-alive)``  a 1 KB JSON ``POST /v1/completions`` arrives
  in one read on an open connection; the router gets the ``HttpRequest`` and
  answers ``200`` with a 1 KB JSON body; the connection is ready again
* ``server cycle (new conn)``    the same on a new connection object
* ``engine exchange``            ``send_request`` of a 1 KB JSON POST leg, then
  a uvicorn-style ``200`` with a 1 KB JSON body arrives in one read and is
  parsed to ``ResponseEnd``
* ``engine stream, per event``   a decode leg streamed as 64 SSE events, one
  chunk per read (the usual shape), per event
* ``engine stream, 64 in 1 read`` the same 64 chunks arriving in one read, per event

Usage::

    python benchmarks/codec_bench.py [--seconds 0.5]

Prints CPU µs per operation (``time.thread_time``, so other load on the
host does not count) for the oracle (``tests/core/http_reference.py``: h11
with the codec's strictness on top) and the codec, and the ratio (oracle /
codec). The codec runs compiled where the install compiled it;
``NARWHAL_PURE_PYTHON=1`` picks its sources.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from narwhal_core.http import NEED_DATA, Codec, CodecLike, HttpRequest, ResponseEnd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the oracle lives with the tests
from tests.core.http_reference import REFERENCE_CODEC  # noqa: E402

PROMPT = "x" * 990
REQUEST_BODY = json.dumps({"model": "m", "prompt": PROMPT}).encode()
REQUEST = (
    b"POST /v1/completions HTTP/1.1\r\n"
    b"Host: router:8000\r\n"
    b"User-Agent: OpenAI/Python 1.40.0\r\n"
    b"Accept: application/json\r\n"
    b"Content-Type: application/json\r\n"
    b"Authorization: Bearer sk-abc\r\n"
    b"Content-Length: %d\r\n\r\n" % len(REQUEST_BODY)
) + REQUEST_BODY
RESPONSE_BODY = json.dumps({"id": "cmpl-1", "choices": [{"text": "y" * 950}]}).encode()
RESPONSE_HEADERS = ((b"content-type", b"application/json"), (b"x-request-id", b"r-0123456789abcdef"))
LEG_HEADERS = (
    (b"host", b"10.0.0.7:8100"),
    (b"content-type", b"application/json"),
    (b"x-request-id", b"r-0123456789abcdef-p1"),
    (b"authorization", b"Bearer engine-key"),
)
ENGINE_RESPONSE = (
    b"HTTP/1.1 200 OK\r\n"
    b"date: Mon, 01 Jan 2024 00:00:00 GMT\r\n"
    b"server: uvicorn\r\n"
    b"content-length: %d\r\n"
    b"content-type: application/json\r\n\r\n" % len(RESPONSE_BODY)
) + RESPONSE_BODY
STREAM_EVENTS = 64
SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\n"
    b"content-type: text/event-stream; charset=utf-8\r\ntransfer-encoding: chunked\r\n\r\n"
)
SSE_CHUNKS = [
    b"%x\r\n%s\r\n" % (len(event), event)
    for event in (
        b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"tok%d"}]}\n\n' % i for i in range(STREAM_EVENTS)
    )
] + [b"0\r\n\r\n"]


def server_cycle_keep_alive(codec: CodecLike) -> Callable[[], None]:
    conn = codec.server_connection()

    def cycle() -> None:
        conn.receive_data(REQUEST)
        request = conn.next_event()
        assert type(request) is HttpRequest
        conn.send_response(200, RESPONSE_HEADERS, RESPONSE_BODY)
        assert conn.next_event() is NEED_DATA

    return cycle


def server_cycle_new_connection(codec: CodecLike) -> Callable[[], None]:
    def cycle() -> None:
        conn = codec.server_connection()
        conn.receive_data(REQUEST)
        request = conn.next_event()
        assert type(request) is HttpRequest
        conn.send_response(200, RESPONSE_HEADERS, RESPONSE_BODY)

    return cycle


def engine_exchange(codec: CodecLike) -> Callable[[], None]:
    def exchange() -> None:
        conn = codec.engine_connection()
        conn.send_request("POST", "/v1/completions", LEG_HEADERS, REQUEST_BODY)
        conn.receive_data(ENGINE_RESPONSE)
        while type(conn.next_event()) is not ResponseEnd:
            pass

    return exchange


def engine_stream(codec: CodecLike, *, one_read: bool) -> Callable[[], None]:
    reads = [SSE_HEAD + b"".join(SSE_CHUNKS)] if one_read else [SSE_HEAD, *SSE_CHUNKS]

    def stream() -> None:
        conn = codec.engine_connection(max_body_bytes=None)
        conn.send_request("POST", "/v1/completions", LEG_HEADERS, REQUEST_BODY)
        for data in reads:
            conn.receive_data(data)
            while True:
                event = conn.next_event()
                if event is NEED_DATA or type(event) is ResponseEnd:
                    break

    return stream


def measure(run: Callable[[], None], seconds: float) -> float:
    """CPU µs per call: the best of a few rounds of this thread's CPU time (other load on the host does not count)."""
    for _ in range(200):
        run()
    best = float("inf")
    rounds = 5
    for _ in range(rounds):
        calls = 0
        start = time.thread_time()
        deadline = start + seconds / rounds
        now = start
        while now < deadline:
            for _ in range(100):
                run()
            calls += 100
            now = time.thread_time()
        best = min(best, (now - start) / calls * 1e6)
    return best


SCENARIOS: list[tuple[str, Callable[[CodecLike], Callable[[], None]], int]] = [
    ("server cycle (keep-alive)", server_cycle_keep_alive, 1),
    ("server cycle (new conn)", server_cycle_new_connection, 1),
    ("engine exchange", engine_exchange, 1),
    ("engine stream, per event", lambda codec: engine_stream(codec, one_read=False), STREAM_EVENTS),
    ("engine stream, 64 in 1 read", lambda codec: engine_stream(codec, one_read=True), STREAM_EVENTS),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="time per scenario and codec")
    args = parser.parse_args()
    print(f"{'CPU µs per operation':<30} {'h11':>9} {'codec':>9} {'ratio':>7}")
    for name, make, per in SCENARIOS:
        reference = measure(make(REFERENCE_CODEC), args.seconds) / per
        fast = measure(make(Codec()), args.seconds) / per
        print(f"{name:<30} {reference:9.2f} {fast:9.2f} {reference / fast:6.1f}x")


if __name__ == "__main__":
    main()
