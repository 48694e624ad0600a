"""A raw HTTP/1.1 client for tests: a plain socket, exact bytes out, responses read by hand.

The end-to-end and security suites use it where an HTTP library would
normalise what is under test (framing, pipelining, half-sent requests,
resets, the connection's end).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = ["Closed", "RawClient", "Response", "chunked", "request_bytes"]


def request_bytes(
    method: str,
    target: str,
    body: bytes | None = None,
    *,
    headers: Sequence[tuple[str, str]] = (),
    host: str = "127.0.0.1",
    version: str = "HTTP/1.1",
) -> bytes:
    """A well-formed request: ``host`` and, for a body, ``content-length`` are added."""
    lines = [f"{method} {target} {version}", f"host: {host}"]
    names = {n.lower() for n, _ in headers}
    if body is not None and "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"content-length: {len(body)}")
    lines += [f"{n}: {v}" for n, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chunked(*pieces: bytes) -> bytes:
    """A chunked request body made of ``pieces``."""
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces if p) + b"0\r\n\r\n"


@attrs.define
class Response:
    """One HTTP/1.x response as read off the socket."""

    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        name = name.lower()
        for n, v in self.headers:
            if n == name:
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)


class Closed(EOFError):
    """The router closed the connection (EOF or reset)."""


class RawClient:
    """One client socket that sends exactly the bytes it is given."""

    def __init__(
        self,
        address: tuple[str, int],
        *,
        timeout: float = 10.0,
        source: str | None = None,
        receive_buffer: int | None = None,
    ) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        if source is not None:
            self.sock.bind((source, 0))
        if receive_buffer is not None:
            # Set before connecting: the kernel then neither grows it nor
            # advertises a larger window (a client that reads slowly).
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
        self.sock.connect(address)
        self._buf = b""
        self.closed = False
        #: Every byte the router sent on this connection.
        self.received = bytearray()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def reset(self) -> None:
        """Abort the connection with a TCP RST (SO_LINGER 0), as a crashing client would."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """Send ``data``; False when the router already closed the connection."""
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            self.closed = True
            return False
        return True

    def _fill(self, deadline: float | None = None) -> None:
        if deadline is not None:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            data = self.sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self.closed = True
            raise Closed(self._buf[:200])
        self.received += data
        self._buf += data

    def _take_until(self, marker: bytes) -> bytes:
        while marker not in self._buf:
            self._fill()
        head, _, self._buf = self._buf.partition(marker)
        return head

    def _take(self, n: int) -> bytes:
        while len(self._buf) < n:
            self._fill()
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    def read_response(self, *, head_request: bool = False) -> Response:
        """One whole response (raises :class:`Closed` if the connection ends first)."""
        head = self._take_until(b"\r\n\r\n").decode("latin-1")
        status_line, *lines = head.split("\r\n")
        version, status, *_ = status_line.split(" ", 2)
        assert version in ("HTTP/1.1", "HTTP/1.0"), status_line
        headers = []
        for line in lines:
            name, _, value = line.partition(":")
            headers.append((name.strip().lower(), value.strip()))
        response = Response(status=int(status), headers=headers, body=b"")
        if 100 <= response.status < 200 or response.status in (204, 304) or head_request:
            return response
        length = response.header("content-length")
        if response.header("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self._take_until(b"\r\n").split(b";")[0], 16)
                if size == 0:
                    self._take_until(b"\r\n")
                    break
                body += self._take(size)
                assert self._take(2) == b"\r\n"
            response.body = body
        elif length is not None:
            response.body = self._take(int(length))
        else:
            while True:
                try:
                    self._fill()
                except Closed:
                    break
            response.body, self._buf = self._buf, b""
        return response

    def read_all(self, timeout: float = 5.0) -> list[Response]:
        """Every response until the router closes the connection; TimeoutError if it never does."""
        deadline = time.monotonic() + timeout
        out = []
        self.sock.settimeout(timeout)
        try:
            while True:
                out.append(self.read_response())
                if time.monotonic() > deadline:
                    raise TimeoutError(f"connection still open after {timeout} s; got {out}")
        except Closed:
            return out
        except (TimeoutError, socket.timeout):
            raise TimeoutError(f"connection still open after {timeout} s; got {out}, unread {self._buf[:200]!r}")

    def wait_closed(self, timeout: float) -> bytes:
        """Wait for EOF/reset, returning what arrived meanwhile; TimeoutError if the socket stays open."""
        deadline = time.monotonic() + timeout
        while True:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"connection still open after {timeout} s")
            try:
                self._fill(deadline)
            except Closed:
                return self._buf
            except (TimeoutError, socket.timeout):
                raise TimeoutError(f"connection still open after {timeout} s; got {self._buf[:200]!r}")

    def peer_closed(self, timeout: float = 5.0) -> bool:
        """Whether the router closes the connection (EOF or reset) within ``timeout``."""
        try:
            self.wait_closed(timeout)
        except TimeoutError:
            return False
        return True
