"""Listening sockets on trio, accepted by hand, as asyncio's listener does.

Not by ``trio.SocketListener``: it drops a set of errors silently and hands
the rest to its caller, so what a failed accept means would be trio's; here
both runtimes take the decisions of one :class:`~narwhal_runtime.listening.AcceptGate`
(a connection slot free or not, the pause after a failed accept) and set up
each accepted socket by one rule (:func:`~narwhal_runtime.socket_options.set_up_client`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import trio

from narwhal_runtime.listening import AcceptGate
from narwhal_runtime.socket_options import set_up_client

from .engines import close_socket

__all__ = ["Listener"]

#: What gets each accepted connection, with the listener whose slot it holds (``listener.release()`` frees it).
StartClient = Callable[[socket.socket, "Listener"], Any]


class Listener:
    """Listening sockets (:func:`~narwhal_runtime.listening.listening_sockets`) accepted by hand."""

    def __init__(self, sockets: list[socket.socket], *, limit: int) -> None:
        self.sockets = sockets
        self.gate = AcceptGate(limit)
        self._waiting = trio.lowlevel.ParkingLot()  # the accepting tasks, while every slot is held

    async def serve(self, start_client: StartClient, task_status: Any) -> None:
        """Accept until cancelled (``task_status.started`` gets the cancel scope), then close the sockets.

        ``start_client(sock, listener)`` gets each accepted connection, holding its slot.
        """
        try:
            async with trio.open_nursery() as accepting:
                for sock in self.sockets:
                    accepting.start_soon(self._accept, sock, start_client)
                task_status.started(accepting.cancel_scope)
        finally:
            self.close()

    def release(self) -> None:
        """A connection accepted here no longer holds a slot: accept again if that was the limit."""
        if self.gate.released():
            self._waiting.unpark_all()

    def close(self) -> None:
        """Stop listening (connections already accepted go on)."""
        for sock in self.sockets:
            close_socket(sock)

    async def _accept(self, listening: socket.socket, start_client: StartClient) -> None:
        gate = self.gate
        while True:
            await trio.lowlevel.checkpoint()  # a scheduling point per try, as trio's own accept has
            if gate.full:
                await self._waiting.park()  # holding no slot: another socket may take the one freed first
                continue
            if gate.resumes > trio.current_time():
                await trio.sleep_until(gate.resumes)
                continue
            try:
                sock, _ = listening.accept()
            except BlockingIOError:
                await trio.lowlevel.wait_readable(listening)
                continue
            except OSError as exc:
                gate.failed(exc, trio.current_time())
                continue
            gate.accepted()
            set_up_client(sock)
            start_client(sock, self)
