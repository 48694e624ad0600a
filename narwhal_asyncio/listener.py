"""Listening on asyncio: the shared :class:`~narwhal_runtime.listening.Listener`, with asyncio's waits.

One task per listening socket accepts (the loop both runtimes share) and
hands each accepted socket on. With every connection slot
(``ingress.max_connections``) held, no socket is watched, so further
connections wait in the kernel's listen backlog.
"""

from __future__ import annotations

import asyncio
import socket
from narwhal_runtime import listening
from narwhal_runtime.listening import StartClient

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
    """Accepting from ``sockets`` on ``loop`` into ``start_client``, until :meth:`close`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sockets: list[socket.socket], start_client: StartClient, *,
                 limit: int) -> None:
        self._shared = listening.Listener(sockets, limit=limit, waits=_Waits(loop))
        self.release = self._shared.release
        self._accepting = [loop.create_task(self._shared.accept(sock, start_client)) for sock in sockets]

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        for task in self._accepting:
            task.cancel()
        self._shared.close()
