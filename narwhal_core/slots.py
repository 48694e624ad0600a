"""Requests waiting for a free slot on an engine (``engine.max_inflight_per_engine``), oldest first.

A request whose next leg finds no engine of its phase with a free slot
waits here (``PREFILL_WAIT`` or ``DECODE_WAIT``). A leg that ends queues the
follow-up that wakes the oldest one waiting for its phase, which the
router does once the event is handled (docs/design.md, "Follow-up work").
This module only keeps the queues and answers questions about them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

from .ids import DECODE, PREFILL, Phase
from .states import State

if TYPE_CHECKING:
    from .inflight import Request

__all__ = ["SlotQueue"]


class SlotQueue:
    """Requests waiting for a free slot on an engine of a phase, oldest first (docs/operate.md, "KV leases").

    Prefilled requests waiting for a decode engine go first: while one
    waits, no new prefill starts (its KV's lease runs).
    """

    __slots__ = ("waiting", "active")

    def __init__(self, active: Mapping[str, Request]) -> None:
        #: The rids waiting, per phase (a request that moved on is dropped when it comes up).
        self.waiting: Final[dict[str, deque[str]]] = {PREFILL: deque(), DECODE: deque()}
        #: The requests not yet terminal, by rid (the registry's own map, read only).
        self.active: Final = active

    def wait(self, req: Request, phase: Phase) -> None:
        """The request waits for a slot on an engine of ``phase``."""
        req.waiting_for_slot = True
        req.retry_phase = phase
        self.waiting[phase].append(req.rid)

    def next_waiter(self, phase: Phase) -> Request | None:
        """Take the oldest request still waiting for a slot of ``phase`` off its queue (``None``: none waits)."""
        waiters = self.waiting[phase]
        active = self.active
        while waiters:
            req = active.get(waiters.popleft())
            if (
                req is not None
                and req.waiting_for_slot
                and req.retry_phase == phase
                and req.state in (State.PREFILL_WAIT, State.DECODE_WAIT)
            ):
                return req
        return None

    def decode_backlog(self) -> bool:
        """Whether a prefilled request waits for a decode engine's slot (the head of its queue; stale heads dropped)."""
        waiters = self.waiting[DECODE]
        active = self.active
        while waiters:
            req = active.get(waiters[0])
            if (
                req is not None
                and req.waiting_for_slot
                and req.retry_phase == DECODE
                and req.state is State.DECODE_WAIT
            ):
                return True
            waiters.popleft()
        return False
