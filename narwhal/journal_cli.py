"""``narwhal journal``: read a Narwhal journal (docs/operate.md, "The journal").

The journal is JSON Lines written one record at a time by a process that may
be killed at any moment, so this reader takes the file as it finds it:

* A last line without its newline is a *torn write*: it is reported on
  stderr and skipped; with ``--follow`` it waits for its newline instead.
* A complete line that is not a journal record (not JSON, not an object,
  no ``rid``...) is reported with its line number and skipped. When a
  restarted writer appended a whole record right after a torn one, the
  record after the torn bytes is kept.
* Nothing is held in memory per line read: the file is streamed in chunks,
  and only ``--unfinished`` / ``--summary`` keep state, one entry per
  request still in flight.
* The per-worker files of ``ingress.workers`` > 1 (``journal.w0.jsonl``...
  next to ``journal.jsonl``) are read as one stream ordered by the records'
  ``ts`` (:mod:`narwhal.journal_set`).

The reading machinery is pull-based like the core (:class:`JournalReader`:
``feed`` bytes, drain ``next_event``); the I/O lives in :func:`read_events`
and :func:`follow_events`, and :func:`main` only wires them to the flags.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO, Final, Literal, TextIO

import attrs

from narwhal_core import wire
from narwhal_core.journal import TERMINALS

__all__ = [
    "MAX_LINE_BYTES",
    "CHUNK_BYTES",
    "POLL_SECONDS",
    "MAX_REPORTS",
    "Record",
    "Problem",
    "CaughtUp",
    "Selection",
    "JournalReader",
    "UnfinishedTracker",
    "Summary",
    "read_events",
    "follow_events",
    "main",
]

#: A line longer than this is reported and skipped (records are a few KiB).
MAX_LINE_BYTES: Final = 8 * 1024 * 1024
#: How much is read from the file at a time.
CHUNK_BYTES: Final = 64 * 1024
#: How long ``--follow`` sleeps at the end of the file before looking again.
POLL_SECONDS: Final = 0.2
#: Problems reported one by one before the rest are only counted.
MAX_REPORTS: Final = 100

_PROG: Final = "narwhal journal"
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


@attrs.frozen(kw_only=True)
class Selection:
    """The ``--rid`` / ``--terminal`` filters; both must match (AND)."""

    #: Only records of this request.
    rid: str | None = None
    #: Only terminal records with this ``terminal`` value.
    terminal: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.terminal is not None and self.terminal not in TERMINALS:
            raise ValueError(
                f"unknown terminal {self.terminal!r} (expected one of {', '.join(TERMINALS)})"
            )

    def matches_rid(self, record: Record) -> bool:
        """Whether the record passes ``--rid``."""
        return self.rid is None or record.rid == self.rid

    def matches(self, record: Record) -> bool:
        """Whether the record passes every filter."""
        if not self.matches_rid(record):
            return False
        return self.terminal is None or record.terminal == self.terminal


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


class UnfinishedTracker:
    """Requests with a progress record and no terminal record yet (``--unfinished``).

    Holds one record per unfinished request, so its memory follows the
    number of requests in flight, not the size of the journal. A progress
    record arriving after its request's terminal record (which the writer
    never does: docs/contract.md, "The journal") opens the request again.
    """

    def __init__(self) -> None:
        # dict order is first appearance; updating a key keeps its place.
        self._last: dict[str, Record] = {}

    def add(self, record: Record) -> None:
        """Account for one record, in file order."""
        if record.terminal is None:
            self._last[record.rid] = record
        else:
            self._last.pop(record.rid, None)

    def __len__(self) -> int:
        return len(self._last)

    def records(self) -> list[Record]:
        """The last record of each unfinished request, by first appearance."""
        return list(self._last.values())


class Summary:
    """Counts for ``--summary``."""

    def __init__(self) -> None:
        self.records = 0
        self.progress = 0
        self.terminal: dict[str, int] = dict.fromkeys(TERMINALS, 0)
        self.status: collections.Counter[int | None] = collections.Counter()

    def add(self, record: Record) -> None:
        """Count one selected record."""
        self.records += 1
        if record.terminal is None:
            self.progress += 1
        else:
            self.terminal[record.terminal] += 1
            self.status[record.status] += 1

    def to_json(self, *, unfinished: int, skipped: int, torn: int) -> dict[str, Any]:
        """The summary as one JSON object; ``status`` counts terminal records only."""
        statuses = sorted(self.status, key=lambda s: (s is None, s or 0))
        return {
            "records": self.records,
            "progress": self.progress,
            "terminal": dict(self.terminal),
            "status": {("null" if s is None else str(s)): self.status[s] for s in statuses},
            "unfinished": unfinished,
            "skipped_lines": skipped,
            "torn_lines": torn,
        }


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


class _Reporter:
    """Problems to stderr, the first :data:`MAX_REPORTS` one by one."""

    def __init__(self, stderr: TextIO) -> None:
        self._stderr = stderr
        self.bad = 0
        self.torn = 0
        self._reported = 0

    def report(self, problem: Problem) -> None:
        if problem.kind == "bad":
            self.bad += 1
        elif problem.kind == "torn":
            self.torn += 1
        if problem.kind == "bad" and self._reported >= MAX_REPORTS:
            if self._reported == MAX_REPORTS:
                self._say("more bad lines follow; only counting them from here")
                self._reported += 1
            return
        if problem.kind == "bad":
            self._reported += 1
        self._say(problem.message)

    def finish(self) -> None:
        if self._reported > MAX_REPORTS:
            self._say(f"{self.bad} bad lines skipped in all")

    def _say(self, message: str) -> None:
        print(f"{_PROG}: {message}", file=self._stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_PROG,
        description="Read a Narwhal journal (JSON Lines): print matching records, one per line.",
    )
    parser.add_argument("file", metavar="FILE", help="the journal file, or - for stdin")
    parser.add_argument("--rid", metavar="ID", help="only records of this router request ID")
    parser.add_argument(
        "--terminal", metavar="T",
        help=f"only terminal records with this terminal value ({', '.join(TERMINALS)})",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--follow", "-f", action="store_true",
        help="keep printing records as they are appended, until interrupted",
    )
    mode.add_argument(
        "--unfinished", action="store_true",
        help="print the last record of each request with no terminal record (after a crash)",
    )
    mode.add_argument(
        "--summary", action="store_true",
        help="print counts by terminal value and status, and unfinished requests, as one JSON object",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit 1 if any complete line had to be skipped",
    )
    # For tests and scripts: end --follow after this many seconds.
    parser.add_argument("--max-seconds", type=float, metavar="S", help=argparse.SUPPRESS)
    return parser


def main(
    argv: list[str],
    *,
    stdin: BinaryIO | None = None,
    stdout: BinaryIO | None = None,
    stderr: TextIO | None = None,
    stop: Callable[[], bool] | None = None,
) -> int:
    """Run ``narwhal journal`` with the arguments after ``journal``; return the exit status.

    Exit status: 0 (also when lines were skipped), 1 with ``--strict`` when a
    complete line was skipped, 2 for a usage error or an unreadable file.
    ``stdin``/``stdout``/``stderr`` default to the process's; ``stop`` ends
    ``--follow`` when it returns true (checked at each end of the file).
    """
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed usage or help
        return exc.code if isinstance(exc.code, int) else 2
    if args.terminal is not None and args.terminal not in TERMINALS:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --terminal must be one of {', '.join(TERMINALS)}, "
              f"not {args.terminal!r}", file=sys.stderr)
        return 2
    if args.terminal is not None and args.unfinished:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --terminal cannot be combined with --unfinished "
              "(an unfinished request has no terminal record)", file=sys.stderr)
        return 2
    if args.max_seconds is not None and args.max_seconds < 0:
        parser.print_usage(sys.stderr)
        print(f"{_PROG}: error: --max-seconds must not be negative", file=sys.stderr)
        return 2

    out = stdout if stdout is not None else sys.stdout.buffer
    err = stderr if stderr is not None else sys.stderr
    selection = Selection(rid=args.rid, terminal=args.terminal)
    reporter = _Reporter(err)
    try:
        _run(args, selection, reporter, out, stdin, stop)
    except OSError as exc:
        if isinstance(exc, BrokenPipeError):
            _silence_stdout(out)
            return 0  # the reader (head, less) has had enough
        # Opening the journal names it; a failed write to stdout does not.
        where = f"{os.fsdecode(exc.filename)}: " if exc.filename is not None else ""
        print(f"{_PROG}: {where}{exc.strerror or exc}", file=err)
        return 2
    except KeyboardInterrupt:
        _flush(out)
        reporter.finish()
        return 0 if args.follow else 130
    reporter.finish()
    return 1 if args.strict and reporter.bad else 0


def _run(
    args: argparse.Namespace,
    selection: Selection,
    reporter: _Reporter,
    out: BinaryIO,
    stdin: BinaryIO | None,
    stop: Callable[[], bool] | None,
) -> None:
    from .journal_set import follow_merged, journal_files, read_merged  # it builds on this module's reader

    events: Iterator[Event | CaughtUp]
    files = [] if args.file == "-" else journal_files(args.file)
    if args.file == "-":
        events = read_events(stdin if stdin is not None else sys.stdin.buffer)
    elif len(files) > 1 or files != [args.file]:  # the per-worker files of ingress.workers > 1
        events = (follow_merged(files, args.file, stop=_stopper(stop, args.max_seconds)) if args.follow
                  else read_merged(files))
    elif args.follow:
        events = follow_events(args.file, stop=_stopper(stop, args.max_seconds))
    else:
        events = _read_file(args.file)

    tracker = UnfinishedTracker() if (args.unfinished or args.summary) else None
    summary = Summary() if args.summary else None
    for event in events:
        if isinstance(event, CaughtUp):
            out.flush()  # --follow: show what we have before waiting
        elif isinstance(event, Problem):
            reporter.report(event)
        else:
            if tracker is not None and selection.matches_rid(event):
                tracker.add(event)
            if not selection.matches(event):
                continue
            if summary is not None:
                summary.add(event)
            elif not args.unfinished:
                out.write(event.raw)
    if args.unfinished and tracker is not None:
        for record in tracker.records():
            out.write(record.raw)
    if summary is not None and tracker is not None:
        body = summary.to_json(unfinished=len(tracker), skipped=reporter.bad, torn=reporter.torn)
        out.write(wire.dumps(body) + b"\n")
    out.flush()


def _read_file(path: str) -> Iterator[Event]:
    # Opened before the first event is asked for, so a missing file fails
    # before anything is printed.
    file = open(path, "rb")  # noqa: SIM115 - closed by the generator below

    def events() -> Iterator[Event]:
        with file:
            yield from read_events(file)

    return events()


def _stopper(stop: Callable[[], bool] | None, max_seconds: float | None) -> Callable[[], bool]:
    if max_seconds is None:
        return stop if stop is not None else (lambda: False)
    deadline = time.monotonic() + max_seconds
    if stop is None:
        return lambda: time.monotonic() >= deadline
    return lambda: stop() or time.monotonic() >= deadline


def _flush(out: BinaryIO) -> None:
    try:
        out.flush()
    except OSError:
        pass


def _silence_stdout(out: BinaryIO) -> None:
    # Python would report the broken pipe again when it flushes stdout at exit.
    if out is sys.stdout.buffer:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
