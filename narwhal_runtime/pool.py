"""Which engine connection carries which leg, and which wait idle: the pool's decisions, sans-IO.

Legs run on keep-alive HTTP/1.1 connections to the engines. Both adapters
keep them the same way, so the decisions live here once and the adapters
only open, write, read and close sockets:

* **reuse or open**: a leg takes the most recently idled connection to its
  engine that is still open, unless the router asks for a fresh one (it
  does after a pooled connection failed stale, see below); without one the
  adapter opens a new connection, attached to the leg at once so that a
  ``CancelLeg`` finds it while it is still connecting.
* **stale**: the engine may close a pooled connection while it sits idle,
  unseen until the next leg's request is written. A connection that carried
  an earlier leg (``reused``) and ends before a byte of the answer came
  reports ``LegFailed(..., "dropped", reused=True)``: the engine never saw
  the request, and the router may retry it at once on a fresh connection.
* **after the answer**: the router says whether the connection is reusable
  (``FinishLeg``); a reusable one goes back to its engine's idle list unless
  that list already holds ``size`` connections, else it is closed.
* **idle**: an idle connection keeps being read, so that an engine's close
  is noticed at once; bytes or a close on an idle connection make it
  unusable, and it leaves the idle list.

A leg is detached from its connection before its failure is reported: the
router may start the leg again under the same backend ID while it handles
the report. Nothing here reads a clock or touches a socket; the adapters
keep their sockets in subclasses of :class:`PooledConnection`.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from narwhal_core import LegData, LegFailed
from narwhal_core.events import LegFailure

__all__ = ["PooledConnection", "Pool"]


class PooledConnection:
    """What the pool knows of one connection to an engine; an adapter's connection extends it."""

    __slots__ = ("url", "leg", "reused", "got_bytes", "closed")

    def __init__(self, url: str) -> None:
        #: The engine's URL: the idle list it returns to.
        self.url = url
        #: The backend ID of the leg it carries, ``None`` while idle.
        self.leg: str | None = None
        #: It carried an earlier leg (a stale pooled connection can fail unseen by the engine).
        self.reused = False
        #: Some of the current leg's answer arrived.
        self.got_bytes = False
        #: Closed, or closing: by us (cancelled, not reusable, pool full, shutdown) or by the engine.
        self.closed = False


C = TypeVar("C", bound=PooledConnection)


class Pool(Generic[C]):
    """The idle connections per engine URL and the connection of every running leg."""

    __slots__ = ("size", "idle", "legs", "unsent")

    def __init__(self, size: int) -> None:
        #: Most idle connections kept per engine (``engine.pool_connections_per_engine``).
        self.size = size
        self.idle: dict[str, list[C]] = {}
        self.legs: dict[str, C] = {}
        #: Leg requests for pooled connections, not written yet: (connection, leg, request).
        #: (Always this list object: :attr:`.leg_connections.Engines.unsent` reads it.)
        self.unsent: list[tuple[C, str, bytes]] = []

    # a leg starts

    def take_idle(self, url: str, key: str, data: bytes, fresh: bool = False) -> C | None:
        """An idle open connection to ``url``, now carrying leg ``key``; ``None``: open a new one.

        The leg's request ``data`` waits in :attr:`unsent` until the adapter
        writes it (:meth:`take_unsent`, once the loop iteration's journal
        lines are out). Connections closed while idle are dropped on the way
        (the adapter closed them, or saw them close, already).
        """
        idle = None if fresh else self.idle.get(url)
        while idle:
            conn = idle.pop()
            if not conn.closed:
                conn.reused = True
                # attach(conn, key), inlined: this runs for every leg on a pooled connection.
                conn.leg = key
                conn.got_bytes = False
                self.legs[key] = conn
                self.unsent.append((conn, key, data))
                return conn
        return None

    def take_unsent(self) -> list[tuple[C, bytes]]:
        """The leg requests to write now on pooled connections: those queued since the last call still wanted."""
        # A loop, not a list comprehension: that would be one more call per batch (Python 3.11).
        wanted = []
        for conn, key, data in self.unsent:
            # A leg cancelled, or a connection failed, before its request went out: nothing to write.
            if conn.leg == key and not conn.closed:
                wanted.append((conn, data))
        self.unsent.clear()  # emptied, never replaced: Engines.unsent is this list
        return wanted

    def attach(self, conn: C, key: str) -> None:
        """``conn`` carries leg ``key`` from now on (a new connection, even before it is open)."""
        conn.leg = key
        conn.got_bytes = False
        self.legs[key] = conn

    # the router ends a leg

    def cancel(self, key: str) -> C | None:
        """The router cancelled leg ``key``: its connection, to close (the engine then aborts the request)."""
        conn = self.legs.pop(key, None)
        if conn is not None:
            conn.leg = None
        return conn

    def finish(self, key: str, reusable: bool) -> tuple[C, bool] | None:
        """Leg ``key``'s answer is complete: its connection and whether it went back to the idle list.

        A connection not kept must be closed by the adapter. ``None``: no
        such leg (it failed or was cancelled meanwhile).
        """
        conn = self.legs.pop(key, None)
        if conn is None:
            return None
        conn.leg = None
        if reusable and not conn.closed:
            idle = self.idle.get(conn.url)
            if idle is None:
                idle = self.idle[conn.url] = []
            if len(idle) < self.size:
                idle.append(conn)
                return conn, True
        return conn, False

    # what a connection says

    def received(self, conn: C, data: bytes) -> LegData | None:
        """Bytes arrived on ``conn``: the leg's data to feed; ``None``: an idle connection spoke, close it."""
        key = conn.leg
        if key is None:
            self.forget(conn)
            return None
        conn.got_bytes = True
        return LegData(key, data)

    def ended(self, conn: C, *, reset: bool = False) -> LegData | LegFailed | None:
        """The engine closed ``conn`` (``reset``: or it broke): what to feed, if anything.

        A clean close after some of the answer is the answer's end (the
        router decides whether the answer was complete). A reset, or a close
        before any byte on a reused connection, fails the leg as dropped,
        ``reused`` telling the router the engine may never have seen it.
        An idle connection just leaves the idle list.
        """
        key = conn.leg
        if key is None:
            self.forget(conn)
            return None
        if reset or (conn.reused and not conn.got_bytes):
            self._detach(conn, key)
            return LegFailed(key, "dropped", conn.reused)
        return LegData(key, b"")

    def failed(self, conn: C, reason: LegFailure) -> LegFailed | None:
        """``conn``'s leg failed for ``reason`` (connect failure, shutdown): the event, if it still carries one."""
        key = conn.leg
        if key is None:
            return None
        self._detach(conn, key)
        return LegFailed(key, reason)

    def forget(self, conn: C) -> None:
        """``conn`` closed while idle: it leaves its idle list."""
        idle = self.idle.get(conn.url)
        if idle:
            try:
                idle.remove(conn)
            except ValueError:
                pass

    def all_connections(self) -> list[C]:
        """Every connection, idle or carrying a leg, to close at shutdown; the idle lists are emptied."""
        conns = [conn for idle in self.idle.values() for conn in idle]
        self.idle.clear()
        conns.extend(self.legs.values())
        return conns

    def _detach(self, conn: C, key: str) -> None:
        if self.legs.get(key) is conn:
            del self.legs[key]
        conn.leg = None
