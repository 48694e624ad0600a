"""The listening sockets, bound the same way on both runtimes, and what an accept failure means.

Plain non-blocking sockets, bound before any event loop is involved: on
every address ``ingress.listen_host`` resolves to, all on one port (with
port 0, the one the first address got), IPv6 sockets IPv6-only, backlog
:data:`BACKLOG`. Each adapter accepts from them with its own loop.
"""

from __future__ import annotations

import errno
import socket

__all__ = ["listening_sockets", "accept_shortage", "BACKLOG", "ACCEPT_RETRY_S"]

#: Listen backlog (the kernel caps it at ``somaxconn``).
BACKLOG = 0xFFFF
#: After an accept failed for want of descriptors or memory: seconds before
#: the next try. Meanwhile the connections already accepted are served.
ACCEPT_RETRY_S = 0.1
_SHORTAGE = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """Bind and listen on every address ``host`` resolves to; raises ``OSError`` (none left open)."""
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
    return sockets


def accept_shortage(exc: OSError) -> bool:
    """``accept`` failed for want of descriptors or memory: stop accepting for :data:`ACCEPT_RETRY_S`."""
    return exc.errno in _SHORTAGE
