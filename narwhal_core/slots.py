"""Requests waiting for a free slot on an engine (``engine.max_inflight_per_engine``), oldest first.

A request whose next leg finds no engine of its phase with a free slot
waits here (``PREFILL_WAIT`` or ``DECODE_WAIT``); each leg that ends wakes
the oldest one waiting for its phase (its ``WAKE`` input).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Final

from .ids import DECODE, PREFILL, Phase
from .states import Input, State

if TYPE_CHECKING:
    from .context import Context
    from .lifecycle import Lifecycle
    from .requests import Request, Requests

__all__ = ["SlotQueue"]


class SlotQueue:
    """Requests waiting for a free slot on an engine of a phase, oldest first (docs/operate.md, "KV leases").

    Prefilled requests waiting for a decode engine go first: while one
    waits, no new prefill starts (its KV's lease runs).
    """

    __slots__ = ("ctx", "waiting", "requests", "lifecycle")

    def __init__(self, ctx: Context) -> None:
        self.ctx: Final = ctx
        self.waiting: Final[dict[str, deque[str]]] = {PREFILL: deque(), DECODE: deque()}

    def connect(self, *, requests: Requests, lifecycle: Lifecycle) -> None:
        """The parts this one calls."""
        self.requests = requests
        self.lifecycle = lifecycle

    def wait(self, req: Request, phase: Phase) -> None:
        """The request waits for a slot on an engine of ``phase``."""
        req.waiting_for_slot = True
        req.retry_phase = phase
        self.waiting[phase].append(req.rid)

    def wake(self, phase: Phase) -> None:
        """A slot freed up on an engine of ``phase``: the oldest request waiting for one takes it."""
        waiters = self.waiting[phase]
        if phase == PREFILL and self.ctx.pd and self.decode_backlog():
            return  # prefilled requests waiting for a decode engine go first
        active = self.requests.active
        while waiters:
            req = active.get(waiters.popleft())
            if (
                req is not None
                and req.waiting_for_slot
                and req.retry_phase == phase
                and req.state in (State.PREFILL_WAIT, State.DECODE_WAIT)
            ):
                self.lifecycle.fire(req, Input.WAKE)
                leg = req.leg
                if (leg is not None and leg.phase == phase) or (req.waiting_for_slot and req.retry_phase == phase):
                    break  # it took the slot (or found none)
                # It went elsewhere (its KV's lease ran short: prefilled again): the slot is still free.
        if phase == DECODE and self.waiting[PREFILL]:
            self.wake_prefills()

    def decode_backlog(self) -> bool:
        """Whether a prefilled request waits for a decode engine's slot (the head of its queue; stale heads dropped)."""
        waiters = self.waiting[DECODE]
        active = self.requests.active
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

    def wake_prefills(self) -> None:
        """Start the prefills held back behind the decode backlog, as many as the prefill engines take."""
        waiters = self.waiting[PREFILL]
        for _ in range(len(waiters)):
            if not waiters or (self.ctx.pd and self.decode_backlog()) or not self.ctx.fleet.has_room(PREFILL):
                return
            self.wake(PREFILL)
