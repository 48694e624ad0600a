"""A non-blocking socket's connect, send and receive, written once for both runtimes.

Each call tries the socket at once and, when it would block, waits for it
the runtime's way (:meth:`~.runtime_io.RuntimeIO.readable`,
:meth:`~.runtime_io.RuntimeIO.writable`: trio's ``wait_readable`` and
``wait_writable``; asyncio's event loop watching the descriptor until it
is ready), then tries again. Control requests, a leg's new connection and
the listener use them alike on both runtimes. (Client and engine
connections are driven by their readiness instead:
:mod:`.client_connections`, :mod:`.leg_connections`.)
"""

from __future__ import annotations

import os
import socket
from collections.abc import Awaitable, Callable
from typing import Any

from .socket_options import READ_SIZE

__all__ = ["Wait", "connect", "send_all", "receive"]

#: Wait until a socket is ready (to read, or to write).
Wait = Callable[[socket.socket], Awaitable[object]]


async def connect(sock: socket.socket, address: Any, writable: Wait) -> None:
    """Connect the non-blocking ``sock`` to ``address``; raises ``OSError`` with the kernel's errno."""
    try:
        sock.connect(address)
    except BlockingIOError:  # in progress: writable once it opened or failed
        await writable(sock)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if error:
            raise OSError(error, os.strerror(error)) from None


async def send_all(sock: socket.socket, data: bytes | memoryview, writable: Wait) -> None:
    """Write all of ``data``: at once when the socket takes it, else waiting until it does."""
    view = memoryview(data)
    while view:
        try:
            sent = sock.send(view)
        except BlockingIOError:
            await writable(sock)
            continue
        view = view[sent:]


async def receive(sock: socket.socket, readable: Wait) -> bytes:
    """The next bytes from ``sock`` (``b""``: the peer closed), once some arrive; raises when the connection broke."""
    while True:
        await readable(sock)
        try:
            return sock.recv(READ_SIZE)
        except BlockingIOError:
            continue
