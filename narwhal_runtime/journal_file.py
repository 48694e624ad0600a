"""The journal file as a server holds it, on either runtime: the writer plus its ``interval`` fsync timer.

Writes are synchronous (:class:`~narwhal_runtime.journal_writer.JournalWriter`,
one ``write(2)`` per batch, docs/operate.md); only the ``interval`` fsync
leaves the event-loop thread. The runtime lends two awaitables, ``sleep``
and ``in_thread`` (run a function in a worker thread), and nothing else
differs between trio and asyncio.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

from .journal_writer import JournalWriter

__all__ = ["JournalFile"]


class JournalFile:
    """A :class:`JournalWriter` plus the timer task that fsyncs it every ``interval``."""

    def __init__(self, path: str, fsync: str, interval: float, *, sleep: Callable[[float], Awaitable[object]],
                 in_thread: Callable[[Callable[[], None]], Awaitable[object]]) -> None:
        self.writer = JournalWriter(path, fsync)
        self._interval = interval
        self._sleep = sleep
        self._in_thread = in_thread
        #: Held by the worker thread while it fsyncs: closing waits for it, so
        #: the descriptor is never closed under a running fsync (a cancelled
        #: timer may leave one running).
        self._fsyncing = threading.Lock()
        self._closed = False

    async def run_sync_timer(self) -> None:
        """Every interval: retry failed writes here, fsync in a worker thread."""
        while True:
            await self._sleep(self._interval)
            self.writer.retry()
            await self._in_thread(self._fsync)

    def _fsync(self) -> None:
        with self._fsyncing:
            if not self._closed:
                self.writer.fsync_now()

    async def aclose(self) -> None:
        """Flush, fsync and close (at shutdown)."""
        with self._fsyncing:
            self._closed = True
            self.writer.close()
