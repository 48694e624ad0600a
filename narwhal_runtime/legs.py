"""The router's leg commands as both adapters carry them out; each adapter's ``Engines`` does the I/O.

A leg starts on an idle pooled connection when there is one (its request
then waits in the pool until the adapter writes it, after the batch's
journal records: :meth:`EngineLegs.write_unsent`), else on a new connection
the adapter opens, attached to the leg at once so that a ``CancelLeg``
finds it while it is still connecting. A cancelled leg's connection is
closed (the engine then aborts the request); a finished leg's goes back to
the pool or is closed, as :class:`~narwhal_runtime.pool.Pool` decides.

An adapter subclasses :class:`EngineLegs` and says how to open
(:meth:`~EngineLegs._open`), and what to do with a connection whose leg
was cancelled (:meth:`~EngineLegs._cancelled`) or finished
(:meth:`~EngineLegs._finished`), and names a connect that failed with
:func:`connect_failure`, so both runtimes report it alike. A new
connection is opened the same way on both (:meth:`EngineLegs.connect`,
with the adapter's ``getaddrinfo`` and its wait for a writable socket): as
a control request's is (:mod:`.control`).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, ClassVar, Generic

from narwhal_core import StartLeg, local_failure
from narwhal_core.events import LegFailure

from .control import TimeLimitExpired, connect_first, resolve
from .pool import C, Pool
from .socket_options import set_up_engine

__all__ = ["EngineLegs", "connect_failure"]


def connect_failure(exc: BaseException) -> LegFailure:
    """Why a leg's new connection could not be opened (what :meth:`EngineLegs.connect` raised): one rule (docs/design.md).

    ``connect_timeout`` means the router's own limit (the leg's
    ``connect_timeout``, ``engine.connect_timeout_s``) ran out
    (:class:`~.control.TimeLimitExpired`), and only that. Any ``OSError`` is
    the engine's ``connect_failed`` -- the kernel's own ``ETIMEDOUT`` too
    (its SYNs went unanswered), a ``TimeoutError`` -- unless Narwhal itself
    was short of descriptors, memory or ports
    (:func:`~narwhal_core.local_failure`): ``local_error``, no verdict on
    the engine.
    """
    if isinstance(exc, TimeLimitExpired):
        return "connect_timeout"
    return "local_error" if local_failure(exc) else "connect_failed"


class EngineLegs(Generic[C]):
    """Start, cancel and finish legs on pooled engine connections (:class:`~.driver.EngineCommands`)."""

    def __init__(self, feed: Any, pool_size: int) -> None:
        #: Where the connections' events go (the adapter's ``Server.feed``).
        self._feed = feed
        self._pool: Pool[C] = Pool(pool_size)
        #: The requests of legs started on pooled connections, waiting for
        #: :meth:`write_unsent` (non-empty: some wait). The pool's own list,
        #: read without a call: an adapter asks once per scheduler batch.
        self.unsent = self._pool.unsent
        #: Closing (:meth:`aclose` began): no leg starts any more, the loop is about to end.
        self._closed = False

    def start_leg(self, cmd: StartLeg) -> None:
        """Queue the leg on an idle pooled connection, or open a new one for it."""
        if self._closed:
            return
        conn = self._pool.take_idle(cmd.engine.url, cmd.leg, cmd.data, cmd.fresh_connection)
        if conn is not None:
            if self._reused is not None:
                self._reused(conn, cmd)
            return
        conn = self._open(cmd)
        self._pool.attach(conn, cmd.leg)

    def cancel_leg(self, key: str) -> None:
        """Stop a leg: closing its connection makes the engine abort the request."""
        conn = self._pool.cancel(key)
        if conn is not None:
            self._cancelled(conn)

    def finish_leg(self, key: str, reusable: bool) -> None:
        """The answer is complete: its connection goes back to the pool (read on while idle), or is closed."""
        finished = self._pool.finish(key, reusable)
        if finished is not None:
            conn, kept = finished  # (unpacked here: a call with *args takes a slower path)
            self._finished(conn, kept)

    async def connect(self, host: str, port: int, timeout: float) -> socket.socket:
        """A socket connected to an engine: the name resolved once, its addresses tried in turn, the engine's options set.

        (:func:`~.control.resolve`, :func:`~.control.connect_first`,
        :func:`~.socket_options.set_up_engine`.) All within ``timeout``, the
        leg's ``connect_timeout``, which the addresses share; raises
        :class:`~.control.TimeLimitExpired` when it runs out, else
        ``OSError`` (named by :func:`connect_failure`).
        """
        async with self.time_limit(timeout):
            infos = await resolve(host, port, self.getaddrinfo)
            sock = await connect_first(infos, self.writable, self.time_limit, timeout)
        set_up_engine(sock)
        return sock

    # what the adapter does

    async def getaddrinfo(self, host: str, port: int, *, type: int) -> Sequence[Any]:
        """The runtime's ``getaddrinfo`` (in its resolver thread)."""
        raise NotImplementedError

    async def writable(self, sock: socket.socket) -> None:
        """Return once ``sock`` is writable (or its connect ended): :class:`~.socket_io.SocketWaits`."""
        raise NotImplementedError

    def time_limit(self, seconds: float) -> AbstractAsyncContextManager[object]:
        """A limit of ``seconds`` from now on what runs inside; raises :class:`~.control.TimeLimitExpired`."""
        raise NotImplementedError

    def write_unsent(self) -> object:
        """Write the requests of legs started on pooled connections since the last call."""
        raise NotImplementedError

    def _open(self, cmd: StartLeg) -> C:
        """A new connection for ``cmd``, being opened (it connects and writes ``cmd.data`` in its own time)."""
        raise NotImplementedError

    #: What the adapter does when ``conn``, idle until now, carries ``cmd``'s
    #: leg (its request waits in the pool): ``_reused(conn, cmd)``; ``None``:
    #: nothing (no call per leg for nothing).
    _reused: ClassVar[Callable[[Any, Any, StartLeg], None] | None] = None

    def _cancelled(self, conn: C) -> None:
        """``conn``'s leg was cancelled: close it."""
        raise NotImplementedError

    def _finished(self, conn: C, kept: bool) -> None:
        """``conn``'s leg is complete: it went back to the pool (``kept``) or must be closed."""
        raise NotImplementedError
