"""The journal file on asyncio: writes are synchronous, ``interval`` fsyncs run in the default executor."""

from __future__ import annotations

import asyncio

from narwhal_runtime.journal_writer import JournalWriter

__all__ = ["JournalFile"]


class JournalFile:
    """A :class:`JournalWriter` plus the timer task that fsyncs it every ``interval``."""

    def __init__(self, path: str, fsync: str, interval: float) -> None:
        self.writer = JournalWriter(path, fsync)
        self._interval = interval
        #: The fsync running in a worker thread, if any: closing waits for it,
        #: so the descriptor is never closed under a running fsync.
        self._fsync: asyncio.Future[None] | None = None

    def write(self, line: bytes) -> bool:
        """Append one record now (one ``write(2)``); return whether the journal is healthy."""
        return self.writer.write(line)

    async def run_sync_timer(self) -> None:
        """Every interval: retry failed writes here, fsync in a worker thread."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._interval)
            self.writer.retry()
            fsync = self._fsync = loop.run_in_executor(None, self.writer.fsync_now)
            # Shielded: a cancelled timer leaves the fsync running for aclose to await.
            await asyncio.shield(fsync)
            self._fsync = None

    async def aclose(self) -> None:
        """Flush, fsync and close (at shutdown)."""
        if self._fsync is not None:
            await asyncio.wait([self._fsync])
            self._fsync = None
        self.writer.close()
