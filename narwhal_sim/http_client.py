"""A small pooled keep-alive HTTP/1.1 client (httptools) for the simulator's calls to other engines.

:class:`EngineClient` sends a decode engine's KV pulls, releases and lease
renewals to the prefill engine named by ``remote_host``/``remote_port``.
"""

from __future__ import annotations

import asyncio
from typing import cast

import httptools

__all__ = ["EngineClient"]


class _ClientConnection(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reusable = False
        self.got_bytes = False
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._status = 0
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses

    def exchange(self, data: bytes) -> asyncio.Future[tuple[int, bytes]]:
        self._waiter = self._loop.create_future()
        self._body = []
        self.got_bytes = False
        self.reusable = False
        assert self.transport is not None
        self.transport.write(data)
        return self._waiter

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"bad answer from engine: {exc}"))
            self.close()

    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.reusable = self._parser.should_keep_alive()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result((self._status, b"".join(self._body)))

    def eof_received(self) -> bool:
        self.closed = True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(ConnectionError("engine closed the connection"))

    def _fail(self, exc: Exception) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class EngineClient:
    """Keep-alive HTTP/1.1 client for the simulator's calls to other engines.

    ``timeout_s`` bounds each call; ``None`` leaves it to the caller (a push registration the
    prefill engine parks is answered only once it pairs, docs/simulator.md, "Push mode").
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        timeout_s: float | None,
        authorization: bytes | None = None,
        max_idle_per_host: int = 32,
    ) -> None:
        self._loop = loop
        self._timeout_s = timeout_s
        self._authorization = authorization
        self._max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], list[_ClientConnection]] = {}

    async def post(self, host: str, port: int, path: str, body: bytes) -> tuple[int, bytes]:
        """POST a JSON body; ``(status, body)``. Raises ``OSError``/``TimeoutError``/``ConnectionError``."""
        head = [
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            % (path.encode(), host.encode(), port, len(body))
        ]
        if self._authorization is not None:
            head.append(b"authorization: " + self._authorization + b"\r\n")
        data = b"".join(head) + b"\r\n" + body
        async with asyncio.timeout(self._timeout_s):
            for attempt in (0, 1):
                conn, reused = await self._acquire(host, port)
                try:
                    status, answer = await conn.exchange(data)
                except ConnectionError:
                    conn.close()
                    # A pooled connection the server closed meanwhile: try a fresh one once.
                    if reused and not conn.got_bytes and attempt == 0:
                        continue
                    raise
                except BaseException:
                    conn.close()
                    raise
                self._release(host, port, conn)
                return status, answer
        raise AssertionError("unreachable")

    async def _acquire(self, host: str, port: int) -> tuple[_ClientConnection, bool]:
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn, True
        _, conn = await self._loop.create_connection(lambda: _ClientConnection(self._loop), host, port)
        return conn, False

    def _release(self, host: str, port: int, conn: _ClientConnection) -> None:
        if not conn.reusable or conn.closed:
            conn.close()
            return
        idle = self._idle.setdefault((host, port), [])
        if len(idle) < self._max_idle:
            idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Close every idle connection."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
