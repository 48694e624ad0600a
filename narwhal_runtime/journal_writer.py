"""The journal file: JSON Lines appended with ``write(2)`` of whole lines (docs/operate.md).

The file is opened for appending without a user-space buffer: what
:meth:`JournalWriter.write` (one record) or :meth:`JournalWriter.write_lines`
(the records of one event-loop iteration, in one ``write(2)``) is given is in
the file when the call returns, and a crash can tear at most the last line.
When each runtime calls them is its business, within this guarantee: every
record is in the file before the loop waits for I/O again, and before any
socket bytes the router produced after it (the answer or the leg the record
describes). ``fsync`` follows ``journal.fsync``: ``always`` after every
write, ``interval`` from the runtime's timer (:meth:`JournalWriter.fsync_now`,
which may run in a worker thread), ``never`` leaves it to the OS.

A failed write (full disk, I/O error) keeps the line in a pending buffer
that is retried before the next record and on every :meth:`sync`, so order
is kept and nothing is dropped while the buffer holds; the runtime reports
the failure to the router, which makes ``/ready`` answer 503. Only past
:data:`MAX_PENDING_BYTES` are records dropped, counted and logged.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from typing import Final

from .log import log_event

__all__ = ["JournalWriter", "MAX_PENDING_BYTES"]

MAX_PENDING_BYTES: Final = 64 * 1024 * 1024


class _ShortWrite(Exception):
    def __init__(self, error: OSError, rest: bytes) -> None:
        super().__init__(error)
        self.error = error
        self.rest = rest


class JournalWriter:
    """Appends journal lines to ``path`` (``"-"`` = standard output)."""

    def __init__(self, path: str, fsync: str = "interval") -> None:
        self.path = path
        self.fsync = fsync
        if path == "-":
            self._fd = sys.stdout.fileno()
            self._owned = False
        else:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            self._owned = True
        self._pending: deque[bytes] = deque()
        self._pending_bytes = 0
        self._dirty = False
        #: Records dropped because the pending buffer was full.
        self.dropped = 0
        #: Records written.
        self.written = 0
        #: The last write error, ``None`` once writes succeed again.
        self.error: str | None = None

    @property
    def ok(self) -> bool:
        """Whether every record so far reached the file."""
        return self.error is None

    def write(self, line: bytes) -> bool:
        """Append one record; return whether the journal is healthy afterwards."""
        return self.write_lines([line])

    def write_lines(self, lines: list[bytes]) -> bool:
        """Append several records (whole lines) with one ``write(2)``; return whether the journal is healthy."""
        data = lines[0] if len(lines) == 1 else b"".join(lines)
        if self._pending:
            self._enqueue(data)
            self._retry()
            return self.ok
        # The first write(2) here, not in _write_all: it nearly always takes
        # the whole batch, and this runs once per flush (a call costs).
        try:
            n = os.write(self._fd, data)
        except OSError as exc:
            self._failed(exc)
            self._enqueue(data)
            return False
        if n < len(data):
            try:
                self._write_all(memoryview(data)[n:])
            except _ShortWrite as short:
                self._failed(short.error)
                self._enqueue(short.rest)
                return False
        self.written += len(lines)
        if self.fsync == "always":
            self._fsync()
        else:
            self._dirty = True
        return True

    def retry(self) -> bool:
        """Retry records a failed write left pending (call from the event-loop thread)."""
        if self._pending:
            self._retry()
        return self.ok

    def fsync_now(self) -> None:
        """Fsync if anything was written since the last fsync (safe from a worker thread)."""
        if self._dirty and self.fsync != "never":
            self._fsync()

    def sync(self) -> bool:
        """:meth:`retry` then :meth:`fsync_now`, in one thread."""
        self.retry()
        self.fsync_now()
        return self.ok

    def close(self) -> None:
        """Flush what can be flushed, fsync (unless ``never``) and close."""
        self.sync()
        if self.fsync == "never" and self._dirty and self._owned:
            # Shutdown still asks the OS to persist what we wrote.
            self._fsync()
        if self._pending:
            log_event("journal_unwritten", level="error", records=len(self._pending), path=self.path)
        if self._owned:
            os.close(self._fd)
            self._owned = False

    def _write_all(self, data: bytes | memoryview) -> None:
        # A write cut short by a full disk must resume where it stopped, or
        # the retried line would be glued to its own first half.
        view = memoryview(data)
        while view:
            try:
                n = os.write(self._fd, view)
            except OSError as exc:
                raise _ShortWrite(exc, bytes(view)) from None
            view = view[n:]

    def _enqueue(self, line: bytes) -> None:
        if self._pending_bytes + len(line) > MAX_PENDING_BYTES:
            before = self.dropped
            self.dropped += line.count(b"\n")  # a batch holds several records
            if before == 0 or before // 1000 != self.dropped // 1000:
                log_event("journal_records_dropped", level="error", dropped=self.dropped, path=self.path)
            return
        self._pending.append(line)
        self._pending_bytes += len(line)

    def _retry(self) -> None:
        while self._pending:
            line = self._pending[0]
            try:
                self._write_all(line)
            except _ShortWrite as short:
                self._pending[0] = short.rest
                self._pending_bytes -= len(line) - len(short.rest)
                self._failed(short.error)
                return
            self._pending.popleft()
            self._pending_bytes -= len(line)
            self.written += line.count(b"\n")
            self._dirty = True
        if self.error is not None:
            self.error = None
            log_event("journal_recovered", path=self.path)

    def _fsync(self) -> None:
        # Clear the flag first: a record written during the fsync sets it again.
        self._dirty = False
        try:
            os.fsync(self._fd)
        except OSError as exc:
            if self._owned:  # fsync on a pipe or terminal is meaningless
                self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        message = f"{exc.strerror or exc}"
        if self.error is None:
            log_event("journal_write_failed", level="error", path=self.path, error=message)
        self.error = message
