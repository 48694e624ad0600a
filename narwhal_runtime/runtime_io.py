"""What a runtime lends the code both runtimes share: one object per server, each adapter's ``IO``.

Client connections (:mod:`.client_connections`), engine legs and control
requests (:mod:`.leg_connections`, :mod:`.control`), the socket calls
(:mod:`.socket_io`) and the listener (:mod:`.listening`) are written once.
What they ask of trio or asyncio is all here, in :class:`RuntimeIO`: a
clock and timers, tasks, waits for a socket, and the callbacks that drive a
connection. The adapter's server adds only the driver's timer, when a batch
is performed, and signals (docs/design.md, "The adapters").
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

__all__ = ["Handle", "RuntimeIO"]


class Handle(Protocol):
    """A timer or a task of the runtime's."""

    def cancel(self) -> None: ...


class RuntimeIO(Protocol):
    """Everything the shared connection code asks of a runtime."""

    #: The runtime's own exceptions, beside ``OSError``, that say a connection broke.
    CONTROL_BROKEN: tuple[type[BaseException], ...]

    # -- time

    def now(self) -> float:
        """The runtime's clock, in seconds."""

    def later(self, delay: float, callback: Callable[[], None]) -> Handle:
        """Call ``callback`` in ``delay`` seconds, unless cancelled first."""

    def soon(self, callback: Callable[..., object], *args: Any) -> object:
        """Call ``callback(*args)`` from the loop, soon (not from inside the caller, say a flush that is writing)."""

    async def sleep_until(self, when: float) -> None:
        """Return at ``when``, on :meth:`now`'s clock."""

    async def checkpoint(self) -> None:
        """Let the other tasks run."""

    def event(self) -> Any:
        """A new one-shot event (``set()``, ``await wait()``)."""

    # -- tasks

    def spawn(self, function: Callable[..., Awaitable[object]], *args: Any) -> Handle:
        """Run ``await function(*args)`` in a task of its own, until it returns or is cancelled."""

    async def cancel_tasks(self) -> None:
        """Cancel every task :meth:`spawn` started that has not ended, and wait until they have."""

    # -- sockets a task waits for (connecting, control requests, accepting)

    async def readable(self, sock: socket.socket) -> None:
        """Return once ``sock`` is readable (bytes, EOF or an error; for a listening socket, a connection)."""

    async def writable(self, sock: socket.socket) -> None:
        """Return once ``sock`` is writable (or its connect ended)."""

    def close_socket(self, sock: socket.socket) -> None:
        """Close ``sock``, waking a task that waits on it if the runtime needs telling; nothing if it is closed."""

    async def getaddrinfo(self, host: str, port: int, *, type: int) -> Sequence[Any]:
        """The runtime's ``getaddrinfo`` (in its resolver thread)."""

    def time_limit(self, seconds: float) -> AbstractAsyncContextManager[object]:
        """A limit of ``seconds`` from now on what runs inside; raises :class:`~.control.TimeLimitExpired`."""

    # -- connections the runtime calls when their sockets are ready (client connections, engine legs)

    def read(self, conn: Any, read: bool) -> None:
        """Call ``conn.readable()`` whenever its socket has bytes or EOF (``read``), or no longer.

        Told ``False`` while ``conn.reading`` is still true, it pauses (until
        told ``True`` again); else reading is over.
        """

    def write(self, conn: Any, wait: bool) -> None:
        """Call ``conn.writable()`` whenever its socket can take bytes (``wait``), or no longer."""

    def ended(self, conn: Any) -> None:
        """``conn`` is over: stop watching its socket, and close it."""
