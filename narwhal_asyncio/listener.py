"""Listening on asyncio: the shared :class:`~narwhal_runtime.listening.Listener`, with asyncio's waits.

One task per listening socket accepts (the loop both runtimes share); each
accepted socket becomes a transport of its own protocol in a task of its
own. With every connection slot (``ingress.max_connections``) held, no
socket is watched, so further connections wait in the kernel's listen
backlog.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from narwhal_runtime import listening

from .engines import Waits

__all__ = ["Listener"]


class _Waits(Waits):
    """asyncio's socket waits, with an event, a sleep and its clock (:class:`~narwhal_runtime.listening.AcceptWaits`)."""

    event = staticmethod(asyncio.Event)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.now = loop.time

    @staticmethod
    async def checkpoint() -> None:
        await asyncio.sleep(0)

    async def sleep_until(self, when: float) -> None:
        await asyncio.sleep(when - self._loop.time())


class Listener:
    """Accepting from ``sockets`` on ``loop`` into protocols made by ``factory``, until :meth:`close`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: list[socket.socket],
                 factory: Callable[[], asyncio.Protocol], *, limit: int) -> None:
        self._loop = loop
        self._factory = factory
        self._shared = listening.Listener(sockets, limit=limit, waits=_Waits(loop))
        self.release = self._shared.release
        self._tasks: set[asyncio.Task[Any]] = set()
        self._accepting = [loop.create_task(self._shared.accept(sock, self._start)) for sock in sockets]

    def _start(self, sock: socket.socket, _: object) -> None:
        task = self._loop.create_task(self._transport(sock))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _transport(self, sock: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, sock)
        except OSError:
            sock.close()
            self.release()  # no protocol ever saw it

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        for task in self._accepting:
            task.cancel()
        self._shared.close()
