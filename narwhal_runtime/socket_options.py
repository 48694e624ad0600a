"""The options each connected socket gets, by kind: one table, set by both adapters, never left to the runtime.

Left to themselves the runtimes differ: trio's ``SocketStream`` turns on
``TCP_NODELAY`` and sets ``TCP_NOTSENT_LOWAT`` to 16 KiB; asyncio's and
uvloop's TCP transports turn on ``TCP_NODELAY`` only; a socket connected
by hand (:func:`.socket_io.connect`) gets neither. So each adapter calls
:func:`set_up_client` on every socket it accepts, before the first read,
whatever its runtime set before, and the connect both runtimes share
(:meth:`.leg_connections.Engines.connect`, :func:`.control.run_control`) calls
:func:`set_up_engine` on every engine connection (a leg's or a control
request's) before the runtime sees it: the same options on the same kind
of socket on both runtimes.
Both cost a few system calls per connection, none per request.

=============== ================= =========================================
socket          ``TCP_NODELAY``   ``TCP_NOTSENT_LOWAT``
=============== ================= =========================================
client          on                :data:`CLIENT_NOTSENT_LOWAT` (16 KiB)
engine          on                0: the system's default (no bound on Linux)
listening       (bound by :func:`~.listening.listening_sockets`, the same on both)
=============== ================= =========================================

``TCP_NODELAY``: the router writes whole answers and whole stream events;
waiting to merge them with bytes that will not come would only delay them.

``TCP_NOTSENT_LOWAT`` on a client socket: the kernel takes at most about
16 KiB that the client has not yet been sent, instead of a send buffer
that grows to megabytes. For a relay of streams that keeps a client that
does not read visible to the router soon -- its bytes wait in the router,
which stops reading the engine legs feeding that client and starts its
``ingress.send_timeout_s`` (docs/operate.md, "Slow clients") -- instead of
hidden in the kernel while the engine goes on generating. The value is
trio's own default, which the trio runtime always had. On an engine socket
the router only writes requests whose bytes it already holds; nothing is
relayed through it, so nothing needs bounding, and a long prompt goes to
the kernel in one write rather than one wake-up per 16 KiB.
"""

from __future__ import annotations

import socket
from typing import Final, Protocol

__all__ = ["set_up_client", "set_up_engine", "CLIENT_OPTIONS", "ENGINE_OPTIONS", "CLIENT_NOTSENT_LOWAT", "READ_SIZE"]

#: Bytes written to a client that may wait unsent in its socket's kernel buffer, at most.
CLIENT_NOTSENT_LOWAT: Final = 2**14

#: Bytes asked of the kernel per read (every connection reads its socket itself, on both runtimes).
READ_SIZE: Final = 65536

_LOWAT = getattr(socket, "TCP_NOTSENT_LOWAT", None)  # Linux and macOS have it

#: ``(level, option, value)`` set on each socket of a kind, in order.
CLIENT_OPTIONS: Final[tuple[tuple[int, int, int], ...]] = (
    (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
    *(((socket.IPPROTO_TCP, _LOWAT, CLIENT_NOTSENT_LOWAT),) if _LOWAT is not None else ()),
)
ENGINE_OPTIONS: Final[tuple[tuple[int, int, int], ...]] = (
    (socket.IPPROTO_TCP, socket.TCP_NODELAY, 1),
    *(((socket.IPPROTO_TCP, _LOWAT, 0),) if _LOWAT is not None else ()),
)


class SettableSocket(Protocol):
    """A socket, or a runtime's wrapper of one (trio's, asyncio's ``TransportSocket``, uvloop's)."""

    def setsockopt(self, level: int, option: int, value: int, /) -> None: ...


def set_up_client(sock: socket.socket) -> None:
    """An accepted client socket: non-blocking, with :data:`CLIENT_OPTIONS`."""
    sock.setblocking(False)
    _set(sock, CLIENT_OPTIONS)


def set_up_engine(sock: SettableSocket) -> None:
    """A new engine connection (a leg's or a control request's), open or opening: :data:`ENGINE_OPTIONS`."""
    _set(sock, ENGINE_OPTIONS)


def _set(sock: SettableSocket, options: tuple[tuple[int, int, int], ...]) -> None:
    try:
        for level, option, value in options:
            sock.setsockopt(level, option, value)
    except OSError:
        pass  # already reset by the peer: its first read or write says so
