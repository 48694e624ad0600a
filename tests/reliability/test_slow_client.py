"""A client that reads a stream slower than its engine writes it: the router must slow the engine down.

The router reads an engine's stream only as fast as its client takes the
relayed bytes (on trio: a writer more than ``narwhal_runtime.driver.HIGH_WATER`` behind
makes the leg wait; on asyncio: the client transport's write-buffer limits
pause the engine transport). Without that, one slow client would make the
router hold a whole answer in memory. The decode engine here is a plain
socket server that writes a large SSE stream as fast as its socket takes it
and counts what it wrote, so the test sees the engine being held back.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest


from ..harness import Fleet, RouterThread
from ..helpers import MODEL, journal_terminal, read_request
from ..rawhttp import RawClient, request_bytes
from .support import WAIT

#: What the engine streams in all: well above what the sockets' kernel
#: buffers and the router's own high-water mark can hold between them.
TOTAL_BYTES = 128 * 1024 * 1024
#: The content of one SSE event.
EVENT_CONTENT = 32 * 1024


class StreamingEngine:
    """A decode engine that streams ``TOTAL_BYTES`` of SSE as fast as its socket takes them.

    A request without ``stream`` gets a whole answer of ``max_tokens`` KiB at once.
    """

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = "http://127.0.0.1:%d" % self._server.getsockname()[1]
        #: Bytes of the stream written to the socket so far, and the events among them.
        self.written = 0
        self.events = 0
        self.finished = threading.Event()
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            self._conns.append(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = b""
        try:
            while (next_request := read_request(conn, buf)) is not None:
                line, _, body, buf = next_request
                if line.startswith("GET "):  # the router's health probes
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                    continue
                request = json.loads(body)
                if not request.get("stream"):
                    self._whole(conn, request)
                    continue
                self._stream(conn)
                return
        except OSError:
            return

    def _whole(self, conn: socket.socket, request: dict[str, Any]) -> None:
        # A chat answer of max_tokens KiB of text, at once.
        tokens = int(request.get("max_tokens") or 1)
        answer = json.dumps({
            "id": "chatcmpl-whole", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "y" * (1024 * tokens)},
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens},
        }).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(answer), answer))

    def _stream(self, conn: socket.socket) -> None:
        conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        event = b"data: " + json.dumps({
            "id": "chatcmpl-slow", "object": "chat.completion.chunk", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": "x" * EVENT_CONTENT}, "finish_reason": None}],
        }).encode() + b"\n\n"
        chunk = b"%x\r\n%s\r\n" % (len(event), event)
        while self.written < TOTAL_BYTES:
            conn.sendall(chunk)  # blocks while the router does not read
            self.written += len(chunk)
            self.events += 1
        done = b"data: [DONE]\n\n"
        conn.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
        self.finished.set()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        for conn in self._conns:
            conn.close()


@pytest.fixture
def streaming_engine() -> Iterator[StreamingEngine]:
    engine = StreamingEngine()
    yield engine
    engine.close()


def written_settles(engine: StreamingEngine, *, quiet: float = 0.5, timeout: float = 20.0) -> int:
    """What the engine has written once it has written nothing more for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = engine.written, time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = engine.written
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise AssertionError(f"the engine kept writing for {timeout} s ({last} bytes)")


def start_behind(start_router: Callable[..., RouterThread], fleet: Fleet, decode: StreamingEngine,
                 **sections: Any) -> RouterThread:
    """A router whose decode engine is ``decode``; ``sections`` override the config (``engine`` merged)."""
    return start_router(
        fleet_=Fleet(prefill=fleet.prefill, decode=[decode]),
        **{**sections, "engine": {"max_response_bytes": 2 * TOTAL_BYTES, **sections.get("engine", {})}},
    )


def chat_request(max_tokens: int, *, stream: bool = False) -> bytes:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a long answer"}],
                       "stream": stream, "max_tokens": max_tokens}).encode()
    return request_bytes("POST", "/v1/chat/completions", body, headers=[("content-type", "application/json")])


def slow_client(router: RouterThread) -> RawClient:
    """A client with a small receive buffer, that reads only when told."""
    assert router.address is not None
    return RawClient(router.address, timeout=WAIT, receive_buffer=16384)


def start_slow_reader(router: RouterThread) -> RawClient:
    """A client that asks for a stream and reads nothing until told."""
    client = slow_client(router)
    client.send(chat_request(16, stream=True))
    return client


def rid_of_head(head: bytes) -> str:
    return next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                if line.lower().startswith(b"x-request-id:"))


def assert_whole_stream(engine: StreamingEngine, head: bytes, stream: bytes) -> None:
    """Every event the engine wrote, then [DONE] and the chunked end: nothing lost while held back."""
    assert head.startswith(b"HTTP/1.1 200 "), head[:200]
    assert engine.finished.is_set()
    assert stream.count(b"data: ") == engine.events + 1
    assert stream.count(b"x" * EVENT_CONTENT) == engine.events
    assert stream.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


def read_to_the_end(client: RawClient) -> tuple[bytes, bytes]:
    """The response head and its (chunked) stream, read to the terminating chunk."""
    received = bytearray()
    while not received.endswith(b"\r\n0\r\n\r\n"):
        data = client.sock.recv(1 << 20)
        assert data, f"the router closed the stream after {len(received)} bytes"
        received += data
    head, _, stream = bytes(received).partition(b"\r\n\r\n")
    return head, stream


def test_a_slow_reader_holds_its_engine_back_and_still_gets_the_whole_stream(
    start_router: Callable[..., RouterThread], fleet: Fleet, streaming_engine: StreamingEngine, journal_path: Any
) -> None:
    router = start_behind(start_router, fleet, streaming_engine)
    client = start_slow_reader(router)
    try:
        # The client reads nothing: the engine must stall well before the end
        # of its stream (kernel buffers on both sockets plus the router's
        # high-water mark hold a few tens of MiB at most on loopback).
        held = written_settles(streaming_engine)
        assert not streaming_engine.finished.is_set()
        assert held < TOTAL_BYTES // 2, f"the router read {held} bytes of the engine's stream for a client that reads nothing"
        # Now the client reads: the whole stream arrives, in order, and ends properly.
        head, stream = read_to_the_end(client)
    finally:
        client.close()
    assert_whole_stream(streaming_engine, head, stream)
    record = journal_terminal(journal_path, rid_of_head(head))
    assert (record["terminal"], record["status"]) == ("completed", 200)


#: One failure charged to an engine takes it out of rotation; a health probe slowed by a busy machine is
#: not one (these tests are about legs held back for a client, not about probes).
ONE_LEG_FAILURE_COUNTS = {"unhealthy_after": 1, "probe_timeout_s": 30.0}


def test_a_slow_reader_is_not_the_engines_fault(
    start_router: Callable[..., RouterThread], fleet: Fleet, streaming_engine: StreamingEngine, journal_path: Any
) -> None:
    # While the router holds the engine back for a client that is not
    # reading, the engine sends nothing, and that is not the engine's idle
    # stream: the client's own limit (ingress.send_timeout_s) governs it.
    # Were the engine blamed, a slow client would end its own stream with a
    # "stream_idle_timeout" error event and count as a failure against a
    # healthy engine.
    idle_s = 0.5
    router = start_behind(start_router, fleet, streaming_engine, engine={"stream_idle_timeout_s": idle_s},
                          ingress={"send_timeout_s": 30.0}, health=ONE_LEG_FAILURE_COUNTS)
    client = start_slow_reader(router)
    try:
        written_settles(streaming_engine)  # held back...
        time.sleep(4 * idle_s)  # ...for well over the engine's idle limit
        head, stream = read_to_the_end(client)
    finally:
        client.close()
    assert b'"error"' not in stream[-4096:], stream[-4096:]
    assert_whole_stream(streaming_engine, head, stream)
    record = journal_terminal(journal_path, rid_of_head(head))
    assert (record["terminal"], record["status"], record["error"]) == ("completed", 200, None)
    assert [leg["outcome"] for leg in record["legs"]] == ["ok", "ok"]
    # One failure would have taken the engine out of rotation (health.unhealthy_after = 1).
    assert all(router.statistics().engine_healthy.values()), router.statistics().engine_healthy


def test_a_request_pipelined_behind_an_unread_answer_waits_for_its_client(
    start_router: Callable[..., RouterThread], fleet: Fleet, streaming_engine: StreamingEngine, journal_path: Any
) -> None:
    # The client pipelines a second request behind a 16 MiB answer it does
    # not read: the second request starts as that answer goes out, and its
    # legs are held back with the client (asyncio stops reading them until
    # it catches up). Their engines' silence is not theirs: no timeout, no
    # failure charged; both answers arrive once the client reads. (Without
    # the hold, asyncio times the second prefill leg out and takes its
    # engine out of rotation.)
    limit_s = 0.5
    router = start_behind(start_router, fleet, streaming_engine,
                          engine={"prefill_timeout_s": limit_s, "decode_timeout_s": limit_s},
                          ingress={"send_timeout_s": 30.0}, retry={"max_attempts": 1}, health=ONE_LEG_FAILURE_COUNTS)
    client = slow_client(router)
    try:
        client.send(chat_request(16 * 1024) + chat_request(4))
        # The client reads nothing for four leg timeouts: without the hold, the second request's
        # legs (started as the first answer went out) would have timed out long before the end.
        time.sleep(4 * limit_s)
        first, second = client.read_response(), client.read_response()
    finally:
        client.close()
    assert (first.status, second.status) == (200, 200), (first.status, second.body[:300])
    assert len(first.json()["choices"][0]["message"]["content"]) == 16 * 1024 * 1024
    assert second.json()["choices"][0]["message"]["content"] == "y" * 4096
    for response in (first, second):
        rid = response.header("x-request-id")
        assert rid is not None
        record = journal_terminal(journal_path, rid)
        assert (record["terminal"], record["status"]) == ("completed", 200)
        assert [leg["outcome"] for leg in record["legs"]] == ["ok", "ok"]
    assert all(router.statistics().engine_healthy.values()), router.statistics().engine_healthy
