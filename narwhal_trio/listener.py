"""Listening sockets on trio, accepted by hand, as asyncio's listener does.

Not by ``trio.SocketListener``: it drops a set of errors silently and hands
the rest to its caller, so what a failed accept means would be trio's; here
both runtimes follow one rule (:func:`~narwhal_runtime.listening.accept_error`).
Each connection takes a slot (``ingress.max_connections``) before it is
accepted; with every slot held, further connections wait in the kernel's
listen backlog, as they do on asyncio. Each accepted socket is set up by
the rule both runtimes share (:func:`~narwhal_runtime.socket_options.set_up_client`).
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from typing import Any

import trio

from narwhal_runtime.listening import accept_error
from narwhal_runtime.socket_options import set_up_client

from .engines import close_socket

__all__ = ["Listener"]

#: What gets each accepted connection, with the slots it holds one of.
StartClient = Callable[[socket.socket, trio.Semaphore], Any]


class Listener:
    """Listening sockets (:func:`~narwhal_runtime.listening.listening_sockets`) accepted by hand."""

    def __init__(self, sockets: list[socket.socket], *, limit: int) -> None:
        self.sockets = sockets
        #: ``ingress.max_connections``: a connection's task releases its slot when it is done.
        self.slots = trio.Semaphore(limit)
        #: After a failed accept that asked for a pause: when accepting resumes, on every socket.
        self._resumes = -math.inf

    async def serve(self, start_client: StartClient, task_status: Any) -> None:
        """Accept until cancelled (``task_status.started`` gets the cancel scope), then close the sockets.

        ``start_client(sock, slots)`` gets each accepted connection, holding its slot.
        """
        try:
            async with trio.open_nursery() as accepting:
                for sock in self.sockets:
                    accepting.start_soon(self._accept, sock, start_client)
                task_status.started(accepting.cancel_scope)
        finally:
            self.close()

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        for sock in self.sockets:
            close_socket(sock)

    async def _accept(self, listening: socket.socket, start_client: StartClient) -> None:
        # No slot is held while waiting for a connection: another socket may need it.
        slots = self.slots
        while True:
            if self._resumes > trio.current_time():
                await trio.sleep_until(self._resumes)
            await slots.acquire()
            try:
                sock, _ = listening.accept()
            except BlockingIOError:
                slots.release()
                await trio.lowlevel.wait_readable(listening)
                continue
            except OSError as exc:
                slots.release()
                pause = accept_error(exc)
                if pause:
                    self._resumes = trio.current_time() + pause
                continue
            set_up_client(sock)
            start_client(sock, slots)
