"""Listening sockets on asyncio, accepted by hand.

What to do is decided by one :class:`~narwhal_runtime.listening.AcceptGate`,
as on trio: a failed accept (a shortage of descriptors costs one log line
and a pause, not the loop); and with every connection slot
(``ingress.max_connections``) held, the sockets are not watched, so further
connections wait in the kernel's listen backlog.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from narwhal_runtime.listening import AcceptGate
from narwhal_runtime.socket_options import set_up_client

__all__ = ["Listener"]

#: Connections accepted per readiness of the listening socket, at most.
ACCEPT_BATCH = 128


class Listener:
    """Listening sockets (:func:`~narwhal_runtime.listening.listening_sockets`) accepted by hand.

    Not by ``loop.create_server``: CPython 3.11's own accept loop answers
    ``EMFILE`` by logging a traceback and scheduling a retry for each of its
    ``backlog`` iterations per wake-up: with a large backlog, a router out
    of file descriptors spends all its time there and stops serving the
    connections it has. Here a failure of the router's logs one line, stops
    watching the sockets for
    :data:`~narwhal_runtime.listening.ACCEPT_RETRY_S` and goes on serving
    (uvloop gets the same code).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: list[socket.socket],
                 factory: Callable[[], asyncio.Protocol], *, limit: int) -> None:
        self._loop = loop
        self.sockets = sockets
        self._factory = factory
        self.gate = AcceptGate(limit)
        self._watching = False
        self._closed = False
        self._retry: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watch()

    def release(self) -> None:
        """A connection accepted here no longer holds a slot: accept again if that was the limit."""
        if self.gate.released() and self._retry is None:
            self._watch()

    def _watch(self) -> None:
        self._retry = None
        if self._watching or self._closed or self.gate.full:
            return
        self._watching = True
        for sock in self.sockets:
            self._loop.add_reader(sock.fileno(), self._accept, sock)

    def _unwatch(self) -> None:
        if self._watching:
            self._watching = False
            for sock in self.sockets:
                self._loop.remove_reader(sock.fileno())

    def _accept(self, sock: socket.socket) -> None:
        gate = self.gate
        if gate.full:
            return  # a readiness seen before the last slot was taken
        for _ in range(ACCEPT_BATCH):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                pause = gate.failed(exc, self._loop.time())
                if not pause:
                    continue  # that connection's own failure: on to the next
                if self._retry is None:
                    self._unwatch()
                    self._retry = self._loop.call_later(pause, self._watch)
                return
            set_up_client(conn)  # the rule both runtimes share (the transport sets TCP_NODELAY again)
            task = self._loop.create_task(self._start(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            if gate.accepted():
                self._unwatch()  # every slot is held: the rest wait in the kernel's listen backlog
                return

    async def _start(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError:
            conn.close()
            self.release()  # no protocol ever saw it

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        self._closed = True
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._unwatch()
        for sock in self.sockets:
            sock.close()
