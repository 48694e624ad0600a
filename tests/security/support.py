"""Helpers of the security suite: hostile clients, fake engines, and what they leave behind.

Everything is synchronous and bounded by explicit timeouts:

* :class:`RawClient` -- one loopback socket that sends bytes as they are
  (smuggling shapes, slow bytes, resets) and reads whatever responses come
  back until the router closes the connection;
* :func:`assert_still_serves` -- the check every hostile test ends with: a
  normal request on a *new* connection gets its answer and its journal
  record;
* :class:`FakeEngine` -- a tiny threaded HTTP server on loopback whose
  answers a test scripts (a forging prefill engine, an echoing engine) and
  which records what it received;
* :class:`Canary` -- a listener that only counts connections, to prove that
  nothing a client sends makes Narwhal connect somewhere else.

What every suite shares (routes, the error envelope, the journal readers)
is in ``tests/helpers.py``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs

from ..helpers import COMPLETION_PATHS, COMPLETIONS, body_for, journal_terminal, read_journal
from ..rawhttp import Closed, RawClient, Response, request_bytes  # noqa: F401  (re-exported for the suite)


def json_post(route: str, payload: Any, headers: Sequence[tuple[str, str]] = ()) -> bytes:
    """A POST of ``payload`` (bytes are sent as they are)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return request_bytes("POST", route, body, headers=[("content-type", "application/json"), *headers])


# ------------------------------------------------------------ raw client


def exchange(address: tuple[str, int], data: bytes, *, timeout: float = 5.0) -> list[Response]:
    """Send ``data`` on a new connection, half-close nothing, and read until the router closes."""
    with RawClient(address, timeout=timeout) as client:
        client.send(data)
        return client.read_all(timeout)


# ---------------------------------------------------------------- journal


def terminal_records(journal_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    return [r for r in read_journal(journal_path) if r.get("terminal") is not None]


def assert_still_serves(
    address: tuple[str, int],
    journal_path: str | os.PathLike[str],
    *,
    headers: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
) -> dict[str, Any]:
    """A normal request on a new connection is answered 200 and journaled ``completed``."""
    with RawClient(address, timeout=timeout) as client:
        client.send(json_post(COMPLETIONS, body_for(COMPLETIONS, max_tokens=2), headers))
        response = client.read_response()
    assert response.status == 200, (response.status, response.body[:300])
    assert response.json()["object"] == "text_completion"
    rid = response.header("x-request-id")
    assert rid
    record = journal_terminal(journal_path, rid)
    assert record["terminal"] == "completed", record
    return record


# ---------------------------------------------------------------- engines


def header_names(record: Mapping[str, Any]) -> list[str]:
    return [name.lower() for name, _ in record["headers"]]


@attrs.define
class Received:
    """One request a :class:`FakeEngine` received."""

    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes


#: A fake engine's answer: (status, content-type, body bytes).
Answer = tuple[int, str, bytes]


class FakeEngine:
    """A threaded HTTP/1.1 server on loopback whose answers come from ``handler(received)``.

    ``GET /health`` answers 200 unless the handler says otherwise. Every
    request is recorded in :attr:`received`.
    """

    def __init__(self, handler: Callable[[Received], Answer]) -> None:
        self.handler = handler
        self.received: list[Received] = []
        self._lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - silence
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                received = Received(self.command, self.path, list(self.headers.items()), body)
                with engine._lock:
                    engine.received.append(received)
                if self.command == "GET" and self.path == "/health":
                    status, ctype, data = 200, "application/json", b"{}"
                else:
                    status, ctype, data = engine.handler(received)
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _serve

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-engine", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def completions(self) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path.split("?")[0] in COMPLETION_PATHS]

    def __enter__(self) -> FakeEngine:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class Canary:
    """A loopback listener that counts the connections made to it (and answers none)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.sock.settimeout(0.05)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="canary", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, socket.timeout, OSError):
                continue
            self.connections += 1
            conn.close()

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
