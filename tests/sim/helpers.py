"""Helpers for the simulator tests: real loopback sockets, port 0, bounded waits."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import httptools
import httpx

from ..helpers import MODEL, PREFILL_KV_REQUEST

#: A prompt of 200 characters: 50 tokens, 4 KV blocks (3 full).
PROMPT = "The narwhal is a medium-sized toothed whale with a large tusk from a protruding canine. " * 2 + "x" * 24
assert len(PROMPT) == 200


def prefill_body(prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    """A prefill leg body (docs/simulator.md, "Prefill leg")."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_REQUEST, **extra}


def decode_body(kv: dict[str, Any], prompt: str = PROMPT, *, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    """A decode leg body: the prompt again and the prefill's kv_transfer_params (docs/simulator.md)."""
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "kv_transfer_params": kv, **extra}


def run_prefill(client: httpx.Client, url: str, rid: str, prompt: str = PROMPT) -> dict[str, Any]:
    """POST a prefill leg; its kv_transfer_params."""
    answer = client.post(url + "/v1/completions", json=prefill_body(prompt), headers={"X-Request-Id": rid})
    assert answer.status_code == 200, answer.text
    kv = answer.json()["kv_transfer_params"]
    assert kv is not None
    return dict(kv)


def http_request(method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    """The bytes of one HTTP/1.1 request with a Content-Length body."""
    lines = [f"{method} {path} HTTP/1.1", "Host: sim"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body or method == "POST":
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def json_request(path: str, payload: Any, headers: dict[str, str] | None = None) -> bytes:
    """A POST with a JSON body."""
    return http_request("POST", path, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})


class RawResponse:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""
        self.complete = False


class _ResponseReader:
    """Reads whole HTTP responses from a socket with httptools."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = httptools.HttpResponseParser(self)
        self.done: list[RawResponse] = []
        self.current = RawResponse()
        self._name = b""

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current.body += body

    def on_message_complete(self) -> None:
        self.current.complete = True
        self.done.append(self.current)
        self.current = RawResponse()

    def read(self, count: int = 1, timeout: float = 5.0) -> list[RawResponse]:
        deadline = time.monotonic() + timeout
        while len(self.done) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"only {len(self.done)} of {count} responses")
            self.sock.settimeout(remaining)
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError(f"closed after {len(self.done)} of {count} responses")
            self.parser.feed_data(data)
        out, self.done = self.done[:count], self.done[count:]
        return out


def connect(port: int, timeout: float = 5.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def exchange(port: int, data: bytes, count: int = 1, timeout: float = 5.0) -> list[RawResponse]:
    """Send ``data`` on a fresh connection and read ``count`` responses."""
    with connect(port, timeout) as sock:
        sock.sendall(data)
        return _ResponseReader(sock).read(count, timeout)


def reader(sock: socket.socket) -> _ResponseReader:
    return _ResponseReader(sock)


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the peer sends until it closes (bounded)."""
    deadline = time.monotonic() + timeout
    chunks = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("peer did not close")
        sock.settimeout(remaining)
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def is_closed(sock: socket.socket, within: float) -> bool:
    """Whether the peer closes the connection within ``within`` seconds (data is discarded)."""
    deadline = time.monotonic() + within
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True


def sse_values(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded (``[DONE]`` kept as a string)."""
    out: list[Any] = []
    for event in text.split("\n\n"):
        if not event.strip():
            continue
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out
