"""Reading a Narwhal journal as it is found on disk (docs/operate.md, "The journal").

The journal is JSON Lines written one record at a time by a process that may
be killed at any moment. :class:`JournalReader` turns its bytes into
:class:`Record` and :class:`Problem` events (pull-based like the core:
``feed`` bytes, drain ``next_event``): a last line without its newline is a
torn write, a complete line that is not a record is reported and skipped, a
record appended right after torn bytes is kept. :func:`read_events` and
:func:`follow_events` do the file I/O. ``narwhal journal``
(:mod:`narwhal.journal_cli`) and the merging of per-worker files
(:mod:`narwhal.journal_set`) both build on this module.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Final, Literal

import attrs

from narwhal_core import wire
from narwhal_core.journal import TERMINALS

__all__ = [
    "MAX_LINE_BYTES", "CHUNK_BYTES", "POLL_SECONDS", "Record", "Problem", "CaughtUp", "Event", "JournalReader",
    "read_events", "follow_events",
]

#: A line longer than this is reported and skipped (records are a few KiB).
MAX_LINE_BYTES: Final = 8 * 1024 * 1024
#: How much is read from the file at a time.
CHUNK_BYTES: Final = 64 * 1024
#: How long ``--follow`` sleeps at the end of the file before looking again.
POLL_SECONDS: Final = 0.2

# Every record the writer makes starts with this: ``to_json`` puts ``ts``
# first and wire.dumps keeps key order. Inside a JSON string a quote is
# always escaped, so these bytes can only open a record.
_RECORD_START: Final = b'{"ts":'
_MAX_RECOVERY_TRIES: Final = 8



@attrs.frozen(kw_only=True)
class Record:
    """One valid journal record, as read."""

    #: 1-based line number in the file (restarts at 1 after truncation or rotation).
    line: int
    #: The record's bytes, newline included, exactly as in the file.
    raw: bytes
    #: Router request ID.
    rid: str
    #: ``None`` for a progress record, else one of :data:`TERMINALS`.
    terminal: str | None
    #: The record's HTTP ``status`` when it is an integer.
    status: int | None
    #: The record's ``ts`` (wall-clock seconds): orders the records of several files.
    ts: float = 0.0


@attrs.frozen(kw_only=True)
class Problem:
    """Something about the file worth telling the operator on stderr."""

    #: What happened, without the ``narwhal journal:`` prefix.
    message: str
    #: ``bad``: a complete line was skipped or damaged (fails ``--strict``);
    #: ``torn``: the last line lacks its newline (a crash, or a write in
    #: progress); ``info``: the file was truncated or replaced.
    kind: Literal["bad", "torn", "info"]
    #: The line concerned, when there is one.
    line: int | None = None


@attrs.frozen(kw_only=True)
class CaughtUp:
    """``--follow`` reached the current end of the file and is about to wait."""


Event = Record | Problem



class JournalReader:
    """Turns journal bytes into :class:`Record` and :class:`Problem` events.

    ``feed`` buffers bytes, ``next_event`` returns the next event or ``None``
    when it needs more bytes; ``end_of_input`` says the bytes stopped (and
    reports a torn last line), ``restart`` that the file was truncated or
    replaced. Memory is bounded by one chunk plus ``max_line``.
    """

    def __init__(self, *, max_line: int = MAX_LINE_BYTES) -> None:
        if max_line < 1:
            raise ValueError("max_line must be positive")
        self._max_line = max_line
        self._buf = bytearray()
        self._start = 0  # where the pending line begins in _buf
        self._scan = 0  # where to look for the next newline
        self._line = 0  # number of the last line started
        self._discarding = False  # inside an over-long line: drop to its newline
        self._out: collections.deque[Event] = collections.deque()

    @property
    def pending(self) -> int:
        """How many bytes of an unfinished line are buffered."""
        return len(self._buf) - self._start

    def feed(self, data: bytes) -> None:
        """Add bytes read from the journal."""
        if self._start:
            del self._buf[: self._start]
            self._scan -= self._start
            self._start = 0
        self._buf += data

    def next_event(self) -> Event | None:
        """The next record or problem, or ``None`` until more bytes are fed."""
        while not self._out:
            newline = self._buf.find(b"\n", self._scan)
            if newline < 0:
                self._scan = len(self._buf)
                if not self._discarding and self.pending > self._max_line:
                    self._line += 1
                    self._too_long()
                    self._discarding = True
                if self._discarding:
                    self._drop_pending()
                return None
            raw = bytes(self._buf[self._start : newline + 1])
            self._start = self._scan = newline + 1
            if self._discarding:
                self._discarding = False
                continue
            self._line += 1
            if len(raw) - 1 > self._max_line:
                self._too_long()
            else:
                self._parse(self._line, raw)
        return self._out.popleft()

    def end_of_input(self) -> Problem | None:
        """The bytes ended: report (and forget) a torn last line, if any."""
        torn = self._torn_tail()
        self._drop_pending()
        self._discarding = False
        return torn

    def restart(self) -> Problem | None:
        """The file was truncated or replaced: forget its tail and number lines from 1."""
        torn = self.end_of_input()
        self._line = 0
        return torn

    def _torn_tail(self) -> Problem | None:
        if self._discarding or not bytes(self._buf[self._start :]).strip():
            return None
        return Problem(
            message=f"line {self._line + 1} is incomplete (torn write?), skipped",
            kind="torn",
            line=self._line + 1,
        )

    def _drop_pending(self) -> None:
        del self._buf[:]
        self._start = self._scan = 0

    def _too_long(self) -> None:
        self._out.append(Problem(
            message=f"line {self._line} is longer than {self._max_line} bytes, skipped",
            kind="bad",
            line=self._line,
        ))

    def _parse(self, number: int, raw: bytes) -> None:
        if not raw.strip():
            return  # a blank line holds nothing to skip
        try:
            value = wire.loads(raw)
        except (wire.JsonError, RecursionError) as exc:
            if self._recover(number, raw):
                return
            reason = "not valid UTF-8" if "UTF-8" in str(exc) else str(exc)
            self._bad(number, f"is not valid JSON ({reason})")
            return
        record = _record(number, raw, value)
        if isinstance(record, str):
            self._bad(number, record)
        else:
            self._out.append(record)

    def _recover(self, number: int, raw: bytes) -> bool:
        # A writer killed mid-line and restarted appends its next record
        # right after the torn bytes: keep that record.
        at = raw.find(_RECORD_START, 1)
        for _ in range(_MAX_RECOVERY_TRIES):
            if at < 0:
                return False
            tail = raw[at:]
            try:
                record = _record(number, tail, wire.loads(tail))
            except (wire.JsonError, RecursionError):
                record = None
            if isinstance(record, Record):
                self._out.append(Problem(
                    message=(
                        f"line {number} starts with {at} bytes of an incomplete record "
                        "(torn write?); kept the record after them"
                    ),
                    kind="bad",
                    line=number,
                ))
                self._out.append(record)
                return True
            at = raw.find(_RECORD_START, at + 1)
        return False

    def _bad(self, number: int, what: str) -> None:
        self._out.append(Problem(message=f"line {number} {what}, skipped", kind="bad", line=number))


def _record(number: int, raw: bytes, value: Any) -> Record | str:
    """The record a decoded line holds, or why it is not a journal record."""
    if not isinstance(value, dict):
        return "is not a JSON object"
    rid = value.get("rid")
    if not isinstance(rid, str):
        return 'is not a journal record (no string "rid")'
    ts = value.get("ts")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        return 'is not a journal record (no numeric "ts")'
    if "terminal" not in value:
        return 'is not a journal record (no "terminal")'
    terminal = value["terminal"]
    if terminal is not None and (not isinstance(terminal, str) or terminal not in TERMINALS):
        shown = wire.dumps(terminal).decode("utf-8", "replace")
        if len(shown) > 40:
            shown = shown[:37] + "..."
        return f"is not a journal record (unknown terminal {shown})"
    status = value.get("status")
    if isinstance(status, bool) or not isinstance(status, int):
        status = None
    return Record(line=number, raw=raw, rid=rid, terminal=terminal, status=status, ts=float(ts))




def _drain(reader: JournalReader) -> Iterator[Event]:
    while (event := reader.next_event()) is not None:
        yield event


def read_events(
    stream: BinaryIO, *, chunk_size: int = CHUNK_BYTES, max_line: int = MAX_LINE_BYTES
) -> Iterator[Event]:
    """Every record and problem in a byte stream, to its end."""
    reader = JournalReader(max_line=max_line)
    read = getattr(stream, "read1", stream.read)  # a pipe yields what it has
    while chunk := read(chunk_size):
        reader.feed(chunk)
        yield from _drain(reader)
    if (torn := reader.end_of_input()) is not None:
        yield torn


def follow_events(
    path: str | os.PathLike[str],
    *,
    stop: Callable[[], bool] = lambda: False,
    poll_seconds: float = POLL_SECONDS,
    sleep: Callable[[float], None] = time.sleep,
    chunk_size: int = CHUNK_BYTES,
    max_line: int = MAX_LINE_BYTES,
) -> Iterator[Event | CaughtUp]:
    """Like ``tail -f``: every record and problem in the file, then those appended.

    At the end of the file it yields :class:`CaughtUp`, asks ``stop()`` and
    sleeps ``poll_seconds``; a torn last line waits for its newline. When the
    file shrinks it is read again from the start; when ``path`` names a new
    file (rotation) the old one is read to its end and the new one opened.
    Opening ``path`` may raise :class:`OSError`. When ``stop()`` says so, a
    still-torn last line is reported and the iteration ends.
    """
    reader = JournalReader(max_line=max_line)
    file = open(path, "rb")  # noqa: SIM115 - closed in finally, across yields
    try:
        while True:
            while chunk := file.read(chunk_size):
                reader.feed(chunk)
                yield from _drain(reader)
            yield CaughtUp()
            if stop():
                break
            change = _file_change(file, path)
            if change is None:
                sleep(poll_seconds)
                continue
            if change == "replaced":
                try:
                    new_file = open(path, "rb")  # noqa: SIM115
                except OSError:
                    sleep(poll_seconds)  # renamed away, not yet recreated
                    continue
                # Whatever the writer put in the old file before it moved on.
                while chunk := file.read(chunk_size):
                    reader.feed(chunk)
                    yield from _drain(reader)
                file.close()
                file = new_file
            else:
                file.seek(0)
            if (torn := reader.restart()) is not None:
                yield torn
            yield Problem(message=f"{os.fsdecode(path)} was {change}; reading it from the start",
                          kind="info")
    finally:
        file.close()
    if (torn := reader.end_of_input()) is not None:
        yield torn


def _file_change(file: BinaryIO, path: str | os.PathLike[str]) -> str | None:
    opened = os.fstat(file.fileno())
    try:
        named = os.stat(path)
    except OSError:
        named = opened  # gone for now: keep reading what we have open
    if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
        return "replaced"
    if opened.st_size < file.tell():
        return "truncated"
    return None
