"""Listening sockets on asyncio, accepted by hand: a shortage of descriptors costs one log line, not the loop."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from typing import Any

from narwhal_runtime.log import log_event

__all__ = ["Listener"]

#: Listen backlog (the kernel caps it at ``somaxconn``), as trio asks for.
BACKLOG = 0xFFFF
#: Connections accepted per readiness of the listening socket, at most.
ACCEPT_BATCH = 128
#: After an accept failed for want of descriptors or memory: seconds before
#: the next try (as on trio).
ACCEPT_RETRY_S = 0.1
_ACCEPT_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Listener:
    """Listening sockets accepted by hand, not by ``loop.create_server``.

    CPython 3.11's own accept loop answers ``EMFILE`` by logging a traceback
    and scheduling a retry for each of its ``backlog`` iterations per
    wake-up: with a large backlog, a router out of file descriptors spends
    all its time there and stops serving the connections it has. Here a
    shortage logs one line, stops watching the sockets for
    :data:`ACCEPT_RETRY_S` and goes on serving (uvloop gets the same code).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: list[socket.socket],
                 factory: Callable[[], asyncio.Protocol]) -> None:
        self._loop = loop
        self.sockets = sockets
        self._factory = factory
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    def open(cls, loop: asyncio.AbstractEventLoop, host: str, port: int,
             factory: Callable[[], asyncio.Protocol]) -> Listener:
        """Bind and listen on every address ``host`` resolves to."""
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
            ):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
                if port == 0:  # every address on the one port the first got
                    port = sock.getsockname()[1]
                sock.listen(BACKLOG)
                sock.setblocking(False)
        except BaseException:
            for sock in sockets:
                sock.close()
            raise
        listener = cls(loop, sockets, factory)
        listener._watch()
        return listener

    def _watch(self) -> None:
        self._retry = None
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _accept(self, sock: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                log_event("accept_failed", error=str(exc))
                if exc.errno in _ACCEPT_SHORTAGE and self._retry is None:
                    for listening in self.sockets:
                        self._loop.remove_reader(listening.fileno())
                    self._retry = self._loop.call_later(ACCEPT_RETRY_S, self._watch)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._start(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _start(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:
            conn.close()

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        for sock in self.sockets:
            if sock.fileno() != -1:
                self._loop.remove_reader(sock.fileno())
                sock.close()
