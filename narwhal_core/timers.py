"""The router's timers: typed timer objects on one heap (like aioquic's ``get_timer``/``handle_timer``).

Every time limit the router keeps -- a client's read timeout, a leg's time
limit, a request's deadline, a health probe's next round, shutdown's grace
period -- is a :class:`Timer` armed on the one :class:`Timers` heap. The
router asks :meth:`Timers.deadline` when the adapter should next call it and
takes what is due with :meth:`Timers.pop_due`; each timer then calls its
action with its owner. What an action returns is its owner's input for the
lifecycle (a request's timer: the :class:`~narwhal_core.states.Input`; a
leg's: its verdict), or ``None``; the router hands it on.

A timer is cancelled by :meth:`Timer.cancel`, which only marks it (a heap
cannot remove from its middle cheaply): a cancelled timer is skipped when
its time comes, and the heap drops cancelled timers in one pass once it has
grown to four times its live size. Cancelling also drops the timer's owner,
so that a finished request or leg is not kept alive until its timer's time.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any, Final

__all__ = ["Timer", "Timers"]

#: Below this many entries the heap is never compacted.
_MIN_COMPACT: Final = 4096


class Timer:
    """One armed time limit: at ``when``, ``action(owner)`` runs, unless cancelled first."""

    __slots__ = ("when", "action", "owner")

    def __init__(self, when: float, action: Callable[[Any], object], owner: Any) -> None:
        self.when = when
        self.action = action
        #: What the action is about; ``None`` once cancelled.
        self.owner = owner

    @property
    def cancelled(self) -> bool:
        """Whether :meth:`cancel` was called (a cancelled timer never fires)."""
        return self.owner is None

    def cancel(self) -> None:
        """Never fire; forget the owner now."""
        self.owner = None


class Timers:
    """One heap of :class:`Timer`, ordered by time, then by the order they were armed."""

    __slots__ = ("_heap", "_seq", "_compact_at")

    def __init__(self) -> None:
        #: ``(when, seq, timer)``: the tuple compares by time, then by arming
        #: order (``seq`` is unique, so the timers themselves are never compared).
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self._compact_at = _MIN_COMPACT

    def __len__(self) -> int:
        """Entries on the heap, cancelled ones not yet dropped included."""
        return len(self._heap)

    def arm(self, when: float, action: Callable[[Any], object], owner: Any) -> Timer:
        """A new timer calling ``action(owner)`` at ``when``; ``owner`` must not be ``None``."""
        timer = Timer(when, action, owner)
        self._seq += 1
        heap = self._heap
        heapq.heappush(heap, (when, self._seq, timer))
        if len(heap) > self._compact_at:
            heap[:] = [entry for entry in heap if entry[2].owner is not None]
            heapq.heapify(heap)
            self._compact_at = max(_MIN_COMPACT, 4 * len(heap))
        return timer

    def deadline(self) -> float | None:
        """When the earliest live timer is due, or ``None`` when none is armed."""
        heap = self._heap
        while heap and heap[0][2].owner is None:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def pop_due(self, now: float) -> Timer | None:
        """Take the earliest live timer due at ``now``, or ``None`` when none is.

        One at a time: a timer's action may arm another one already due,
        which the next call returns.
        """
        heap = self._heap
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            if timer.owner is not None:
                return timer
        return None
