"""The journal file on trio: writes are synchronous, ``interval`` fsyncs run in a thread."""

from __future__ import annotations

import trio

from narwhal_runtime.journal_writer import JournalWriter

__all__ = ["JournalFile"]


class JournalFile:
    """A :class:`JournalWriter` plus the timer task that fsyncs it every ``interval``."""

    def __init__(self, path: str, fsync: str, interval: float) -> None:
        self.writer = JournalWriter(path, fsync)
        self._interval = interval
        self._lock = trio.Lock()

    def write(self, line: bytes) -> bool:
        """Append one record now (one ``write(2)``); return whether the journal is healthy."""
        return self.writer.write(line)

    async def run_sync_timer(self) -> None:
        """Every interval: retry failed writes here, fsync in a worker thread."""
        while True:
            await trio.sleep(self._interval)
            self.writer.retry()
            async with self._lock:
                await trio.to_thread.run_sync(self.writer.fsync_now)

    async def aclose(self) -> None:
        """Flush, fsync and close (at shutdown)."""
        async with self._lock:
            self.writer.close()
