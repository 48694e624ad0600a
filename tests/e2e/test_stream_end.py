"""A stream the client received whole is ``completed`` (issue 20, item 1), over real sockets.

The official ``openai`` SDK's sync client stops reading at ``data: [DONE]``
and closes its connection if the body has not ended by then. Behind a real
network the engine's body often ends a few milliseconds after ``[DONE]``.
The engine here (a few lines on a plain socket) waits 25 ms between the
``[DONE]`` chunk and the body's last chunk; Narwhal must end the client's
body at ``[DONE]`` and journal ``completed``, every time.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ..harness import RouterThread, make_config
from ..helpers import MODEL, poll, read_journal, read_request

#: The engine's pause between ``[DONE]`` and the end of its body.
TAIL_PAUSE_S = 0.025
ROUNDS = 200


class TailEngine:
    """A decode engine that streams a short answer and ends its body ``TAIL_PAUSE_S`` after ``[DONE]``."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self.completions = 0
        self.tails_sent = 0
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._closing = False
        self._accept = threading.Thread(target=self._accept_loop, daemon=True)

    def __enter__(self) -> TailEngine:
        self._accept.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing = True
        self.sock.close()

    def _accept_loop(self) -> None:
        while not self._closing:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                self._answer(conn)
            except ConnectionResetError:
                return  # the router closed the connection while bytes of ours were unread: it left, as a client may

    def _answer(self, conn: socket.socket) -> None:
        buf = b""
        while (next_request := read_request(conn, buf)) is not None:
            line, _, body, buf = next_request
            method, target, _ = line.split(" ")
            if method == "GET":
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                continue
            request = json.loads(body)
            with self._lock:
                self.completions += 1
            # The head and every event at once, then the pause, then the body's end.
            conn.sendall(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in self._events(target, request))
            )
            time.sleep(TAIL_PAUSE_S)
            try:
                conn.sendall(b"0\r\n\r\n")
            except OSError:
                return
            with self._lock:
                self.tails_sent += 1

    @staticmethod
    def _events(target: str, request: dict[str, Any]) -> list[bytes]:
        chat = target.endswith("/chat/completions")
        out = []
        for i, word in enumerate(("Narwhals ", "have ", "tusks.")):
            if chat:
                choice: dict[str, Any] = {"index": 0, "delta": {"content": word}, "finish_reason": None}
            else:
                choice = {"index": 0, "text": word, "finish_reason": None}
            if i == 2:
                choice["finish_reason"] = "stop"
            out.append({"id": "s-1", "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": 1, "model": request["model"], "choices": [choice]})
        out.append({"id": "s-1", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                    "model": request["model"], "choices": [],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}})
        # The last event and [DONE] in one chunk, as vLLM writes them back to back.
        events = [b"data: " + json.dumps(e).encode() + b"\n\n" for e in out]
        return [*events[:-1], events[-1] + b"data: [DONE]\n\n"]


@pytest.fixture
def engine() -> Iterator[TailEngine]:
    with TailEngine() as engine:
        yield engine


@pytest.mark.parametrize("runtime", ["trio", "asyncio"])
def test_openai_sdk_sync_streams_are_completed_when_the_engine_ends_its_body_after_done(
    runtime: str, engine: TailEngine, tmp_path: Any
) -> None:
    journal = tmp_path / "journal.jsonl"
    config = make_config(journal, decode=(engine.url,))
    with RouterThread(config, runtime) as router, openai.OpenAI(
        base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=10
    ) as client:
        rids = []
        for i in range(ROUNDS):
            if i % 2:
                stream: Any = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "Tusks?"}], max_tokens=3, stream=True,
                    stream_options={"include_usage": True},
                )
                text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
            else:
                stream = client.completions.create(model=MODEL, prompt="Tusks?", max_tokens=3, stream=True,
                                                   stream_options={"include_usage": True})
                text = "".join(c.choices[0].text for c in stream if c.choices)
            assert text == "Narwhals have tusks."
            rids.append(stream.response.headers["x-request-id"])
        # Every engine body ended (its tail was read), and nothing is left running.
        poll(lambda: engine.tails_sent == ROUNDS, timeout=10, what="every engine body ended")
        stats = router.wait_idle()
        assert stats.legs == 0 and all(v == 0 for v in stats.engine_outstanding.values())
    terminals = {r["rid"]: r for r in read_journal(journal) if r.get("terminal") is not None}
    assert len(terminals) == ROUNDS and set(terminals) == set(rids)
    outcomes = [(terminals[rid]["terminal"], terminals[rid]["status"]) for rid in rids]
    assert outcomes == [("completed", 200)] * ROUNDS, [o for o in outcomes if o != ("completed", 200)][:5]
    assert all(terminals[rid]["usage"]["completion_tokens"] == 3 for rid in rids)
    assert all(terminals[rid]["legs"][-1]["outcome"] == "ok" for rid in rids)
    assert engine.completions == ROUNDS
    # Bodies that ended cleanly after [DONE] went back to the pool: fewer
    # connections than requests (each request's leg needs one only while
    # the previous one's tail is still being read).
    assert engine.connections < ROUNDS
