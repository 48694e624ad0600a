"""``ingress.max_connections``: which client connections hold a slot and which wait for one, sans-IO.

A connection accepted while every slot is held waits, unread, like one in
the kernel's listen backlog (where trio, which accepts only with a slot
free, leaves it); at most ``limit`` wait, a connection beyond them is
refused. A slot frees when Narwhal has closed its connection (a lingering
close holds none) or when the connection is lost; the connection that has
waited longest takes it.
"""

from __future__ import annotations

import enum
from collections import deque
from typing import Generic, TypeVar

__all__ = ["ConnectionSlots", "Admission"]

T = TypeVar("T")


class Admission(enum.Enum):
    """What becomes of a connection just accepted."""

    #: It holds a slot: serve it.
    ADMITTED = "admitted"
    #: Every slot is held: keep it unread until :meth:`ConnectionSlots.next_waiting` admits it.
    WAITING = "waiting"
    #: Too many wait already: close it.
    REFUSED = "refused"


class ConnectionSlots(Generic[T]):
    """The connections holding a slot, and those waiting for one, oldest first."""

    __slots__ = ("limit", "holders", "waiting")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.holders: set[T] = set()
        self.waiting: deque[T] = deque()

    def arrive(self, conn: T) -> Admission:
        """``conn`` was accepted: does it hold a slot, wait for one, or is it refused?"""
        if len(self.holders) < self.limit:
            self.holders.add(conn)
            return Admission.ADMITTED
        if len(self.waiting) >= self.limit:
            return Admission.REFUSED
        self.waiting.append(conn)
        return Admission.WAITING

    def release(self, conn: T) -> None:
        """``conn`` frees its slot: Narwhal closed it, or it was lost."""
        self.holders.discard(conn)

    def withdraw(self, conn: T) -> None:
        """``conn`` was lost while it waited for a slot."""
        try:
            self.waiting.remove(conn)
        except ValueError:
            pass

    def next_waiting(self) -> T | None:
        """The connection that waited longest, now holding the slot that freed; ``None``: none free, or none waits."""
        if self.waiting and len(self.holders) < self.limit:
            conn = self.waiting.popleft()
            self.holders.add(conn)
            return conn
        return None

    def drop_waiting(self) -> list[T]:
        """Every waiting connection, to close (shutting down: none will be served)."""
        waiting = list(self.waiting)
        self.waiting.clear()
        return waiting
