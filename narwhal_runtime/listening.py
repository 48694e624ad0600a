"""The listening sockets, bound the same way on both runtimes, and what an accept failure means.

Plain non-blocking sockets, bound before any event loop is involved: on
every address ``ingress.listen_host`` resolves to, all on one port (with
port 0, the one the first address got), IPv6 sockets IPv6-only, backlog
:data:`BACKLOG`. Each adapter accepts from them with its own loop.

With ``ingress.workers`` > 1 every worker binds the same port with
``SO_REUSEPORT`` and the kernel spreads new connections across their
listening sockets. The supervisor picks that port (port 0: the kernel's
choice) by binding the addresses itself with ``SO_REUSEPORT`` *without
listening* (:func:`reserve_port`) and holds them until it exits: a socket
that does not listen gets no connections, yet keeps the port for the
group, also across a worker's restart (docs/operate.md, "Workers").

What a listener decides is the same on both runtimes and kept once, in an
:class:`AcceptGate`: whether it may accept (a connection slot is free,
``ingress.max_connections``), whether a slot given back lets it accept
again, and, when ``accept`` fails (:func:`accept_error`: one rule,
docs/operate.md, "Ingress requirements", "Connections"), until when it
stops. How it accepts is kept once too: the :class:`Listener` runs the
same loop on both runtimes, one task per listening socket, waiting the
way the runtime lends it (:class:`~.runtime_io.RuntimeIO`).
"""

from __future__ import annotations

import errno
import math
import socket
from collections.abc import Callable

from .log import log_event
from .runtime_io import Handle, RuntimeIO
from .socket_options import set_up_client

__all__ = [
    "listening_sockets", "reserve_port", "accept_error", "AcceptGate", "Listener", "BACKLOG",
    "ACCEPT_RETRY_S",
]

#: Listen backlog (the kernel caps it at ``somaxconn``).
BACKLOG = 0xFFFF
#: After an accept failed for a reason of the router's (:func:`accept_error`):
#: seconds before the next try. Meanwhile the connections already accepted are served.
ACCEPT_RETRY_S = 0.1

#: ``accept`` errors that are one pending connection's own fate, not the
#: listening socket's: reset or aborted before it was taken, refused by a
#: firewall rule (``EPERM``), or a network error pending on it, which Linux
#: passes on from ``accept`` (accept(2), "Error handling": retry as for
#: ``EAGAIN``). The same list trio's ``SocketListener`` retries silently.
CONNECTION_ERRNOS: frozenset[int] = frozenset(
    getattr(errno, name) for name in (
        "ECONNABORTED", "ECONNRESET", "EPERM", "EPROTO", "ETIMEDOUT", "ENETDOWN", "ENETUNREACH",
        "EHOSTDOWN", "EHOSTUNREACH", "ENONET", "ENOPROTOOPT", "EOPNOTSUPP", "ENOSR",
        "ESOCKTNOSUPPORT", "EPROTONOSUPPORT",
    ) if hasattr(errno, name)
)
#: ``accept`` errors that say the router is short of descriptors or memory.
SHORTAGE_ERRNOS: frozenset[int] = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def listening_sockets(host: str, port: int, *, reuse_port: bool = False) -> list[socket.socket]:
    """Bind and listen on every address ``host`` resolves to; raises ``OSError`` (none left open).

    ``reuse_port``: set ``SO_REUSEPORT`` (a worker of a group, ``ingress.workers`` > 1).
    """
    return _bound(host, port, reuse_port=reuse_port, listen=True)


def reserve_port(host: str, port: int) -> tuple[list[socket.socket], int]:
    """Bind, without listening, ``SO_REUSEPORT`` sockets on every address of ``host``: the group's port.

    Returns the sockets (close them when the group stops) and the port (with
    ``port`` 0, the one the kernel chose). Raises ``OSError`` like
    :func:`listening_sockets`, so a port another program holds is a start-up
    failure of the supervisor, before any worker starts.
    """
    sockets = _bound(host, port, reuse_port=True, listen=False)
    return sockets, sockets[0].getsockname()[1]


def _bound(host: str, port: int, *, reuse_port: bool, listen: bool) -> list[socket.socket]:
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            if port == 0:  # every address on the one port the first got
                port = sock.getsockname()[1]
            if listen:
                sock.listen(BACKLOG)
                sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def accept_error(exc: OSError) -> float:
    """``accept`` raised ``exc`` (not ``EAGAIN``): seconds to stop accepting from that socket, ``0.0`` for none.

    A connection's own failure (:data:`CONNECTION_ERRNOS`) costs nothing: it
    is dropped without a word and the next one is accepted at once; the
    client saw its connection fail and no slot was taken. Anything else is
    the router's: one ``accept_failed`` log line, then a pause of
    :data:`ACCEPT_RETRY_S` -- a shortage (:data:`SHORTAGE_ERRNOS`) lasts
    until connections close, and an unexpected error may come back at every
    try, where going on at once would spin and flood the log. Both adapters
    call this on the failure branch only; the connections already accepted
    are served meanwhile, and new ones wait in the listen backlog.
    """
    if exc.errno in CONNECTION_ERRNOS:
        return 0.0
    log_event("accept_failed", error=str(exc), shortage=exc.errno in SHORTAGE_ERRNOS)
    return ACCEPT_RETRY_S


class AcceptGate:
    """A listener's decisions over all its sockets: connection slots and the pause after a failed accept.

    ``limit`` (``ingress.max_connections``) slots: an accepted connection
    holds one (:meth:`accepted`) until it gives it back (:meth:`released`).
    While :attr:`full`, the listener accepts nothing, so further connections
    wait in the kernel's listen backlog, and holds no slot while it waits
    for one. A failed accept (:meth:`failed`) may stop accepting on every
    socket until :attr:`resumes`. Times are the caller's clock.
    """

    __slots__ = ("limit", "held", "resumes")

    def __init__(self, limit: int) -> None:
        #: ``ingress.max_connections``, and the slots held now.
        self.limit = limit
        self.held = 0
        #: After a failed accept that asked for a pause: when accepting may resume.
        self.resumes = -math.inf

    @property
    def full(self) -> bool:
        """Every slot is held: accept nothing until one is released."""
        return self.held >= self.limit

    def accepted(self) -> bool:
        """A connection was accepted and holds a slot: whether that was the last (stop accepting)."""
        self.held += 1
        return self.held >= self.limit

    def released(self) -> bool:
        """A connection gave its slot back: whether accepting may go on again (every slot was held)."""
        self.held -= 1
        return self.held == self.limit - 1

    def failed(self, exc: OSError, now: float) -> float:
        """``accept`` raised ``exc`` (not ``EAGAIN``) at ``now``: seconds to stop accepting, ``0.0`` for none.

        The rule is :func:`accept_error`'s; a pause holds every socket until :attr:`resumes`.
        """
        pause = accept_error(exc)
        if pause:
            self.resumes = now + pause
        return pause


#: What gets each accepted connection, with the listener whose slot it holds (``listener.release()`` frees it).
StartClient = Callable[[socket.socket, "Listener"], object]


class Listener:
    """Listening sockets (:func:`listening_sockets`) accepted by hand, the same way on both runtimes.

    Not by the runtime's own accept loop: CPython 3.11's ``create_server``
    answers ``EMFILE`` by logging a traceback and retrying for each of its
    ``backlog`` tries per wake-up (a router out of descriptors spends its
    time there), and trio's ``SocketListener`` drops a set of errors
    silently and hands the rest to its caller. Here one :class:`AcceptGate`
    decides, and each accepted socket is set up by one rule
    (:func:`~.socket_options.set_up_client`). :meth:`start` runs
    :meth:`accept` in a task per socket; :meth:`close` cancels them.
    """

    def __init__(self, sockets: list[socket.socket], *, limit: int, io: RuntimeIO) -> None:
        self.sockets = sockets
        self.gate = AcceptGate(limit)
        self._io = io
        #: Set when a slot is given back while every slot was held (then a new one waits for the next).
        self._slot_freed = io.event()
        self._accepting: list[Handle] = []
        self._closed = False

    def start(self, start_client: StartClient) -> None:
        """Accept from every socket, each in a task of its own, until :meth:`close`."""
        self._accepting = [self._io.spawn(self.accept, sock, start_client) for sock in self.sockets]

    def release(self) -> None:
        """A connection accepted here no longer holds a slot: accept again if that was the limit."""
        if self.gate.released():
            freed, self._slot_freed = self._slot_freed, self._io.event()
            freed.set()

    def close(self) -> None:
        """Stop accepting, and close the sockets (connections already accepted go on)."""
        self._closed = True
        for task in self._accepting:
            task.cancel()
        for sock in self.sockets:
            self._io.close_socket(sock)

    async def accept(self, listening: socket.socket, start_client: StartClient) -> None:
        """Accept from ``listening`` until cancelled; ``start_client(sock, self)`` gets each connection, holding its slot."""
        gate, waits = self.gate, self._io
        while True:
            await waits.checkpoint()  # a scheduling point per try: accepting never starves the connections
            if gate.full:
                await self._slot_freed.wait()  # holding no slot: another socket may take the one freed first
                continue
            if gate.resumes > waits.now():
                await waits.sleep_until(gate.resumes)
                continue
            try:
                sock, _ = listening.accept()
            except BlockingIOError:
                await waits.readable(listening)
                continue
            except OSError as exc:
                if self._closed:
                    return  # closed while this task was about to run: not a failure
                gate.failed(exc, waits.now())
                continue
            gate.accepted()
            set_up_client(sock)
            start_client(sock, self)
